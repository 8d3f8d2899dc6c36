"""``hpcdl-containers run``'s foreground wait (``containers/runner.run_foreground``), over a plain process group
(the signal handling is the same whatever runs inside): a stop signal ends the whole tree and the run with 143,
a second signal during the stop changes nothing, and a command's own end keeps its exit code."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil

ROOT = str(Path(__file__).resolve().parents[1])
#: The foreground run of ``argv[1:]``; the command prints its pid first.
RUN = textwrap.dedent("""
    import os, sys
    from jupyter_hpcdl.containers.runner import ContainerProcess, run_foreground
    sys.exit(run_foreground(ContainerProcess(sys.argv[1:], os.environ)))
""")


def catches(pid: int, *signals: int) -> bool:
    """Whether process ``pid`` has handlers of its own for all of ``signals`` (``SigCgt`` in its status)."""
    status = Path(f"/proc/{pid}/status").read_text()
    caught = int(next(line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:")), 16)
    return all(caught >> (sig - 1) & 1 for sig in signals)


def start(command: str, caught: bool = True) -> tuple[subprocess.Popen, int]:
    """The foreground run of ``command`` and the command's process, once the run catches the stop signals (a
    signal before that would meet the default action, as for any process that has not started yet)."""
    run = subprocess.Popen([sys.executable, "-c", RUN, "sh", "-c", command], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": ROOT})
    pid = int(run.stdout.readline())  # the command is up
    deadline = time.monotonic() + 30
    while caught and not catches(run.pid, signal.SIGTERM, signal.SIGHUP):
        assert time.monotonic() < deadline, "the foreground run never caught SIGTERM and SIGHUP"
        time.sleep(0.01)
    return run, pid


def gone(proc: psutil.Process) -> bool:
    try:
        return proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_a_stop_signal_ends_the_tree_and_the_run_with_143_even_when_repeated():
    for signals in ([signal.SIGTERM], [signal.SIGHUP, signal.SIGTERM, signal.SIGTERM]):
        run, pid = start("echo $$; trap 'sleep 1; exit 0' TERM; sleep 300 & wait")
        command = psutil.Process(pid)  # it waits for its sleep: up until the signal
        child = command.children()
        for sig in signals:
            run.send_signal(sig)
            time.sleep(0.05)
        _, err = run.communicate(timeout=60)
        assert run.returncode == 143, err
        assert "Traceback" not in err, err
        assert gone(command) and all(gone(p) for p in child), "the container's tree was left running"


def test_stop_signals_that_keep_coming_until_the_run_ends_change_nothing():
    run, pid = start("echo $$; sleep 300")
    command = psutil.Process(pid)
    while run.poll() is None:  # a supervisor that repeats its stop: before, during and after the stop itself
        run.send_signal(signal.SIGTERM)
        time.sleep(0.002)
    _, err = run.communicate(timeout=60)
    assert run.returncode == 143 and "Traceback" not in err, (run.returncode, err)
    assert gone(command), "the container's command was left running"


def test_the_commands_own_end_keeps_its_exit_code():
    run, _ = start("echo $$; exit 7", caught=False)
    _, err = run.communicate(timeout=60)
    assert run.returncode == 7 and "Traceback" not in err, err
