"""IBM Spectrum LSF adapter: bsub, bjobs, bkill and bhosts, as pure argv builders and output parsers. Written
against the documented CLIs of LSF 10.1 (``bjobs -o ... -json``, ``bsub -env``, ``bsub -gpu``, ``bhosts -o ...
-json``: fix packs from 10.1.0.3 on); tested only on recorded outputs, untested on a live system.

Choices, and why:

- **Listings are JSON** (``bjobs -o "..." -json``): the fields users write (the job's name, its description) are
  JSON strings, so a newline or a separator in them cannot forge a job. Output that is not JSON reads as no job.
- **The mark is the job description** (``-Jd``), read alone with ``bjobs -o job_description -json ID``. The
  directive line is parsed by bsub, not a shell: every value written here is free of spaces and quotes (the mark
  is letters, digits and ``._:%-``; names and paths are the site's).
- **Environment by name**: ``bsub -env "NAME1,NAME2"`` propagates only those variables, each "with its default
  value", the one in bsub's environment (``-env none`` when there are none). LSF keeps them with the job;
  ``bjobs -env ID`` shows them to whoever ``SECURE_JOB_INFO_LEVEL`` (lsb.params) lets see the job's details:
  with the default (0), every user. Set it so other users' job details are hidden.
- **Job-id placeholder**: ``%J`` in ``-o`` (without ``-e``, stderr goes to the same file).
- **UNKWN is running**: mbatchd has lost contact with the execution host; the job may well still run there, and
  LSF settles its state when the host is back. ZOMBI, DONE and EXIT are ended.
- **Queues stand for partitions**, but ``bhosts`` does not say which queue takes which host (lsb.queues HOSTS):
  :attr:`Lsf.queue_hosts` maps queue -> host-name patterns; without it every host counts in
  :attr:`Lsf.default_queue`. bhosts does not see GPUs that LSF does not manage (LSF_GPU_AUTOCONFIG off).
"""
from __future__ import annotations

import fnmatch
import json
import re
from typing import Any, Sequence

from traitlets import Dict, List, Unicode

from .scheduler import ENDED, PENDING, RUNNING, Availability, JobInfo, Scheduler, JobRequest

_PENDING = {"PEND", "PSUSP", "WAIT"}
_RUNNING = {"RUN", "USUSP", "SSUSP", "PROV", "UNKWN"}
_JOB_ID = re.compile(r"\d+")  # array elements ("12[3]") are never a server's
_NO_JOBS = re.compile(r"No (unfinished |pending |running )?job found\.?")  # bjobs on an empty listing
_FIELDS = "jobid stat user exec_host pend_reason exit_code"
#: Host states in which a host takes no new job for a reason other than being busy (bhosts "Host Status").
_NOT_UP = {"unavail", "unreach", "closed_Adm", "closed_Lock", "closed_LIM", "closed_EGO", "closed_RC", "closed_Wind"}


def _phase(state: str) -> str:
    return PENDING if state in _PENDING else RUNNING if state in _RUNNING else ENDED


def _records(stdout: str) -> list[dict]:
    """The RECORDS of LSF's JSON output, without the ERROR ones ("Job <12> is not found")."""
    try:
        data = json.loads(stdout)
    except ValueError:
        return []
    records = data.get("RECORDS") if isinstance(data, dict) else None
    return [r for r in records if isinstance(r, dict) and "ERROR" not in r] if isinstance(records, list) else []


def _is_listing(stdout: str) -> bool:
    """Whether ``stdout`` is a listing: bjobs' JSON object, or its word for an empty one ("No job found")."""
    text = stdout.strip()
    if not text or _NO_JOBS.fullmatch(text):
        return True
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


def _text(value: Any) -> str:
    text = "" if value is None or isinstance(value, (dict, list)) else str(value).strip()
    return "" if text == "-" else text


def _num(value: Any) -> int:
    try:
        return int(float(_text(value) or 0))
    except ValueError:
        return 0


def _hosts(exec_host: str) -> tuple[str, ...]:
    """``4*hostA:4*hostB`` (or ``hostA:hostA:hostB``) -> (hostA, hostB)."""
    hosts: list[str] = []
    for item in exec_host.split(":"):
        host = item.split("*")[-1].strip()
        if host and host not in hosts:
            hosts.append(host)
    return tuple(hosts)


def _info(record: dict) -> JobInfo | None:
    job_id, state = _text(record.get("JOBID")), _text(record.get("STAT"))
    if not _JOB_ID.fullmatch(job_id) or not state:
        return None
    phase = _phase(state)
    nodes = () if phase == PENDING else _hosts(_text(record.get("EXEC_HOST")))
    exit_code = _text(record.get("EXIT_CODE")) or ("0" if state == "DONE" else "")
    return JobInfo(job_id, phase, state, _text(record.get("PEND_REASON")) if phase == PENDING else "",
                   batch_host=nodes[0] if nodes else "", exit_code=exit_code, nodes=nodes, user=_text(record.get("USER")))


