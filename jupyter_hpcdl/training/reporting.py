"""What a training session tells the allocation's owner (runs in the kernel): its state and its ranks, for the
JupyterLab panel. Reporting never fails the training."""
from __future__ import annotations

import time
from typing import Callable

from ..job.owner import owner_socket, request


class Reporter:
    """Keeps a session's :attr:`state` and tells the allocation's owner, when there is one, with each rank's row
    (``rank_table()``); at most once per ``every`` seconds while the state stays the same."""

    def __init__(self, session_id: str, rank_table: Callable[[], list[dict]]):
        self.session_id, self.rank_table = session_id, rank_table
        self.state = "none"
        self.reported_at = 0.0

    def report(self, state: str, every: float = 0.0, message: str | None = None) -> None:
        now = time.monotonic()
        if state == self.state and now - self.reported_at < every:
            return
        self.state, self.reported_at = state, now
        sock = owner_socket()
        if sock:
            try:
                request(sock, "PUT", "/session",
                        {"id": self.session_id, "session": state, "ranks": self.rank_table(),
                         **({"message": message} if message else {})}, timeout=2)
            except (OSError, RuntimeError, ValueError):
                pass
