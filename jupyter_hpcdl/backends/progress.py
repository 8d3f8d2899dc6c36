"""Where a training stands, as every backend's checkpoints keep it beside the model (framework-free): epochs and
batches done, the world's size, the data seed; and the checkpoint's directory."""
from __future__ import annotations

import os
from dataclasses import dataclass

#: The file in a checkpoint's directory that names its newest complete state, for people and tools.
MANIFEST = "hpcdl.json"


@dataclass(frozen=True)
class Progress:
    """Where the training stands: what a checkpoint keeps besides the model and the optimizer."""

    epochs_done: int
    batches_done: int
    world_size: int
    seed: int

    def start_batch(self, world_size: int, steps_per_epoch: int) -> int:
        """Where this world's data streams go on: the same batch in the same world; the next epoch's start in a
        world of another size (its shards are different ones)."""
        return self.batches_done if world_size == self.world_size else self.epochs_done * steps_per_epoch


def check_target(path: str) -> str:
    """A checkpoint's path (a directory), or a ValueError that says what is in the way."""
    path = os.path.abspath(os.path.expanduser(path))
    if os.path.isfile(path):
        raise ValueError(f"{path} is a file: a checkpoint is a directory (the framework's files and {MANIFEST}); "
                         "give a new name")
    return path
