"""Where a session's engines run (runs in the kernel): on this machine (here), across the batch job this kernel runs
in (started by the allocation's owner: :mod:`.placement_allocation`), or in a new batch job of their own
(:mod:`.placement_new`). Each placement starts an ipyparallel controller and its engines, says which engine is which
rank and where, and stops what it started; this module holds what they share."""
from __future__ import annotations

import json
import os
import socket
import sys
import time
from dataclasses import dataclass
from typing import Callable

import ipyparallel as ipp

from ..commands import end_group_by_id
from ..containers.kernelspec import DEFAULT_IMAGE
from ..job.owner import job_time_left, owner_socket, request
from ..job.newjob import NewAllocation
from ..job.world import hosts_from_tasks

PLACES = ("local", "allocation", "new")
#: Ranks a session starts outside a batch job (and in a new job) when not told how many.
LOCAL_RANKS = 2


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
                end_group_by_id(controller)

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

    def engines_connection_file(self, timeout: float) -> str:
        """The controller's connection file for engines, once it is whole (engines elsewhere read it at start)."""
        name = f"ipcontroller-{self.cluster.cluster_id}-engine.json"
        path = os.path.join(self.cluster.profile_dir, "security", name)
        wait_for_json_file(path, timeout, "the controller's connection file for engines")
        return path

    def controller_address(self) -> str:
        """Where the engines reach the controller (and the rendezvous): ``controller_ip``, or this node's address."""
        return self.options.controller_ip or socket.gethostbyname(socket.gethostname())

    def engines_by_task(self, addr: str, get) -> Engines:
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


def container_engine_cmd(image: str, mpi: bool = False, python: str | None = None) -> list[str]:
    """An engine started in the user's container for ``image`` by ``python`` (the host's, with jupyter_hpcdl);
    ipyparallel tells engines their cluster through these variables, which are passed into the container by name."""
    from ..job.owner import ENGINE_ENV, MPI_IN_CONTAINER
    from ..containers.kernelspec import in_container_argv

    return in_container_argv(image, python or sys.executable, ENGINE_ENV, ["python3", "-m", "ipyparallel.engine"],
                             MPI_IN_CONTAINER if mpi else ())


def _task() -> tuple[int, str]:
    """On an engine: its task number and node, as jupyter_hpcdl.job.tasks or the batch system's step (Slurm's) says."""
    import os

    if "HPCDL_TASK_RANK" in os.environ:
        return int(os.environ["HPCDL_TASK_RANK"]), os.environ["HPCDL_TASK_NODE"]
    return int(os.environ["SLURM_PROCID"]), os.environ["SLURMD_NODENAME"]
