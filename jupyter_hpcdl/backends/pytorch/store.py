"""Where a torch world's ranks meet (runs in the kernel and in ``hpcdl-launch``): a ``torch.distributed.FileStore``
in a new directory of the user's home that only the user can read (mode 0700), on the file system the ranks share.
PyTorch's ``TCPStore`` answers anyone who reaches its port; a file behind the user's own permissions needs no
secret and opens no port. Gloo's (or NCCL's) pair sockets between the ranks stay open to the node, as Horovod's do
(docs/security.md)."""
from __future__ import annotations

import os
import re
import shutil
import tempfile
from typing import TYPE_CHECKING, Sequence

from .dist import DEFAULT_TIMEOUT_S, STORE_ENV, TIMEOUT_ENV

if TYPE_CHECKING:
    from ...job.world import Slot


class FileRendezvous:
    """One world's store: a file the ranks create in a private directory (made in ``parent``: the session's own
    directory, which the session's reaper removes if the kernel dies; else the home); ``stop()`` removes it."""

    port = 0  # no port: the ranks find the store by its path

    def __init__(self, parent: str | None = None):
        self.directory = tempfile.mkdtemp(prefix=".hpcdl-torch-", dir=parent or os.path.expanduser("~"))
        self.path = os.path.join(self.directory, "store")

    def rank_address(self, addr: str) -> str:
        """The store's path (the same on every node: the user's home is shared)."""
        return self.path

    def stop(self, timeout: float = 10) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)


#: The module each rank of ``hpcdl-launch`` runs a torchrun script through (:mod:`.launched`).
LAUNCHED = "jupyter_hpcdl.backends.pytorch.launched"


def rank_command(command: Sequence[str]) -> list[str]:
    """``python script.py args`` (or ``python -m module args``) as one rank of ``hpcdl-launch``: the script runs
    through :mod:`.launched`, which joins the world from the file store first, as ``torchrun`` would from its own
    TCP store. Anything else is refused with what to give."""
    command = list(command)
    python = re.fullmatch(r"python(\d+(\.\d+)?)?", os.path.basename(command[0])) if command else None
    script = len(command) > 1 and (not command[1].startswith("-") or (command[1] == "-m" and len(command) > 2))
    if not (python and script):
        raise ValueError("PyTorch ranks start from a Python script, as with torchrun: give the command as "
                         f"'python3 script.py ARGS' or 'python3 -m module ARGS', not {' '.join(command)!r}")
    return [command[0], "-m", LAUNCHED, *command[1:]]


def rank_env(slot: Slot, store_path: str, iface: str, timeout_s: float | None = None) -> dict[str, str]:
    """What the rank in ``slot`` needs to join the world, in ``torchrun``'s names where it has them. ``timeout_s``:
    the deadline of the join and of each collective (at least :data:`DEFAULT_TIMEOUT_S`, so that a peer still
    importing on a loaded node, or rank 0 writing a checkpoint, is waited for)."""
    return {
        STORE_ENV: store_path,
        TIMEOUT_ENV: str(max(DEFAULT_TIMEOUT_S, timeout_s or 0)),
        "RANK": str(slot.rank),
        "WORLD_SIZE": str(slot.size),
        "LOCAL_RANK": str(slot.local_rank),
        "LOCAL_WORLD_SIZE": str(slot.local_size),
        "GROUP_RANK": str(slot.cross_rank),
        "GLOO_SOCKET_IFNAME": iface,
        "NCCL_SOCKET_IFNAME": iface,
        "HPCDL_NODE": slot.hostname,
    }
