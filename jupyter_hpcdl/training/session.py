"""TrainingSession: Horovod ranks as ipyparallel engines, driven from the notebook.

    session = TrainingSession(ranks=2)              # local engines (laptops, binder, workshops)
    session.start()
    session.setup(model_fn, data_fn, loss="sparse_categorical_crossentropy", lr=0.05)
    session.fit(epochs=3)                           # and again: training goes on where it stopped
    session.metrics                                 # per-rank metrics as they streamed in (pandas)
    session.checkpoint("~/ckpt/digits.npz"); session.resume("~/ckpt/digits.npz")
    session.close()

The session owns the Gloo rendezvous (Horovod's own server) for its whole life. Each fit ends with a check that all
ranks hold identical weights: a world that silently stopped averaging is an error, never a result."""
from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid
import warnings
from dataclasses import dataclass, field

import ipyparallel as ipp

from ..allocation import SOCKET_ENV, request
from ..newjob import NewAllocation, engines_job_template
from ..world import gloo_env, hosts_from_tasks, iface_for, mpi_env, plan_slots
from . import rank as rank_side
from .metrics import MetricsTable, rank_rows, straggler_ranks
from .reaper import start_reaper, stop_reaper
from .walltime import DEFAULT_MARGIN, WalltimeWatch, squeue_time_left
from .watchdog import kill_local_engines, local_process_states, stall_message


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


