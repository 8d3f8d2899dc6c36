"""The doctor's checks on the hub host: the batch system answers, the hub's API answers, the hub's sudo rule is
the one it needs; and how the doctor runs a command as the user (:class:`Target`)."""
from __future__ import annotations

import os
import pwd
import subprocess
from dataclasses import dataclass

from jupyter_hpcdl.batchsystems.scheduler import Scheduler
from jupyter_hpcdl.spawner.commands import as_user
from jupyter_hpcdl.spawner.sudoers import rule_for, user_commands

from .probe import check_hub
from .report import FAIL, OK, SKIP, Finding

KEEP_ENV = ("SLURM_CONF",)  # kept through the exec prefix when the doctor has them


@dataclass(frozen=True)
class Target:
    """Who the node checks run as, and how the doctor becomes them (an empty prefix: it already is them)."""

    user: str
    home: str
    prefix: tuple[str, ...]


def run_cli(argv: list[str], env: dict[str, str], timeout: float,
            input: str | None = None) -> subprocess.CompletedProcess:
    """A batch system's command, its output taken."""
    return subprocess.run(argv, env=env, input=input, capture_output=True, text=True, timeout=timeout)


def become(target: Target, env_names: tuple[str, ...] = ()) -> list[str]:
    """The prefix that runs a command as ``target``, keeping ``env_names`` (none: the doctor already is them)."""
    return as_user(target.prefix, target.user, env_names) if target.prefix else []


def check_scheduler(sched: Scheduler, target: Target, env: dict, partition: str, timeout: float) -> Finding:
    argv = [*become(target, tuple(n for n in KEEP_ENV if n in env)), *sched.availability_argv()]
    try:
        r = run_cli(argv, env, timeout)
    except FileNotFoundError:
        return Finding("batch system", FAIL, f"{sched.availability_argv()[0]} ({sched.name}) not found on the hub host",
                       f"install {sched.name}'s client commands on the hub host and put them on the hub's PATH")
    except subprocess.TimeoutExpired:
        return Finding("batch system", FAIL, f"{' '.join(sched.availability_argv()[:1])} did not answer in {timeout:.0f} s",
                       f"is the {sched.name} controller up and reachable from the hub host (Slurm: scontrol ping)?")
    if r.returncode:
        return Finding("batch system", FAIL, f"{sched.availability_argv()[0]} failed (exit {r.returncode}): "
                       f"{(r.stderr or r.stdout).strip()[-300:]}",
                       f"check {sched.name}'s configuration on the hub host (Slurm: SLURM_CONF, munge) and that "
                       f"{target.user} may use it")
    avail = sched.parse_availability(r.stdout)
    if partition not in avail:
        return Finding("batch system", FAIL, f"partition {partition!r} of the site profile is unknown to {sched.name} "
                       f"(it has: {', '.join(sorted(avail)) or 'none'})", "fix c.SiteProfile.partitions")
    a = avail[partition]
    return Finding("batch system", OK, f"{sched.name} answers: partition {partition}: {a.nodes} nodes "
                   f"({a.idle_nodes} idle), {a.gpus} GPUs ({a.idle_gpus} free)")


def check_hub_api(url: str) -> Finding:
    status, error = check_hub(url, timeout=5)
    if error:
        return Finding("hub API", FAIL, f"{url} does not answer on the hub host: {error}",
                       "start the hub, or fix c.JupyterHub.hub_ip / hub_port / hub_connect_url (or --hub-url)")
    how = f"HTTP {status}" if status else "TLS, and asks for a client certificate: internal_ssl"
    return Finding("hub API", OK, f"{url} answers ({how})")


def check_sudo_rule(hub_user: str | None, user: str, sched: Scheduler, timeout: float) -> Finding:
    """Whether the hub's account may run, as ``user``, each command the hub runs as a user (``sudo -l -U``, as
    root), keeping variables (SETENV), and not a shell, nor anything as root."""
    if os.geteuid() != 0:
        return Finding("sudo rule", SKIP, "not checked: only root may list another account's sudo rights")
    if user == "root":
        return Finding("sudo rule", SKIP, "not checked: it is checked for a user", "give --user USER")
    if not hub_user:
        return Finding("sudo rule", SKIP, "not checked: the hub's account is not known",
                       "give --hub-user (the account the hub runs as)")
    try:
        pwd.getpwnam(hub_user)
        rule = rule_for(hub_user, [sched.name])
    except KeyError:
        return Finding("sudo rule", FAIL, f"there is no account {hub_user!r}", "give the hub's account as --hub-user")
    except ValueError as e:
        return Finding("sudo rule", FAIL, str(e), "install the batch system's client where sudo looks for it")
    fix = f"install the rule of `python -m jupyter_hpcdl.spawner.sudoers --hub-user {hub_user} --scheduler " \
          f"{sched.name}` in /etc/sudoers.d/ (docs/admin.md)"

    def allowed(runas: str, argv: list[str]) -> bool:
        r = subprocess.run(["sudo", "-n", "-l", "-U", hub_user, "-u", runas, *argv], capture_output=True, text=True,
                           timeout=timeout)
        return r.returncode == 0

    try:
        missing = [" ".join(argv) for argv in user_commands(rule)
                   if not allowed(user, argv + (["x"] if argv[0] == rule.python else []))]
        listing = subprocess.run(["sudo", "-n", "-l", "-U", hub_user], capture_output=True, text=True,
                                 timeout=timeout).stdout
        too_much = [what for what, runas, argv in (("a shell as the users", user, ["/bin/sh"]),
                                                   ("commands as root", "root", [rule.job_commands[0]]))
                    if allowed(runas, argv)]
    except (OSError, subprocess.TimeoutExpired) as e:
        return Finding("sudo rule", FAIL, f"sudo -l did not answer: {e}", "is sudo installed on the hub host?")
    if missing:
        return Finding("sudo rule", FAIL, f"{hub_user} may not run as {user}: {'; '.join(missing)}", fix)
    if "SETENV" not in listing:
        return Finding("sudo rule", FAIL, f"{hub_user}'s rule does not keep variables (no SETENV): the hub's "
                       "sudo --preserve-env is refused", fix)
    if too_much:
        return Finding("sudo rule", FAIL, f"{hub_user} may run {' and '.join(too_much)}: more than the hub needs",
                       f"narrow its rule to the one of {fix.removeprefix('install the rule of ')}")
    return Finding("sudo rule", OK, f"{hub_user} may run what the hub runs as {user}, and not as root")
