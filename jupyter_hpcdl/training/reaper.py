"""A session's reaper: a small process in its own session that outlives the kernel. If the kernel dies (killed,
crashed, restarted) before it closed its training session, the reaper ends what the session started: the engines
(through the allocation's owner where it started them), the ipyparallel controller and its launchers (a batch job of
the ranks included), and the session's private directory.

The kernel holds the write end of a pipe that is the reaper's standard input: its end of file (the kernel gone) or
the kernel's pid gone means reap; the word "closed" (the session closed normally) means exit, "reap" (the session
could not stop everything itself) means reap now. Signals do not stop
it: a SIGTERM to the kernel's whole process tree (its server stopping) is exactly when it must still do its work.

    python -m jupyter_hpcdl.training.reaper --kernel-pid PID --kernel-started T --cluster-file F [...]
"""
from __future__ import annotations

import argparse
import os
import select
import shutil
import signal
import subprocess
import sys
import threading

import psutil

from ..commands import start_group


def kernel_alive(pid: int, started: float) -> bool:
    """Whether ``pid`` is still the kernel that started at ``started`` (not a reused pid, not a zombie)."""
    try:
        p = psutil.Process(pid)
        return abs(p.create_time() - started) < 1.0 and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _with_deadline(fn, seconds: float, what: str) -> None:
    t = threading.Thread(target=fn, daemon=True)
    t.start()
    t.join(seconds)
    if t.is_alive():
        print(f"hpcdl reaper: {what} did not finish in {seconds:.0f} s", file=sys.stderr)


def reap(args: argparse.Namespace) -> None:
    if args.owner_socket and os.path.exists(args.owner_socket):
        from jupyter_hpcdl.job.owner import request

        _with_deadline(lambda: request(args.owner_socket, "DELETE", "/engines"), 60, "stopping the engines' steps")
    if args.cluster_file and os.path.exists(args.cluster_file):
        import ipyparallel as ipp

        _with_deadline(lambda: ipp.Cluster.from_file(args.cluster_file).stop_cluster_sync(), 60,
                       "stopping the controller and engines")
    if args.session_dir:
        shutil.rmtree(args.session_dir, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m jupyter_hpcdl.training.reaper", description=__doc__.split("\n\n")[0])
    p.add_argument("--kernel-pid", type=int, required=True)
    p.add_argument("--kernel-started", type=float, required=True)
    p.add_argument("--cluster-file")
    p.add_argument("--owner-socket")
    p.add_argument("--session-dir")
    p.add_argument("--interval", type=float, default=1.0)
    args = p.parse_args(argv)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    said = b""
    while True:
        ready, _, _ = select.select([0], [], [], args.interval)
        if ready:
            chunk = os.read(0, 64)
            if not chunk:
                break  # end of file: the kernel is gone
            said += chunk
            if b"closed" in said:
                return 0
            if b"reap" in said:
                break  # the session could not stop everything itself
        elif not kernel_alive(args.kernel_pid, args.kernel_started):
            break  # the kernel is gone (a child it forked may still hold the pipe)
    reap(args)
    return 0


def start_reaper(cluster_file: str | None, owner_socket: str | None, session_dir: str) -> subprocess.Popen:
    """Watch this process (the kernel); returns the reaper, which :func:`stop_reaper` ends."""
    me = psutil.Process()
    argv = [sys.executable, "-m", "jupyter_hpcdl.training.reaper", f"--kernel-pid={me.pid}",
            f"--kernel-started={me.create_time()}", f"--session-dir={session_dir}"]
    if cluster_file:
        argv.append(f"--cluster-file={cluster_file}")
    if owner_socket:
        argv.append(f"--owner-socket={owner_socket}")
    # stdin=PIPE: the write end stays in this process alone (not inherited by what it starts later)
    return start_group(argv, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                       close_fds=True)


def stop_reaper(proc: subprocess.Popen | None, reap: bool = False, timeout: float = 5) -> None:
    """The session closed: tell the reaper, which exits without touching anything, or, with ``reap`` (stopping
    failed somewhere), ends what is left on its own and then exits (this process does not wait for that)."""
    if proc is None or proc.poll() is not None:
        return
    try:
        proc.stdin.write(b"reap\n" if reap else b"closed\n")
        proc.stdin.close()
        if not reap:
            proc.wait(timeout)
    except (OSError, subprocess.TimeoutExpired):
        proc.kill()
        proc.wait(timeout)


if __name__ == "__main__":
    sys.exit(main())
