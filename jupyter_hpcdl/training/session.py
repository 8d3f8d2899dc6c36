"""TrainingSession: Horovod ranks as ipyparallel engines, driven from the notebook.

    session = TrainingSession(ranks=2)              # local engines (laptops, binder, workshops)
    session.start()
    session.setup(model_fn, data, validation_data=val, callbacks=[...])   # the user's compiled Keras model
    session.fit(epochs=3)                           # and again: training goes on where it stopped
    session.metrics                                 # per-rank metrics as they streamed in (pandas)
    session.checkpoint("~/ckpt/run1"); session.resume("~/ckpt/run1")     # optimizer state included
    session.run(fn, *args); session.run_script("train.py", ["--epochs", "3"])
    session.close()

The session is a façade over its parts: its world of ranks (:mod:`.rankworld`: where the engines run,
:mod:`.placement`, how they join, :mod:`.joining`), the model and its fits and metrics (:mod:`.fitting`),
checkpoints (:mod:`.checkpoints`), calls, cells and scripts on every rank (:mod:`.everyrank`), what the allocation's
owner is told (:mod:`.reporting`), what a call gives back (:mod:`.results`) and scaling experiments
(:mod:`.experiments`). What each rank does is the training backend's (:mod:`jupyter_hpcdl.backends`). The session
owns the Gloo rendezvous for its whole life. Each fit ends with a check that all ranks hold identical weights: a
world that silently stopped averaging is an error, never a result. (Most of this module is the docstrings users read in
notebooks; each method hands its work to a part.)"""
from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from dataclasses import replace
from typing import Sequence

from ..backends import BACKEND_ENV, load_backend
from ..containers.kernelspec import kernel_image
from ..job.newjob import NewAllocation, rank_job
from ..job.owner import owner_socket
from .checkpoints import Checkpoints
from .everyrank import EveryRank
from .experiments import run_scaling
from .fitting import CallSettings, Fitting, ModelState
from .placement import LOCAL_RANKS, PLACES, PlacementOptions, container_engine_cmd, default_ranks, resolve
from .rankworld import JoinOptions, RankWorld
from .reporting import Reporter
from .results import FitResult, ScriptResult
from .spec import TrainingSpec, check_batch_size, make_spec
from .walltime import DEFAULT_MARGIN

__all__ = ["TrainingSession"]


class _Kept:
    """A session attribute that one of its parts keeps (``part``: the session's attribute holding that part)."""

    def __init__(self, part: str, name: str):
        self.part, self.name = part, name

    def __get__(self, session, owner=None):
        return self if session is None else getattr(getattr(session, self.part), self.name)

    def __set__(self, session, value) -> None:
        setattr(getattr(session, self.part), self.name, value)


