"""TrainingSession: Horovod ranks as ipyparallel engines, driven from the notebook.

    session = TrainingSession(ranks=2)              # local engines (laptops, binder, workshops)
    session.start()
    session.setup(model_fn, data, validation_data=val, callbacks=[...])   # the user's compiled Keras model
    session.fit(epochs=3)                           # and again: training goes on where it stopped
    session.metrics                                 # per-rank metrics as they streamed in (pandas)
    session.checkpoint("~/ckpt/run1"); session.resume("~/ckpt/run1")     # optimizer state included
    session.run(fn, *args); session.run_script("train.py", ["--epochs", "3"])
    session.close()

Where the engines run is :mod:`.placement`, how they join one world :mod:`.joining`, what each rank does
:mod:`jupyter_hpcdl.backends`, scaling experiments :mod:`.experiments`. The session owns the Gloo rendezvous
for its whole life. Each fit ends with a check that all ranks hold identical weights: a world that silently
stopped averaging is an error, never a result."""
from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
import uuid
import warnings
from dataclasses import dataclass, field, replace
from typing import Callable, Sequence

import ipyparallel as ipp

from ..containers.kernelspec import kernel_image
from ..job.owner import request
from ..job.newjob import NewAllocation, rank_job
from ..backends import load_backend
from .experiments import run_scaling
from .joining import check_one_world, gloo_envs, mpi_envs
from .metrics import MetricsTable, rank_rows, straggler_ranks
from .placement import (LOCAL_RANKS, PLACES, Placement, PlacementOptions, container_engine_cmd,
                        default_ranks, owner_socket, placement_for, resolve)
from .reaper import start_reaper, stop_reaper
from .spec import TrainingSpec, check_batch_size, make_spec
from .walltime import DEFAULT_MARGIN, WalltimeWatch
from .watchdog import kill_local_engines, local_process_states, stall_message

rank_side = load_backend()  # what runs on the ranks: the training backend's functions, shipped by reference

__all__ = ["FitResult", "RankError", "ScriptResult", "TrainingSession", "WorldDiverged", "check_one_world",
           "container_engine_cmd"]


class RankError(RuntimeError):
    """One or more ranks raised; the message names each rank and its error."""

    engine_died = False


class WorldDiverged(RuntimeError):
    """The ranks' weights differ after training: gradients were not averaged."""


@dataclass
class FitResult:
    epochs_done: int
    history: dict[int, dict[str, list[float]]]
    stopped: str | None
    weights: str
    seconds: float
    ranks: list[int] = field(default_factory=list)

    @property
    def loss(self) -> list[float]:
        return self.history[0].get("loss", [])


@dataclass
class ScriptResult:
    """A script's run on every rank: each rank's exit code and output, whether Stop or the walltime ended it."""

    exit_codes: dict[int, int]
    stdout: dict[int, str]
    stderr: dict[int, str]
    stopped: str | None
    seconds: float

    @property
    def ok(self) -> bool:
        return all(code == 0 for code in self.exit_codes.values())


class ScriptFailed(RankError):
    """A script exited with a non-zero code on some rank; ``result`` holds every rank's code and output."""

    def __init__(self, message: str, result: ScriptResult):
        super().__init__(message)
        self.result = result


@dataclass
class _Drive:
    """How a wait on the ranks ended: the walltime's reason to stop, if it stopped the ranks."""

    walltime_stop: str | None = None


