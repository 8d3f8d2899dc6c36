"""The dashboard without a browser: its pure parts, the allocation owner's session report and time left, the
owner's socket on an event loop with Slurm's commands faked (a slow one blocks nothing else), the widget models
driven by their buttons against real local ranks, and the server extension's handler in a real Jupyter server
(authenticated; outside a batch job it says so)."""
import asyncio
import contextlib
import json
import os
import re
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pandas as pd
import psutil
import pytest

from jupyter_hpcdl.job import allocation as allocation_module
from jupyter_hpcdl.commands import run_sync
from jupyter_hpcdl.job.allocation import MAX_SESSIONS, SESSION_KEEP_S, AllocationOwner
from jupyter_hpcdl.job.owner import request
from jupyter_hpcdl.job.ownerapi import handle, session_report
from jupyter_hpcdl.batchsystems.slurm import parse_time_left
from jupyter_hpcdl.jobvalues import gres_count
from jupyter_hpcdl.dashboard.series import (batches_per_epoch, epoch_progress, parse_rank_counts, rank_series,
                                            rank_table_html)
from jupyter_hpcdl.training.metrics import rank_rows

from jupyterserver import running_jupyter


def ask(owner: AllocationOwner, method: str, path: str, body: dict) -> tuple[int, dict]:
    return asyncio.run(handle(owner, method, path, body))


# -- pure parts ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("text, seconds", [("3:58:12", 14292), ("1-02:00:00", 93600), ("12:05", 725), ("0:00", 0),
                                           ("UNLIMITED", None), ("NOT_SET", None), ("", None), ("1:2:3:4", None)])
def test_time_left_from_squeue(text, seconds):
    assert parse_time_left(text) == seconds


@pytest.mark.parametrize("gres, gpus", [("gpu:2", 2), ("gres/gpu:4", 4), ("gres:gpu:tesla:3(IDX:0-2)", 3),
                                        ("gpu:a100-sxm:2", 2), ("gpu:2g.10gb:1", 1), ("gpu:1,gpu:a100:2", 3),
                                        ("N/A", 0), ("", 0), ("gres/mps:100", 0), ("gpu", 0)])
def test_gpus_per_node_from_gres(gres, gpus):
    assert gres_count(gres) == gpus


def test_session_report_keeps_only_known_plain_fields():
    clean = session_report({"id": "k1", "session": "training", "ranks": [
        {"rank": 0, "node": "node1" * 40, "gpu": "0", "container": "userns", "state": "training", "straggler": True,
         "loss": 1, "samples_per_s": float("nan"), "extra": "<script>"}]})
    assert clean == {"id": "k1", "session": "training", "ranks": [
        {"rank": 0, "node": ("node1" * 40)[:64], "gpu": "0", "container": "userns", "state": "training",
         "straggler": True, "loss": 1.0, "samples_per_s": None}]}
    json.dumps(clean, allow_nan=False)  # what the panel gets is strict JSON
    with pytest.raises(ValueError, match="session must be one of"):
        session_report({"session": "rm -rf", "ranks": []})
    for bad_rank in ("0", True):
        with pytest.raises(ValueError, match="whole-number 'rank'"):
            session_report({"session": "idle", "ranks": [{"rank": bad_rank}]})
    with pytest.raises(ValueError, match="plain value"):
        session_report({"session": "idle", "ranks": [{"rank": 0, "loss": [1]}]})


