"""The Horovod backend: TensorFlow/Keras trained with Horovod, the ranks joined over Gloo (at the session's or the
launcher's rendezvous) or MPI. Registered as ``horovod`` (the default) in the ``jupyter_hpcdl.backends`` entry
point group; :data:`BACKEND` is what :func:`jupyter_hpcdl.backends.load_backend` returns. Every import of
TensorFlow, Keras and Horovod in the package is in this package."""
from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from ..base import Backend, StackFinding
from . import environment, hvd, rank_data, scripts, stack
from . import rank as training

if TYPE_CHECKING:
    from ...job.world import Slot


class HorovodBackend:
    """The :class:`~jupyter_hpcdl.backends.base.Backend` of Horovod (rank members are this package's functions)."""

    name = "horovod"

    join = staticmethod(training.join)
    leave = staticmethod(training.leave)
    rank = staticmethod(hvd.rank)
    size = staticmethod(hvd.size)
    local_rank = staticmethod(hvd.local_rank)
    allreduce_max = staticmethod(hvd.allreduce_max)
    allreduce_sum = staticmethod(hvd.allreduce_sum)
    build = staticmethod(training.build)
    fit = staticmethod(training.fit)
    shard_size = staticmethod(training.shard_size)
    weights_digest = staticmethod(training.weights_digest)
    set_lr = staticmethod(training.set_lr)
    save = staticmethod(training.save)
    load = staticmethod(training.load)
    run_script = staticmethod(scripts.run_script)
    load_shard = staticmethod(rank_data.load_shard)
    check_allreduce = staticmethod(hvd.check_allreduce)

    probe_script = stack.PROBE_SCRIPT

    def start_rendezvous(self, bind: str, hosts: Sequence[tuple[str, int]], size: int, directory: str | None = None):
        return environment.start_rendezvous(bind, hosts, size)

    def rank_env(self, slot: Slot, rendezvous_addr: str, rendezvous_port: int, iface: str,
                 timeout_s: float | None = None) -> dict[str, str]:
        return environment.gloo_env(slot, rendezvous_addr, rendezvous_port, iface, timeout_s)

    def rank_command(self, command: Sequence[str]) -> list[str]:
        return list(command)  # hvd.init() joins the world from the environment

    def mpi_env(self) -> dict[str, str]:
        return environment.mpi_env()

    def pinned_version(self, requirements: Sequence[str]) -> str | None:
        return stack.pinned_version(requirements)

    def assess_stack(self, versions: dict, ref: str, pinned: str | None) -> list[StackFinding]:
        return stack.assess_stack(versions, ref, pinned)

    def stack_summary(self, versions: dict) -> str:
        return stack.stack_summary(versions)


BACKEND: Backend = HorovodBackend()
