"""Walltime-aware training: how long the ranks' batch job has left (the scheduler's word), and when to stop.

The session asks the scheduler every ``poll`` seconds while a fit runs and, ``margin`` seconds before the end, stops
the ranks at the next agreed batch, checkpoints and says so. (Slurm's ``--signal`` is not used: see docs/training.md.)"""
from __future__ import annotations

import subprocess
import time
from dataclasses import dataclass, field
from typing import Callable

from ..allocation import parse_time_left

DEFAULT_MARGIN = 300  # seconds before the end: time to stop at a batch and write a checkpoint


def squeue_time_left(job_id: str, timeout: float = 15) -> int | None:
    """Seconds left for ``job_id`` as squeue says (``%L``), or None (no limit, or the job is not known)."""
    try:
        out = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%L"], capture_output=True, text=True,
                             timeout=timeout)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return parse_time_left(out.stdout.strip()) if out.returncode == 0 and out.stdout.strip() else None


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
