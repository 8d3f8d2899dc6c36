"""The framework seam: what a training backend (Horovod with TensorFlow/Keras today; ``torch.distributed`` could be
another) gives the rest of the package, which knows no framework. Each member says where it runs:

- **rank**: on each rank (an ipyparallel engine, or a process of ``hpcdl-launch``). These are plain functions of an
  importable module: the kernel ships them to the engines by reference (module path and name), and every rank has
  this same package installed, so a rank imports the backend's module and calls the function there.
- **kernel**: in the user's kernel (the training session), which must not import the framework itself.
- **launcher**: in ``hpcdl-launch`` (the batch job's side), before any rank starts.
- **doctor**: in ``hpcdl-doctor`` on the hub host, and (``probe_script``) in a container of the user's image.

The data forms a backend shards (a ``.npz`` file, arrays, a function of rank and size) are defined here too, since
both the kernel's checks and the backend's ranks know them."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Protocol, Sequence

if TYPE_CHECKING:
    from ..job.world import Slot


@dataclass(frozen=True)
class NpzFile:
    """Arrays ``x`` and ``y`` (or the names given) in a ``.npz`` file on the shared file system; each rank reads its
    shard (every size-th sample) memory-mapped, so no rank holds more than its part."""

    path: str
    x: str = "x"
    y: str = "y"


def user_callbacks(callbacks, rank: int, size: int) -> list:
    """The user's callbacks on rank ``rank``: a list, or a function ``(rank, size) -> list`` (e.g. one that writes
    a log on rank 0 only)."""
    made = callbacks(rank, size) if callable(callbacks) else callbacks
    return list(made or [])


@dataclass(frozen=True)
class StackFinding:
    """One thing the doctor reports about an image's training stack: ``level`` is ``"fail"`` or ``"warn"``."""

    level: str
    message: str
    fix: str


class Rendezvous(Protocol):
    """Where the ranks of one world meet (kernel, launcher): started for a plan, addressed by the ranks, stopped."""

    port: int

    def rank_address(self, addr: str) -> str: ...

    def stop(self, timeout: float = 10) -> None: ...


