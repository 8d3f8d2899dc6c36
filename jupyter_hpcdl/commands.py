"""Running a command with a deadline, and starting and ending process groups, the one way the package does both.

Commands (the hub's scheduler commands, the allocation's owner): argv lists only (never a shell), each command in a
process group of its own, the whole group killed past the deadline (sudo and what it runs, a scheduler client and its
children) or when the caller is cancelled, and :class:`CommandTimeout` naming the command.

Process groups (engine steps, ranks, tasks): :func:`start_group` starts one, :func:`end_groups` (or
:func:`ending_groups`, for a caller that sleeps on its own loop) ends them: SIGTERM, a grace, SIGKILL, a last wait,
and a :class:`GroupsEnded` saying which needed SIGKILL and which are still running; :func:`end_group_by_id` ends
a group known by its id alone (its ``Popen`` gone, or never this process's).

asyncio is imported only by the coroutines: a container's start (:mod:`jupyter_hpcdl.containers.runner`) imports
this module and pays for every import."""
from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass
from typing import Any, Generator, Mapping, Sequence

#: How long the processes of ended groups have to go once SIGKILL was sent.
KILL_WAIT_S = 5.0


@dataclass(frozen=True)
class Result:
    argv: tuple[str, ...]
    returncode: int
    stdout: str
    stderr: str

    def failure(self, what: str) -> str:
        return f"{what} failed (exit {self.returncode}): {(self.stderr or self.stdout).strip()[-500:]}"

    def check(self, what: str) -> "Result":
        """This result, or RuntimeError saying ``what`` failed and why."""
        if self.returncode:
            raise RuntimeError(self.failure(what))
        return self


class CommandTimeout(RuntimeError, TimeoutError):
    """A command did not end within its deadline (its process group was killed)."""


def command_name(argv: Sequence[str]) -> str:
    """The program a command line runs: ``squeue`` for ``sudo -n -u alice -- squeue ...`` too."""
    argv = list(argv)
    if argv and os.path.basename(argv[0]) == "sudo" and "--" in argv[:-1]:
        argv = argv[argv.index("--") + 1:]
    return argv[0] if argv else "?"


def timed_out(argv: Sequence[str], timeout: float) -> CommandTimeout:
    return CommandTimeout(f"{command_name(argv)} did not answer in {timeout:g} s")


def kill_group(pid: int, sig: int = signal.SIGKILL) -> bool:
    """``sig`` to the process group ``pid`` leads; whether it reached a member (False: the group is gone)."""
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        return False
    return True


def start_group(argv: Sequence[str], **popen_kwargs: Any) -> subprocess.Popen:
    """Start ``argv`` in a session and process group of its own (its pid is the group's id), so that
    :func:`end_groups` reaches everything it starts that stays in the group."""
    return subprocess.Popen(list(argv), start_new_session=True, **popen_kwargs)


def end_group_by_id(pgid: int, grace: float = 5.0) -> None:
    """End a process group by its id alone, its leader this process's child or not (a session's ipyparallel
    controller, started with setsid by ipyparallel; a batch run's local ranks, seen from the kernel that started
    them or a later one): SIGTERM to ``pgid``, SIGKILL to what is left after ``grace`` seconds. The members are
    found by their group id and waited for by psutil; a leader that is a child is left for its owner to reap."""
    import psutil

    def members() -> list[psutil.Process]:
        found = []
        for p in psutil.process_iter():
            try:
                if os.getpgid(p.pid) == pgid:
                    found.append(p)
            except (ProcessLookupError, psutil.Error):
                pass
        return found

    left = members()
    if not left:
        return
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(pgid, sig)
        except (ProcessLookupError, PermissionError):
            return
        _, left = psutil.wait_procs(left, timeout=grace)
        if not left:
            return


@dataclass(frozen=True)
class GroupEnd:
    """How one process group was ended: the signals that reached a member of it, and whether its leader (the
    process started) was still running at the end."""

    pid: int
    signals: tuple[int, ...]
    running: bool

    @property
    def killed(self) -> bool:
        """SIGKILL reached the group: something in it outlasted the grace (or its leader had already exited)."""
        return signal.SIGKILL in self.signals


