"""Walltime-aware training: how long the ranks' batch job has left (the scheduler's word), and when to stop.

The session asks the scheduler every ``poll`` seconds while a fit runs and, ``margin`` seconds before the end, stops
the ranks at the next agreed batch, checkpoints and says so. (Slurm's ``--signal`` is not used: see docs/training.md.)"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

from ..job.owner import job_time_left

__all__ = ["DEFAULT_MARGIN", "WalltimeWatch", "job_time_left"]

DEFAULT_MARGIN = 300  # seconds before the end: time to stop at a batch and write a checkpoint


@dataclass
class WalltimeWatch:
    """Asks ``time_left`` at most every ``poll`` seconds; ``due()`` once it is at most ``margin`` seconds."""

    time_left: Callable[[], float | None]
    margin: float = DEFAULT_MARGIN
    poll: float = 30.0
    clock: Callable[[], float] = time.monotonic
    left: float | None = None
    _asked: float = field(default=float("-inf"))

    def due(self) -> bool:
        now = self.clock()
        if now - self._asked >= self.poll:
            self._asked = now
            self.left = self.time_left()
        return self.left is not None and self.left - (now - self._asked) <= self.margin
