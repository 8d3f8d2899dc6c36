"""What a training session's calls give back (runs in the kernel): a fit's and a script's results, and the errors
that name the ranks they came from."""
from __future__ import annotations

from dataclasses import dataclass, field


class RankError(RuntimeError):
    """One or more ranks raised; the message names each rank and its error."""

    engine_died = False


class WorldDiverged(RuntimeError):
    """The ranks' weights differ after training: gradients were not averaged."""


@dataclass
class FitResult:
    epochs_done: int
    history: dict[int, dict[str, list[float]]]
    stopped: str | None
    weights: str
    seconds: float
    ranks: list[int] = field(default_factory=list)

    @property
    def loss(self) -> list[float]:
        return self.history[0].get("loss", [])


@dataclass
class ScriptResult:
    """A script's run on every rank: each rank's exit code and output, whether Stop or the walltime ended it."""

    exit_codes: dict[int, int]
    stdout: dict[int, str]
    stderr: dict[int, str]
    stopped: str | None
    seconds: float

    @property
    def ok(self) -> bool:
        return all(code == 0 for code in self.exit_codes.values())


class ScriptFailed(RankError):
    """A script exited with a non-zero code on some rank; ``result`` holds every rank's code and output."""

    def __init__(self, message: str, result: ScriptResult):
        super().__init__(message)
        self.result = result
