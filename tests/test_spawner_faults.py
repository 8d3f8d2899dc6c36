"""Faults on the bed, with the real hub, proxy, Slurm and jobs: a frozen and a dead controller, a dead node, a job
cancelled outside the hub, the walltime reached, an orphan job — each with a hub restart in the middle. For each:
servers kept or lost, orphan jobs (must be none), how long until the hub knew, and what the user sees; each test
ends with the bed healed as it was. The figures go to $HPCDL_FAULT_REPORT (JSON lines; default in /tmp)."""
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from test_spawner_hub import (KERNEL_REPORT, _user_session, clean, hub, jobs,  # noqa: F401,F811
                              running_blocker, spawn, spawn_running_and_queued)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "testbed"))
import bed as testbed  # noqa: E402
import config  # noqa: E402  (the hub's timing settings on the bed)

pytestmark = pytest.mark.testbed
REPORT = Path(os.environ.get("HPCDL_FAULT_REPORT", "/tmp/hpcdl-fault-report.jsonl"))


def record(fault: str, **figures) -> None:
    line = json.dumps({"fault": fault, **figures})
    print(line)
    with open(REPORT, "a") as f:
        f.write(line + "\n")


@pytest.fixture
def healed():
    """After the test (and before `clean` stops what is left): the controller and every node back, the hub up."""
    yield
    testbed.heal()


def restart_hub() -> float:
    t0 = time.monotonic()
    testbed.hub().stop()
    testbed.hub().start()
    return time.monotonic() - t0


def api_latency(hub, n: int = 5) -> float:
    """The slowest of ``n`` calls of the hub's REST API (seconds)."""
    worst = 0.0
    for _ in range(n):
        t0 = time.monotonic()
        status, _ = hub.api("GET", "/hub/api/users/alice")
        assert status == 200
        worst = max(worst, time.monotonic() - t0)
    return worst


def server_jobs(hub, user: str) -> dict[str, str]:
    """Server name → the job its saved state names (the hub's own record, read with the admin service's token)."""
    servers = hub.api("GET", f"/hub/api/users/{user}?include_stopped_servers=1")[1].get("servers") or {}
    return {name: (s.get("state") or {}).get("job_id", "") for name, s in servers.items()}


def orphans(hub, *users: str) -> list[str]:
    """Jobs of these users in the queue that no server of theirs owns."""
    owned = {job for user in users for job in server_jobs(hub, user).values() if job}
    listed = subprocess.run(["squeue", "-h", "-u", ",".join(users), "-o", "%i"], capture_output=True, text=True).stdout
    return [j for j in listed.split() if j not in owned]


def wait(check, timeout: float, what: str, interval: float = 1.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"{what}: not within {timeout:.0f} s")


def last_end(bed, user: str, name: str = "") -> str:
    page = _user_session(bed, user).get("/hub/spawn" + (f"/{user}/{name}" if name else ""))
    m = re.search(r"Your last server ended: ([^<]*)<", page)
    return m.group(1) if m else ""


def test_an_orphan_job_of_this_hub_is_cancelled_and_the_user_told(bed, hub, alice, clean, healed):
    """A job with this hub's mark that no server owns (as a hub that lost its server leaves behind) is cancelled
    within two sweeps; another hub's job and a job of alice's own are left alone."""
    ours = alice.run("sbatch", "--parsable", "--job-name=jupyterhub-hpcdl", "--comment=jupyterhub-hpcdl:testbed:alice:",
                     "--time=10", "--wrap=sleep 600", check=True).stdout.strip()
    other = alice.run("sbatch", "--parsable", "--job-name=jupyterhub-hpcdl", "--comment=jupyterhub-hpcdl:otherhub:alice:",
                      "--time=10", "--wrap=sleep 600", check=True).stdout.strip()
    own = alice.run("sbatch", "--parsable", "--job-name=jupyterhub-hpcdl", "--time=10", "--wrap=sleep 600",
                    check=True).stdout.strip()  # named like the hub's jobs, but without its mark
    t0 = time.monotonic()
    sweeps = 2 * config.ORPHAN_INTERVAL + config.SCHEDULER_TIMEOUT + 30  # two sweeps, one slow squeue, the queue read
    wait(lambda: ours not in [j[0] for j in jobs("alice")], sweeps, f"orphan job {ours} cancelled by the sweep")
    took = time.monotonic() - t0
    # what alice is told, read before the second orphan's cancellation below replaces it as her last server's end
    told_pattern = rf"job {ours} \((pending|running)\) was found without its server at .* cancelled by the hub"
    wait(lambda: re.search(told_pattern, last_end(bed, "alice")), 30, f"alice told of orphan job {ours}'s end")
    told = last_end(bed, "alice")
    # a later sweep (it cancels a second orphan) leaves the other two alone
    again = alice.run("sbatch", "--parsable", "--job-name=jupyterhub-hpcdl", "--comment=jupyterhub-hpcdl:testbed:alice:",
                      "--time=10", "--wrap=sleep 600", check=True).stdout.strip()
    wait(lambda: again not in [j[0] for j in jobs("alice")], sweeps, f"second orphan job {again} cancelled by a later sweep")
    left = [j[0] for j in jobs("alice")]
    assert other in left, "another hub's job was touched"
    assert own in left, "a job of alice's own without the hub's mark was touched"
    assert re.search(told_pattern, told), told
    subprocess.run(["scancel", other, own], check=True)
    record("orphan job of this hub", orphans_left=0, cancelled_after_s=round(took, 1), user_sees=told)