class Backend(Protocol):
    """A training backend. Members typed as ``Callable`` are module-level functions (rank ones are shipped by
    reference); the others are methods or values of the backend object."""

    #: The name it is registered under (entry point group ``jupyter_hpcdl.backends``).
    name: str

    # -- rank: joining and leaving the world ---------------------------------------------------------------------
    #: ``join(env) -> dict``: set ``env`` (the world's variables) in this process, join the world, pick this rank's
    #: GPU; this rank's place: ``rank``, ``size``, ``local_rank``, ``host``, ``node``, ``pid``, ``gpus``,
    #: ``cuda_visible_devices``, ``container_mode``.
    join: Callable[[dict], dict]
    #: ``leave()``: leave the world and forget this rank's state (a no-op when not joined).
    leave: Callable[[], None]

    #: ``rank()``, ``size()``, ``local_rank()``: this rank's place in the world it joined.
    rank: Callable[[], int]
    size: Callable[[], int]
    local_rank: Callable[[], int]
    #: ``allreduce_max(values, name)``, ``allreduce_sum(values, name)``: the elementwise maximum or sum of a few
    #: numbers over all ranks (every rank calls it, with the same ``name``); how the ranks agree (steps, stop).
    allreduce_max: Callable[[list, str], list]
    allreduce_sum: Callable[[list, str], list]

    # -- rank: the session's training ----------------------------------------------------------------------------
    #: ``build(spec) -> dict``: the user's model (its optimizer made to average over the ranks, the learning rate
    #: scaled when asked) and this rank's data shard; the ranks agree on the steps of an epoch in one collective
    #: that every rank joins, even one that failed. Returns ``rank``, ``samples``, ``steps_per_epoch``,
    #: ``batches_per_pass``, ``optimizer``, ``learning_rate``.
    build: Callable[[Any], dict]
    #: ``fit(epochs, stop_file, publish_every, check_every, min_interval) -> dict``: train more epochs with the
    #: rank callbacks (live metrics published to the kernel, the agreed stop when ``stop_file`` exists, the count of
    #: epochs and batches); returns ``rank``, ``history``, ``stopped``, ``epochs_done``, ``weights``.
    fit: Callable[..., dict]
    #: ``shard_size() -> dict``: ``rank``, ``samples``, ``batches_per_pass``.
    shard_size: Callable[[], dict]
    #: ``weights_digest() -> str``: a digest of this rank's weights (equal on every rank of a world in step).
    weights_digest: Callable[[], str]
    #: ``set_lr(lr) -> float``: set the optimizer's learning rate; the rate now (ValueError for a schedule).
    set_lr: Callable[[float], float]
    #: ``save(path) -> str | None``: rank 0 writes a checkpoint directory (model, optimizer state, progress) and
    #: returns it; the other ranks None.
    save: Callable[[str], "str | None"]
    #: ``load(path) -> dict``: every rank continues from the checkpoint: ``rank``, ``epochs_done``, ``weights``,
    #: ``iterations``, ``saved_world_size``.
    load: Callable[[str], dict]
    #: ``run_script(path, args, stop_file) -> dict``: run a user's script as ``__main__`` in this rank's world, with
    #: the rank callbacks added to its training; ``rank``, ``exit_code``, ``stopped``, ``epochs_done``.
    run_script: Callable[..., dict]
    #: ``load_shard(data, rank, size)``: this rank's shard of the user's data (any form of ``spec.check_data``),
    #: with ``samples`` and ``x``/``y`` or ``dataset``.
    load_shard: Callable[[Any, int, int], Any]

    # -- rank: a process's check of its world ----------------------------------------------------------------------
    #: ``check_allreduce() -> dict``: join the world (its environment is set), sum rank+1 over the ranks; ``rank``,
    #: ``size``, ``local_rank``, ``allreduce_sum``, ``allreduce_ok``, ``gpus``.
    check_allreduce: Callable[[], dict]

    # -- kernel and launcher: the world's environment and rendezvous ---------------------------------------------
    def start_rendezvous(self, bind: str, hosts: Sequence[tuple[str, int]], size: int,
                         directory: str | None = None) -> Rendezvous:
        """A rendezvous bound to ``bind`` only, started for ``size`` ranks over ``hosts`` (name, slots);
        ``directory``: the session's private directory, for a rendezvous that meets in files (else the home)."""

    def rank_env(self, slot: Slot, rendezvous_addr: str, rendezvous_port: int, iface: str,
                 timeout_s: float | None = None) -> dict[str, str]:
        """What the rank in ``slot`` needs in its environment, before the framework is imported, to join the world
        at the rendezvous over ``iface`` (waiting up to ``timeout_s`` for its peers)."""

    def rank_command(self, command: Sequence[str]) -> list[str]:
        """What each rank of ``hpcdl-launch`` runs for the user's ``command`` (which joins the world from the
        environment ``rank_env`` gives, or is wrapped so that it does); a ValueError that says what to give where
        the backend cannot start it."""

    def mpi_env(self) -> dict[str, str]:
        """What a rank needs to join the world over MPI (rank and size come from the MPI launcher)."""

    # -- doctor ----------------------------------------------------------------------------------------------------
    #: Python run in a container of the image (``python3 -c``); it prints one line ``HPCDL-VERSIONS {json}`` with
    #: ``python``, ``jupyter-hpcdl``, ``ipykernel``, ``ipyparallel`` and whatever the backend's own checks read.
    probe_script: str

    def pinned_version(self, requirements: Sequence[str]) -> str | None:
        """The framework release jupyter-hpcdl pins (from its requirements), or None."""

    def assess_stack(self, versions: dict, ref: str, pinned: str | None) -> list[StackFinding]:
        """What is wrong with the training stack of image ``ref`` (``versions``: the probe's line); empty if
        nothing."""

    def stack_summary(self, versions: dict) -> str:
        """The training stack in a few words, for the doctor's OK line (e.g. ``TensorFlow 2.15.1, Horovod 0.28.1
        (loads)``)."""
