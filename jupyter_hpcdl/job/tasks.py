"""``python -m jupyter_hpcdl.job.tasks``: one task per rank over the batch job this runs in, and wait for them (job side,
on the job's first host). The batch system's adapter says how: one step on Slurm (srun); one task per rank where
tasks are started alone (Grid Engine's ``qrsh -inherit``), each supervised on its host by ``--one``, which ends the
task's tree when this launcher ends or closes the task's stdin (a killed qrsh does not end its remote task).

Every task knows its rank and host: Slurm's task variables, or ``HPCDL_TASK_RANK`` / ``HPCDL_TASK_NODE``; with
``--gpus-per-rank G`` each sees only its own G of its host's GPUs. Used by the allocation's owner for a training
session's engines, and by the scripts of new allocations::

    python -m jupyter_hpcdl.job.tasks --ranks 4 --gpus-per-rank 1 -e IPP_PROFILE_DIR -- CMD ...
"""
from __future__ import annotations

import argparse
import ctypes
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

from ..commands import end_groups, start_group

TASK_RANK_ENV, TASK_NODE_ENV = "HPCDL_TASK_RANK", "HPCDL_TASK_NODE"
#: How long a rank has between its supervisor's SIGTERM and SIGKILL, and how long the launcher waits for its tasks
#: to end after closing their stdin.
GRACE_S = 10.0
HOSTS_TIMEOUT_S = 15.0


@dataclass(frozen=True)
class TaskExit:
    """A task that ended before its launcher: its rank, its host and how it ended."""

    rank: int
    node: str
    how: str


#: How a task's early end reads in the launcher's output: Slurm's srun, and this launcher's own line.
_SRUN_EXIT = re.compile(r"^srun: error: (?P<node>[\w.-]+): tasks? (?P<ranks>[\d,-]+): (?P<how>.+)$", re.M)
_OWN_EXIT = re.compile(r"^jupyter_hpcdl\.job\.tasks: task (?P<ranks>\d+) on (?P<node>[\w.-]+) (?P<how>.+)$", re.M)


def exit_line(rank: int, node: str, code: int) -> str:
    """This launcher's line for a task that ended with ``code`` (what :func:`task_exits` reads back)."""
    how = f"exited with exit code {code}" if code >= 0 else f"was killed by signal {-code}"
    return f"jupyter_hpcdl.job.tasks: task {rank} on {node} {how}"


def task_exits(output: str) -> list[TaskExit]:
    """The tasks that ended early, read from a launcher's output (srun's ``srun: error: node2: task 1: Exited with
    exit code 1``, or :func:`exit_line`), in rank order."""
    found: dict[int, TaskExit] = {}
    for pattern in (_SRUN_EXIT, _OWN_EXIT):
        for m in pattern.finditer(output):
            for part in m["ranks"].split(","):
                first, _, last = part.partition("-")
                if first.isdigit() and (not last or last.isdigit()):
                    for rank in range(int(first), int(last or first) + 1):
                        found.setdefault(rank, TaskExit(rank, m["node"], m["how"].strip()))
    return [found[r] for r in sorted(found)]


def spread(hosts: Sequence[tuple[str, int]], ranks: int) -> list[tuple[str, int]]:
    """``ranks`` over the job's hosts, filling each host's slots in order (block-wise, as the ranks are numbered)."""
    total = sum(n for _, n in hosts)
    if not 1 <= ranks <= total:
        raise ValueError(f"this job holds {total} task slot(s) on {len(hosts)} host(s): ask for 1 to {total} ranks, "
                         "or for a bigger job")
    placed, left = [], ranks
    for host, n in hosts:
        if left <= 0:
            break
        placed.append((host, min(n, left)))
        left -= placed[-1][1]
    return placed


def gpu_share(visible: str | None, local_rank: int, per_rank: int) -> str | None:
    """This task's GPUs out of its host's ``CUDA_VISIBLE_DEVICES``: the ``local_rank``-th ``per_rank`` of them."""
    if not per_rank or visible is None:
        return visible
    devices = [d for d in visible.split(",") if d]
    share = devices[local_rank * per_rank:(local_rank + 1) * per_rank]
    if len(share) < per_rank:
        raise ValueError(f"task {local_rank} on this host needs {per_rank} GPU(s), but the job has {len(devices)} here "
                         f"(CUDA_VISIBLE_DEVICES={visible})")
    return ",".join(share)


def job_hosts(sched, env: Mapping[str, str]) -> list[tuple[str, int]]:
    """The job's hosts and slots, as its batch system says."""
    argv = sched.hosts_argv(env)
    out = ""
    if argv:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=HOSTS_TIMEOUT_S, env=dict(env))
        if done.returncode:
            raise ValueError(f"{argv[0]} could not list the job's hosts: {done.stderr.strip()[:300]}")
        out = done.stdout
    return sched.parse_hosts(out, env)


def _term_with_parent() -> Callable[[], None] | None:
    """For a child: SIGTERM when its parent dies (Linux's PR_SET_PDEATHSIG), so that a supervisor killed outright
    (Grid Engine's qdel kills a task's process group with SIGKILL) still ends the rank it started in a session of
    its own. None where the C library has no prctl."""
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def arm() -> None:
        prctl(1, signal.SIGTERM, 0, 0, 0)  # 1: PR_SET_PDEATHSIG
        if os.getppid() != parent:  # the parent died before the signal was armed
            os._exit(143)

    return arm


