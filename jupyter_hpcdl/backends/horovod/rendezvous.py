"""The session's Gloo rendezvous: Horovod's own key-value store (its scopes and its clean-up when ranks finish),
bound to the one address the ranks use and guarded by a per-session secret, since Horovod's server listens on every
interface and answers anyone.

Horovod's C++ client cannot send a header, but it builds each URL as ``http://{ADDR}:{PORT}/{scope}/{key}`` from
``HOROVOD_GLOO_RENDEZVOUS_ADDR``; with ADDR set to ``host:port/secret`` every request's path starts with
``/secret:port/``, which the handler checks (constant-time) and strips. The secret travels only in the ranks'
environment (readable by their owner alone), never on a command line or in a file."""
from __future__ import annotations

import hmac
import secrets
import threading

from horovod.runner.http.http_server import RendezvousHandler, RendezvousHTTPServer

FORBIDDEN = 403


class _GuardedHandler(RendezvousHandler):
    def _admit(self) -> bool:
        first, _, rest = self.path.lstrip("/").partition("/")
        given = first.rsplit(":", 1)[0]
        if rest and hmac.compare_digest(given.encode(), self.server.secret.encode()):
            self.path = "/" + rest
            return True
        self.send_status_code(FORBIDDEN)
        return False

    def do_GET(self):
        if self._admit():
            super().do_GET()

    def do_PUT(self):
        if self._admit():
            super().do_PUT()

    def do_DELETE(self):
        if self._admit():
            super().do_DELETE()

    def do_POST(self):
        self.send_status_code(FORBIDDEN)

    do_HEAD = do_POST


class _Server(RendezvousHTTPServer):
    daemon_threads = True


class SessionRendezvous:
    """Horovod's rendezvous for one session: ``start()``, ``init(plan)`` for each new world, ``stop()``."""

    def __init__(self, bind: str):
        self.bind = bind
        self.secret = secrets.token_urlsafe(24)
        self._httpd: _Server | None = None
        self._thread: threading.Thread | None = None
        self.port = 0

    def start(self) -> int:
        self._httpd = _Server((self.bind, 0), _GuardedHandler, 0)
        self._httpd.secret = self.secret
        self.port = self._httpd.server_address[1]
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="hpcdl-rendezvous", daemon=True)
        self._thread.start()
        return self.port

    def init(self, host_alloc_plan) -> None:
        self._httpd.init(host_alloc_plan)

    def rank_address(self, addr: str) -> str:
        """The value of HOROVOD_GLOO_RENDEZVOUS_ADDR for the ranks (with HOROVOD_GLOO_RENDEZVOUS_PORT = port)."""
        return f"{addr}:{self.port}/{self.secret}"

    def stop(self, timeout: float = 10) -> None:
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._thread.join(timeout)
            self._httpd = None


__all__ = ["SessionRendezvous", "FORBIDDEN"]
