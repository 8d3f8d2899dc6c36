"""One scheduler query per interval serves every server of the hub: each spawner asks this cache about its job,
and the queue is read again only when the last reading is older than the interval (concurrent askers share one
query); hub.py keeps one per scheduler for the hub process.

A scheduler that cannot be asked (an error, a timeout: an overloaded or restarting controller) makes every job's
phase UNKNOWN, never ENDED: the last reading is kept, and the queue is asked again with exponential backoff (from the
interval up to ``max_backoff``) so that a struggling controller is not hammered by every server's poll."""
from __future__ import annotations

import asyncio
import time
from dataclasses import replace
from typing import Awaitable, Callable

from ..commands import Result, run
from ..batchsystems.scheduler import ENDED, PENDING, UNKNOWN, JobInfo, Scheduler

Runner = Callable[..., Awaitable[Result]]


class SchedulerUnreachable(RuntimeError):
    """The scheduler did not answer (or answered with an error that is not about the job)."""


class JobQueue:
    def __init__(self, scheduler: Scheduler, interval: float = 5.0, runner: Runner = run, timeout: float = 30.0,
                 max_backoff: float = 60.0):
        self.scheduler = scheduler
        self.interval = interval
        self.runner = runner
        self.timeout = timeout
        self.max_backoff = max_backoff
        self.queries = 0  # scheduler commands run (for the benchmark and tests)
        self.failures = 0  # consecutive failed readings
        self.error = ""  # why the last reading failed
        self.unreachable_since: float | None = None  # monotonic time of the first failure of this outage
        self._jobs: dict[str, JobInfo] = {}
        self._read_at = -1e9
        self._tried_at = -1e9
        self._lock = asyncio.Lock()
        self._ended: dict[str, JobInfo] = {}
        self._reasons: dict[str, tuple[float, str]] = {}  # job → (the reading it was asked at, why it waits)

    @property
    def reachable(self) -> bool:
        return self.unreachable_since is None

    def unreachable_for(self, now: float | None = None) -> float:
        """Seconds since the scheduler stopped answering (0 while it answers)."""
        if self.unreachable_since is None:
            return 0.0
        return (time.monotonic() if now is None else now) - self.unreachable_since

    def _retry_wait(self) -> float:
        return min(self.interval * 2 ** max(self.failures - 1, 0), self.max_backoff)

    def _fresh(self, max_age: float, force: bool = False) -> bool:
        now = time.monotonic()
        if self.failures and not force:
            return now - self._tried_at < max(max_age, self._retry_wait())
        return now - self._read_at < max_age

    async def ask(self, argv: list[str], what: str) -> Result:
        """Run one scheduler command (counted, with the queue's deadline); SchedulerUnreachable if it could not."""
        try:
            result = await self.runner(argv, timeout=self.timeout)
        except (OSError, RuntimeError) as e:  # the runner's timeout names the command
            raise SchedulerUnreachable(f"{what}: {e or type(e).__name__}") from None
        finally:
            self.queries += 1
        return result

    def _failed(self, error: str) -> None:
        self.failures += 1
        self.error = error
        if self.unreachable_since is None:
            self.unreachable_since = time.monotonic()

    def _answered(self) -> None:
        self.failures, self.error, self.unreachable_since = 0, "", None

    async def refresh(self, max_age: float | None = None, force: bool = False) -> None:
        """Read the queue unless the last reading is fresh enough (or, during an outage, unless the next retry is
        not due yet; ``force``: the caller has just seen the scheduler answer). Never raises for the scheduler's
        sake: a failure is recorded (see :attr:`reachable`)."""
        max_age = self.interval if max_age is None else max_age
        if self._fresh(max_age, force):
            return
        async with self._lock:
            if self._fresh(max_age, force):
                return  # someone else read it while we waited
            self._tried_at = time.monotonic()
            try:
                result = await self.ask(self.scheduler.queue_argv(), "reading the queue")
                if result.returncode:
                    raise SchedulerUnreachable(result.failure("reading the queue"))
            except SchedulerUnreachable as e:
                self._failed(str(e))
                return
            try:
                self._jobs = self.scheduler.parse_queue(result.stdout)
            except ValueError as e:  # an answer that cannot be read is no answer (never "no jobs")
                self._failed(f"reading the queue: {e}")
                return
            self._read_at = time.monotonic()
            self._answered()

    def jobs(self) -> dict[str, JobInfo]:
        """Every job of the last good reading (all users')."""
        return dict(self._jobs)

    def unknown(self, job_id: str) -> JobInfo:
        last = self._jobs.get(job_id)
        return JobInfo(job_id, UNKNOWN, "UNKNOWN", f"the scheduler is not answering ({self.error})",
                       batch_host=last.batch_host if last else "")

    async def job(self, job_id: str, max_age: float | None = None, force: bool = False) -> JobInfo | None:
        """The job as last seen (at most ``max_age`` s old); for a job gone from the queue, why it ended (or None
        when the scheduler has forgotten it); phase UNKNOWN while the scheduler cannot be asked."""
        await self.refresh(max_age, force)
        if not self.reachable:
            return self.unknown(job_id)
        info = self._jobs.get(job_id)
        if info is not None and info.phase == PENDING and not self.scheduler.queue_has_reasons:
            return await self._pending_reason(info)
        if info is not None and info.phase != ENDED:
            return info
        if job_id not in self._ended:
            try:
                ended = await self._ask_job(self.scheduler.job_argv(job_id), f"asking about job {job_id}")
                accounting = self.scheduler.accounting_argv(job_id)
                if ended is None and accounting:  # gone from the scheduler's memory: its accounting may know
                    try:
                        ended = await self._ask_job(accounting, f"reading job {job_id}'s accounting")
                    except SchedulerUnreachable as e:  # the job is gone either way: never the whole queue UNKNOWN
                        ended = JobInfo(job_id, ENDED, "ENDED", f"left the queue; its accounting could not be read ({e})")
            except SchedulerUnreachable as e:
                self._failed(str(e))
                return self.unknown(job_id)
            if ended is None:
                return info
            if ended.phase != ENDED:  # left the queue listing between the two reads: report it as it is now
                return ended
            self._ended[job_id] = ended
        return self._ended[job_id]

    async def _ask_job(self, argv: list[str], what: str) -> JobInfo | None:
        """One job as ``argv`` tells it; None where the scheduler does not know it."""
        result = await self.ask(argv, what)
        if result.returncode and not self.scheduler.job_forgotten(result.stderr + result.stdout):
            raise SchedulerUnreachable(result.failure(what))
        try:
            return self.scheduler.parse_job(result.stdout) if result.returncode == 0 else None
        except ValueError as e:  # an answer that cannot be read is no answer
            raise SchedulerUnreachable(f"{what}: {e}") from None

    async def _pending_reason(self, info: JobInfo) -> JobInfo:
        """A pending job with the reason its details give (asked once per reading of the queue)."""
        if self._reasons.get(info.job_id, (None, ""))[0] != self._read_at:
            try:
                detail = await self._ask_job(self.scheduler.job_argv(info.job_id), f"asking why job {info.job_id} waits")
            except SchedulerUnreachable:
                return info  # the listing's answer stands; the next reading asks again
            self._reasons[info.job_id] = (self._read_at, detail.reason if detail and detail.phase == PENDING else "")
            if detail is not None and detail.phase == ENDED:
                self._ended[info.job_id] = detail
                return detail
        reason = self._reasons[info.job_id][1]
        return replace(info, reason=reason) if reason else info

