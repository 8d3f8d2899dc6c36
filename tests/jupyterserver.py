"""A Jupyter server (jupyter_server or JupyterLab) for tests: on a free loopback port with a token, outside any batch
job, stopped at the end (and its kernels with it)."""
from __future__ import annotations

import contextlib
import os
import secrets
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path


@contextlib.contextmanager
def running_jupyter(app: str, root: Path, log: Path, *args: str, env: dict | None = None, timeout: float = 60):
    """``python -m app`` serving ``root``; yields (url, token) once its API answers."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    token = secrets.token_hex(16)
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "HPCDL_ALLOCATION"))}
    proc = subprocess.Popen(
        [sys.executable, "-m", app, "--no-browser", "--ip=127.0.0.1", f"--port={port}", "--allow-root",
         "--ServerApp.port_retries=0", f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={root}", *args],
        stdout=open(log, "w"), stderr=subprocess.STDOUT, env={**environ, **(env or {})}, cwd=root)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                urllib.request.urlopen(f"{url}/api/status?token={token}", timeout=1)
                break
            except OSError:
                assert proc.poll() is None, log.read_text()
                assert time.monotonic() < deadline, f"{app} did not answer in {timeout} s:\n{log.read_text()}"
                time.sleep(0.2)
        yield url, token
    finally:
        proc.terminate()  # the server shuts its kernels down, and each kernel its session's engines
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
