"""One world out of a placement's engines (runs in the kernel): the Gloo environment of each rank (with the
session's own rendezvous) or the MPI one, as the training backend sets them, and the check that the engines joined one world, not several."""
from __future__ import annotations

from ..backends import Backend
from ..job.world import iface_for, plan_slots
from .placement import Engines


def gloo_envs(backend: Backend, engines: Engines, ranks: int, iface: str | None = None,
              timeout_s: float | None = None, directory: str | None = None):
    """Start a rendezvous for this world (bound to the ranks' address, answering only with its secret; or a file
    store in ``directory``, the session's private one); it and each rank's environment, in rank order (waiting up
    to ``timeout_s`` for the other ranks)."""
    rendezvous = backend.start_rendezvous(engines.addr, engines.hosts, ranks, directory)
    iface = iface or iface_for(engines.addr)
    return rendezvous, [backend.rank_env(s, rendezvous.rank_address(engines.addr), rendezvous.port, iface, timeout_s)
                        for s in plan_slots(engines.hosts)]


def mpi_envs(backend: Backend, engines: Engines) -> list[dict]:
    return [backend.mpi_env()] * len(engines.ids)


def check_one_world(world: list[dict], ranks: int) -> None:
    """The ranks must form one world: ranks 0..N-1 once each, all of size N. (Engines whose MPI did not reach the
    launcher's PMI each start a world of their own, and would train alone, unnoticed.)"""
    got = sorted((w["rank"], w["size"]) for w in world)
    if got != [(r, ranks) for r in range(ranks)]:
        raise RuntimeError(f"the {ranks} engines did not join one Horovod world (rank, size: {got}); with "
                           "world='mpi' the MPI library in the container must reach the launcher's PMI — "
                           "use world='gloo' where it does not")
