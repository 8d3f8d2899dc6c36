"""Training on a session's ranks (runs in the kernel): the model every rank built, fits that stream their metrics
into one table, and the wait on the ranks' work (a fit, a script) that watches for dead and stalled ranks, an
unanswered Stop and the walltime. A fit whose ranks end with different weights raises :class:`.WorldDiverged`."""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Callable

from .checkpoints import Checkpoints
from .metrics import MetricsTable, rank_rows, straggler_ranks
from .rankworld import RankWorld
from .reporting import Reporter
from .results import FitResult, RankError, WorldDiverged
from .spec import TrainingSpec
from .walltime import WalltimeWatch
from .watchdog import local_process_states, stall_message


@dataclass(frozen=True)
class CallSettings:
    """A session's limits as they are when a call starts (they may change between calls)."""

    call_timeout: float
    stall_timeout: float
    stop_grace: float
    walltime_margin: float
    checkpoint_dir: str
    time_left: Callable[[], float | None]


@dataclass
class ModelState:
    """The model the ranks built: its spec, what each rank said of it, the whole epochs it has trained (kept
    through checkpoints)."""

    spec: TrainingSpec | None = None
    built: list[dict] = field(default_factory=list)
    epochs_done: int = 0


@dataclass
class Drive:
    """How a wait on the ranks ended: the walltime's reason to stop, if it stopped the ranks."""

    walltime_stop: str | None = None


