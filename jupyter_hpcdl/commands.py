"""Running a command with a deadline, the one way the package does it (the hub's scheduler commands, the
allocation's owner): argv lists only (never a shell), each command in a process group of its own, the whole group
killed past the deadline (sudo and what it runs, a scheduler client and its children) or when the caller is
cancelled, and :class:`CommandTimeout` naming the command."""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
from dataclasses import dataclass
from typing import Mapping, Sequence


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


def kill_group(pid: int, sig: int = signal.SIGKILL) -> None:
    """``sig`` to the process group ``pid`` leads; nothing if it is gone."""
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        pass


async def run(argv: Sequence[str], env: Mapping[str, str] | None = None, input: str | None = None,
              timeout: float = 60) -> Result:
    """Run ``argv`` to its end on the event loop and take its output."""
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
    with subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          errors="replace", env=env, start_new_session=True) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_group(proc.pid)  # leaving the with block reaps it
            raise timed_out(argv, timeout) from None
    return Result(tuple(argv), proc.returncode, out, err)
