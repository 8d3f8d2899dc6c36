"""A workshop's load on the hub: every attendee of the test bed (20) spawns at once through the REST API, each
watching their spawn's progress as the browser does, while the hub's API is sampled every 0.2 s. Baselines from the
same run: the API's latency with the hub idle, and one attendee's spawn alone.

Figures: time until every server is ready (and its ratio to one spawn alone), the hub API's latency p50/p95 under
the load (and its ratio to idle), and the scheduler's job-listing RPCs per queue interval (slurmctld's own count,
``sdiag``) while every server is polled. Everything stops at the end; jobs left behind are counted.

    /opt/jupyter-hpcdl/venv/bin/python benchmarks/hub_load.py [--users 20]   # as root, with the bed up
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

STATE = Path(os.environ.get("HPCDL_TESTBED_STATE", "/var/lib/jupyter-hpcdl-testbed"))
WORKSHOP_OPTIONS = {"partition": "cpu", "gpus_per_node": 0, "image": "os", "walltime": "00:30:00"}


@dataclass
class Outcome:
    user: str
    status: int  # of the spawn request
    result: str  # ready, refused or failed
    message: str  # the refusal, or the last progress message
    ready_s: float | None = None


@dataclass
class LoadReport:
    users: int
    outcomes: list[Outcome]
    all_ready_s: float | None
    api_p50_s: float
    api_p95_s: float
    api_max_s: float
    api_samples: int
    job_info_rpcs: int
    rpcs_per_interval: float
    jobs_left: list[str]
    stopped_s: float
    api_errors: list[str] = field(default_factory=list)


def hub_client(timeout: float = 30) -> httpx.Client:
    bed = json.loads((STATE / "bed.json").read_text())
    token = (Path(bed["hub_dir"]) / "service_token").read_text().strip()
    return httpx.Client(base_url=bed["hub_url"], headers={"Authorization": f"token {token}"}, timeout=timeout)


def job_info_rpcs() -> int:
    """slurmctld's count of job-listing RPCs (squeue, scontrol show job) since it started."""
    out = subprocess.run(["sdiag"], capture_output=True, text=True, timeout=30).stdout
    m = re.search(r"REQUEST_JOB_INFO\s+\(\s*\d+\)\s+count:\s*(\d+)", out)
    return int(m.group(1)) if m else 0


def spawn_and_watch(client: httpx.Client, user: str, options: dict, timeout: float) -> Outcome:
    t0 = time.monotonic()
    r = client.post(f"/hub/api/users/{user}/server", json=options)
    if r.status_code >= 400:
        return Outcome(user, r.status_code, "refused", r.json().get("message", r.text))
    message = ""
    with client.stream("GET", f"/hub/api/users/{user}/server/progress", timeout=timeout) as events:
        for line in events.iter_lines():
            if not line.startswith("data:"):
                continue
            event = json.loads(line[5:])
            message = event.get("message", message)
            if event.get("ready"):
                return Outcome(user, r.status_code, "ready", message, time.monotonic() - t0)
            if event.get("failed"):
                return Outcome(user, r.status_code, "failed", message)
    server = client.get(f"/hub/api/users/{user}").json()["servers"].get("")
    if server and server.get("ready"):
        return Outcome(user, r.status_code, "ready", message, time.monotonic() - t0)
    return Outcome(user, r.status_code, "failed", message or "the progress stream ended")


class LatencySampler(threading.Thread):
    """Calls the hub's API every ``every`` seconds and keeps each call's latency."""

    def __init__(self, client: httpx.Client, path: str = "/hub/api/users", every: float = 0.2):
        super().__init__(daemon=True)
        self.client, self.path, self.every = client, path, every
        self.samples: list[float] = []
        self.errors: list[str] = []  # a call that failed or timed out counts as a sample too (its time until then)
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.is_set():
            t0 = time.monotonic()
            try:
                self.client.get(self.path).raise_for_status()
            except httpx.HTTPError as e:
                self.errors.append(f"{type(e).__name__}: {e}")
            self.samples.append(time.monotonic() - t0)
            self.stopped.wait(max(self.every - (time.monotonic() - t0), 0))

    def stop(self) -> list[float]:
        self.stopped.set()
        self.join(timeout=60)
        return self.samples


