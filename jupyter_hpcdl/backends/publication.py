"""What every backend's ranks share with the kernel, framework-free (runs on the ranks): live records published to
the kernel through ipyparallel, and the exception of a stop every rank agreed on."""
from __future__ import annotations

import itertools
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


class TrainingStopped(Exception):
    """Raised inside a fit when every rank agreed to stop (each checks the stop file at the same batches and the
    ranks take the maximum), so the ranks leave the fit at the same batch and the world stays in step."""

