"""PBS Professional / OpenPBS adapter: qsub, qstat, qselect, qdel and pbsnodes, as pure argv builders and output
parsers. Written against the documented CLIs (OpenPBS 20+/PBS Pro 2021+ man pages, ``qstat -f -F json`` and
``pbsnodes -a -F json`` as OpenPBS emits them); tested only on recorded outputs, untested on a live system.

Choices, and why:

- **Listings are JSON.** ``qstat -f -F json`` prints every attribute, including ones users write (the job's name,
  its ``Variable_List``, its project), but as JSON strings: a newline or a separator in them cannot forge a job.
  Output that is not JSON is read as no job at all (every job is then asked about alone, by :meth:`job_argv`).
- **The mark is the job's project** (``-P``). PBS has no free comment a user sets at submission (``comment`` is
  the scheduler's). ``-v HPCDL_MARK=...`` in a ``#PBS`` directive does not work: qsub's command-line ``-v`` (the
  names of :meth:`submit_argv`) takes precedence over the script's, so the mark would be dropped. A project may
  not hold ``:`` (nor ``/[]";|<>+,?*``), so the mark's ``:`` is written ``@`` (never in a mark: it is encoded as
  ``%40``) and read back. Where the site's projects are allocations, set ``c.Pbs.mark_in_project = False``:
  no job then carries the mark and the orphan sweep cancels nothing.
- **Environment by name**: ``qsub -v NAME1,NAME2``; qsub takes each value from its own environment (a name it
  cannot find fails the submission). The values land in the job's ``Variable_List``, which with the server's
  default ``query_other_jobs = True`` **every user can read** (``qstat -f``): the hub's API token included. Set
  ``query_other_jobs = False`` (the hub's account must then be a PBS operator or manager to see every job).
- **No job-id placeholder in -o paths.** An output path ending in ``/`` makes PBS name the file
  ``<job id>.OU``; so an output of ``DIR/<placeholder>.log`` becomes ``-o DIR/`` (the log is ``DIR/<id>.OU``).
- **Finished jobs** are known to ``qstat -x`` only with the server's ``job_history_enable = True``; without it a
  finished job is forgotten at once ("Unknown Job Id").
- **Queues stand for partitions**: a node's partition is its ``queue`` attribute, else the queues in its
  ``resources_available.Qlist`` (a common site convention), else :attr:`Pbs.default_queue`.
"""
from __future__ import annotations

import json
import re
from typing import Any, Sequence

from traitlets import Bool, Unicode

from .scheduler import ENDED, PENDING, RUNNING, Availability, JobInfo, Scheduler, JobRequest

#: PBS's job states (Reference Guide, "Job States"), by the words the documentation gives them.
_STATES = {"Q": "QUEUED", "H": "HELD", "W": "WAITING", "T": "TRANSIT", "S": "SUSPENDED", "U": "USER_SUSPENDED",
           "R": "RUNNING", "E": "EXITING", "B": "BEGUN", "F": "FINISHED", "X": "EXPIRED", "M": "MOVED"}
_PENDING = {"Q", "H", "W", "T", "S", "U"}
_RUNNING = {"R", "E", "B"}
_JOB_ID = re.compile(r"\d+\.[A-Za-z0-9_.-]+")  # array jobs ("12[].srv", "12[3].srv") are never a server's
_PLACEHOLDER = "%PBS_JOBID%"
_NOT_UP = {"down", "offline", "stale", "state-unknown", "unresolvable", "maintenance", "sleep", "provisioning",
           "wait-provisioning", "initializing"}


def _phase(state: str) -> str:
    return PENDING if state in _PENDING else RUNNING if state in _RUNNING else ENDED


def _load(stdout: str) -> dict:
    try:
        data = json.loads(stdout)
    except ValueError:
        return {}
    return data if isinstance(data, dict) else {}


def _jobs(stdout: str) -> dict[str, dict]:
    jobs = _load(stdout).get("Jobs")
    return {k: v for k, v in jobs.items() if isinstance(v, dict)} if isinstance(jobs, dict) else {}


def _num(value: Any) -> int:
    try:
        return int(float(value))
    except (TypeError, ValueError):
        return 0


def _text(value: Any) -> str:
    return "" if value is None or isinstance(value, (dict, list)) else str(value)


def _hosts(exec_host: str) -> tuple[str, ...]:
    """``node1/0*4+node2/0*4`` -> (node1, node2)."""
    hosts: list[str] = []
    for chunk in exec_host.split("+"):
        host = chunk.split("/")[0].strip()
        if host and host not in hosts:
            hosts.append(host)
    return tuple(hosts)


def _info(job_id: str, job: dict) -> JobInfo:
    letter = _text(job.get("job_state"))
    phase = _phase(letter)
    estimated = job.get("estimated") if isinstance(job.get("estimated"), dict) else {}
    nodes = () if phase == PENDING else _hosts(_text(job.get("exec_host")))
    return JobInfo(job_id, phase, _STATES.get(letter, letter), "" if phase == RUNNING else _text(job.get("comment")),
                   _text(estimated.get("start_time")) if phase == PENDING else "", nodes[0] if nodes else "",
                   _text(job.get("Exit_status")), nodes, _text(job.get("Job_Owner")).split("@")[0])


