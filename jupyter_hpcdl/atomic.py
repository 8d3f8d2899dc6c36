"""Files that are never half-written: the file appears under its name only once it is complete. Standard library
only, so every layer (the containers' CLI, the doctor, the ranks' checkpoints) can use it at no import cost."""
from __future__ import annotations

import json
import os
import tempfile
from typing import Callable


def atomic_write(path: str, write: Callable[[str], None]) -> str:
    """Call ``write(tmp_path)`` for a temporary file beside ``path``, flush it to disk, then rename it into place.
    A failure leaves the previous file (if any) untouched and no partial file behind."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".partial-", suffix=os.path.splitext(path)[1], dir=directory)
    os.close(fd)
    try:
        write(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


def write_json(path: str, value, indent: int | None = None) -> str:
    """``value`` as JSON at ``path``, whole or not at all."""
    def write(tmp: str) -> None:
        with open(tmp, "w") as f:
            json.dump(value, f, indent=indent)

    return atomic_write(path, write)
