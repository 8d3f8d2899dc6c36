"""What runs on each rank (an ipyparallel engine, natively or in the user's container): join the world, build the
user's module wrapped in ``DistributedDataParallel`` with its optimizer, train epoch by epoch while publishing
metrics, stop with all ranks at the same batch, checkpoint and resume. The state of this rank lives in ``_STATE``;
what is ``torch.distributed``'s is in :mod:`.dist`."""
from __future__ import annotations

import hashlib
import os
import socket
import time

from ..agreement import Together
from ..base import user_callbacks
from ..progress import Progress
from ..publication import TrainingStopped
from . import checkpoint, dist
from .model import current_lr, model_parts, scale_learning_rate
from .rank_data import batches_per_pass, load_shard, training_stream, validation_batches
from .rank_steps import step_watch

_STATE: dict = {}


def join(env: dict) -> dict:
    """Set the world's environment, then join it (Gloo, or NCCL on GPUs) through the session's store."""
    os.environ.update(env)
    import torch

    threads = int(os.environ.get("HPCDL_TF_THREADS", "0"))  # the session's threads per rank
    if threads:
        torch.set_num_threads(threads)
    place = dist.init()
    _STATE.clear()
    _STATE["progress"] = {"epochs_done": 0, "batches_done": 0, "optimizer_steps": 0}
    return {**place, "host": socket.gethostname(), "node": os.environ.get("HPCDL_NODE", ""), "pid": os.getpid(),
            "gpus": torch.cuda.device_count(), "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "container_mode": os.environ.get("HPCDL_CONTAINER_MODE")}


def build(spec) -> dict:
    """Build the user's module, optimizer and data on this rank, agree on the steps of an epoch, then wrap the
    module in ``DistributedDataParallel`` (which starts every rank from rank 0's parameters)."""
    import torch
    from torch.nn.parallel import DistributedDataParallel

    mine = 0
    rank, size, device = dist.rank(), dist.size(), dist.device()
    with Together(dist.allreduce_max, "hpcdl.steps", "build its model or data") as part:
        torch.manual_seed(spec.seed)
        parts = model_parts(spec.model_fn(), spec.compile, device)
        if spec.scale_lr:
            scale_learning_rate(parts, size)
        shard = load_shard(spec.data, rank, size)
        validation = load_shard(spec.validation_data, rank, size)
        mine = batches_per_pass(shard, spec.batch_size, spec.steps_per_epoch)
    steps = int(part.agree([mine])[0])  # the most any rank needs for one pass over its shard; the same on all
    wrapped = DistributedDataParallel(parts.model, device_ids=[device.index] if device.type == "cuda" else None)
    _STATE.update(parts=parts, wrapped=wrapped, spec=spec, shard=shard, validation=validation, per_pass=mine,
                  steps=spec.steps_per_epoch or steps, device=device,
                  progress={"epochs_done": 0, "batches_done": 0, "optimizer_steps": 0})
    return {"rank": rank, "samples": shard.samples, "steps_per_epoch": _STATE["steps"], "batches_per_pass": mine,
            "optimizer": type(parts.optimizer).__name__, "learning_rate": current_lr(parts.optimizer),
            "user_optimizer": parts.user_optimizer}


def _figures(parts, output, target) -> list[float]:
    """The metrics of one batch, in ``parts.metrics``' order."""
    return [float(fn(output, target)) for fn in parts.metrics.values()]


def _averaged(names: list[str], sums: list[float], count: float) -> dict[str, float]:
    """Sample-weighted means over every rank's batches (one collective)."""
    *totals, n = dist.allreduce_sum([*sums, count], "hpcdl.metrics")
    return {name: total / n for name, total in zip(names, totals)} if n else {}


def evaluate() -> dict[str, float]:
    """The validation loss and metrics over every rank's validation shard (the module unwrapped: no collective
    per batch, so uneven shards are fine), averaged over all ranks' samples."""
    import torch

    parts, spec, device = _STATE["parts"], _STATE["spec"], _STATE["device"]
    names = ["loss", *parts.metrics]
    sums, count = [0.0] * len(names), 0
    parts.model.eval()
    with torch.no_grad():
        for x, y in validation_batches(_STATE["validation"], spec.batch_size, device):
            output = parts.model(x)
            n = len(y)
            for i, v in enumerate([float(parts.loss(output, y)), *_figures(parts, output, y)]):
                sums[i] += v * n
            count += n
    return {f"val_{k}": v for k, v in _averaged(names, sums, count).items()}


def fit(epochs: int, stop_file: str, publish_every: int = 5, check_every: int = 20, min_interval: float = 0.0) -> dict:
    """Train ``epochs`` more epochs; this rank's history, whether it was stopped, and a digest of its parameters.
    The user's callbacks are called after each epoch as ``callback(epoch, logs)`` (or their ``on_epoch_end``)."""
    import torch

    if "wrapped" not in _STATE:
        raise RuntimeError("this rank has no model: setup() builds one")
    parts, wrapped, spec, progress = _STATE["parts"], _STATE["wrapped"], _STATE["spec"], _STATE["progress"]
    rank, size = dist.rank(), dist.size()
    watch = step_watch(stop_file, publish_every, check_every, min_interval)
    callbacks = user_callbacks(spec.callbacks, rank, size)
    stream = training_stream(_STATE["shard"], spec.batch_size, spec.seed, rank, spec.shuffle,
                             progress["batches_done"], _STATE["per_pass"], _STATE["device"])
    names = ["loss", *parts.metrics]
    history: dict[str, list[float]] = {}
    stopped = None
    try:
        for _ in range(epochs):
            epoch = progress["epochs_done"] + 1
            wrapped.train()
            sums, count = [0.0] * len(names), 0
            for batch in range(_STATE["steps"]):
                started = time.perf_counter()
                x, y = next(stream)
                parts.optimizer.zero_grad(set_to_none=True)
                output = wrapped(x)
                loss = parts.loss(output, y)
                loss.backward()
                parts.optimizer.step()
                progress["batches_done"] += 1
                progress["optimizer_steps"] += 1
                with torch.no_grad():
                    values = [float(loss.detach()), *_figures(parts, output.detach(), y)]
                n = len(y)
                sums = [s + v * n for s, v in zip(sums, values)]
                count += n
                watch.step(epoch, batch, started, n, values[0], dict(zip(names[1:], values[1:])))
            logs = _averaged(names, sums, count)
            if _STATE["validation"] is not None:
                logs.update(evaluate())
            if isinstance(parts.scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
                parts.scheduler.step(logs.get("val_loss", logs.get("loss")))
            elif parts.scheduler is not None:
                parts.scheduler.step()
            for key, value in logs.items():
                history.setdefault(key, []).append(value)
            progress["epochs_done"] += 1
            for callback in callbacks:
                (getattr(callback, "on_epoch_end", None) or callback)(epoch - 1, dict(logs))
            watch.epoch_end(epoch, logs.get("loss"), logs)
    except TrainingStopped as e:
        stopped = str(e)
    return {"rank": rank, "history": history, "stopped": stopped, "epochs_done": progress["epochs_done"],
            "weights": weights_digest()}


def shard_size() -> dict:
    return {"rank": dist.rank(), "samples": _STATE["shard"].samples, "batches_per_pass": _STATE["per_pass"]}


def weights_digest() -> str:
    """A digest of the module's parameters, which ``DistributedDataParallel`` keeps equal on every rank (buffers
    such as BatchNorm's running statistics are each rank's own)."""
    import torch

    h = hashlib.sha256()
    for p in _STATE["parts"].model.parameters():
        h.update(p.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def set_lr(lr: float) -> float:
    parts = _STATE["parts"]
    if parts.scheduler is not None:
        raise ValueError("this optimizer follows a learning-rate scheduler: its rate cannot be set by hand (build "
                         "the model again with another scheduler, or none)")
    for group in parts.optimizer.param_groups:
        group["lr"] = float(lr)
    return current_lr(parts.optimizer)


def save(path: str) -> str | None:
    """Rank 0 writes the module's, the optimizer's and the scheduler's state with the progress (see
    :mod:`.checkpoint`); the others nothing."""
    if dist.rank() != 0:
        return None
    parts, progress = _STATE["parts"], _STATE["progress"]
    return checkpoint.save(path, parts.model, parts.optimizer, parts.scheduler,
                           Progress(progress["epochs_done"], progress["batches_done"], dist.size(),
                                    _STATE["spec"].seed), progress["optimizer_steps"])


def load(path: str) -> dict:
    """Every rank reads the checkpoint (on the shared file system) and continues from it: the same parameters,
    optimizer state, scheduler, epoch, and — in a world of the same size — the same place in the data. The ranks
    agree that each read it (one collective every rank joins), so none goes on with other weights."""
    parts = _STATE["parts"]
    with Together(dist.allreduce_max, "hpcdl.load", "read the checkpoint", "this rank's model is loaded from it, "
                  "resume again once every rank can read it") as part:
        saved = checkpoint.load(path, parts.model, parts.optimizer, parts.scheduler, _STATE["device"])
    part.agree()
    _STATE["progress"] = {"epochs_done": saved.progress.epochs_done,
                          "batches_done": saved.progress.start_batch(dist.size(), _STATE["steps"]),
                          "optimizer_steps": saved.optimizer_steps}
    return {"rank": dist.rank(), "epochs_done": saved.progress.epochs_done, "weights": weights_digest(),
            "iterations": saved.optimizer_steps, "saved_world_size": saved.progress.world_size}


def leave() -> None:
    if "progress" in _STATE:
        dist.shutdown()
    _STATE.clear()
