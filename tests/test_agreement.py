"""Ranks that agree after their part of a step (``backends/agreement.py``): two ranks as threads, joined by a real
maximum over what each gives, so that a rank whose part failed still joins and every rank learns of it."""
from __future__ import annotations

import threading

import pytest

from jupyter_hpcdl.backends.agreement import Together


class TwoRanks:
    """An elementwise maximum over two threads (a barrier stands for the collective)."""

    def __init__(self):
        self.given: dict[int, list[float]] = {}
        self.barrier = threading.Barrier(2, timeout=10)
        self.names: list[str] = []

    def allreduce_max(self, rank: int):
        def reduce(values: list[float], name: str) -> list[float]:
            self.given[rank] = values
            self.names.append(name)
            self.barrier.wait()
            return [max(pair) for pair in zip(*self.given.values())]
        return reduce


def run_both(parts) -> list:
    world, outcome = TwoRanks(), [None, None]

    def rank(index: int) -> None:
        try:
            with Together(world.allreduce_max(index), "hpcdl.test", "build its model", "fix it") as part:
                mine = parts[index]()
            outcome[index] = part.agree([mine if part.failure is None else 0])
        except Exception as e:  # noqa: BLE001 - the outcome under test
            outcome[index] = e

    threads = [threading.Thread(target=rank, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(15)
    assert world.names == ["hpcdl.test"] * 2, "every rank joins the one collective"
    return outcome


def test_ranks_that_succeed_get_the_maximum_of_their_values():
    assert run_both([lambda: 3, lambda: 5]) == [[5.0], [5.0]]


def test_a_failed_part_is_raised_on_its_rank_and_named_as_another_ranks_on_the_others():
    def fails():
        raise ValueError("rank 1's data has no 'y'")

    mine, theirs = run_both([lambda: 3, fails])
    assert isinstance(theirs, ValueError) and "no 'y'" in str(theirs)
    assert isinstance(mine, RuntimeError)
    assert str(mine) == "another rank could not build its model (its own error is reported too): fix it"


def test_what_is_not_an_exception_is_not_held():
    with pytest.raises(KeyboardInterrupt):
        with Together(lambda values, name: values, "n", "x"):
            raise KeyboardInterrupt


def test_a_failed_collective_still_reports_this_ranks_own_error():
    def broken(values, name):
        raise RuntimeError("the peer is gone")

    with pytest.raises(ValueError, match="no 'y'") as raised:
        with Together(broken, "n", "read its data") as part:
            raise ValueError("this rank's data has no 'y'")
        part.agree()
    assert "the peer is gone" in str(raised.value.__cause__)
    with pytest.raises(RuntimeError, match="the peer is gone"):  # a rank without an error of its own
        with Together(broken, "n", "read its data") as part:
            pass
        part.agree()
