"""Jupyter server extension: inside a batch job, run the allocation's owner (see allocation.py) on a Unix socket in
the user's private job directory, so that kernels (inside containers) can ask it for engines and report their
training session; and serve ``GET <base_url>jupyter-hpcdl/allocation`` (authenticated) to the JupyterLab panel."""
from __future__ import annotations

import asyncio
import atexit
import json
import os

from jupyter_server.auth.decorator import authorized
from jupyter_server.base.handlers import APIHandler
from jupyter_server.utils import url_path_join
from tornado import web
from tornado.httpserver import HTTPServer
from tornado.netutil import bind_unix_socket

from .allocation import SOCKET_ENV, AllocationOwner, default_socket_path, handle


class _OwnerHandler(web.RequestHandler):
    def initialize(self, owner: AllocationOwner):
        self.owner = owner

    def _answer(self, method: str):
        try:
            body = json.loads(self.request.body or b"{}")
        except ValueError:
            body = None
        status, reply = handle(self.owner, method, self.request.path, body if isinstance(body, dict) else {})
        self.set_status(status)
        self.finish(json.dumps(reply))

    def get(self):
        self._answer("GET")

    def post(self):
        self._answer("POST")

    def put(self):
        self._answer("PUT")

    def delete(self):
        self._answer("DELETE")


class AllocationHandler(APIHandler):
    """The allocation this server runs in, and the training session its kernel reported, for the panel."""

    auth_resource = "hpcdl"

    def initialize(self, owner: AllocationOwner):
        self.owner = owner

    @web.authenticated
    @authorized
    async def get(self):
        status, reply = await asyncio.to_thread(handle, self.owner, "GET", "/allocation", {})
        self.set_status(status)
        self.finish(json.dumps(reply))


def _jupyter_server_extension_points():
    return [{"module": "jupyter_hpcdl.serverext"}]


def _load_jupyter_server_extension(serverapp):
    owner = AllocationOwner()
    route = url_path_join(serverapp.web_app.settings["base_url"], "jupyter-hpcdl", "allocation")
    serverapp.web_app.add_handlers(".*$", [(route, AllocationHandler, {"owner": owner})])
    if not owner.job_id:
        serverapp.log.info("jupyter_hpcdl: not inside a batch job; no allocation owner")
        return
    path = os.environ.get(SOCKET_ENV) or default_socket_path(owner.job_id)
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    os.chmod(os.path.dirname(path), 0o700)
    server = HTTPServer(web.Application([(r"/.*", _OwnerHandler, {"owner": owner})]))
    server.add_socket(bind_unix_socket(path, mode=0o600))
    os.environ[SOCKET_ENV] = path  # kernels started from now on find it (passed into containers by name)
    serverapp.web_app.settings["hpcdl_allocation_owner"] = owner
    atexit.register(owner.stop_all)  # the job ends: its engine steps and the jobs it submitted end with it
    serverapp.log.info("jupyter_hpcdl: allocation owner for job %s at %s", owner.job_id, path)
