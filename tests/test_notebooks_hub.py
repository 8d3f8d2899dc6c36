"""The notebooks unchanged in a job through the hub (the first is what the main job, ``testbed/demo``, ends with):
alice's JupyterLab on two nodes, each notebook executed in her containerized kernel, one rank per node in her
container."""
from __future__ import annotations

import json
import subprocess

import pytest

from demo_notebook import run_notebooks
from hubclient import Hub
from jupyter_hpcdl.batchsystems.scheduler import ENDED, load_scheduler

pytestmark = pytest.mark.testbed


def check_the_first(summary: dict, executed, nodes: list[str]) -> None:
    """What notebook 01 (the main job's, ``testbed/demo``) printed: two ranks on ``nodes`` in the container, the
    loss down, no error, its chart a PNG."""
    assert summary["where"] == "allocation" and summary["ranks"] == 2 and summary["epochs"] == 4, summary
    ranks = summary["per_rank"]
    assert sorted(r["node"] for r in ranks.values()) == sorted(nodes), ranks
    assert all(r["container"] and r["batches"] > 0 for r in ranks.values()), ranks
    assert summary["loss_last_epoch"] < 0.8 * summary["loss_first_epoch"], summary
    book = json.loads(executed.read_text())
    assert not [o for c in book["cells"] for o in c.get("outputs", []) if o.get("output_type") == "error"]
    with open(summary["chart"], "rb") as png:
        assert png.read(8) == b"\x89PNG\r\n\x1a\n"


FIRST = "01-first-training.ipynb"
THE_REST = ["02-your-own-model-and-data.ipynb", "03-scaling.ipynb", "04-checkpoint-resume-rescale.ipynb",
            "05-horovod-script.ipynb", "06-batch-mode.ipynb"]


def check_the_rest(done: dict, sched) -> None:
    """What notebooks 02-06 printed, and that 06's batch run ended by itself (as ``sched``, the adapter, says)."""
    s = {name.split("-", 1)[0]: summary for name, (summary, _) in done.items()}
    assert s["02"]["where"] == "allocation" and s["02"]["history_rows"] == 4 and s["02"]["val_accuracy"] > 0.7, s
    for mode in ("strong", "weak"):
        assert [r["ranks"] for r in s["03"][mode]] == [1, 2] and all(r["throughput"] > 0 for r in s["03"][mode])
    assert s["04"]["weights_match_checkpoint"] and s["04"]["ranks_after_rescale"] == 1
    assert s["04"]["time_left"] is not None and s["04"]["time_left"] > 0, s["04"]  # a job's walltime, this time
    assert s["05"]["exit_codes"] == {"0": 0, "1": 0} and s["05"]["batches_streamed"] > 0
    batch = s["06"]
    assert batch["where"] == "batch" and batch["job_id"].isdigit() and batch["exit_code"] == 0, batch
    assert batch["ranks_seen"] == [0, 1] and batch["epochs"] == 4
    assert batch["loss_last_epoch"] < batch["loss_first_epoch"] and batch["attached_phase"] == "ended"
    listing = subprocess.run(sched.queue_argv(), capture_output=True, text=True, timeout=30, check=True).stdout
    job = sched.parse_queue(listing).get(batch["job_id"])
    assert job is None or job.phase == ENDED, job  # the batch job ended by itself
    for _, executed in done.values():
        book = json.loads(executed.read_text())
        assert not [o for c in book["cells"] for o in c.get("outputs", []) if o.get("output_type") == "error"]


@pytest.mark.timeout(1800)  # six notebooks, each with its own deadline in the kernel
def test_the_notebooks_run_unchanged_in_alices_job(bed):
    """The six notebooks, unchanged, in one server of alice's (two nodes; the first is what the main job runs): the
    ranks on the job's nodes in her container, the batch run in a Slurm job of its own."""
    # (a directory of its own: ~/hpcdl-notebooks is where the panel puts them, in the browser test)
    done = run_notebooks(Hub(bed), "alice", nodes=2, names=[FIRST, *THE_REST], directory="hpcdl-notebooks-slurm")
    check_the_first(*done.pop(FIRST), ["node1", "node2"])
    check_the_rest(done, load_scheduler("slurm"))


@pytest.mark.timeout(1800)
@pytest.mark.stream("rest")  # beside the Slurm tests: its own hub, scheduler and notebook directory
def test_the_notebooks_run_unchanged_in_a_grid_engine_job(bed):
    """The same six notebooks in alice's server on the second hub, whose jobs are Grid Engine's: two nodes (the
    bed's two execution hosts), the batch run a Grid Engine job of two nodes of its own."""
    hub = Hub({"hub_url": bed["sge_hub_url"], "hub_dir": bed["sge_hub_dir"]})
    hub.api("POST", "/hub/api/users/alice")  # 201, or 409 when known
    done = run_notebooks(hub, "alice", nodes=2, names=[FIRST, *THE_REST], directory="hpcdl-notebooks-gridengine")
    check_the_first(*done.pop(FIRST), bed["sge_hosts"])
    check_the_rest(done, load_scheduler("gridengine"))