def test_a_frozen_controller_and_a_hub_restart_keep_a_running_and_a_pending_server(bed, hub, bob, clean, healed):
    blocker = spawn_running_and_queued(hub, bob)
    before = sorted(j[0] for j in jobs("alice"))

    hub_log = testbed.hub().log
    log_from = len(hub_log.read_text(errors="replace"))
    testbed.signal_controller(signal.SIGSTOP)
    t_frozen = time.monotonic()
    restart_s = restart_hub()
    latency = api_latency(hub)
    # the hub checks its servers in the background (each poll waits for the frozen controller's timeout)
    hub.wait_ready("alice", timeout=90)  # raises if the server goes away instead
    assert hub.server("alice", "queued") is not None, "the pending spawn was lost while the controller was frozen"
    hub.wait_routed("alice")
    report = json.loads(hub.run_in_kernel("alice", KERNEL_REPORT))  # the lab works without the scheduler
    assert report["image"] == bed["identity"]
    # the hub's poll of the running server met the frozen controller and kept the server (it says so once)
    kept = re.compile(r"alice: job \d+: .*; the server is kept")
    wait(lambda: kept.search(hub_log.read_text(errors="replace")[log_from:]),
         config.POLL_INTERVAL * 1.1 + config.SCHEDULER_TIMEOUT + 30, f"the hub's poll against the frozen controller "
         f"(a line 'the server is kept' in {hub_log})")
    assert hub.server("alice")["ready"] and hub.server("alice", "queued") is not None
    frozen_for = time.monotonic() - t_frozen

    testbed.signal_controller(signal.SIGCONT)
    subprocess.run(["scancel", blocker], check=True)
    hub.wait_ready("alice", name="queued", timeout=180)
    assert sorted(j[0] for j in jobs("alice")) == before, "a job was lost or submitted twice"
    assert {j[1] for j in jobs("alice")} == {"RUNNING"}
    assert orphans(hub, "alice") == []
    kept = sum(bool((hub.server("alice", name) or {}).get("ready")) for name in ("", "queued"))
    assert kept == 2
    record("controller frozen (SIGSTOP) + hub restart", servers_kept=kept, servers_lost=2 - kept, orphans=0,
           frozen_s=round(frozen_for), hub_restart_s=round(restart_s, 1), hub_api_worst_s=round(latency, 3),
           user_sees="the lab works; the pending spawn's progress says the scheduler is not answering")