class TrainingSession:
    def __init__(self, ranks: int = 2, iface: str | None = None, tf_threads: int = 1, env: dict | None = None,
                 engine_cmd: list[str] | None = None, start_timeout: float = 120, where: str = "auto",
                 image: str = "hpcdl/base:latest", controller_ip: str | None = None, containers: bool = False,
                 new_allocation: NewAllocation | None = None, world: str = "gloo", stall_timeout: float = 60,
                 call_timeout: float = 600, stop_grace: float = 30, walltime_margin: float = DEFAULT_MARGIN,
                 checkpoint_dir: str = "~/.jupyter-hpcdl/checkpoints"):
        """``where``: "local" (engines on this machine), "allocation" (one engine per rank across the nodes of the
        batch job this kernel runs in, each in the user's container for ``image``), "new" (a new batch job for the
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
        if where not in ("auto", "local", "allocation", "new"):
            raise ValueError("where must be 'auto', 'local', 'allocation' or 'new'")
        if world not in ("gloo", "mpi"):
            raise ValueError("world must be 'gloo' (the session's own rendezvous) or 'mpi' (the site's MPI)")
        self.world_kind = world
        self.new_allocation = new_allocation or NewAllocation()
        if where == "new":
            engines_job_template(self.new_allocation, ranks)  # bad values fail here, not at start
        self.ranks = ranks
        self.where = where
        self.image = image
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
        self._cluster = self._client = self._rendezvous = None
        self._dir = tempfile.mkdtemp(prefix="hpcdl-session-", dir=os.path.expanduser("~"))
        self.stop_file = os.path.join(self._dir, "stop")
        self.state = "none"
        self.id = uuid.uuid4().hex
        self._setup = None
        self.epochs_done = 0  # whole epochs the model has trained (kept through checkpoints)
        self._reported_at = 0.0

    # -- lifecycle ---------------------------------------------------------------------------------------------------
    @property
    def owner_socket(self) -> str | None:
        path = os.environ.get(SOCKET_ENV)
        return path if path and os.path.exists(path) else None

    def start(self) -> list[dict]:
        """Start the engines and join them into one Horovod world (Gloo, or MPI); return each rank's description."""
        self.mode = self.where if self.where != "auto" else "allocation" if self.owner_socket else "local"
        os.makedirs(self._dir, mode=0o700, exist_ok=True)  # again after close()
        self._report("starting")
        try:
            engines, hosts, addr = {"local": self._start_local, "allocation": self._start_in_allocation,
                                    "new": self._start_in_new_allocation}[self.mode]()
            envs = self._gloo_envs(hosts, addr) if self.world_kind == "gloo" else [mpi_env()] * len(engines)
            # every engine joins at once (hvd.init waits for all ranks)
            results = [self._client[e].apply_async(rank_side.join, {**self.env, **env})
                       for e, env in zip(engines, envs)]
            self.world = [self._get(r, f"joining the world (engine {e})", self.start_timeout)
                          for e, r in zip(engines, results)]
            check_one_world(self.world, len(engines))
        except BaseException:
            self._report("failed")
            try:
                self._stop_world()  # nothing left behind: no engines, no controller, no queued job
            except Exception as cleanup:  # the first error is the one to tell
                warnings.warn(f"stopping the ranks after a failed start: {cleanup}")
            raise
        self._engine_of = {w["rank"]: e for w, e in zip(self.world, engines)}
        self._view = self._client[[self._engine_of[r] for r in sorted(self._engine_of)]]
        self._view.use_cloudpickle()  # the user's model and data functions travel by value
        self._report("idle")
        return self.world

    def _watch(self) -> None:
        """A reaper that ends the ranks, the controller and a job of the ranks if this kernel dies unclosed."""
        cluster_file = getattr(self._cluster, "cluster_file", None) if self._cluster is not None else None
        self._reaper = start_reaper(cluster_file, self.owner_socket if self.mode == "allocation" else None,
                                    self._dir)

    def _gloo_envs(self, hosts: list[tuple[str, int]], addr: str) -> list[dict]:
        """Start the session's rendezvous for this world; each rank's Gloo environment, in rank order."""
        from horovod.runner.common.util.hosts import get_host_assignments, parse_hosts

        from .rendezvous import SessionRendezvous

        iface = self.iface or iface_for(addr)
        self._rendezvous = SessionRendezvous(bind=addr)  # only on the ranks' interface, only with the secret
        port = self._rendezvous.start()
        self._rendezvous.init(get_host_assignments(parse_hosts(",".join(f"{h}:{n}" for h, n in hosts)), self.ranks))
        return [gloo_env(s, self._rendezvous.rank_address(addr), port, iface) for s in plan_slots(hosts)]

    def _start_local(self):
        kwargs = {}
        if self.engine_cmd:
            from traitlets.config import Config

            launcher = "MPIEngineSetLauncher" if self.world_kind == "mpi" else "LocalEngineSetLauncher"
            kwargs["config"] = Config({launcher: {"engine_cmd": list(self.engine_cmd)}})
        if self.world_kind == "mpi":
            kwargs["engines"] = "mpi"
        self._cluster = ipp.Cluster(n=self.ranks, log_level=40, engine_timeout=self.start_timeout, **kwargs)
        self._cluster.start_controller_sync()
        self._watch()  # from here on a dying kernel takes the controller and engines with it
        self._cluster.start_engines_sync()
        self._client = self._cluster.connect_client_sync()
        self._client.wait_for_engines(self.ranks, timeout=self.start_timeout)
        return sorted(self._client.ids)[: self.ranks], [(socket.gethostname(), self.ranks)], "127.0.0.1"

    def _start_in_allocation(self):
        """A controller here; the engines started by the allocation's owner with srun, one per rank, in containers."""
        if not self.owner_socket:
            raise RuntimeError("no batch allocation to start ranks in: this kernel is not in a jupyter-hpcdl job "
                               f"(${SOCKET_ENV} unset); use where='local', or where='new' for a new batch job")
        addr = self.controller_ip or socket.gethostbyname(socket.gethostname())
        self._cluster = ipp.Cluster(n=0, controller_ip=addr, engines="local", log_level=40)
        self._cluster.start_controller_sync()
        self._watch()
        connection = os.path.join(self._cluster.profile_dir, "security",
                                  f"ipcontroller-{self._cluster.cluster_id}-engine.json")
        gpus = 1 if os.environ.get("CUDA_VISIBLE_DEVICES") else 0  # each rank sees only its own GPU
        request(self.owner_socket, "POST", "/engines", {"ranks": self.ranks, "image": self.image,
                                                         "connection_file": connection, "gpus_per_rank": gpus,
                                                         "mpi": self.world_kind == "mpi"})
        self._client = self._cluster.connect_client_sync()
        return self._engines_by_task(addr)

    def _start_in_new_allocation(self):
        """A controller here; a new batch job whose tasks are the engines, submitted by ipyparallel's Slurm engine
        launcher with our script (and cancelled by it when the world ends)."""
        from traitlets.config import Config

        submit, python = {}, sys.executable
        if not shutil.which("sbatch"):
            if not self.owner_socket:
                raise RuntimeError("where='new' submits a batch job, but there is no sbatch here and no "
                                   "jupyter-hpcdl job whose owner could submit it")
            from ..jobclient import CANCEL, SUBMIT

            submit = {"submit_command": SUBMIT, "delete_command": CANCEL}  # the owner runs sbatch and scancel
            python = request(self.owner_socket, "GET", "/allocation")["host_python"]  # the job runs on the host
        addr = self.controller_ip or socket.gethostbyname(socket.gethostname())
        config = Config({"SlurmEngineSetLauncher": {
            **submit,
            "batch_template": engines_job_template(self.new_allocation, self.ranks, self.world_kind == "mpi"),
            "batch_file_name": os.path.join(self._dir, "engines.sbatch"),  # not the kernel's working directory
            "engine_cmd": self.engine_cmd or container_engine_cmd(self.image, self.world_kind == "mpi", python)}})
        self._cluster = ipp.Cluster(n=self.ranks, controller_ip=addr, engines="slurm", config=config, log_level=40,
                                    engine_timeout=self.start_timeout)  # the queue wait counts
        if not re.fullmatch(r"/[\w./-]+", self._cluster.profile_dir):  # it goes into the batch script
            raise RuntimeError(f"the IPython profile directory {self._cluster.profile_dir!r} has characters a "
                               "batch script cannot carry safely: use a profile path of letters, digits, . _ - /")
        try:
            self._cluster.start_controller_sync()
            self._watch()  # before the submission: a kernel that dies in the queue wait leaves no job behind
            self._cluster.start_engines_sync()
            self._client = self._cluster.connect_client_sync()
        except BaseException as e:
            for key, engine_set in list(self._cluster.engines.items()):
                if not getattr(engine_set, "job_id", None):  # never submitted: nothing to cancel
                    del self._cluster.engines[key]
            if isinstance(e, subprocess.CalledProcessError):
                said = e.output.decode(errors="replace") if isinstance(e.output, bytes) else str(e.output or "")
                raise RuntimeError(f"the batch system refused the ranks' job: {said.strip() or e}") from None
            raise
        return self._engines_by_task(addr)

    @property
    def job_id(self) -> str | None:
        """The batch job of the ranks' engines (where='new')."""
        for launcher in (self._cluster.engines.values() if self._cluster is not None else ()):
            return getattr(launcher, "job_id", None) or None
        return None

    def _engines_by_task(self, addr: str):
        """Wait for the engines srun started; order them by Slurm task (the ranks) and say where they run."""
        self._client.wait_for_engines(self.ranks, timeout=self.start_timeout)
        engines = sorted(self._client.ids)[: self.ranks]
        tasks = self._get(self._client[engines].apply_async(_slurm_task), "finding the ranks' tasks",
                          self.start_timeout)
        by_rank = sorted(zip(tasks, engines))
        return [e for _, e in by_rank], hosts_from_tasks(tasks), addr

    def close(self) -> None:
        """Leave the world, stop the engines and the rendezvous; nothing is left running. The session can start
        again (``start()`` then ``setup()``): the model is gone with the ranks."""
        try:
            self._stop_world()
        finally:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._setup = None
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
        try:
            if self._client is not None:
                if force:
                    kill_local_engines(self.world)
                else:
                    try:  # a rank that hangs does not hold the end of the world: its engine is stopped below
                        self._view.apply_async(rank_side.leave).get(timeout=10)
                    except Exception:
                        pass
                self._client.close()
        finally:
            try:
                if self.owner_socket and getattr(self, "mode", None) == "allocation":
                    try:
                        request(self.owner_socket, "DELETE", "/engines")
                    except (OSError, RuntimeError):
                        pass
                if self._cluster is not None:
                    self._cluster.stop_cluster_sync()
                stopped = True
            finally:
                try:
                    if self._rendezvous is not None:
                        self._rendezvous.stop()
                finally:
                    # last: if this kernel dies before here, the reaper ends the rest; if stopping failed, it tries
                    stop_reaper(self._reaper, reap=not stopped)
                    self._cluster = self._client = self._rendezvous = self._reaper = None
                    self.world, self._engine_of = [], {}

    def __enter__(self) -> "TrainingSession":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- training ----------------------------------------------------------------------------------------------------
    def setup(self, model_fn, data_fn, loss, metrics=(), lr: float = 0.01, batch_size: int = 32) -> list[dict]:
        """Build ``model_fn()`` on every rank with ``data_fn(rank, size) -> (x, y)`` as its shard."""
        setup = (model_fn, data_fn, loss, tuple(metrics), lr, batch_size)
        built = self._all(rank_side.build, *setup)
        self._setup, self.epochs_done = setup, 0  # only a model that every rank built counts
        return built

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
        return sorted(r for r, e in getattr(self, "_engine_of", {}).items() if e not in alive)

    def recover(self, checkpoint: str, ranks: int | None = None) -> list[dict]:
        """After a rank died: a new world (of ``ranks`` ranks, default as before) continues from ``checkpoint``."""
        self._new_world(ranks or self.ranks)
        return self.resume(checkpoint)

    def _new_world(self, ranks: int, data_fn=None) -> None:
        """End the current world and build the same model in a new one of ``ranks`` ranks."""
        if not self.has_model:
            raise RuntimeError("no model yet: call setup() first")
        model_fn, setup_data_fn, *rest = self._setup
        self._stop_world()
        self.ranks = ranks
        self.start()
        self._all(rank_side.build, model_fn, data_fn or setup_data_fn, *rest)
        self.epochs_done = 0

    def rescale(self, ranks: int) -> list[dict]:
        """Continue with ``ranks`` ranks: the model's state goes through a checkpoint into a new world."""
        return self.recover(self.checkpoint(os.path.join(self._dir, "rescale.npz")), ranks)

    def scaling(self, ranks: list[int], epochs: int = 1, mode: str = "strong", csv: str | None = None,
                plot: str | None = None, on_step=None, on_metrics=None, restore: bool = True):
        """Train the same configuration on each rank count and measure throughput (samples/s over all ranks),
        speedup against the smallest count, and efficiency against ideal scaling. ``mode="weak"`` keeps each
        rank's shard the same size as at the smallest count (more ranks, more data); "strong" splits the same
        data. Returns a pandas DataFrame (and writes ``csv`` and a ``plot`` PNG when given). ``on_step(row)`` is
        called after each rank count; ``on_metrics`` as in :meth:`fit`. Each count trains a fresh model; afterwards
        (``restore``) the session's model, data and rank count are as they were before. A stop request ends the
        experiment with the counts measured so far."""
        import pandas as pd

        if mode not in ("strong", "weak"):
            raise ValueError("mode must be 'strong' or 'weak'")
        if not self.has_model:
            raise RuntimeError("no model yet: call setup() first")
        data_fn, ranks_before = self._setup[1], self.ranks
        keep = self.checkpoint(os.path.join(self._dir, "before-scaling.npz"))  # each count starts a fresh model
        base = min(ranks)
        rows = []
        try:
            for n in ranks:
                self._new_world(n, data_fn if mode == "strong" else _weak_shard(data_fn, base))
                self.fit(epochs=1, on_metrics=on_metrics)  # warm-up: tracing and first-epoch costs stay out
                result = self.fit(epochs=epochs, on_metrics=on_metrics)
                if result.stopped:  # a partial fit measures nothing: the counts done so far stand
                    break
                samples = sum(self.shard_sizes().values()) * epochs
                rows.append({"ranks": n, "seconds": result.seconds, "throughput": samples / result.seconds})
                if on_step is not None:
                    on_step(rows[-1])
        finally:
            if restore:  # the model as it was, with its data, on as many ranks as before
                self.recover(keep, ranks_before)
        if not rows or base not in [r["ranks"] for r in rows]:
            raise RuntimeError("scaling stopped before the smallest rank count was measured: no figures")
        table = pd.DataFrame(rows)
        first = table.loc[table["ranks"] == base, "throughput"].iloc[0]
        table["speedup"] = table["throughput"] / first
        table["ideal"] = table["ranks"] / base
        table["efficiency"] = table["speedup"] / table["ideal"]
        table["mode"] = mode
        if csv:
            table.to_csv(csv, index=False)
        if plot:
            plot_scaling(table, plot)
        return table


    def fit(self, epochs: int = 1, publish_every: int = 5, on_metrics=None, poll: float = 0.1,
            stop_check_every: int = 20, publish_interval: float = 0.1) -> FitResult:
        """Train ``epochs`` more epochs on all ranks, streaming metrics (every ``publish_every`` batches, at most
        every ``publish_interval`` seconds) into :attr:`metrics` and ``on_metrics``; the ranks look for a stop
        request every ``stop_check_every`` batches."""
        if os.path.exists(self.stop_file):
            os.unlink(self.stop_file)
        self._stop_asked = None
        walltime = WalltimeWatch(self.time_left, self.walltime_margin)
        walltime_stop = None
        t0 = time.perf_counter()
        self._report("training")
        ar = self._view.apply_async(rank_side.fit, epochs, self.stop_file, publish_every, stop_check_every,
                                    publish_interval)
        progress = measured = time.monotonic()
        step = 0.0  # the slowest rank's latest step time: slow steps stretch the deadlines below
        while not ar.ready():
            if self._collect(ar, on_metrics):
                progress = time.monotonic()
                if progress - measured > 2.0:
                    measured, step = progress, max(self.metrics_table.latest_step_times().values(), default=0.0)
            self._raise_if_dead("fit")  # the others wait in a collective that will never complete
            now = time.monotonic()
            grace = max(self.stop_grace, 2 * stop_check_every * step)  # the ranks look every stop_check_every batches
            if self._stop_asked is not None and now - self._stop_asked > grace and not ar.ready():
                self._end_stalled("Stop", now - self._stop_asked, f"stop_grace, {grace:.0f} s at this step time")
            stall = max(self.stall_timeout, 3 * step)
            if now - progress > stall and not ar.ready():
                self._end_stalled("fit", now - progress, f"stall_timeout, {stall:.0f} s at this step time")
            if walltime_stop is None and walltime.due():
                walltime_stop = f"the scheduler says {walltime.left:.0f} s of walltime are left"
                self.stop_training()
            self._report("training", every=2.0)
            time.sleep(poll)
        self._collect(ar, on_metrics)
        try:
            results = self._get(ar, "fit")
        except RankError as e:
            if e.engine_died:  # the survivors' errors follow from a death: report the death
                self._raise_if_dead("fit", wait=5)
            self._report("failed")
            raise
        digests = {r["rank"]: r["weights"] for r in results}
        if len(set(digests.values())) != 1:
            self._report("failed")
            raise WorldDiverged(f"ranks hold different weights after training ({digests}): gradients were not averaged")
        self.epochs_done = results[0]["epochs_done"]
        stopped = results[0]["stopped"]
        if stopped and walltime_stop:
            stopped = self._checkpoint_for_walltime(walltime_stop)
        else:
            self._report("stopped" if stopped else "idle")
        return FitResult(results[0]["epochs_done"], {r["rank"]: r["history"] for r in results},
                         stopped, results[0]["weights"], time.perf_counter() - t0,
                         [r["rank"] for r in results])

    def _checkpoint_for_walltime(self, why: str) -> str:
        os.makedirs(self.checkpoint_dir, mode=0o700, exist_ok=True)
        path = self.checkpoint(os.path.join(self.checkpoint_dir, f"walltime-{self.id[:12]}-epoch{self.epochs_done}.npz"))
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
            mode = getattr(self, "mode", None)
            if mode == "allocation" and self.owner_socket:
                return request(self.owner_socket, "GET", "/allocation", timeout=15).get("time_left_s")
            job = self.job_id if mode == "new" else os.environ.get("SLURM_JOB_ID") if mode == "local" else None
            if not job:
                return None
            if shutil.which("squeue"):
                return squeue_time_left(job)
            if self.owner_socket:
                return request(self.owner_socket, "GET", f"/jobs/{job}", timeout=15).get("time_left_s")
        except (OSError, RuntimeError, ValueError):
            return None
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
            engines_job_template(new_allocation, ranks or self.ranks)
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

    @property
    def has_model(self) -> bool:
        """Whether setup() built the model (it survives a dead rank, for recover(); close() ends it)."""
        return self._setup is not None

    @property
    def batch_size(self) -> int | None:
        return self._setup[5] if self._setup else None

    def shard_sizes(self) -> dict[int, int]:
        """Samples in each rank's shard."""
        return {r["rank"]: r["samples"] for r in self._all(rank_side.shard_size)}

    def weights_digest(self) -> str:
        """A digest of the model's weights, the same on every rank (else :class:`WorldDiverged`)."""
        digests = self._all(rank_side.weights_digest)
        if len(set(digests)) != 1:
            raise WorldDiverged(f"ranks hold different weights: {digests}")
        return digests[0]

    def set_lr(self, lr: float) -> list[float]:
        return self._all(rank_side.set_lr, lr)

    def checkpoint(self, path: str) -> str:
        path = os.path.expanduser(path)
        return next(p for p in self._all(rank_side.save, path) if p)

    def resume(self, path: str) -> list[dict]:
        loaded = self._all(rank_side.load, os.path.expanduser(path))
        self.epochs_done = loaded[0]["epochs_done"]
        return loaded

    @property
    def metrics(self):
        return self.metrics_table.frame()

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

    def _all(self, fn, *args):
        """``fn(*args)`` on every rank; a world with a dead rank is ended and reported, not called."""
        if not self.world:
            raise RuntimeError(f"no ranks for {fn.__name__}: start() first, or recover(checkpoint) after a rank died")
        self._raise_if_dead(fn.__name__)
        return self._get(self._view.apply_async(fn, *args), fn.__name__)

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
        ranks = sorted(getattr(self, "_engine_of", {}))
        if self._client is None or len(ids) != len(ranks):
            return ""
        left = [str(r) for r, m in zip(ranks, ids) if m in self._client.outstanding]
        return f" on rank(s) {', '.join(left)}" if left else ""

    def _rank_of(self, info) -> str:
        engine = info.get("engine_id") if isinstance(info, dict) else info
        for r, e in getattr(self, "_engine_of", {}).items():
            if e == engine:
                return str(r)
        return f"(engine {engine})"