class TrainingSession:
    def __init__(self, ranks: int | None = None, iface: str | None = None, tf_threads: int = 1, env: dict | None = None,
                 engine_cmd: list[str] | None = None, start_timeout: float = 120, where: str = "auto",
                 image: str | None = None, controller_ip: str | None = None, containers: bool = False,
                 new_allocation: NewAllocation | None = None, world: str = "gloo", stall_timeout: float = 60,
                 call_timeout: float = 600, stop_grace: float = 30, walltime_margin: float = DEFAULT_MARGIN,
                 checkpoint_dir: str = "~/.jupyter-hpcdl/checkpoints"):
        """``ranks``: how many; by default one per task slot of the job this kernel runs in (one per GPU where the
        job has GPUs: what the server's form asked for), and two elsewhere (``where="local"`` or "new").
        ``where``: "local" (engines on this machine), "allocation" (one engine per rank across the nodes of the
        batch job this kernel runs in, each in the user's container for ``image``: by default the image this kernel
        runs in), "new" (a new batch job for the
        ranks, as ``new_allocation`` asks, submitted from here: needs the scheduler's client), or "auto" (the
        allocation when the job's owner is reachable, else local). ``world``: the ranks join over "gloo" (a
        rendezvous the session owns; needs nothing from the site) or "mpi" (engines started by mpiexec locally, or
        by srun with the PMIx plugin; Horovod built with MPI).

        Nothing waits forever: ``start_timeout`` bounds the start (the queue included), ``call_timeout`` every other
        call to the ranks, ``stall_timeout`` a fit in which no rank finishes a batch (a stopped, hung or stuck
        rank; a rank whose engine misses the controller's heartbeats for about 30 s counts as gone sooner), and
        ``stop_grace`` how long Stop waits for the ranks to agree. Past any of them the world is ended and the
        error names the ranks and what they were doing.

        In a batch job (the ranks' own with ``where="new"``, the kernel's with "allocation"), a fit stops
        ``walltime_margin`` seconds before the walltime ends (the scheduler's time left), checkpoints into
        ``checkpoint_dir`` and says so;
        :meth:`continue_in_new_allocation` then goes on in a new job from that checkpoint."""
        if where not in ("auto", *PLACES):
            raise ValueError("where must be 'auto', 'local', 'allocation' or 'new'")
        if world not in ("gloo", "mpi"):
            raise ValueError("world must be 'gloo' (the session's own rendezvous) or 'mpi' (the site's MPI)")
        self.world_kind = world
        self.new_allocation = new_allocation or NewAllocation()
        if ranks is not None and (not isinstance(ranks, int) or isinstance(ranks, bool) or ranks < 1):
            raise ValueError(f"ranks must be a whole number of at least 1, not {ranks!r} (or leave it out: one rank "
                             "per slot of the job)")
        if where == "new":
            rank_job(self.new_allocation, ranks or LOCAL_RANKS, "check", "/check")  # bad values fail here, not at start
        self.ranks = ranks
        self.where = where
        self.image = image = image or kernel_image()
        self.controller_ip = controller_ip
        self.iface = iface
        self.env = {"TF_CPP_MIN_LOG_LEVEL": "2", "HPCDL_TF_THREADS": str(tf_threads), **(env or {})}
        self.engine_cmd = engine_cmd or (container_engine_cmd(image, world == "mpi") if containers else None)
        self.start_timeout = start_timeout
        self.stall_timeout, self.call_timeout, self.stop_grace = stall_timeout, call_timeout, stop_grace
        self._reaper = None
        self._stop_asked: float | None = None
        self.walltime_margin = walltime_margin
        self.checkpoint_dir = os.path.expanduser(checkpoint_dir)
        self.walltime_checkpoint: str | None = None
        self.metrics_table = MetricsTable()
        self.world: list[dict] = []
        self._placement: Placement | None = None
        self._client = self._rendezvous = None
        self._engine_of: dict[int, int] = {}
        self._dir = tempfile.mkdtemp(prefix="hpcdl-session-", dir=os.path.expanduser("~"))
        self.stop_file = os.path.join(self._dir, "stop")
        self.state = "none"
        self.id = uuid.uuid4().hex
        self.spec: TrainingSpec | None = None
        self.built: list[dict] = []
        self.epochs_done = 0  # whole epochs the model has trained (kept through checkpoints)
        self._reported_at = 0.0

    # -- lifecycle ---------------------------------------------------------------------------------------------------
    @property
    def owner_socket(self) -> str | None:
        return owner_socket()

    @property
    def private_dir(self) -> str:
        """The session's own directory (mode 0700): the stop file, the ranks' batch script, rescale checkpoints."""
        return self._dir

    @property
    def _cluster(self) -> ipp.Cluster | None:
        return self._placement.cluster if self._placement is not None else None

    def start(self) -> list[dict]:
        """Start the engines and join them into one Horovod world (Gloo, or MPI); return each rank's description."""
        self.mode = resolve(self.where)
        if self.ranks is None:
            self.ranks = default_ranks(self.mode)
        os.makedirs(self._dir, mode=0o700, exist_ok=True)  # again after close()
        self._report("starting")
        self._placement = placement_for(self.mode, PlacementOptions(
            self.ranks, self.start_timeout, self._dir, self.image, self.controller_ip, self.engine_cmd,
            self.world_kind == "mpi", self.new_allocation))
        try:
            engines = self._placement.start(self._watch, self._get)
            self._client = self._placement.client
            if self.world_kind == "gloo":
                # joining has the start's deadline, not Gloo's own 30 s (imports on a loaded node take longer)
                self._rendezvous, envs = gloo_envs(engines, self.ranks, self.iface, self.start_timeout)
            else:
                envs = mpi_envs(engines)
            # every engine joins at once (hvd.init waits for all ranks)
            results = [self._client[e].apply_async(rank_side.join, {**self.env, **env})
                       for e, env in zip(engines.ids, envs)]
            self.world = [self._get(r, f"joining the world (engine {e})", self.start_timeout)
                          for e, r in zip(engines.ids, results)]
            check_one_world(self.world, len(engines.ids))
        except BaseException:
            self._report("failed")
            try:
                self._stop_world()  # nothing left behind: no engines, no controller, no queued job
            except Exception as cleanup:  # the first error is the one to tell
                warnings.warn(f"stopping the ranks after a failed start: {cleanup}")
            raise
        self._engine_of = {w["rank"]: e for w, e in zip(self.world, engines.ids)}
        self._view = self._client[[self._engine_of[r] for r in sorted(self._engine_of)]]
        self._view.use_cloudpickle()  # the user's model and data functions travel by value
        from .magic import register_cell_magic

        register_cell_magic(self)  # %%ranks runs a cell on this session's ranks
        self._report("idle")
        return self.world

    def _watch(self) -> None:
        """A reaper that ends the ranks, the controller and a job of the ranks if this kernel dies unclosed."""
        self._reaper = start_reaper(self._placement.cluster_file,
                                    self.owner_socket if self.mode == "allocation" else None, self._dir)

    @property
    def job_id(self) -> str | None:
        """The batch job of the ranks' engines (where='new')."""
        return self._placement.job_id if self._placement is not None else None

    def close(self) -> None:
        """Leave the world, stop the engines and the rendezvous; nothing is left running. The session can start
        again (``start()`` then ``setup()``): the model is gone with the ranks."""
        try:
            self._stop_world()
        finally:
            shutil.rmtree(self._dir, ignore_errors=True)
            self.spec, self.built = None, []
            self._report("none")

    @property
    def alive(self) -> bool:
        """Whether the ranks are up and joined (no rank has died)."""
        return bool(self.world) and self._client is not None and not self.dead_ranks()

    def _stop_world(self, force: bool = False) -> None:
        """End the current world: leave Horovod, stop the engines (and ask the allocation's owner to), the
        controller (and with it a batch job of the ranks) and the rendezvous — each even if another step fails.
        ``force`` (a rank hangs): no goodbye, and this machine's engines are killed at once."""
        stopped = False
        if self._client is None and self._placement is not None:
            self._client = self._placement.client  # a start that failed half-way
        try:
            if self._client is not None:
                if force:
                    kill_local_engines(self.world)
                elif self.world:
                    try:  # a rank that hangs does not hold the end of the world: its engine is stopped below
                        self._view.apply_async(rank_side.leave).get(timeout=10)
                    except Exception:
                        pass
                    if self._placement is not None and self._placement.kind != "local":
                        self._placement.shutdown_engines()  # engines in a batch job end themselves first
                self._client.close()
        finally:
            try:
                if self._placement is not None:
                    self._placement.stop()
                stopped = True
            finally:
                try:
                    if self._rendezvous is not None:
                        self._rendezvous.stop()
                finally:
                    # last: if this kernel dies before here, the reaper ends the rest; if stopping failed, it tries
                    stop_reaper(self._reaper, reap=not stopped)
                    self._placement = self._client = self._rendezvous = self._reaper = None
                    self.world, self._engine_of = [], {}

    def __enter__(self) -> "TrainingSession":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- the user's training -----------------------------------------------------------------------------------------
    def setup(self, model_fn, data, loss=None, metrics: Sequence = (), lr: float | None = None, batch_size: int = 32,
              *, validation_data=None, callbacks=(), seed: int | None = None, scale_lr: bool = False,
              shuffle: bool = True, steps_per_epoch: int | None = None) -> list[dict]:
        """Build the model on every rank with its data.

        ``model_fn()`` builds the model on each rank. Compile it there yourself — any optimizer (with its
        learning-rate schedule), loss and metrics — and the session wraps your optimizer so that it averages
        gradients over the ranks. Or give ``loss`` (and ``lr``, ``metrics``): the short form, compiled by the
        session with SGD. ``scale_lr=True`` multiplies your learning rate (or schedule) by the number of ranks, as
        Horovod advises for a batch that grows with them; by default it is left as you set it.

        ``data`` and ``validation_data``: ``(x, y)`` arrays (each rank takes every size-th sample), a function
        ``(rank, size)`` returning this rank's ``(x, y)`` or a batched ``tf.data.Dataset``, or a path to a
        ``.npz`` file with arrays ``x`` and ``y`` on the shared file system. Validation metrics are averaged over the
        ranks (``val_loss`` …, the same on every rank). ``callbacks``: your Keras callbacks, or a function ``(rank,
        size)`` that returns them (e.g. a ModelCheckpoint on rank 0 only); they see averaged epoch metrics.
        ``seed``: the seed of the weights' initialisation and the data order (default: a random one, kept in
        :attr:`seed` and in checkpoints). ``steps_per_epoch``: for a Dataset that repeats forever."""
        spec = make_spec(model_fn, data, loss, metrics, lr, batch_size, validation_data, callbacks, seed, scale_lr,
                         shuffle, steps_per_epoch)
        built = self._all(rank_side.build, spec)
        self.spec, self.built, self.epochs_done = spec, built, 0  # only a model that every rank built counts
        return built

    @property
    def has_model(self) -> bool:
        """Whether setup() built the model (it survives a dead rank, for recover(); close() ends it)."""
        return self.spec is not None

    @property
    def batch_size(self) -> int | None:
        return self.spec.batch_size if self.spec else None

    @property
    def seed(self) -> int | None:
        return self.spec.seed if self.spec else None

    @property
    def batches_per_epoch(self) -> int | None:
        """The agreed steps of an epoch (the most any rank needs for one pass over its shard)."""
        return self.built[0]["steps_per_epoch"] if self.built else None

    def fit(self, epochs: int = 1, publish_every: int = 5, on_metrics=None, poll: float = 0.1,
            stop_check_every: int = 20, publish_interval: float = 0.1) -> FitResult:
        """Train ``epochs`` more epochs on all ranks, streaming metrics (every ``publish_every`` batches, at most
        every ``publish_interval`` seconds) into :attr:`metrics` and ``on_metrics``; the ranks look for a stop
        request every ``stop_check_every`` batches."""
        self._clear_stop()
        t0 = time.perf_counter()
        self._report("training")
        ar = self._view.apply_async(rank_side.fit, epochs, self.stop_file, publish_every, stop_check_every,
                                    publish_interval)
        drive = self._drive(ar, "fit", on_metrics, poll, stop_check_every)
        results = self._results(ar, "fit")
        digests = {r["rank"]: r["weights"] for r in results}
        if len(set(digests.values())) != 1:
            self._report("failed")
            raise WorldDiverged(f"ranks hold different weights after training ({digests}): gradients were not averaged")
        self.epochs_done = results[0]["epochs_done"]
        stopped = results[0]["stopped"]
        if stopped and drive.walltime_stop:
            stopped = self._checkpoint_for_walltime(drive.walltime_stop)
        else:
            self._report("stopped" if stopped else "idle")
        return FitResult(results[0]["epochs_done"], {r["rank"]: r["history"] for r in results},
                         stopped, results[0]["weights"], time.perf_counter() - t0,
                         [r["rank"] for r in results])

    def _clear_stop(self) -> None:
        if os.path.exists(self.stop_file):
            os.unlink(self.stop_file)
        self._stop_asked = None

    def _drive(self, ar, what: str, on_metrics, poll: float, stop_check_every: int,
               first_progress_timeout: float | None = None, on_output: Callable | None = None) -> _Drive:
        """Wait for ``ar`` while collecting metrics, watching for dead and stalled ranks, an unanswered Stop and the
        walltime. Before the first batch the ranks have ``first_progress_timeout`` (default ``stall_timeout``)."""
        walltime = WalltimeWatch(self.time_left, self.walltime_margin)
        drive = _Drive()
        progress = measured = time.monotonic()
        started = False
        step = 0.0  # the slowest rank's latest step time: slow steps stretch the deadlines below
        while not ar.ready():
            moved = self._collect(ar, on_metrics)
            if on_output is not None and on_output(ar):
                moved = True
            if moved:
                started, progress = True, time.monotonic()
                if progress - measured > 2.0:
                    measured, step = progress, max(self.metrics_table.latest_step_times().values(), default=0.0)
            self._raise_if_dead(what)  # the others wait in a collective that will never complete
            now = time.monotonic()
            grace = max(self.stop_grace, 2 * stop_check_every * step)  # the ranks look every stop_check_every batches
            if self._stop_asked is not None and now - self._stop_asked > grace and not ar.ready():
                self._end_stalled("Stop", now - self._stop_asked, f"stop_grace, {grace:.0f} s at this step time")
            stall = max(self.stall_timeout, 3 * step)
            if not started and first_progress_timeout is not None:
                stall = first_progress_timeout
            if now - progress > stall and not ar.ready():
                self._end_stalled(what, now - progress, f"stall_timeout, {stall:.0f} s at this step time")
            if drive.walltime_stop is None and walltime.due():
                drive.walltime_stop = f"the scheduler says {walltime.left:.0f} s of walltime are left"
                self.stop_training()
            self._report("training", every=2.0)
            time.sleep(poll)
        self._collect(ar, on_metrics)
        if on_output is not None:
            on_output(ar)
        return drive

    def _results(self, ar, what: str) -> list:
        try:
            return self._get(ar, what)
        except RankError as e:
            if e.engine_died:  # the survivors' errors follow from a death: report the death
                self._raise_if_dead(what, wait=5)
            self._report("failed")
            raise

    def _checkpoint_for_walltime(self, why: str) -> str:
        os.makedirs(self.checkpoint_dir, mode=0o700, exist_ok=True)
        path = self.checkpoint(os.path.join(self.checkpoint_dir, f"walltime-{self.id[:12]}-epoch{self.epochs_done}"))
        self.walltime_checkpoint = path
        message = (f"Stopped before the walltime ends ({why}; margin {self.walltime_margin:.0f} s): epoch "
                   f"{self.epochs_done} is checkpointed in {path}. Continue in a new allocation with "
                   "session.continue_in_new_allocation().")
        print(message, file=sys.stderr, flush=True)
        self._report("walltime", message=message)
        return message

    def time_left(self) -> float | None:
        """Seconds of walltime the ranks have left, as the batch system says; None without a limit or a job."""
        try:
            return self._placement.time_left() if self._placement is not None else None
        except (OSError, RuntimeError, ValueError):
            return None

    def continue_in_new_allocation(self, new_allocation: NewAllocation | None = None, checkpoint: str | None = None,
                                   ranks: int | None = None) -> list[dict]:
        """Go on in a new batch job (``where="new"``) from ``checkpoint`` (default: the one written before the
        walltime ended): the same model, its epochs, as many ranks as before unless ``ranks`` says otherwise."""
        checkpoint = checkpoint or self.walltime_checkpoint
        if not checkpoint:
            raise RuntimeError("no checkpoint to continue from: give checkpoint=PATH (or fit until the walltime "
                               "stops it, which writes one)")
        if new_allocation is not None:
            rank_job(new_allocation, ranks or self.ranks, "check", "/check")
            self.new_allocation = new_allocation
        self.where = "new"
        return self.recover(checkpoint, ranks)

    def stop_training(self) -> None:
        """Ask every rank to stop after the current batch (they agree on the same batch); if they have not within
        ``stop_grace`` seconds (a rank hangs), the running fit ends the world and says which rank held it."""
        open(self.stop_file, "w").close()
        self._stop_asked = time.monotonic()

    def _end_stalled(self, what: str, seconds: float, setting: str) -> None:
        message = stall_message(what, seconds, setting, self.world, self.metrics_table.latest(),
                                local_process_states(self.world))
        self._report("failed")
        self._stop_world(force=True)
        raise RankError(message)

    def shard_sizes(self) -> dict[int, int | None]:
        """Samples in each rank's shard (None for a Dataset)."""
        return {r["rank"]: r["samples"] for r in self._all(rank_side.shard_size)}

    def weights_digest(self) -> str:
        """A digest of the model's weights, the same on every rank (else :class:`WorldDiverged`)."""
        digests = self._all(rank_side.weights_digest)
        if len(set(digests)) != 1:
            raise WorldDiverged(f"ranks hold different weights: {digests}")
        return digests[0]

    def set_lr(self, lr: float) -> list[float]:
        return self._all(rank_side.set_lr, lr)

    # -- checkpoints, recovery, rescaling ----------------------------------------------------------------------------
    def checkpoint(self, path: str) -> str:
        """Write the model, its optimizer's state, the epochs and the data position into the directory ``path``
        (rank 0 writes; TensorFlow reads it as it is: see :mod:`jupyter_hpcdl.backends.horovod.checkpoint`); the
        directory."""
        return next(p for p in self._all(rank_side.save, os.path.expanduser(path)) if p)

    def resume(self, path: str) -> list[dict]:
        """Every rank continues from the checkpoint in ``path``: weights, optimizer state, epoch, data position."""
        loaded = self._all(rank_side.load, os.path.expanduser(path))
        self.epochs_done = loaded[0]["epochs_done"]
        return loaded

    def _raise_if_dead(self, what: str, wait: float = 0) -> None:
        deadline = time.monotonic() + wait
        while True:
            dead = self.dead_ranks()
            if dead or time.monotonic() >= deadline:
                break
            time.sleep(0.2)
        if dead:
            self._report("failed")
            self._stop_world()
            raise RankError(f"rank(s) {', '.join(map(str, dead))} died during {what} (the engine exited, or stopped "
                            "answering the controller's heartbeats for about 30 s); this world is gone: "
                            "recover(checkpoint) starts a new one from the last checkpoint")

    def dead_ranks(self) -> list[int]:
        """Ranks whose engine has gone (the controller is told at once by the engine's nanny)."""
        alive = set(self._client.ids) if self._client is not None else set()
        return sorted(r for r, e in self._engine_of.items() if e not in alive)

    def recover(self, checkpoint: str, ranks: int | None = None, batch_size: int | None = None) -> list[dict]:
        """After a rank died: a new world (of ``ranks`` ranks, default as before; each with batches of
        ``batch_size``, default as before) continues from ``checkpoint``."""
        spec = self.spec
        if batch_size is not None and spec is not None:
            spec = replace(spec, batch_size=check_batch_size(batch_size))
        self._new_world(ranks or self.ranks, spec)
        self.spec = spec
        return self.resume(checkpoint)

    def _new_world(self, ranks: int, spec: TrainingSpec | None = None) -> None:
        """End the current world and build the same model (or ``spec``'s) in a new one of ``ranks`` ranks."""
        if not self.has_model:
            raise RuntimeError("no model yet: call setup() first")
        spec = spec or self.spec
        self._stop_world()
        self.ranks = ranks
        self.start()
        self.built = self._all(rank_side.build, spec)
        self.epochs_done = 0

    def rescale(self, ranks: int, batch_size: int | None = None) -> list[dict]:
        """Continue with ``ranks`` ranks: the model's and the optimizer's state go through a checkpoint into a new
        world (the data is sharded anew, from the next epoch's start). ``batch_size``: each rank's batch from now
        on (e.g. to keep the global batch, and with it Adam's course, as it was); default as before."""
        return self.recover(self.checkpoint(os.path.join(self._dir, "rescale")), ranks, batch_size)

    def scaling(self, ranks: list[int], epochs: int = 1, mode: str = "strong", csv: str | None = None,
                plot: str | None = None, on_step=None, on_metrics=None, restore: bool = True):
        """Train the same configuration on each rank count and measure throughput (samples/s over all ranks),
        speedup against the smallest count, and efficiency against ideal scaling. ``mode="weak"`` keeps each
        rank's shard the same size as at the smallest count (more ranks, more data); "strong" splits the same
        data. Returns a pandas DataFrame (and writes ``csv`` and a ``plot`` PNG when given). ``on_step(row)`` is
        called after each rank count; ``on_metrics`` as in :meth:`fit`. Each count trains a fresh model; afterwards
        (``restore``) the session's model, data and rank count are as they were before. A stop request ends the
        experiment with the counts measured so far."""
        return run_scaling(self, ranks, epochs, mode, csv, plot, on_step, on_metrics, restore)

    # -- anything on every rank --------------------------------------------------------------------------------------
    def run(self, fn, *args, **kwargs) -> dict[int, object]:
        """``fn(*args, **kwargs)`` on every rank (in its world: ``hvd.rank()`` works there); each rank's result, by
        rank. An error names the rank(s) it came from."""
        if not callable(fn):
            raise ValueError("run() takes a function (and its arguments) to call on every rank")
        return dict(zip(sorted(self._engine_of), self._all(fn, *args, **kwargs)))

    def run_cell(self, code: str, timeout: float | None = None) -> dict[int, dict]:
        """Run notebook code on every rank (in the engines' namespace, kept between cells); each rank's stdout,
        stderr and the value of the last expression. What the ``%%ranks`` cell magic calls."""
        if not isinstance(code, str):
            raise ValueError("run_cell() takes the cell's code as a string")
        self._require_world("the cell")
        ar = self._view.execute(code, silent=False, block=False)
        self._get(ar, "the cell", timeout)
        ar.wait_for_output(timeout=5)  # output streams may trail the reply
        out = {}
        for i, r in enumerate(sorted(self._engine_of)):
            result = ar.execute_result[i] if ar.execute_result else None
            data = (result.get("data") if isinstance(result, dict) else getattr(result, "data", None)) or {}
            out[r] = {"stdout": ar.stdout[i], "stderr": ar.stderr[i], "result": data.get("text/plain")}
        return out

    def run_script(self, path: str, args: Sequence[str] = (), on_metrics=None, echo: bool = True,
                   first_batch_timeout: float | None = None, poll: float = 0.1) -> ScriptResult:
        """Run an existing Horovod script, unchanged, on the session's ranks — the way ``horovodrun -np N python
        path args`` would, but in this session's world, containers and GPUs. Its ``hvd.init()`` joins the world
        the ranks are in; every ``model.fit`` it calls streams its metrics live (:attr:`metrics`, the dashboard,
        the JupyterLab panel) and stops at an agreed batch on :meth:`stop_training`. Each rank's output is echoed as
        it comes (``echo``), prefixed by its rank. The script must start its first batch (or end) within
        ``first_batch_timeout`` (default ``call_timeout``); after that ``stall_timeout`` holds. A non-zero exit on
        any rank raises :class:`ScriptFailed` (with every rank's code and output)."""
        path = os.path.abspath(os.path.expanduser(path))
        if not os.path.isfile(path):
            raise ValueError(f"no script {path}: the ranks run it from the shared file system")
        if isinstance(args, str) or not all(isinstance(a, str) for a in args):
            raise ValueError("args must be a list of strings, as sys.argv[1:] of the script")
        self._require_world("the script")
        self._clear_stop()
        t0 = time.perf_counter()
        self._report("training")
        ar = self._view.apply_async(rank_side.run_script, path, list(args), self.stop_file)
        echoed: dict[int, int] = {}
        ranks = sorted(self._engine_of)

        def output(ar) -> bool:
            moved = False
            for i, r in enumerate(ranks):
                text = ar.stdout[i] if i < len(ar.stdout) else ""
                new, echoed[r] = text[echoed.get(r, 0):], len(text)
                if new:
                    moved = True
                    if echo:
                        print("".join(f"[rank {r}] {line}\n" for line in new.splitlines()), end="", flush=True)
            return moved

        drive = self._drive(ar, f"the script {os.path.basename(path)}", on_metrics, poll, 20,
                            first_batch_timeout or self.call_timeout, output)
        results = self._results(ar, f"the script {os.path.basename(path)}")
        ar.wait_for_output(timeout=5)  # output streams may trail the reply
        output(ar)
        stopped = next((r["stopped"] for r in results if r["stopped"]), None)
        if stopped and drive.walltime_stop:
            stopped = f"stopped before the walltime ends ({drive.walltime_stop}): {stopped}"
        result = ScriptResult({r: res["exit_code"] for r, res in zip(ranks, results)},
                              dict(zip(ranks, ar.stdout)), dict(zip(ranks, ar.stderr)), stopped,
                              time.perf_counter() - t0)
        self._report("stopped" if stopped else "idle" if result.ok else "failed")
        if not result.ok:
            failed = ", ".join(f"rank {r}: exit code {c}" for r, c in result.exit_codes.items() if c)
            last = {r: result.stderr[r].strip().splitlines()[-1:] for r, c in result.exit_codes.items() if c}
            said = "; ".join(f"rank {r} said: {lines[0]}" for r, lines in last.items() if lines)
            raise ScriptFailed(f"{os.path.basename(path)} failed on {failed}" + (f" ({said})" if said else ""), result)
        return result

    # -- what the dashboard and the panel show -----------------------------------------------------------------------
    @property
    def metrics(self):
        """Each published batch record of each rank (pandas): loss, the model's other metrics, throughput, memory."""
        return self.metrics_table.frame()

    @property
    def epoch_metrics(self):
        """Each epoch's metrics as the ranks averaged them (validation metrics too), one row per rank and epoch."""
        return self.metrics_table.epoch_frame()

    def stragglers(self, factor: float = 1.5) -> list[int]:
        """Ranks of this world whose latest step time is more than ``factor`` × the median."""
        current = {w["rank"] for w in self.world}
        return straggler_ranks({r: t for r, t in self.metrics_table.latest_step_times().items()
                                if not current or r in current}, factor)

    def rank_table(self) -> list[dict]:
        """Each rank: node, GPU, state, straggler flag, latest loss and samples/s."""
        rank_state = "training" if self.state == "training" else "idle" if self.world else self.state
        return rank_rows(self.world, self.metrics_table.latest(), self.stragglers(), self.dead_ranks(), rank_state)

    def _report(self, state: str, every: float = 0.0, message: str | None = None) -> None:
        """Keep :attr:`state`, and tell the allocation's owner (for the JupyterLab panel) when there is one; at most
        once per ``every`` seconds while the state stays the same. Reporting never fails the training."""
        now = time.monotonic()
        if state == self.state and now - self._reported_at < every:
            return
        self.state, self._reported_at = state, now
        if self.owner_socket:
            try:
                request(self.owner_socket, "PUT", "/session",
                        {"id": self.id, "session": state, "ranks": self.rank_table(),
                         **({"message": message} if message else {})}, timeout=2)
            except (OSError, RuntimeError, ValueError):
                pass

    # -- plumbing ----------------------------------------------------------------------------------------------------
    def _collect(self, ar, on_metrics) -> bool:
        """Take the ranks' newly published metrics; return whether there were any."""
        data = ar.data if isinstance(ar.data, list) else [ar.data]
        added = self.metrics_table.add(d for d in data if d)
        if added and on_metrics is not None:
            on_metrics(self.metrics_table)
        return bool(added)

    def _require_world(self, what: str) -> None:
        if not self.world:
            raise RuntimeError(f"no ranks for {what}: start() first, or recover(checkpoint) after a rank died")
        self._raise_if_dead(what)

    def _all(self, fn, *args, **kwargs):
        """``fn(*args)`` on every rank; a world with a dead rank is ended and reported, not called."""
        name = getattr(fn, "__name__", "the call")
        self._require_world(name)
        return self._get(self._view.apply_async(fn, *args, **kwargs), name)

    def _get(self, ar, what: str, timeout: float | None = None):
        timeout = self.call_timeout if timeout is None else timeout
        try:
            return ar.get(timeout=timeout)
        except ipp.error.TimeoutError:
            waiting = self._waiting_ranks(ar)
            self._report("failed")
            self._stop_world(force=True)
            raise RankError(f"{what} did not finish in {timeout:.0f} s{waiting}: the world was ended "
                            "(a rank may hang); recover(checkpoint) starts a new one") from None
        except ipp.error.CompositeError as e:
            lines = [f"rank {self._rank_of(info)}: {name}: {message}" for name, message, _tb, info in e.elist]
            error = RankError(f"{what} failed on " + "; ".join(sorted(lines)))
            error.engine_died = any(name == "EngineError" for name, *_ in e.elist)
            raise error from None
        except ipp.error.RemoteError as e:
            raise RankError(f"{what} failed: {e.ename}: {e.evalue}") from None

    def _waiting_ranks(self, ar) -> str:
        """ ' on rank(s) …' for the ranks whose part of ``ar`` has not come back (calls on the whole world)."""
        ids = list(getattr(ar, "msg_ids", []))
        ranks = sorted(self._engine_of)
        if self._client is None or len(ids) != len(ranks):
            return ""
        left = [str(r) for r, m in zip(ranks, ids) if m in self._client.outstanding]
        return f" on rank(s) {', '.join(left)}" if left else ""

    def _rank_of(self, info) -> str:
        engine = info.get("engine_id") if isinstance(info, dict) else info
        for r, e in self._engine_of.items():
            if e == engine:
                return str(r)
        return f"(engine {engine})"
