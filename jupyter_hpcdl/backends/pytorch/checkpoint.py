"""Checkpoints that are never half-written, and that plain PyTorch loads.

A checkpoint is a directory: each save writes ``model.pt``, ``optimizer.pt`` and ``scheduler.pt`` (``torch.save`` of
their state dicts) into a new sub-directory, which appears under its name only once all its files are on disk; then
``hpcdl.json`` (written whole or not at all) names it as the newest, with the session's progress (epochs and
batches done, the world's size, the data seed). The two newest are kept. Rank 0 writes; every rank reads. In plain
PyTorch::

    state = os.path.join(path, json.load(open(os.path.join(path, "hpcdl.json")))["latest"])
    model.load_state_dict(torch.load(os.path.join(state, "model.pt")))"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass

from ...atomic import write_json
from ..progress import MANIFEST, Progress, check_target

FORMAT = "torch.save state dicts"
PREFIX = "state-"


@dataclass(frozen=True)
class Saved:
    """What a checkpoint gave back: the progress and the optimizer steps taken before it."""

    progress: Progress
    optimizer_steps: int


def _fsync(path: str) -> None:
    """``path`` (a file or a directory's entries) on disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _on_cpu(state):
    """A state dict with every tensor copied to the CPU, so that a machine without the GPU loads it as it is."""
    import torch

    if isinstance(state, torch.Tensor):
        return state.detach().cpu()
    if isinstance(state, dict):
        return {k: _on_cpu(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(_on_cpu(v) for v in state)
    return state


def save(path: str, model, optimizer, scheduler, progress: Progress, optimizer_steps: int, keep: int = 2) -> str:
    """Write the module's, the optimizer's and the scheduler's state as the newest checkpoint in ``path``; the
    directory."""
    import torch

    path = check_target(path)
    os.makedirs(path, exist_ok=True)
    for stale in (d for d in os.listdir(path) if d.startswith(".partial-")):  # a save that was killed half-way
        shutil.rmtree(os.path.join(path, stale), ignore_errors=True)
    name = f"{PREFIX}{time.time_ns():020d}-epoch{progress.epochs_done}-batch{progress.batches_done}"
    partial = tempfile.mkdtemp(prefix=".partial-", dir=path)
    try:
        parts = {"model.pt": model.state_dict(), "optimizer.pt": optimizer.state_dict()}
        if scheduler is not None:
            parts["scheduler.pt"] = scheduler.state_dict()
        for file, state in parts.items():
            torch.save(_on_cpu(state), os.path.join(partial, file))
            _fsync(os.path.join(partial, file))
        os.rename(partial, os.path.join(path, name))
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    try:
        _fsync(path)  # the new directory's name is on disk before the manifest names it
    except OSError:
        pass  # a file system that cannot sync a directory: the rename stands
    write_json(os.path.join(path, MANIFEST), {"format": FORMAT, "latest": name, "files": sorted(parts),
                                              "optimizer_steps": optimizer_steps, **asdict(progress)})
    older = sorted(d for d in os.listdir(path) if d.startswith(PREFIX) and d != name)  # by the time in the name
    for old in older[:max(0, len(older) - (keep - 1))]:
        shutil.rmtree(os.path.join(path, old), ignore_errors=True)
    return path


def load(path: str, model, optimizer, scheduler, device) -> Saved:
    """Restore the newest checkpoint in ``path`` into the module, its optimizer (Adam's moments and step count) and
    scheduler; the progress it recorded."""
    import torch

    path = os.path.abspath(os.path.expanduser(path))
    try:
        with open(os.path.join(path, MANIFEST)) as f:
            manifest = json.load(f)
    except FileNotFoundError:
        raise FileNotFoundError(f"no checkpoint in {path} (a directory written by session.checkpoint())") from None
    if manifest.get("format") != FORMAT:
        raise ValueError(f"the checkpoint in {path} was written by another backend ({manifest.get('format')!r}): "
                         "resume it in a session of that backend")
    state = os.path.join(path, manifest["latest"])

    def read(file: str):
        return torch.load(os.path.join(state, file), map_location=device, weights_only=True)

    try:
        model.load_state_dict(read("model.pt"))
        optimizer.load_state_dict(read("optimizer.pt"))
    except (RuntimeError, ValueError, KeyError) as e:
        raise ValueError(f"the checkpoint {state} does not fit this model (another architecture or optimizer?): "
                         f"{str(e)[:300]}") from None
    if scheduler is not None and "scheduler.pt" in manifest.get("files", ()):
        scheduler.load_state_dict(read("scheduler.pt"))
    fields = {k: int(manifest[k]) for k in ("epochs_done", "batches_done", "world_size", "seed")}
    return Saved(Progress(**fields), int(manifest.get("optimizer_steps", 0)))
