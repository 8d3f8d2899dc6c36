"""Engines across the batch job this kernel runs in (runs in the kernel): a controller here, the engines started by
the allocation's owner as tasks of its job, one per rank, each in the user's container; an engine that ends before
it joins is named at once, with its node and the last lines of the step's log."""
from __future__ import annotations

import os
import time

import ipyparallel as ipp

from ..job.owner import SOCKET_ENV, owner_socket, request
from ..job.tasks import task_exits
from .placement import Engines, EnginesFailed, Placement

#: How many last lines of an engine step's log an error shows.
LOG_LINES = 15


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


class AllocationPlacement(Placement):
    """A controller here; the engines started by the allocation's owner as tasks of its job, one per rank, in
    containers."""

    kind = "allocation"

    def start(self, on_controller, get) -> Engines:
        o, sock = self.options, owner_socket()
        if not sock:
            raise RuntimeError("no batch allocation to start ranks in: this kernel is not in a jupyter-hpcdl job "
                               f"(${SOCKET_ENV} unset); use where='local', or where='new' for a new batch job")
        addr = self.controller_address()
        self.cluster = ipp.Cluster(n=0, controller_ip=addr, engines="local", log_level=40)
        self.cluster.start_controller_sync()
        on_controller()
        connection = self.engines_connection_file(min(60.0, o.start_timeout))
        gpus = 1 if os.environ.get("CUDA_VISIBLE_DEVICES") else 0  # each rank sees only its own GPU
        step = request(sock, "POST", "/engines", {"ranks": o.ranks, "image": o.image,
                                                  "connection_file": connection, "gpus_per_rank": gpus, "mpi": o.mpi})
        self.client = self.cluster.connect_client_sync()
        self._wait_for_engines(step.get("log"), int(step.get("log_offset") or 0))
        return self.engines_by_task(addr, get)

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
