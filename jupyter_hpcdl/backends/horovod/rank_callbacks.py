"""The session's Keras callbacks on each rank (runs on the ranks): live metrics to the kernel and the agreed stop
(through the framework-free ``StepWatch``), and the count of epochs and batches that checkpoints keep. They go
beside the user's own callbacks, in a session's fit and in a user's script run by ``session.run_script``."""
from __future__ import annotations

import time

from ..steps import StepWatch
from . import hvd


def make_callbacks(progress: dict, stop_file: str, batch_size: int | None, publish_every: int = 5,
                   check_every: int = 20, min_interval: float = 0.0) -> list:
    """Watch (live metrics and the agreed stop: :class:`~jupyter_hpcdl.backends.steps.StepWatch`) and Count,
    sharing ``progress`` (``epochs_done``, ``batches_done``)."""
    import tensorflow as tf

    has_gpu = bool(tf.config.list_logical_devices("GPU"))

    def gpu_memory_mb() -> float | None:
        """TensorFlow's memory in use on this rank's GPU."""
        return tf.config.experimental.get_memory_info("GPU:0")["current"] / 2**20

    watch = StepWatch(hvd.rank(), hvd.allreduce_max, stop_file, publish_every, check_every, min_interval,
                      gpu_index=hvd.local_rank() if has_gpu else None,
                      gpu_memory_mb=gpu_memory_mb if has_gpu else None)

    class Watch(tf.keras.callbacks.Callback):
        """Live metrics of this rank, sent to the kernel as they happen (ipyparallel's data publication), and the
        agreed stop, after each batch; each epoch's averaged metrics (validation ones too) at its end. It takes
        Keras' logs as tensors (``_supports_tf_logs``), so only what is sent is converted."""

        _supports_tf_logs = True

        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = progress["epochs_done"] + 1

        def on_train_batch_begin(self, batch, logs=None):
            self.t0 = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            size = batch_size or (self.params or {}).get("batch_size")
            watch.step(self.epoch, batch, self.t0, size, (logs or {}).get("loss"), logs)

        def on_epoch_end(self, epoch, logs=None):
            watch.epoch_end(self.epoch, (logs or {}).get("loss"), logs)

    class Count(tf.keras.callbacks.Callback):
        _supports_tf_logs = True

        def on_train_batch_end(self, batch, logs=None):
            progress["batches_done"] += 1

        def on_epoch_end(self, epoch, logs=None):
            progress["epochs_done"] += 1

    return [Watch(), Count()]


def ordered(first: list, user: list, ours: list) -> list:
    """Broadcast first, then metric averaging, so the user's callbacks (and ours) see averaged epoch metrics."""
    return [*first, hvd.metric_average_callback(), *user, *ours]

