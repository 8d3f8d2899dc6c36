"""A training session's checkpoints (runs in the kernel): written by rank 0 (what it writes:
:mod:`jupyter_hpcdl.backends.horovod.checkpoint`), read by every rank, and the one written when the walltime is
about to end."""
from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING

from .rankworld import RankWorld
from .reporting import Reporter

if TYPE_CHECKING:
    from .fitting import ModelState


class Checkpoints:
    """Checkpoints of the model on ``ranks``; :attr:`walltime_checkpoint`: the last one the walltime made."""

    def __init__(self, ranks: RankWorld, model: "ModelState", reporter: Reporter, session_id: str):
        self.ranks, self.model, self.reporter, self.session_id = ranks, model, reporter, session_id
        self.walltime_checkpoint: str | None = None

    def save(self, path: str) -> str:
        """Write the model into the directory ``path``; the directory."""
        return next(p for p in self.ranks.call(self.ranks.backend.save, os.path.expanduser(path)) if p)

    def resume(self, path: str) -> list[dict]:
        """Every rank continues from the checkpoint in ``path``."""
        loaded = self.ranks.call(self.ranks.backend.load, os.path.expanduser(path))
        self.model.epochs_done = loaded[0]["epochs_done"]
        return loaded

    def for_walltime(self, why: str, directory: str, margin: float) -> str:
        """Checkpoint into ``directory`` before the walltime ends, and say so (to the user and the panel); what
        was said."""
        os.makedirs(directory, mode=0o700, exist_ok=True)
        path = self.save(os.path.join(directory, f"walltime-{self.session_id[:12]}-epoch{self.model.epochs_done}"))
        self.walltime_checkpoint = path
        message = (f"Stopped before the walltime ends ({why}; margin {margin:.0f} s): epoch "
                   f"{self.model.epochs_done} is checkpointed in {path}. Continue in a new allocation with "
                   "session.continue_in_new_allocation().")
        print(message, file=sys.stderr, flush=True)
        self.reporter.report("walltime", message=message)
        return message
