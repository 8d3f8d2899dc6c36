"""The session's Keras callbacks on each rank (runs on the ranks): live metrics to the kernel, the agreed stop, and
the count of epochs and batches that checkpoints keep. They go beside the user's own callbacks, in a session's fit
and in a user's script run by ``session.run_script``."""
from __future__ import annotations

import os
import time

from ...figures import number
from ..publication import TrainingStopped, publish
from . import hvd


def make_callbacks(progress: dict, stop_file: str, batch_size: int | None, publish_every: int = 5,
                   check_every: int = 20, min_interval: float = 0.0) -> list:
    """Publisher, StopWhenAsked and Count, sharing ``progress`` (``epochs_done``, ``batches_done``)."""
    import psutil
    import tensorflow as tf
    from ..gpu import RankGpu

    rank = hvd.rank()
    process = psutil.Process()
    has_gpu = bool(tf.config.list_logical_devices("GPU"))
    gpu = RankGpu(default_index=hvd.local_rank() if has_gpu else None)

    def gpu_memory_mb() -> float | None:
        """TensorFlow's memory in use on this rank's GPU (None without one)."""
        return tf.config.experimental.get_memory_info("GPU:0")["current"] / 2**20 if has_gpu else None

    def gpu_figures() -> dict:
        """The driver's view of this rank's GPU (NVML): utilisation and memory used by all its processes."""
        sample = gpu.sample()
        return {"gpu_util_pct": sample.utilization_pct, "gpu_used_mb": sample.memory_used_mb} if sample else {}

    def metrics_of(logs) -> dict[str, float]:
        return {k: n for k, v in (logs or {}).items() if k != "loss" and (n := number(v)) is not None}

    class Publisher(tf.keras.callbacks.Callback):
        """Live metrics of this rank, sent to the kernel as they happen (ipyparallel's data publication): every
        ``publish_every`` batches, but at most every ``min_interval`` seconds; and each epoch's averaged metrics
        (validation ones too) at its end. It takes Keras' logs as tensors (``_supports_tf_logs``), so it converts
        only what it sends."""

        _supports_tf_logs = True

        def on_train_begin(self, logs=None):
            self.published = 0.0
            self.batch_size = batch_size

        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = progress["epochs_done"] + 1

        def on_train_batch_begin(self, batch, logs=None):
            self.t0 = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            step = time.perf_counter() - self.t0
            due = batch % publish_every == 0 or self.t0 - self.published >= 1.0  # slow batches: each one
            if due and self.t0 - self.published >= min_interval:
                self.published = self.t0
                size = self.batch_size or (self.params or {}).get("batch_size")
                publish(rank, {"rank": rank, "epoch": self.epoch, "batch": batch, "time": time.time(),
                              "loss": number((logs or {}).get("loss")), "step_time_s": step,
                              "samples_per_s": size / step if size and step > 0 else None,
                              "memory_mb": process.memory_info().rss / 2**20, "gpu_memory_mb": gpu_memory_mb(),
                              **gpu_figures(), "metrics": metrics_of(logs)})

        def on_epoch_end(self, epoch, logs=None):
            publish(rank, {"rank": rank, "epoch": self.epoch, "batch": None, "kind": "epoch", "time": time.time(),
                          "loss": number((logs or {}).get("loss")), "metrics": metrics_of(logs)})

    class StopWhenAsked(tf.keras.callbacks.Callback):
        """Every ``check_every`` batches each rank checks the stop file, and all agree (max over ranks) before
        stopping, so the ranks leave fit at the same batch and the world stays in step."""

        _supports_tf_logs = True

        def on_train_batch_end(self, batch, logs=None):
            if batch % check_every:  # the same batches on every rank, so the collective stays matched
                return
            asked = 1.0 if os.path.exists(stop_file) else 0.0
            if hvd.allreduce_max([asked], "hpcdl.stop")[0] > 0:
                raise TrainingStopped(f"stopped in epoch {progress['epochs_done'] + 1} after batch {batch}")

    class Count(tf.keras.callbacks.Callback):
        _supports_tf_logs = True

        def on_train_batch_end(self, batch, logs=None):
            progress["batches_done"] += 1

        def on_epoch_end(self, epoch, logs=None):
            progress["epochs_done"] += 1

    return [Publisher(), StopWhenAsked(), Count()]


def ordered(first: list, user: list, ours: list) -> list:
    """Broadcast first, then metric averaging, so the user's callbacks (and ours) see averaged epoch metrics."""
    return [*first, hvd.metric_average_callback(), *user, *ours]

