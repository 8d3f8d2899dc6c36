"""The scripts of new batch jobs a kernel asks for, built here (pure, every value checked; the directives are the
batch system's adapter's):

- a new allocation for a training session's ranks: one batch job whose tasks are the ranks, each an ipyparallel
  engine in the user's container; ipyparallel's engine launcher for the batch system submits it, and cancels it
  when the session ends;
- a batch run (``jupyter_hpcdl.training.batchrun``): a command run as Horovod ranks by ``hpcdl-launch``, each in the user's
  container, which writes its exit code beside its output when it ends."""
from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from typing import Sequence

from ..backends import DEFAULT as DEFAULT_BACKEND
from ..containers.spec import check_image_ref
from ..jobvalues import check_name, parse_walltime
from ..batchsystems.scheduler import CONFIG_ENV, RankJob, Scheduler


@dataclass(frozen=True)
class NewAllocation:
    """What to ask the batch system for. ``gpus_per_rank``: each rank its own GPU(s) (0 on CPU partitions)."""

    nodes: int = 1
    walltime: str | int = "01:00:00"
    partition: str | None = None
    account: str | None = None
    gpus_per_rank: int = 0
    reservation: str | None = None  # the site's (from the job's offer), never the user's


def _whole(kind: str, value, low: int, high: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise ValueError(f"{kind} must be a whole number from {low} to {high}, not {value!r}")
    return value


def rank_job(alloc: NewAllocation, ranks: int, job_name: str, output: str, workdir: str | None = None) -> RankJob:
    """``alloc`` for ``ranks`` tasks as the adapters take it, every value checked (ValueError says which)."""
    nodes = _whole("nodes", alloc.nodes, 1, 4096)
    _whole("ranks", ranks, nodes, 65536)
    gpus = _whole("gpus_per_rank", alloc.gpus_per_rank, 0, 16)
    return RankJob(job_name, nodes, ranks, parse_walltime(alloc.walltime), output, workdir,
                   None if alloc.partition is None else check_name("partition", alloc.partition),
                   None if alloc.account is None else check_name("account", alloc.account), gpus,
                   None if alloc.reservation is None else check_name("reservation", alloc.reservation))


def _prologue(sched: Scheduler) -> list[str]:
    """The site's configuration of the batch system for the job's side (as the server's job has it), and its
    prologue, as every job script of the site runs it first (in bash, as the server's; its epilogue is the server's
    job's alone: these jobs end with their ranks)."""
    config = sched.job_config()
    return [*([f"export {CONFIG_ENV}={shlex.quote(config)}"] if config else []),
            *(["# the site's prologue", *sched.prologue] if sched.prologue else [])]


def check_new_allocation(sched: Scheduler, alloc: NewAllocation, ranks: int) -> None:
    """Whether ``sched`` can write a job of ``ranks`` ranks for ``alloc`` (ValueError says what to change)."""
    sched.rank_job_header(rank_job(alloc, ranks, "hpcdl-check", "/tmp/out"))


def engines_job_template(sched: Scheduler, alloc: NewAllocation, ranks: int, python: str, mpi: bool = False) -> str:
    """The batch script of a session's new allocation, as an ipyparallel batch template: ``{cluster_id}``,
    ``{profile_dir}`` and ``{program_and_args}`` (the engine in its container) are filled in by the launcher; the
    ranks are tasks started by ``jupyter_hpcdl.job.tasks`` with ``python`` (the host's). ``mpi``: the ranks' MPI world
    from the batch system (Slurm's PMIx)."""
    job = rank_job(alloc, ranks, "hpcdl-engines-{cluster_id}",
                   "{profile_dir}/log/hpcdl-engines-" + sched.job_id_placeholder + ".out")
    # the engines find the controller by these arguments (not by exported variables: the job may be submitted by
    # the allocation's owner on the kernel's behalf, from another environment); the site's lines may hold braces,
    # which the launcher's formatting would read as its fields
    site = [line.replace("{", "{{").replace("}", "}}") for line in (*sched.site_directives(), *_prologue(sched))]
    return "\n".join(["#!/bin/bash", *sched.directives(sched.rank_job_options(job)), *site,
                      f"exec {check_job_dir(python)} -m jupyter_hpcdl.job.tasks --ranks={ranks} "
                      f"--gpus-per-rank={job.gpus_per_rank} --name=hpcdl-engines " + ("--mpi " if mpi else "")
                      + "-- {program_and_args} --profile-dir={profile_dir} --cluster-id={cluster_id}"]) + "\n"


#: What a batch run's directory may be named with: it goes into directive lines, which have no quoting.
SAFE_PATH = re.compile(r"/[A-Za-z0-9._+/-]+")


def check_job_dir(path: str) -> str:
    if not isinstance(path, str) or not SAFE_PATH.fullmatch(path) or "/../" in path + "/":
        raise ValueError(f"the batch run's directory {path!r} must be an absolute path of letters, digits and "
                         "'._+-/' (a batch script cannot carry other characters safely): give another directory")
    return path


def batch_run_script(sched: Scheduler, alloc: NewAllocation, ranks: int, job_dir: str, host_python: str,
                     image: str, command: Sequence[str], job_name: str, backend: str = DEFAULT_BACKEND) -> str:
    """The batch script of a batch run: ``ranks`` tasks of the training ``backend`` over ``alloc.nodes`` nodes,
    their output (labelled by rank) in ``job_dir/output.log``, the exit code in ``job_dir/status.json``; the
    command's words are quoted for the shell, so they are passed exactly as given."""
    job_dir, python = check_job_dir(job_dir), check_job_dir(host_python)
    check_image_ref(image)
    check_name("job name", job_name)
    check_name("backend", backend)
    if not command or not all(isinstance(word, str) and word and "\0" not in word for word in command):
        raise ValueError("the command must be a non-empty list of non-empty strings")
    job = rank_job(alloc, ranks, job_name, f"{job_dir}/output.log", job_dir)
    return "\n".join(["#!/bin/bash", *sched.rank_job_header(job), *_prologue(sched),
                      f"exec {python} -m jupyter_hpcdl.job.launch --backend={backend} --image={image} --label "
                      f"--status-file={job_dir}/status.json -- " + shlex.join(command)]) + "\n"
