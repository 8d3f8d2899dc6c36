"""Jupyter server extension: inside a batch job, run the allocation's owner (see allocation.py) on a Unix socket in
the user's private job directory, so that kernels (inside containers) can ask it for engines and report their
training session; serve ``GET <base_url>jupyter-hpcdl/allocation`` (authenticated) to the JupyterLab panel, and
``POST <base_url>jupyter-hpcdl/notebooks``, which copies the package's notebooks into the server's root directory
(see material.py); and
have the server accept on the socket the job chose its port with, so that the port is never free for another user.

Both handlers are coroutines that await the owner's router on the server's own event loop: the owner's commands are
asyncio subprocesses, so a slow ``sbatch`` blocks only the request that asked for it, never the rest of the lab, and
the loop alone touches the owner's state (no threads)."""
from __future__ import annotations

import asyncio
import atexit
import json
import os
import socket

from jupyter_server.auth.decorator import authorized
from jupyter_server.base.handlers import APIHandler
from jupyter_server.utils import url_path_join
from tornado import web
from tornado.httpserver import HTTPServer
from tornado.netutil import bind_unix_socket

from .material import NOTEBOOKS_DIR, copy_notebooks
from .allocation import AllocationOwner
from .owner import SOCKET_ENV, default_socket_path
from .ownerapi import handle

#: The descriptor of the socket the job listens on the server's port with (set by the job; the server accepts on it).
HELD_PORT_ENV = "HPCDL_HELD_PORT_FD"


class _OwnerHandler(web.RequestHandler):
    def initialize(self, owner: AllocationOwner) -> None:
        self.owner = owner

    async def _answer(self, method: str) -> None:
        try:
            body = json.loads(self.request.body or b"{}")
        except ValueError:
            body = None
        status, reply = await handle(self.owner, method, self.request.path, body if isinstance(body, dict) else {})
        self.set_status(status)
        self.finish(json.dumps(reply))

    async def get(self) -> None:
        await self._answer("GET")

    async def post(self) -> None:
        await self._answer("POST")

    async def put(self) -> None:
        await self._answer("PUT")

    async def delete(self) -> None:
        await self._answer("DELETE")


class AllocationHandler(APIHandler):
    """The allocation this server runs in, and the training session its kernel reported, for the panel."""

    auth_resource = "hpcdl"

    def initialize(self, owner: AllocationOwner) -> None:
        self.owner = owner

    @web.authenticated
    @authorized
    async def get(self) -> None:
        status, reply = await handle(self.owner, "GET", "/allocation", {})
        self.set_status(status)
        self.finish(json.dumps(reply))


class NotebooksHandler(APIHandler):
    """Copy the package's notebooks into ``hpcdl-notebooks/`` of the server's root directory, keeping what is there;
    the answer says what was copied and kept, and the first notebook's path (relative to the root)."""

    auth_resource = "hpcdl"

    @web.authenticated
    @authorized
    async def post(self) -> None:
        root = os.path.expanduser(self.settings.get("server_root_dir") or "~")
        try:
            result = await asyncio.to_thread(copy_notebooks, os.path.join(root, NOTEBOOKS_DIR))
        except OSError as e:
            self.set_status(500)
            self.finish(json.dumps({"message": f"could not copy the notebooks into ~/{NOTEBOOKS_DIR}: {e}"}))
            return
        reply = result.as_dict()
        reply.update(directory=NOTEBOOKS_DIR, first=os.path.relpath(reply["first"], root),
                     message=" ".join(result.lines()))
        self.finish(json.dumps(reply))


def serve_owner(owner: AllocationOwner, path: str) -> HTTPServer:
    """Serve the owner's API on a Unix socket at ``path`` (mode 0600, in a directory of mode 0700) on the current
    event loop."""
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    os.chmod(os.path.dirname(path), 0o700)
    server = HTTPServer(web.Application([(r"/.*", _OwnerHandler, {"owner": owner})]))
    server.add_socket(bind_unix_socket(path, mode=0o600))
    return server


def _jupyter_server_extension_points():
    return [{"module": "jupyter_hpcdl.job.serverext"}]


def serve_on_held_socket(serverapp, fd: int) -> None:
    """Have ``serverapp`` accept on the listening socket ``fd`` that the job chose its port with (see server.py)
    instead of binding the port anew, which would leave it free for a moment. Where that cannot be (``fd`` is not a
    listening socket, or this Jupyter Server binds otherwise, e.g. on a Unix socket) the server stops with a
    message: serving where another user could have been first is not an option."""
    why = ""
    try:
        held = socket.socket(fileno=fd)
    except OSError as e:
        held, why = None, f"{HELD_PORT_ENV}={fd} is not a socket ({e})"
    if held is not None and not held.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
        why = f"the job's socket {held} is not listening"
    elif held is not None and (serverapp.sock or not all(
            callable(getattr(serverapp, name, None)) for name in ("_find_http_port", "_bind_http_server_tcp"))):
        why = f"this Jupyter Server ({type(serverapp).__name__}) does not bind a TCP port the way it knows"
    if why:
        serverapp.log.critical("jupyter_hpcdl: %s; the server stops rather than bind a port another user could "
                               "take first (the job, python -m jupyter_hpcdl.job.server, passes a listening socket in %s)", why,
                               HELD_PORT_ENV)
        raise SystemExit(1)  # the extension manager turns exceptions into warnings, not this
    held.set_inheritable(False)  # kernels and what they start do not hold the server's port
    held.setblocking(False)
    port = held.getsockname()[1]
    if serverapp.port != port:
        serverapp.log.warning("jupyter_hpcdl: serving on the job's port %s, not %s", port, serverapp.port)
        serverapp.port = port

    def bind_tcp() -> bool:
        serverapp.http_server.add_sockets([held])
        return True

    serverapp._find_http_port = lambda: None  # the port is chosen and held already
    serverapp._bind_http_server_tcp = bind_tcp


def _load_jupyter_server_extension(serverapp):
    held = os.environ.pop(HELD_PORT_ENV, "")
    if held.isdigit():
        serve_on_held_socket(serverapp, int(held))
    owner = AllocationOwner()
    base = url_path_join(serverapp.web_app.settings["base_url"], "jupyter-hpcdl")
    serverapp.web_app.add_handlers(".*$", [(url_path_join(base, "allocation"), AllocationHandler, {"owner": owner}),
                                           (url_path_join(base, "notebooks"), NotebooksHandler)])
    if not owner.job_id:
        serverapp.log.info("jupyter_hpcdl: not inside a batch job; no allocation owner")
        return
    path = os.environ.get(SOCKET_ENV) or default_socket_path(owner.job_id)
    serve_owner(owner, path)
    os.environ[SOCKET_ENV] = path  # kernels started from now on find it (passed into containers by name)
    serverapp.web_app.settings["hpcdl_allocation_owner"] = owner
    atexit.register(owner.stop_all_sync)  # the job ends: its engine steps and the jobs it submitted end with it
    serverapp.log.info("jupyter_hpcdl: allocation owner for job %s at %s", owner.job_id, path)
