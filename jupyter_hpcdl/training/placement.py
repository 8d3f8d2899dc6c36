"""Where a session's engines run (runs in the kernel): on this machine, across the batch job this kernel runs in
(started by the allocation's owner), or in a new batch job of their own. Each placement starts an ipyparallel
controller and its engines, says which engine is which rank and where, and stops what it started."""
from __future__ import annotations

import getpass
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Callable

import ipyparallel as ipp
import psutil

from ..containers.kernelspec import DEFAULT_IMAGE
from ..job.owner import SOCKET_ENV, job_time_left, owner_socket, request
from ..job.newjob import NewAllocation, engines_job_template
from ..job.tasks import task_exits
from ..job.world import hosts_from_tasks

PLACES = ("local", "allocation", "new")
#: Ranks a session starts outside a batch job (and in a new job) when not told how many.
LOCAL_RANKS = 2
#: How many last lines of an engine step's log an error shows.
LOG_LINES = 15


class EnginesFailed(RuntimeError):
    """An engine ended before it joined: the message names each rank, its node and the last lines of the log."""


@dataclass(frozen=True)
class Engines:
    """The engines of one world, in rank order, the hosts with their slot counts, and the address they reach the
    kernel (the controller, the rendezvous) at."""

    ids: list[int]
    hosts: list[tuple[str, int]]
    addr: str


@dataclass
class PlacementOptions:
    ranks: int
    start_timeout: float
    session_dir: str
    image: str = DEFAULT_IMAGE
    controller_ip: str | None = None
    engine_cmd: list[str] | None = None
    mpi: bool = False
    new_allocation: NewAllocation | None = None


def resolve(where: str) -> str:
    """"auto": the allocation when its owner is reachable, else local."""
    return where if where != "auto" else "allocation" if owner_socket() else "local"


def default_ranks(mode: str) -> int:
    """One rank per task slot of the kernel's job ("allocation": the slots its batch system gave it, one per GPU
    where the job has GPUs); :data:`LOCAL_RANKS` elsewhere."""
    sock = owner_socket() if mode == "allocation" else None
    if sock:
        slots = request(sock, "GET", "/allocation", timeout=30).get("slots") or []
        if sum(slots) > 0:
            return sum(slots)
    return LOCAL_RANKS


