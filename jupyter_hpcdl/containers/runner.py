"""Run a command in a container as a process tree that can be stopped whole.

udocker starts the engine (proot) and exits or waits; killing the udocker process alone leaves the container's
processes running. So the command starts in a session and process group of its own, and :meth:`stop` signals the
group and every descendant that left it (an engine's processes leave the group, so the end of a group alone,
:func:`jupyter_hpcdl.commands.end_groups`, would miss them), then waits, then kills what is left."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
from typing import TYPE_CHECKING, Mapping, Sequence

from ..commands import kill_group, start_group
from .spec import PROOT_MODE

if TYPE_CHECKING:
    import psutil


def _psutil():
    """psutil, imported when a tree is first signalled (not at start-up: a containerized command's launch pays for
    every import)."""
    import psutil

    return psutil


class ContainerProcess:
    """A started ``udocker run``; use as a context manager or call :meth:`stop`."""

    def __init__(self, argv: Sequence[str], env: Mapping[str, str], private_dir: str | None = None,
                 mode: str = PROOT_MODE, **popen_kwargs):
        self.argv = list(argv)
        self._private_dir = private_dir
        self.mode = mode  # the fast path's process becomes the command itself: no engine between
        self.popen = start_group(self.argv, env=dict(env), **popen_kwargs)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def poll(self) -> int | None:
        rc = self.popen.poll()
        if rc is not None:
            self._cleanup()
        return rc

    def wait(self, timeout: float | None = None) -> int:
        rc = self.popen.wait(timeout)
        self._cleanup()
        return rc

    def communicate(self, input: str | bytes | None = None, timeout: float | None = None):
        out = self.popen.communicate(input, timeout)
        self._cleanup()
        return out

    def _tree(self) -> list[psutil.Process]:
        psutil = _psutil()
        try:
            return psutil.Process(self.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []

    def _signal(self, procs: list[psutil.Process], sig: int) -> None:
        psutil = _psutil()
        try:
            kill_group(self.pid, sig)
        except PermissionError:
            pass
        for p in procs:
            try:
                p.send_signal(sig)
            except psutil.NoSuchProcess:
                pass

    def signal_payload(self, sig: int) -> int:
        """Send ``sig`` to the processes running inside the container (below the engine, e.g. proot), not to
        udocker or the engine: an interrupt reaches the kernel without ending the container. Returns how many."""
        psutil = _psutil()
        if self.mode == "userns":
            try:
                os.kill(self.pid, sig)
                return 1
            except ProcessLookupError:
                return 0
        tree = self._tree()
        engines = [p for p in tree if _name(p).startswith(("proot", "runc"))]
        targets = [c for e in engines[:1] for c in _children(e)] if engines else tree
        for p in targets:
            try:
                p.send_signal(sig)
            except psutil.NoSuchProcess:
                pass
        return len(targets)

    def stop(self, timeout: float = 10.0) -> int | None:
        """SIGTERM to the whole tree, SIGKILL to what is left after ``timeout`` s; returns the exit status."""
        psutil = _psutil()
        procs = self._tree()
        if self.popen.poll() is None or procs:
            self._signal(procs, signal.SIGTERM)
            _, alive = psutil.wait_procs(procs, timeout=timeout)
            try:
                self.popen.wait(timeout=0 if not alive else 0.1)
            except subprocess.TimeoutExpired:
                pass
            left = alive + self._tree()
            if left or self.popen.poll() is None:
                self._signal(left, signal.SIGKILL)
                psutil.wait_procs(left, timeout=5)
        try:
            rc = self.popen.wait(timeout=5)
        except subprocess.TimeoutExpired:
            rc = None
        self._cleanup()
        return rc

    def _cleanup(self) -> None:
        if self._private_dir:
            shutil.rmtree(self._private_dir, ignore_errors=True)
            self._private_dir = None

    def __enter__(self) -> "ContainerProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def start_prepared(plan: dict, private_dir: str | None = None,
                   **popen_kwargs) -> tuple[ContainerProcess | None, str] | None:
    """The fast path's ``plan`` started from this process, which must be single-threaded: its child prepares the
    container (:func:`.nsexec.preexec`) and becomes the command, with no second interpreter. Returns the process,
    or None and why the container could not be prepared (nothing started), or None alone where the command could
    not be executed (not found, not executable: the launcher's own interpreter says so as a shell would)."""
    from . import nsexec

    kwargs = dict(popen_kwargs)
    read_end, write_end = os.pipe()
    pass_fds = tuple(kwargs.pop("pass_fds", ())) + (write_end,)
    try:
        proc = ContainerProcess(plan["argv"], plan["env"], private_dir=private_dir, mode="userns", pass_fds=pass_fds,
                                preexec_fn=nsexec.preexec(plan, write_end), **kwargs)
    except subprocess.SubprocessError:  # the container could not be prepared: why is on the pipe
        os.close(write_end)
        why = os.read(read_end, 4096).decode(errors="replace") or "the container could not be prepared"
        os.close(read_end)
        if private_dir:
            shutil.rmtree(private_dir, ignore_errors=True)
        return None, why
    except OSError:
        os.close(write_end)
        os.close(read_end)
        return None
    os.close(write_end)
    os.close(read_end)
    return proc, ""


#: The signals that stop a container's whole tree.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


class _Stopping(Exception):
    """SIGTERM or SIGHUP arrived while the container ran."""


def _raise_stopping(*_) -> None:
    for sig in STOP_SIGNALS:  # one stop: a second signal changes nothing
        signal.signal(sig, signal.SIG_IGN)
    raise _Stopping


def run_foreground(proc: ContainerProcess) -> int:
    """Wait for the container; SIGINT reaches the program inside (a kernel interrupt), SIGTERM/SIGHUP stop the
    whole container tree. The stop runs after the wait is left, not inside the signal handler: there, Popen's
    wait holds its lock, so the stop could not reap the command it ended and would wait out its timeout. After a
    stop the stop signals stay ignored (this run ends with 143, and one repeated meanwhile changes nothing); after
    the command's own end the earlier handlers are back."""
    signal.signal(signal.SIGINT, lambda *_: proc.signal_payload(signal.SIGINT))
    previous = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    stopped = False
    try:
        for sig in STOP_SIGNALS:
            signal.signal(sig, _raise_stopping)
        return proc.wait()
    except _Stopping:
        stopped = True
        ended = proc.poll()  # the command may have ended just before the signal
        if ended is not None:
            return ended
        proc.stop()
        return 143
    finally:
        for sig, handler in previous.items():
            if not stopped:
                signal.signal(sig, signal.SIG_DFL if handler is None else handler)  # None: not set from Python


def _name(p: psutil.Process) -> str:
    psutil = _psutil()
    try:
        return p.name()
    except psutil.NoSuchProcess:
        return ""


def _children(p: psutil.Process) -> list[psutil.Process]:
    psutil = _psutil()
    try:
        return p.children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def private_env_file(text: str) -> tuple[str, str]:
    """Write env-file ``text`` into a fresh directory only the caller can read; return (directory, file)."""
    d = tempfile.mkdtemp(prefix="hpcdl-env-")
    path = os.path.join(d, "env")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    return d, path
