"""This rank's :class:`~jupyter_hpcdl.backends.steps.StepWatch` with PyTorch's collective and GPU figures (runs on
the ranks): in a session's fit and in a user's script run by ``session.run_script``."""
from __future__ import annotations

from ..steps import StepWatch
from . import dist


def step_watch(stop_file: str, publish_every: int = 5, check_every: int = 20, min_interval: float = 0.0) -> StepWatch:
    """The watch of this rank's steps: its GPU (the local rank's, where CUDA is there) and the memory PyTorch
    holds on it."""
    import torch

    cuda = torch.cuda.is_available()
    return StepWatch(dist.rank(), dist.allreduce_max, stop_file, publish_every, check_every, min_interval,
                     gpu_index=dist.local_rank() if cuda else None,
                     gpu_memory_mb=(lambda: torch.cuda.memory_allocated() / 2**20) if cuda else None)
