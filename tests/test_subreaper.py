"""The job's main process keeps everything its server starts inside the job, and ends it all when the server ends:
orphans (a kernel whose launcher died, a process in a session of its own) included. Each supervisor runs in a
process of its own (a subreaper is one for life)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

SUPERVISE = "import sys; from jupyter_hpcdl.job.subreaper import supervise; sys.exit(supervise(sys.argv[2:], grace={grace}))"


def supervisor(command: str, grace: float = 2.0) -> subprocess.Popen:
    root = Path(__file__).resolve().parents[1]
    return subprocess.Popen([sys.executable, "-c", SUPERVISE.format(grace=grace), "--", "sh", "-c", command],
                            cwd=root, env={**os.environ, "PYTHONPATH": str(root)}, stderr=subprocess.PIPE, text=True)


def wait_for_file(path: Path, timeout: float = 10) -> str:
    deadline = time.monotonic() + timeout
    while not (path.exists() and path.read_text().strip()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} was not written")
        time.sleep(0.05)
    return path.read_text().strip()


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_an_orphan_in_a_session_of_its_own_is_ended_with_the_server_and_the_exit_code_kept(tmp_path):
    pidfile = tmp_path / "orphan"
    sup = supervisor(f"setsid sleep 300 & echo $! > {pidfile}; sleep 0.5; exit 3")
    orphan = int(wait_for_file(pidfile))
    assert sup.wait(timeout=30) == 3
    assert not alive(orphan), "the orphan outlived the supervisor"


@pytest.mark.timing
def test_an_orphan_that_ignores_sigterm_is_killed_after_the_grace_and_named(tmp_path):
    pidfile = tmp_path / "orphan"
    sup = supervisor(f"setsid sh -c 'trap \"\" TERM; echo $$ > {pidfile}; while :; do sleep 0.1; done' & "
                     "sleep 1; exit 0", grace=1.0)
    orphan = int(wait_for_file(pidfile))
    started = time.monotonic()
    _, err = sup.communicate(timeout=30)
    assert sup.returncode == 0
    assert not alive(orphan)
    assert f"{orphan} (sh -c" in err and "killed what was still running" in err, err
    assert time.monotonic() - started >= 0.5  # the grace was given (1 s from the server's end)


def test_sigterm_reaches_the_server_and_its_status_is_returned(tmp_path):
    ready = tmp_path / "ready"
    sup = supervisor(f"trap 'exit 7' TERM; echo up > {ready}; while :; do sleep 0.1; done")
    wait_for_file(ready)
    sup.send_signal(signal.SIGTERM)
    assert sup.wait(timeout=30) == 7


def test_a_server_killed_by_a_signal_gives_128_plus_the_signal(tmp_path):
    sup = supervisor("kill -KILL $$")
    assert sup.wait(timeout=30) == 128 + signal.SIGKILL


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_CHILD_SUBREAPER is Linux's")
def test_orphans_are_reparented_to_the_supervisor_while_the_server_runs(tmp_path):
    pidfile, ready = tmp_path / "orphan", tmp_path / "ready"
    sup = supervisor(f"sh -c 'sleep 300 & echo $! > {pidfile}' ; echo up > {ready}; sleep 300")
    try:
        orphan = int(wait_for_file(pidfile))
        wait_for_file(ready)
        assert psutil.Process(orphan).ppid() == sup.pid, "an orphan left the job's process tree"
    finally:
        sup.send_signal(signal.SIGTERM)
        sup.wait(timeout=30)
    assert not alive(orphan)