class Pbs(Scheduler):
    name = "pbs"
    directive = "#PBS"
    #: Not PBS's (it has none): :meth:`options` turns ``DIR/<this>.log`` into ``-o DIR/``, named ``<id>.OU``.
    job_id_placeholder = _PLACEHOLDER
    job_id_env = "PBS_JOBID"
    node_env = "HOSTNAME"
    private_env = False  # every user can read a job's environment by default (see the module's docstring)

    default_queue = Unicode("workq", help="The partition of nodes that name no queue (PBS's default queue "
                            "is workq).").tag(config=True)
    gpu_type_resource = Unicode("", help="The chunk resource that selects a GPU type (e.g. 'gputype': "
                                "select=1:...:gputype=a100); empty: gpu_type is not asked for.").tag(config=True)
    mark_in_project = Bool(True, help="Carry the hub's mark in the job's project (-P). False where the site's "
                           "projects are allocations: then the orphan sweep finds no job of the hub's.").tag(config=True)

    def options(self, req: JobRequest, job_name: str, output: str, workdir: str, comment: str = "") -> list[str]:
        per_node = max(req.gpus_per_node, 1)
        chunk = f"{req.nodes}:ncpus={per_node}"
        if req.gpus_per_node:
            chunk += f":ngpus={req.gpus_per_node}"
            if req.gpu_type and self.gpu_type_resource:
                chunk += f":{self.gpu_type_resource}={req.gpu_type}"
        chunk += f":mpiprocs={per_node}"
        if req.memory_gb:
            chunk += f":mem={req.memory_gb}gb"
        if output.endswith(f"/{_PLACEHOLDER}.log"):
            output = output[: -len(f"{_PLACEHOLDER}.log")]
        # A reservation is a queue of its own (R123 for reservation R123.server); the partition's queue gives way.
        queue = req.reservation.split(".")[0] if req.reservation else req.partition
        # -r n: a server is not a batch job to run again (the hub says so instead).
        lines = [f"-N {job_name}", f"-q {queue}", f"-l select={chunk}", *(["-l place=scatter"] if req.nodes > 1 else []),
                 f"-l walltime={req.walltime}", f"-o {output}", "-j oe", "-r n"]
        if req.account:
            lines.append(f"-A {req.account}")
        if comment and self.mark_in_project:
            if re.search(r"[^A-Za-z0-9._:%=-]", comment):
                raise ValueError(f"job mark {comment!r}: a PBS project cannot hold it")
            lines.append(f"-P {comment.replace(':', '@')}")
        return lines

    def submit_argv(self, env_names: Sequence[str]) -> list[str]:
        # No script argument: qsub reads the script, its #PBS directives included, on stdin.
        return ["qsub", *(["-v", ",".join(env_names)] if env_names else [])]

    def parse_submit(self, stdout: str) -> str:
        m = re.match(r"^\s*(\d+\.[A-Za-z0-9_.-]+)\s*$", stdout)
        if not m:
            raise ValueError(f"qsub printed no job id: {stdout.strip()[:200]!r}")
        return m.group(1)

    def queue_argv(self) -> list[str]:
        # Not -x: history (job_history_duration, two weeks by default) would be read every interval.
        return ["qstat", "-f", "-F", "json"]

    def parse_queue(self, stdout: str) -> dict[str, JobInfo]:
        if stdout.strip() and not _load(stdout):  # an answer that does not read is no answer, never "no jobs"
            raise ValueError(f"qstat's listing is not the JSON object of -F json: {stdout.strip()[:200]!r}")
        return {job_id: _info(job_id, job) for job_id, job in _jobs(stdout).items() if _JOB_ID.fullmatch(job_id)}

    def job_argv(self, job_id: str) -> list[str]:
        return ["qstat", "-f", "-F", "json", "-x", job_id]

    def parse_job(self, stdout: str) -> JobInfo | None:
        jobs = [(k, v) for k, v in _jobs(stdout).items() if _JOB_ID.fullmatch(k)]
        return _info(*jobs[0]) if len(jobs) == 1 else None

    def named_jobs_argv(self, job_name: str) -> list[str]:
        return ["qselect", "-N", job_name]

    def parse_job_ids(self, stdout: str, job_name: str = "") -> list[str]:
        return [line.strip() for line in stdout.splitlines() if _JOB_ID.fullmatch(line.strip())]

    def comment_argv(self, job_id: str) -> list[str]:
        return ["qstat", "-f", "-F", "json", job_id]

    def parse_comment(self, stdout: str) -> str:
        jobs = list(_jobs(stdout).values())
        project = _text(jobs[0].get("project")) if len(jobs) == 1 and self.mark_in_project else ""
        return "" if project == "_pbs_project_default" else project.replace("@", ":")

    def job_forgotten(self, stderr: str) -> bool:
        return "Unknown Job Id" in stderr or "Job has finished" in stderr

    def cancel_argv(self, job_id: str) -> list[str]:
        return ["qdel", job_id]

    def availability_argv(self) -> list[str]:
        return ["pbsnodes", "-a", "-F", "json"]

    def parse_availability(self, stdout: str) -> dict[str, Availability]:
        nodes = _load(stdout).get("nodes")
        acc: dict[str, list[int]] = {}
        for node in (nodes.values() if isinstance(nodes, dict) else ()):
            if not isinstance(node, dict):
                continue
            available = node.get("resources_available") if isinstance(node.get("resources_available"), dict) else {}
            assigned = node.get("resources_assigned") if isinstance(node.get("resources_assigned"), dict) else {}
            states = {s.strip() for s in _text(node.get("state")).split(",")}
            up = not states & _NOT_UP
            queues = ([_text(node["queue"])] if node.get("queue") else
                      [q.strip() for q in _text(available.get("Qlist")).split(",") if q.strip()] or [self.default_queue])
            total = _num(available.get("ngpus"))  # resources_assigned omits zeros
            for queue in queues:
                a = acc.setdefault(queue, [0, 0, 0, 0])
                a[0] += 1
                a[1] += int(up and states == {"free"} and not node.get("jobs"))
                a[2] += total
                a[3] += max(total - _num(assigned.get("ngpus")), 0) if up else 0
        return {p: Availability(p, *a) for p, a in acc.items()}
