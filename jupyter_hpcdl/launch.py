"""``hpcdl-launch``: run a command as Horovod ranks, one per Slurm task, each inside the user's udocker container,
joined over Gloo through a rendezvous this launcher owns. Run it inside an allocation (a batch script or salloc)::

    hpcdl-launch --image hpcdl/base:latest -- python3 train.py

Without a batch system (a laptop, binder), ``--local N`` runs N ranks as processes on this machine, with no
container, joined over loopback, and ends them at ``--time-limit``::

    hpcdl-launch --local 2 --time-limit 600 -- python3 train.py

``--status-file`` writes the ranks' exit code when they end, as JSON (``jupyter_hpcdl.batch`` collects it).
"""
from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
import time

from .allocation import hostnames
from .atomic import write_json
from .containers.site import load_site
from .world import Slot, gloo_env, iface_for, plan_slots, slurm_hosts, slurm_slot

GLOO_NAMES = tuple(gloo_env(Slot("host", 0, 0, 1, 0, 1, 1), "addr", 0, "iface"))
RENDEZVOUS_ENV = "HPCDL_RENDEZVOUS"
PASS_THROUGH = ("CUDA_VISIBLE_DEVICES", "SLURM_JOB_ID", "SLURM_PROCID", "SLURM_LOCALID", "SLURMD_NODENAME")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hpcdl-launch", description=__doc__.split("\n\n")[0])
    p.add_argument("--image", help="image whose container runs each rank (required in a batch job)")
    p.add_argument("--local", type=int, metavar="N", help="no batch system: N ranks on this machine, no container")
    p.add_argument("--time-limit", type=float, metavar="SECONDS", help="with --local: end the ranks after this long")
    p.add_argument("--status-file", help="write the ranks' exit code here (JSON) when they end")
    p.add_argument("--label", action="store_true", help="prefix each line of output with its rank ('0: ...')")
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


#: How long ranks have between SIGTERM and SIGKILL when the launcher ends them (a rank failed, the time limit, or
#: the launcher was told to stop).
GRACE_S = 10.0


def _rendezvous(bind: str, hosts: list[tuple[str, int]]):
    from horovod.runner.common.util.hosts import get_host_assignments, parse_hosts

    from .training.rendezvous import SessionRendezvous

    server = SessionRendezvous(bind=bind)  # only on the ranks' interface, only with the secret
    server.start()
    size = sum(n for _, n in hosts)
    server.init(get_host_assignments(parse_hosts(",".join(f"{h}:{n}" for h, n in hosts)), size))
    return server


def _relay(stream, rank: int, out) -> None:
    for line in iter(stream.readline, b""):
        out.write(f"{rank}: ".encode() + line)
        out.flush()


def _end(procs: list[subprocess.Popen], grace: float = GRACE_S) -> None:
    for sig, patience in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(sig)
        deadline = time.monotonic() + patience
        while any(proc.poll() is None for proc in procs) and time.monotonic() < deadline:
            time.sleep(0.05)


class _Stopped(Exception):
    """The launcher got SIGTERM or SIGINT (a cancel)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _raise_stopped(signum, frame):
    raise _Stopped(signum)


def run_local(args, command: list[str]) -> tuple[int, str]:
    """``--local N``: N ranks as processes of this machine, joined over loopback; the first rank to fail ends the
    others (as srun's --kill-on-bad-exit), and so does the time limit. Returns the exit code and why it ended."""
    host = socket.gethostname()
    hosts = [(host, args.local)]
    server = _rendezvous("127.0.0.1", hosts)
    procs: list[subprocess.Popen] = []
    relays: list[threading.Thread] = []
    deadline = time.monotonic() + args.time_limit if args.time_limit else None
    out = sys.stdout.buffer
    try:
        for slot in plan_slots(hosts):
            env = {**os.environ, **gloo_env(slot, server.rank_address("127.0.0.1"), server.port, "lo")}
            proc = subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL,
                                    stdout=subprocess.PIPE if args.label else None,
                                    stderr=subprocess.STDOUT if args.label else None)
            procs.append(proc)
            if args.label:
                relays.append(threading.Thread(target=_relay, args=(proc.stdout, slot.rank, out), daemon=True))
                relays[-1].start()
        while True:
            codes = [proc.poll() for proc in procs]
            failed = [(rank, code) for rank, code in enumerate(codes) if code]
            if failed:
                _end(procs)
                return failed[0][1], f"rank {failed[0][0]} exited with {failed[0][1]}"
            if all(code == 0 for code in codes):
                return 0, "every rank exited with 0"
            if deadline is not None and time.monotonic() > deadline:
                _end(procs)
                return 124, f"the time limit ({args.time_limit:g} s) ran out"
            time.sleep(0.1)
    except _Stopped as e:
        _end(procs)
        return 128 + e.signum, f"stopped by {e}"
    finally:
        _end(procs, 0)
        for relay in relays:
            relay.join(5)
        server.stop()


def run_batch(args, command: list[str]) -> tuple[int, str]:
    """In a Slurm allocation: one srun step of the ranks, each in the user's container."""
    addr = args.rendezvous_addr or socket.gethostbyname(socket.gethostname())
    iface = args.iface or iface_for(addr)
    hosts = slurm_hosts(hostnames(os.environ["SLURM_JOB_NODELIST"]), os.environ["SLURM_TASKS_PER_NODE"])
    size = sum(n for _, n in hosts)
    load_site().client().ensure_container(args.image)  # once, before the ranks (they share the home file system)
    server = _rendezvous(addr, hosts)
    try:
        srun = ["srun", "--kill-on-bad-exit=1", "--distribution=block", f"--ntasks={size}",
                *(["--label"] if args.label else []),
                sys.executable, "-m", "jupyter_hpcdl.launch", "--rank", f"--image={args.image}",
                f"--port={server.port}", f"--iface={iface}", *(f"--env={n}" for n in args.env), "--", *command]
        # The secret goes to the tasks in srun's environment (theirs alone to read), not on a command line.
        code = subprocess.call(srun, env={**os.environ, RENDEZVOUS_ENV: server.rank_address(addr)})
        return code, f"srun exited with {code}"
    finally:
        server.stop()


def write_status(path: str, code: int, why: str) -> None:
    """The ranks' end, for whoever collects the run: written whole or not at all."""
    write_json(path, {"exit_code": code, "why": why, "ended_at": time.time()})


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        print("hpcdl-launch: give the command after --", file=sys.stderr)
        return 2
    if args.local is not None:
        if not 1 <= args.local <= 256:
            print(f"hpcdl-launch: --local takes 1 to 256 ranks, not {args.local}", file=sys.stderr)
            return 2
        if args.time_limit is not None and not args.time_limit > 0:
            print("hpcdl-launch: --time-limit must be a positive number of seconds", file=sys.stderr)
            return 2
        run = run_local
    elif "SLURM_JOB_ID" not in os.environ:
        print("hpcdl-launch: not inside a Slurm allocation: run it from a batch script (sbatch) or salloc, or give "
              "--local N to run N ranks on this machine", file=sys.stderr)
        return 2
    elif not args.image:
        print("hpcdl-launch: give --image: the image whose container runs each rank", file=sys.stderr)
        return 2
    elif args.rank:
        return run_rank(args, command)
    else:
        run = run_batch
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _raise_stopped)
    try:
        code, why = run(args, command)
    except _Stopped as e:
        code, why = 128 + e.signum, f"stopped by {e}"
    print(f"hpcdl-launch: {why}", file=sys.stderr, flush=True)
    if args.status_file:
        write_status(args.status_file, code, why)
    return code


if __name__ == "__main__":
    sys.exit(main())
