"""One Horovod world: which slot (rank, local rank, cross rank) each process takes, and the environment that joins it
to a Gloo rendezvous. Pure functions: the same plan as Horovod's own ``get_host_assignments``, computed from what
the batch system says (its hosts and their slots), so ranks can be started by srun, qrsh, ipyparallel or anything
else."""
from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from typing import Mapping, Sequence


@dataclass(frozen=True)
class Slot:
    hostname: str
    rank: int
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int
    size: int


def plan_slots(hosts: Sequence[tuple[str, int]]) -> list[Slot]:
    """Ranks host by host in order, as Horovod and Slurm's block distribution both number them."""
    size = sum(n for _, n in hosts)
    slots, rank = [], 0
    for index, (host, n) in enumerate(hosts):
        for local_rank in range(n):
            with_local = [i for i, (_, m) in enumerate(hosts) if m > local_rank]
            slots.append(Slot(host, rank, local_rank, n, with_local.index(index), len(with_local), size))
            rank += 1
    return slots


def task_slot(hosts: Sequence[tuple[str, int]], index: int, node: str | None = None,
              local_rank: int | None = None) -> Slot:
    """Task ``index``'s slot in the plan of ``hosts``; where the batch system says the task's node and local index,
    they must be where block distribution puts it."""
    slots = plan_slots(hosts)
    if not 0 <= index < len(slots):
        raise ValueError(f"task {index} is not in a world of {len(slots)}")
    slot = slots[index]
    if (node is not None and node != slot.hostname) or (local_rank is not None and local_rank != slot.local_rank):
        raise ValueError(f"task {index} runs on {node} as local {local_rank}, not where block distribution puts it "
                         f"({slot.hostname}, local {slot.local_rank}): start the step block-wise")
    return slot


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


def hosts_from_tasks(tasks: Sequence[tuple[int, str]]) -> list[tuple[str, int]]:
    """Hosts and their task counts, in rank order, from (rank, host) pairs of a block-distributed step."""
    hosts: list[tuple[str, int]] = []
    for _, host in sorted(tasks):
        if hosts and hosts[-1][0] == host:
            hosts[-1] = (host, hosts[-1][1] + 1)
        elif any(h == host for h, _ in hosts):
            raise ValueError(f"ranks on {host} are not contiguous: start the step with --distribution=block")
        else:
            hosts.append((host, 1))
    return hosts


def iface_for(addr: str, interfaces: Mapping[str, Sequence[tuple[str, str | None]]] | None = None) -> str:
    """The network interface that holds ``addr`` (Gloo binds there): the one with that address, else the one whose
    network holds it (a host named by another address of loopback's 127.0.0.0/8, say). ``interfaces``: name →
    (address, netmask) pairs; this machine's by default."""
    if interfaces is None:
        import psutil

        interfaces = {name: [(a.address, a.netmask) for a in addrs] for name, addrs in psutil.net_if_addrs().items()}
    for name, addrs in interfaces.items():
        if any(a == addr for a, _ in addrs):
            return name
    try:
        wanted = ipaddress.ip_address(addr)
    except ValueError:
        raise ValueError(f"{addr!r} is not an IP address") from None
    holding = []  # (prefix length, name): the most specific network wins
    for name, addrs in interfaces.items():
        for a, mask in addrs:
            try:
                network = ipaddress.ip_network(f"{a.split('%')[0]}/{mask}", strict=False) if mask else None
            except ValueError:  # a link-layer address, or one of another family
                continue
            if network is not None and wanted in network:
                holding.append((network.prefixlen, name))
    if holding:
        return max(holding)[1]
    raise ValueError(f"no network interface holds {addr}: give the interface explicitly")
