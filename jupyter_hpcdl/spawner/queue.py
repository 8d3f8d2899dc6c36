"""One scheduler query per interval serves every server of the hub: each spawner asks this cache about its job,
and the queue is read again only when the last reading is older than the interval (concurrent askers share one
query)."""
from __future__ import annotations

import asyncio
import time
from typing import Awaitable, Callable

from .commands import Result, run
from .scheduler import ENDED, JobInfo, Scheduler

Runner = Callable[..., Awaitable[Result]]


class JobQueue:
    def __init__(self, scheduler: Scheduler, interval: float = 5.0, runner: Runner = run):
        self.scheduler = scheduler
        self.interval = interval
        self.runner = runner
        self.queries = 0  # scheduler commands run (for the benchmark and tests)
        self._jobs: dict[str, JobInfo] = {}
        self._read_at = -1e9
        self._lock = asyncio.Lock()
        self._ended: dict[str, JobInfo] = {}

    async def refresh(self, max_age: float | None = None) -> None:
        max_age = self.interval if max_age is None else max_age
        if time.monotonic() - self._read_at < max_age:
            return
        async with self._lock:
            if time.monotonic() - self._read_at < max_age:
                return  # someone else read it while we waited
            result = (await self.runner(self.scheduler.queue_argv())).check("reading the queue")
            self.queries += 1
            self._jobs = self.scheduler.parse_queue(result.stdout)
            self._read_at = time.monotonic()

    async def job(self, job_id: str, max_age: float | None = None) -> JobInfo | None:
        """The job as last seen (at most ``max_age`` s old); for a job gone from the queue, why it ended (or None
        when the scheduler has forgotten it)."""
        await self.refresh(max_age)
        info = self._jobs.get(job_id)
        if info is not None and info.phase != ENDED:
            return info
        if job_id not in self._ended:
            result = await self.runner(self.scheduler.job_argv(job_id))
            self.queries += 1
            ended = self.scheduler.parse_job(result.stdout) if result.returncode == 0 else None
            if ended is None:
                return info
            if ended.phase != ENDED:  # left the queue listing between the two reads: report it as it is now
                return ended
            self._ended[job_id] = ended
        return self._ended[job_id]


_QUEUES: dict[tuple[str, float], JobQueue] = {}


def shared_queue(scheduler: Scheduler, interval: float) -> JobQueue:
    """The hub-wide queue for this scheduler."""
    key = (scheduler.name, interval)
    if key not in _QUEUES:
        _QUEUES[key] = JobQueue(scheduler, interval)
    return _QUEUES[key]
