"""The environment of a Horovod rank (set before Horovod is imported): a Gloo slot at the session's rendezvous, or
MPI; and the rendezvous itself, started for one world's plan. Runs in the kernel and in ``hpcdl-launch``."""
from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:
    from ...job.world import Slot
    from .rendezvous import SessionRendezvous


def gloo_env(slot: Slot, rendezvous_addr: str, rendezvous_port: int, iface: str,
             timeout_s: float | None = None) -> dict[str, str]:
    """What a rank needs, before Horovod is imported, to join the Gloo world at the rendezvous. ``timeout_s``: how
    long Gloo waits for the other ranks (Horovod's default, 30 s, where not given): a rank that imported its
    framework sooner than a peer on a loaded node must not give up on it before the caller's own deadline."""
    timeout = {"HOROVOD_GLOO_TIMEOUT_SECONDS": str(max(30, round(timeout_s)))} if timeout_s else {}
    return {**timeout,
        "HOROVOD_GLOO_RENDEZVOUS_ADDR": rendezvous_addr,
        "HOROVOD_GLOO_RENDEZVOUS_PORT": str(rendezvous_port),
        "HOROVOD_CONTROLLER": "gloo",
        "HOROVOD_CPU_OPERATIONS": "gloo",
        "HOROVOD_GLOO_IFACE": iface,
        "HOROVOD_HOSTNAME": slot.hostname,
        "HOROVOD_RANK": str(slot.rank),
        "HOROVOD_SIZE": str(slot.size),
        "HOROVOD_LOCAL_RANK": str(slot.local_rank),
        "HOROVOD_LOCAL_SIZE": str(slot.local_size),
        "HOROVOD_CROSS_RANK": str(slot.cross_rank),
        "HOROVOD_CROSS_SIZE": str(slot.cross_size),
    }


def mpi_env() -> dict[str, str]:
    """What a rank needs to join the world over MPI: its rank and size come from the MPI launcher (mpiexec, or
    srun with a PMI plugin)."""
    return {"HOROVOD_CONTROLLER": "mpi", "HOROVOD_CPU_OPERATIONS": "mpi"}


def start_rendezvous(bind: str, hosts: Sequence[tuple[str, int]], size: int) -> SessionRendezvous:
    """A rendezvous bound to ``bind`` (the ranks' address only, answering only with its secret), started and set up
    for ``size`` ranks over ``hosts`` (name, slots) in Horovod's own plan."""
    from horovod.runner.common.util.hosts import get_host_assignments, parse_hosts

    from .rendezvous import SessionRendezvous

    server = SessionRendezvous(bind=bind)
    server.start()
    server.init(get_host_assignments(parse_hosts(",".join(f"{h}:{n}" for h, n in hosts)), size))
    return server