def test_owner_keeps_each_kernels_report_and_refuses_bad_ones():
    owner = AllocationOwner(environ={})
    assert ask(owner, "PUT", "/session", {"id": "a", "session": "idle", "ranks": [{"rank": 0}]})[0] == 200
    assert owner.current_session()["ranks"][0]["rank"] == 0
    status, reply = ask(owner, "PUT", "/session", {"id": "a", "session": "bogus"})
    assert status == 400 and "session must be one of" in reply["message"]
    assert owner.current_session()["session"] == "idle", "a refused report changes nothing"
    owner.report(session_report({"id": "b", "session": "training", "ranks": []}), now=time.time() + 1)
    owner.report(session_report({"id": "a", "session": "none"}))  # kernel a closed its session: b's stays
    assert owner.current_session(now=time.time() + 2) == {"session": "training", "ranks": [], "sessions": 1,
                                                          "message": None}
    assert owner.current_session(now=time.time() + 60)["session"] == "stale", "a silent 'training' is not trusted"
    said = "Stopped before the walltime ends: epoch 7 is checkpointed in /h/c.npz"
    owner.report(session_report({"id": "b", "session": "walltime", "ranks": [], "message": said}),
                 now=time.time() + 3)
    assert owner.current_session(now=time.time() + 4)["message"] == said
    assert owner.current_session(now=time.time() + 90)["session"] == "walltime"
    with pytest.raises(ValueError, match="message must be a string"):
        session_report({"id": "c", "session": "idle", "message": {"html": "<b>"}})
    status, reply = ask(owner, "GET", "/jobs/12345", {})  # the time left of a job it did not submit: refused
    assert status == 400 and "was not submitted through this allocation's owner" in reply["message"]
    outside = ask(owner, "GET", "/allocation", {})[1]
    assert outside["in_job"] is False and "Not in a batch job" in outside["message"]



def test_owner_lists_every_session_newest_first():
    owner, t = AllocationOwner(environ={}), 1_000_000.0
    assert owner.all_sessions(now=t) == []
    owner.report(session_report({"id": "a", "session": "training", "ranks": [{"rank": 0, "node": "node1"}]}), now=t)
    owner.report(session_report({"id": "b", "session": "idle", "ranks": [{"rank": 0}, {"rank": 1}],
                                 "message": "ready"}), now=t + 5)
    listed = owner.all_sessions(now=t + 10)
    assert [s["id"] for s in listed] == ["b", "a"], "the most recently reported first"
    assert listed[0] == {"id": "b", "session": "idle", "ranks": listed[0]["ranks"], "message": "ready",
                         "reported_at": t + 5}
    assert [r["rank"] for r in listed[0]["ranks"]] == [0, 1] and listed[1]["ranks"][0]["node"] == "node1"
    assert listed[1]["message"] is None and listed[1]["session"] == "training"
    newest = owner.current_session(now=t + 10)
    assert (newest["session"], newest["sessions"], newest["message"]) == ("idle", 2, "ready"), "as before: the newest"

    # a silent "training" is stale, in the list as in current_session; other states stay as they were said
    assert [s["session"] for s in owner.all_sessions(now=t + 31)] == ["idle", "stale"]
    assert [s["session"] for s in owner.all_sessions(now=t + 40, stale_after=60)] == ["idle", "training"]

    owner.report(session_report({"id": "a", "session": "training", "ranks": []}), now=t + 20)  # a reports again
    assert [s["id"] for s in owner.all_sessions(now=t + 21)] == ["a", "b"]
    owner.report(session_report({"id": "a", "session": "none"}), now=t + 22)  # kernel a closed its session
    assert [s["id"] for s in owner.all_sessions(now=t + 23)] == ["b"]
    owner.report(session_report({"id": "b", "session": "none"}), now=t + 24)
    assert owner.all_sessions(now=t + 25) == [] and owner.current_session(now=t + 25) == {"session": "none",
                                                                                          "ranks": []}


def test_owner_keeps_a_bounded_number_of_sessions():
    owner, t = AllocationOwner(environ={}), 1_000_000.0
    for i in range(MAX_SESSIONS + 5):  # kernels that never say "none"
        owner.report(session_report({"id": f"k{i}", "session": "idle", "ranks": []}), now=t + i)
    listed = owner.all_sessions(now=t + MAX_SESSIONS + 5)
    assert len(owner.sessions) == len(listed) == MAX_SESSIONS, "the least recently reported are forgotten"
    assert listed[0]["id"] == f"k{MAX_SESSIONS + 4}" and listed[-1]["id"] == "k5"

    # a session silent for longer than SESSION_KEEP_S is no longer listed, and is forgotten at the next report
    late = t + MAX_SESSIONS + 4 + SESSION_KEEP_S + 1
    assert owner.all_sessions(now=late) == [] and owner.current_session(now=late)["session"] == "none"
    owner.report(session_report({"id": "new", "session": "starting", "ranks": []}), now=late)
    assert list(owner.sessions) == ["new"]
    assert [s["id"] for s in owner.all_sessions(now=late)] == ["new"]


