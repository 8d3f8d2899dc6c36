"""The user's model on a rank (runs on the ranks): what ``model_fn`` returned (a module; or the module with its
optimizer and scheduler), the loss and the metrics, checked with errors that say what to give instead."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

#: Loss functions that may be named by a string (``torch.nn.functional``'s); any callable ``(output, target)`` too.
LOSS_NAMES = ("cross_entropy", "nll_loss", "mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss",
              "binary_cross_entropy", "binary_cross_entropy_with_logits", "kl_div")


@dataclass
class ModelParts:
    """The module (not yet wrapped for the world), its optimizer and scheduler (or None), the loss, and the
    metrics by name, each ``(output, target) -> number``."""

    model: Any
    optimizer: Any
    scheduler: Any
    loss: Callable
    metrics: dict[str, Callable] = field(default_factory=dict)
    #: Whether the optimizer is the user's own (``set_lr`` then is theirs to call), not the short form's SGD.
    user_optimizer: bool = True


def accuracy(output, target):
    """The fraction of samples whose largest output is the target class."""
    return (output.argmax(dim=-1) == target).float().mean()


def loss_of(loss) -> Callable:
    import torch.nn.functional as F

    if isinstance(loss, str):
        if loss not in LOSS_NAMES:
            raise ValueError(f"unknown loss {loss!r}: name one of {', '.join(LOSS_NAMES)}, or give a callable "
                             "(output, target), e.g. torch.nn.CrossEntropyLoss()")
        return getattr(F, loss)
    if not callable(loss):
        raise ValueError(f"loss must be a callable (output, target) or a name, not {type(loss).__name__}")
    return loss


def metrics_of(metrics) -> dict[str, Callable]:
    """``metrics``: names ("accuracy"), callables (named by their ``__name__``), ``(name, callable)`` pairs, or a
    dict of name to callable."""
    if isinstance(metrics, dict):
        items = list(metrics.items())
    else:
        items = []
        for m in metrics:
            if isinstance(m, tuple) and len(m) == 2 and isinstance(m[0], str):
                items.append(m)
            elif m in ("accuracy", "acc"):
                items.append(("accuracy", accuracy))
            elif callable(m):
                items.append((getattr(m, "__name__", type(m).__name__), m))
            else:
                raise ValueError(f"unknown metric {m!r}: give 'accuracy', a callable (output, target), or a dict "
                                 "of name to callable")
    bad = [name for name, fn in items if not callable(fn) or name in ("loss",) or name.startswith("val_")]
    if bad:
        raise ValueError(f"metric names must be new names of callables (not 'loss' or 'val_…'): {bad}")
    return dict(items)


def model_parts(made, compile_spec, device=None) -> ModelParts:
    """``made`` (what ``model_fn`` returned) and the session's short form (``loss``, ``metrics``, ``lr``), the
    module moved to ``device`` (in place: a user's optimizer keeps its parameters) before the session's SGD."""
    import torch

    optimizer = scheduler = None
    if isinstance(made, torch.nn.Module):
        model = made
    elif isinstance(made, dict):
        unknown = set(made) - {"model", "optimizer", "scheduler"}
        if unknown or "model" not in made:
            raise ValueError("model_fn's dict must have 'model' (and may have 'optimizer', 'scheduler'); it has "
                             f"{sorted(made)}")
        model, optimizer, scheduler = made["model"], made.get("optimizer"), made.get("scheduler")
    elif isinstance(made, (tuple, list)) and len(made) in (2, 3):
        model, optimizer, scheduler = (*made, None)[:3]
    else:
        raise ValueError("model_fn must return a torch.nn.Module, (module, optimizer), (module, optimizer, "
                         f"scheduler) or a dict of them, not {type(made).__name__}")
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"model_fn's model must be a torch.nn.Module, not {type(model).__name__}")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError(f"model_fn's optimizer must be a torch.optim.Optimizer, not {type(optimizer).__name__}")
    if compile_spec is None:
        raise ValueError("give the loss to setup(): loss=torch.nn.CrossEntropyLoss() (or another callable "
                         "(output, target), or a name such as 'cross_entropy'); metrics=['accuracy'] adds accuracy")
    user_optimizer = optimizer is not None
    if device is not None:
        model.to(device)
    if optimizer is None:
        optimizer = torch.optim.SGD(model.parameters(), lr=compile_spec.lr)
    return ModelParts(model, optimizer, scheduler, loss_of(compile_spec.loss), metrics_of(compile_spec.metrics),
                      user_optimizer)


def scale_learning_rate(parts: ModelParts, factor: float) -> None:
    """Multiply the optimizer's learning rates (and the scheduler's base rates) by ``factor``."""
    for group in parts.optimizer.param_groups:
        group["lr"] *= factor
        if "initial_lr" in group:
            group["initial_lr"] *= factor
    if parts.scheduler is not None and hasattr(parts.scheduler, "base_lrs"):
        parts.scheduler.base_lrs = [lr * factor for lr in parts.scheduler.base_lrs]


def current_lr(optimizer) -> float | None:
    groups = optimizer.param_groups
    return float(groups[0]["lr"]) if groups else None
