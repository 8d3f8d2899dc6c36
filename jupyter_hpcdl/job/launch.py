"""``hpcdl-launch``: run a command as the training backend's ranks, one per task of the batch job, each
inside the user's udocker container, joined over Gloo through a rendezvous this launcher owns. Run it inside an allocation (a batch script or salloc)::

    hpcdl-launch --image hpcdl/base:latest -- python3 train.py

Without a batch system (a laptop, binder), ``--local N`` runs N ranks as processes on this machine, with no
container, joined over loopback, and ends them at ``--time-limit``::

    hpcdl-launch --local 2 --time-limit 600 -- python3 train.py

``--backend`` names the training backend whose ranks to start (default: ``$HPCDL_BACKEND``, else Horovod's); with
``--backend torch`` the command is ``python3 script.py ARGS`` (or ``python3 -m module ARGS``) of an unchanged
``torchrun`` script.
``--status-file`` writes the ranks' exit code when they end, as JSON (``jupyter_hpcdl.training.batchrun`` collects it).
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
from functools import partial

from ..atomic import write_json
from ..containers.site import load_site
from ..batchsystems.scheduler import job_scheduler, serves
from .tasks import job_hosts, supervise
from ..backends import BACKEND_ENV, load_backend
from .world import Slot, iface_for, plan_slots, task_slot

RENDEZVOUS_ENV = "HPCDL_RENDEZVOUS"
PASS_THROUGH = ("CUDA_VISIBLE_DEVICES", "SLURM_JOB_ID", "SLURM_PROCID", "SLURM_LOCALID", "SLURMD_NODENAME", "JOB_ID",
                BACKEND_ENV)


def _gloo_names() -> tuple[str, ...]:
    """The names of a rank's world environment, as the site's backend sets them. The backend (``HPCDL_BACKEND``,
    else Horovod) is loaded where a command needs it: a bad name fails that command, saying which are installed,
    not the import of this module."""
    return tuple(load_backend().rank_env(Slot("host", 0, 0, 1, 0, 1, 1), "addr", 0, "iface"))


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hpcdl-launch", description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", help="the training backend whose ranks to start (default: $HPCDL_BACKEND, else horovod)")
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
    p.add_argument("--slot", type=int, help=argparse.SUPPRESS)  # with --hosts: a task started alone (Grid Engine)
    p.add_argument("--hosts", help=argparse.SUPPRESS)  # host:count,... in rank order
    p.add_argument("command", nargs=argparse.REMAINDER)
    return p


def _job_scheduler():
    """This job's adapter, None outside a job, False (said on stderr) where the hub's hand-off is broken."""
    try:
        return job_scheduler(os.environ)
    except ValueError as e:
        print(f"hpcdl-launch: {e}", file=sys.stderr)
        return False


def run_rank(args, command: list[str]) -> int:
    """Inside one task: its slot (from ``--slot``, or the batch system's task variables) in the launcher's
    ``--hosts``, and exec the command in the container."""
    hosts = _parse_hosts(args.hosts or "")
    if args.slot is not None:
        slot = task_slot(hosts, args.slot)
    else:
        sched = job_scheduler(os.environ)
        if sched is None or not hasattr(sched, "task_index"):
            print("hpcdl-launch --rank: not a task of a batch job's step (start ranks with hpcdl-launch)", file=sys.stderr)
            return 2
        slot = task_slot(hosts, *sched.task_index(os.environ))
    rendezvous = os.environ.pop(RENDEZVOUS_ENV, "")  # address and secret, from the launcher's environment
    if not rendezvous:
        print(f"hpcdl-launch --rank: ${RENDEZVOUS_ENV} is not set (start ranks with hpcdl-launch)", file=sys.stderr)
        return 2
    os.environ.update(load_backend().rank_env(slot, rendezvous, args.port, args.iface))
    names = [n for n in (*_gloo_names(), *PASS_THROUGH, *args.env) if n in os.environ]
    argv = [sys.executable, "-m", "jupyter_hpcdl.containers", "run", *(f"--env={n}" for n in names), args.image, "--", *command]
    if args.slot is None:
        os.execv(sys.executable, argv)  # a step's task: the step ends them all
    return supervise(argv)


#: How long ranks have between SIGTERM and SIGKILL when the launcher ends them (a rank failed, the time limit, or
#: the launcher was told to stop).
GRACE_S = 10.0


def _rendezvous(bind: str, hosts: list[tuple[str, int]]):
    # only on the ranks' interface, only with the secret
    return load_backend().start_rendezvous(bind, hosts, sum(n for _, n in hosts))


def _relay(stream, rank: int, out) -> None:
    for line in iter(stream.readline, b""):
        out.write(f"{rank}: ".encode() + line)
        out.flush()


def _end(procs: list[subprocess.Popen], grace: float = GRACE_S) -> None:
    held = [proc for proc in procs if proc.stdin and not proc.stdin.closed]
    for proc in held:
        proc.stdin.close()  # a task started alone (qrsh -inherit) ends its rank on this, then exits
    deadline = time.monotonic() + grace
    while any(proc.poll() is None for proc in held) and time.monotonic() < deadline:
        time.sleep(0.05)
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


def _parse_hosts(spec: str) -> list[tuple[str, int]]:
    hosts = [(h, int(n)) for h, _, n in (part.rpartition(":") for part in spec.split(",") if part)]
    if not hosts:
        raise ValueError(f"--hosts {spec!r}: give host:count,...")
    return hosts


class _Ranks:
    """Rank processes started one by one (``--local``, Grid Engine's tasks), their output labelled if asked."""

    def __init__(self, label: bool):
        self.label, self.procs, self.relays = label, [], []

    def start(self, rank: int, argv: list[str], env: dict, hold_stdin: bool = False) -> None:
        """``hold_stdin``: the rank's stdin is a pipe held open until it is ended (a task started alone watches it)."""
        proc = subprocess.Popen(argv, env=env, stdin=subprocess.PIPE if hold_stdin else subprocess.DEVNULL,
                                stdout=subprocess.PIPE if self.label else None,
                                stderr=subprocess.STDOUT if self.label else None)
        self.procs.append(proc)
        if self.label:
            self.relays.append(threading.Thread(target=_relay, args=(proc.stdout, rank, sys.stdout.buffer), daemon=True))
            self.relays[-1].start()

    def watch(self, time_limit: float | None = None) -> tuple[int, str]:
        """Until every rank exits with 0, one fails (the others are then ended, as srun's --kill-on-bad-exit) or
        the time limit runs out."""
        procs = self.procs
        deadline = time.monotonic() + time_limit if time_limit else None
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
                return 124, f"the time limit ({time_limit:g} s) ran out"
            time.sleep(0.1)

    def close(self) -> None:
        _end(self.procs, 0)
        for relay in self.relays:
            relay.join(5)


def run_local(args, command: list[str]) -> tuple[int, str]:
    """``--local N``: N ranks as processes of this machine, joined over loopback; the first rank to fail ends the
    others (as srun's --kill-on-bad-exit), and so does the time limit. Returns the exit code and why it ended."""
    hosts = [(socket.gethostname(), args.local)]
    server = _rendezvous("127.0.0.1", hosts)
    ranks = _Ranks(args.label)
    try:
        for slot in plan_slots(hosts):
            ranks.start(slot.rank, command, {**os.environ, **load_backend().rank_env(slot, server.rank_address("127.0.0.1"), server.port, "lo")})
        return ranks.watch(args.time_limit)
    except _Stopped as e:
        _end(ranks.procs)  # with the grace: the ranks may checkpoint
        return 128 + e.signum, f"stopped by {e}"
    finally:
        ranks.close()
        server.stop()


def run_batch(args, command: list[str], sched) -> tuple[int, str]:
    """In a batch job: the ranks over its allocation, each in the user's container; one srun step on Slurm, one
    task per rank on batch systems that start tasks alone (Grid Engine's ``qrsh -inherit``)."""
    addr = args.rendezvous_addr or socket.gethostbyname(socket.gethostname())
    iface = args.iface or iface_for(addr)
    hosts = job_hosts(sched, os.environ)
    spec = ",".join(f"{h}:{n}" for h, n in hosts)
    size = sum(n for _, n in hosts)
    load_site().client().ensure_container(args.image)  # once, before the ranks (they share the home file system)
    server = _rendezvous(addr, hosts)
    # The secret goes to the tasks in the launcher's environment (theirs alone to read), not on a command line.
    env = {**os.environ, RENDEZVOUS_ENV: server.rank_address(addr)}

    def rank_argv(*extra: str) -> list[str]:
        return [sys.executable, "-m", "jupyter_hpcdl.job.launch", "--rank", *extra, f"--backend={load_backend().name}",
                f"--hosts={spec}", f"--image={args.image}",
                f"--port={server.port}", f"--iface={iface}", *(f"--env={n}" for n in args.env), "--", *command]

    ranks = _Ranks(args.label)
    try:
        if hasattr(sched, "step_argv"):
            step = sched.step_argv(size, rank_argv(), label=args.label)
            code = subprocess.call(step, env=env)
            return code, f"{step[0]} exited with {code}"
        names = [RENDEZVOUS_ENV, *(n for n in args.env if n in os.environ)]  # a task alone gets only what is named
        alone = sched.hosts_argv(os.environ) is None  # no parallel environment: the job's one slot is here
        for slot in plan_slots(hosts):
            one = rank_argv(f"--slot={slot.rank}")
            ranks.start(slot.rank, one if alone else sched.task_argv(slot.hostname, names, one), env, hold_stdin=True)
        return ranks.watch()
    except _Stopped as e:
        _end(ranks.procs)  # with the grace, as srun gives its tasks
        return 128 + e.signum, f"stopped by {e}"
    finally:
        ranks.close()
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
    if args.backend is not None:  # the ranks and their containers get it as HPCDL_BACKEND
        try:
            os.environ[BACKEND_ENV] = load_backend(args.backend).name
        except (ValueError, ImportError) as e:
            print(f"hpcdl-launch: --backend: {e}", file=sys.stderr)
            return 2
    if not args.rank:  # the launcher's side: what each rank runs, as the site's backend starts its ranks
        try:
            command = load_backend().rank_command(command)
        except ValueError as e:
            print(f"hpcdl-launch: {e}", file=sys.stderr)
            return 2
    if args.local is not None:
        if not 1 <= args.local <= 256:
            print(f"hpcdl-launch: --local takes 1 to 256 ranks, not {args.local}", file=sys.stderr)
            return 2
        if args.time_limit is not None and not args.time_limit > 0:
            print("hpcdl-launch: --time-limit must be a positive number of seconds", file=sys.stderr)
            return 2
        run = run_local
    elif args.rank:
        try:
            return run_rank(args, command)
        except (ValueError, OSError) as e:
            print(f"hpcdl-launch --rank: {e}", file=sys.stderr)
            return 2
    elif (sched := _job_scheduler()) is False:
        return 2
    elif sched is None:
        print("hpcdl-launch: not inside a batch job: run it from a batch script (sbatch, qsub) or an interactive "
              "allocation (salloc), or give --local N to run N ranks on this machine", file=sys.stderr)
        return 2
    elif not args.image:
        print("hpcdl-launch: give --image: the image whose container runs each rank", file=sys.stderr)
        return 2
    elif not serves(sched, "job"):
        print(f"hpcdl-launch: starting ranks inside a {sched.name} job is not supported yet (Slurm and Grid Engine "
              "are); give --local N to run N ranks on this node", file=sys.stderr)
        return 2
    else:
        run = partial(run_batch, sched=sched)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _raise_stopped)
    try:
        code, why = run(args, command)
    except _Stopped as e:
        code, why = 128 + e.signum, f"stopped by {e}"
    except (ValueError, OSError, subprocess.SubprocessError) as e:  # the job cannot hold the ranks, or was not read
        code, why = 2, str(e)
    print(f"hpcdl-launch: {why}", file=sys.stderr, flush=True)
    if args.status_file:
        write_status(args.status_file, code, why)
    return code


if __name__ == "__main__":
    sys.exit(main())
