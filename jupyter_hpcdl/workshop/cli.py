"""``hpcdl-workshop``: prepare a workshop's attendees ahead of time, see how they are doing, clean up after.

Run by the hub's administrator, where the hub runs, with the spawner's way of acting as a user (``--exec-prefix``,
by default ``sudo -n -u {username}``) and a hub token with ``admin:groups`` and ``admin:servers`` (which includes
the servers' state, where the spawner keeps each job's id) in ``JUPYTERHUB_API_TOKEN``::

    hpcdl-workshop prepare --attendees room.txt --group workshop --image hpcdl/os:latest --material notebooks/
    hpcdl-workshop status --group workshop --scheduler slurm   # the instructor's page shows the same, live
    hpcdl-workshop cleanup --group workshop         # servers stopped (their jobs end), the group emptied
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from jupyter_hpcdl.containers.spec import check_image_ref

from ..batchsystems.scheduler import load_scheduler
from ..spawner.commands import as_user
from ..spawner.queue import JobQueue
from .attendees import check_accounts, parse_attendees
from .hub import HubAPI, HubError
from .room import Room
from .status import render_lines

STEP_TIMEOUT_S = 600  # one attendee's pull, container or copy


@dataclass
class Prepared:
    user: str
    seconds: float = 0.0
    copied: list[str] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)
    error: str = ""


def attendee_steps(python: str, image: str, material: str | None, dest: str) -> list[tuple[str, list[str]]]:
    """What runs as each attendee, in order (pure): pull the image, create the container, copy the material."""
    check_image_ref(image)
    steps = [("pull", [python, "-m", "jupyter_hpcdl.containers", "pull", image]),
             ("container", [python, "-m", "jupyter_hpcdl.containers", "ensure", image])]
    if material:
        steps.append(("material", [python, "-m", "jupyter_hpcdl.workshop.place", material, dest]))
    return steps


def prepare_one(user: str, prefix: list[str], steps: list[tuple[str, list[str]]]) -> Prepared:
    done, t0 = Prepared(user), time.monotonic()
    for what, argv in steps:
        try:
            r = subprocess.run([*as_user(prefix, user), *argv], capture_output=True, text=True,
                               timeout=STEP_TIMEOUT_S, cwd="/")
        except subprocess.TimeoutExpired:
            done.error = f"{what}: no end in {STEP_TIMEOUT_S} s ({' '.join(argv[:5])})"
            break
        if r.returncode:
            done.error = f"{what} failed (exit {r.returncode}): {(r.stderr or r.stdout).strip()[-300:]}"
            break
        if what == "material":
            placed = json.loads(r.stdout.strip().splitlines()[-1])
            done.copied, done.kept = placed["copied"], placed["kept"]
    done.seconds = time.monotonic() - t0
    return done


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hpcdl-workshop", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--hub-url", default=os.environ.get("JUPYTERHUB_URL", "http://127.0.0.1:8000"))
    group_help = "the workshop's JupyterHub group (its limits: SiteProfile.limits)"
    p.add_argument("--group", help=group_help)
    each = argparse.ArgumentParser(add_help=False)  # --group also after the command, as the examples write it
    each.add_argument("--group", dest="command_group", metavar="GROUP", help=group_help)
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("prepare", parents=[each], help="pull, create the container, copy the material, add to the group")
    s.add_argument("--attendees", required=True, help="a file with one user name per line")
    s.add_argument("--image", required=True, help="the image reference every attendee needs, e.g. hpcdl/os:latest")
    s.add_argument("--material", help="a directory (readable by the attendees) copied into each home")
    s.add_argument("--dest", default="~/workshop", help="where in each home the material goes (default ~/workshop)")
    s.add_argument("--python", default=sys.executable, help="the jupyter-hpcdl environment's Python")
    s.add_argument("--exec-prefix", default="sudo -n -u {username}", help="how to run a command as an attendee")
    s.add_argument("--parallel", type=int, default=4, help="attendees prepared at once")
    t = sub.add_parser("status", parents=[each], help="who runs what: servers, jobs, walltime left")
    t.add_argument("--json", action="store_true")
    t.add_argument("--scheduler", default="slurm",
                   help="the batch system's adapter, as the spawner names it (slurm, gridengine, pbs, lsf)")
    c = sub.add_parser("cleanup", parents=[each], help="stop the group's servers (their jobs end) and empty the group")
    c.add_argument("--keep-group", action="store_true", help="stop the servers but keep the members")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    args.group = args.command_group or args.group
    if not args.group:
        parser.error("the workshop's group is needed: --group NAME")
    try:
        api = HubAPI(args.hub_url, os.environ.get("JUPYTERHUB_API_TOKEN", ""))
        if args.cmd == "prepare":
            return _prepare(api, args)
        if args.cmd == "status":
            rows = asyncio.run(Room(api, args.group, JobQueue(load_scheduler(args.scheduler), timeout=15.0)).rows())
            if args.json:
                print(json.dumps([r.as_dict() for r in rows], indent=1))
            else:
                print("\n".join(render_lines(rows)))
            return 0
        members = api.members(args.group)
        with ThreadPoolExecutor(8) as pool:
            stopped = dict(zip(members, pool.map(api.stop_servers, members)))
        if not args.keep_group:
            api.remove_members(args.group, members)
        print(f"stopped {sum(map(len, stopped.values()))} server(s) of {len(members)} attendee(s)"
              + ("" if args.keep_group else f"; group {args.group} emptied"))
        return 0
    except (HubError, ValueError, OSError) as e:
        print(f"hpcdl-workshop: error: {e}", file=sys.stderr)
        return 2


def _prepare(api: HubAPI, args) -> int:
    names = parse_attendees(Path(args.attendees).read_text())
    missing = check_accounts(names)
    if missing:
        raise ValueError(f"no account on this machine for: {', '.join(missing)} (the hub's users are Unix users)")
    material = str(Path(args.material).resolve()) if args.material else None
    steps = attendee_steps(args.python, args.image, material, args.dest)
    prefix = shlex.split(args.exec_prefix)
    with ThreadPoolExecutor(max(1, args.parallel)) as pool:
        results = list(pool.map(lambda user: prepare_one(user, prefix, steps), names))
    ready = [r.user for r in results if not r.error]
    api.ensure_users(ready)
    api.ensure_group(args.group)
    api.add_members(args.group, ready)
    for r in results:
        print(json.dumps({"user": r.user, "ok": not r.error, "seconds": round(r.seconds, 1), "copied": len(r.copied),
                          "kept": len(r.kept), **({"error": r.error} if r.error else {})}))
    failed = [r.user for r in results if r.error]
    print(f"{len(ready)} of {len(names)} attendee(s) ready in group {args.group}"
          + (f"; not ready: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
