"""``hpcdl-doctor``: run on the hub host (as root, naming a user, or as that user). It checks the hub side, then
submits one small job as the user and reads what the probe found on the node. ``--json`` for scripts; the exit status
is 1 when a check failed."""
from __future__ import annotations

import argparse
import math
import os
import pwd
import secrets
import sys
from dataclasses import asdict
from importlib.metadata import PackageNotFoundError, requires

from traitlets.config import Config
from traitlets.config.loader import PyFileConfigLoader

from jupyter_hpcdl import __version__
from jupyter_hpcdl.backends import installed, load_backend
from jupyter_hpcdl.batchsystems.scheduler import JobRequest, load_scheduler
from jupyter_hpcdl.containers.site import DEFAULT_SITE_CONFIG, SITE_CONFIG_ENV, load_site
from jupyter_hpcdl.spawner.profile import Profile, SiteProfile

from .assess import Expected, assess_node
from .exchange import DEFAULT_PARENT, ExchangeError, prepare, remove, run_as
from .facts import ProbeRequest
from .hubchecks import KEEP_ENV, Target, check_hub_api, check_scheduler, check_sudo_rule
from .nodejob import run_node_job
from .report import FAIL, OK, SKIP, Finding, exit_code, render_json, render_text

DEFAULT_EXEC_PREFIX = ["sudo", "-n", "-u", "{username}"]


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


def expected(without_stack: frozenset[str] = frozenset(), backends: frozenset[str] = frozenset()) -> Expected:
    """What the hub host's installation expects of the images: its version, and each backend's pinned release
    (the site's default one and ``backends``, those the catalogue's images name)."""
    try:
        requirements = requires("jupyter-hpcdl") or ()
    except PackageNotFoundError:
        requirements = ()
    return Expected(hpcdl_version=__version__, pinned=load_backend().pinned_version(requirements),
                    without_stack=without_stack,
                    pins={name: load_backend(name).pinned_version(requirements) for name in sorted(backends)})


def _hub_user(args: argparse.Namespace) -> str | None:
    """The hub's account: --hub-user, else the owner of the hub's configuration file where that is not root."""
    if args.hub_user or not args.hub_config:
        return args.hub_user
    owner = pwd.getpwuid(os.stat(args.hub_config).st_uid).pw_name
    return None if owner == "root" else owner


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
    # each image's backends, the hub's default where the catalogue names none (the node's may differ)
    default = load_backend().name
    backends = {ref: [default] for ref in images}
    backends.update({i.ref: list(i.backends) for i in profile.images.values() if i.backends and i.ref in images})
    unknown = sorted({n for names in backends.values() for n in names} - set(installed()))
    if unknown:
        findings.append(Finding("site profile", FAIL, f"the catalogue's images name training backends not installed "
                                f"on the hub host: {', '.join(unknown)} (installed: {', '.join(sorted(installed()))})",
                                "install their packages beside jupyter-hpcdl, or correct the images' 'backends' in "
                                "c.SiteProfile.images"))
        backends = {ref: [n for n in names if n not in unknown] for ref, names in backends.items()}
    # pull, create, run per image, and one more run for each backend beyond the first that an image names
    timeout = args.timeout or 120 + args.step_timeout * (
        3 * len(images) + 2 + sum(max(0, len(b) - 1) for b in backends.values()))
    nonce = secrets.token_hex(8)
    work = os.path.join(args.exchange_dir or os.path.join(target.home, DEFAULT_PARENT.removeprefix("~/")), nonce)
    probe_req = ProbeRequest(nonce=nonce, hub_url=url, result=f"{work}/result.json", images=images, gpus=args.gpus,
                             site_config=site_config if os.path.exists(site_config) else None,
                             step_timeout=args.step_timeout, backends=backends)
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
            findings += assess_node(facts, expected(without_stack, frozenset(n for b in backends.values() for n in b)),
                                    site.registry)
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
