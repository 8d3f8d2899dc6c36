"""One Horovod world: which slot (rank, local rank, cross rank) each process takes, and the environment that joins it
to a Gloo rendezvous. Pure functions: the same plan as Horovod's own ``get_host_assignments``, computed from what
the batch system says (e.g. Slurm's task layout), so ranks can be started by srun, ipyparallel or anything else."""
from __future__ import annotations

import re
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


def expand_tasks_per_node(spec: str) -> list[int]:
    """Slurm's ``SLURM_TASKS_PER_NODE`` (``2(x3),1``) as one count per node (``[2, 2, 2, 1]``)."""
    counts: list[int] = []
    for part in spec.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if not m:
            raise ValueError(f"cannot read tasks per node {spec!r}")
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    return counts


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


def slurm_hosts(hostnames: Sequence[str], tasks_per_node: str) -> list[tuple[str, int]]:
    counts = expand_tasks_per_node(tasks_per_node)
    if len(counts) != len(hostnames):
        raise ValueError(f"{len(hostnames)} nodes but tasks per node {tasks_per_node!r}")
    return list(zip(hostnames, counts))


def slurm_slot(env: Mapping[str, str], hostnames: Sequence[str]) -> Slot:
    """This task's slot, from the variables srun gives each task."""
    slots = plan_slots(slurm_hosts(hostnames, env["SLURM_TASKS_PER_NODE"]))
    slot = slots[int(env["SLURM_PROCID"])]
    if slot.hostname != env.get("SLURMD_NODENAME", slot.hostname) or slot.local_rank != int(env.get("SLURM_LOCALID", slot.local_rank)):
        raise ValueError(f"task {env['SLURM_PROCID']} runs on {env.get('SLURMD_NODENAME')} as local {env.get('SLURM_LOCALID')}, "
                         f"not where block distribution puts it ({slot.hostname}, local {slot.local_rank}): use --distribution=block")
    return slot


def gloo_env(slot: Slot, rendezvous_addr: str, rendezvous_port: int, iface: str) -> dict[str, str]:
    """What a rank needs, before Horovod is imported, to join the Gloo world at the rendezvous."""
    return {
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


def iface_for(addr: str) -> str:
    """The network interface that holds ``addr`` (Gloo binds there)."""
    import psutil

    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address == addr for a in addrs):
            return name
    raise ValueError(f"no network interface holds {addr}: give the interface explicitly")
