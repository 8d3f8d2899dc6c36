"""``hpcdl-launch``: run a command as Horovod ranks, one per Slurm task, each inside the user's udocker container,
joined over Gloo through a rendezvous this launcher owns. Run it inside an allocation (a batch script or salloc)::

    hpcdl-launch --image hpcdl/base:latest -- python3 train.py
"""
from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys

from .allocation import hostnames
from .containers.site import load_site
from .world import Slot, gloo_env, iface_for, slurm_hosts, slurm_slot

GLOO_NAMES = tuple(gloo_env(Slot("host", 0, 0, 1, 0, 1, 1), "addr", 0, "iface"))
RENDEZVOUS_ENV = "HPCDL_RENDEZVOUS"
PASS_THROUGH = ("CUDA_VISIBLE_DEVICES", "SLURM_JOB_ID", "SLURM_PROCID", "SLURM_LOCALID", "SLURMD_NODENAME")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hpcdl-launch", description=__doc__.split("\n\n")[0])
    p.add_argument("--image", required=True, help="image whose container runs each rank")
    p.add_argument("--rendezvous-addr", help="address of this host that the ranks reach (default: this host's name)")
    p.add_argument("--iface", help="network interface for Gloo (default: the one holding the rendezvous address)")
    p.add_argument("-e", "--env", action="append", default=[], metavar="NAME", help="also pass this variable to the ranks")
    p.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)  # one task's side, started by srun
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    p.add_argument("command", nargs=argparse.REMAINDER)
    return p


def run_rank(args, command: list[str]) -> int:
    """Inside one srun task: compute this task's slot and exec the command in the container."""
    slot = slurm_slot(os.environ, hostnames(os.environ["SLURM_JOB_NODELIST"]))
    rendezvous = os.environ.pop(RENDEZVOUS_ENV, "")  # address and secret, from the launcher's environment
    if not rendezvous:
        print(f"hpcdl-launch --rank: ${RENDEZVOUS_ENV} is not set (start ranks with hpcdl-launch)", file=sys.stderr)
        return 2
    os.environ.update(gloo_env(slot, rendezvous, args.port, args.iface))
    names = [n for n in (*GLOO_NAMES, *PASS_THROUGH, *args.env) if n in os.environ]
    argv = [sys.executable, "-m", "jupyter_hpcdl.containers", "run", *(f"--env={n}" for n in names), args.image, "--", *command]
    os.execv(sys.executable, argv)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        print("hpcdl-launch: give the command after --", file=sys.stderr)
        return 2
    if "SLURM_JOB_ID" not in os.environ:
        print("hpcdl-launch: not inside a Slurm allocation: run it from a batch script (sbatch) or salloc", file=sys.stderr)
        return 2
    if args.rank:
        return run_rank(args, command)
    from horovod.runner.common.util.hosts import get_host_assignments, parse_hosts

    from .training.rendezvous import SessionRendezvous

    addr = args.rendezvous_addr or socket.gethostbyname(socket.gethostname())
    iface = args.iface or iface_for(addr)
    hosts = slurm_hosts(hostnames(os.environ["SLURM_JOB_NODELIST"]), os.environ["SLURM_TASKS_PER_NODE"])
    size = sum(n for _, n in hosts)
    load_site().client().ensure_container(args.image)  # once, before the ranks (they share the home file system)
    server = SessionRendezvous(bind=addr)  # only on the ranks' interface, only with the secret
    port = server.start()
    server.init(get_host_assignments(parse_hosts(",".join(f"{h}:{n}" for h, n in hosts)), size))
    try:
        srun = ["srun", "--kill-on-bad-exit=1", "--distribution=block", f"--ntasks={size}",
                sys.executable, "-m", "jupyter_hpcdl.launch", "--rank", f"--image={args.image}",
                f"--port={port}", f"--iface={iface}", *(f"--env={n}" for n in args.env), "--", *command]
        # The secret goes to the tasks in srun's environment (theirs alone to read), not on a command line.
        return subprocess.call(srun, env={**os.environ, RENDEZVOUS_ENV: server.rank_address(addr)})
    finally:
        server.stop()


if __name__ == "__main__":
    sys.exit(main())
