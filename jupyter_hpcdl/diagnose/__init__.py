"""``python -m jupyter_hpcdl.diagnose [--allreduce]``: what this process sees, as one JSON line — node, GPUs
assigned, user, the image it runs in and in which container mode (``userns``: the fast path; ``P1``: proot; None
outside a container) and, with ``--allreduce``, whether the training backend (Horovod) joins every rank (a sum over
ranks of rank+1, which must equal size*(size+1)/2)."""
from __future__ import annotations

import argparse
import json
import os
import pwd
import socket
import sys

IMAGE_IDENTITY = "/etc/hpcdl-image.json"


def report(allreduce: bool = False) -> dict:
    try:
        with open(IMAGE_IDENTITY) as f:
            image = json.load(f)
    except (OSError, ValueError):
        image = None
    info = {
        "host": socket.gethostname(),
        "node": os.environ.get("SLURMD_NODENAME") or os.environ.get("HOROVOD_HOSTNAME"),
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "user": pwd.getpwuid(os.getuid()).pw_name,
        "uid": os.getuid(),
        "image": image,
        "container_mode": os.environ.get("HPCDL_CONTAINER_MODE"),
        "python": sys.version.split()[0],
    }
    if allreduce:
        from ..backends import load_backend

        info.update(load_backend().check_allreduce())
    return info


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m jupyter_hpcdl.diagnose", description=__doc__.split("\n\n")[0])
    p.add_argument("--allreduce", action="store_true", help="also join the Horovod world and sum across ranks")
    info = report(p.parse_args(argv).allreduce)
    print(json.dumps(info, sort_keys=True), flush=True)
    return 0 if info.get("allreduce_ok", True) else 1
