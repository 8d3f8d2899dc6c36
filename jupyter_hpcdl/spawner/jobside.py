"""The job's side of a spawn, run by the batch script on the first node (host side, beside srun and the
scheduler's client): prepare the user's container, write the container kernelspec, pick a port, tell the hub only
that port (the hub takes the node from the scheduler), then become the single-user server."""
from __future__ import annotations

import argparse
import os
import socket
import sys

import requests
from requests.adapters import HTTPAdapter
from urllib3.util.retry import Retry

from jupyter_hpcdl.containers.errors import ContainerError
from jupyter_hpcdl.containers.kernelspec import container_kernelspec, write_kernelspec
from jupyter_hpcdl.containers.site import load_site

KERNEL_NAME = "hpcdl"


def free_port(ip: str) -> int:
    with socket.socket(socket.AF_INET6 if ":" in ip else socket.AF_INET) as s:
        s.bind((ip, 0))
        return s.getsockname()[1]


def report_port(api_url: str, token: str, port: int) -> None:
    """Tell the hub the port, retrying with backoff (up to about 15 minutes) while the hub is unreachable: it may
    be restarting."""
    retry = Retry(total=100, connect=100, read=3, status=5, backoff_factor=0.5, backoff_max=10,
                  status_forcelist=(502, 503, 504), allowed_methods=None)
    with requests.Session() as session:
        session.mount("http://", HTTPAdapter(max_retries=retry))
        session.mount("https://", HTTPAdapter(max_retries=retry))
        r = session.post(api_url.rstrip("/") + "/hpcdl/callback", json={"port": port}, timeout=30,
                         headers={"Authorization": f"token {token}"})
        r.raise_for_status()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m jupyter_hpcdl.spawner.jobside")
    p.add_argument("--image", required=True)
    p.add_argument("--listen-ip", default="0.0.0.0")
    p.add_argument("command", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    job = os.environ.get("SLURM_JOB_ID", str(os.getpid()))
    print(f"[jupyter-hpcdl] job {job} on {os.environ.get('SLURMD_NODENAME', socket.gethostname())}: "
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

    port = free_port(args.listen_ip)
    prefix = os.environ.get("JUPYTERHUB_SERVICE_PREFIX", "/")
    os.environ["JUPYTERHUB_SERVICE_URL"] = f"http://{args.listen_ip}:{port}{prefix}"
    report_port(os.environ["JUPYTERHUB_API_URL"], os.environ["JUPYTERHUB_API_TOKEN"], port)
    print(f"[jupyter-hpcdl] server on port {port}", flush=True)
    argv = [*command, f"--MultiKernelManager.default_kernel_name={KERNEL_NAME}"]
    os.execvp(argv[0], argv)


if __name__ == "__main__":
    sys.exit(main())
