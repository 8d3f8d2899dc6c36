"""The job's main process as a child subreaper: it runs the single-user server as its child, and nothing the server
starts outlives the job.

A batch system finds a job's processes its own way. Slurm's ``proctrack/linuxproc`` (where cgroups are not
available) and any tracker that follows parent pids lose a process whose parent died first: it is reparented to
init, outside the job, and is never signalled. A kernel whose server was killed before shutting it down, or a
container whose launcher died, is then left running on the node. With ``PR_SET_CHILD_SUBREAPER`` such orphans are
reparented to this process instead, so they stay in the job's tree while it lives; and it lives until they are gone:
when the server exits, every process left below it gets SIGTERM, then SIGKILL after a grace period."""
from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from typing import Sequence

import psutil

PR_SET_CHILD_SUBREAPER = 36
#: Signals passed on to the server (a batch system's stop, a terminal's hang-up, a job's warning signals).
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)


def become_subreaper() -> bool:
    """Make this process the subreaper of its descendants; False where the kernel does not offer it."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _reap_exited() -> None:
    """Collect the exit status of every child that has exited (orphans reparented here, now zombies)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def end_descendants(grace: float, kill_wait: float = 5.0) -> list[str]:
    """SIGTERM to every process below this one, SIGKILL to those still there after ``grace`` seconds; returns a
    description of each process that had to be killed. Orphans reparented here while it works are included.
    (By descendant, not :func:`jupyter_hpcdl.commands.end_groups`: what the server's tree starts may leave its group.)"""
    deadline = time.monotonic() + grace
    killed: list[str] = []
    signalled: set[int] = set()
    while True:
        _reap_exited()
        procs = psutil.Process().children(recursive=True)
        fresh = [p for p in procs if p.pid not in signalled]
        for p in fresh:
            signalled.add(p.pid)
            try:
                p.terminate()
            except psutil.NoSuchProcess:
                pass
        if not procs:
            return killed
        if time.monotonic() >= deadline:
            break
        psutil.wait_procs(procs, timeout=min(0.2, max(0.0, deadline - time.monotonic())))
    for p in psutil.Process().children(recursive=True):
        try:
            killed.append(f"{p.pid} ({' '.join(p.cmdline())[:120]})")
            p.kill()
        except psutil.NoSuchProcess:
            pass
    end = time.monotonic() + kill_wait
    while psutil.Process().children(recursive=True) and time.monotonic() < end:
        _reap_exited()
        time.sleep(0.05)
    _reap_exited()
    return killed


def supervise(argv: Sequence[str], pass_fds: Sequence[int] = (), grace: float = 10.0) -> int:
    """Run ``argv`` as a child of this (subreaper) process, handing it ``pass_fds`` (closed here once it started:
    the child alone holds them), pass it the signals in :data:`FORWARDED`, and once it exits end whatever is left
    below; returns its exit code (128 + N for a signal N, as a shell gives)."""
    become_subreaper()
    try:
        child = subprocess.Popen(list(argv), pass_fds=tuple(pass_fds))
    finally:
        for fd in pass_fds:
            os.close(fd)

    def forward(signum, _frame):
        try:
            child.send_signal(signum)
        except ProcessLookupError:
            pass

    for sig in FORWARDED:
        signal.signal(sig, forward)
    while True:  # reap orphans as they end, until the server itself has
        pid, status = os.waitpid(-1, 0)
        if pid == child.pid:
            child.returncode = code = os.waitstatus_to_exitcode(status)
            break
    for sig in FORWARDED:
        signal.signal(sig, signal.SIG_IGN)  # the stop has reached the server; end the rest without being cut short
    killed = end_descendants(grace)
    if killed:
        print(f"[jupyter-hpcdl] killed what was still running {grace:g} s after the server ended: "
              + ", ".join(killed), file=sys.stderr, flush=True)
    return 128 - code if code < 0 else code
