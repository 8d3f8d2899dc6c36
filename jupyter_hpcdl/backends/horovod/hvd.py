"""Horovod's own calls on a rank, in one place: join the world, wrap the user's optimizer so it averages gradients,
broadcast rank 0's variables, average metrics, and the small allreduces the session agrees through. The rest of the
backend (:mod:`.rank`, :mod:`.rank_callbacks`, :mod:`.scripts`) reaches Horovod only through here.

Runs on the ranks (ipyparallel engines, ``hpcdl-launch``'s processes); the kernel imports it without calling it."""
from __future__ import annotations

import os


def keras_problem(tf_version: str, legacy_env: str | None) -> str | None:
    """Why Horovod's Keras optimizer would not average gradients here, or None. TensorFlow >= 2.16 brings Keras 3,
    with which ``hvd.DistributedOptimizer`` trains silently without averaging; tf-keras with TF_USE_LEGACY_KERAS=1
    works."""
    major, minor = (int(p) for p in tf_version.split(".")[:2])
    if (major, minor) >= (2, 16) and legacy_env != "1":
        return (f"TensorFlow {tf_version} uses Keras 3, with which Horovod's DistributedOptimizer skips gradient "
                "averaging silently: install tf-keras and set TF_USE_LEGACY_KERAS=1 in the ranks' environment")
    return None


def _hvd():
    import horovod.tensorflow.keras as hvd

    return hvd


def init() -> dict:
    """Join the world (the environment was set before); this rank's place in it. Calling ``hvd.init()`` again (a
    user's script does) is a no-op, so a script joins the same world."""
    import tensorflow as tf

    problem = keras_problem(tf.__version__, os.environ.get("TF_USE_LEGACY_KERAS"))
    if problem:
        raise RuntimeError(problem)
    hvd = _hvd()
    hvd.init()
    return {"rank": hvd.rank(), "size": hvd.size(), "local_rank": hvd.local_rank()}


def rank() -> int:
    return _hvd().rank()


def size() -> int:
    return _hvd().size()


def local_rank() -> int:
    return _hvd().local_rank()


def allreduce_max(values: list[float], name: str) -> list[float]:
    """The elementwise maximum over all ranks (every rank must call it, with the same ``name``)."""
    import horovod.tensorflow as hvd_tf
    import tensorflow as tf

    return [float(v) for v in hvd_tf.allreduce(tf.constant([float(v) for v in values]), op=hvd_tf.Max,
                                               name=name).numpy()]


def allreduce_sum(values: list[float], name: str) -> list[float]:
    """The elementwise sum over all ranks (every rank must call it, with the same ``name``)."""
    import horovod.tensorflow as hvd_tf
    import tensorflow as tf

    return [float(v) for v in hvd_tf.allreduce(tf.constant([float(v) for v in values]), op=hvd_tf.Sum,
                                               name=name).numpy()]


def distributed_optimizer(optimizer):
    """The user's optimizer (any Keras optimizer, with its schedule) averaging gradients over the ranks."""
    return _hvd().DistributedOptimizer(optimizer)


def broadcast_callback():
    """Rank 0's model and optimizer variables to every rank, after the first batch."""
    return _hvd().callbacks.BroadcastGlobalVariablesCallback(0)


def metric_average_callback():
    """Epoch metrics (validation ones too) averaged over the ranks before other callbacks see them."""
    return _hvd().callbacks.MetricAverageCallback()


def shutdown() -> None:
    _hvd().shutdown()


def check_allreduce() -> dict:
    """Join the world (its environment was set before) and sum rank+1 over the ranks, which must equal
    size*(size+1)/2: this rank's place, the sum, and whether it is right."""
    import horovod.tensorflow as hvd
    import tensorflow as tf

    hvd.init()
    total = hvd.allreduce(tf.constant([float(hvd.rank() + 1)]), op=hvd.Sum).numpy().tolist()[0]
    size = hvd.size()
    return dict(rank=hvd.rank(), size=size, local_rank=hvd.local_rank(), allreduce_sum=total,
                allreduce_ok=total == size * (size + 1) / 2, gpus=len(tf.config.list_physical_devices("GPU")))
