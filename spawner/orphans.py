"""No job without its server: every job a hub submits carries a mark (its comment) naming the hub, the user and the
server; a job with this hub's mark that no server's state owns is an orphan, and is cancelled (as its user).

Which jobs are adopted instead: a job that a spawner's state still names (a spawn pending or running when the hub
stopped) is followed again by that spawner (``start``/``get_url``). A job that no state names has lost its server's
API token with the server (JupyterHub revokes it when a server stops), so its JupyterLab could never be reached
through the hub again: cancelling it, and telling the user on the next form, is the only safe end.

A job is cancelled only when two sweeps at least an interval apart both find it unowned (a spawn records its job
at once after the submission, so a fresh job is never taken for an orphan), only while the scheduler answers, and
only if its comment, read alone, is exactly this hub's mark for the job's owner as the scheduler reports it: names
and comments are free text (they can hold newlines), so they never come from the shared listing of every job.
"""
from __future__ import annotations

import asyncio
import logging
import re
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping, Sequence

from .commands import cancel_as_user
from .queue import JobQueue, SchedulerUnreachable
from ..batchsystems.scheduler import ENDED, JobInfo

MARK_PREFIX = "jupyterhub-hpcdl"
_TAG = re.compile(r"[A-Za-z0-9._-]{1,40}")
_SAFE = re.compile(r"[A-Za-z0-9._-]")


def _encode(text: str) -> str:
    """Letters, digits and ``._-`` as they are; anything else as %XX of its UTF-8 bytes (so a server name can
    never bring anything else into a batch script)."""
    return "".join(c if _SAFE.fullmatch(c) else "".join(f"%{b:02X}" for b in c.encode()) for c in text)


def _decode(text: str) -> str:
    return re.sub(rb"%([0-9A-F]{2})", lambda m: bytes([int(m.group(1), 16)]), text.encode()).decode(errors="replace")


def check_hub_tag(tag: str) -> str:
    if not _TAG.fullmatch(tag):
        raise ValueError(f"hub_tag {tag!r}: 1 to 40 letters, digits, '.', '_' or '-'")
    return tag


@dataclass(frozen=True)
class JobMark:
    """Whose job this is: the hub, the user and the server (its name; "" for the default server)."""

    hub: str
    user: str
    server: str = ""

    def comment(self) -> str:
        return ":".join((MARK_PREFIX, check_hub_tag(self.hub), _encode(self.user), _encode(self.server)))

    @classmethod
    def parse(cls, comment: str) -> "JobMark | None":
        parts = comment.split(":")
        if len(parts) != 4 or parts[0] != MARK_PREFIX or not _TAG.fullmatch(parts[1]):
            return None
        return cls(parts[1], _decode(parts[2]), _decode(parts[3]))


def find_suspects(jobs: Mapping[str, JobInfo], named: Iterable[str], owned: Iterable[str]) -> list[JobInfo]:
    """The jobs named as this hub names its jobs that are in the queue, not ended, and that no server owns."""
    owned = set(owned)
    return [jobs[j] for j in named if j in jobs and jobs[j].phase != ENDED and j not in owned]


def is_orphan(job: JobInfo, comment_output: str, hub: str) -> JobMark | None:
    """The job's mark if its comment, read alone, is exactly this hub's mark for the job's own user (anyone can
    write a comment, or name a job like the hub's)."""
    lines = comment_output.splitlines()
    mark = JobMark.parse(lines[0].strip()) if len(lines) == 1 else None
    return mark if mark is not None and mark.hub == hub and mark.user == job.user else None


@dataclass(frozen=True)
class SweepAction:
    job_id: str
    user: str
    server: str
    cancelled: bool
    message: str


OwnedFn = Callable[[], Iterable[str]]
NotifyFn = Callable[[JobMark, str], None]


class OrphanSweeper:
    """Sweeps one hub's jobs at start-up and every ``interval`` seconds (see the module's docstring). The queue's
    shared reading (which holds only fields no user writes) gives each job's state and owner; the ids of the jobs
    named as the hub names its jobs come from a second listing of ids alone; a suspect's comment is read alone and
    must be exactly this hub's mark for that owner."""

    def __init__(self, queue: JobQueue, hub: str, job_name: str, owned: OwnedFn, notify: NotifyFn,
                 exec_prefix: Sequence[str] = ("sudo", "-n", "-u", "{username}"), interval: float = 300.0,
                 log: logging.Logger | None = None):
        self.queue, self.hub, self.job_name = queue, check_hub_tag(hub), job_name
        self.owned, self.notify = owned, notify
        self.exec_prefix, self.interval = list(exec_prefix), interval
        self.log = log or logging.getLogger(__name__)
        self.suspects: set[str] = set()
        self._task: asyncio.Task | None = None

    async def _orphans(self) -> list[tuple[JobInfo, JobMark]]:
        scheduler = self.queue.scheduler
        named = await self.queue.ask(scheduler.named_jobs_argv(self.job_name), "listing the hub's jobs")
        if named.returncode:
            raise SchedulerUnreachable(named.failure("listing the hub's jobs"))
        try:
            named_ids = scheduler.parse_job_ids(named.stdout, self.job_name)
        except ValueError as e:
            raise SchedulerUnreachable(f"listing the hub's jobs: {e}") from None
        suspects = find_suspects(self.queue.jobs(), named_ids, self.owned())
        found = []
        for job in suspects:
            if job.job_id not in self.suspects:
                continue  # first seen unowned now: a spawn may be about to record it
            comment = await self.queue.ask(scheduler.comment_argv(job.job_id), f"reading job {job.job_id}'s comment")
            try:
                mark = is_orphan(job, scheduler.parse_comment(comment.stdout), self.hub) if comment.returncode == 0 else None
            except ValueError:  # a comment that cannot be read is no mark: never cancelled on it
                mark = None
            if mark is not None:
                found.append((job, mark))
        self.suspects = {job.job_id for job in suspects}
        return found

    async def sweep(self) -> list[SweepAction]:
        """One sweep: nothing is done while the scheduler is not answering."""
        await self.queue.refresh(max_age=min(self.interval, self.queue.interval))
        try:
            if not self.queue.reachable:
                raise SchedulerUnreachable(self.queue.error)
            orphans = await self._orphans()
        except SchedulerUnreachable as e:
            self.log.warning("jupyter-hpcdl: orphan sweep skipped: %s", e)
            return []
        done = []
        for job, mark in orphans:
            failed = await cancel_as_user(self.exec_prefix, job.user, self.queue.scheduler.cancel_argv(job.job_id),
                                          self.queue.scheduler.job_forgotten, self.queue.timeout)
            if failed is None:
                message = (f"job {job.job_id} ({job.state.lower()}) was found without its server at "
                           f"{time.strftime('%Y-%m-%d %H:%M')} and was cancelled by the hub")
                self.notify(mark, message)
                self.suspects.discard(job.job_id)
            else:
                message = f"cancelling orphan job {job.job_id} of {job.user} failed: {failed} (tried again next sweep)"
            self.log.warning("jupyter-hpcdl: %s", message)
            done.append(SweepAction(job.job_id, mark.user, mark.server, failed is None, message))
        return done

    async def run_forever(self) -> None:
        while True:
            try:
                await self.sweep()
            except Exception:  # a sweep must never end the sweeping
                self.log.exception("jupyter-hpcdl: orphan sweep failed")
            await asyncio.sleep(self.interval)

    def start(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self.run_forever())
