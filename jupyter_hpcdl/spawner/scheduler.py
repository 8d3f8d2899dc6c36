"""What a spawner needs from a batch system, as pure builders of argv and parsers of output. An adapter is a small
class; Slurm's is in slurm.py, and others (Grid Engine, PBS, LSF) are additions registered under the entry point
group ``jupyter_hpcdl.schedulers``, not forks of the spawner."""
from __future__ import annotations

from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import Sequence

from .options import JobRequest

PENDING, RUNNING, ENDED = "pending", "running", "ended"
#: The scheduler could not be asked (an error or a timeout): the job may be anywhere. Never the same as ended.
UNKNOWN = "unknown"


@dataclass(frozen=True)
class JobInfo:
    """One job as the scheduler reports it. ``phase`` is pending, running or ended; ``state`` and ``reason`` are the
    scheduler's own words (e.g. PENDING / Resources, FAILED / NonZeroExitCode); ``user`` is the job's owner."""

    job_id: str
    phase: str
    state: str
    reason: str = ""
    expected_start: str = ""
    batch_host: str = ""
    exit_code: str = ""
    nodes: tuple[str, ...] = field(default_factory=tuple)
    user: str = ""


@dataclass(frozen=True)
class Availability:
    partition: str
    nodes: int
    idle_nodes: int
    gpus: int
    idle_gpus: int


class Scheduler:
    """Interface of a batch-system adapter (every method is pure)."""

    name = "abstract"
    directive = "#"

    def header(self, req: JobRequest, job_name: str, output: str, workdir: str, comment: str = "") -> list[str]:
        """The script's directives; ``comment`` (checked by the caller: letters, digits and ``=._:%/-`` only) marks
        the job as this hub's."""
        raise NotImplementedError

    def submit_argv(self, env_names: Sequence[str]) -> list[str]:
        """Submission reading the script on stdin; only the named variables go to the job, with their values taken
        from the submitting process's environment (never from its command line)."""
        raise NotImplementedError

    def parse_submit(self, stdout: str) -> str:
        raise NotImplementedError

    def queue_argv(self) -> list[str]:
        """Every job the scheduler holds, one line each (one query serves all users' servers). Only fields that no
        user writes: a job's name or comment can hold newlines, and so forge lines."""
        raise NotImplementedError

    def parse_queue(self, stdout: str) -> dict[str, JobInfo]:
        raise NotImplementedError

    def job_argv(self, job_id: str) -> list[str]:
        """Details of one job that has left the queue (why it ended)."""
        raise NotImplementedError

    def parse_job(self, stdout: str) -> JobInfo | None:
        raise NotImplementedError

    def named_jobs_argv(self, job_name: str) -> list[str]:
        """The ids of every job named ``job_name`` (one per line: nothing a user writes is printed)."""
        raise NotImplementedError

    def parse_job_ids(self, stdout: str) -> list[str]:
        raise NotImplementedError

    def comment_argv(self, job_id: str) -> list[str]:
        """One job's comment, alone (checked whole against the mark by the caller)."""
        raise NotImplementedError

    def job_forgotten(self, stderr: str) -> bool:
        """Whether a failed :meth:`job_argv` means the scheduler no longer knows the job (rather than that it could
        not be asked)."""
        raise NotImplementedError

    def cancel_argv(self, job_id: str) -> list[str]:
        raise NotImplementedError

    def availability_argv(self) -> list[str]:
        raise NotImplementedError

    def parse_availability(self, stdout: str) -> dict[str, Availability]:
        raise NotImplementedError


def load_scheduler(name: str) -> Scheduler:
    """The adapter registered as ``name`` in the entry point group jupyter_hpcdl.schedulers."""
    found = {ep.name: ep for ep in entry_points(group="jupyter_hpcdl.schedulers")}
    if name not in found:
        raise ValueError(f"no batch-system adapter {name!r}; installed: {', '.join(sorted(found)) or 'none'}")
    return found[name].load()()
