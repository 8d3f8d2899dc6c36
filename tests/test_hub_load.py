"""A workshop at once: every attendee of the bed (20 real users, each with the image) spawns through the REST API at
the same moment; every spawn must end ready, or refused with a message that says why, and everything must stop
cleanly with no job left. The hub's latency under this load is a figure of benchmarks/hub_load.py (which this test
runs once), not an assertion here."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import hub_load  # noqa: E402

pytestmark = pytest.mark.testbed


def test_a_workshop_spawning_at_once_all_end_well_and_stop_cleanly(bed):
    users = bed["workshop_users"]
    assert len(users) >= 20
    report = hub_load.run_load(users)
    print({k: v for k, v in vars(report).items() if k != "outcomes"})
    bad = [o for o in report.outcomes if not (o.result == "ready" or o.result == "refused" and o.message)]
    assert not bad, f"spawns that neither became ready nor were refused with a reason: {bad}"
    ready = [o for o in report.outcomes if o.result == "ready"]
    assert len(ready) == len(users), "the bed has room for every attendee: none should be refused"
    assert report.jobs_left == [], f"jobs left after every server was stopped: {report.jobs_left}"
    assert report.api_samples > 10, "the hub's API was not sampled during the load"
    assert report.api_errors == [], f"the hub's API failed during the load: {report.api_errors[:3]}"
