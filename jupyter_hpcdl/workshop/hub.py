"""The few JupyterHub REST calls workshop mode makes (httpx, with deadlines); the token comes from the environment
(``JUPYTERHUB_API_TOKEN``), never from a command line, and goes to the hub's API only."""
from __future__ import annotations

import time
from typing import Any

import httpx
from urllib.parse import quote


class HubError(RuntimeError):
    """A hub call failed; the message names the call and the hub's answer."""


class HubAPI:
    def __init__(self, url: str, token: str, timeout: float = 30.0):
        if not token:
            raise HubError("no hub API token: set JUPYTERHUB_API_TOKEN (a token with admin:groups, admin:servers)")
        self.url = url.rstrip("/")
        self.client = httpx.Client(headers={"Authorization": f"token {token}"}, timeout=timeout, trust_env=False)

    def call(self, method: str, path: str, body: Any = None, ok: tuple[int, ...] = (200, 201, 202, 204),
             missing_ok: bool = False) -> Any:
        """The JSON answer of a hub call (None for none, or for 404 where ``missing_ok``); HubError otherwise."""
        if not path.startswith("/"):  # the hub's API only: never an attendee's server, which would get the token
            raise ValueError(f"not a path of the hub's API: {path!r}")
        url = f"{self.url}/hub/api{path}"
        try:
            r = self.client.request(method, url, json=body)
        except httpx.TimeoutException:
            raise HubError(f"{method} {url}: no answer from the hub in {self.client.timeout.read} s") from None
        except httpx.HTTPError as e:
            raise HubError(f"{method} {url}: {e}") from None
        if missing_ok and r.status_code == 404:
            return None
        if r.status_code not in ok:
            raise HubError(f"{method} {url}: {r.status_code} {r.text[:300]}")
        return r.json() if r.content and r.headers.get("content-type", "").startswith("application/json") else None

    def ensure_users(self, names: list[str]) -> None:
        known = {u["name"] for u in self.call("GET", "/users?limit=10000") or []}
        missing = [n for n in names if n not in known]
        if missing:
            self.call("POST", "/users", {"usernames": missing})

    def ensure_group(self, group: str) -> None:
        if self.call("GET", f"/groups/{group}", missing_ok=True) is None:
            self.call("POST", f"/groups/{group}")

    def members(self, group: str) -> list[str]:
        found = self.call("GET", f"/groups/{group}", missing_ok=True)
        return list(found["users"]) if found else []

    def add_members(self, group: str, names: list[str]) -> None:
        self.call("POST", f"/groups/{group}/users", {"users": names})

    def remove_members(self, group: str, names: list[str]) -> None:
        if names:
            self.call("DELETE", f"/groups/{group}/users", {"users": names})

    def user(self, name: str) -> dict:
        return self.call("GET", f"/users/{quote(name, safe='')}")

    def members_with_servers(self, group: str) -> list[dict]:
        """The user models (with their servers, and the servers' state where the token may read it) of the
        group's members."""
        return [self.user(name) for name in self.members(group)]

    def stop_servers(self, name: str, timeout: float = 180.0) -> list[str]:
        """Stop every server of ``name`` (the spawner cancels each job) and wait until they are gone; their names."""
        servers = list(self.user(name).get("servers", {}))
        for server in servers:
            self.call("DELETE", f"/users/{name}/server" + (f"s/{server}" if server else ""))
        deadline = time.monotonic() + timeout
        while self.user(name).get("servers"):
            if time.monotonic() > deadline:
                raise HubError(f"{name}'s servers {servers} were still there {timeout:.0f} s after stopping them")
            time.sleep(1)
        return servers
