"""One reading of a workshop's room: the group's members and their servers from the hub's API, and one listing of
the batch system's queue for all of them, shared by every page load within ``max_age`` seconds and bounded by an
overall deadline. Nothing is asked of an attendee's server."""
from __future__ import annotations

import asyncio
import time

from ..spawner.queue import JobQueue
from .hub import HubAPI, HubError
from .status import AttendeeRow, attendee_rows


class Room:
    def __init__(self, api: HubAPI, group: str, queue: JobQueue, max_age: float = 5.0, deadline: float = 20.0):
        self.api, self.group, self.queue = api, group, queue
        self.max_age, self.deadline = max_age, deadline
        self._rows: list[AttendeeRow] = []
        self._read_at = -1e9
        self._lock = asyncio.Lock()

    async def rows(self) -> list[AttendeeRow]:
        """The rows, read again where the last reading is older than ``max_age``; HubError if the hub did not
        answer, or if the reading took longer than ``deadline`` (naming what hung)."""
        async with self._lock:
            if time.monotonic() - self._read_at < self.max_age:
                return self._rows
            try:
                self._rows = await asyncio.wait_for(self._read(), self.deadline)
            except asyncio.TimeoutError:
                raise HubError(f"no reading of group {self.group} within {self.deadline:.0f} s: the hub's API "
                               f"(GET /groups/{self.group}, /users/NAME) or the queue listing "
                               f"({' '.join(self.queue.scheduler.queue_argv()[:1])}) hung") from None
            self._read_at = time.monotonic()
            return self._rows

    async def _read(self) -> list[AttendeeRow]:
        users = await asyncio.to_thread(self.api.members_with_servers, self.group)
        await self.queue.refresh(self.max_age)
        jobs = self.queue.jobs() if self.queue.reachable else None
        return attendee_rows(users, jobs, listing_error=self.queue.error)
