"""Scheduler load of polling 1,000 servers, per poll interval: HpcdlSpawner's shared queue (one ``squeue --all`` for
every server) against batchspawner's way (one ``squeue -j JOB`` per server). The count comes from running the real
JobQueue with 1,000 concurrent pollers whose jobs are simulated in the listing; the cost of each kind of query is
the median wall time of the real commands on the test bed's Slurm, in alternating rounds.

    /opt/jupyter-hpcdl/venv/bin/python benchmarks/scheduler_queries.py --servers 1000   # with the bed up
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time

from jupyter_hpcdl.spawner.commands import run
from jupyter_hpcdl.spawner.queue import JobQueue
from jupyter_hpcdl.batchsystems.slurm import Slurm


def timed(argv: list[str]) -> float:
    t0 = time.perf_counter()
    subprocess.run(argv, check=True, capture_output=True)
    return time.perf_counter() - t0


async def shared_queue_queries(servers: int) -> tuple[int, int]:
    """Run the real queue against real squeue, with ``servers`` simulated RUNNING jobs added to its listing."""
    simulated = "".join(f"{900000 + i}|RUNNING|None|N/A|node1|u\n" for i in range(servers))
    commands = []

    async def runner(argv, **kw):
        commands.append(argv[0])
        result = await run(argv, **kw)
        return type(result)(result.argv, result.returncode, result.stdout + simulated, result.stderr)

    queue = JobQueue(Slurm(), interval=30, runner=runner)
    infos = await asyncio.gather(*(queue.job(str(900000 + i)) for i in range(servers)))
    assert all(i is not None and i.phase == "running" for i in infos)
    return queue.queries, len(commands)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--servers", type=int, default=1000)
    p.add_argument("--rounds", type=int, default=15)
    args = p.parse_args()
    queries, commands = asyncio.run(shared_queue_queries(args.servers))
    job = subprocess.run(["sbatch", "--parsable", "--wrap=sleep 120", "--time=5"], check=True, capture_output=True,
                         text=True).stdout.strip()
    try:
        all_jobs, one_job = [], []
        for r in range(args.rounds):
            pair = [("all", Slurm().queue_argv()), ("one", ["squeue", "-h", "-j", job, "-o", "%T %B"])]
            for kind, argv in (pair if r % 2 == 0 else pair[::-1]):
                (all_jobs if kind == "all" else one_job).append(timed(argv))
    finally:
        subprocess.run(["scancel", job], check=False)
    t_all, t_one = statistics.median(all_jobs), statistics.median(one_job)
    summary = {
        "servers": args.servers,
        "hpcdl_queries_per_interval": queries,
        "batchspawner_queries_per_interval": args.servers,
        "query_ratio_hpcdl_over_batchspawner": queries / args.servers,
        "squeue_all_s": t_all,
        "squeue_one_job_s": t_one,
        "scheduler_seconds_per_interval_hpcdl": queries * t_all,
        "scheduler_seconds_per_interval_batchspawner": args.servers * t_one,
    }
    print(json.dumps(summary, indent=2))
    return 0 if commands == queries == 1 else 1


if __name__ == "__main__":
    sys.exit(main())
