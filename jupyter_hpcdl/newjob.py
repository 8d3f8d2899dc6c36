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


def engines_job_template(alloc: NewAllocation, ranks: int, mpi: bool = False, warn_before: int | None = None) -> str:
    """The batch script as an ipyparallel batch template: ``{n}``, ``{cluster_id}``, ``{profile_dir}`` and
    ``{program_and_args}`` (the engine in its container) are filled in by the launcher. ``mpi``: srun gives the
    ranks their MPI world (PMIx). ``warn_before``: that many seconds before the walltime ends Slurm signals the
    batch shell (USR1), which leaves :func:`walltime_flag` for the session; it then stops the ranks at the next
    batch they agree on and checkpoints. Only the shell is signalled: the ranks' steps never see it."""
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
    if warn_before is not None:
        lines.append(f"#SBATCH --signal=B:USR1@{_whole('warn_before', warn_before, 1, 65535)}")
    # the engines find the controller by these arguments (not only by exported variables: the job may be
    # submitted by the allocation's owner on the kernel's behalf, from another environment)
    srun = ("srun --kill-on-bad-exit=0 " + ("--mpi=pmix " if mpi else "")
            + "{program_and_args} --profile-dir={profile_dir} --cluster-id={cluster_id}")
    if warn_before is None:
        lines.append(srun)
    else:  # in the background, so that the shell takes the signal while srun runs (a foreground child defers it)
        lines += [f"trap 'touch {WALLTIME_FLAG}' USR1", f"{srun} &", "step=$!",
                  'while kill -0 "$step" 2>/dev/null; do wait "$step"; done', 'wait "$step"']
    return "\n".join(lines) + "\n"


WALLTIME_FLAG = "{profile_dir}/log/hpcdl-walltime-{cluster_id}"


def walltime_flag(profile_dir: str, cluster_id: str) -> str:
    """The file the ranks' batch script leaves when Slurm warns that the walltime ends soon."""
    return WALLTIME_FLAG.format(profile_dir=profile_dir, cluster_id=cluster_id)
