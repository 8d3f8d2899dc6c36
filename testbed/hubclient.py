"""A small client for the test bed's hub: REST calls with the test service's token, and code run in a kernel of a
user's server over the kernel websocket (the same path JupyterLab uses). What goes to a user's server (``/user/NAME/``)
carries a token of that user's that reaches only their servers, never the service's: the server is a process the user
controls, and the service's token is the hub's admin."""
from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request
import uuid
import warnings
from pathlib import Path

from tornado.httpclient import HTTPRequest
from tornado.websocket import websocket_connect


class Hub:
    def __init__(self, bed: dict):
        self.url = bed["hub_url"]
        self.token = (Path(bed["hub_dir"]) / "service_token").read_text().strip()
        self._user_tokens: dict[str, str] = {}

    def user_token(self, user: str) -> str:
        """A token of ``user``'s (made once, by the service, for 4 hours) that reaches only ``user``'s servers."""
        if user not in self._user_tokens:
            status, body = self.api("POST", f"/hub/api/users/{user}/tokens",
                                    {"scopes": [f"access:servers!user={user}"], "expires_in": 4 * 3600,
                                     "note": "the test bed's client, for this user's servers"})
            assert status == 201, (status, body)
            self._user_tokens[user] = body["token"]
        return self._user_tokens[user]

    def _token_for(self, path: str) -> str:
        """The user's own token for a path of their server, else the service's."""
        if path.startswith("/user/"):
            return self.user_token(path.split("/")[2])
        return self.token

    def api(self, method: str, path: str, body=None, token: str | None = None, timeout: float = 30):
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers={"Authorization": f"token {token or self._token_for(path)}"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                text = r.read().decode()
                if not text.strip():
                    return r.status, None
                try:
                    return r.status, json.loads(text)
                except ValueError:  # a page, not the API
                    return r.status, text
        except urllib.error.HTTPError as e:
            text = e.read().decode()
            try:
                return e.code, json.loads(text)
            except ValueError:
                return e.code, text

    def server(self, user: str, name: str = "") -> dict | None:
        return self.api("GET", f"/hub/api/users/{user}")[1]["servers"].get(name)

    def wait_ready(self, user: str, timeout: float = 180, name: str = "") -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            s = self.server(user, name)
            if s and s.get("ready"):
                return s
            if s is None:
                raise AssertionError(f"{user}'s server went away while starting")
            time.sleep(1)
        raise TimeoutError(f"{user}'s server not ready in {timeout} s")

    def wait_gone(self, user: str, timeout: float = 120, name: str = "") -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.server(user, name) is None:
                return
            time.sleep(1)
        raise TimeoutError(f"{user}'s server still there after {timeout} s")

    def stop(self, user: str, name: str = "") -> None:
        path = f"/hub/api/users/{user}/server" + (f"s/{name}" if name else "")
        status, body = self.api("DELETE", path)
        assert status in (202, 204), (status, body)
        self.wait_gone(user, name=name)

    def wait_routed(self, user: str, name: str = "", timeout: float = 60) -> None:
        """Wait until the proxy routes to the server (after a hub restart, JupyterHub adds the routes of the servers
        it kept only once its start-up checks are done)."""
        path = f"/user/{user}/" + (f"{name}/" if name else "") + "api/status"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.api("GET", path)[0] == 200:
                return
            time.sleep(1)
        raise TimeoutError(f"the proxy does not route to {user}'s server {name!r} after {timeout} s")

    def run_in_kernel(self, user: str, code: str, kernel: str = "hpcdl", timeout: float = 120) -> str:
        """Start a kernel on ``user``'s server, run ``code``, return its stdout, shut the kernel down."""
        base = f"/user/{user}/api/kernels"
        status, k = self.api("POST", base, {"name": kernel}, timeout=timeout)
        assert status == 201, (status, k)
        try:
            return asyncio.run(self._execute(user, f"{base}/{k['id']}", code, timeout))
        finally:
            self.api("DELETE", f"{base}/{k['id']}")

    async def _execute(self, user: str, kernel_path: str, code: str, timeout: float, reconnects: int = 3) -> str:
        """Run ``code`` over the kernel's websocket. A dropped websocket is reopened with the same session, as
        JupyterLab does (the server keeps what the kernel said meanwhile and replays it), while the kernel lives;
        once it is gone the error says what the hub and the server report."""
        msg_id, session = uuid.uuid4().hex, uuid.uuid4().hex
        url = f"{self.url.replace('http', 'ws', 1)}{kernel_path}/channels?session_id={session}"
        out, deadline, dropped = [], time.monotonic() + timeout, 0
        conn = await websocket_connect(HTTPRequest(url, headers={"Authorization": f"token {self.user_token(user)}"}))
        conn.write_message(json.dumps({
            "header": {"msg_id": msg_id, "username": "test", "session": session, "msg_type": "execute_request",
                       "version": "5.3", "date": ""},
            "parent_header": {}, "metadata": {}, "channel": "shell", "buffers": [],
            "content": {"code": code, "silent": False, "store_history": False, "user_expressions": {},
                        "allow_stdin": False, "stop_on_error": True}}))
        try:
            while time.monotonic() < deadline:
                raw = await asyncio.wait_for(conn.read_message(), deadline - time.monotonic())
                if raw is None:
                    kernel_status, kernel_info = self.api("GET", kernel_path)
                    if kernel_status != 200 or dropped >= reconnects:
                        server = self.api("GET", f"/hub/api/users/{user}")[1]
                        raise ConnectionError(
                            f"the kernel's websocket closed ({dropped} reconnects before); the kernel: "
                            f"{kernel_status} {kernel_info}; {user} at the hub: {server}")
                    dropped += 1
                    warnings.warn(f"the kernel's websocket closed while the kernel is {kernel_info}: reconnecting "
                                  f"({dropped} of {reconnects})")
                    conn = await websocket_connect(HTTPRequest(url, headers={"Authorization": f"token {self.user_token(user)}"}))
                    continue
                if isinstance(raw, bytes):
                    continue
                msg = json.loads(raw)
                if msg.get("parent_header", {}).get("msg_id") != msg_id:
                    continue
                kind = msg["header"]["msg_type"]
                if kind == "stream":
                    out.append(msg["content"]["text"])
                elif kind == "error":
                    raise RuntimeError("\n".join(msg["content"]["traceback"]))
                elif kind == "status" and msg["content"]["execution_state"] == "idle":
                    return "".join(out)
            raise TimeoutError(f"no reply from the kernel in {timeout} s")
        finally:
            conn.close()