class Lsf(Scheduler):
    name = "lsf"
    directive = "#BSUB"
    job_id_placeholder = "%J"
    job_id_env = "LSB_JOBID"
    node_env = "HOSTNAME"
    private_env = False  # every user can read a job's environment by default (see the module's docstring)

    default_queue = Unicode("normal", help="The partition every host counts in when queue_hosts is empty (LSF's "
                            "default queue is normal).").tag(config=True)
    queue_hosts = Dict(value_trait=List(Unicode()), help="Queue -> host name patterns (fnmatch: 'gpu*'), as "
                       "lsb.queues HOSTS says; a host counts in every queue it matches.").tag(config=True)

    def options(self, req: JobRequest, job_name: str, output: str, workdir: str, comment: str = "") -> list[str]:
        per_node = max(req.gpus_per_node, 1)
        hours, minutes = divmod(req.walltime_minutes, 60)
        # -rn: a server is not a batch job to run again (the hub says so instead).
        lines = [f"-J {job_name}", f"-q {req.partition}", f"-n {req.nodes * per_node}", f"-R span[ptile={per_node}]"]
        if req.gpus_per_node:
            lines.append(f"-gpu num={req.gpus_per_node}" + (f":gmodel={req.gpu_type}" if req.gpu_type else ""))
        lines += [f"-W {hours}:{minutes:02d}", f"-o {output}", f"-cwd {workdir}", "-rn"]
        if req.memory_gb:
            lines.append(f"-M {req.memory_gb}GB")
        if req.account:
            lines.append(f"-P {req.account}")
        if req.reservation:
            lines.append(f"-U {req.reservation}")
        if comment:
            lines.append(f"-Jd {comment}")
        return lines

    def submit_argv(self, env_names: Sequence[str]) -> list[str]:
        # No command: bsub reads the script, its #BSUB directives included, on stdin.
        return ["bsub", "-env", ",".join(env_names) if env_names else "none"]

    def parse_submit(self, stdout: str) -> str:
        m = re.search(r"^Job <(\d+)> is submitted to (?:default )?queue <[^>\n]*>\.?\s*$", stdout, re.MULTILINE)
        if not m:
            raise ValueError(f"bsub printed no job id: {stdout.strip()[:200]!r}")
        return m.group(1)

    def queue_argv(self) -> list[str]:
        # -a: jobs that finished within CLEAN_PERIOD too, so that a quiet cluster still lists something (bjobs
        # fails with "No job found" on an empty listing, which must not read as an unreachable scheduler).
        return ["bjobs", "-u", "all", "-a", "-o", _FIELDS, "-json"]

    def parse_queue(self, stdout: str) -> dict[str, JobInfo]:
        if not _is_listing(stdout):  # an answer that does not read is no answer, never "no jobs"
            raise ValueError(f"bjobs' listing is not the JSON of -json: {stdout.strip()[:200]!r}")
        return {info.job_id: info for info in map(_info, _records(stdout)) if info is not None}

    def job_argv(self, job_id: str) -> list[str]:
        return ["bjobs", "-a", "-o", _FIELDS, "-json", job_id]

    def parse_job(self, stdout: str) -> JobInfo | None:
        infos = [i for i in map(_info, _records(stdout)) if i is not None]
        return infos[0] if len(infos) == 1 else None

    def named_jobs_argv(self, job_name: str) -> list[str]:
        # Every job's id and name as JSON (a name cannot forge a line there), filtered by parse_job_ids: -J takes
        # wildcards and fails on no match; -a as in queue_argv (ended jobs are no suspects anyway).
        return ["bjobs", "-u", "all", "-a", "-o", "jobid job_name", "-json"]

    def parse_job_ids(self, stdout: str, job_name: str = "") -> list[str]:
        return [_text(r.get("JOBID")) for r in _records(stdout)
                if _JOB_ID.fullmatch(_text(r.get("JOBID"))) and (not job_name or r.get("JOB_NAME") == job_name)]

    def comment_argv(self, job_id: str) -> list[str]:
        return ["bjobs", "-o", "job_description", "-json", job_id]

    def parse_comment(self, stdout: str) -> str:
        records = _records(stdout)
        value = records[0].get("JOB_DESCRIPTION") if len(records) == 1 else None
        return value if isinstance(value, str) else ""

    def job_forgotten(self, stderr: str) -> bool:
        return bool(re.search(r"Job <\d+> is not found", stderr))

    def cancel_argv(self, job_id: str) -> list[str]:
        return ["bkill", job_id]

    def availability_argv(self) -> list[str]:
        return ["bhosts", "-X", "-o", "host_name status njobs ngpus ngpus_alloc", "-json"]

    def parse_availability(self, stdout: str) -> dict[str, Availability]:
        acc: dict[str, list[int]] = {}
        for record in _records(stdout):
            host, status = _text(record.get("HOST_NAME")), _text(record.get("STATUS"))
            if not host:
                continue
            up = status not in _NOT_UP
            queues = ([q for q, patterns in self.queue_hosts.items() if any(fnmatch.fnmatch(host, p) for p in patterns)]
                      if self.queue_hosts else [self.default_queue])
            total = _num(record.get("NGPUS"))
            for queue in queues:
                a = acc.setdefault(queue, [0, 0, 0, 0])
                a[0] += 1
                a[1] += int(status == "ok" and _num(record.get("NJOBS")) == 0)
                a[2] += total
                a[3] += max(total - _num(record.get("NGPUS_ALLOC")), 0) if up else 0
        return {p: Availability(p, *a) for p, a in acc.items()}
