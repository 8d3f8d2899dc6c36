"""The scheduler's commands from the hub, as the user: the prefix that runs a command as them, and a cancel that
tells a job already gone from a failure. Commands run through :mod:`jupyter_hpcdl.commands` (a deadline, the
process group killed past it)."""
from __future__ import annotations

from typing import Callable, Sequence

from ..commands import run


def as_user(prefix: Sequence[str], user: str, env_names: Sequence[str] = ()) -> list[str]:
    """The command prefix that runs as ``user`` (e.g. ``sudo -n -u {username}``), keeping the named variables."""
    argv = [part.replace("{username}", user) for part in prefix]
    if env_names and argv and argv[0].endswith("sudo"):
        argv.append(f"--preserve-env={','.join(env_names)}")
    return argv + (["--"] if argv and argv[0].endswith("sudo") else [])


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