@pytest.mark.timing
def test_a_dead_controller_a_stop_meanwhile_and_a_hub_restart_leave_no_orphan(bed, hub, clean, healed):
    spawn(hub, "alice", {"gpus_per_node": 1, "walltime": "00:20:00"})
    spawn(hub, "alice", {"gpus_per_node": 1, "walltime": "00:20:00"}, name="two")
    hub.wait_ready("alice")
    hub.wait_ready("alice", name="two")
    two_job = server_jobs(hub, "alice")["two"]
    assert two_job
    testbed.wait_controller_saved(list(server_jobs(hub, "alice").values()))

    testbed.signal_controller(signal.SIGKILL)
    restart_hub()
    hub.wait_ready("alice", timeout=90)
    hub.wait_ready("alice", name="two", timeout=90)
    hub.wait_routed("alice")
    t0 = time.monotonic()
    hub.stop("alice", "two")  # the hub cannot cancel the job now: it must not hang, and must not forget the job
    stop_s = time.monotonic() - t0
    assert hub.server("alice", "two") is None
    # the spawner's deadline: cancel_timeout, plus an attempt in flight (scheduler_timeout), plus the hub's own stop
    # (the REST call, the proxy's route) and this client's poll for the server to go
    bound = config.CANCEL_TIMEOUT + config.SCHEDULER_TIMEOUT + 20
    assert stop_s < bound, (f"stopping took {stop_s:.0f} s with the controller dead (cancel_timeout "
                            f"{config.CANCEL_TIMEOUT:.0f} s + scheduler_timeout {config.SCHEDULER_TIMEOUT:.0f} s)")

    testbed.controller().start()
    t_back = time.monotonic()
    wait(lambda: two_job not in [j[0] for j in jobs("alice")], 120, f"job {two_job} cancelled once the controller is back")
    cancelled_after = time.monotonic() - t_back
    assert hub.server("alice")["ready"]
    assert json.loads(hub.run_in_kernel("alice", KERNEL_REPORT))["image"] == bed["identity"]
    assert orphans(hub, "alice") == []
    told = last_end(bed, "alice", "two")
    assert f"job {two_job}" in told and "cancelled by the hub" in told, told
    record("controller killed, a server stopped meanwhile, hub restart",
           servers_kept=int(bool(hub.server("alice")["ready"])), servers_lost=0, orphans=len(orphans(hub, "alice")),
           stop_during_outage_s=round(stop_s, 1), orphan_cancelled_after_controller_back_s=round(cancelled_after, 1),
           user_sees=told)


def test_a_dead_node_with_a_server_on_it_ends_the_server_with_why(bed, hub, bob, clean, healed):
    blocker = running_blocker(bob, "node1")
    spawn(hub, "alice", {"gpus_per_node": 1, "walltime": "00:20:00"})
    hub.wait_ready("alice")
    ((job, _, _),) = jobs("alice")
    host = subprocess.run(["squeue", "-h", "-j", job, "-o", "%N"], capture_output=True, text=True).stdout.strip()
    assert host == "node2"

    t0 = time.monotonic()
    testbed.kill_node("node2")
    restart_hub()  # the hub restarts while the node is dead
    hub.wait_gone("alice", timeout=240)
    known_after = time.monotonic() - t0
    subprocess.run(["scancel", blocker], check=True)
    assert jobs("alice") == [] and orphans(hub, "alice") == []
    told = last_end(bed, "alice")
    assert re.search(rf"job {job} ended: NODE_FAIL|job {job} cancelled when the server was stopped", told), told
    record("node's slurmd and job killed + hub restart", servers_kept=0, servers_lost=1, orphans=0,
           hub_knew_after_s=round(known_after), user_sees=told)


def test_a_job_cancelled_while_the_hub_is_down_is_explained(bed, hub, clean, healed):
    spawn(hub, "alice", {"walltime": "00:20:00"})
    hub.wait_ready("alice")
    ((job, _, _),) = jobs("alice")
    testbed.hub().stop()
    subprocess.run(["scancel", job], check=True)
    t0 = time.monotonic()
    testbed.hub().start()
    hub.wait_gone("alice", timeout=60)
    told = last_end(bed, "alice")
    assert f"job {job} ended: CANCELLED" in told, told
    assert orphans(hub, "alice") == []
    record("job cancelled outside the hub while it was down", servers_lost=1, orphans=0,
           hub_knew_after_start_s=round(time.monotonic() - t0, 1), user_sees=told)


def test_the_walltime_reached_while_the_hub_is_down_is_explained(bed, hub, clean, healed):
    spawn(hub, "alice", {"walltime": "00:01:00"})
    hub.wait_ready("alice")
    ((job, _, _),) = jobs("alice")
    testbed.hub().stop()

    def timed_out():
        out = subprocess.run(["scontrol", "--oneliner", "show", "job", job], capture_output=True, text=True).stdout
        return "JobState=TIMEOUT" in out

    wait(timed_out, 180, f"job {job} reaching its walltime", interval=2)
    testbed.hub().start()
    hub.wait_gone("alice", timeout=60)
    told = last_end(bed, "alice")
    assert f"job {job} ended: TIMEOUT" in told, told
    assert orphans(hub, "alice") == []
    record("walltime reached while the hub was down", servers_lost=1, orphans=0, user_sees=told)
