"""The one way the package runs a command with a deadline (jupyter_hpcdl.commands): the output, the exit status,
and past the deadline (or when the caller is cancelled) the whole process group killed and the command named; and
the one way it ends a process group: SIGTERM, the grace, SIGKILL, and a result saying which needed it."""
import asyncio
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from jupyter_hpcdl.commands import (CommandTimeout, command_name, end_group_by_id, end_groups, end_groups_async, run,
                                    run_sync, start_group)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_command_gives_its_output_and_status_sync_and_async():
    for result in (run_sync(["sh", "-c", "echo out; echo err >&2; exit 3"], 10),
                   asyncio.run(run(["sh", "-c", "echo out; echo err >&2; exit 3"], timeout=10))):
        assert (result.returncode, result.stdout, result.stderr) == (3, "out\n", "err\n")
        assert result.failure("sh") == "sh failed (exit 3): err"
        with pytest.raises(RuntimeError, match=r"^x failed \(exit 3\): err$"):
            result.check("x")
    assert asyncio.run(run(["cat"], input="to stdin", timeout=10)).stdout == "to stdin"


@pytest.mark.parametrize("how", ["sync", "async", "cancelled"])
def test_past_the_deadline_the_whole_group_is_killed_and_the_command_named(tmp_path, how):
    pidfile = tmp_path / "child"
    argv = ["sh", "-c", f"sleep 60 & echo $! > {pidfile}; wait"]  # a child in the same group
    began = time.monotonic()
    if how == "sync":
        with pytest.raises(CommandTimeout, match=r"^sh did not answer in 0\.5 s$"):
            run_sync(argv, 0.5)
    elif how == "async":
        with pytest.raises(TimeoutError, match=r"^sh did not answer in 0\.5 s$"):
            asyncio.run(run(argv, timeout=0.5))
    else:
        async def cancel_it():
            task = asyncio.ensure_future(run(argv, timeout=60))
            await asyncio.sleep(0.5)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        asyncio.run(cancel_it())
    assert time.monotonic() - began < 15
    child = int(pidfile.read_text())
    deadline = time.monotonic() + 5
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(child), "the command's child outlived it"


def test_the_name_is_the_program_even_behind_sudo():
    assert command_name(["sudo", "-n", "-u", "alice", "--", "squeue", "-h"]) == "squeue"
    assert command_name(["/usr/bin/sbatch", "--parsable", "job"]) == "/usr/bin/sbatch"


def _group_left(pgid: int) -> list[int]:
    """The processes of group ``pgid`` still running (a zombie waiting for its parent is gone)."""
    left = []
    for p in psutil.process_iter(["pid", "status"]):
        try:
            if os.getpgid(p.pid) == pgid and p.info["status"] != psutil.STATUS_ZOMBIE:
                left.append(p.pid)
        except (ProcessLookupError, psutil.Error):
            pass
    return left


def _wait_gone(pgid: int, timeout: float = 5) -> list[int]:
    deadline = time.monotonic() + timeout
    while _group_left(pgid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return _group_left(pgid)


def _stubborn_group(tmp_path) -> subprocess.Popen:
    """A group whose leader and its child ignore SIGTERM (an ignored signal stays ignored across fork and exec)."""
    ready = tmp_path / "ready"
    proc = start_group(["sh", "-c", f"trap '' TERM; sleep 300 & touch {ready}; wait"])
    deadline = time.monotonic() + 10
    while not ready.exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    return proc


@pytest.mark.parametrize("how", ["sync", "async"])
def test_a_group_that_ignores_sigterm_is_killed_after_the_grace_and_nothing_is_left(tmp_path, how):
    proc = _stubborn_group(tmp_path)
    assert os.getpgid(proc.pid) == proc.pid and len(_group_left(proc.pid)) == 2, "a group of its own, and a child"
    began = time.monotonic()
    if how == "sync":
        ended = end_groups([proc], 0.5)
    else:
        ended = asyncio.run(end_groups_async([proc], 0.5))
    assert 0.5 <= time.monotonic() - began < 5, "SIGKILL once the grace is over, not before"
    assert ended.killed == (proc.pid,) and ended.running == ()
    assert ended.groups[0].signals == (signal.SIGTERM, signal.SIGKILL)
    assert proc.returncode == -signal.SIGKILL, "the leader was reaped"
    assert _wait_gone(proc.pid) == [], "nothing of the group is left"


def test_a_group_that_ends_on_sigterm_is_not_killed_and_one_already_ended_is_not_signalled(tmp_path):
    polite = start_group(["sleep", "300"])
    done = start_group(["true"])
    done.wait()
    began = time.monotonic()
    ended = end_groups([polite, done], 30)
    assert time.monotonic() - began < 5, "no wait for the grace once every leader is gone"
    assert ended.killed == () and ended.running == ()
    assert [g.signals for g in ended.groups] == [(signal.SIGTERM,), ()]
    assert polite.returncode == -signal.SIGTERM


def test_signal_exited_reaches_what_a_leader_that_exited_left_in_its_group(tmp_path):
    pidfile = tmp_path / "child"
    code = (f"import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); open({str(pidfile)!r}, 'w'); "
            "time.sleep(300)")
    leader = start_group(["sh", "-c", f'{sys.executable} -c "{code}" & wait'])  # the leader ends on SIGTERM
    deadline = time.monotonic() + 10
    while not pidfile.exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    ended = end_groups([leader], 30, signal_exited=True)
    assert ended.killed == (leader.pid,), "SIGKILL to the group at once: its leader had exited"
    assert _wait_gone(leader.pid) == []


def test_a_group_that_is_not_a_child_is_ended_by_its_id_after_the_grace(tmp_path):
    """As the session ends ipyparallel's controller: a group started with setsid by someone else, its members
    ignoring SIGTERM, is killed once the grace is over; a group that is gone is left alone."""
    ready = tmp_path / "ready"
    out = subprocess.run(["sh", "-c", f"setsid sh -c \"trap '' TERM; sleep 300 & touch {ready}; wait\" "
                          ">/dev/null 2>&1 & echo $!"], capture_output=True, text=True, timeout=10, check=True)
    pgid = int(out.stdout)
    deadline = time.monotonic() + 10
    while not ready.exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert os.getpgid(pgid) == pgid and len(_group_left(pgid)) == 2, "a group of its own that is not our child"
    began = time.monotonic()
    end_group_by_id(pgid, grace=0.5)
    assert 0.5 <= time.monotonic() - began < 5, "SIGKILL once the grace is over, not before"
    assert _wait_gone(pgid) == [], "nothing of the group is left"
    began = time.monotonic()
    end_group_by_id(pgid, grace=30)
    assert time.monotonic() - began < 2, "a group that is gone: nothing to wait for"