class TrainingSession:
    world = _Kept("_rankworld", "world")
    state = _Kept("_reporter", "state")
    spec = _Kept("_model", "spec")
    built = _Kept("_model", "built")
    epochs_done = _Kept("_model", "epochs_done")  # whole epochs the model has trained (kept through checkpoints)
    walltime_checkpoint = _Kept("_checkpoints", "walltime_checkpoint")
    metrics_table = _Kept("_fitting", "metrics_table")
    stop_file = _Kept("_fitting", "stop_file")

    def __init__(self, ranks: int | None = None, iface: str | None = None, tf_threads: int = 1, env: dict | None = None,
                 engine_cmd: list[str] | None = None, start_timeout: float = 120, where: str = "auto",
                 image: str | None = None, controller_ip: str | None = None, containers: bool = False,
                 new_allocation: NewAllocation | None = None, world: str = "gloo", stall_timeout: float = 60,
                 call_timeout: float = 600, stop_grace: float = 30, walltime_margin: float = DEFAULT_MARGIN,
                 checkpoint_dir: str = "~/.jupyter-hpcdl/checkpoints", backend: str | None = None):
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
        :meth:`continue_in_new_allocation` then goes on in a new job from that checkpoint.

        ``backend``: the training backend the ranks use (``jupyter_hpcdl.backends``; by default the one the site names
        in ``HPCDL_BACKEND``, else "horovod": TensorFlow/Keras with Horovod)."""
        if where not in ("auto", *PLACES):
            raise ValueError("where must be 'auto', 'local', 'allocation' or 'new'")
        if world not in ("gloo", "mpi"):
            raise ValueError("world must be 'gloo' (the session's own rendezvous) or 'mpi' (the site's MPI)")
        self.backend = load_backend(backend)  # an unknown name fails here, saying which are installed
        if world == "mpi":
            self.backend.mpi_env()  # a backend that cannot join over MPI says so here, before any engine starts
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
        self.walltime_margin = walltime_margin
        self.checkpoint_dir = os.path.expanduser(checkpoint_dir)
        self._dir = tempfile.mkdtemp(prefix="hpcdl-session-", dir=os.path.expanduser("~"))
        self.id = uuid.uuid4().hex
        self._reporter = Reporter(self.id, self.rank_table)
        self._rankworld = RankWorld(self.backend, lambda: self.call_timeout, lambda: self._reporter.report("failed"))
        self._model = ModelState()
        self._checkpoints = Checkpoints(self._rankworld, self._model, self._reporter, self.id)
        self._fitting = Fitting(self._rankworld, self._model, self._reporter, self._checkpoints,
                                os.path.join(self._dir, "stop"))
        self._every = EveryRank(self._rankworld, self._fitting, self._reporter)

    # -- lifecycle ---------------------------------------------------------------------------------------------------
    @property
    def owner_socket(self) -> str | None:
        return owner_socket()

    @property
    def private_dir(self) -> str:
        """The session's own directory (mode 0700): the stop file, the ranks' batch script, rescale checkpoints."""
        return self._dir

    def start(self) -> list[dict]:
        """Start the engines and join them into one Horovod world (Gloo, or MPI); return each rank's description."""
        self.mode = resolve(self.where)
        if self.ranks is None:
            self.ranks = default_ranks(self.mode)
        os.makedirs(self._dir, mode=0o700, exist_ok=True)  # again after close()
        self._reporter.report("starting")
        world = self._rankworld.start(self.mode, PlacementOptions(
            self.ranks, self.start_timeout, self._dir, self.image, self.controller_ip, self.engine_cmd,
            self.world_kind == "mpi", self.new_allocation),
            JoinOptions(self.world_kind, self.iface, {**self.env, BACKEND_ENV: self.backend.name}))  # rank-side code too
        from .magic import register_cell_magic

        register_cell_magic(self)  # %%ranks runs a cell on this session's ranks
        self._reporter.report("idle")
        return world

    @property
    def job_id(self) -> str | None:
        """The batch job of the ranks' engines (where='new')."""
        return self._rankworld.job_id

    def close(self) -> None:
        """Leave the world, stop the engines and the rendezvous; nothing is left running. The session can start
        again (``start()`` then ``setup()``): the model is gone with the ranks."""
        try:
            self._rankworld.stop()
        finally:
            shutil.rmtree(self._dir, ignore_errors=True)
            self.spec, self.built = None, []
            self._reporter.report("none")

    @property
    def alive(self) -> bool:
        """Whether the ranks are up and joined (no rank has died)."""
        return self._rankworld.alive

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
        built = self._fitting.build(spec)
        self.spec = spec  # only a model that every rank built counts
        return built

    @property
    def has_model(self) -> bool:
        """Whether setup() built the model (it survives a dead rank, for recover(); close() ends it)."""
        return self.spec is not None

    @property
    def batch_size(self) -> int | None:
        return self.spec.batch_size if self.spec else None

    @property
    def user_optimizer(self) -> bool:
        """Whether the ranks train with your own optimizer (a Keras model you compiled, or the optimizer your
        ``model_fn`` returned to the torch backend): its learning rate is yours to set, not the dashboard's."""
        if not self.built:
            return False
        return bool(self.built[0].get("user_optimizer", self.spec.user_compiled))

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
        return self._fitting.fit(epochs, publish_every, on_metrics, poll, stop_check_every, publish_interval,
                                 self._settings())

    def _settings(self) -> CallSettings:
        return CallSettings(self.call_timeout, self.stall_timeout, self.stop_grace, self.walltime_margin,
                            self.checkpoint_dir, self.time_left)

    def time_left(self) -> float | None:
        """Seconds of walltime the ranks have left, as the batch system says; None without a limit or a job."""
        return self._rankworld.time_left()

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
        self._fitting.stop_training()

    def shard_sizes(self) -> dict[int, int | None]:
        """Samples in each rank's shard (None for a Dataset)."""
        return self._fitting.shard_sizes()

    def weights_digest(self) -> str:
        """A digest of the model's trainable weights (PyTorch: its parameters), the same on every rank (else
        :class:`WorldDiverged`); not BatchNormalization's moving statistics, which follow each rank's batches."""
        return self._fitting.weights_digest()

    def set_lr(self, lr: float) -> list[float]:
        return self._fitting.set_lr(lr)

    # -- checkpoints, recovery, rescaling ----------------------------------------------------------------------------
    def checkpoint(self, path: str) -> str:
        """Write the model, its optimizer's state, the epochs and the data position into the directory ``path``
        (rank 0 writes; TensorFlow reads it as it is: see :mod:`jupyter_hpcdl.backends.horovod.checkpoint`); the directory."""
        return self._checkpoints.save(path)

    def resume(self, path: str) -> list[dict]:
        """Every rank continues from the checkpoint in ``path``: weights, optimizer state, epoch, data position."""
        return self._checkpoints.resume(path)

    def dead_ranks(self) -> list[int]:
        """Ranks whose engine has gone (the controller is told at once by the engine's nanny)."""
        return self._rankworld.dead_ranks()

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
        self._rankworld.stop()
        self.ranks = ranks
        self.start()
        self._fitting.build(spec)

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
        return run_scaling(self, self._new_world, ranks, epochs, mode, csv, plot, on_step, on_metrics, restore)

    # -- anything on every rank --------------------------------------------------------------------------------------
    def run(self, fn, *args, **kwargs) -> dict[int, object]:
        """``fn(*args, **kwargs)`` on every rank (in its world: ``hvd.rank()`` works there); each rank's result, by
        rank. An error names the rank(s) it came from."""
        return self._every.run(fn, *args, **kwargs)

    def run_cell(self, code: str, timeout: float | None = None) -> dict[int, dict]:
        """Run notebook code on every rank (in the engines' namespace, kept between cells); each rank's stdout,
        stderr and the value of the last expression. What the ``%%ranks`` cell magic calls."""
        return self._every.run_cell(code, timeout)

    def run_script(self, path: str, args: Sequence[str] = (), on_metrics=None, echo: bool = True,
                   first_batch_timeout: float | None = None, poll: float = 0.1) -> ScriptResult:
        """Run an existing Horovod script, unchanged, on the session's ranks — the way ``horovodrun -np N python
        path args`` would, but in this session's world, containers and GPUs. Its ``hvd.init()`` joins the world
        the ranks are in; every ``model.fit`` it calls streams its metrics live (:attr:`metrics`, the dashboard,
        the JupyterLab panel) and stops at an agreed batch on :meth:`stop_training`. Each rank's output is echoed as
        it comes (``echo``), prefixed by its rank. The script must start its first batch (or end) within
        ``first_batch_timeout`` (default ``call_timeout``); after that ``stall_timeout`` holds. A non-zero exit on
        any rank raises :class:`ScriptFailed` (with every rank's code and output)."""
        return self._every.run_script(path, args, on_metrics, echo, first_batch_timeout, poll, self._settings())

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
        return self._fitting.stragglers(factor)

    def rank_table(self) -> list[dict]:
        """Each rank: node, GPU, state, straggler flag, latest loss and samples/s."""
        return self._fitting.rank_table(self.state)
