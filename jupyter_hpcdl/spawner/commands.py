"""Running the scheduler's commands from the hub: argv lists only (never a shell), optionally as the user."""
from __future__ import annotations

import asyncio
import os
import signal
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence


@dataclass(frozen=True)
class Result:
    argv: tuple[str, ...]
    returncode: int
    stdout: str
    stderr: str

    def failure(self, what: str) -> str:
        return f"{what} failed (exit {self.returncode}): {(self.stderr or self.stdout).strip()[-500:]}"

    def check(self, what: str) -> "Result":
        if self.returncode:
            raise RuntimeError(self.failure(what))
        return self


def as_user(prefix: Sequence[str], user: str, env_names: Sequence[str] = ()) -> list[str]:
    """The command prefix that runs as ``user`` (e.g. ``sudo -n -u {username}``), keeping the named variables."""
    argv = [part.replace("{username}", user) for part in prefix]
    if env_names and argv and argv[0].endswith("sudo"):
        argv.append(f"--preserve-env={','.join(env_names)}")
    return argv + (["--"] if argv and argv[0].endswith("sudo") else [])


async def run(argv: Sequence[str], env: Mapping[str, str] | None = None, input: str | None = None,
              timeout: float = 60) -> Result:
    """Run ``argv`` in a process group of its own; past ``timeout`` seconds the whole group (sudo and the command it
    runs) is killed and RuntimeError names the command."""
    proc = await asyncio.create_subprocess_exec(
        *argv, env=dict(env) if env is not None else None, stdin=asyncio.subprocess.PIPE if input else asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, start_new_session=True)
    try:
        out, err = await asyncio.wait_for(proc.communicate(input.encode() if input else None), timeout)
    except asyncio.TimeoutError:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:  # it ended meanwhile
            pass
        try:
            await asyncio.wait_for(proc.wait(), 10)
        except asyncio.TimeoutError:  # unkillable for now (a hung file system): left to the kernel
            pass
        raise RuntimeError(f"{' '.join(argv[:1] + [a for a in argv[1:] if not a.startswith('-')][-2:])} did not answer "
                           f"in {timeout:.0f} s") from None
    return Result(tuple(argv), proc.returncode, out.decode(errors="replace"), err.decode(errors="replace"))


async def cancel_as_user(prefix: Sequence[str], user: str, cancel_argv: Sequence[str],
                         forgotten: Callable[[str], bool], timeout: float) -> str | None:
    """Cancel a job as ``user``; None once the scheduler took it (or no longer knows the job), else why not."""
    try:
        result = await run([*as_user(prefix, user), *cancel_argv], timeout=timeout)
    except (OSError, RuntimeError) as e:
        return str(e) or type(e).__name__
    if result.returncode and not forgotten(result.stderr + result.stdout):
        return result.failure(" ".join(cancel_argv))
    return None
