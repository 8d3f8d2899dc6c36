"""Per-rank training metrics as they stream in, kept as a table, and the straggler check (pure functions)."""
from __future__ import annotations

import statistics
import time
from collections import deque
from typing import Iterable, Iterator, Mapping

import pandas as pd

COLUMNS = ("rank", "epoch", "batch", "loss", "samples_per_s", "step_time_s", "memory_mb", "gpu_memory_mb",
           "gpu_util_pct", "gpu_used_mb", "time", "arrived")


def straggler_ranks(step_times: Mapping[int, float], factor: float = 1.5) -> list[int]:
    """Ranks whose recent step time is more than ``factor`` times the median of all ranks."""
    if len(step_times) < 2:
        return []
    median = statistics.median(step_times.values())
    return sorted(r for r, t in step_times.items() if median > 0 and t > factor * median)


def _unpacked(records: Iterable[Mapping], seen: Mapping) -> Iterator[Mapping]:
    """The records of each publication that may be new. A rank's publication repeats its last few records, in
    order of their consecutive ``seq``: of one whose last record was seen nothing is read, of the others only the
    tail after what was seen (so the kernel's cost follows the new records, not the ranks times the repeats)."""
    for rec in records:
        if not rec or "records" not in rec:
            yield rec
            continue
        batch = rec["records"]
        last = batch[-1] if batch else None
        if last is None or "seq" not in last:
            yield from batch
            continue
        known = seen.get(last.get("origin"), -1)
        if last["seq"] <= known:
            continue
        yield from batch[max(0, len(batch) - (last["seq"] - known)):]


class MetricsTable:
    """Records from every rank, in arrival order; ``frame()`` gives the batch records as a pandas DataFrame (the
    model's own metrics as extra columns), ``epoch_frame()`` each rank's averaged epoch metrics."""

    #: How many of a rank's latest step times ``typical_step_times`` looks at.
    RECENT = 8

    def __init__(self):
        self._rows: list[dict] = []
        self._epochs: list[dict] = []
        self._extra: dict[str, None] = {}  # the model's metric names, in the order first seen
        self._seen: dict = {}  # origin -> last seq, or (kind, rank) -> last key
        self._latest: dict[int, dict] = {}  # each rank's latest batch record
        self._recent: dict[int, deque] = {}  # each rank's last RECENT step times
        self._frame: pd.DataFrame | None = None  # frame() so far: the rows after it are appended to it

    def add(self, records: Iterable[Mapping]) -> int:
        """Add records not seen before (a rank's latest record may be read several times); return how many."""
        added = 0
        for rec in _unpacked(records, self._seen):
            if not rec or "rank" not in rec:
                continue
            kind = rec.get("kind", "batch")
            if "seq" in rec:  # a rank's publications repeat its last few records: keep each once
                if rec["seq"] <= self._seen.get(rec.get("origin"), -1):
                    continue
                self._seen[rec.get("origin")] = rec["seq"]
            else:
                key = (rec.get("epoch"), rec.get("batch"), rec.get("time"))
                if self._seen.get((kind, rec["rank"])) == key:
                    continue
                self._seen[(kind, rec["rank"])] = key
            extra = {k: v for k, v in (rec.get("metrics") or {}).items() if k not in COLUMNS}
            if kind == "epoch":
                self._epochs.append({"rank": rec["rank"], "epoch": rec.get("epoch"), "loss": rec.get("loss"), **extra})
                added += 1
                continue
            self._extra.update(dict.fromkeys(extra))
            row = {**{c: rec.get(c) for c in COLUMNS}, **extra, "arrived": time.time()}
            self._rows.append(row)
            self._latest[row["rank"]] = row
            if row["step_time_s"] is not None:
                self._recent.setdefault(row["rank"], deque(maxlen=self.RECENT)).append(row["step_time_s"])
            added += 1
        return added

    def frame(self) -> pd.DataFrame:
        """The batch records so far (a new frame each call; built once, then only the new rows are added)."""
        columns = [*COLUMNS, *self._extra]
        done = self._frame
        if done is None or list(done.columns) != columns or len(done) > len(self._rows):
            done = pd.DataFrame(self._rows, columns=columns)
        elif len(done) < len(self._rows):
            new = pd.DataFrame(self._rows[len(done):], columns=columns)
            done = pd.concat([done, new], ignore_index=True) if len(done) else new
        self._frame = done
        return done.copy(deep=False)

    def epoch_frame(self) -> pd.DataFrame:
        names = list(dict.fromkeys(k for row in self._epochs for k in row))
        return pd.DataFrame(self._epochs, columns=names or ["rank", "epoch", "loss"])

    def latest(self) -> dict[int, dict]:
        """Each rank's most recent record."""
        return dict(self._latest)

    def latest_step_times(self) -> dict[int, float]:
        """Each rank's most recent step time (of its latest record)."""
        return {r: row["step_time_s"] for r, row in self._latest.items() if row["step_time_s"] is not None}

    def typical_step_times(self) -> dict[int, float]:
        """Each rank's median step time over its last ``RECENT`` records: one slow step (the first batch's tracing,
        a checkpoint, a loaded machine's pause) does not make it."""
        return {r: statistics.median(times) for r, times in self._recent.items() if times}


def rank_rows(world: Iterable[Mapping], latest: Mapping[int, Mapping], stragglers: Iterable[int] = (),
              dead: Iterable[int] = (), state: str = "idle") -> list[dict]:
    """One row per rank for a rank table (the dashboard's, the JupyterLab panel's): where it runs, its GPU, the
    container mode it runs in, its state, whether it straggles, and its latest loss and throughput."""
    stragglers, dead = set(stragglers), set(dead)
    rows = []
    for w in sorted(world, key=lambda w: w["rank"]):
        r = w["rank"]
        last = latest.get(r, {})
        gpu = w.get("cuda_visible_devices") if w.get("gpus") or w.get("cuda_visible_devices") else None
        rows.append({"rank": r, "node": w.get("node") or w.get("host"), "gpu": gpu,
                     "container": w.get("container_mode"),
                     "state": "dead" if r in dead else state, "straggler": r in stragglers,
                     "loss": last.get("loss"), "samples_per_s": last.get("samples_per_s"),
                     "epoch": last.get("epoch")})
    return rows
