"""Checkpoints that are never half-written, and that continue the same optimization.

A training checkpoint is a directory that TensorFlow reads as it is: ``tf.train.CheckpointManager`` writes the
model's and the optimizer's variables (Adam's moments, its step count, so a schedule goes on) together with the
session's progress (epochs and batches done, the world's size, the data seed), and names the newest complete one
in the ``checkpoint`` file only once all its files are written. ``hpcdl.json`` beside it says the same for people
and tools. Rank 0 writes; every rank reads. Load it in plain TensorFlow with
``tf.train.Checkpoint(model=model, optimizer=model.optimizer).restore(tf.train.latest_checkpoint(path))``."""
from __future__ import annotations

import json
import os
from dataclasses import asdict

from ...atomic import atomic_write
from ..progress import MANIFEST, Progress, check_target


def _tracked(model, progress_var):
    import tensorflow as tf

    return tf.train.Checkpoint(model=model, optimizer=model.optimizer, progress=progress_var)


def _build_optimizer(model) -> None:
    """Create the optimizer's slots (Adam's moments, momentum) if no step has made them yet: a checkpoint written
    before the first fit then holds them as zeros, and loading builds them before restoring, so the two match."""
    import tensorflow as tf

    optimizer = model.optimizer
    if isinstance(optimizer, tf.keras.optimizers.Optimizer) and not getattr(optimizer, "_built", False):
        optimizer.build(model.trainable_variables)  # (legacy optimizers restore their slots when they make them)


def save(path: str, model, progress: Progress, keep: int = 2) -> str:
    """Write ``model`` (with its optimizer) and ``progress`` as the newest checkpoint in ``path``; its prefix."""
    import tensorflow as tf

    path = check_target(path)
    _build_optimizer(model)
    values = [progress.epochs_done, progress.batches_done, progress.world_size, progress.seed]
    manager = tf.train.CheckpointManager(_tracked(model, tf.Variable(values, dtype=tf.int64)), path,
                                         max_to_keep=keep)
    prefix = manager.save()

    def manifest(tmp: str) -> None:
        with open(tmp, "w") as f:
            json.dump({"format": "tf.train.Checkpoint", "latest": os.path.basename(prefix), **asdict(progress)}, f)

    atomic_write(os.path.join(path, MANIFEST), manifest)
    return prefix


def load(path: str, model) -> Progress:
    """Restore the newest checkpoint in ``path`` into ``model`` and its optimizer (built first, so Adam's moments
    are restored, not recreated); the progress it recorded."""
    import tensorflow as tf

    path = os.path.abspath(os.path.expanduser(path))
    prefix = tf.train.latest_checkpoint(path) if os.path.isdir(path) else None
    if prefix is None:
        raise FileNotFoundError(f"no checkpoint in {path} (a directory written by session.checkpoint())")
    _build_optimizer(model)
    progress_var = tf.Variable([0, 0, 0, 0], dtype=tf.int64)
    status = _tracked(model, progress_var).restore(prefix)
    try:
        status.assert_existing_objects_matched()
    except AssertionError as e:
        raise ValueError(f"the checkpoint {prefix} does not fit this model (another architecture or optimizer?): "
                         f"{str(e)[:300]}") from None
    return Progress(*(int(v) for v in progress_var.numpy()))
