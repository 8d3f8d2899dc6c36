"""The one way the package runs a command with a deadline (jupyter_hpcdl.commands): the output, the exit status,
and past the deadline (or when the caller is cancelled) the whole process group killed and the command named."""
import asyncio
import os
import time

import pytest

from jupyter_hpcdl.commands import CommandTimeout, command_name, run, run_sync


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
