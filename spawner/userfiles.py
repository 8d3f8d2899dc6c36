"""What the hub does with a user's files, always as the user (the sudo rule's commands, never the hub's rights): a
job's private files written through ``envfile`` (on its stdin, never on a command line), files removed, and the end
of a job's log read through ``usertail``."""
from __future__ import annotations

import json
import logging
import sys
from dataclasses import dataclass
from typing import Sequence

from ..commands import run
from ..controls import escape_controls
from .commands import as_user

#: The hub's Python run as a user (a module follows): no user site directory (``-s``) and nothing from the working
#: directory (``-P``), so only the hub's installation runs; sudo leaves out the caller's PYTHON* variables.
USER_PYTHON = (sys.executable, "-s", "-P", "-m")


@dataclass(frozen=True)
class UserFiles:
    """One user's files: ``exec_prefix`` runs a command as ``user``; ``timeout`` bounds removing and reading."""

    exec_prefix: Sequence[str]
    user: str
    timeout: float

    async def write_private(self, path: str, texts: dict[str, str], what: str, timeout: float = 60) -> None:
        """Write ``texts`` into ``path``, a file of mode 0600 only the user can read (RuntimeError saying ``what``
        failed)."""
        (await run([*as_user(self.exec_prefix, self.user), *USER_PYTHON, "jupyter_hpcdl.spawner.envfile", path],
                   input=json.dumps(texts), timeout=timeout)).check(what)

    async def remove(self, paths: Sequence[str]) -> str | None:
        """Remove ``paths`` (``rm -f``): None once done, else why not."""
        result = await run([*as_user(self.exec_prefix, self.user), "rm", "-f", "--", *paths], timeout=self.timeout)
        return result.failure("rm") if result.returncode else None

    async def log_tail(self, path: str, lines: int, max_bytes: int, log: logging.Logger | logging.LoggerAdapter,
                       who: str) -> str:
        """The end of a job's log (``usertail``: a regular file only, bounded in bytes and in time), or why it is
        not shown; never read with the hub's rights, never on the event loop. ``who`` names the server in ``log``."""
        argv = [*as_user(self.exec_prefix, self.user), *USER_PYTHON, "jupyter_hpcdl.spawner.usertail",
                "--lines", str(lines), "--max-bytes", str(max_bytes), "--", path]
        try:
            result = await run(argv, timeout=self.timeout)
        except (OSError, RuntimeError) as e:
            log.warning("%s: reading the end of %s as %s: %s", who, path, self.user, e)
            return ""
        if result.returncode == 3:  # not shown, with the reason
            return f"(not shown: {escape_controls(result.stderr.strip()[-300:])})\n"
        if result.returncode:
            log.warning("%s: %s", who, escape_controls(result.failure(f"reading the end of {path}")))
            return ""
        return escape_controls(result.stdout[-4 * max_bytes:])  # as usertail gives it, whatever ran
