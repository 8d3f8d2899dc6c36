"""Spawn-to-ready of HpcdlSpawner against plain batchspawner 1.3.0 (SlurmSpawner) on the same test-bed cluster,
for the same user, in alternating rounds: the time from the REST request that starts alice's server until the
hub reports it ready. A second JupyterHub (ports 8010/8011/8091, its own database in a temporary directory) runs
batchspawner; this script starts it, records its pid, and stops it by that pid.

    /opt/jupyter-hpcdl/venv/bin/python benchmarks/spawn_to_ready.py --rounds 5   # as root, with the bed up
"""
from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

STATE = Path(os.environ.get("HPCDL_TESTBED_STATE", "/var/lib/jupyter-hpcdl-testbed"))

PLAIN_CONFIG = """
c = get_config()  # noqa
c.JupyterHub.ip = "127.0.0.1"
c.JupyterHub.port = 8010
c.JupyterHub.hub_ip = "127.0.0.1"
c.JupyterHub.hub_port = 8091
c.ConfigurableHTTPProxy.api_url = "http://127.0.0.1:8011"
c.ConfigurableHTTPProxy.command = ["{prefix}/node/bin/configurable-http-proxy"]
c.JupyterHub.db_url = "sqlite:///{work}/hub.sqlite"
c.JupyterHub.cookie_secret_file = "{work}/cookie_secret"
c.JupyterHub.authenticator_class = "shared-password"
c.SharedPasswordAuthenticator.user_password = "{password}"
c.Authenticator.allowed_users = {{"alice"}}
c.JupyterHub.tornado_settings = {{"slow_spawn_timeout": 0}}
c.JupyterHub.services = [{{"name": "bench", "api_token": "{token}"}}]
c.JupyterHub.load_roles = [{{"name": "bench", "services": ["bench"], "scopes": ["admin:users", "admin:servers"]}}]
c.JupyterHub.spawner_class = "batchspawner.SlurmSpawner"
c.Spawner.default_url = "/lab"
c.Spawner.cmd = ["{venv}/bin/jupyterhub-singleuser"]
c.Spawner.http_timeout = 120
c.Spawner.start_timeout = 300
c.BatchSpawnerBase.batchspawner_singleuser_cmd = "{venv}/bin/batchspawner-singleuser"
c.SlurmSpawner.req_partition = "gpu"
c.SlurmSpawner.req_gres = "gpu:1"
c.SlurmSpawner.req_runtime = "00:20:00"
c.SlurmSpawner.req_srun = ""
c.SlurmSpawner.state_exechost_exp = "127.0.0.1"
"""


class Client:
    def __init__(self, url: str, token: str):
        self.url, self.token = url, token

    def call(self, method: str, path: str, body=None):
        req = urllib.request.Request(self.url + path, method=method, headers={"Authorization": f"token {self.token}"},
                                     data=None if body is None else json.dumps(body).encode())
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                text = r.read().decode()
                return r.status, json.loads(text) if text.strip() else None
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    def server(self):
        return self.call("GET", "/hub/api/users/alice")[1]["servers"].get("")

    def spawn_to_ready(self, options: dict, timeout: float = 300) -> float:
        t0 = time.perf_counter()
        status, body = self.call("POST", "/hub/api/users/alice/server", options)
        assert status in (201, 202), (status, body)
        while time.perf_counter() - t0 < timeout:
            s = self.server()
            if s and s.get("ready"):
                return time.perf_counter() - t0
            if s is None:
                raise RuntimeError("the server failed to start")
            time.sleep(0.1)
        raise TimeoutError("not ready")

    def stop(self, timeout: float = 120) -> None:
        self.call("DELETE", "/hub/api/users/alice/server")
        deadline = time.monotonic() + timeout
        while self.server() is not None and time.monotonic() < deadline:
            time.sleep(0.2)
        while subprocess.run(["squeue", "-h", "-u", "alice"], capture_output=True, text=True).stdout.strip():
            time.sleep(0.2)


def wait_http(url: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.3)
    raise TimeoutError(url)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out")
    args = p.parse_args()
    bed = json.loads((STATE / "bed.json").read_text())
    ours = Client(bed["hub_url"], (Path(bed["hub_dir"]) / "service_token").read_text().strip())
    work = Path(tempfile.mkdtemp(prefix="hpcdl-plain-hub-"))
    token = secrets.token_hex(16)
    (work / "jupyterhub_config.py").write_text(PLAIN_CONFIG.format(prefix=bed["prefix"], venv=bed["venv"], work=work,
                                                                   password=secrets.token_hex(8), token=token))
    env = {**os.environ, "PATH": f"{bed['venv']}/bin:{bed['prefix']}/node/bin:/usr/sbin:/usr/bin:/sbin:/bin"}
    log = open(work / "hub.log", "wb")
    hub = subprocess.Popen([f"{bed['venv']}/bin/jupyterhub", "-f", str(work / "jupyterhub_config.py")], cwd=work,
                           env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    (work / "hub.pid").write_text(f"{hub.pid}\n")
    plain = Client("http://127.0.0.1:8010", token)
    rows = []
    try:
        wait_http("http://127.0.0.1:8010/hub/api/")
        for r in range(args.rounds):
            order = ("hpcdl", "batchspawner") if r % 2 == 0 else ("batchspawner", "hpcdl")
            row = {}
            for which in order:
                client = ours if which == "hpcdl" else plain
                row[which] = client.spawn_to_ready({"gpus_per_node": 1, "walltime": "00:20:00"} if which == "hpcdl" else {})
                client.stop()
            row["ratio"] = row["hpcdl"] / row["batchspawner"]
            rows.append(row)
            print(json.dumps(row), flush=True)
    finally:
        os.kill(hub.pid, signal.SIGTERM)
        hub.wait(timeout=60)
    summary = {"rounds": args.rounds,
               "hpcdl_s": statistics.median(r["hpcdl"] for r in rows),
               "batchspawner_s": statistics.median(r["batchspawner"] for r in rows),
               "ratio_hpcdl_over_batchspawner": statistics.median(r["ratio"] for r in rows)}
    print(json.dumps(summary, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps({"summary": summary, "rounds": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