def log_tail(path: str, offset: int = 0, lines: int = LOG_LINES, limit: int = 1 << 16) -> str:
    """The last ``lines`` lines of ``path`` after ``offset`` (at most ``limit`` bytes read), "" when unreadable."""
    try:
        with open(path, "rb") as f:
            f.seek(max(offset, f.seek(0, os.SEEK_END) - limit))
            text = f.read(limit).decode(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


def engines_failed_message(exits, log: str, tail: str) -> str:
    """What a user reads when engines ended before joining: each rank, its node, how, and the log's last lines."""
    which = "; ".join(f"rank {e.rank} on {e.node}: {e.how}" for e in exits)
    return (f"the engine of {which}, before it joined the session. Its log: {log}; its last lines:\n{tail}\n"
            "(A missing image: pull it with hpcdl-containers pull, or give TrainingSession(image=...); "
            "a Python error: the image lacks what the ranks import.)")


class Placement:
    """One world's controller and engines. ``start(on_controller)`` calls ``on_controller`` as soon as the
    controller runs (the session starts its reaper then), and returns the :class:`Engines`."""

    kind = ""

    def __init__(self, options: PlacementOptions):
        self.options = options
        self.cluster: ipp.Cluster | None = None
        self.client: ipp.Client | None = None

    def start(self, on_controller: Callable[[], None], get: Callable) -> Engines:
        """``get(async_result, what, timeout)``: the session's wait with a deadline."""
        raise NotImplementedError

    @property
    def cluster_file(self) -> str | None:
        return getattr(self.cluster, "cluster_file", None) if self.cluster is not None else None

    @property
    def job_id(self) -> str | None:
        return None

    def time_left(self) -> float | None:
        """Seconds of walltime the ranks have left, as the batch system says; None without a limit or a job."""
        return job_time_left()

    def stop(self) -> None:
        """Stop the controller and the engines (and with them a batch job of the ranks). The controller runs in a
        process group of its own: what of it is left after ipyparallel's stop (its schedulers, forked while a
        failed start was already being undone) is ended with the group."""
        if self.cluster is None:
            return
        from ipyparallel.cluster.launcher import LocalProcessLauncher

        local = isinstance(self.cluster.controller, LocalProcessLauncher)
        controller = self.cluster.controller.pid if local else -1  # (its own session: started with setsid)
        try:
            self.cluster.stop_cluster_sync()
        finally:
            if controller > 0:
                end_process_group(controller)

    def shutdown_engines(self, timeout: float = 5.0) -> None:
        """Ask the engines to exit (ipyparallel's shutdown) and wait up to ``timeout`` seconds for them to leave, so
        that engines in a batch job end themselves before the job is cancelled (a batch system's kill does not
        reach what runs in a session of its own); engines that do not answer are left to the stop."""
        if self.client is None:
            return
        try:
            if not self.client.ids:
                return
            self.client.shutdown(targets="all", block=False)
            deadline = time.monotonic() + timeout
            while self.client.ids and time.monotonic() < deadline:
                self.client.spin()
                time.sleep(0.1)
        except Exception:  # a client whose controller is gone: nothing to ask
            pass

    def _engines_connection_file(self, timeout: float) -> str:
        """The controller's connection file for engines, once it is whole (engines elsewhere read it at start)."""
        name = f"ipcontroller-{self.cluster.cluster_id}-engine.json"
        path = os.path.join(self.cluster.profile_dir, "security", name)
        wait_for_json_file(path, timeout, "the controller's connection file for engines")
        return path

    def _addr(self) -> str:
        return self.options.controller_ip or socket.gethostbyname(socket.gethostname())

    def _engines_by_task(self, addr: str, get) -> Engines:
        """Wait for the engines the batch system started; order them by task (the ranks) and say where they run."""
        self.client.wait_for_engines(self.options.ranks, timeout=self.options.start_timeout)  # (at once if up)
        engines = sorted(self.client.ids)[: self.options.ranks]
        tasks = get(self.client[engines].apply_async(_task), "finding the ranks' tasks",
                    self.options.start_timeout)
        by_rank = sorted(zip(tasks, engines))
        return Engines([e for _, e in by_rank], hosts_from_tasks(tasks), addr)


class LocalPlacement(Placement):
    """Engines on this machine (laptops, binder, workshops), started by ipyparallel (or its MPI launcher)."""

    kind = "local"

    def start(self, on_controller, get) -> Engines:
        o = self.options
        kwargs = {}
        if o.engine_cmd:
            from traitlets.config import Config

            launcher = "MPIEngineSetLauncher" if o.mpi else "LocalEngineSetLauncher"
            kwargs["config"] = Config({launcher: {"engine_cmd": list(o.engine_cmd)}})
        if o.mpi:
            kwargs["engines"] = "mpi"
        self.cluster = ipp.Cluster(n=o.ranks, log_level=40, engine_timeout=o.start_timeout, **kwargs)
        self.cluster.start_controller_sync()
        on_controller()  # from here on a dying kernel takes the controller and engines with it
        self.cluster.start_engines_sync()
        self.client = self.cluster.connect_client_sync()
        self.client.wait_for_engines(o.ranks, timeout=o.start_timeout)
        return Engines(sorted(self.client.ids)[: o.ranks], [(socket.gethostname(), o.ranks)], "127.0.0.1")


class AllocationPlacement(Placement):
    """A controller here; the engines started by the allocation's owner as tasks of its job, one per rank, in
    containers."""

    kind = "allocation"

    def start(self, on_controller, get) -> Engines:
        o, sock = self.options, owner_socket()
        if not sock:
            raise RuntimeError("no batch allocation to start ranks in: this kernel is not in a jupyter-hpcdl job "
                               f"(${SOCKET_ENV} unset); use where='local', or where='new' for a new batch job")
        addr = self._addr()
        self.cluster = ipp.Cluster(n=0, controller_ip=addr, engines="local", log_level=40)
        self.cluster.start_controller_sync()
        on_controller()
        connection = self._engines_connection_file(min(60.0, o.start_timeout))
        gpus = 1 if os.environ.get("CUDA_VISIBLE_DEVICES") else 0  # each rank sees only its own GPU
        step = request(sock, "POST", "/engines", {"ranks": o.ranks, "image": o.image,
                                                  "connection_file": connection, "gpus_per_rank": gpus, "mpi": o.mpi})
        self.client = self.cluster.connect_client_sync()
        self._wait_for_engines(step.get("log"), int(step.get("log_offset") or 0))
        return self._engines_by_task(addr, get)

    def _wait_for_engines(self, log: str | None, offset: int) -> None:
        """Wait for the engines to register, and fail as soon as the step's log says one of them ended."""
        o = self.options
        deadline = time.monotonic() + o.start_timeout
        while len(self.client.ids) < o.ranks:
            exits = task_exits(log_tail(log, offset, lines=10_000)) if log else []
            if exits:
                raise EnginesFailed(engines_failed_message(exits, log, log_tail(log, offset)))
            if time.monotonic() > deadline:
                tail = f", its last lines:\n{log_tail(log, offset)}" if log else ""
                raise TimeoutError(f"{o.ranks} engines not ready in {o.start_timeout:g} seconds ("
                                   f"{len(self.client.ids)} ready; the job's queue or the image's start is slow): "
                                   f"their log is {log}{tail}")
            time.sleep(0.25)

    def time_left(self) -> float | None:
        sock = owner_socket()
        return request(sock, "GET", "/allocation", timeout=15).get("time_left_s") if sock else None

    def stop(self) -> None:
        self.shutdown_engines()
        try:
            sock = owner_socket()
            if sock:
                try:
                    request(sock, "DELETE", "/engines")
                except (OSError, RuntimeError):
                    pass
        finally:
            super().stop()


def wait_for_json_file(path: str, timeout: float, what: str) -> dict:
    """Wait until ``path`` holds a whole JSON object. ipyparallel's controller writes its connection files in place
    and its own wait ends when the file exists: an engine started at that moment can read it empty and exit (seen
    on the bed: one rank of two never came, and the session waited out its start timeout)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with open(path) as f:
                found = json.load(f)
            if isinstance(found, dict) and found:
                return found
        except (OSError, ValueError):
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} ({path}) was not written in {timeout:.0f} s: the controller did not start "
                               "(its log is in the profile's log directory)")
        time.sleep(0.05)


#: ipyparallel's engine launcher for each batch system's adapter.
ENGINE_LAUNCHERS = {"slurm": ("slurm", "SlurmEngineSetLauncher"), "gridengine": ("sge", "SGEEngineSetLauncher")}


def _client_here(sched) -> bool:
    from ..batchsystems.scheduler import serves

    return serves(sched, "ranks") and shutil.which(sched.submit_file_argv("job")[0]) is not None


def submitting_scheduler(env=None):
    """The batch system a new job goes to from here (outside an owner): this job's, or the one whose client is
    installed; None if there is none."""
    from ..batchsystems.scheduler import job_scheduler, load_scheduler

    env = os.environ if env is None else env
    found = job_scheduler(env)
    if found is not None:
        return found
    for name in ENGINE_LAUNCHERS:
        try:
            sched = load_scheduler(name)
        except ValueError:
            continue
        if _client_here(sched):
            return sched
    return None


class NewAllocationPlacement(Placement):
    """A controller here; a new batch job whose tasks are the engines, submitted by ipyparallel's engine launcher
    for the batch system with our script (and cancelled by it when the world ends)."""

    kind = "new"

    def start(self, on_controller, get) -> Engines:
        from traitlets.config import Config

        from ..batchsystems.scheduler import OFFER_ENV, owners_scheduler
        from ..job.offer import within_offer

        o = self.options
        submit, python, sock = {}, sys.executable, owner_socket()
        offer = os.environ.get(OFFER_ENV, "")
        sched = submitting_scheduler()
        if sched is None or not _client_here(sched):
            if not sock:
                raise RuntimeError("where='new' submits a batch job, but there is no batch system's client here "
                                   "and no jupyter-hpcdl job whose owner could submit it")
            from ..job.client import CANCEL, SUBMIT

            submit = {"submit_command": SUBMIT, "delete_command": CANCEL}  # the owner submits and cancels
            told = request(sock, "GET", "/allocation")
            python = told["host_python"]  # the job runs on the host
            sched, offer = owners_scheduler(told), told.get("offer") or offer
        if sched.name not in ENGINE_LAUNCHERS:
            raise RuntimeError(f"where='new' has no ipyparallel launcher for {sched.name}")
        engines, launcher = ENGINE_LAUNCHERS[sched.name]
        addr = self._addr()
        alloc = within_offer(o.new_allocation or NewAllocation(), o.ranks, o.image, offer, getpass.getuser()).alloc
        try:
            template = engines_job_template(sched, alloc, o.ranks, python, o.mpi)
        except (ValueError, NotImplementedError) as e:
            raise RuntimeError(f"the ranks' job cannot be written for {sched.name}: {e or 'not supported yet'}") from None
        config = Config({launcher: {
            **submit,
            "batch_template": template,
            "batch_file_name": os.path.join(o.session_dir, "engines.job"),  # not the kernel's working directory
            "engine_cmd": o.engine_cmd or container_engine_cmd(o.image, o.mpi, python)}})
        self.cluster = ipp.Cluster(n=o.ranks, controller_ip=addr, engines=engines, config=config, log_level=40,
                                   engine_timeout=o.start_timeout)  # the queue wait counts
        if not re.fullmatch(r"/[\w./-]+", self.cluster.profile_dir):  # it goes into the batch script
            raise RuntimeError(f"the IPython profile directory {self.cluster.profile_dir!r} has characters a "
                               "batch script cannot carry safely: use a profile path of letters, digits, . _ - /")
        self._sched = sched
        try:
            self.cluster.start_controller_sync()
            on_controller()  # before the submission: a kernel that dies in the queue wait leaves no job behind
            self._engines_connection_file(60.0)
            self.cluster.start_engines_sync()
            self.client = self.cluster.connect_client_sync()
        except BaseException as e:
            for key, engine_set in list(self.cluster.engines.items()):
                if not getattr(engine_set, "job_id", None):  # never submitted: nothing to cancel
                    del self.cluster.engines[key]
            if isinstance(e, subprocess.CalledProcessError):
                said = e.output.decode(errors="replace") if isinstance(e.output, bytes) else str(e.output or "")
                raise RuntimeError(f"the batch system refused the ranks' job: {said.strip() or e}") from None
            raise
        return self._engines_by_task(addr, get)

    def stop(self) -> None:
        self.shutdown_engines()  # before the job is cancelled
        super().stop()

    @property
    def job_id(self) -> str | None:
        for launcher in (self.cluster.engines.values() if self.cluster is not None else ()):
            return getattr(launcher, "job_id", None) or None
        return None

    def time_left(self) -> float | None:
        job = self.job_id
        if not job:
            return None
        sched = getattr(self, "_sched", None)
        if sched is not None and shutil.which(sched.resources_argv(job)[0]):
            return job_time_left(job, sched)
        sock = owner_socket()
        return request(sock, "GET", f"/jobs/{job}", timeout=15).get("time_left_s") if sock else None


def container_engine_cmd(image: str, mpi: bool = False, python: str | None = None) -> list[str]:
    """An engine started in the user's container for ``image`` by ``python`` (the host's, with jupyter_hpcdl);
    ipyparallel tells engines their cluster through these variables, which are passed into the container by name."""
    from ..job.owner import ENGINE_ENV, MPI_IN_CONTAINER
    from ..containers.kernelspec import in_container_argv

    return in_container_argv(image, python or sys.executable, ENGINE_ENV, ["python3", "-m", "ipyparallel.engine"],
                             MPI_IN_CONTAINER if mpi else ())


def end_process_group(pgid: int, grace: float = 5.0) -> None:
    """SIGTERM to the process group ``pgid`` (one this session started as a new session), SIGKILL to what is left
    after ``grace`` seconds."""
    def members() -> list[psutil.Process]:
        found = []
        for p in psutil.process_iter():
            try:
                if os.getpgid(p.pid) == pgid:
                    found.append(p)
            except (ProcessLookupError, psutil.Error):
                pass
        return found

    left = members()
    if not left:
        return
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(pgid, sig)
        except (ProcessLookupError, PermissionError):
            return
        _, left = psutil.wait_procs(left, timeout=grace)
        if not left:
            return


def placement_for(kind: str, options: PlacementOptions) -> Placement:
    return {"local": LocalPlacement, "allocation": AllocationPlacement, "new": NewAllocationPlacement}[kind](options)


def _task() -> tuple[int, str]:
    """On an engine: its task number and node, as jupyter_hpcdl.job.tasks or the batch system's step (Slurm's) says."""
    import os

    if "HPCDL_TASK_RANK" in os.environ:
        return int(os.environ["HPCDL_TASK_RANK"]), os.environ["HPCDL_TASK_NODE"]
    return int(os.environ["SLURM_PROCID"]), os.environ["SLURMD_NODENAME"]
