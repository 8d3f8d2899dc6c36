"""Slurm's adapter: sbatch, squeue, scontrol, scancel and sinfo, as pure argv builders and output parsers."""
from __future__ import annotations

import re
from typing import Sequence

from jupyter_hpcdl.jobvalues import gres_count

from .scheduler import ENDED, PENDING, RUNNING, Availability, JobInfo, JobResources, RankJob, Scheduler, JobRequest

_PENDING = {"PENDING", "CONFIGURING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "RESV_DEL_HOLD", "SUSPENDED"}
_RUNNING = {"RUNNING", "COMPLETING", "STAGE_OUT", "SIGNALING", "RESIZING"}
_SEP = "|"
_JOB_ID = re.compile(r"\d+")  # array and het-job ids ("12_3", "12+1") are never a server's


def _phase(state: str) -> str:
    return PENDING if state in _PENDING else RUNNING if state in _RUNNING else ENDED


def parse_time_left(text: str) -> int | None:
    """Seconds in squeue's ``%L`` ("[days-]hours:minutes:seconds", "minutes:seconds"), or None for UNLIMITED,
    NOT_SET, INVALID or anything else."""
    m = re.fullmatch(r"(?:(\d+)-)?(?:(\d+):)?(\d+):(\d+)", text.strip())
    if not m:
        return None
    days, hours, minutes, seconds = (int(g or 0) for g in m.groups())
    return ((days * 24 + hours) * 60 + minutes) * 60 + seconds


def expand_tasks_per_node(spec: str) -> list[int]:
    """``SLURM_TASKS_PER_NODE`` (``2(x3),1``) as one count per node (``[2, 2, 2, 1]``)."""
    counts: list[int] = []
    for part in spec.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if not m:
            raise ValueError(f"cannot read tasks per node {spec!r}")
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    return counts


def slurm_hosts(hostnames: Sequence[str], tasks_per_node: str) -> list[tuple[str, int]]:
    """The job's nodes with their task counts."""
    counts = expand_tasks_per_node(tasks_per_node)
    if len(counts) != len(hostnames):
        raise ValueError(f"{len(hostnames)} nodes but tasks per node {tasks_per_node!r}")
    return list(zip(hostnames, counts))


class Slurm(Scheduler):
    name = "slurm"
    directive = "#SBATCH"

    def options(self, req: JobRequest, job_name: str, output: str, workdir: str, comment: str = "") -> list[str]:
        gres = f"gpu:{req.gpu_type}:{req.gpus_per_node}" if req.gpu_type else f"gpu:{req.gpus_per_node}"
        # A server is not a batch job to run again: after a node failure, the hub says so instead of Slurm requeuing it.
        lines = [f"--job-name={job_name}", f"--partition={req.partition}", f"--nodes={req.nodes}",
                 f"--ntasks-per-node={max(req.gpus_per_node, 1)}", *([f"--gres={gres}"] if req.gpus_per_node else []),
                 f"--time={req.walltime}", f"--output={output}", f"--chdir={workdir}", "--no-requeue"]
        if req.memory_gb:
            lines.append(f"--mem={req.memory_gb}G")
        if req.account:
            lines.append(f"--account={req.account}")
        if req.reservation:
            lines.append(f"--reservation={req.reservation}")
        if comment:
            lines.append(f"--comment={comment}")
        return lines

    def submit_argv(self, env_names: Sequence[str]) -> list[str]:
        return ["sbatch", "--parsable", f"--export={','.join(env_names) if env_names else 'NONE'}"]

    def parse_submit(self, stdout: str) -> str:
        m = re.match(r"^\s*(\d+)(?:;\S+)?\s*$", stdout)
        if not m:
            raise ValueError(f"sbatch printed no job id: {stdout.strip()[:200]!r}")
        return m.group(1)

    def queue_argv(self) -> list[str]:
        # Only fields no user writes: a job's name or comment may hold newlines and separators (forged lines).
        return ["squeue", "--noheader", "--all", f"--format=%i{_SEP}%T{_SEP}%r{_SEP}%S{_SEP}%B{_SEP}%u"]

    def parse_queue(self, stdout: str) -> dict[str, JobInfo]:
        jobs = {}
        for line in stdout.splitlines():
            fields = line.strip().split(_SEP)
            if len(fields) != 6 or not _JOB_ID.fullmatch(fields[0]):
                continue
            job_id, state, reason, start, host, user = fields
            phase = _phase(state)
            jobs[job_id] = JobInfo(job_id, phase, state, "" if reason == "None" else reason,
                                   "" if start in ("N/A", "Unknown") else start,
                                   "" if host in ("n/a", "(null)") or phase == PENDING else host, user=user)
        return jobs

    def job_argv(self, job_id: str) -> list[str]:
        return ["scontrol", "--oneliner", "show", "job", job_id]

    def parse_job(self, stdout: str) -> JobInfo | None:
        fields = dict(m.groups() for m in re.finditer(r"(\w+)=(\S*)", stdout))
        if "JobId" not in fields:
            return None
        state = fields.get("JobState", "")
        return JobInfo(fields["JobId"], _phase(state), state, "" if fields.get("Reason") == "None" else fields.get("Reason", ""),
                       fields.get("StartTime", ""), fields.get("BatchHost", ""), fields.get("ExitCode", ""))

    def named_jobs_argv(self, job_name: str) -> list[str]:
        return ["squeue", "--noheader", "--all", f"--name={job_name}", "--format=%i"]

    def parse_job_ids(self, stdout: str, job_name: str = "") -> list[str]:
        return [line.strip() for line in stdout.splitlines() if _JOB_ID.fullmatch(line.strip())]

    def comment_argv(self, job_id: str) -> list[str]:
        return ["squeue", "--noheader", f"--jobs={job_id}", "--format=%k"]

    def job_forgotten(self, stderr: str) -> bool:
        return "Invalid job id" in stderr

    def cancel_argv(self, job_id: str) -> list[str]:
        return ["scancel", job_id]

    def availability_argv(self) -> list[str]:
        return ["sinfo", "--noheader", "--Node", f"--Format=PartitionName:{_SEP},NodeList:{_SEP},StateLong:{_SEP},"
                f"Gres:{_SEP},GresUsed:"]

    def parse_availability(self, stdout: str) -> dict[str, Availability]:
        acc: dict[str, list[int]] = {}
        for line in stdout.splitlines():
            fields = [f.strip() for f in line.split(_SEP)]
            if len(fields) < 5 or not fields[0]:
                continue
            partition, _node, state, gres, used = fields[:5]
            partition = partition.rstrip("*")
            up = not any(s in state for s in ("down", "drain", "fail", "maint", "inval", "unknown"))
            total, busy = gres_count(gres), gres_count(used)
            a = acc.setdefault(partition, [0, 0, 0, 0])
            a[0] += 1
            a[1] += int(up and state.startswith("idle"))
            a[2] += total
            a[3] += max(total - busy, 0) if up else 0
        return {p: Availability(p, *a) for p, a in acc.items()}

    # -- jobs whose tasks are ranks ------------------------------------------------------------------------------
    job_env_prefixes = ("SLURM_",)

    def rank_job_options(self, job: RankJob) -> list[str]:
        lines = [f"--job-name={job.job_name}", "--export=ALL", f"--nodes={job.nodes}", f"--ntasks={job.ranks}",
                 "--distribution=block", f"--time={job.walltime_min // 60:02d}:{job.walltime_min % 60:02d}:00",
                 f"--output={job.output}", *([f"--chdir={job.workdir}"] if job.workdir else [])]
        if job.partition is not None:
            lines.append(f"--partition={job.partition}")
        if job.account is not None:
            lines.append(f"--account={job.account}")
        if job.gpus_per_rank:
            lines.append(f"--gpus-per-task={job.gpus_per_rank}")
        if job.reservation:
            lines.append(f"--reservation={job.reservation}")
        return lines

    def submit_file_argv(self, path: str) -> list[str]:
        return ["sbatch", "--parsable", path]

    # -- inside a job ----------------------------------------------------------------------------------------------
    def hosts_argv(self, env) -> list[str] | None:
        return ["scontrol", "show", "hostnames", env.get("SLURM_JOB_NODELIST", "")]

    def parse_hosts(self, stdout: str, env) -> list[tuple[str, int]]:
        return slurm_hosts(stdout.split(), env.get("SLURM_TASKS_PER_NODE", ""))

    def task_index(self, env) -> tuple[int, str | None, int | None]:
        """A step's task: its index, node and local index, from the variables srun gives it."""
        local, index = env.get("SLURM_LOCALID"), env.get("SLURM_PROCID", "")
        if not index.isdigit():
            raise ValueError("not a task of a Slurm step (SLURM_PROCID is unset)")
        return int(index), env.get(self.node_env), int(local) if local is not None else None

    def resources_argv(self, job_id: str) -> list[str]:
        return ["squeue", "-h", "-j", job_id, "-o", "%L|%P|%b"]

    def parse_resources(self, stdout: str, now: float) -> JobResources | None:
        if not stdout.strip():
            return None
        left, partition, gres = (stdout.strip().split("|") + ["", "", ""])[:3]
        return JobResources(parse_time_left(left), partition, gres_count(gres), None, left)

    def step_argv(self, size: int, argv: Sequence[str], label: bool = False, kill_on_bad_exit: bool = True,
                  nodes: int | None = None, gpus_per_task: int = 0, mpi: bool = False,
                  job_name: str | None = None) -> list[str]:
        """One step of ``size`` tasks over the allocation (or ``nodes`` of its nodes), block-wise; with
        ``kill_on_bad_exit`` the first task to fail ends the others. ``mpi``: the tasks' MPI world from PMIx."""
        return ["srun", f"--kill-on-bad-exit={int(kill_on_bad_exit)}", "--distribution=block", f"--ntasks={size}",
                *([f"--nodes={nodes}"] if nodes else []), *([f"--job-name={job_name}"] if job_name else []),
                *([f"--gpus-per-task={gpus_per_task}"] if gpus_per_task else []), *(["--mpi=pmix"] if mpi else []),
                *(["--label"] if label else []), *argv]
