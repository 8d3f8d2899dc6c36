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
DEFAULT_TIMEOUT_S = 1800.0  # PyTorch's own for Gloo; the kernel's stall watch ends a world that hangs sooner


def device():
    """This rank's device: its GPU (by local rank, among those it sees) or the CPU."""
    import torch

    if torch.cuda.is_available():
        return torch.device("cuda", local_rank() % torch.cuda.device_count())
    return torch.device("cpu")


def _gpu_identity() -> str:
    """This rank's GPU as ``host/uuid`` (the physical device it would use), or "" without one (or without NCCL)."""
    import socket

    import torch
    import torch.distributed as dist

    if not (torch.cuda.is_available() and dist.is_nccl_available()):
        return ""
    index = device().index
    uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
    if uuid is None:  # the device's place among the node's GPUs
        visible = [v for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v]
        uuid = visible[index] if index < len(visible) else index
    return f"{socket.gethostname()}/{uuid}"


def init() -> dict:
    """Join the world that the environment describes (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, the store); this
    rank's place in it. NCCL for CUDA tensors where every rank has a GPU of its own (each tells the others, through
    the store, which physical device it would use), Gloo for the rest: ranks that share a GPU train over Gloo.
    Joining again is a no-op."""
    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        missing = [n for n in ("RANK", "WORLD_SIZE", STORE_ENV) if n not in os.environ]
        if missing:
            raise RuntimeError(f"this process has no torch world to join ({', '.join(missing)} unset): the session "
                               "or hpcdl-launch sets them for its ranks")
        world_size, me = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
        timeout = datetime.timedelta(seconds=float(os.environ.get(TIMEOUT_ENV, DEFAULT_TIMEOUT_S)))
        store = dist.FileStore(os.environ[STORE_ENV], world_size)
        store.set_timeout(timeout)
        store.set(f"hpcdl/gpu/{me}", _gpu_identity())
        gpus = [store.get(f"hpcdl/gpu/{r}").decode() for r in range(world_size)]  # waits for every rank
        nccl = all(gpus) and len(set(gpus)) == world_size  # each rank on a GPU of its own
        if nccl:
            torch.cuda.set_device(device())
        dist.init_process_group("cpu:gloo,cuda:nccl" if nccl else "gloo", store=store, rank=me,
                                world_size=world_size, timeout=timeout)
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

    tensor = torch.tensor([float(v) for v in values], dtype=torch.float64)  # on the CPU: Gloo, no GPU sync
    dist.all_reduce(tensor, op=op)
    return [float(v) for v in tensor.tolist()]


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
