"""A rank's data (runs on the ranks): its shard of the user's data as a ``tf.data`` stream that any epoch of any
fit can start from, so a resumed or recovered fit goes on with the data order it would have had.

The stream is pass after pass over the shard; pass ``p`` is shuffled with a seed made of the session's seed, the
rank and ``p``. An epoch is the agreed number of batches (the most any rank needs for one pass), so a rank with a
smaller shard wraps into its next pass; the position after ``k`` epochs is ``k × steps`` batches into the stream."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..sharding import pass_seed, user_shard


@dataclass
class Shard:
    """This rank's data: arrays (``x``, ``y``), or the user's batched ``tf.data.Dataset``."""

    x: Any = None
    y: Any = None
    dataset: Any = None

    @property
    def samples(self) -> int | None:
        return len(self.x) if self.dataset is None else None


def load_shard(data, rank: int, size: int) -> Shard | None:
    """The user's data in any of its forms (see ``spec.check_data``) as this rank's shard."""
    import tensorflow as tf

    return user_shard(data, rank, size, Shard, lambda made: isinstance(made, tf.data.Dataset),
                      "(x, y) or a batched tf.data.Dataset")


def batches_per_pass(shard: Shard, batch_size: int, steps_per_epoch: int | None = None) -> int:
    """Batches in one pass over this rank's shard (the last one partial). A Dataset of unknown length is counted
    once; an endless one needs ``steps_per_epoch``."""
    import tensorflow as tf

    if shard.dataset is None:
        if shard.samples <= 0:
            raise ValueError("this rank's data shard is empty: every rank needs at least one sample")
        return -(-shard.samples // batch_size)
    n = int(shard.dataset.cardinality())
    if n == tf.data.INFINITE_CARDINALITY:
        if steps_per_epoch is None:
            raise ValueError("this rank's Dataset repeats forever: give steps_per_epoch=")
        return steps_per_epoch
    if n == tf.data.UNKNOWN_CARDINALITY:
        n = int(shard.dataset.reduce(0, lambda count, _: count + 1))
    if n <= 0:
        raise ValueError("this rank's Dataset is empty: every rank needs at least one batch")
    return n


def training_stream(shard: Shard, batch_size: int, seed: int, rank: int, shuffle: bool = True,
                    start_batch: int = 0, per_pass: int | None = None):
    """The endless stream of batches from batch ``start_batch`` on (see the module's docstring)."""
    import tensorflow as tf

    per_pass = per_pass or batches_per_pass(shard, batch_size)
    first_pass, offset = divmod(start_batch, per_pass)
    if shard.dataset is not None:
        one_pass = lambda p: shard.dataset  # noqa: E731 - the user's pipeline shuffles as it was written to
    else:
        base = tf.data.Dataset.from_tensor_slices((shard.x, shard.y))
        n = shard.samples

        def one_pass(p):
            passed = base.shuffle(n, seed=tf.constant(pass_seed(seed, rank, 0), tf.int64) + p,
                                  reshuffle_each_iteration=False) if shuffle else base
            return passed.batch(batch_size)

    stream = tf.data.Dataset.range(first_pass, 2**62).flat_map(one_pass).skip(offset).prefetch(tf.data.AUTOTUNE)
    if shard.dataset is not None:  # the user's own options (the stream's are its outer stages', not flat_map's)
        stream = stream.with_options(shard.dataset.options())
    return stream.with_options(untuned(shard.dataset))


def untuned(dataset=None):
    """Options that turn ``tf.data``'s autotuning off, unless ``dataset`` (a user's) sets it itself.

    Tearing down an autotuned iterator waits for its tuning thread's next round (TensorFlow 2.15), and that
    thread's period doubles as the iterator runs: 2.3–2.8 s after 5 of 7 45-batch fits in
    ``benchmarks/fit_end.py``, up to about 20 s after 125-batch fits in ``benchmarks/training_user_model.py``. Keras
    tears down a fit's iterator at its end, and a validation set's after each epoch, on one rank or another while
    its peers wait. Without autotuning, a stage's ``AUTOTUNE`` parallelism is TensorFlow's default (its thread pool's
    size, up to 16) and a prefetch buffer still grows as needed. A user's Dataset that sets
    ``options.autotune.enabled = True`` keeps it."""
    import tensorflow as tf

    options = tf.data.Options()
    if dataset is None or dataset.options().autotune.enabled is None:
        options.autotune.enabled = False
    return options


def validation_stream(shard: Shard | None, batch_size: int):
    """The validation shard, batched, once over (Keras evaluates it at each epoch's end)."""
    import tensorflow as tf

    if shard is None:
        return None
    if shard.dataset is not None:
        return shard.dataset.with_options(untuned(shard.dataset))
    return tf.data.Dataset.from_tensor_slices((shard.x, shard.y)).batch(batch_size).with_options(untuned())
