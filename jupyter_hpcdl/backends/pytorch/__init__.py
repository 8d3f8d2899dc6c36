"""The PyTorch backend: the user's ``torch.nn.Module`` trained with ``DistributedDataParallel``, the ranks joined by
``torch.distributed`` (Gloo on CPUs, NCCL on GPUs) through a file store only the user can read. Registered as
``torch`` in the ``jupyter_hpcdl.backends`` entry point group: ``TrainingSession(backend="torch")``. Every import of
PyTorch in the package is in this package, and none at import time (the kernel loads the backend without it)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from ..base import Backend, StackFinding
from . import dist, rank_data, scripts, stack, store
from . import rank as training

if TYPE_CHECKING:
    from ...job.world import Slot


class TorchBackend:
    """The :class:`~jupyter_hpcdl.backends.base.Backend` of PyTorch (rank members are this package's functions)."""

    name = "torch"

    join = staticmethod(training.join)
    leave = staticmethod(training.leave)
    rank = staticmethod(dist.rank)
    size = staticmethod(dist.size)
    local_rank = staticmethod(dist.local_rank)
    allreduce_max = staticmethod(dist.allreduce_max)
    allreduce_sum = staticmethod(dist.allreduce_sum)
    build = staticmethod(training.build)
    fit = staticmethod(training.fit)
    shard_size = staticmethod(training.shard_size)
    weights_digest = staticmethod(training.weights_digest)
    set_lr = staticmethod(training.set_lr)
    save = staticmethod(training.save)
    load = staticmethod(training.load)
    run_script = staticmethod(scripts.run_script)
    load_shard = staticmethod(rank_data.load_shard)
    check_allreduce = staticmethod(dist.check_allreduce)

    probe_script = stack.PROBE_SCRIPT

    def start_rendezvous(self, bind: str, hosts: Sequence[tuple[str, int]], size: int, directory: str | None = None):
        return store.FileRendezvous(directory)

    def rank_env(self, slot: Slot, rendezvous_addr: str, rendezvous_port: int, iface: str,
                 timeout_s: float | None = None) -> dict[str, str]:
        return store.rank_env(slot, rendezvous_addr, iface, timeout_s)

    def rank_command(self, command: Sequence[str]) -> list[str]:
        return store.rank_command(command)

    def mpi_env(self) -> dict[str, str]:
        raise ValueError("the torch backend joins its ranks through its own store over Gloo or NCCL, not MPI: use "
                         "world='gloo' (the default)")

    def pinned_version(self, requirements: Sequence[str]) -> str | None:
        return stack.pinned_version(requirements)

    def assess_stack(self, versions: dict, ref: str, pinned: str | None) -> list[StackFinding]:
        return stack.assess_stack(versions, ref, pinned)

    def stack_summary(self, versions: dict) -> str:
        return stack.stack_summary(versions)


BACKEND: Backend = TorchBackend()
