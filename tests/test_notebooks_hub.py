"""The first notebook unchanged in a job through the hub (what the main job, ``testbed/demo``, ends with): alice's
JupyterLab on two nodes, the notebook executed in her containerized kernel, one rank per node in her container."""
from __future__ import annotations

import json

import pytest

from demo_notebook import run_first_notebook
from hubclient import Hub

pytestmark = pytest.mark.testbed


def test_first_notebook_trains_across_the_two_nodes_of_alices_job(bed):
    summary, executed = run_first_notebook(Hub(bed), "alice", nodes=2)
    assert summary["where"] == "allocation" and summary["ranks"] == 2 and summary["epochs"] == 4
    ranks = summary["per_rank"]
    assert sorted(r["node"] for r in ranks.values()) == ["node1", "node2"], ranks
    assert all(r["container"] and r["batches"] > 0 for r in ranks.values()), ranks
    assert summary["loss_last_epoch"] < 0.8 * summary["loss_first_epoch"], summary
    book = json.loads(executed.read_text())
    assert not [o for c in book["cells"] for o in c.get("outputs", []) if o.get("output_type") == "error"]
    with open(summary["chart"], "rb") as png:
        assert png.read(8) == b"\x89PNG\r\n\x1a\n"