class Fitting:
    """The model on ``ranks``, its fits and their metrics (:attr:`metrics_table`), and Stop (through
    ``stop_file``, which every rank looks for)."""

    def __init__(self, ranks: RankWorld, model: ModelState, reporter: Reporter, checkpoints: Checkpoints,
                 stop_file: str):
        self.ranks, self.model, self.reporter, self.checkpoints = ranks, model, reporter, checkpoints
        self.stop_file = stop_file
        self.stop_asked: float | None = None
        self.metrics_table = MetricsTable()

    def build(self, spec: TrainingSpec) -> list[dict]:
        """Build ``spec``'s model on every rank, untrained; each rank's description of it. (Which spec the
        session's model has is the session's to say: a scaling experiment builds others.)"""
        built = self.ranks.call(self.ranks.backend.build, spec)
        self.model.built, self.model.epochs_done = built, 0
        return built

    def shard_sizes(self) -> dict[int, int | None]:
        return {r["rank"]: r["samples"] for r in self.ranks.call(self.ranks.backend.shard_size)}

    def weights_digest(self) -> str:
        digests = self.ranks.call(self.ranks.backend.weights_digest)
        if len(set(digests)) != 1:
            raise WorldDiverged(f"ranks hold different weights: {digests}")
        return digests[0]

    def set_lr(self, lr: float) -> list[float]:
        return self.ranks.call(self.ranks.backend.set_lr, lr)

    def fit(self, epochs: int, publish_every: int, on_metrics, poll: float, stop_check_every: int,
            publish_interval: float, settings: CallSettings) -> FitResult:
        self.clear_stop()
        t0 = time.perf_counter()
        self.reporter.report("training")
        ar = self.ranks.view.apply_async(self.ranks.backend.fit, epochs, self.stop_file, publish_every, stop_check_every,
                                         publish_interval)
        drive = self.drive(ar, "fit", on_metrics, poll, stop_check_every, settings)
        results = self.ranks.results(ar, "fit")
        digests = {r["rank"]: r["weights"] for r in results}
        if len(set(digests.values())) != 1:
            self.reporter.report("failed")
            raise WorldDiverged(f"ranks hold different weights after training ({digests}): gradients were not averaged")
        self.model.epochs_done = results[0]["epochs_done"]
        stopped = results[0]["stopped"]
        if stopped and drive.walltime_stop:
            stopped = self.checkpoints.for_walltime(drive.walltime_stop, settings.checkpoint_dir,
                                                    settings.walltime_margin)
        else:
            self.reporter.report("stopped" if stopped else "idle")
        return FitResult(results[0]["epochs_done"], {r["rank"]: r["history"] for r in results},
                         stopped, results[0]["weights"], time.perf_counter() - t0,
                         [r["rank"] for r in results])

    def clear_stop(self) -> None:
        if os.path.exists(self.stop_file):
            os.unlink(self.stop_file)
        self.stop_asked = None

    def stop_training(self) -> None:
        """Ask every rank to stop after the current batch."""
        open(self.stop_file, "w").close()
        self.stop_asked = time.monotonic()

    def drive(self, ar, what: str, on_metrics, poll: float, stop_check_every: int, settings: CallSettings,
              first_progress_timeout: float | None = None, on_output: Callable | None = None) -> Drive:
        """Wait for ``ar`` while collecting metrics, watching for dead and stalled ranks, an unanswered Stop and the
        walltime. Before the first batch the ranks have ``first_progress_timeout`` (default ``stall_timeout``)."""
        walltime = WalltimeWatch(settings.time_left, settings.walltime_margin)
        drive = Drive()
        progress = measured = time.monotonic()
        started = False
        step = 0.0  # the slowest rank's typical step time: slow steps stretch the deadlines below
        while not ar.ready():
            moved = self.collect(ar, on_metrics)
            if on_output is not None and on_output(ar):
                moved = True
            if moved:
                started, progress = True, time.monotonic()
                if progress - measured > 2.0:
                    measured, step = progress, max(self.typical_step_times().values(), default=0.0)
            self.ranks.raise_if_dead(what)  # the others wait in a collective that will never complete
            self.ranks.raise_if_failed(ar, what)  # likewise
            now = time.monotonic()
            grace = max(settings.stop_grace, 2 * stop_check_every * step)  # the ranks look every stop_check_every
            if self.stop_asked is not None and now - self.stop_asked > grace and not ar.ready():
                self.end_stalled("Stop", now - self.stop_asked, f"stop_grace, {grace:.0f} s at this step time")
            stall = max(settings.stall_timeout, 3 * step)
            if not started and first_progress_timeout is not None:
                stall = first_progress_timeout
            if now - progress > stall and not ar.ready():
                self.end_stalled(what, now - progress, f"stall_timeout, {stall:.0f} s at this step time")
            if drive.walltime_stop is None and walltime.due():
                drive.walltime_stop = f"the scheduler says {walltime.left:.0f} s of walltime are left"
                self.stop_training()
            self.reporter.report("training", every=2.0)
            time.sleep(poll)
        self.collect(ar, on_metrics)
        if on_output is not None:
            on_output(ar)
        return drive

    def collect(self, ar, on_metrics) -> bool:
        """Take the ranks' newly published metrics; return whether there were any."""
        data = ar.data if isinstance(ar.data, list) else [ar.data]
        added = self.metrics_table.add(d for d in data if d)
        if added and on_metrics is not None:
            on_metrics(self.metrics_table)
        return bool(added)

    def end_stalled(self, what: str, seconds: float, setting: str) -> None:
        message = stall_message(what, seconds, setting, self.ranks.world, self.metrics_table.latest(),
                                local_process_states(self.ranks.world))
        self.reporter.report("failed")
        self.ranks.stop(force=True)
        raise RankError(message)

    def typical_step_times(self) -> dict[int, float]:
        """Each rank of this world's median recent step time (a rank of an earlier world does not count)."""
        current = {w["rank"] for w in self.ranks.world}
        return {r: t for r, t in self.metrics_table.typical_step_times().items() if not current or r in current}

    def stragglers(self, factor: float = 1.5) -> list[int]:
        """Ranks of this world whose latest step time is more than ``factor`` × the median."""
        current = {w["rank"] for w in self.ranks.world}
        return straggler_ranks({r: t for r, t in self.metrics_table.latest_step_times().items()
                                if not current or r in current}, factor)

    def rank_table(self, state: str) -> list[dict]:
        """Each rank: node, GPU, state, straggler flag, latest loss and samples/s, the session being in ``state``."""
        rank_state = "training" if state == "training" else "idle" if self.ranks.world else state
        return rank_rows(self.ranks.world, self.metrics_table.latest(), self.stragglers(), self.ranks.dead_ranks(),
                         rank_state)
