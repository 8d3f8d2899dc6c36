"""Pure functions from a session's metrics and ranks to what the dashboard draws: per-rank series, the epoch's
progress, the rank table, and parsed user input. Tested without widgets."""
from __future__ import annotations

import html
import math
from typing import Iterable, Mapping

import pandas as pd

CHARTS = {"loss": "loss", "samples_per_s": "samples/s", "step_time_s": "step time (s)"}
GPU_CHARTS = {"gpu_memory_mb": "GPU memory (MB)", "gpu_util_pct": "GPU utilisation (%)"}  # when the ranks have GPUs


def batches_per_epoch(samples: int, batch_size: int) -> int:
    return max(1, math.ceil(samples / batch_size))


def rank_series(frame: pd.DataFrame, column: str, per_epoch: int, limit: int = 2000) -> dict[int, tuple[list, list]]:
    """For each rank, (step, value) of ``column``, where step counts batches since the first epoch; at most the last
    ``limit`` points of each rank."""
    series = {}
    if frame.empty:
        return series
    rows = frame.dropna(subset=[column, "epoch", "batch"])
    for rank, part in rows.groupby("rank", sort=True):
        steps = ((part["epoch"] - 1) * per_epoch + part["batch"]).astype(float).tolist()[-limit:]
        series[int(rank)] = (steps, part[column].astype(float).tolist()[-limit:])
    return series


#: Above this many ranks a chart shows the spread over the ranks (their minimum, median and maximum at each step)
#: instead of a line per rank: three lines whatever the world's size, so the dashboard stays responsive.
MAX_RANK_LINES = 16


def chart_series(frame: pd.DataFrame, column: str, per_epoch: int, limit: int = 2000,
                 max_lines: int = MAX_RANK_LINES) -> dict[str, tuple[list, list]]:
    """The lines of one chart, by label: "rank N" for each rank, or above ``max_lines`` ranks "min", "median" and
    "max" over the ranks at each step (at most the last ``limit`` steps)."""
    if frame.empty or frame["rank"].nunique() <= max_lines:
        return {f"rank {r}": line for r, line in rank_series(frame, column, per_epoch, limit).items()}
    rows = frame.dropna(subset=[column, "epoch", "batch"])
    steps = ((rows["epoch"] - 1) * per_epoch + rows["batch"]).astype(float)
    spread = rows[column].astype(float).groupby(steps).agg(["min", "median", "max"]).tail(limit)
    n = frame["rank"].nunique()
    return {f"{how} of {n} ranks": (spread.index.tolist(), spread[how].tolist()) for how in ("min", "median", "max")}


def epoch_progress(latest: Mapping[int, Mapping], per_epoch: int, first_epoch: int, epochs: int) -> tuple[int, int, str]:
    """(done, total, label) of the running fit, from the slowest rank's latest record: batches done of
    ``epochs * per_epoch``, and "epoch e/E"."""
    total = max(1, epochs * per_epoch)
    records = [r for r in latest.values() if r.get("epoch") is not None and r["epoch"] >= first_epoch]
    if not records:
        return 0, total, f"epoch 0/{epochs}"
    slowest = min(records, key=lambda r: (r["epoch"], r["batch"]))
    current = slowest["epoch"] - first_epoch
    done = min(total, current * per_epoch + slowest["batch"] + 1)
    return done, total, f"epoch {min(current + 1, epochs)}/{epochs}"


def _cell(value) -> str:
    if value is None or isinstance(value, float) and math.isnan(value):
        return "–"
    if isinstance(value, float):
        return f"{value:.4g}"
    return html.escape(str(value))


def rank_table_html(rows: Iterable[Mapping]) -> str:
    """The rank table as HTML (every value escaped); a straggler's row is marked."""
    names = ("rank", "node", "GPU", "container", "state", "straggler", "loss", "samples/s")
    head = "".join(f"<th>{h}</th>" for h in names)
    body = []
    for r in rows:
        mark = ' class="hpcdl-straggler"' if r.get("straggler") else ""
        cells = [r["rank"], r.get("node"), r.get("gpu"), r.get("container"), r.get("state"),
                 "yes" if r.get("straggler") else "", r.get("loss"), r.get("samples_per_s")]
        body.append(f'<tr data-rank="{int(r["rank"])}"{mark}>' + "".join(f"<td>{_cell(c)}</td>" for c in cells)
                    + "</tr>")
    if not body:
        body.append(f'<tr><td colspan="{len(names)}">no ranks yet: press Train</td></tr>')
    return f'<table class="hpcdl-rank-table"><thead><tr>{head}</tr></thead><tbody>{"".join(body)}</tbody></table>'


def parse_rank_counts(text: str, most: int) -> list[int]:
    """"1, 2, 4" -> [1, 2, 4]; a clear error for anything else."""
    parts = [p.strip() for p in text.replace(";", ",").split(",") if p.strip()]
    if not parts:
        raise ValueError("give the rank counts to try, e.g. 1, 2, 4")
    counts = []
    for p in parts:
        if not p.isdigit() or not 1 <= int(p) <= most:
            raise ValueError(f"{p!r} is not a rank count from 1 to {most}")
        counts.append(int(p))
    if len(set(counts)) != len(counts):
        raise ValueError("each rank count once, please")
    return sorted(counts)


def error_html(message: str) -> str:
    return f'<div class="hpcdl-error" style="color:var(--jp-error-color1,#c00)">{html.escape(message)}</div>'
