"""``torch.distributed``'s own calls on a rank, in one place: join the world through the session's file store,
pick this rank's device, and the small collectives the session agrees through. The rest of the backend reaches
the process group only through here.

Runs on the ranks (ipyparallel engines, ``hpcdl-launch``'s processes); the kernel imports it without calling it."""
from __future__ import annotations

import datetime
import os

#: The rank's environment: the store's file (in a directory only the user can read) and the deadline of the join
#: and of every collective, in seconds.
STORE_ENV = "HPCDL_TORCH_STORE"
TIMEOUT_ENV = "HPCDL_TORCH_TIMEOUT"
DEFAULT_TIMEOUT_S = 300.0


def device():
    """This rank's device: its GPU (by local rank, among those it sees) or the CPU."""
    import torch

    if torch.cuda.is_available():
        return torch.device("cuda", local_rank() % torch.cuda.device_count())
    return torch.device("cpu")


def init() -> dict:
    """Join the world that the environment describes (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, the store); this
    rank's place in it. Gloo on the CPU, NCCL where the rank has a GPU. Joining again is a no-op."""
    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        missing = [n for n in ("RANK", "WORLD_SIZE", STORE_ENV) if n not in os.environ]
        if missing:
            raise RuntimeError(f"this process has no torch world to join ({', '.join(missing)} unset): the session "
                               "or hpcdl-launch sets them for its ranks")
        world_size = int(os.environ["WORLD_SIZE"])
        timeout = datetime.timedelta(seconds=float(os.environ.get(TIMEOUT_ENV, DEFAULT_TIMEOUT_S)))
        gpu = torch.cuda.is_available() and dist.is_nccl_available()
        if gpu:
            torch.cuda.set_device(device())
        dist.init_process_group("nccl" if gpu else "gloo", store=dist.FileStore(os.environ[STORE_ENV], world_size),
                                rank=int(os.environ["RANK"]), world_size=world_size, timeout=timeout)
    return {"rank": rank(), "size": size(), "local_rank": local_rank()}


def rank() -> int:
    import torch.distributed as dist

    return dist.get_rank()


def size() -> int:
    import torch.distributed as dist

    return dist.get_world_size()


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def _allreduce(values: list[float], op) -> list[float]:
    import torch
    import torch.distributed as dist

    tensor = torch.tensor([float(v) for v in values], dtype=torch.float64, device=device())
    dist.all_reduce(tensor, op=op)
    return [float(v) for v in tensor.cpu().tolist()]


def allreduce_max(values: list[float], name: str = "") -> list[float]:
    """The elementwise maximum over all ranks (every rank must call it; the process group orders the calls, so
    ``name`` only documents the call)."""
    import torch.distributed as dist

    return _allreduce(values, dist.ReduceOp.MAX)


def allreduce_sum(values: list[float], name: str = "") -> list[float]:
    """The elementwise sum over all ranks (every rank must call it)."""
    import torch.distributed as dist

    return _allreduce(values, dist.ReduceOp.SUM)


def shutdown() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def check_allreduce() -> dict:
    """Join the world (its environment was set before) and sum rank+1 over the ranks, which must equal
    size*(size+1)/2: this rank's place, the sum, and whether it is right."""
    import torch

    place = init()
    total = allreduce_sum([place["rank"] + 1])[0]
    n = place["size"]
    return dict(**place, allreduce_sum=total, allreduce_ok=total == n * (n + 1) / 2, gpus=torch.cuda.device_count())
