"""The instructor's page: a JupyterHub service (started and proxied by the hub) that shows, for the members of a
workshop's group, who runs what and how far — the server's state, partition and resources, the job, its nodes and
walltime left, and the training session's state, ranks, loss and throughput. It reloads itself every 10 s;
``api/status`` gives the same as JSON.

Who may see it is JupyterHub's to say: the service admits users (and their tokens) holding the scope
``access:services!service=<name>``, e.g. through an ``instructor`` role. What it reads it reads with its own token,
whose role the site grants (``read:groups``, ``read:users``, ``read:servers``, and ``access:servers!user=<name>``
for each attendee: single-user servers do not resolve ``!group=`` filters, a documented limit of JupyterHub):

    c.JupyterHub.services = [{"name": "hpcdl-workshop", "url": "http://127.0.0.1:10101", "oauth_no_confirm": True,
                              "command": [sys.executable, "-m", "jupyter_hpcdl.workshop.service", "--group", "workshop"]}]
    c.JupyterHub.load_roles = [
        {"name": "hpcdl-workshop", "services": ["hpcdl-workshop"],
         "scopes": ["read:groups", "list:users", "read:users", "read:servers",
                    *[f"access:servers!user={name}" for name in attendees]]},
        {"name": "instructor", "users": ["teacher"], "scopes": ["access:services!service=hpcdl-workshop"]}]
"""
from __future__ import annotations

import argparse
import asyncio
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

from .hub import HubAPI, HubError
from .status import collect, render_page


class _Page(HubOAuthenticated, web.RequestHandler):
    def initialize(self, api: HubAPI, group: str) -> None:
        self.api, self.group = api, group

    async def rows(self):
        try:
            return await asyncio.to_thread(collect, self.api, self.group)
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


def make_app(api: HubAPI, group: str, prefix: str) -> web.Application:
    args = {"api": api, "group": group}
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
                   help="the hub's public URL (the proxy), through which the attendees' servers are reached")
    p.add_argument("--no-exit-with-hub", dest="exit_with_hub", action="store_false",
                   help="keep running when the hub that started this service ends (by default a service the hub "
                        "manages ends with it)")
    args = p.parse_args(argv)
    if args.exit_with_hub and os.environ.get("JUPYTERHUB_SERVICE_NAME"):  # a service the hub started and manages
        end_with_parent()
    url = urlsplit(os.environ["JUPYTERHUB_SERVICE_URL"])
    app = make_app(HubAPI(args.hub_url, os.environ["JUPYTERHUB_API_TOKEN"]), args.group,
                   os.environ.get("JUPYTERHUB_SERVICE_PREFIX", "/services/hpcdl-workshop/"))
    app.listen(url.port or 80, url.hostname or "127.0.0.1")  # the address the hub gave: loopback on the bed
    ioloop.IOLoop.current().start()
    return 0


if __name__ == "__main__":
    sys.exit(main())
