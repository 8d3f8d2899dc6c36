"""What runs on each rank (an ipyparallel engine, natively or in the user's container): join the Horovod world,
build the user's model with an optimizer that averages gradients, train epoch by epoch while publishing metrics,
stop with all ranks at the same batch, checkpoint and resume. The state of this rank lives in ``_STATE``."""
from __future__ import annotations

import hashlib
import os
import socket
import time

_STATE: dict = {}


class TrainingStopped(Exception):
    """Raised inside fit when every rank agreed to stop (see the stop callback)."""


def keras_problem(tf_version: str, legacy_env: str | None) -> str | None:
    """Why Horovod's Keras optimizer would not average gradients here, or None. TensorFlow >= 2.16 brings Keras 3,
    with which ``hvd.DistributedOptimizer`` trains silently without averaging; tf-keras with TF_USE_LEGACY_KERAS=1
    works."""
    major, minor = (int(p) for p in tf_version.split(".")[:2])
    if (major, minor) >= (2, 16) and legacy_env != "1":
        return (f"TensorFlow {tf_version} uses Keras 3, with which Horovod's DistributedOptimizer skips gradient "
                "averaging silently: install tf-keras and set TF_USE_LEGACY_KERAS=1 in the ranks' environment")
    return None


def join(env: dict) -> dict:
    """Set the Horovod environment (before TensorFlow is imported here), then join the world."""
    os.environ.update(env)
    import tensorflow as tf

    problem = keras_problem(tf.__version__, os.environ.get("TF_USE_LEGACY_KERAS"))
    if problem:
        raise RuntimeError(problem)
    threads = int(os.environ.get("HPCDL_TF_THREADS", "0"))
    if threads:
        tf.config.threading.set_intra_op_parallelism_threads(threads)
        tf.config.threading.set_inter_op_parallelism_threads(threads)
    import horovod.tensorflow.keras as hvd

    hvd.init()
    gpus = tf.config.list_physical_devices("GPU")
    if gpus:
        tf.config.set_visible_devices(gpus[hvd.local_rank() % len(gpus)], "GPU")
    _STATE.clear()
    _STATE.update(hvd=hvd, epochs_done=0)
    return {"rank": hvd.rank(), "size": hvd.size(), "local_rank": hvd.local_rank(), "host": socket.gethostname(),
            "node": os.environ.get("HOROVOD_HOSTNAME", ""), "pid": os.getpid(), "gpus": len(gpus),
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")}


def build(model_fn, data_fn, loss, metrics, lr: float, batch_size: int) -> dict:
    """Build the user's model and this rank's data shard; compile with Horovod's averaging optimizer."""
    import tensorflow as tf

    hvd = _STATE["hvd"]
    failure, mine = None, 0
    try:
        tf.keras.utils.set_random_seed(1234)
        model = model_fn()
        x, y = data_fn(hvd.rank(), hvd.size())
        optimizer = hvd.DistributedOptimizer(tf.keras.optimizers.SGD(learning_rate=lr))
        model.compile(optimizer=optimizer, loss=loss, metrics=list(metrics), experimental_run_tf_function=False)
        mine = steps_per_epoch(len(x), batch_size)
    except Exception as e:  # noqa: BLE001 - re-raised below, after the collective every rank must join
        failure = e
    steps, others_failed = agreed_steps(mine, failure is not None)
    if failure is not None:
        raise failure
    if others_failed:
        raise RuntimeError("another rank could not build its model or data (its own error is reported too)")
    _STATE.update(model=model, x=x, y=y, batch_size=batch_size, steps=steps, broadcast_done=False, epochs_done=0)
    return {"rank": hvd.rank(), "samples": len(x), "steps_per_epoch": steps}


def steps_per_epoch(samples: int, batch_size: int) -> int:
    """Batches one pass over ``samples`` takes (the last one partial)."""
    if samples <= 0:
        raise ValueError("this rank's data shard is empty: every rank needs at least one sample")
    return -(-samples // batch_size)


def agreed_steps(mine: int, failed: bool) -> tuple[int, bool]:
    """The steps of every epoch, the same on every rank: the most any rank needs for one pass over its shard
    (``mine`` is this rank's); and whether any rank failed to build (each rank joins this one collective, so one
    rank's error never leaves the others waiting in it).
    Uneven shards would otherwise deadlock (a rank with one batch fewer leaves the epoch while its peers wait in
    the next gradient allreduce); ranks with smaller shards wrap around (no sample is dropped: each shard is read
    pass after pass)."""
    import horovod.tensorflow as hvd_tf
    import tensorflow as tf

    agreed = hvd_tf.allreduce(tf.constant([float(mine), float(failed)]), op=hvd_tf.Max, name="hpcdl.steps").numpy()
    return int(agreed[0]), bool(agreed[1])


def _dataset(x, y, batch_size: int):
    """This rank's shard as an endless, reshuffled stream of full batches (the epoch's length is agreed_steps)."""
    import tensorflow as tf

    return (tf.data.Dataset.from_tensor_slices((x, y)).shuffle(len(x), reshuffle_each_iteration=True).repeat()
            .batch(batch_size).prefetch(tf.data.AUTOTUNE))


def _callbacks(stop_file: str, publish_every: int, check_every: int, min_interval: float = 0.0):
    import horovod.tensorflow as hvd_tf
    import psutil
    import tensorflow as tf
    from ipyparallel.datapub import publish_data

    hvd = _STATE["hvd"]
    batch_size = _STATE["batch_size"]
    process = psutil.Process()
    has_gpu = bool(tf.config.list_logical_devices("GPU"))

    def gpu_memory_mb() -> float | None:
        """TensorFlow's memory in use on this rank's GPU (None without one)."""
        return tf.config.experimental.get_memory_info("GPU:0")["current"] / 2**20 if has_gpu else None

    class Publisher(tf.keras.callbacks.Callback):
        """Live metrics of this rank, sent to the kernel as they happen (ipyparallel's data publication): every
        ``publish_every`` batches, but at most every ``min_interval`` seconds. It takes Keras' logs as tensors
        (``_supports_tf_logs``), so it adds no per-batch conversion of its own (the first fit's broadcast callback
        still asks Keras for one)."""

        _supports_tf_logs = True

        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = _STATE["epochs_done"] + 1
            self.published = getattr(self, "published", 0.0)

        def on_train_batch_begin(self, batch, logs=None):
            self.t0 = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            step = time.perf_counter() - self.t0
            due = batch % publish_every == 0 or self.t0 - self.published >= 1.0  # slow batches: each one
            if due and self.t0 - self.published >= min_interval:
                self.published = self.t0
                publish_data({"rank": hvd.rank(), "epoch": self.epoch, "batch": batch, "time": time.time(),
                              "loss": float((logs or {}).get("loss", float("nan"))), "step_time_s": step,
                              "samples_per_s": batch_size / step if step > 0 else None,
                              "memory_mb": process.memory_info().rss / 2**20, "gpu_memory_mb": gpu_memory_mb()})

    class StopWhenAsked(tf.keras.callbacks.Callback):
        """Every ``check_every`` batches each rank checks the stop file, and all agree (max over ranks) before
        stopping, so the ranks leave fit at the same batch and the world stays in step."""

        _supports_tf_logs = True

        def on_train_batch_end(self, batch, logs=None):
            if batch % check_every:  # the same batches on every rank, so the collective stays matched
                return
            asked = 1.0 if os.path.exists(stop_file) else 0.0
            if float(hvd_tf.allreduce(tf.constant(asked), op=hvd_tf.Max, name="hpcdl.stop")) > 0:
                raise TrainingStopped(f"stopped in epoch {_STATE['epochs_done'] + 1} after batch {batch}")

    class CountEpochs(tf.keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            _STATE["epochs_done"] += 1

    return [Publisher(), StopWhenAsked(), hvd.callbacks.MetricAverageCallback(), CountEpochs()]


def fit(epochs: int, stop_file: str, publish_every: int = 5, check_every: int = 20, min_interval: float = 0.0) -> dict:
    """Train ``epochs`` more epochs; return this rank's history, whether it was stopped, and a weights digest."""
    hvd = _STATE["hvd"]
    model = _STATE["model"]
    callbacks = _callbacks(stop_file, publish_every, check_every, min_interval)
    if not _STATE["broadcast_done"]:
        callbacks.insert(0, hvd.callbacks.BroadcastGlobalVariablesCallback(0))
        _STATE["broadcast_done"] = True
    stopped = None
    try:
        history = model.fit(_dataset(_STATE["x"], _STATE["y"], _STATE["batch_size"]), steps_per_epoch=_STATE["steps"],
                            epochs=epochs, verbose=0, callbacks=callbacks).history
    except TrainingStopped as e:
        history, stopped = {}, str(e)
    return {"rank": hvd.rank(), "history": {k: [float(v) for v in vs] for k, vs in history.items()},
            "stopped": stopped, "epochs_done": _STATE["epochs_done"], "weights": weights_digest()}


def shard_size() -> dict:
    return {"rank": _STATE["hvd"].rank(), "samples": len(_STATE["x"])}


def weights_digest() -> str:
    h = hashlib.sha256()
    for w in _STATE["model"].get_weights():
        h.update(w.tobytes())
    return h.hexdigest()


def set_lr(lr: float) -> float:
    import tensorflow as tf

    optimizer = _STATE["model"].optimizer
    tf.keras.backend.set_value(optimizer.learning_rate, lr)
    return float(tf.keras.backend.get_value(optimizer.learning_rate))


def save(path: str) -> str | None:
    """Rank 0 writes the weights and progress, atomically; the other ranks write nothing."""
    import numpy as np

    from .checkpoint import atomic_write

    if _STATE["hvd"].rank() != 0:
        return None
    weights = _STATE["model"].get_weights()

    def write(tmp: str) -> None:
        with open(tmp, "wb") as f:
            np.savez(f, epochs_done=np.array(_STATE["epochs_done"]), count=np.array(len(weights)),
                     **{f"w{i}": w for i, w in enumerate(weights)})

    return atomic_write(path, write)


def load(path: str) -> dict:
    """Every rank reads the checkpoint (on the shared file system) and continues from it."""
    import numpy as np

    with np.load(path) as data:
        weights = [data[f"w{i}"] for i in range(int(data["count"]))]
        _STATE["epochs_done"] = int(data["epochs_done"])
    _STATE["model"].set_weights(weights)
    _STATE["broadcast_done"] = True
    return {"rank": _STATE["hvd"].rank(), "epochs_done": _STATE["epochs_done"], "weights": weights_digest()}


def leave() -> None:
    hvd = _STATE.get("hvd")
    if hvd is not None:
        hvd.shutdown()
    _STATE.clear()
