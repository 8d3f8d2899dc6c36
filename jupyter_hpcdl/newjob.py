"""The scripts of new batch jobs a kernel asks for, built here (pure, every value checked):

- a new allocation for a training session's ranks: one batch job whose tasks are the ranks, each an ipyparallel
  engine in the user's container; ipyparallel's Slurm engine launcher submits it, and cancels it when the session
  ends;
- a batch run (``jupyter_hpcdl.batch``): a command run as Horovod ranks by ``hpcdl-launch``, each in the user's
  container, which writes its exit code beside its output when it ends."""
from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from typing import Sequence

from .containers.spec import check_image_ref

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


def _header(alloc: NewAllocation, ranks: int, job_name: str, ntasks: str, extra: list[str]) -> list[str]:
    """The #SBATCH lines both scripts share, every value checked: ``ranks`` tasks (written as ``ntasks``, which may
    be a template's placeholder) block-wise over ``alloc.nodes`` nodes, then ``extra`` directives."""
    nodes = _whole("nodes", alloc.nodes, 1, 4096)
    _whole("ranks", ranks, nodes, 65536)
    gpus = _whole("gpus_per_rank", alloc.gpus_per_rank, 0, 16)
    lines = ["#!/bin/sh", f"#SBATCH --job-name={job_name}", "#SBATCH --export=ALL", f"#SBATCH --nodes={nodes}",
             f"#SBATCH --ntasks={ntasks}", "#SBATCH --distribution=block",
             f"#SBATCH --time={format_walltime(parse_walltime(alloc.walltime))}",
             *(f"#SBATCH {directive}" for directive in extra)]
    if alloc.partition is not None:
        lines.append(f"#SBATCH --partition={check_name('partition', alloc.partition)}")
    if alloc.account is not None:
        lines.append(f"#SBATCH --account={check_name('account', alloc.account)}")
    if gpus:
        lines.append(f"#SBATCH --gpus-per-task={gpus}")
    return lines


def engines_job_template(alloc: NewAllocation, ranks: int, mpi: bool = False) -> str:
    """The batch script as an ipyparallel batch template: ``{n}``, ``{cluster_id}``, ``{profile_dir}`` and
    ``{program_and_args}`` (the engine in its container) are filled in by the launcher. ``mpi``: srun gives the
    ranks their MPI world (PMIx)."""
    lines = _header(alloc, ranks, "hpcdl-engines-{cluster_id}", "{n}",
                    ["--output={profile_dir}/log/hpcdl-engines-%j.out"])
    # the engines find the controller by these arguments (not only by exported variables: the job may be
    # submitted by the allocation's owner on the kernel's behalf, from another environment)
    lines.append("srun --kill-on-bad-exit=0 " + ("--mpi=pmix " if mpi else "")
                 + "{program_and_args} --profile-dir={profile_dir} --cluster-id={cluster_id}")
    return "\n".join(lines) + "\n"


#: What a batch run's directory may be named with: it goes into #SBATCH lines, which have no quoting.
SAFE_PATH = re.compile(r"/[A-Za-z0-9._+/-]+")


def check_job_dir(path: str) -> str:
    if not isinstance(path, str) or not SAFE_PATH.fullmatch(path) or "/../" in path + "/":
        raise ValueError(f"the batch run's directory {path!r} must be an absolute path of letters, digits and "
                         "'._+-/' (a batch script cannot carry other characters safely): give another directory")
    return path


def batch_run_script(alloc: NewAllocation, ranks: int, job_dir: str, host_python: str, image: str,
                     command: Sequence[str], job_name: str) -> str:
    """The batch script of a batch run: ``ranks`` tasks over ``alloc.nodes`` nodes, their output (labelled by rank)
    in ``job_dir/output.log``, the exit code in ``job_dir/status.json``; the command's words are quoted for the
    shell, so they are passed exactly as given."""
    job_dir, python = check_job_dir(job_dir), check_job_dir(host_python)
    check_image_ref(image)
    check_name("job name", job_name)
    if not command or not all(isinstance(word, str) and word and "\0" not in word for word in command):
        raise ValueError("the command must be a non-empty list of non-empty strings")
    lines = _header(alloc, ranks, job_name, str(ranks), [f"--output={job_dir}/output.log", f"--chdir={job_dir}"])
    lines.append(f"exec {python} -m jupyter_hpcdl.launch --image={image} --label "
                 f"--status-file={job_dir}/status.json -- " + shlex.join(command))
    return "\n".join(lines) + "\n"
