"""The sudo rule that lets the hub's account act as the users, and nothing more (a pure builder, and a command that
prints it for ``/etc/sudoers.d/``)::

    python -m jupyter_hpcdl.spawner.sudoers --hub-user jupyterhub --scheduler slurm > /etc/sudoers.d/jupyter-hpcdl
    visudo -cf /etc/sudoers.d/jupyter-hpcdl

What the hub runs as a user (through ``c.HpcdlSpawner.exec_prefix``, ``sudo -n -u {username}``): the scheduler's
submit and cancel commands (keeping the variables it names, hence ``SETENV``), ``mkdir`` and ``rm`` (the job's log
directory, its private environment file), and the hub's Python for :mod:`.envfile` and :mod:`.usertail`. Never as
root."""
from __future__ import annotations

import argparse
import re
import shutil
import sys
from dataclasses import dataclass
from typing import Sequence

from ..batchsystems.scheduler import load_scheduler

#: Where sudo looks for a command (Debian's ``secure_path``): the rule names each command by its path there.
SECURE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
#: The modules the hub runs with its Python as a user, after ``-s -P -m`` (see ``userfiles.USER_PYTHON``).
USER_MODULES = ("jupyter_hpcdl.spawner.envfile", "jupyter_hpcdl.spawner.usertail")
_PLAIN = re.compile(r"^[A-Za-z0-9_./+-]+$")  # nothing sudoers would read as syntax


@dataclass(frozen=True)
class SudoRule:
    """The hub's account, the hub's Python, and the absolute paths of the commands it runs as the users."""

    hub_user: str
    python: str
    job_commands: tuple[str, ...]  # the schedulers' submit and cancel commands
    file_commands: tuple[str, ...]  # mkdir, rm


def user_commands(rule: SudoRule) -> list[list[str]]:
    """Every command (an argv prefix) the hub runs as a user under ``rule``."""
    return [*([c] for c in rule.job_commands), *([c] for c in rule.file_commands),
            *([rule.python, "-s", "-P", "-m", m] for m in USER_MODULES)]


def _plain(kind: str, value: str) -> str:
    if not _PLAIN.match(value):
        raise ValueError(f"{kind} {value!r} has characters sudoers would read as syntax: use a plain name or path")
    return value


def sudoers_text(rule: SudoRule) -> str:
    """The file for ``/etc/sudoers.d/`` (check it with ``visudo -cf``)."""
    hub = _plain("the hub's account", rule.hub_user)
    for path in (rule.python, *rule.job_commands, *rule.file_commands):
        if not _plain("command", path).startswith("/"):
            raise ValueError(f"command {path!r} must be an absolute path")
    python = [f"{rule.python} -s -P -m {m} *" for m in USER_MODULES]
    return "\n".join([
        f"# jupyter-hpcdl: what the hub's account {hub} may run as the users, and nothing else (never as root).",
        "# The submit and cancel commands keep the variables the hub names (SETENV, for sudo --preserve-env).",
        f"Cmnd_Alias HPCDL_JOBS = {', '.join(rule.job_commands)}",
        f"Cmnd_Alias HPCDL_FILES = {', '.join(rule.file_commands)}",
        f"Cmnd_Alias HPCDL_PYTHON = {', '.join(python)}",
        f"Defaults:{hub} !requiretty, !lecture",
        f"{hub} ALL = (ALL, !root) NOPASSWD: SETENV: HPCDL_JOBS, HPCDL_FILES, HPCDL_PYTHON",
        ""])


def _where(command: str, path: str = SECURE_PATH) -> str:
    found = shutil.which(command, path=path)
    if not found:
        raise ValueError(f"{command} is not on sudo's secure_path ({path}): install it there, or name its path")
    return found


def rule_for(hub_user: str, schedulers: Sequence[str], python: str = sys.executable) -> SudoRule:
    """The rule for a hub running ``schedulers`` (adapter names), with its commands found where sudo finds them."""
    jobs: list[str] = []
    for name in schedulers:
        sched = load_scheduler(name)
        for word in (sched.submit_argv([])[0], sched.cancel_argv("1")[0]):
            if (path := _where(word)) not in jobs:
                jobs.append(path)
    return SudoRule(hub_user, python, tuple(jobs), tuple(_where(c) for c in ("mkdir", "rm")))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m jupyter_hpcdl.spawner.sudoers", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hub-user", required=True, help="the account the hub runs as")
    p.add_argument("--scheduler", action="append", required=True,
                   help="the batch system's adapter (slurm, gridengine, pbs, lsf); repeat for several hubs")
    p.add_argument("--python", default=sys.executable, help="the hub's Python (default: this one)")
    args = p.parse_args(argv)
    try:
        sys.stdout.write(sudoers_text(rule_for(args.hub_user, args.scheduler, args.python)))
    except ValueError as e:
        print(f"{p.prog}: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
