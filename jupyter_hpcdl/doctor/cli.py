"""``hpcdl-doctor``: run on the hub host (as root, naming a user, or as that user). It checks the hub side, then
submits one small job as the user and reads what the probe found on the node. ``--json`` for scripts; the exit status
is 1 when a check failed."""
from __future__ import annotations

import argparse
import math
import os
import pwd
import secrets
import shlex
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from importlib.metadata import PackageNotFoundError, requires

from traitlets.config import Config
from traitlets.config.loader import PyFileConfigLoader

from jupyter_hpcdl import __version__
from jupyter_hpcdl.backends import load_backend
from jupyter_hpcdl.containers.site import DEFAULT_SITE_CONFIG, SITE_CONFIG_ENV, load_site
from jupyter_hpcdl.spawner.commands import as_user
from jupyter_hpcdl.batchsystems.scheduler import JobRequest
from jupyter_hpcdl.spawner.profile import Profile, SiteProfile
from jupyter_hpcdl.spawner.sudoers import rule_for, user_commands
from jupyter_hpcdl.batchsystems.scheduler import ENDED, Scheduler, load_scheduler

from .assess import Expected, assess_node
from .exchange import DEFAULT_PARENT, ExchangeError, collect, prepare, remove, run_as
from .facts import NodeFacts, ProbeRequest, facts_from_json
from .probe import check_hub
from .report import FAIL, OK, SKIP, Finding, exit_code, render_json, render_text

DEFAULT_EXEC_PREFIX = ["sudo", "-n", "-u", "{username}"]
JOB_ENV = ("PATH", "HOME", "USER", "LANG")
KEEP_ENV = ("SLURM_CONF",)  # kept through the exec prefix when the doctor has them


@dataclass(frozen=True)
class Target:
    """Who the node checks run as, and how the doctor becomes them (an empty prefix: it already is them)."""

    user: str
    home: str
    prefix: tuple[str, ...]


def load_hub_config(path: str) -> Config:
    return PyFileConfigLoader(os.path.basename(path), os.path.dirname(os.path.abspath(path))).load_config()


def hub_api_url(cfg: Config) -> str:
    """The URL a job reports to, as JupyterHub derives it from its configuration."""
    hub = cfg.JupyterHub
    if hub.get("hub_connect_url"):
        return str(hub.hub_connect_url).rstrip("/") + "/api"
    ip = hub.get("hub_connect_ip") or hub.get("hub_ip") or "127.0.0.1"
    base = str(hub.get("base_url") or "/").rstrip("/") + "/"
    scheme = "https" if hub.get("internal_ssl") else "http"
    return f"{scheme}://{ip}:{hub.get('hub_port') or 8081}{base}hub/api"


def expected(without_stack: frozenset[str] = frozenset()) -> Expected:
    try:
        pin = load_backend().pinned_version(requires("jupyter-hpcdl") or ())
    except PackageNotFoundError:
        pin = None
    return Expected(hpcdl_version=__version__, pinned=pin, without_stack=without_stack)


