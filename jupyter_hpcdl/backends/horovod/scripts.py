"""An existing Horovod script, run unchanged on the session's ranks (runs on the ranks): as ``python script.py
args`` would, in this rank's world (its ``hvd.init()`` joins the world the rank is already in), with the session's
callbacks added to every ``model.fit`` it calls, so its metrics stream live and Stop ends it at an agreed batch."""
from __future__ import annotations

import contextlib
import warnings

from ..scriptrun import run_main
from . import hvd
from .rank_callbacks import make_callbacks

FIT_CALLBACKS_POSITION = 5  # Model.fit(x, y, batch_size, epochs, verbose, callbacks, ...)


def _tolerant(fn, what: str):
    """``fn``, but a RuntimeError for devices already initialized (the session's join set this rank's GPU up
    before the script's own ``set_visible_devices``/``set_memory_growth``) becomes a warning."""

    def call(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except RuntimeError as e:
            if "initialized" not in str(e):
                raise
            warnings.warn(f"{what} ignored: the session had set up this rank's devices already ({e})")
            return None

    return call


@contextlib.contextmanager
def session_fit(stop_file: str, publish_every: int, check_every: int, min_interval: float):
    """While the script runs: every ``Model.fit`` gets the session's callbacks, and device set-up that TensorFlow
    no longer allows is a warning."""
    import numpy as np
    import tensorflow as tf

    progress = {"epochs_done": 0, "batches_done": 0}
    model_class, original_fit = tf.keras.Model, tf.keras.Model.fit
    saved = {(tf.config, "set_visible_devices"): tf.config.set_visible_devices,
             (tf.config.experimental, "set_memory_growth"): tf.config.experimental.set_memory_growth,
             (tf.config.experimental, "set_visible_devices"): tf.config.experimental.set_visible_devices}

    def fit(self, *args, **kwargs):
        args = list(args)
        given = args.pop(FIT_CALLBACKS_POSITION) if len(args) > FIT_CALLBACKS_POSITION else kwargs.pop("callbacks", None)
        x = args[0] if args else kwargs.get("x")
        batch_size = (args[2] if len(args) > 2 else kwargs.get("batch_size")) or (
            32 if isinstance(x, np.ndarray) else None)  # Keras' default for arrays; a Dataset's own
        ours = make_callbacks(progress, stop_file, batch_size, publish_every, check_every, min_interval)
        return original_fit(self, *args, callbacks=[*(given or []), *ours], **kwargs)

    model_class.fit = fit
    for (owner, name), fn in saved.items():
        setattr(owner, name, _tolerant(fn, f"tf.config.{name}"))
    try:
        yield progress
    finally:
        model_class.fit = original_fit
        for (owner, name), fn in saved.items():
            setattr(owner, name, fn)


def run_script(path: str, args: list[str], stop_file: str, publish_every: int = 5, check_every: int = 20,
               min_interval: float = 0.0) -> dict:
    """Run ``path`` as ``__main__`` with ``sys.argv = [path, *args]``; this rank's exit code and whether Stop
    ended it."""
    with session_fit(stop_file, publish_every, check_every, min_interval) as progress:
        end = run_main(path, args)
    return {"rank": hvd.rank(), "exit_code": end.exit_code, "stopped": end.stopped,
            "epochs_done": progress["epochs_done"]}
