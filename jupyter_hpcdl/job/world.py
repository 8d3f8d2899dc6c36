"""One world of ranks: which slot (rank, local rank, cross rank) each process takes, and the network interface its
collectives bind to. Pure functions: the same plan as Horovod's own ``get_host_assignments``, computed from what
the batch system says (its hosts and their slots), so ranks can be started by srun, qrsh, ipyparallel or anything
else; the environment that joins a slot to its framework's world is the backend's (:mod:`jupyter_hpcdl.backends`)."""
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