# -- the owner on its socket, with Slurm's commands faked --------------------------------------------------------------
#: Scripts for Slurm's commands (``{bin}``: where they are): a two-node job with 29:10 left; sbatch takes
#: $FAKE_SBATCH_SECONDS; srun steps run until stopped, ignoring SIGTERM where $FAKE_SRUN_STUBBORN is set.
FAKE_SLURM = {
    "scontrol": 'case "$1" in --oneliner) echo "JobId=$4 JobState=RUNNING Reason=None ExitCode=0:0" ;; '
                '*) echo node1; echo node2 ;; esac',
    "squeue": 'case "$5" in %L) echo 0:29:10 ;; *) echo "0:29:10|gpu|gpu:1" ;; esac',
    "sbatch": 'echo $$ > {bin}/sbatch.pid; sleep "${{FAKE_SBATCH_SECONDS:-0}}"; echo 4242',
    "scancel": 'echo "$@" >> {bin}/scancel.called',
    "srun": '[ -z "$FAKE_SRUN_STUBBORN" ] || trap "" TERM; echo $$ >> {bin}/srun.pids; sleep 60',
}


@pytest.fixture
def fake_slurm(tmp_path, monkeypatch) -> dict[str, str]:
    """The environment of job 42 whose Slurm commands are :data:`FAKE_SLURM`, first on its PATH; HOME is tmp_path,
    with a batch script in it."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in FAKE_SLURM.items():
        (bin_dir / name).write_text(f"#!/bin/sh\n{body.format(bin=bin_dir)}\n")
        (bin_dir / name).chmod(0o755)
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "job.sbatch").write_text("#!/bin/sh\n")
    return {"PATH": f"{bin_dir}:/usr/bin:/bin", "SLURM_JOB_ID": "42", "SLURM_JOB_NODELIST": "node[1-2]",
            "SLURM_TASKS_PER_NODE": "1(x2)"}


@contextlib.contextmanager
def owner_serving(owner: AllocationOwner, path: Path):
    """The owner's socket as the server extension serves it, on an event loop in a thread of its own (the test's
    thread plays the kernels); yields the socket's path. At the end, what still runs on the loop is cancelled."""
    from jupyter_hpcdl.job.serverext import serve_owner

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    async def start():
        return serve_owner(owner, str(path))

    async def stop(server):
        server.stop()
        rest = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
        for task in rest:
            task.cancel()
        await asyncio.gather(*rest, return_exceptions=True)

    server = asyncio.run_coroutine_threadsafe(start(), loop).result(10)
    try:
        yield str(path)
    finally:
        asyncio.run_coroutine_threadsafe(stop(server), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


def wait_until(condition, what: str, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"not in {timeout} s: {what}"
        time.sleep(0.02)


def group_alive(pgid: int) -> bool:
    """Whether a process of group ``pgid`` still runs (zombies do not count)."""
    for proc in psutil.process_iter(["status"]):
        with contextlib.suppress(OSError):
            if os.getpgid(proc.pid) == pgid and proc.info["status"] != psutil.STATUS_ZOMBIE:
                return True
    return False


def test_owner_describes_every_session_beside_the_newest(fake_slurm):
    owner = AllocationOwner(environ=fake_slurm)
    first = ask(owner, "GET", "/allocation", {})[1]
    assert first["all_sessions"] == [] and first["session"] == "none"
    now = time.time()
    owner.report(session_report({"id": "a", "session": "idle", "ranks": [{"rank": 0}]}), now=now - 2)
    owner.report(session_report({"id": "b", "session": "training", "ranks": [{"rank": 0}, {"rank": 1}]}), now=now)
    body = json.loads(json.dumps(ask(owner, "GET", "/allocation", {})[1]))
    assert body["in_job"] is True and body["job_id"] == "42" and body["time_left_s"] == 29 * 60 + 10
    assert (body["nodes"], body["partition"], body["gpus_per_node"]) == (["node1", "node2"], "gpu", 1)
    assert (body["session"], len(body["ranks"]), body["sessions"]) == ("training", 2, 2), "unchanged: the newest"
    assert [(s["id"], s["session"], len(s["ranks"])) for s in body["all_sessions"]] == [("b", "training", 2),
                                                                                        ("a", "idle", 1)]


def test_owner_says_how_this_nodes_containers_run_without_starting_one(fake_slurm, tmp_path):
    """The panel's "Containers": the site's setting or the node's cached probe, read, never probed."""
    from jupyter_hpcdl.containers.fastpath import Decision, cache_file, cache_key, write_cached

    repo, site = tmp_path / "udocker", tmp_path / "site.json"

    def described(fast_path: str):
        site.write_text(json.dumps({"ContainerSite": {"udocker_dir": str(repo), "fast_path": fast_path}}))
        return ask(AllocationOwner({**fake_slurm, "HPCDL_SITE_CONFIG": str(site)}), "GET", "/allocation", {})[1]

    assert described("auto")["containers"] is None, "no start has probed this node: nothing to say yet"
    assert not repo.exists(), "describing the allocation started or wrote nothing"
    write_cached(cache_file(str(repo)), Decision("userns", "user namespaces work here (probe 0.05 s)", cache_key()))
    assert described("auto")["containers"] == {"mode": "userns", "reason": "user namespaces work here (probe 0.05 s)"}
    assert described("off")["containers"] == {"mode": "P1", "reason": "the site turned the fast path off"}
    write_cached(cache_file(str(repo)), Decision("userns", "probed under another kernel", "old-key"))
    assert described("auto")["containers"] is None, "an answer for another kernel or launcher is not this node's"
    site.write_text("{not json")
    body = ask(AllocationOwner({**fake_slurm, "HPCDL_SITE_CONFIG": str(site)}), "GET", "/allocation", {})[1]
    assert body["in_job"] is True and body["containers"] is None, "a broken site file does not break the panel"


@pytest.mark.timing
@pytest.mark.timeout(60)
def test_a_slow_sbatch_does_not_block_the_lab(fake_slurm, tmp_path):
    owner = AllocationOwner({**fake_slurm, "FAKE_SBATCH_SECONDS": "5"})
    with owner_serving(owner, tmp_path / "job" / "a.sock") as sock, ThreadPoolExecutor(1) as pool:
        submitted = pool.submit(request, sock, "POST", "/jobs", {"batch_file": str(tmp_path / "job.sbatch")})
        wait_until(lambda: (tmp_path / "bin" / "sbatch.pid").exists(), "sbatch started")
        began = time.monotonic()
        described = request(sock, "GET", "/allocation", timeout=10)
        took = time.monotonic() - began
        assert not submitted.done(), "sbatch was still running"
        assert took < 2, f"GET /allocation waited {took:.1f} s behind a slow sbatch on the same loop"
        assert described["nodes"] == ["node1", "node2"] and described["time_left_s"] == 29 * 60 + 10
        assert submitted.result(30) == {"job_id": "4242", "output": "4242"}


@pytest.mark.timing
@pytest.mark.timeout(60)
def test_the_client_says_what_hung_or_failed(fake_slurm, tmp_path):
    owner = AllocationOwner({**fake_slurm, "FAKE_SBATCH_SECONDS": "30"})
    with owner_serving(owner, tmp_path / "job" / "a.sock") as sock:
        began = time.monotonic()
        with pytest.raises(TimeoutError, match=r"^the allocation owner did not answer POST /jobs in 0\.5 s$"):
            request(sock, "POST", "/jobs", {"batch_file": str(tmp_path / "job.sbatch")}, timeout=0.5)
        assert time.monotonic() - began < 5
        with pytest.raises(RuntimeError, match="^the allocation owner refused PUT /session: session must be one of"):
            request(sock, "PUT", "/session", {"session": "bogus"})
        assert request(sock, "GET", "/allocation", timeout=10)["in_job"] is True, "the owner still answers"
        sbatch = int((tmp_path / "bin" / "sbatch.pid").read_text())
    # tornado does not cancel a handler whose client went away: the sbatch runs on to its own deadline, or, as
    # here, ends when the owner's server stops (its tasks cancelled)
    wait_until(lambda: not group_alive(sbatch), "the hung sbatch killed when the owner's server stopped", 5)
    with pytest.raises(ConnectionError, match=r"^no allocation owner answers at .*a\.sock \(GET /allocation\)"):
        request(sock, "GET", "/allocation")


@pytest.mark.timing
def test_a_hung_command_is_killed_and_named(fake_slurm, tmp_path, monkeypatch):
    monkeypatch.setattr(allocation_module, "COMMAND_TIMEOUT_S", 0.5)
    owner = AllocationOwner({**fake_slurm, "FAKE_SBATCH_SECONDS": "30"})
    began = time.monotonic()
    assert ask(owner, "POST", "/jobs", {"batch_file": str(tmp_path / "job.sbatch")}) == (
        400, {"message": "sbatch did not answer in 0.5 s"})
    assert time.monotonic() - began < 5
    sbatch = int((tmp_path / "bin" / "sbatch.pid").read_text())
    wait_until(lambda: not group_alive(sbatch), "the hung sbatch and its sleep killed", 5)
    began = time.monotonic()
    with pytest.raises(TimeoutError, match=r"^sleep did not answer in 0\.2 s$"):  # the blocking one, for atexit
        run_sync(["sleep", "30"], 0.2)
    assert time.monotonic() - began < 5


@pytest.mark.timing
@pytest.mark.timeout(60)
def test_engine_steps_stop_by_process_group_on_the_loop_and_at_exit(fake_slurm, tmp_path, monkeypatch):
    monkeypatch.setattr(allocation_module, "STOP_GRACE_S", 0.5)
    owner = AllocationOwner({**fake_slurm, "FAKE_SRUN_STUBBORN": "1"})  # steps that ignore SIGTERM
    engines = {"ranks": 2, "image": "hpcdl/base:latest", "connection_file": str(tmp_path / "engine.json")}
    pids = tmp_path / "bin" / "srun.pids"

    def start(steps: int) -> list[int]:
        for _ in range(steps):
            assert ask(owner, "POST", "/engines", engines)[0] == 201
        wait_until(lambda: pids.exists() and len(pids.read_text().split()) == steps, "steps ignoring SIGTERM")
        return [int(pid) for pid in pids.read_text().split()]

    steps = start(2)
    assert [s["running"] for s in ask(owner, "GET", "/allocation", {})[1]["engine_steps"]] == [True, True]
    began = time.monotonic()
    assert ask(owner, "DELETE", "/engines", {}) == (200, {"stopped": 2})
    assert 0.5 <= time.monotonic() - began < 5, "SIGKILL once the grace is over, for both steps together"
    wait_until(lambda: not any(group_alive(pid) for pid in steps), "both steps' groups gone", 5)
    assert ask(owner, "GET", "/allocation", {})[1]["engine_steps"] == []

    pids.unlink()  # at exit, without an event loop: the steps and the jobs it submitted end too
    batch = {"batch_file": str(tmp_path / "job.sbatch")}
    assert ask(owner, "POST", "/jobs", {**batch, "keep": True})[1]["job_id"] == "4242"  # a batch run
    owner.stop_all_sync()
    assert not (tmp_path / "bin" / "scancel.called").exists(), "a batch run outlives the server"
    assert ask(owner, "POST", "/jobs", batch)[1]["job_id"] == "4242"  # a new allocation for a session
    assert ask(owner, "GET", "/jobs/4242", {}) == (200, {"job_id": "4242", "phase": "running", "state": "RUNNING",
                                                         "reason": "", "exit_code": "0:0",
                                                         "time_left_s": 29 * 60 + 10})
    steps = start(1)
    owner.stop_all_sync()
    wait_until(lambda: not group_alive(steps[0]), "the step's group gone at exit", 5)
    assert owner._steps == []
    assert (tmp_path / "bin" / "scancel.called").read_text().split() == ["4242"]
    assert ask(owner, "GET", "/jobs/4242", {})[0] == 200, "still answered once cancelled (until Slurm forgets it)"


def _frame(records):
    return pd.DataFrame(records, columns=["rank", "epoch", "batch", "loss", "samples_per_s", "step_time_s"])


def test_rank_series_and_progress():
    frame = _frame([(0, 1, 0, 2.0, 100, 0.1), (1, 1, 0, 2.1, 90, 0.11), (0, 1, 5, 1.5, 110, 0.09),
                    (0, 2, 0, 1.0, 120, 0.08), (1, 1, 5, None, 80, 0.12)])
    series = rank_series(frame, "loss", per_epoch=10)
    assert series == {0: ([0.0, 5.0, 10.0], [2.0, 1.5, 1.0]), 1: ([0.0], [2.1])}
    assert rank_series(_frame([]), "loss", 10) == {}
    latest = {0: {"epoch": 2, "batch": 0}, 1: {"epoch": 1, "batch": 5}}
    assert epoch_progress(latest, per_epoch=10, first_epoch=1, epochs=2) == (6, 20, "epoch 1/2")  # the slowest rank
    assert epoch_progress({}, 10, 1, 3) == (0, 30, "epoch 0/3")
    assert batches_per_epoch(899, 32) == 29 and batches_per_epoch(0, 32) == 1


def test_many_ranks_draw_as_their_spread_and_a_chart_follows_the_change():
    from jupyter_hpcdl.dashboard import charts
    from jupyter_hpcdl.dashboard.series import MAX_RANK_LINES, chart_series

    few = _frame([(r, 1, b, float(r + b), 100, 0.1) for r in range(2) for b in (0, 1)])
    assert chart_series(few, "loss", 10) == {"rank 0": ([0.0, 1.0], [0.0, 1.0]), "rank 1": ([0.0, 1.0], [1.0, 2.0])}
    n = MAX_RANK_LINES + 4
    many = _frame([(r, 1, b, float(r + b), 100, 0.1) for r in range(n) for b in (0, 1)])
    spread = chart_series(many, "loss", 10)
    assert spread == {f"min of {n} ranks": ([0.0, 1.0], [0.0, 1.0]),
                      f"median of {n} ranks": ([0.0, 1.0], [(n - 1) / 2, (n - 1) / 2 + 1]),
                      f"max of {n} ranks": ([0.0, 1.0], [n - 1.0, float(n)])}
    fig = charts.figure("loss", "step", "loss")
    charts.set_rank_lines(fig, chart_series(few, "loss", 10))
    assert [m.labels[0] for m in fig.marks] == ["rank 0", "rank 1"]
    charts.set_rank_lines(fig, spread)  # a rescale to many ranks: three lines, the ranks' gone
    assert [m.labels[0] for m in fig.marks] == list(spread) and list(fig.marks[2].y) == [n - 1.0, float(n)]


def test_rank_table_marks_stragglers_dead_ranks_modes_and_escapes():
    world = [{"rank": 1, "node": "node2", "cuda_visible_devices": "0", "gpus": 1, "container_mode": "userns"},
             {"rank": 0, "node": "<b>n</b>", "cuda_visible_devices": None, "gpus": 0, "container_mode": "P1"},
             {"rank": 2, "node": "laptop", "cuda_visible_devices": None, "gpus": 0, "container_mode": None}]
    rows = rank_rows(world, {1: {"loss": 0.5, "samples_per_s": 10.0, "epoch": 1}}, stragglers=[1], dead=[0])
    assert [(r["rank"], r["state"], r["straggler"], r["gpu"], r["container"]) for r in rows] == [
        (0, "dead", False, None, "P1"), (1, "idle", True, "0", "userns"), (2, "idle", False, None, None)]
    page = rank_table_html(rows)
    assert '<tr data-rank="1" class="hpcdl-straggler">' in page and "&lt;b&gt;n&lt;/b&gt;" in page
    assert "<b>" not in page
    assert "<th>container</th>" in page and "<td>userns</td>" in page and "<td>P1</td>" in page
    assert 'colspan="8"' in rank_table_html([]), "the empty table's row spans every column"


@pytest.mark.parametrize("text, error", [("", "give the rank counts"), ("1, x", "'x' is not a rank count"),
                                         ("0", "from 1 to 8"), ("2, 2", "each rank count once"), ("9", "from 1 to 8")])
def test_rank_counts_are_checked(text, error):
    with pytest.raises(ValueError, match=error):
        parse_rank_counts(text, most=8)
    assert parse_rank_counts(" 4; 1,2 ", 8) == [1, 2, 4]


# -- the widget models, driven by their buttons, against real local ranks ----------------------------------------------
@pytest.fixture(scope="module")
def dashboard(tmp_path_factory):
    pytest.importorskip("horovod.tensorflow.keras")
    from jupyter_hpcdl.dashboard import Dashboard

    tmp = tmp_path_factory.mktemp("dash")
    tabs = Dashboard(ranks=2, epochs=3, where="local", checkpoint_dir=str(tmp / "ckpt"))
    tabs.scaling.export_dir = str(tmp / "export")
    yield tabs
    tabs.training.stop_ranks()


@pytest.mark.ranks
def test_train_button_draws_a_line_per_rank_and_fills_the_table(dashboard):
    d = dashboard.training
    d.buttons["Train"].click()
    assert d.buttons["Train"].disabled and not d.buttons["Stop"].disabled, "busy while training"
    d.wait(300)
    assert d.error.value == "", d.error.value
    assert "done: 3 epochs" in d.status.value
    assert d.figures["gpu_memory_mb"].layout.display == "none" and not d.figures["gpu_memory_mb"].marks, "no GPUs"
    for column, fig in ((c, d.figures[c]) for c in ("loss", "samples_per_s", "step_time_s")):
        lines = {m.labels[0]: m for m in fig.marks}
        assert set(lines) == {"rank 0", "rank 1"}, column
        assert all(len(m.x) == len(m.y) > 0 for m in lines.values()), column
    loss = {m.labels[0]: list(m.y) for m in d.figures["loss"].marks}
    assert loss["rank 0"][-1] < loss["rank 0"][0]
    assert (d.progress.value, d.progress.description) == (d.progress.max, "epoch 3/3")
    assert d.table.value.count("<tr data-rank=") == 2 and not d.buttons["Train"].disabled


@pytest.mark.ranks
def test_stop_button_stops_all_ranks_mid_training(dashboard):
    d = dashboard.training
    d.epochs.value = 200
    d.buttons["Train"].click()
    deadline = time.monotonic() + 60
    while d.session.state != "training" and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(1.0)
    d.buttons["Stop"].click()
    d.wait(120)
    assert not d._worker.is_alive(), "Stop did not end the training"
    assert "stopped in epoch" in d.status.value and d.session.state == "stopped"
    d.epochs.value = 1


@pytest.mark.ranks
def test_errors_show_in_place(dashboard, tmp_path):
    d = dashboard.training
    d.checkpoint_dir, d.last_checkpoint = str(tmp_path / "none"), None
    d.buttons["Resume"].click()
    d.wait(60)
    assert "no checkpoint at" in d.error.value and "press Checkpoint first" in d.error.value
    d.checkpoint_dir = str(tmp_path / "ckpt")
    d.buttons["Checkpoint"].click()
    d.wait(60)
    assert d.error.value == "" and os.path.exists(d.last_checkpoint)


@pytest.mark.ranks
def test_scaling_tab_runs_plots_against_ideal_and_exports(dashboard):
    s, d = dashboard.scaling, dashboard.training
    trained = d.session.weights_digest()
    s.counts.value = "1, 2"
    s.run_button.click()
    assert s.run_button.disabled and d.buttons["Train"].disabled, "one action at a time, from either tab"
    assert not d.run_in_background(d.train, d.error), "a second action must not start while one runs"
    s.wait(600)
    assert s.error.value == "", s.error.value
    assert list(s.measured.x) == [1.0, 2.0] and list(s.ideal.y) == [1.0, 2.0]
    assert s.measured.y[0] == 1.0 and 0 < s.efficiency.y[1] <= 1.5
    assert (s.progress.value, s.progress.max) == (2, 2) and "hpcdl-scaling-table" in s.table.value
    csv, png = s.export()
    assert pd.read_csv(csv)["ranks"].tolist() == [1, 2]
    assert Path(png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert d.ranks.value == 2 and d.session.ranks == 2
    assert d.session.weights_digest() == trained, "the scaling run did not give the trained model back"


@pytest.mark.ranks
def test_after_a_rank_died_train_says_to_resume_and_resume_recovers(dashboard):
    import signal

    d = dashboard.training
    assert d.last_checkpoint and os.path.exists(d.last_checkpoint)
    os.kill(next(w for w in d.session.world if w["rank"] == 1)["pid"], signal.SIGKILL)
    deadline = time.monotonic() + 30
    while d.session.alive and time.monotonic() < deadline:
        time.sleep(0.2)
    for expected in (r"rank\(s\) (0, )?1 died during", "press Resume to continue from the last checkpoint"):
        d.buttons["Train"].click()
        d.wait(120)
        assert re.search(expected, d.error.value), d.error.value
    d.buttons["Resume"].click()
    d.wait(300)
    assert d.error.value == "" and d.session.alive and "resumed from" in d.status.value


@pytest.mark.ranks
def test_close_then_train_starts_again(dashboard):
    d = dashboard.training
    d.buttons["Close"].click()
    d.wait(120)
    assert "ranks stopped" in d.status.value and not d.session.alive
    d.epochs.value = 1
    d.buttons["Train"].click()
    d.wait(300)
    assert d.error.value == "", d.error.value
    assert "done: 1 epochs" in d.status.value and d.session.alive


# -- the server extension's handler in a real Jupyter server -----------------------------------------------------------
@pytest.fixture(scope="module")
def jupyter_server(tmp_path_factory):
    root = tmp_path_factory.mktemp("server")
    with running_jupyter("jupyter_server", root, root / "server.log") as server:
        yield server


def test_handler_needs_authentication(jupyter_server):
    url, _ = jupyter_server
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(f"{url}/jupyter-hpcdl/allocation", timeout=10)
    assert e.value.code == 403


def test_handler_says_plainly_when_not_in_a_batch_job(jupyter_server):
    url, token = jupyter_server
    req = urllib.request.Request(f"{url}/jupyter-hpcdl/allocation", headers={"Authorization": f"token {token}"})
    body = json.loads(urllib.request.urlopen(req, timeout=10).read())
    assert body["in_job"] is False and body["message"].startswith("Not in a batch job")


@pytest.mark.timing
@pytest.mark.ranks
@pytest.mark.timeout(120)
def test_in_a_job_the_panel_answers_while_sbatch_runs_and_exit_cancels_the_job(fake_slurm, tmp_path):
    sock = str(tmp_path / "job" / "a.sock")
    env = {**fake_slurm, "HPCDL_ALLOCATION_FILE": sock, "FAKE_SBATCH_SECONDS": "5"}
    with running_jupyter("jupyter_server", tmp_path, tmp_path / "server.log", env=env) as (url, token), \
            ThreadPoolExecutor(1) as pool:
        submitted = pool.submit(request, sock, "POST", "/jobs", {"batch_file": str(tmp_path / "job.sbatch")})
        wait_until(lambda: (tmp_path / "bin" / "sbatch.pid").exists(), "sbatch started")
        began = time.monotonic()
        req = urllib.request.Request(f"{url}/jupyter-hpcdl/allocation", headers={"Authorization": f"token {token}"})
        body = json.loads(urllib.request.urlopen(req, timeout=10).read())
        took = time.monotonic() - began
        assert not submitted.done() and took < 2, f"the panel waited {took:.1f} s behind a slow sbatch"
        assert (body["in_job"], body["job_id"], body["nodes"]) == (True, "42", ["node1", "node2"])
        assert submitted.result(30)["job_id"] == "4242"
    assert (tmp_path / "bin" / "scancel.called").read_text().split() == ["4242"], "the server's exit cancels it"
