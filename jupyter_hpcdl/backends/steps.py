"""What the session does after each training step on a rank, framework-free (runs on the ranks): live metrics to
the kernel, and the agreed stop; in a session's fit and in a user's script run by ``session.run_script``. A backend
calls it from its own hook (a Keras callback, an optimizer step hook) with its collective and GPU figures."""
from __future__ import annotations

import os
import time
from collections.abc import Callable

from ..figures import number
from .agreement import AllreduceMax
from .gpu import RankGpu
from .publication import TrainingStopped, publish


class StepWatch:
    """Publishes this rank's step figures every ``publish_every`` steps, but at most every ``min_interval``
    seconds (and each slow step, one second apart); every ``check_every`` steps each rank looks for the stop file
    and all agree (``allreduce_max``, the maximum over the ranks), so they leave training at the same step.
    ``gpu_index``: this rank's GPU for the driver's figures, ``gpu_memory_mb``: the framework's own memory in use
    on it (None for both without one)."""

    def __init__(self, rank: int, allreduce_max: AllreduceMax, stop_file: str, publish_every: int = 5,
                 check_every: int = 20, min_interval: float = 0.0, gpu_index: int | None = None,
                 gpu_memory_mb: Callable[[], float] | None = None):
        import psutil

        self.rank, self.allreduce_max, self.stop_file = rank, allreduce_max, stop_file
        self.publish_every, self.check_every, self.min_interval = publish_every, check_every, min_interval
        self.gpu_memory_mb = gpu_memory_mb
        self.process = psutil.Process()
        self.gpu = RankGpu(default_index=gpu_index)
        self.published = 0.0

    def _gpu_figures(self) -> dict:
        sample = self.gpu.sample()
        figures = {"gpu_util_pct": sample.utilization_pct, "gpu_used_mb": sample.memory_used_mb} if sample else {}
        return {"gpu_memory_mb": self.gpu_memory_mb() if self.gpu_memory_mb else None, **figures}

    def step(self, epoch: int, batch: int, started: float, samples: int | None, loss=None,
             metrics: dict | None = None) -> None:
        """After step ``batch`` of ``epoch`` (0: a script's steps, in no epoch the session knows), which began at
        ``started`` (``time.perf_counter()``); ``loss`` and ``metrics`` as the framework has them (converted only
        when sent; a "loss" among the metrics is left out)."""
        took = time.perf_counter() - started
        due = batch % self.publish_every == 0 or started - self.published >= 1.0  # slow steps: each one
        if due and started - self.published >= self.min_interval:
            self.published = started
            publish(self.rank, {"rank": self.rank, "epoch": epoch, "batch": batch, "time": time.time(),
                                "loss": number(loss), "step_time_s": took,
                                "samples_per_s": samples / took if samples and took > 0 else None,
                                "memory_mb": self.process.memory_info().rss / 2**20, **self._gpu_figures(),
                                "metrics": numbers(metrics)})
        self.check_stop(epoch, batch)

    def check_stop(self, epoch: int, batch: int) -> None:
        """At step ``batch``, every ``check_every`` steps: whether any rank was asked to stop, agreed by all (a rank
        whose data ran out while the others step on calls this alone, for the steps it no longer takes)."""
        if batch % self.check_every == 0:  # the same steps on every rank, so the collective stays matched
            asked = 1.0 if os.path.exists(self.stop_file) else 0.0
            if self.allreduce_max([asked], "hpcdl.stop")[0] > 0:
                where = f"in epoch {epoch} " if epoch else ""
                raise TrainingStopped(f"stopped {where}after batch {batch}")

    def epoch_end(self, epoch: int, loss, metrics: dict | None) -> None:
        """An epoch's (averaged) figures, validation ones too."""
        publish(self.rank, {"rank": self.rank, "epoch": epoch, "batch": None, "kind": "epoch", "time": time.time(),
                            "loss": number(loss), "metrics": numbers(metrics)})


def numbers(metrics: dict | None) -> dict[str, float]:
    """The figures of ``metrics`` that are numbers (tensors and NumPy values converted), by name; not "loss",
    which a record carries on its own (so a framework's whole logs can be given, converted only when sent)."""
    return {k: n for k, v in (metrics or {}).items() if k != "loss" and (n := number(v)) is not None}