def supervise(argv: list[str]) -> int:
    """Run ``argv`` until it exits, or until this process's stdin closes or it is told to stop: then end ``argv``'s
    process group (SIGTERM, SIGKILL after the grace). If this process is killed outright, ``argv`` gets SIGTERM."""
    proc = start_group(argv, stdin=subprocess.DEVNULL, preexec_fn=_term_with_parent())
    ended = threading.Event()

    def watch_stdin() -> None:
        try:
            while os.read(0, 4096):
                pass
        except OSError:
            pass
        ended.set()

    threading.Thread(target=watch_stdin, daemon=True).start()
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda *_: ended.set())
    while proc.poll() is None:
        if ended.wait(0.2):
            end_groups([proc], GRACE_S + 20)  # longer than the container runner's own stop (it ends the whole tree)
            break
    return proc.wait()


def end_tasks(procs: Sequence[subprocess.Popen], grace: float = GRACE_S + 25) -> None:
    # (the default: longer than a supervisor's own end of its rank, and shorter than the allocation owner's grace)
    """Tasks started alone: close their stdin (their supervisors end the ranks), then signal what is left."""
    for proc in procs:
        if proc.stdin and not proc.stdin.closed:
            proc.stdin.close()
    deadline = time.monotonic() + grace
    while any(proc.poll() is None for proc in procs) and time.monotonic() < deadline:
        time.sleep(0.05)
    end_groups(procs, 5.0)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m jupyter_hpcdl.job.tasks", description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, help="how many tasks (default: every slot of the job)")
    p.add_argument("--gpus-per-rank", type=int, default=0, help="each task its own this many of its host's GPUs")
    p.add_argument("--mpi", action="store_true", help="the tasks' MPI world from the batch system (Slurm's PMIx)")
    p.add_argument("--name", default="hpcdl-tasks", help="the step's name, where the batch system names steps")
    p.add_argument("-e", "--env", action="append", default=[], metavar="NAME",
                   help="also pass this variable to tasks started alone (they get only what is named)")
    p.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # one task, on its host
    p.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    p.add_argument("--local-rank", type=int, help=argparse.SUPPRESS)
    p.add_argument("--node", help=argparse.SUPPRESS)
    p.add_argument("command", nargs=argparse.REMAINDER)
    return p


def run_one(args, command: list[str]) -> int:
    os.environ[TASK_RANK_ENV], os.environ[TASK_NODE_ENV] = str(args.rank), args.node or ""
    share = gpu_share(os.environ.get("CUDA_VISIBLE_DEVICES"), args.local_rank or 0, args.gpus_per_rank)
    if share is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = share
    return supervise(command)


def run_tasks(sched, args, command: list[str]) -> int:
    from ..batchsystems.scheduler import require

    require(sched, "job")  # (RoleUnsupported, a ValueError, says what the adapter serves)
    hosts = job_hosts(sched, os.environ)
    ranks = args.ranks or sum(n for _, n in hosts)
    if hasattr(sched, "step_argv"):
        step = sched.step_argv(ranks, command, kill_on_bad_exit=False, nodes=min(len(hosts), ranks),
                               gpus_per_task=args.gpus_per_rank, mpi=args.mpi, job_name=args.name)
        os.execvp(step[0], step)  # the step is this process: stopping it stops the step
    if args.mpi:
        raise ValueError(f"an MPI world from the batch system needs Slurm's PMIx; in a {sched.name} job use Gloo")
    names = [n for n in args.env if n in os.environ and n != "CUDA_VISIBLE_DEVICES"]
    procs: list[subprocess.Popen] = []
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda *_: stop.set())
    alone = sched.hosts_argv(os.environ) is None  # no parallel environment: the job's one slot is here
    where: list[tuple[int, str]] = []  # each task's rank and host
    said: set[int] = set()
    try:
        rank = 0
        for host, n in spread(hosts, ranks):
            for local in range(n):
                if stop.is_set():
                    return 143
                one = [sys.executable, "-m", "jupyter_hpcdl.job.tasks", "--one", f"--rank={rank}",
                       f"--local-rank={local}", f"--node={host}", f"--gpus-per-rank={args.gpus_per_rank}", "--",
                       *command]
                # its own session: a stop of this launcher's group reaches the tasks through their stdin, not by
                # killing qrsh (which would leave the remote task running)
                procs.append(start_group(one if alone else sched.task_argv(host, names, one), stdin=subprocess.PIPE))
                where.append((rank, host))
                rank += 1
        while not stop.wait(0.2):
            for i, proc in enumerate(procs):  # a task that failed is said at once, as srun does
                if proc.poll() not in (None, 0) and i not in said:
                    said.add(i)
                    print(exit_line(*where[i], proc.returncode), file=sys.stderr, flush=True)
            if all(proc.poll() is not None for proc in procs):
                code = next((proc.returncode for proc in procs if proc.returncode), 0)
                return 128 - code if code < 0 else code
        return 143
    finally:
        end_tasks(procs)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        print("jupyter_hpcdl.job.tasks: give the command after --", file=sys.stderr)
        return 2
    try:
        if args.one:
            return run_one(args, command)
        from ..batchsystems.scheduler import job_scheduler

        sched = job_scheduler(os.environ)
        if sched is None:
            print("jupyter_hpcdl.job.tasks: not inside a batch job", file=sys.stderr)
            return 2
        return run_tasks(sched, args, command)
    except (ValueError, OSError, subprocess.SubprocessError) as e:
        print(f"jupyter_hpcdl.job.tasks: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
