"""What a spawner needs from a batch system, as pure builders of argv and parsers of output. An adapter is a small
class; Slurm's is in slurm.py, and others (Grid Engine, PBS, LSF) are additions registered under the entry point
group ``jupyter_hpcdl.schedulers``, not forks of the spawner."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import Mapping, Sequence

from traitlets import List, Unicode, validate
from traitlets.config import Config, Configurable

from ..jobvalues import format_walltime

PENDING, RUNNING, ENDED = "pending", "running", "ended"
#: The hub's configuration of the adapter, handed to its jobs (JSON: ``{"GridEngine": {"pe_multi_node": ...}}``), so
#: that the jobs a kernel submits get the site's directives, prologue and names as the hub's do.
CONFIG_ENV = "HPCDL_SCHEDULER_CONFIG"
OFFER_ENV = "HPCDL_OFFER"  # in a server's job: what its user may ask for (the hub's SiteProfile, narrowed for them)
#: The scheduler could not be asked (an error or a timeout): the job may be anywhere. Never the same as ended.
UNKNOWN = "unknown"


@dataclass(frozen=True)
class JobRequest:
    """A checked request for a job (the spawner's options form builds it): every value bounded and allow-listed."""

    partition: str
    nodes: int
    gpus_per_node: int
    walltime_minutes: int
    image: str  # catalogue name
    image_ref: str
    account: str | None = None
    gpu_type: str | None = None
    memory_gb: int | None = None  # per node; None where the partition sets no memory limit
    reservation: str | None = None  # the site's, from the user's or group's limits (never a user option)

    @property
    def gpu_hours(self) -> float:
        return self.nodes * self.gpus_per_node * self.walltime_minutes / 60

    @property
    def walltime(self) -> str:
        return format_walltime(self.walltime_minutes)


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
class JobResources:
    """What the scheduler says of a running job to the job itself: seconds of walltime left (None: no limit, or not
    known), its partition (queue), and its GPUs, per node where the scheduler counts them so (Slurm's GRES) or per
    task (Grid Engine's per-slot consumable)."""

    time_left_s: int | None
    partition: str = ""
    gpus_per_node: int | None = None
    gpus_per_task: int | None = None
    time_left: str = ""  # as the scheduler writes it, for people


@dataclass(frozen=True)
class RankJob:
    """A batch job whose tasks are ranks (a training session's new allocation, a batch run): ``ranks`` tasks
    block-wise over ``nodes`` nodes, each with ``gpus_per_rank`` GPUs. Every value is checked by its builder
    (``jupyter_hpcdl.job.newjob``) before an adapter writes it."""

    job_name: str
    nodes: int
    ranks: int
    walltime_min: int
    output: str
    workdir: str | None = None
    partition: str | None = None
    account: str | None = None
    gpus_per_rank: int = 0
    reservation: str | None = None  # the site's, from the user's or group's limits


@dataclass(frozen=True)
class Availability:
    partition: str
    nodes: int
    idle_nodes: int
    gpus: int
    idle_gpus: int


class Scheduler(Configurable):
    """Interface of a batch-system adapter: every method is pure (argv builders, output parsers). The site's hooks
    are configuration (``c.Slurm.extra_directives = ["--qos=interactive"]``, ``c.GridEngine.prologue = [...]``)."""

    name = "abstract"
    directive = "#"
    #: What the scheduler replaces by the job's id in an output path (Slurm's ``%j``).
    job_id_placeholder = "%j"
    #: The variable that holds the job's id inside the job.
    job_id_env = "SLURM_JOB_ID"
    #: The variable that names the node a job's script runs on (the scheduler's name for it).
    node_env = "SLURMD_NODENAME"
    #: Whether a job's environment stays between its user and the administrators (Slurm's). Where every user can
    #: read it (Grid Engine's ``qstat -j``), the spawner gives the job its secrets in a file only the user reads.
    private_env = True
    #: Whether :meth:`parse_queue` says why a job waits; where not, :meth:`job_argv` of a pending job does.
    queue_has_reasons = True

    extra_directives = List(Unicode(), help="The site's own lines for every job's header, without the directive "
                            "(Slurm: '--qos=interactive', '--constraint=a100'; Grid Engine: '-P project', "
                            "'-l scratch=10G'); they come after the ones built from the request.").tag(config=True)
    prologue = List(Unicode(), help="Shell lines every job script runs first (e.g. 'module load cuda/12.2').").tag(config=True)
    epilogue = List(Unicode(), help="Shell lines every job script runs after the server exits, with or without an "
                    "error (not when the job is cancelled or out of time: use the scheduler's own epilog for what must "
                    "always run); the script then exits with the server's code.").tag(config=True)

    @validate("extra_directives", "prologue", "epilogue")
    def _one_line_each(self, proposal):
        for line in proposal["value"]:
            if "\n" in line or "\r" in line or "\0" in line:
                raise ValueError(f"{type(self).__name__}.{proposal['trait'].name}: {line!r} must be one line")
        return proposal["value"]

    def options(self, req: JobRequest, job_name: str, output: str, workdir: str, comment: str = "") -> list[str]:
        """The directives built from the request, without the directive prefix; ``comment`` (checked by the caller:
        letters, digits and ``=._:%/-`` only) marks the job as this hub's."""
        raise NotImplementedError

    def header(self, req: JobRequest, job_name: str, output: str, workdir: str, comment: str = "") -> list[str]:
        """The script's directive lines: the request's, then the site's ``extra_directives``."""
        return [*self.directives(self.options(req, job_name, output, workdir, comment)), *self.site_directives()]

    def directives(self, options: Sequence[str]) -> list[str]:
        return [f"{self.directive} {o}" for o in options]

    def site_directives(self) -> list[str]:
        """The site's ``extra_directives`` as lines, for every job's header after the request's."""
        return self.directives(self.extra_directives)

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

    def parse_job_ids(self, stdout: str, job_name: str = "") -> list[str]:
        """The ids :meth:`named_jobs_argv` printed (an adapter whose command lists every job filters by
        ``job_name`` here)."""
        raise NotImplementedError

    def comment_argv(self, job_id: str) -> list[str]:
        """One job's comment, alone (checked whole against the mark by the caller)."""
        raise NotImplementedError

    def parse_comment(self, stdout: str) -> str:
        """The comment in what :meth:`comment_argv` printed."""
        return stdout

    def accounting_argv(self, job_id: str) -> list[str] | None:
        """Where a job that :meth:`job_argv` no longer knows is still told of (Grid Engine's ``qacct``), parsed by
        :meth:`parse_job`; None where the two are one."""
        return None

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


    # -- jobs whose tasks are ranks, submitted from inside a job ------------------------------------------------------
    #: Variables of a job that a job submitted from inside it must not inherit (sbatch reads SLURM_* as options).
    job_env_prefixes: tuple[str, ...] = ()

    def rank_job_options(self, job: RankJob) -> list[str]:
        """The directives (without the prefix) of a job of ``job.ranks`` tasks, block-wise over ``job.nodes`` nodes."""
        raise NotImplementedError

    def rank_job_header(self, job: RankJob) -> list[str]:
        """The directive lines of such a job: the request's, then the site's ``extra_directives``."""
        return [*self.directives(self.rank_job_options(job)), *self.site_directives()]

    def job_config(self) -> str:
        """What the site configured of this adapter (the traits that differ from their defaults), as
        :data:`CONFIG_ENV` carries it; empty where nothing is."""
        changed = {name: value for name, value in self.trait_values(config=True).items()
                   if value != self.trait_defaults(name)}
        return json.dumps({type(self).__name__: changed}, sort_keys=True) if changed else ""

    def submit_file_argv(self, path: str) -> list[str]:
        """Submission of the batch script ``path``, whose directives say everything; it prints the id as
        :meth:`parse_submit` reads it."""
        raise NotImplementedError

    # -- inside a job (the job's side: the allocation's owner, hpcdl-launch, jupyter_hpcdl.job.tasks) --------------------
    def in_job(self, env: Mapping[str, str]) -> bool:
        """Whether ``env`` is that of a job of this batch system."""
        return bool(env.get(self.job_id_env))

    def job_id(self, env: Mapping[str, str]) -> str:
        return env.get(self.job_id_env, "")

    def hosts_argv(self, env: Mapping[str, str]) -> list[str] | None:
        """The command whose output :meth:`parse_hosts` reads; None where ``env`` alone tells."""
        raise NotImplementedError

    def parse_hosts(self, stdout: str, env: Mapping[str, str]) -> list[tuple[str, int]]:
        """The job's hosts and its task slots on each, in rank order (ValueError when the job holds none)."""
        raise NotImplementedError

    def resources_argv(self, job_id: str) -> list[str]:
        """What :meth:`parse_resources` reads of a running job."""
        raise NotImplementedError

    def parse_resources(self, stdout: str, now: float) -> JobResources | None:
        """Time left (at ``now``, seconds since the epoch), partition and GPUs; None when the job is not known."""
        raise NotImplementedError


@dataclass(frozen=True)
class Role:
    """One use of an adapter, and the members it needs (each overridden from :class:`Scheduler`; of ``any_of`` at
    least one defined)."""

    name: str
    what: str
    needs: tuple[str, ...]
    any_of: tuple[str, ...] = ()


#: The adapters' three roles: the hub's servers; the job's own side (the allocation's owner, its tasks,
#: hpcdl-launch: training inside a server's job); jobs of ranks that a notebook submits from inside a job.
ROLES = {r.name: r for r in (
    Role("hub", "the hub's servers (the form's jobs)",
         ("options", "submit_argv", "parse_submit", "queue_argv", "parse_queue", "job_argv", "parse_job",
          "named_jobs_argv", "parse_job_ids", "comment_argv", "job_forgotten", "cancel_argv", "availability_argv",
          "parse_availability")),
    Role("job", "training inside its jobs (the allocation's owner, its tasks, hpcdl-launch)",
         ("hosts_argv", "parse_hosts", "resources_argv", "parse_resources"), ("step_argv", "task_argv")),
    Role("ranks", "jobs of ranks that a notebook submits (where=\"new\", BatchRun)",
         ("rank_job_options", "submit_file_argv")),
)}


class RoleUnsupported(ValueError):
    """An adapter asked for a role it does not serve; the message names the role and what the adapter serves."""


def serves(sched: Scheduler | type[Scheduler], role: str) -> bool:
    """Whether the adapter ``sched`` (an instance or its class) serves ``role`` (a key of :data:`ROLES`)."""
    cls = sched if isinstance(sched, type) else type(sched)
    needed = ROLES[role]
    return (all(getattr(cls, m, None) is not getattr(Scheduler, m, None) for m in needed.needs)
            and (not needed.any_of or any(hasattr(cls, m) for m in needed.any_of)))


def require(sched: Scheduler, role: str) -> None:
    """RoleUnsupported, saying what the adapter does serve, unless it serves ``role``."""
    if not serves(sched, role):
        served = "; ".join(ROLES[r].what for r in ROLES if serves(sched, r)) or "nothing yet"
        raise RoleUnsupported(f"the {sched.name} adapter does not serve {ROLES[role].what} yet (it serves: {served}; "
                              "docs/spawner.md, 'What each adapter serves')")


def handed_config(text: str | None) -> Config:
    """The configuration a job was handed (:data:`CONFIG_ENV`'s value); empty if none. ValueError if it is not the
    JSON object of objects that :meth:`Scheduler.job_config` writes."""
    if not text:
        return Config()
    try:
        data = json.loads(text)
    except ValueError as e:
        raise ValueError(f"${CONFIG_ENV} is not JSON ({e})") from None
    if not isinstance(data, dict) or not all(isinstance(v, dict) for v in data.values()):
        raise ValueError(f"${CONFIG_ENV} must be a JSON object of adapter sections, as the hub writes it")
    return Config(data)


def job_scheduler(env: Mapping[str, str]) -> Scheduler | None:
    """The adapter whose job this process runs in (by its job's variables), configured as the hub handed it to the
    job (:data:`CONFIG_ENV`), or None outside any job."""
    config = handed_config(env.get(CONFIG_ENV))
    for ep in sorted(entry_points(group="jupyter_hpcdl.schedulers"), key=lambda ep: ep.name != "slurm"):
        try:
            sched = ep.load()()
        except Exception:  # a broken third-party adapter must not stop the others
            continue
        if sched.in_job(env):
            return type(sched)(config=config)
    return None


def owners_scheduler(told: Mapping) -> Scheduler:
    """The adapter of the job whose allocation's owner answered ``told`` (its ``GET /allocation``), configured as
    the hub configured it."""
    return load_scheduler(told.get("scheduler") or "slurm", config=handed_config(told.get("scheduler_config")))


def load_scheduler(name: str, parent: Configurable | None = None, config: Config | None = None) -> Scheduler:
    """The adapter registered as ``name`` in the entry point group jupyter_hpcdl.schedulers, configured from
    ``parent``'s configuration, or from ``config``."""
    found = {ep.name: ep for ep in entry_points(group="jupyter_hpcdl.schedulers")}
    if name not in found:
        raise ValueError(f"no batch-system adapter {name!r}; installed: {', '.join(sorted(found)) or 'none'}")
    cls = found[name].load()
    return cls(parent=parent) if parent is not None else cls(config=config or Config())