def check_one_world(world: list[dict], ranks: int) -> None:
    """The ranks must form one world: ranks 0..N-1 once each, all of size N. (Engines whose MPI did not reach the
    launcher's PMI each start a world of their own, and would train alone, unnoticed.)"""
    got = sorted((w["rank"], w["size"]) for w in world)
    if got != [(r, ranks) for r in range(ranks)]:
        raise RuntimeError(f"the {ranks} engines did not join one Horovod world (rank, size: {got}); with "
                           "world='mpi' the MPI library in the container must reach the launcher's PMI — "
                           "use world='gloo' where it does not")


def container_engine_cmd(image: str, mpi: bool = False, python: str | None = None) -> list[str]:
    """An engine started in the user's container for ``image`` by ``python`` (the host's, with jupyter_hpcdl);
    ipyparallel tells engines their cluster through these variables, which are passed into the container by name."""
    from ..allocation import ENGINE_ENV, MPI_IN_CONTAINER
    from ..containers.kernelspec import in_container_argv

    return in_container_argv(image, python or sys.executable, ENGINE_ENV, ["python3", "-m", "ipyparallel.engine"],
                             MPI_IN_CONTAINER if mpi else ())


def _weak_shard(data_fn, base: int):
    """Weak scaling: every rank gets as much data as a rank had at ``base`` ranks (shards repeat as needed)."""

    def shard(rank: int, size: int):
        return data_fn(rank % base, base)

    return shard


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


def _slurm_task() -> tuple[int, str]:
    """On an engine started by srun: its task number and node."""
    import os

    return int(os.environ["SLURM_PROCID"]), os.environ["SLURMD_NODENAME"]
