"""Running the scheduler's commands from the hub: argv lists only (never a shell), optionally as the user."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Mapping, Sequence


@dataclass(frozen=True)
class Result:
    argv: tuple[str, ...]
    returncode: int
    stdout: str
    stderr: str

    def check(self, what: str) -> "Result":
        if self.returncode:
            raise RuntimeError(f"{what} failed (exit {self.returncode}): {(self.stderr or self.stdout).strip()[-500:]}")
        return self


def as_user(prefix: Sequence[str], user: str, env_names: Sequence[str] = ()) -> list[str]:
    """The command prefix that runs as ``user`` (e.g. ``sudo -n -u {username}``), keeping the named variables."""
    argv = [part.replace("{username}", user) for part in prefix]
    if env_names and argv and argv[0].endswith("sudo"):
        argv.append(f"--preserve-env={','.join(env_names)}")
    return argv + (["--"] if argv and argv[0].endswith("sudo") else [])


async def run(argv: Sequence[str], env: Mapping[str, str] | None = None, input: str | None = None,
              timeout: float = 60) -> Result:
    proc = await asyncio.create_subprocess_exec(
        *argv, env=dict(env) if env is not None else None, stdin=asyncio.subprocess.PIPE if input else asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    try:
        out, err = await asyncio.wait_for(proc.communicate(input.encode() if input else None), timeout)
    except asyncio.TimeoutError:
        try:
            proc.kill()
        except ProcessLookupError:  # it ended meanwhile
            pass
        await proc.wait()
        raise RuntimeError(f"{argv[0]} did not answer in {timeout:.0f} s") from None
    return Result(tuple(argv), proc.returncode, out.decode(errors="replace"), err.decode(errors="replace"))
