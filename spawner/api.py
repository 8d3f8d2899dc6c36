"""The hub's API for jobs and forms.

- ``POST /hub/api/hpcdl/callback``: the job tells the hub the one thing it may — the port its server listens on —
  with the server's own token. Exactly ``{"port": <1..65535>}`` is accepted; anything else is refused and changes
  nothing. The node comes from the scheduler, never from the job.
- ``POST /hub/api/batchspawner``: batchspawner 1.3.0's route sets *any* spawner attribute the JSON body names
  (including commands the hub later runs) for anyone holding the job's token. In a hub with HpcdlSpawner, the
  hardened callback above answers that route in its place (``hub.install`` puts these routes in front of the
  hub's own); it still serves plain batchspawner spawners: their job wrapper only ever sends the port, and only
  ``port`` is set. Importing this module changes no route.
- ``GET /hub/api/hpcdl/preview``: the exact batch script and GPU-hours for the form's current values, for the
  user's default server or one of their named servers (404 for any other name: it never creates a server).
"""
from __future__ import annotations

import hashlib
import json

from jupyterhub.apihandlers import APIHandler
from tornado import web

BATCHSPAWNER_ROUTE = r"/api/batchspawner"


def token_digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def parse_callback(body: object) -> int:
    """The port from a callback body, or ValueError saying what is accepted."""
    if not isinstance(body, dict) or set(body) != {"port"}:
        raise ValueError('the callback accepts exactly {"port": <1-65535>} and nothing else')
    port = body["port"]
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        raise ValueError("port must be a whole number from 1 to 65535")
    return port


class CallbackHandler(APIHandler):
    @web.authenticated
    async def post(self):
        user = self.current_user
        token = self.get_auth_token()
        if token is None or not hasattr(user, "spawners"):
            raise web.HTTPError(403, "only a server's own token may report its port")
        try:
            port = parse_callback(json.loads(self.request.body or b"null"))
        except (ValueError, json.JSONDecodeError) as e:
            raise web.HTTPError(400, str(e))
        digest = token_digest(token)
        for spawner in user.spawners.values():
            accept = getattr(spawner, "accept_port", None)
            if accept is not None:
                accepted = accept(digest, port)
            else:  # plain batchspawner: its own wrapper reports the port, and only the port is set
                accepted = hasattr(spawner, "job_id") and getattr(spawner, "api_token", None) == token
                if accepted:
                    spawner.port = port
            if accepted:
                self.set_status(201)
                self.finish(json.dumps({"message": f"port {port} recorded"}))
                return
        raise web.HTTPError(409, "no server of this user is waiting for this token's job")


class PreviewHandler(APIHandler):
    @web.authenticated
    async def get(self):
        user = self.current_user
        name = self.get_argument("server_name", "")
        if not hasattr(user, "spawners"):
            raise web.HTTPError(403, "only users have spawn forms")
        if name and name not in user.orm_spawners:  # looking it up would create it (past allow_named_servers)
            raise web.HTTPError(404, f"you have no server named {name!r}")
        spawner = user.spawners[name]
        preview = getattr(spawner, "preview", None)
        if preview is None:
            raise web.HTTPError(404, "this server's spawner has no preview")
        raw = {k: v[0].decode() for k, v in self.request.arguments.items() if k not in ("server_name", "_xsrf")}
        try:
            self.finish(json.dumps(preview(raw)))
        except ValueError as e:
            raise web.HTTPError(400, str(e))


def hardened_routes() -> list[tuple[str, type[APIHandler]]]:
    """This module's API routes, relative to the hub's prefix: the callback under both names, the preview."""
    return [(r"/api/hpcdl/callback", CallbackHandler), (BATCHSPAWNER_ROUTE, CallbackHandler),
            (r"/api/hpcdl/preview", PreviewHandler)]
