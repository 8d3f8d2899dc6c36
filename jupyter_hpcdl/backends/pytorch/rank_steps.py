"""What the session does after each training step on a rank (runs on the ranks), in a session's fit and in a user's
script run by ``session.run_script``: live metrics to the kernel, and the agreed stop."""
from __future__ import annotations

import os
import time

from ...figures import number
from ..gpu import RankGpu
from ..publication import TrainingStopped, publish
from . import dist


class StepWatch:
    """Publishes this rank's step figures every ``publish_every`` steps, but at most every ``min_interval``
    seconds (and each slow step, one second apart); every ``check_every`` steps each rank looks for the stop file
    and all agree (the maximum over the ranks), so they leave training at the same step."""

    def __init__(self, stop_file: str, publish_every: int = 5, check_every: int = 20, min_interval: float = 0.0):
        import psutil
        import torch

        self.stop_file, self.publish_every, self.check_every = stop_file, publish_every, check_every
        self.min_interval = min_interval
        self.rank = dist.rank()
        self.process = psutil.Process()
        self.cuda = torch.cuda.is_available()
        self.gpu = RankGpu(default_index=dist.local_rank() if self.cuda else None)
        self.published = 0.0

    def _gpu_figures(self) -> dict:
        import torch

        sample = self.gpu.sample()
        figures = {"gpu_util_pct": sample.utilization_pct, "gpu_used_mb": sample.memory_used_mb} if sample else {}
        return {"gpu_memory_mb": torch.cuda.memory_allocated() / 2**20 if self.cuda else None, **figures}

    def step(self, epoch: int, batch: int, started: float, samples: int | None, loss=None,
             metrics: dict | None = None) -> None:
        """After step ``batch`` of ``epoch`` (0: a script's steps, in no epoch the session knows), which began at
        ``started`` (``time.perf_counter()``)."""
        took = time.perf_counter() - started
        due = batch % self.publish_every == 0 or started - self.published >= 1.0  # slow steps: each one
        if due and started - self.published >= self.min_interval:
            self.published = started
            publish(self.rank, {"rank": self.rank, "epoch": epoch, "batch": batch, "time": time.time(),
                                "loss": number(loss), "step_time_s": took,
                                "samples_per_s": samples / took if samples and took > 0 else None,
                                "memory_mb": self.process.memory_info().rss / 2**20, **self._gpu_figures(),
                                "metrics": {k: n for k, v in (metrics or {}).items() if (n := number(v)) is not None}})
        if batch % self.check_every == 0:  # the same steps on every rank, so the collective stays matched
            asked = 1.0 if os.path.exists(self.stop_file) else 0.0
            if dist.allreduce_max([asked], "hpcdl.stop")[0] > 0:
                where = f"in epoch {epoch} " if epoch else ""
                raise TrainingStopped(f"stopped {where}after batch {batch}")

    def epoch_end(self, epoch: int, logs: dict) -> None:
        publish(self.rank, {"rank": self.rank, "epoch": epoch, "batch": None, "kind": "epoch", "time": time.time(),
                            "loss": number(logs.get("loss")),
                            "metrics": {k: n for k, v in logs.items() if k != "loss" and (n := number(v)) is not None}})