def _run(argv: list[str], env: dict[str, str], timeout: float, input: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(argv, env=env, input=input, capture_output=True, text=True, timeout=timeout)


def check_scheduler(sched: Scheduler, target: Target, env: dict, partition: str, timeout: float) -> Finding:
    argv = [*_become(target, tuple(n for n in KEEP_ENV if n in env)), *sched.availability_argv()]
    try:
        r = _run(argv, env, timeout)
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


def job_script(sched: Scheduler, req: JobRequest, python: str, work: str, home: str) -> str:
    header = sched.header(req, "hpcdl-doctor", f"{work}/job.out", home)
    probe = [python, "-m", "jupyter_hpcdl.doctor.probe", f"{work}/request.json"]
    return "\n".join(["#!/bin/bash", *header, "exec " + " ".join(shlex.quote(a) for a in probe)]) + "\n"


def _cancel(sched: Scheduler, target: Target, env: dict, job_id: str) -> None:
    try:
        _run([*_become(target), *sched.cancel_argv(job_id)], env, 30)
    except (OSError, subprocess.TimeoutExpired):
        pass


def wait_for_job(sched: Scheduler, env: dict, job_id: str, timeout: float) -> tuple[bool, str, str]:
    """Poll the queue until ``job_id`` has ended (gone from it, or ENDED) or ``timeout`` passes; return (ended,
    node, last state). A failed or missing first reading is retried, not taken for the end."""
    deadline, node, state, seen, misses = time.monotonic() + timeout, "", "not seen yet", False, 0
    while time.monotonic() < deadline:
        try:
            q = _run(sched.queue_argv(), env, 30)
        except (OSError, subprocess.TimeoutExpired):
            q = None
        if q is not None and q.returncode == 0:
            info = sched.parse_queue(q.stdout).get(job_id)
            if info is None:
                misses += 1
                if seen or misses >= 5:  # gone from the queue (a very short job may never be seen running)
                    return True, node, state
            else:
                seen, state = True, f"{info.state} ({info.reason})" if info.reason else info.state
                node = info.batch_host or node
                if info.phase == ENDED:
                    return True, node, state
        time.sleep(1)
    return False, node, state


def run_node_job(sched: Scheduler, target: Target, env: dict, probe_req: ProbeRequest, req: JobRequest, python: str,
                 work: str, timeout: float) -> tuple[NodeFacts | None, list[Finding]]:
    """Submit the probe, wait for it (at most ``timeout`` s, then cancel it), return its facts. The job never
    outlives the doctor: any way out of the wait before it ended cancels it."""
    script = job_script(sched, req, python, work, target.home)
    names = JOB_ENV + tuple(n for n in KEEP_ENV if n in env)
    why = ""
    try:
        r = _run([*_become(target, names), *sched.submit_argv(names)], env, 60, input=script)
        job_id = sched.parse_submit(r.stdout) if r.returncode == 0 else None
        why = (r.stderr or r.stdout).strip()[-300:]
    except (OSError, subprocess.TimeoutExpired, ValueError) as e:
        job_id, why = None, str(e)
    if job_id is None:
        return None, [Finding("node job", FAIL, f"submitting the doctor's job as {target.user} failed: {why}",
                              f"check that {target.user} may submit to partition {req.partition} with --gres=gpu:"
                              f"{req.gpus_per_node}")]
    ended = False
    try:
        ended, node, state = wait_for_job(sched, env, job_id, timeout)
    finally:
        if not ended:
            _cancel(sched, target, env, job_id)
    if not ended:
        return None, [Finding("node job", FAIL, f"job {job_id} still {state} after {timeout:.0f} s; cancelled",
                              f"are the nodes of partition {req.partition} up and free? (sinfo); or give a longer "
                              "--timeout")]
    found: dict = {}
    for _ in range(10):  # a shared file system may show the file a moment later
        found = run_as(target.user, collect, work)
        if found["result"] is not None:
            break
        time.sleep(0.5)
    if found["result"] is None:
        lines = (found["job_out"] or "").strip().splitlines()[-3:]
        tail = " / ".join(lines) if lines else "no job output"
        return None, [Finding("shared home", FAIL, f"job {job_id} ran{' on ' + node if node else ''} but its result "
                              f"never appeared in {work} on the hub host ({tail})",
                              "home directories (or the doctor's --exchange-dir) must be shared between the hub host "
                              "and the nodes, at the same path, and writable by the user there; also check that "
                              f"{python} exists on the nodes", where=node or "node")]
    try:
        facts = facts_from_json(found["result"])
    except (ValueError, TypeError) as e:
        return None, [Finding("node job", FAIL, f"job {job_id}'s result in {work} is not the probe's: {e}",
                              "check that the nodes run the same jupyter-hpcdl as the hub host", where=node or "node")]
    if facts.nonce != probe_req.nonce:
        return facts, [Finding("shared home", FAIL, f"the result in {work} is not this run's", "run the doctor again",
                               where=facts.node)]
    return facts, [Finding("shared home", OK, f"{work} is shared: the node read the request and the hub host reads "
                           f"the result (job {job_id})", where=facts.node)]


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


def _hub_user(args: argparse.Namespace) -> str | None:
    """The hub's account: --hub-user, else the owner of the hub's configuration file where that is not root."""
    if args.hub_user or not args.hub_config:
        return args.hub_user
    owner = pwd.getpwuid(os.stat(args.hub_config).st_uid).pw_name
    return None if owner == "root" else owner


def _become(target: Target, env_names: tuple[str, ...] = ()) -> list[str]:
    return as_user(target.prefix, target.user, env_names) if target.prefix else []


def _json(req: ProbeRequest) -> str:
    import json
    return json.dumps(asdict(req), indent=2)


def _target(user: str | None, cfg: Config) -> Target:
    me = pwd.getpwuid(os.geteuid()).pw_name
    user = user or me
    entry = pwd.getpwnam(user)
    prefix = () if user == me else tuple(cfg.HpcdlSpawner.get("exec_prefix") or DEFAULT_EXEC_PREFIX)
    return Target(user, entry.pw_dir, prefix)


def doctor(args: argparse.Namespace) -> list[Finding]:
    findings: list[Finding] = []
    cfg = Config()
    if args.hub_config:
        try:
            cfg = load_hub_config(args.hub_config)
            findings.append(Finding("hub config", OK, f"{args.hub_config} loads"))
        except Exception as e:  # a site's Python file: anything can go wrong in it
            return [Finding("hub config", FAIL, f"{args.hub_config} does not load: {type(e).__name__}: {e}",
                            "fix the file (it is JupyterHub's configuration, plain Python)")]
    site_profile = SiteProfile(config=cfg)
    try:
        profile: Profile = site_profile.snapshot()
        findings.append(Finding("site profile", OK, f"partitions {', '.join(profile.partitions)}; images "
                                f"{', '.join(i.ref for i in profile.images.values())}"))
    except (ValueError, KeyError, TypeError) as e:
        return findings + [Finding("site profile", FAIL, str(e), "set c.SiteProfile.partitions and .images in the hub's "
                                   "configuration (docs/admin.md)")]
    site_config = args.site_config or os.environ.get(SITE_CONFIG_ENV) or DEFAULT_SITE_CONFIG
    try:
        site = load_site(site_config)
        findings.append(Finding("site config", OK, f"{site_config}: udocker {site.udocker}, tools "
                                f"{site.tools_dir or '~/.udocker'}, registry {site.registry or 'none'}"))
    except Exception as e:
        return findings + [Finding("site config", FAIL, f"{site_config}: {type(e).__name__}: {e}",
                                   "fix the file: JSON with a ContainerSite section (docs/admin.md)")]
    try:
        target = _target(args.user, cfg)
    except KeyError:
        return findings + [Finding("user", FAIL, f"no such user {args.user!r}", "name an existing user with --user")]
    if os.geteuid() == 0 and target.user == "root" and not args.no_job:
        return findings + [Finding("user", FAIL, "the node checks run as a user, not root",
                                   "give --user USER (a user who may submit jobs and has access to the images)")]
    try:
        sched = load_scheduler(site_profile.scheduler, config=cfg)  # with the site's directives and names
    except ValueError as e:
        return findings + [Finding("batch system", FAIL, str(e), "set c.SiteProfile.scheduler to an installed adapter")]
    partition = args.partition or next(iter(profile.partitions))
    python = args.python or cfg.HpcdlSpawner.get("python") or sys.executable
    env = {"PATH": f"{os.path.dirname(python)}:/usr/local/bin:/usr/bin:/bin", "HOME": target.home,
           "USER": target.user, "LANG": "C.UTF-8"}
    env.update({n: os.environ[n] for n in KEEP_ENV if n in os.environ})
    batch = check_scheduler(sched, target, env, partition, args.cli_timeout)
    url = args.hub_url or hub_api_url(cfg)
    findings += [batch, check_hub_api(url), check_sudo_rule(_hub_user(args), target.user, sched, args.cli_timeout)]
    if args.no_job:
        return findings
    if batch.status == FAIL:
        return findings + [Finding("node checks", SKIP, "not run: the batch system does not answer")]
    images = tuple(args.image) or tuple(i.ref for i in profile.images.values())
    # the catalogue's own word that an image has no training stack; an image asked for by --image is checked whole
    without_stack = frozenset() if args.image else frozenset(i.ref for i in profile.images.values() if not i.training)
    timeout = args.timeout or 120 + args.step_timeout * (3 * len(images) + 2)  # pull, create, run per image
    nonce = secrets.token_hex(8)
    work = os.path.join(args.exchange_dir or os.path.join(target.home, DEFAULT_PARENT.removeprefix("~/")), nonce)
    probe_req = ProbeRequest(nonce=nonce, hub_url=url, result=f"{work}/result.json", images=images, gpus=args.gpus,
                             site_config=site_config if os.path.exists(site_config) else None,
                             step_timeout=args.step_timeout)
    try:
        run_as(target.user, prepare, args.exchange_dir, nonce, _json(probe_req))
    except ExchangeError as e:
        return findings + [Finding("shared home", FAIL, f"cannot prepare the exchange directory {work} as "
                                   f"{target.user}: {e}", "the user's home (or --exchange-dir) must exist and be "
                                   "writable by them")]
    try:
        req = JobRequest(partition=partition, nodes=1, gpus_per_node=args.gpus,
                         walltime_minutes=max(5, math.ceil(timeout / 60) + 1), image="doctor", image_ref=images[0])
        facts, found = run_node_job(sched, target, env, probe_req, req, python, work, timeout)
        findings += found
        if facts is not None:
            findings += assess_node(facts, expected(without_stack), site.registry)
    except ExchangeError as e:
        findings.append(Finding("shared home", FAIL, f"the exchange directory {work}: {e}",
                                "the user's home (or --exchange-dir) must be writable by them"))
    finally:
        run_as(target.user, remove, work)
    return findings


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hpcdl-doctor", description=__doc__)
    p.add_argument("-f", "--hub-config", help="the hub's jupyterhub_config.py (site profile, hub URL, job Python)")
    p.add_argument("--site-config", help=f"the container settings (default ${SITE_CONFIG_ENV} or {DEFAULT_SITE_CONFIG})")
    p.add_argument("--user", help="run the node checks as this user (required as root)")
    p.add_argument("--hub-user", help="the account the hub runs as, whose sudo rule is checked (default: the owner "
                   "of the hub's configuration file, where that is not root)")
    p.add_argument("--partition", help="partition for the doctor's job (default: the profile's first)")
    p.add_argument("--gpus", type=int, default=1, help="GPUs the doctor's job asks for (default 1; at least 1)")
    p.add_argument("--image", action="append", default=[], help="check this image instead of the catalogue (repeatable)")
    p.add_argument("--hub-url", help="the hub API URL jobs report to (default: from the hub config)")
    p.add_argument("--python", help="the nodes' Python with jupyter-hpcdl (default: c.HpcdlSpawner.python)")
    p.add_argument("--exchange-dir", help="shared directory for the job's request and result (default ~USER/.jupyter-hpcdl/doctor)")
    p.add_argument("--timeout", type=float, help="seconds the job may take, queue included, then it is cancelled "
                   "(default: 120 + step-timeout x (3 x images + 2))")
    p.add_argument("--step-timeout", type=float, default=180, help="seconds for each step on the node")
    p.add_argument("--cli-timeout", type=float, default=20, help="seconds the batch system's CLI may take to answer")
    p.add_argument("--no-job", action="store_true", help="only the hub host's checks")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.gpus < 1:
        print("hpcdl-doctor: error: --gpus must be at least 1", file=sys.stderr)
        return 2
    findings = doctor(args)
    print(render_json(findings) if args.json else render_text(findings))
    return exit_code(findings)


if __name__ == "__main__":
    sys.exit(main())
