"""What every backend's ranks share with the kernel, framework-free (runs on the ranks): live records published to
the kernel through ipyparallel, the number a record may carry, and the exception of a stop every rank agreed on."""
from __future__ import annotations

import itertools
import math
import os
import socket
from collections import deque

OUTBOX_SIZE = 32
_OUTBOX: deque = deque(maxlen=OUTBOX_SIZE)
_SEQUENCE = itertools.count()
_ORIGIN = f"{socket.gethostname()}:{os.getpid()}"


def publish(rank: int, record: dict) -> None:
    """Send ``record`` to the kernel with the last few before it: ipyparallel keeps only an engine's latest
    publication, so a kernel that reads less often than the rank publishes still gets every record (up to
    ``OUTBOX_SIZE`` behind); the kernel drops what it has by (origin, seq)."""
    from ipyparallel.datapub import publish_data

    _OUTBOX.append({**record, "seq": next(_SEQUENCE), "origin": _ORIGIN})
    publish_data({"rank": rank, "records": list(_OUTBOX)})


def number(value) -> float | None:
    """``value`` as a finite float, or None (a record carries no NaN, infinity or object)."""
    try:
        found = float(value)
    except (TypeError, ValueError):
        return None
    return found if math.isfinite(found) else None


class TrainingStopped(Exception):
    """Raised inside a fit when every rank agreed to stop (each checks the stop file at the same batches and the
    ranks take the maximum), so the ranks leave the fit at the same batch and the world stays in step."""


_REPORTED: dict[str, float] = {}


def report(**figures) -> None:
    """Hand figures of the step just taken (``loss=...``, any metric) to the session's live metrics: a script run by
    ``session.run_script`` calls ``jupyter_hpcdl.report(loss=loss.item())`` after its step. Outside a session it
    does nothing, so the script runs unchanged under ``torchrun`` too."""
    _REPORTED.update({k: n for k, v in figures.items() if (n := number(v)) is not None})


def reported() -> dict[str, float]:
    """The figures :func:`report` was given since the last call (then forgotten)."""
    found = dict(_REPORTED)
    _REPORTED.clear()
    return found
