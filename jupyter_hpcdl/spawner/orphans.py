"""No job without its server: every job a hub submits carries a mark (its comment) naming the hub, the user and the
server; a job with this hub's mark that no server's state owns is an orphan, and is cancelled (as its user).

Which jobs are adopted instead: a job that a spawner's state still names (a spawn pending or running when the hub
stopped) is followed again by that spawner (``start``/``get_url``). A job that no state names has lost its server's
API token with the server (JupyterHub revokes it when a server stops), so its JupyterLab could never be reached
through the hub again: cancelling it, and telling the user on the next form, is the only safe end.

A job is cancelled only when two sweeps at least an interval apart both find it unowned (a spawn records its job
at once after the submission, so a fresh job is never taken for an orphan), and only while the scheduler answers.
"""
from __future__ import annotations

import asyncio
import logging
import re
import time
from dataclasses import dataclass
from typing import Awaitable, Callable, Iterable, Mapping, Sequence

from .commands import as_user, run
from .queue import JobQueue
from .scheduler import ENDED, JobInfo

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


@dataclass(frozen=True)
class Orphan:
    job: JobInfo
    mark: JobMark


def find_orphans(jobs: Mapping[str, JobInfo], hub: str, owned: Iterable[str],
                 suspects: set[str]) -> tuple[list[Orphan], set[str]]:
    """The jobs of ``hub`` that no server owns and that were already suspects at the last sweep, and the new set
    of suspects. A mark whose user is not the job's owner (anyone can write a comment) is ignored."""
    owned = set(owned)
    found: dict[str, Orphan] = {}
    for job_id, job in jobs.items():
        mark = JobMark.parse(job.comment)
        if mark is None or mark.hub != hub or job.phase == ENDED or job_id in owned or mark.user != job.user:
            continue
        found[job_id] = Orphan(job, mark)
    return [o for job_id, o in found.items() if job_id in suspects], set(found)


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
    """Sweeps one hub's jobs at start-up and every ``interval`` seconds (see the module's docstring)."""

    def __init__(self, queue: JobQueue, hub: str, owned: OwnedFn, notify: NotifyFn,
                 exec_prefix: Sequence[str] = ("sudo", "-n", "-u", "{username}"), interval: float = 300.0,
                 log: logging.Logger | None = None, runner: Callable[..., Awaitable] = run):
        self.queue, self.hub, self.owned, self.notify = queue, check_hub_tag(hub), owned, notify
        self.exec_prefix, self.interval, self.runner = list(exec_prefix), interval, runner
        self.log = log or logging.getLogger(__name__)
        self.suspects: set[str] = set()
        self.actions: list[SweepAction] = []  # what the sweeps did (the newest last; at most 1000 kept)
        self._task: asyncio.Task | None = None

    async def sweep(self) -> list[SweepAction]:
        """One sweep: nothing is done while the scheduler is not answering."""
        await self.queue.refresh(max_age=min(self.interval, self.queue.interval))
        if not self.queue.reachable:
            self.log.warning("jupyter-hpcdl: orphan sweep skipped: %s", self.queue.error)
            return []
        orphans, self.suspects = find_orphans(self.queue.jobs(), self.hub, self.owned(), self.suspects)
        done = []
        for orphan in orphans:
            job, mark = orphan.job, orphan.mark
            argv = [*as_user(self.exec_prefix, job.user), *self.queue.scheduler.cancel_argv(job.job_id)]
            when = time.strftime("%Y-%m-%d %H:%M")
            try:
                result = await self.runner(argv, timeout=self.queue.timeout)
                ok, why = result.returncode == 0, (result.stderr or result.stdout).strip()[-300:]
            except (OSError, RuntimeError) as e:
                ok, why = False, str(e)
            if ok:
                message = (f"job {job.job_id} ({job.state.lower()}) was found without its server at {when} and "
                           "was cancelled by the hub")
                self.notify(mark, message)
                self.suspects.discard(job.job_id)
            else:
                message = f"cancelling orphan job {job.job_id} of {job.user} failed: {why} (tried again next sweep)"
            self.log.warning("jupyter-hpcdl: %s", message)
            done.append(SweepAction(job.job_id, mark.user, mark.server, ok, message))
        self.actions = (self.actions + done)[-1000:]
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

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
