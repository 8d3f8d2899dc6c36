"""Figures a user's training script hands to the session (standard library only; runs on the ranks): the step's
loss and any metric, published with the session's own step figures while ``session.run_script`` runs the script."""
from __future__ import annotations

import math

_REPORTED: dict[str, float] = {}


def number(value) -> float | None:
    """``value`` as a finite float, or None (a record carries no NaN, infinity or object)."""
    try:
        found = float(value)
    except (TypeError, ValueError):
        return None
    return found if math.isfinite(found) else None


def report(**figures) -> None:
    """Hand figures of the step just taken (``loss=...``, any metric) to the session's live metrics: a script run by
    ``session.run_script`` calls ``jupyter_hpcdl.report(loss=loss.item())`` after its step. Outside a session it
    keeps only the latest figures, so the script runs unchanged under ``torchrun`` too."""
    _REPORTED.update({name: found for name, value in figures.items() if (found := number(value)) is not None})


def reported() -> dict[str, float]:
    """The figures :func:`report` was given since the last call (then forgotten)."""
    found = dict(_REPORTED)
    _REPORTED.clear()
    return found
