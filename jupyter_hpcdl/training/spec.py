"""What the user asked to train, as typed values checked in the kernel before anything reaches the ranks."""
from __future__ import annotations

import os
import secrets
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Sequence

from ..backends.base import NpzFile


@dataclass(frozen=True)
class ShortCompile:
    """The short form ``setup(model_fn, data_fn, loss, metrics, lr=...)``: the session compiles the model with SGD."""

    loss: Any
    metrics: tuple = ()
    lr: float = 0.01


@dataclass(frozen=True)
class TrainingSpec:
    """The user's training: ``model_fn()`` builds the model on each rank — compiled by the user (any optimizer,
    loss, metrics, schedule) or, with ``compile``, by the session; ``data`` is each rank's training data,
    ``validation_data`` likewise (see :func:`check_data`)."""

    model_fn: Callable[[], Any]
    data: Any
    batch_size: int = 32
    validation_data: Any = None
    compile: ShortCompile | None = None
    callbacks: Any = ()
    seed: int = field(default_factory=lambda: secrets.randbelow(2**31))
    scale_lr: bool = False
    shuffle: bool = True
    steps_per_epoch: int | None = None

    @property
    def user_compiled(self) -> bool:
        return self.compile is None

    def with_data(self, data) -> "TrainingSpec":
        return replace(self, data=data)


def check_data(data, what: str = "data"):
    """Data in one of the forms a rank can take, or a ValueError that says which forms there are:
    ``(x, y)`` arrays (each rank takes every size-th sample), a function ``(rank, size)`` returning this rank's
    ``(x, y)`` or a batched ``tf.data.Dataset``, or a path to a ``.npz`` file with arrays ``x`` and ``y``."""
    if data is None:
        return None
    if isinstance(data, (str, os.PathLike)):
        data = NpzFile(os.fspath(data))
    if isinstance(data, NpzFile):
        path = os.path.expanduser(data.path)
        if not path.endswith(".npz"):
            raise ValueError(f"{what}: a path must name a .npz file with arrays x and y (got {data.path!r}); for "
                             "other files give a function (rank, size) -> tf.data.Dataset that reads them")
        if not os.path.isfile(path):
            raise ValueError(f"{what}: no file {path}: the ranks read it from the shared file system")
        return replace(data, path=path)
    if callable(data):
        return data
    if isinstance(data, Sequence) and len(data) == 2 and not isinstance(data, str):
        x, y = data
        if len(x) != len(y):
            raise ValueError(f"{what}: x has {len(x)} samples but y has {len(y)}")
        return tuple(data)
    raise ValueError(f"{what} must be (x, y) arrays, a function (rank, size) -> (x, y) or tf.data.Dataset, or a "
                     f"path to a .npz file; got {type(data).__name__}")


def check_batch_size(batch_size) -> int:
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive whole number, not {batch_size!r}")
    return batch_size


def make_spec(model_fn, data, loss=None, metrics: Sequence = (), lr: float | None = None, batch_size: int = 32,
              validation_data=None, callbacks=(), seed: int | None = None, scale_lr: bool = False,
              shuffle: bool = True, steps_per_epoch: int | None = None) -> TrainingSpec:
    """A checked :class:`TrainingSpec` from :meth:`TrainingSession.setup`'s arguments."""
    if not callable(model_fn):
        raise ValueError("model_fn must be a function that builds (and, without loss=, compiles) the model: it runs "
                         "on every rank")
    check_batch_size(batch_size)
    if steps_per_epoch is not None and (not isinstance(steps_per_epoch, int) or steps_per_epoch < 1):
        raise ValueError(f"steps_per_epoch must be a positive whole number or None, not {steps_per_epoch!r}")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**31):
        raise ValueError(f"seed must be a whole number in [0, 2**31), not {seed!r}")
    if not (callable(callbacks) or isinstance(callbacks, (list, tuple))):
        raise ValueError("callbacks must be a list of Keras callbacks or a function (rank, size) -> list")
    if loss is None and (lr is not None or metrics):
        raise ValueError("lr and metrics go with loss= (the short form, compiled by the session with SGD); a model "
                         "you compile yourself in model_fn brings its own optimizer and metrics")
    named = tuple(metrics.items()) if isinstance(metrics, dict) else tuple(metrics)  # a dict: (name, metric) pairs
    short = ShortCompile(loss, named, 0.01 if lr is None else float(lr)) if loss is not None else None
    spec = TrainingSpec(model_fn, check_data(data), batch_size, check_data(validation_data, "validation_data"),
                        short, callbacks if callable(callbacks) else tuple(callbacks), scale_lr=bool(scale_lr),
                        shuffle=bool(shuffle), steps_per_epoch=steps_per_epoch)
    return spec if seed is None else replace(spec, seed=seed)
