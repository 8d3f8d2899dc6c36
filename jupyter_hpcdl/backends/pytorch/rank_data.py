"""A rank's data (runs on the ranks): its shard of the user's data as batches that any epoch of any fit can start
from, so a resumed or recovered fit goes on with the data order it would have had.

The stream is pass after pass over the shard; pass ``p`` of arrays is shuffled with a seed made of the session's
seed, the rank and ``p`` (a ``Dataset`` is batched by a ``DataLoader`` seeded the same way; the user's own
``DataLoader`` is read as it was written). An epoch is the agreed number of batches (the most any rank needs for one
pass), so a rank with a smaller shard wraps into its next pass and no rank leaves an epoch while its peers wait in
a gradient allreduce; the position after ``k`` epochs is ``k × steps`` batches into the stream."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator

from ..sharding import pass_seed, user_shard


@dataclass
class Shard:
    """This rank's data: arrays or tensors (``x``, ``y``), or a ``torch.utils.data`` ``Dataset`` or ``DataLoader``
    (``dataset``)."""

    x: Any = None
    y: Any = None
    dataset: Any = None

    @property
    def samples(self) -> int | None:
        if self.dataset is None:
            return len(self.x)
        return None if _is_loader(self.dataset) else len(self.dataset)


def _is_loader(data) -> bool:
    from torch.utils.data import DataLoader

    return isinstance(data, DataLoader)


def load_shard(data, rank: int, size: int) -> Shard | None:
    """The user's data in any of its forms (see ``spec.check_data``) as this rank's shard: ``(x, y)`` arrays or
    tensors (every size-th sample), a ``.npz`` file, or a function ``(rank, size)`` returning this rank's ``(x, y)``,
    a map-style ``Dataset`` of ``(x, y)`` samples or a ``DataLoader`` of ``(x, y)`` batches."""
    return user_shard(data, rank, size, Shard, _torch_data, "(x, y), a torch Dataset of (x, y) samples or a "
                      "DataLoader of (x, y) batches")


def _torch_data(made) -> bool:
    """Whether ``made`` is a ``DataLoader`` or a map-style ``Dataset`` (an iterable one is refused)."""
    from torch.utils.data import Dataset

    if _is_loader(made):
        return True
    if isinstance(made, Dataset) and not hasattr(made, "__len__"):
        raise ValueError("the data function gave an iterable Dataset: wrap it in a DataLoader that batches it and "
                         "give steps_per_epoch=")
    return isinstance(made, Dataset)


def batches_per_pass(shard: Shard, batch_size: int, steps_per_epoch: int | None = None) -> int:
    """Batches in one pass over this rank's shard (the last one partial); a ``DataLoader`` without a length needs
    ``steps_per_epoch``."""
    if shard.dataset is not None and _is_loader(shard.dataset):
        try:
            n = len(shard.dataset)
        except TypeError:
            if steps_per_epoch is None:
                raise ValueError("this rank's DataLoader has no length (an iterable Dataset): give "
                                 "steps_per_epoch=") from None
            return steps_per_epoch
        if n <= 0:
            raise ValueError("this rank's DataLoader is empty: every rank needs at least one batch")
        return n
    if shard.samples <= 0:
        raise ValueError("this rank's data shard is empty: every rank needs at least one sample")
    return -(-shard.samples // batch_size)


def from_arrays(x, y) -> tuple:
    """A batch of the user's arrays as tensors: NumPy's float64 in torch's default dtype (a model's weights are
    float32), integer labels as int64 (what ``cross_entropy`` takes); tensors as they are."""
    import numpy as np
    import torch

    def tensor(value, labels: bool):
        if isinstance(value, torch.Tensor):
            return value
        array = np.asarray(value)
        if array.dtype == np.float64:
            return torch.from_numpy(array).to(torch.get_default_dtype())
        if labels and np.issubdtype(array.dtype, np.integer):
            return torch.from_numpy(array.astype(np.int64, copy=False))
        return torch.as_tensor(array)

    return tensor(x, False), tensor(y, True)


def to_device(batch: tuple, device) -> tuple:
    """A batch on ``device``; float64 tensors in torch's default dtype, as arrays arrive (other dtypes, float16 or
    bfloat16 say, as they are)."""
    import torch

    def moved(part):
        if part.dtype == torch.float64:
            part = part.to(torch.get_default_dtype())
        return part.to(device, non_blocking=True)

    return tuple(moved(part) for part in batch)


def _pair(batch) -> tuple:
    if not isinstance(batch, (tuple, list)) or len(batch) != 2:
        raise ValueError(f"a batch of the user's data must be a pair (x, y), not {type(batch).__name__}")
    return batch[0], batch[1]


def one_pass(shard: Shard, batch_size: int, seed: int, rank: int, p: int, shuffle: bool) -> Iterator[tuple]:
    """The batches of pass ``p`` over the shard, as ``(x, y)`` tensors not yet on a device (a ``Dataset``'s samples
    collated by the ``DataLoader``, the user's ``DataLoader``'s batches as it gives them)."""
    import numpy as np
    import torch
    from torch.utils.data import DataLoader

    if shard.dataset is None:
        n = shard.samples
        order = np.random.default_rng(pass_seed(seed, rank, p)).permutation(n) if shuffle else np.arange(n)
        for start in range(0, n, batch_size):
            index = order[start:start + batch_size]
            x, y = shard.x, shard.y
            yield from_arrays(x[torch.as_tensor(index)] if isinstance(x, torch.Tensor) else x[index],
                              y[torch.as_tensor(index)] if isinstance(y, torch.Tensor) else y[index])
        return
    loader = shard.dataset if _is_loader(shard.dataset) else DataLoader(
        shard.dataset, batch_size=batch_size, shuffle=shuffle,
        generator=torch.Generator().manual_seed(pass_seed(seed, rank, p)))
    for batch in loader:
        yield _pair(batch)


def training_stream(shard: Shard, batch_size: int, seed: int, rank: int, shuffle: bool, start_batch: int,
                    per_pass: int, device) -> Iterator[tuple]:
    """The endless stream of batches on ``device`` from batch ``start_batch`` on (see the module's docstring)."""
    p, offset = divmod(start_batch, per_pass)
    while True:
        i = -1
        for i, (x, y) in enumerate(one_pass(shard, batch_size, seed, rank, p, shuffle)):
            if i >= offset:
                yield to_device((x, y), device)
        if i < 0:
            raise ValueError(f"pass {p} over this rank's data gave no batch (an exhausted iterator?): a DataLoader "
                             "must give its batches again on every pass")
        p, offset = p + 1, 0


def validation_batches(shard: Shard, batch_size: int, device) -> Iterator[tuple]:
    """The validation shard once over, in order, on ``device``."""
    for batch in one_pass(shard, batch_size, 0, 0, 0, shuffle=False):
        yield to_device(batch, device)
