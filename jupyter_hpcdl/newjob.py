"""A new allocation for a training session's ranks, when asked: one batch job whose tasks are the ranks, each an
ipyparallel engine in the user's container. The script is built here (pure, every value checked); ipyparallel's
Slurm engine launcher submits it, and cancels the job when the session ends."""
from __future__ import annotations

from dataclasses import dataclass

from .jobvalues import check_name, format_walltime, parse_walltime


@dataclass(frozen=True)
class NewAllocation:
    """What to ask the batch system for. ``gpus_per_rank``: each rank its own GPU(s) (0 on CPU partitions)."""

    nodes: int = 1
    walltime: str | int = "01:00:00"
    partition: str | None = None
    account: str | None = None
    gpus_per_rank: int = 0


def _whole(kind: str, value, low: int, high: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise ValueError(f"{kind} must be a whole number from {low} to {high}, not {value!r}")
    return value


def engines_job_template(alloc: NewAllocation, ranks: int, mpi: bool = False) -> str:
    """The batch script as an ipyparallel batch template: ``{n}``, ``{cluster_id}``, ``{profile_dir}`` and
    ``{program_and_args}`` (the engine in its container) are filled in by the launcher. ``mpi``: srun gives the
    ranks their MPI world (PMIx)."""
    nodes = _whole("nodes", alloc.nodes, 1, 4096)
    _whole("ranks", ranks, nodes, 65536)
    gpus = _whole("gpus_per_rank", alloc.gpus_per_rank, 0, 16)
    lines = ["#!/bin/sh", "#SBATCH --job-name=hpcdl-engines-{cluster_id}", "#SBATCH --export=ALL",
             f"#SBATCH --nodes={nodes}", "#SBATCH --ntasks={n}", "#SBATCH --distribution=block",
             f"#SBATCH --time={format_walltime(parse_walltime(alloc.walltime))}",
             "#SBATCH --output={profile_dir}/log/hpcdl-engines-%j.out"]
    if alloc.partition is not None:
        lines.append(f"#SBATCH --partition={check_name('partition', alloc.partition)}")
    if alloc.account is not None:
        lines.append(f"#SBATCH --account={check_name('account', alloc.account)}")
    if gpus:
        lines.append(f"#SBATCH --gpus-per-task={gpus}")
    # the engines find the controller by these arguments (not only by exported variables: the job may be
    # submitted by the allocation's owner on the kernel's behalf, from another environment)
    lines.append("srun --kill-on-bad-exit=0 " + ("--mpi=pmix " if mpi else "")
                 + "{program_and_args} --profile-dir={profile_dir} --cluster-id={cluster_id}")
    return "\n".join(lines) + "\n"
