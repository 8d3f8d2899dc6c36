"""JupyterHub's internal_ssl with batch jobs: the hub hands each server its key and certificates through a file only
the user can read, and the job unpacks them privately (the bed's Grid Engine hub runs so: see
test_spawner_schedulers.py for a neighbour against such a server)."""
from __future__ import annotations

import asyncio
import http.server
import json
import os
import ssl
import stat
import threading
import time
from types import SimpleNamespace

import pytest
import requests
from certipy import Certipy
from traitlets.config import Config

from jupyter_hpcdl.doctor.cli import hub_api_url
from jupyter_hpcdl.job.server import TlsClient, report_port
from jupyter_hpcdl.spawner import envfile
from jupyter_hpcdl.spawner.spawner import HpcdlSpawner


def _spawner(home: str, **traits) -> HpcdlSpawner:
    spawner = HpcdlSpawner(user=SimpleNamespace(name="alice", url="/user/alice/"), orm_spawner=None, exec_prefix=[],
                           scheduler_timeout=30, **traits)
    spawner.user_home = lambda: home
    return spawner


def _hub_certs(tmp_path) -> dict[str, str]:
    """A CA and a server's pair, as JupyterHub's create_certs makes them (with certipy)."""
    certipy = Certipy(store_dir=str(tmp_path / "hub-certs"))
    certipy.create_ca("notebooks-ca")
    pair = certipy.create_signed_pair("user-alice", "notebooks-ca", alt_names=["DNS:localhost", "IP:127.0.0.1"])
    return {"keyfile": pair["files"]["key"], "certfile": pair["files"]["cert"],
            "cafile": certipy.store.get_record("notebooks-ca")["files"]["cert"]}


def test_the_key_reaches_the_job_privately_and_is_read_once(tmp_path, monkeypatch):
    home = tmp_path / "home"
    home.mkdir()
    hub = _hub_certs(tmp_path)
    spawner = _spawner(str(home))
    moved = asyncio.run(asyncio.wait_for(spawner.move_certs(hub), 60))
    tls = home / ".jupyter-hpcdl/tls/default"
    assert moved == {"keyfile": str(tls / "server.key"), "certfile": str(tls / "server.crt"), "cafile": str(tls / "ca.crt")}
    bundle = home / ".jupyter-hpcdl/jobs/tls-default.json"
    assert stat.S_IMODE(bundle.stat().st_mode) == 0o600
    assert stat.S_IMODE(bundle.parent.stat().st_mode) == 0o700
    # the job's side: JupyterHub's variables name the files (get_env from cert_paths), the bundle names itself
    for var, (key, _) in envfile.TLS_FILES.items():
        monkeypatch.setenv(var, moved[key])
    written = envfile.unpack_tls(str(bundle))
    assert sorted(written) == sorted(moved.values()) and not bundle.exists()
    for key, path in moved.items():
        assert open(path).read() == open(hub[key]).read()
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert stat.S_IMODE(tls.stat().st_mode) == 0o700
    with pytest.raises(FileNotFoundError):  # one job, one reading
        envfile.unpack_tls(str(bundle))


def test_a_bundle_that_is_not_the_hubs_is_refused(tmp_path, monkeypatch):
    bundle = tmp_path / "tls.json"
    bundle.write_text(json.dumps({"LD_PRELOAD": "x"}))
    with pytest.raises(ValueError, match="unexpected entries"):
        envfile.unpack_tls(str(bundle))
    monkeypatch.delenv("JUPYTERHUB_SSL_KEYFILE", raising=False)
    bundle.write_text(json.dumps({"JUPYTERHUB_SSL_KEYFILE": "PEM"}))
    with pytest.raises(ValueError, match="did not say where JUPYTERHUB_SSL_KEYFILE"):
        envfile.unpack_tls(str(bundle))


def test_the_servers_certificate_names_the_nodes_the_hub_reaches_it_by(tmp_path):
    spawner = _spawner(str(tmp_path), node_addresses={"node1": "10.1.0.1", "node2": "node2.ib"},
                       trusted_alt_names=["DNS:*.nodes.example.org"])
    assert spawner.ssl_alt_names == ["DNS:*.nodes.example.org", "DNS:node1", "IP:10.1.0.1", "DNS:node2",
                                     "DNS:node2.ib"]


def test_the_doctor_asks_the_hub_over_tls_where_internal_ssl_is_on():
    c = Config()
    c.JupyterHub.hub_ip = "10.0.0.1"
    assert hub_api_url(c) == "http://10.0.0.1:8081/hub/api"
    c.JupyterHub.internal_ssl = True
    assert hub_api_url(c) == "https://10.0.0.1:8081/hub/api"


def _hub_api(tmp_path):
    """A hub API stand-in over mutual TLS (the hub's CA signs both sides, as JupyterHub's internal_ssl does) that
    records the callbacks it is sent."""
    certipy = Certipy(store_dir=str(tmp_path / "pki"))
    certipy.create_ca("hub-ca")
    hub = certipy.create_signed_pair("hub-internal", "hub-ca", alt_names=["IP:127.0.0.1"])
    job = certipy.create_signed_pair("user-alice", "hub-ca", alt_names=["IP:127.0.0.1"])
    ca = certipy.store.get_record("hub-ca")["files"]["cert"]
    got: list[dict] = []

    class Callback(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            got.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Callback)
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=ca)
    context.verify_mode = ssl.CERT_REQUIRED
    context.load_cert_chain(hub["files"]["cert"], hub["files"]["key"])
    server.socket = context.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    client = TlsClient(keyfile=job["files"]["key"], certfile=job["files"]["cert"], cafile=ca)
    return server, client, got


def test_the_job_reports_its_port_over_mutual_tls_and_a_refused_certificate_fails_at_once(tmp_path, monkeypatch):
    server, client, got = _hub_api(tmp_path)
    url = f"https://127.0.0.1:{server.server_address[1]}/hub/api"
    try:
        monkeypatch.setenv("REQUESTS_CA_BUNDLE", "/etc/ssl/certs/ca-certificates.crt")  # must not replace the hub's CA
        report_port(url, "t0ken", 4242, client)
        assert got == [{"port": 4242}]
        other = Certipy(store_dir=str(tmp_path / "other"))
        other.create_ca("another-ca")
        t0 = time.monotonic()
        with pytest.raises(requests.exceptions.SSLError):
            report_port(url, "t0ken", 4243, TlsClient(client.keyfile, client.certfile,
                                                      other.store.get_record("another-ca")["files"]["cert"]))
        assert time.monotonic() - t0 < 10, "a refused certificate was retried"
        assert got == [{"port": 4242}]
    finally:
        server.shutdown()
