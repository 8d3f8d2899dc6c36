"""What runs on each rank (an ipyparallel engine, natively or in the user's container): join the world, build the
user's model with an optimizer that averages gradients, train epoch by epoch while publishing metrics, stop with all
ranks at the same batch, checkpoint and resume. The state of this rank lives in ``_STATE``; what is Horovod's is
in :mod:`.hvd`."""
from __future__ import annotations

import hashlib
import os
import socket

from . import hvd
from . import checkpoint as checkpoints
from ..publication import TrainingStopped
from ..agreement import Together
from ..base import user_callbacks
from .rank_callbacks import make_callbacks, ordered
from .rank_data import batches_per_pass, load_shard, training_stream, validation_stream

_STATE: dict = {}


def join(env: dict) -> dict:
    """Set the Horovod environment (before TensorFlow is imported here), then join the world."""
    os.environ.update(env)
    import tensorflow as tf

    threads = int(os.environ.get("HPCDL_TF_THREADS", "0"))
    if threads:
        tf.config.threading.set_intra_op_parallelism_threads(threads)
        tf.config.threading.set_inter_op_parallelism_threads(threads)
    place = hvd.init()
    gpus = tf.config.list_physical_devices("GPU")
    if gpus:
        tf.config.set_visible_devices(gpus[place["local_rank"] % len(gpus)], "GPU")
    _STATE.clear()
    _STATE["progress"] = {"epochs_done": 0, "batches_done": 0}
    return {**place, "host": socket.gethostname(), "node": os.environ.get("HOROVOD_HOSTNAME", ""),
            "pid": os.getpid(), "gpus": len(gpus), "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "container_mode": os.environ.get("HPCDL_CONTAINER_MODE")}


def scaled_schedule(schedule, factor: float):
    """A learning-rate schedule times a factor (the world's size, when the user asks for linear scaling)."""
    import tensorflow as tf

    class Scaled(tf.keras.optimizers.schedules.LearningRateSchedule):
        def __call__(self, step):
            return schedule(step) * factor

        def get_config(self):
            return {"schedule": tf.keras.optimizers.schedules.serialize(schedule), "factor": factor}

    return Scaled()


def scale_learning_rate(optimizer, factor: float) -> None:
    """Multiply the optimizer's learning rate (a number or a schedule) by ``factor``."""
    import tensorflow as tf

    current = getattr(optimizer, "_learning_rate", None)
    if current is None:
        current = optimizer.learning_rate
    if isinstance(current, tf.keras.optimizers.schedules.LearningRateSchedule):
        optimizer.learning_rate = scaled_schedule(current, factor)
    else:
        optimizer.learning_rate = float(tf.keras.backend.get_value(current)) * factor


def compile_for_world(model, spec):
    """The model compiled with the user's optimizer (or the short form's SGD) made to average over the ranks."""
    import tensorflow as tf

    if spec.compile is not None:
        model.compile(optimizer=tf.keras.optimizers.SGD(learning_rate=spec.compile.lr), loss=spec.compile.loss,
                      metrics=list(spec.compile.metrics))
    if not getattr(model, "_is_compiled", False) or getattr(model, "optimizer", None) is None:
        raise ValueError("model_fn returned a model that is not compiled: call model.compile(optimizer=..., loss=..., "
                         "metrics=...) in model_fn, or give loss= (and lr=) for the short form")
    args = model._get_compile_args()  # the user's optimizer, loss, metrics and weights, as compiled
    args["optimizer"] = hvd.distributed_optimizer(args["optimizer"])
    if spec.scale_lr:
        scale_learning_rate(args["optimizer"], hvd.size())
    model.compile(**args)
    return model


def build(spec) -> dict:
    """Build the user's model and this rank's data; the ranks agree on the steps of an epoch (one collective that
    every rank joins, so one rank's error never leaves the others waiting)."""
    import tensorflow as tf

    mine = 0
    rank, size = hvd.rank(), hvd.size()
    with Together(hvd.allreduce_max, "hpcdl.steps", "build its model or data") as part:
        tf.keras.utils.set_random_seed(spec.seed)
        model = compile_for_world(spec.model_fn(), spec)
        shard = load_shard(spec.data, rank, size)
        validation = load_shard(spec.validation_data, rank, size)
        mine = batches_per_pass(shard, spec.batch_size, spec.steps_per_epoch)
    # the steps of every epoch, the same on every rank: the most any rank needs for one pass over its shard.
    # Uneven shards would otherwise deadlock (a rank with one batch fewer leaves the epoch while its peers wait in
    # the next gradient allreduce); ranks with smaller shards wrap around (each shard is read pass after pass).
    agreed = int(part.agree([mine])[0])
    steps = spec.steps_per_epoch or agreed
    _STATE.update(model=model, spec=spec, shard=shard, validation=validation, per_pass=mine, steps=steps,
                  broadcast_done=False, progress={"epochs_done": 0, "batches_done": 0})
    return {"rank": rank, "samples": shard.samples, "steps_per_epoch": steps, "batches_per_pass": mine,
            "optimizer": type(model.optimizer).__name__, "learning_rate": current_lr(model.optimizer)}


def current_lr(optimizer) -> float | None:
    """The learning rate now (a schedule's value at the optimizer's step)."""
    import tensorflow as tf

    try:
        schedule = getattr(optimizer, "_learning_rate", None)
        if isinstance(schedule, tf.keras.optimizers.schedules.LearningRateSchedule):
            return float(schedule(optimizer.iterations))
        return float(tf.keras.backend.get_value(optimizer.learning_rate))
    except (TypeError, ValueError):
        return None


def fit(epochs: int, stop_file: str, publish_every: int = 5, check_every: int = 20, min_interval: float = 0.0) -> dict:
    """Train ``epochs`` more epochs; return this rank's history, whether it was stopped, and a weights digest."""
    model, spec, progress = _STATE["model"], _STATE["spec"], _STATE["progress"]
    shard = _STATE["shard"]
    rank, size = hvd.rank(), hvd.size()
    first = [] if _STATE["broadcast_done"] else [hvd.broadcast_callback()]
    _STATE["broadcast_done"] = True
    ours = make_callbacks(progress, stop_file, spec.batch_size if shard.dataset is None else None, publish_every,
                          check_every, min_interval)
    stream = training_stream(shard, spec.batch_size, spec.seed, rank, spec.shuffle, progress["batches_done"],
                             _STATE["per_pass"])
    stopped, start = None, progress["epochs_done"]
    try:
        history = model.fit(stream, steps_per_epoch=_STATE["steps"], initial_epoch=start, epochs=start + epochs,
                            validation_data=validation_stream(_STATE["validation"], spec.batch_size), verbose=0,
                            callbacks=ordered(first, user_callbacks(spec.callbacks, rank, size), ours)).history
    except TrainingStopped as e:
        history, stopped = {}, str(e)
    return {"rank": rank, "history": {k: [float(v) for v in vs] for k, vs in history.items()},
            "stopped": stopped, "epochs_done": progress["epochs_done"], "weights": weights_digest()}


def shard_size() -> dict:
    return {"rank": hvd.rank(), "samples": _STATE["shard"].samples, "batches_per_pass": _STATE["per_pass"]}


def weights_digest() -> str:
    """A digest of the model's trainable weights, which data-parallel training keeps equal on every rank. Not the
    non-trainable ones: BatchNormalization's moving statistics follow each rank's own batches (Horovod averages
    gradients, not them; rank 0's are the ones a checkpoint keeps)."""
    h = hashlib.sha256()
    for w in _STATE["model"].trainable_weights:
        h.update(w.numpy().tobytes())
    return h.hexdigest()


def set_lr(lr: float) -> float:
    import tensorflow as tf

    optimizer = _STATE["model"].optimizer
    try:
        optimizer.learning_rate = lr
    except TypeError:
        raise ValueError("this optimizer follows a learning-rate schedule: its rate cannot be set by hand (build "
                         "the model again with another schedule)") from None
    return float(tf.keras.backend.get_value(optimizer.learning_rate))


def save(path: str) -> str | None:
    """Rank 0 writes the model, the optimizer's state and the progress (see :mod:`.checkpoint`); the others
    nothing."""
    if hvd.rank() != 0:
        return None
    progress = _STATE["progress"]
    checkpoints.save(path, _STATE["model"], checkpoints.Progress(progress["epochs_done"], progress["batches_done"],
                                                                 hvd.size(), _STATE["spec"].seed))
    return checkpoints.check_target(path)


def load(path: str) -> dict:
    """Every rank reads the checkpoint (on the shared file system) and continues from it: the same model, optimizer
    state, epoch, and — in a world of the same size — the same place in the data."""
    saved = checkpoints.load(path, _STATE["model"])
    _STATE["progress"] = {"epochs_done": saved.epochs_done,
                          "batches_done": saved.start_batch(hvd.size(), _STATE["steps"])}
    _STATE["broadcast_done"] = True
    return {"rank": hvd.rank(), "epochs_done": saved.epochs_done, "weights": weights_digest(),
            "iterations": int(_STATE["model"].optimizer.iterations), "saved_world_size": saved.world_size}


def leave() -> None:
    if "progress" in _STATE:
        hvd.shutdown()
    _STATE.clear()
