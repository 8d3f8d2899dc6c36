"""The job's side of a spawn, run by the batch script on the first node (host side, beside srun and the
scheduler's client): prepare the user's container, write the container kernelspec, take a port and hold it, tell the
hub only that port (the hub takes the node from the scheduler), then run the single-user server as the child of
this process, which stays the job's subreaper (:mod:`.subreaper`: nothing the server starts outlives the job).

The port is the server's from the moment it is chosen: the job listens on it before it tells the hub (no
SO_REUSEADDR, no SO_REUSEPORT), so no other process, whatever options it sets, can bind or listen on that port
until the server ends, and whoever answers there is this job's server. The listening socket is passed to the server,
whose extension has it accept on that very socket (``HPCDL_HELD_PORT_FD``, see serverext.py) instead of binding
anew; connections made meanwhile wait in its backlog."""
from __future__ import annotations

import argparse
import contextlib
import os
import socket
import sys
from dataclasses import dataclass
from urllib.parse import urlsplit

import requests
from requests.adapters import HTTPAdapter
from urllib3.util.retry import Retry

from jupyter_hpcdl.containers.errors import ContainerError
from jupyter_hpcdl.containers.kernelspec import container_kernelspec, write_kernelspec
from jupyter_hpcdl.containers.site import load_site

from ..spawner import envfile  # the hub writes it; the job reads it once
from .subreaper import supervise

KERNEL_NAME = "hpcdl"


def hold_port(ip: str) -> socket.socket:
    """A socket listening on a free port of ``ip`` (inheritable: the server it is passed to serves on it)."""
    s = socket.socket(socket.AF_INET6 if ":" in ip else socket.AF_INET)
    s.bind((ip, 0))
    s.listen(128)
    s.set_inheritable(True)
    return s


def route_address(url: str) -> str:
    """This node's address on its route to ``url``'s host: the interface the hub's network reaches it by (no packet
    is sent: connecting a UDP socket only chooses the route)."""
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or (443 if parts.scheme == "https" else 80)
    family, _, _, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect(addr)
        return s.getsockname()[0]


def report_port(api_url: str, token: str, port: int, tls: TlsClient | None = None) -> None:
    """Tell the hub the port, retrying with backoff (up to about 15 minutes) while the hub is unreachable: it may
    be restarting; a TLS failure (a certificate the other side refuses) is final at once. With ``tls`` (JupyterHub's ``internal_ssl``), as the server's certificate to a hub that the CA
    bundle vouches for."""
    retry = Retry(total=100, connect=100, read=3, status=5, other=0, backoff_factor=0.5, backoff_max=10,
                  status_forcelist=(502, 503, 504), allowed_methods=None)
    # per request, not on the session: requests lets REQUESTS_CA_BUNDLE override a session's CA bundle
    tls_args = {"cert": (tls.certfile, tls.keyfile), "verify": tls.cafile} if tls is not None else {}
    with requests.Session() as session:
        session.mount("http://", HTTPAdapter(max_retries=retry))
        session.mount("https://", HTTPAdapter(max_retries=retry))
        r = session.post(api_url.rstrip("/") + "/hpcdl/callback", json={"port": port}, timeout=30,
                         headers={"Authorization": f"token {token}"}, **tls_args)
        r.raise_for_status()


@dataclass(frozen=True)
class TlsClient:
    """The server's key and certificate, and the CA bundle it trusts (JupyterHub's ``internal_ssl``)."""

    keyfile: str
    certfile: str
    cafile: str

    @classmethod
    def from_env(cls) -> "TlsClient":
        return cls(*(os.environ[var] for var in ("JUPYTERHUB_SSL_KEYFILE", "JUPYTERHUB_SSL_CERTFILE",
                                                   "JUPYTERHUB_SSL_CLIENT_CA")))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m jupyter_hpcdl.job.server")
    p.add_argument("--image", required=True)
    p.add_argument("--listen-ip", default="", help="default: this node's address on its route to the hub")
    p.add_argument("--env-file", default="", help="a file with the job's secrets (read once, then removed)")
    p.add_argument("command", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if args.env_file:
        os.environ.update(envfile.load(args.env_file))
    tls_files: list[str] = []
    if bundle := os.environ.pop(envfile.TLS_BUNDLE_ENV, ""):
        try:
            tls_files = envfile.unpack_tls(bundle)
        except (OSError, ValueError) as e:
            print(f"[jupyter-hpcdl] error: the hub's TLS files (internal_ssl) could not be unpacked: {e}",
                  file=sys.stderr, flush=True)
            return 2
    tls = TlsClient.from_env() if tls_files else None
    try:
        return _serve(args, command, tls)
    finally:
        for path in tls_files:  # the server's key lives as long as the server
            with contextlib.suppress(OSError):
                os.unlink(path)


def _serve(args: argparse.Namespace, command: list[str], tls: TlsClient | None) -> int:
    job = os.environ.get("HPCDL_JOB_ID") or str(os.getpid())
    print(f"[jupyter-hpcdl] job {job} on {os.environ.get('HPCDL_NODE') or socket.gethostname()}: "
          f"preparing the container for {args.image}", flush=True)
    try:
        container = load_site().client().ensure_container(args.image)
    except ContainerError as e:
        print(f"[jupyter-hpcdl] error: {e}", file=sys.stderr, flush=True)
        return 2
    print(f"[jupyter-hpcdl] container {container} ready", flush=True)

    job_dir = os.path.expanduser(f"~/.jupyter-hpcdl/jobs/{job}")
    write_kernelspec(os.path.join(job_dir, "kernels"), KERNEL_NAME, container_kernelspec(args.image, sys.executable))
    os.environ["JUPYTER_PATH"] = os.pathsep.join(filter(None, [job_dir, os.environ.get("JUPYTER_PATH")]))

    ip = args.listen_ip or route_address(os.environ["JUPYTERHUB_API_URL"])
    held = hold_port(ip)
    port = held.getsockname()[1]
    os.environ["HPCDL_HELD_PORT_FD"] = str(held.fileno())  # the server's extension has the server accept on it
    prefix = os.environ.get("JUPYTERHUB_SERVICE_PREFIX", "/")
    host = f"[{ip}]" if ":" in ip else ip
    os.environ["JUPYTERHUB_SERVICE_URL"] = f"{'https' if tls else 'http'}://{host}:{port}{prefix}"
    try:
        report_port(os.environ["JUPYTERHUB_API_URL"], os.environ["JUPYTERHUB_API_TOKEN"], port, tls)
    except requests.RequestException as e:
        print(f"[jupyter-hpcdl] error: could not tell the hub at {os.environ['JUPYTERHUB_API_URL']} the port: {e}",
              file=sys.stderr, flush=True)
        return 2
    print(f"[jupyter-hpcdl] server on {host}:{port}{' (TLS, client certificates required)' if tls else ''}",
          flush=True)
    argv = [*command, f"--MultiKernelManager.default_kernel_name={KERNEL_NAME}"]
    fd = held.detach()  # from here on only the server holds the port
    return supervise(argv, pass_fds=[fd])


if __name__ == "__main__":
    sys.exit(main())
