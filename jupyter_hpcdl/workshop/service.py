"""The instructor's page: a JupyterHub service (started and proxied by the hub) that shows, for the members of a
workshop's group, who runs what — the server's state, partition, resources and image, the job, its state in the
batch system, its first node and the walltime left. It reloads itself every 10 s; ``api/status`` gives the same as
JSON. What it shows comes from the hub's API and one listing of the batch system's queue per refresh, never from an
attendee's server (code the attendee controls, which would get the service's token).

Who may see it is JupyterHub's to say: the service admits users (and their tokens) holding the scope
``access:services!service=<name>``, e.g. through an ``instructor`` role. What it reads it reads with its own token,
whose role the site grants: the group, its members and their servers, and the servers' state (where the spawner
keeps the job's id), for that group only; no access to any server:

    c.JupyterHub.services = [{"name": "hpcdl-workshop", "url": "http://127.0.0.1:10101", "oauth_no_confirm": True,
                              "command": [sys.executable, "-m", "jupyter_hpcdl.workshop.service",
                                          "--group", "workshop", "--scheduler", "slurm"]}]
    c.JupyterHub.load_roles = [
        {"name": "hpcdl-workshop", "services": ["hpcdl-workshop"],
         "scopes": ["read:groups!group=workshop", "read:users!group=workshop", "read:servers!group=workshop",
                    "admin:server_state!group=workshop"]},
        {"name": "instructor", "users": ["teacher"], "scopes": ["access:services!service=hpcdl-workshop"]}]
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import secrets
import signal
import sys
from urllib.parse import urlsplit

from jupyterhub.services.auth import HubOAuthCallbackHandler, HubOAuthenticated
from jupyterhub.utils import url_path_join
from tornado import ioloop, web

from ..batchsystems.scheduler import load_scheduler
from ..spawner.queue import JobQueue
from .hub import HubAPI, HubError
from .room import Room
from .status import render_page


class _Page(HubOAuthenticated, web.RequestHandler):
    def initialize(self, room: Room) -> None:
        self.room, self.group = room, room.group

    async def rows(self):
        try:
            return await self.room.rows()
        except HubError as e:
            raise web.HTTPError(502, f"the hub did not answer the workshop service: {e}") from None


class PageHandler(_Page):
    @web.authenticated
    async def get(self) -> None:
        self.write(render_page(await self.rows(), self.group))


class StatusHandler(_Page):
    @web.authenticated
    async def get(self) -> None:
        self.set_header("Content-Type", "application/json")
        self.write(json.dumps({"group": self.group, "attendees": [r.as_dict() for r in await self.rows()]}))


def make_app(room: Room, prefix: str) -> web.Application:
    args = {"room": room}
    return web.Application([
        (prefix, PageHandler, args),
        (url_path_join(prefix, "api/status"), StatusHandler, args),
        (url_path_join(prefix, "oauth_callback"), HubOAuthCallbackHandler),
    ], cookie_secret=secrets.token_bytes(32))


PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def end_with_parent() -> None:
    """Have the kernel send SIGTERM here when the process that started this one (the hub) ends: a hub that
    crashed or was restarted leaves no copy of the service holding its port. SystemExit if that process is gone
    already (this one was adopted)."""
    parent = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG)")
    if os.getppid() != parent:
        raise SystemExit("hpcdl-workshop service: the hub that started it has ended")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m jupyter_hpcdl.workshop.service", description=__doc__.split("\n\n")[0])
    p.add_argument("--group", required=True, help="the workshop's JupyterHub group")
    p.add_argument("--hub-url", default=os.environ.get("JUPYTERHUB_PUBLIC_URL", "http://127.0.0.1:8000"),
                   help="the hub's URL, whose API the service reads")
    p.add_argument("--scheduler", default="slurm",
                   help="the batch system's adapter, as the spawner names it (slurm, gridengine, pbs, lsf)")
    p.add_argument("--no-exit-with-hub", dest="exit_with_hub", action="store_false",
                   help="keep running when the hub that started this service ends (by default a service the hub "
                        "manages ends with it)")
    args = p.parse_args(argv)
    if args.exit_with_hub and os.environ.get("JUPYTERHUB_SERVICE_NAME"):  # a service the hub started and manages
        end_with_parent()
    url = urlsplit(os.environ["JUPYTERHUB_SERVICE_URL"])
    queue = JobQueue(load_scheduler(args.scheduler), interval=5.0, timeout=15.0)
    room = Room(HubAPI(args.hub_url, os.environ["JUPYTERHUB_API_TOKEN"]), args.group, queue)
    app = make_app(room, os.environ.get("JUPYTERHUB_SERVICE_PREFIX", "/services/hpcdl-workshop/"))
    app.listen(url.port or 80, url.hostname or "127.0.0.1")  # the address the hub gave: loopback on the bed
    ioloop.IOLoop.current().start()
    return 0


if __name__ == "__main__":
    sys.exit(main())