@dataclass(frozen=True)
class GroupsEnded:
    """What :func:`end_groups` did, group by group."""

    groups: tuple[GroupEnd, ...]

    @property
    def killed(self) -> tuple[int, ...]:
        """The groups (by leader pid) that SIGKILL reached."""
        return tuple(g.pid for g in self.groups if g.killed)

    @property
    def running(self) -> tuple[int, ...]:
        """The leaders still running after the last wait (unkillable for now: a hung file system)."""
        return tuple(g.pid for g in self.groups if g.running)


def ending_groups(procs: Sequence[subprocess.Popen], grace: float, kill_wait: float = KILL_WAIT_S,
                  signal_exited: bool = False) -> Generator[float, None, GroupsEnded]:
    """End the process groups that ``procs`` lead: SIGTERM to each, SIGKILL once every leader has exited or
    ``grace`` seconds have passed, then up to ``kill_wait`` seconds for the leaders to go (each is reaped). Yields
    how long to sleep between looks, so that the caller sleeps as it can (blocking, or on an event loop); returns
    what was done. ``signal_exited``: signal a group whose leader has already exited too (whatever of it is left
    goes; a group's id is not reused while a member is left), not only those whose leader still runs."""
    reached: dict[int, list[int]] = {proc.pid: [] for proc in procs}
    for sig, patience in ((signal.SIGTERM, grace), (signal.SIGKILL, kill_wait)):
        for proc in procs:
            if (signal_exited or proc.poll() is None) and kill_group(proc.pid, sig):
                reached[proc.pid].append(sig)
        deadline = time.monotonic() + patience
        while any(proc.poll() is None for proc in procs) and time.monotonic() < deadline:
            yield 0.05
    return GroupsEnded(tuple(GroupEnd(proc.pid, tuple(reached[proc.pid]), proc.poll() is None) for proc in procs))


def end_groups(procs: Sequence[subprocess.Popen], grace: float, kill_wait: float = KILL_WAIT_S,
               signal_exited: bool = False) -> GroupsEnded:
    """:func:`ending_groups`, sleeping here until it is done."""
    steps = ending_groups(procs, grace, kill_wait, signal_exited)
    while True:
        try:
            time.sleep(next(steps))
        except StopIteration as done:
            return done.value


async def end_groups_async(procs: Sequence[subprocess.Popen], grace: float, kill_wait: float = KILL_WAIT_S,
                           signal_exited: bool = False) -> GroupsEnded:
    """:func:`ending_groups`, sleeping on the event loop."""
    import asyncio

    steps = ending_groups(procs, grace, kill_wait, signal_exited)
    while True:
        try:
            await asyncio.sleep(next(steps))
        except StopIteration as done:
            return done.value


async def run(argv: Sequence[str], env: Mapping[str, str] | None = None, input: str | None = None,
              timeout: float = 60) -> Result:
    """Run ``argv`` to its end on the event loop and take its output."""
    import asyncio

    proc = await asyncio.create_subprocess_exec(
        *argv, env=dict(env) if env is not None else None,
        stdin=asyncio.subprocess.PIPE if input else asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, start_new_session=True)
    try:
        out, err = await asyncio.wait_for(proc.communicate(input.encode() if input else None), timeout)
    except asyncio.TimeoutError:
        raise timed_out(argv, timeout) from None
    finally:
        if proc.returncode is None:  # past the deadline, or the caller was cancelled
            kill_group(proc.pid)
            try:
                await asyncio.wait_for(proc.wait(), 10)
            except asyncio.TimeoutError:  # unkillable for now (a hung file system): left to the kernel
                pass
    return Result(tuple(argv), proc.returncode, out.decode(errors="replace"), err.decode(errors="replace"))


def run_sync(argv: Sequence[str], timeout: float, env: Mapping[str, str] | None = None) -> Result:
    """:func:`run` for where there is no event loop (``atexit``, a thread of its own)."""
    with start_group(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                     errors="replace", env=env) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_group(proc.pid)  # leaving the with block reaps it
            raise timed_out(argv, timeout) from None
    return Result(tuple(argv), proc.returncode, out, err)