def stop_all(client: httpx.Client, users: list[str], timeout: float = 300) -> float:
    t0 = time.monotonic()
    with ThreadPoolExecutor(len(users)) as pool:
        list(pool.map(lambda u: client.delete(f"/hub/api/users/{u}/server", timeout=timeout), users))
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not any(client.get(f"/hub/api/users/{u}").json()["servers"] for u in users):
            break
        time.sleep(1)
    return time.monotonic() - t0


def queued_jobs(users: list[str]) -> list[str]:
    out = subprocess.run(["squeue", "-h", "-u", ",".join(users), "-o", "%i"], capture_output=True, text=True,
                         timeout=30).stdout
    return out.split()


def percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


def run_load(users: list[str], options: dict = WORKSHOP_OPTIONS, timeout: float = 900,
             queue_interval: float = 2.0) -> LoadReport:
    """Spawn every user's server at once and watch them all; then stop them all (see the module's docstring)."""
    with hub_client() as client:
        rpcs0, t0 = job_info_rpcs(), time.monotonic()
        sampler = LatencySampler(client)
        sampler.start()
        with ThreadPoolExecutor(len(users)) as pool:
            outcomes = list(pool.map(lambda u: spawn_and_watch(client, u, options, timeout), users))
        ready = [o.ready_s for o in outcomes if o.result == "ready"]
        rpcs, elapsed = job_info_rpcs() - rpcs0, time.monotonic() - t0
        samples, errors = sampler.stop(), sampler.errors
        stopped_s = stop_all(client, [o.user for o in outcomes if o.status < 400])
        time.sleep(2)
        return LoadReport(
            users=len(users), outcomes=outcomes, all_ready_s=max(ready) if len(ready) == len(users) else None,
            api_p50_s=percentile(samples, 50), api_p95_s=percentile(samples, 95), api_max_s=max(samples),
            api_samples=len(samples), job_info_rpcs=rpcs, rpcs_per_interval=rpcs / max(elapsed / queue_interval, 1),
            jobs_left=queued_jobs(users), stopped_s=stopped_s, api_errors=errors)


def idle_latency(samples: int = 50) -> list[float]:
    with hub_client() as client:
        sampler = LatencySampler(client)
        sampler.start()
        while len(sampler.samples) < samples:
            time.sleep(0.2)
        return sampler.stop()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--users", type=int, default=20)
    p.add_argument("--out", default="", help="write the report (JSON) here too")
    args = p.parse_args()
    attendees = json.loads((STATE / "bed.json").read_text())["workshop_users"][:args.users]
    idle = idle_latency()
    alone = run_load(attendees[:1])
    load = run_load(attendees)
    idle_p95 = percentile(idle, 95)
    summary = {
        "users": load.users,
        "outcomes": {r: sum(o.result == r for o in load.outcomes) for r in ("ready", "refused", "failed")},
        "one_spawn_alone_s": round(alone.all_ready_s or float("nan"), 1),
        "all_ready_s": round(load.all_ready_s or float("nan"), 1),
        "all_ready_over_one_alone": round((load.all_ready_s or float("nan")) / (alone.all_ready_s or float("nan")), 2),
        "api_idle_p95_s": round(idle_p95, 3),
        "api_under_load_p50_s": round(load.api_p50_s, 3), "api_under_load_p95_s": round(load.api_p95_s, 3),
        "api_under_load_max_s": round(load.api_max_s, 3),
        "api_p95_under_load_over_idle": round(load.api_p95_s / idle_p95, 2),
        "job_info_rpcs_per_queue_interval": round(load.rpcs_per_interval, 2),
        "jobs_left": load.jobs_left, "stop_all_s": round(load.stopped_s, 1), "api_errors": len(load.api_errors),
    }
    print(json.dumps(summary, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps({"summary": summary, "load": asdict(load), "alone": asdict(alone)},
                                             indent=2) + "\n")
    return 0 if summary["outcomes"]["failed"] == 0 and not load.jobs_left else 1


if __name__ == "__main__":
    raise SystemExit(main())
