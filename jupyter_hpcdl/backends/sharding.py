"""A rank's part of the user's data, framework-free (runs on the ranks): every size-th sample of arrays or of a
``.npz`` file, copied out so that a rank holds only its part; and the seed of each pass over a shard."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from .base import NpzFile

S = TypeVar("S")


def npz_shard(data: NpzFile, rank: int, size: int) -> tuple:
    """Rank ``rank``'s samples of the arrays in ``data``, as contiguous copies (a strided view would keep the whole
    array alive)."""
    import numpy as np

    with np.load(data.path) as arrays:
        missing = [k for k in (data.x, data.y) if k not in arrays.files]
        if missing:
            raise ValueError(f"{data.path} has no array {missing[0]!r} (it has {', '.join(arrays.files)})")
        return (np.ascontiguousarray(arrays[data.x][rank::size]), np.ascontiguousarray(arrays[data.y][rank::size]))


def array_shard(x, y, rank: int, size: int) -> tuple:
    """Every size-th sample of ``x`` and ``y`` from ``rank`` on (arrays or tensors)."""
    return x[rank::size], y[rank::size]


def checked_pair(made, rank: int) -> tuple:
    """A data function's ``(x, y)`` of equal lengths, or a ValueError that names the rank."""
    if len(made[0]) != len(made[1]):
        raise ValueError(f"the data function gave rank {rank} {len(made[0])} x but {len(made[1])} y")
    return made[0], made[1]


def pass_seed(seed: int, rank: int, p: int) -> int:
    """The shuffle seed of pass ``p`` over rank ``rank``'s shard: the same on every run with the session's seed."""
    return (seed * 1_000_003 + rank * 7_919 + p) % 2**63


def user_shard(data, rank: int, size: int, shard: Callable[..., S], own_form: Callable[[Any], bool],
               forms: str) -> S | None:
    """The user's data in any of its forms (see ``training.spec.check_data``) as this rank's ``shard(x, y)``:
    None, a ``.npz`` file or ``(x, y)`` arrays (every size-th sample), or a function ``(rank, size)`` returning
    this rank's ``(x, y)`` or a dataset of the backend's own kind (where ``own_form`` takes it: ``shard(dataset=)``).
    ``forms`` says what the function may return, for the error."""
    if data is None:
        return None
    if isinstance(data, NpzFile):
        return shard(*npz_shard(data, rank, size))
    if isinstance(data, tuple):
        return shard(*array_shard(*data, rank, size))
    made = data(rank, size)
    if own_form(made):
        return shard(dataset=made)
    if isinstance(made, (tuple, list)) and len(made) == 2:
        return shard(*checked_pair(made, rank))
    raise ValueError(f"the data function must return {forms}, not {type(made).__name__}")
