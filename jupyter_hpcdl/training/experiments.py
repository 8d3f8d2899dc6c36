"""Scaling experiments (runs in the kernel): the same training on each rank count, throughput, speedup against
the smallest count and efficiency against ideal scaling, as a table, a CSV and a plot."""
from __future__ import annotations

import os
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from .session import TrainingSession
    from .spec import TrainingSpec

MODES = ("strong", "weak")

#: ``new_world(ranks, spec)``: end the session's world and build its model (or ``spec``'s) untrained in a new one of
#: ``ranks`` ranks; the session's own spec stays as it was.
NewWorld = Callable[[int, "TrainingSpec | None"], None]


def weak_data(data, base: int, backend: str):
    """Weak scaling: every rank gets as much data as a rank had at ``base`` ranks (the base world's shards repeat
    as needed), whatever form the data has, sharded by the training backend named ``backend``."""

    def shard(rank: int, size: int):
        from ..backends import load_backend

        part = load_backend(backend).load_shard(data, rank % base, base)
        return part.dataset if part.dataset is not None else (part.x, part.y)

    return shard


def scaling_table(rows: list[dict], base: int, mode: str):
    """Throughput per rank count → the table with speedup, ideal and efficiency (pure)."""
    import pandas as pd

    if not rows or base not in [r["ranks"] for r in rows]:
        raise RuntimeError("scaling stopped before the smallest rank count was measured: no figures")
    table = pd.DataFrame(rows)
    first = table.loc[table["ranks"] == base, "throughput"].iloc[0]
    table["speedup"] = table["throughput"] / first
    table["ideal"] = table["ranks"] / base
    table["efficiency"] = table["speedup"] / table["ideal"]
    table["mode"] = mode
    return table


def run_scaling(session: "TrainingSession", new_world: NewWorld, ranks: list[int], epochs: int = 1,
                mode: str = "strong", csv: str | None = None, plot: str | None = None, on_step=None, on_metrics=None,
                restore: bool = True):
    """See :meth:`TrainingSession.scaling`; each rank count's world comes from ``new_world``."""
    if mode not in MODES:
        raise ValueError("mode must be 'strong' or 'weak'")
    if not session.has_model:
        raise RuntimeError("no model yet: call setup() first")
    spec, ranks_before = session.spec, session.ranks
    keep = session.checkpoint(os.path.join(session.private_dir, "before-scaling"))  # each count: a fresh model
    base = min(ranks)
    rows = []
    try:
        for n in ranks:
            new_world(n, spec if mode == "strong" else spec.with_data(weak_data(spec.data, base, session.backend.name)))
            session.fit(epochs=1, on_metrics=on_metrics)  # warm-up: tracing and first-epoch costs stay out
            result = session.fit(epochs=epochs, on_metrics=on_metrics)
            if result.stopped:  # a partial fit measures nothing: the counts done so far stand
                break
            sizes = list(session.shard_sizes().values())  # samples per rank (None for a Dataset: its batches)
            per_epoch = sum(sizes) if None not in sizes else session.batches_per_epoch * spec.batch_size * n
            samples = per_epoch * epochs
            rows.append({"ranks": n, "seconds": result.seconds, "throughput": samples / result.seconds})
            if on_step is not None:
                on_step(rows[-1])
    finally:
        if restore:  # the model as it was, with its data, on as many ranks as before
            new_world(ranks_before, spec)
            session.resume(keep)
    table = scaling_table(rows, base, mode)
    if csv:
        table.to_csv(csv, index=False)
    if plot:
        plot_scaling(table, plot)
    return table


def plot_scaling(table, path: str) -> None:
    """Speedup against the ideal line, and efficiency, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3.5))
    ax1.plot(table["ranks"], table["speedup"], "o-", label="measured")
    ax1.plot(table["ranks"], table["ideal"], "--", color="grey", label="ideal")
    ax1.set_xlabel("ranks")
    ax1.set_ylabel("speedup")
    ax1.legend()
    ax2.plot(table["ranks"], table["efficiency"], "o-")
    ax2.axhline(1.0, ls="--", color="grey")
    ax2.set_ylim(0, 1.1)
    ax2.set_xlabel("ranks")
    ax2.set_ylabel("efficiency")
    fig.suptitle(f"{table['mode'].iloc[0]} scaling")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
