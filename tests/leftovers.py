"""What a test may leave behind, and who left it: the test users' batch jobs and processes, and the live processes
this test process started itself (not the bed's daemons, which the bed starts and a fault test may restart).
``conftest.py`` takes a snapshot before each test and checks after its teardown.

The suite runs as two streams side by side (``conftest.STREAMS``): one uses Slurm and its hub, the other runs
local ranks and Grid Engine. Each stream looks only at its own scheduler's jobs, at the users' processes inside
those jobs, and at what its own test process started, so neither blames the other for what it runs meanwhile. A
user's process outside any job and outside both test processes (an orphan) is counted by both."""
from __future__ import annotations

import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

#: Where a user's process runs: under a Slurm step or a Grid Engine shepherd (by the ancestor's name).
JOB_ANCESTORS = {"slurmstepd": "slurm", "slurmd": "slurm", "sge_shepherd": "gridengine", "sge_execd": "gridengine"}
#: The scheduler of each stream's jobs.
STREAM_SCHEDULER = {"slurm": "slurm", "rest": "gridengine"}


@dataclass(frozen=True)
class Thing:
    """One job or process; ``key`` stays the same for as long as it lives (a pid with its start time)."""

    key: tuple
    text: str


def _slurm_jobs(users: list[str]) -> list[Thing]:
    try:
        out = subprocess.run(["squeue", "-h", "-u", ",".join(users), "-o", "%i %u %T %j"], capture_output=True,
                             text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [Thing(("slurm", line.split()[0]), f"Slurm job {line}") for line in out.splitlines() if line.strip()]


def _gridengine_jobs(users: list[str]) -> list[Thing]:
    import gridengine  # the bed's module (testbed/), only where the bed is up: Grid Engine's client environment

    try:
        out = gridengine.client(["qstat", "-u", ",".join(users)]).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [Thing(("sge", line.split()[0]), f"Grid Engine job {' '.join(line.split()[:5])}")
            for line in out.splitlines()[2:] if line.split() and line.split()[0].isdigit()]


def _daemon_pids(state: Path) -> set[int]:
    pids = set()
    for pidfile in (state / "run").glob("*.pid"):
        try:
            pids.add(int(pidfile.read_text().split()[0]))
        except (OSError, ValueError, IndexError):
            pass
    return pids


def _processes(users: set[str], state: Path, stream: str) -> list[Thing]:
    """The processes this stream answers for: the test users' (in this stream's jobs, started by this test process,
    or orphans), and this test process's own descendants outside the bed's daemons."""
    me = os.getpid()
    controller = os.getppid() if os.environ.get("PYTEST_XDIST_WORKER") else None  # the other stream's parent too
    daemons = _daemon_pids(state)
    procs = {}
    for p in psutil.process_iter(["pid", "ppid", "name", "username", "cmdline", "create_time", "status"]):
        if p.info["status"] != psutil.STATUS_ZOMBIE:
            procs[p.info["pid"]] = p.info

    def owner(pid: int) -> str:
        """'mine', 'daemon', 'other stream', a scheduler's name, or 'orphan'."""
        for _ in range(64):
            if pid in daemons:
                return "daemon"
            info = procs.get(pid)
            if info is None:
                return "orphan"
            if info["name"] in JOB_ANCESTORS or (info["name"] or "").startswith("sge_shepherd"):
                return JOB_ANCESTORS.get(info["name"], "gridengine")
            pid = info["ppid"]
            if pid == me:
                return "mine"
            if controller is not None and pid == controller:
                return "other stream"
            if pid in (0, 1):
                return "orphan"
        return "orphan"

    found = []
    for pid, info in procs.items():
        if pid == me:
            continue
        who = owner(pid)
        ours = who == "mine" or (info["username"] in users and who in ("orphan", STREAM_SCHEDULER[stream]))
        if ours:
            found.append(Thing(("pid", pid, info["create_time"]),
                               f"process {pid} of {info['username']}: {' '.join(info['cmdline'] or [])[:200]}"))
    return found


def snapshot(users: list[str], state: Path, bed_up: bool, stream: str) -> dict[tuple, Thing]:
    things = _processes(set(users), state, stream)
    if bed_up:
        things += _slurm_jobs(users) if STREAM_SCHEDULER[stream] == "slurm" else _gridengine_jobs(users)
    return {t.key: t for t in things}


def still_there(keys: set[tuple] | None, users: list[str], state: Path, bed_up: bool, stream: str,
                exclude: set[tuple] = frozenset(), timeout: float = 30) -> list[Thing]:
    """Those of ``keys`` (all, when None) but ``exclude`` still there after up to ``timeout`` seconds (a cancelled
    job's processes, a stopped server, take a moment to go)."""
    deadline = time.monotonic() + timeout
    while True:
        now = snapshot(users, state, bed_up, stream)
        left = [t for k, t in now.items() if (keys is None or k in keys) and k not in exclude]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.5)


def cpu_times() -> tuple[float, float]:
    """This machine's (busy, total) CPU time so far, in clock ticks of all cores (``/proc/stat``)."""
    with open("/proc/stat") as f:
        fields = [float(x) for x in f.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0.0)  # idle + iowait
    return sum(fields) - idle, sum(fields)
