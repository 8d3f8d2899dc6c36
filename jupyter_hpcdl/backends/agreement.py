"""A step every rank takes together, framework-free (runs on the ranks): an error in this rank's part is held
until one collective that every rank joins (also a rank whose part failed) has told each rank whether any failed,
so that one rank's error never leaves the others waiting in their next collective."""
from __future__ import annotations

from collections.abc import Callable, Sequence

#: A backend's elementwise maximum over all ranks: ``(values, name) -> values``.
AllreduceMax = Callable[[list[float], str], list[float]]


class Together:
    """``with Together(allreduce_max, "hpcdl.load", "read the checkpoint") as part: ...`` then ``part.agree()``.

    An ``Exception`` inside the block is held, not raised; :meth:`agree` joins the collective, then raises this
    rank's own error, or a ``RuntimeError`` saying that another rank could not do ``what`` (that rank reports its
    own error)."""

    def __init__(self, allreduce_max: AllreduceMax, name: str, what: str, then: str = ""):
        self.allreduce_max, self.name, self.what, self.then = allreduce_max, name, what, then
        self.failure: Exception | None = None

    def __enter__(self) -> "Together":
        return self

    def __exit__(self, kind, error, traceback) -> bool:
        if isinstance(error, Exception):
            self.failure = error
            return True  # held for agree()
        return False

    def agree(self, values: Sequence[float] = ()) -> list[float]:
        """The elementwise maximum of ``values`` over every rank (a failed rank gives what it had), once every
        rank's part succeeded; raises otherwise."""
        try:
            *maxed, failed = self.allreduce_max([*map(float, values), float(self.failure is not None)], self.name)
        except Exception as e:
            if self.failure is not None:  # this rank's own error says more than the collective's
                raise self.failure from e
            raise
        if self.failure is not None:
            raise self.failure
        if failed:
            raise RuntimeError(f"another rank could not {self.what} (its own error is reported too)"
                               + (f": {self.then}" if self.then else ""))
        return maxed
