"""(Son of) Grid Engine's adapter: qsub, qstat, qacct, qdel, as pure argv builders and parsers of their XML (never of
the column output, whose names and paths are free text).

What differs from Slurm, and how it is met:

- GPUs are a consumable (``-l gpu=1``) counted per slot, so a request of G GPUs per node is G slots of one GPU each,
  in a parallel environment: ``pe_single_node`` (allocation rule ``$pe_slots``) for one node, ``pe_multi_node``
  (allocation rule G, e.g. one PE per GPU count) for several.
- A job's environment (``qsub -v``) is shown to every user by ``qstat -j``: :attr:`private_env` is False, so the
  spawner hands the job its secrets through a file only the user can read.
- A job in error (``Eqw``: it cannot start, e.g. its working directory is missing) stays in the queue for ever:
  it is ended here, with the error's reason from ``qstat -j``, not pending.
- A job that has left the queue is known only to the accounting (``qacct -j``): :meth:`accounting_argv`.
- The pending reason is not in the listing: :attr:`queue_has_reasons` is False, and ``qstat -j`` tells it.
"""
from __future__ import annotations

import math
import re
import shlex
import xml.etree.ElementTree as ET
from typing import Sequence

from traitlets import Unicode

from .scheduler import ENDED, PENDING, RUNNING, Availability, JobInfo, JobResources, RankJob, Scheduler, JobRequest

_JOB_ID = re.compile(r"\d+")
#: What qstat -j says before the scheduler has passed over a job: no reason yet.
_NO_REASON = {"There are no messages available"}
#: The context variable that holds the hub's mark (``qsub -ac``; read back alone with ``qstat -j``).
MARK_VARIABLE = "hpcdl_mark"


def phase(state: str) -> str:
    """Grid Engine's state letters (``qw``, ``hqw``, ``r``, ``t``, ``Rr``, ``dr``, ``s``, ``Eqw``) as a phase."""
    if "E" in state:
        return ENDED  # error: it will not start until someone clears it
    if any(c in state for c in "sST"):
        return PENDING  # suspended: holds no running server (as Slurm's SUSPENDED)
    if "r" in state or "t" in state:
        return RUNNING
    if "d" in state:
        return ENDED  # deleted before it started
    return PENDING


def _text(node: ET.Element | None, tag: str) -> str:
    found = node.find(tag) if node is not None else None
    return (found.text or "").strip() if found is not None else ""


def _xml(stdout: str) -> ET.Element | None:
    """The XML ``stdout``; if it does not parse, again without the jobs' names (the one field users write, whose
    escaping by qstat is its own: ``<`` comes out as ``%lt;``); ValueError if even that fails (never an empty
    listing, which would end every job)."""
    if not stdout.strip():
        return None
    try:
        return ET.fromstring(stdout)
    except ET.ParseError:
        pass
    try:
        return ET.fromstring(re.sub(r"<(JB_name|full_job_name)>.*?</\1>", "", stdout, flags=re.DOTALL))
    except ET.ParseError as e:
        raise ValueError(f"qstat's XML does not parse ({e})") from None


def _seconds(text: str) -> int | None:
    """Grid Engine's time (``600``, ``0:10:0``, ``1:00:00:00``); None for INFINITY or anything else."""
    parts = text.strip().split(":")
    if not text.strip() or not all(p.isdigit() for p in parts) or len(parts) > 4:
        return None
    total = 0
    for part, unit in zip(reversed(parts), (1, 60, 3600, 86400)):
        total += int(part) * unit
    return total


def _host(queue_instance: str) -> str:
    return queue_instance.partition("@")[2]


class GridEngine(Scheduler):
    name = "gridengine"
    directive = "#$"
    job_id_placeholder = "$JOB_ID"
    job_id_env = "JOB_ID"
    node_env = "HOSTNAME"
    private_env = False
    queue_has_reasons = False

    pe_single_node = Unicode("smp", help="Parallel environment for a one-node job (allocation rule $pe_slots): "
                             "one slot per GPU.").tag(config=True)
    pe_multi_node = Unicode("mpi-{gpus_per_node}", help="Parallel environment for a job on several nodes, whose "
                            "allocation rule gives each node {gpus_per_node} slots (a PE per GPU count, a common "
                            "site layout).").tag(config=True)
    gpu_resource = Unicode("gpu", help="The consumable complex that counts GPUs (per slot).").tag(config=True)
    gpu_type_resource = Unicode("gpu_type", help="The complex a GPU type is asked for with (-l NAME=TYPE).").tag(config=True)
    memory_resource = Unicode("mem_free", help="The complex memory is asked for with (per slot). Not h_vmem: "
                              "it limits address space, which CUDA's runtime reserves by the terabyte.").tag(config=True)

    def options(self, req: JobRequest, job_name: str, output: str, workdir: str, comment: str = "") -> list[str]:
        slots = max(req.gpus_per_node, 1)
        lines = [f"-N {job_name}", f"-q {req.partition}", f"-o {output}", "-j y", f"-wd {workdir}", "-r n", "-S /bin/bash"]
        if req.nodes > 1 or slots > 1:
            pe = self.pe_single_node if req.nodes == 1 else self.pe_multi_node.format(gpus_per_node=slots)
            lines.append(f"-pe {pe} {req.nodes * slots}")
        resources = [f"h_rt={req.walltime}"]
        if req.gpus_per_node:
            resources.append(f"{self.gpu_resource}=1")
        if req.gpu_type:
            resources.append(f"{self.gpu_type_resource}={req.gpu_type}")
        if req.memory_gb:
            resources.append(f"{self.memory_resource}={math.ceil(req.memory_gb * 1024 / slots)}M")
        lines.append(f"-l {','.join(resources)}")
        if req.account:
            lines.append(f"-A {req.account}")
        if req.reservation:
            lines.append(f"-ar {req.reservation}")
        if comment:
            lines.append(f"-ac {MARK_VARIABLE}={comment}")
        return lines

    def submit_argv(self, env_names: Sequence[str]) -> list[str]:
        # -v NAME takes the value from qsub's environment; never a secret (see private_env).
        return ["qsub", "-terse", *(["-v", ",".join(env_names)] if env_names else [])]

    def parse_submit(self, stdout: str) -> str:
        m = re.match(r"^\s*(\d+)(?:\.\S+)?\s*$", stdout)
        if not m:
            raise ValueError(f"qsub printed no job id: {stdout.strip()[:200]!r}")
        return m.group(1)

    def queue_argv(self) -> list[str]:
        return ["qstat", "-u", "*", "-xml"]

    def parse_queue(self, stdout: str) -> dict[str, JobInfo]:
        root = _xml(stdout)
        jobs: dict[str, JobInfo] = {}
        for job in root.iter("job_list") if root is not None else ():
            job_id, state = _text(job, "JB_job_number"), _text(job, "state")
            if not _JOB_ID.fullmatch(job_id) or job.find("tasks") is not None:
                continue  # array tasks are never a server's
            p = phase(state)
            jobs[job_id] = JobInfo(job_id, p, state, "error: qstat -j tells why" if "E" in state else "",
                                   _text(job, "JAT_start_time") if p == RUNNING else "",
                                   _host(_text(job, "queue_name")) if p == RUNNING else "", user=_text(job, "JB_owner"))
        return jobs

    def job_argv(self, job_id: str) -> list[str]:
        return ["qstat", "-j", job_id, "-xml"]

    def accounting_argv(self, job_id: str) -> list[str] | None:
        return ["qacct", "-j", job_id]

    def parse_job(self, stdout: str) -> JobInfo | None:
        """``qstat -j N -xml`` (a job still held: its error or why it waits) or ``qacct -j N`` (one that ended)."""
        if stdout.lstrip().startswith("<"):
            return self._parse_detail(stdout)
        return self._parse_accounting(stdout)

    def _parse_detail(self, stdout: str) -> JobInfo | None:
        root = _xml(stdout)
        job = root.find("djob_info/element") if root is not None else None
        job_id = _text(job, "JB_job_number")
        if job is None or not _JOB_ID.fullmatch(job_id):
            return None
        errors = [m.text.strip() for m in job.iter("QIM_message") if m.text]
        if errors:
            return JobInfo(job_id, ENDED, "Eqw", errors[-1], user=_text(job, "JB_owner"))
        # The scheduler's messages: those for this job, and those for every job (no job list).
        why = [_text(m, "MES_message") for m in root.iter("element") if m.find("MES_message") is not None
               and (m.find("MES_job_number_list") is None or job_id in {v.text for v in m.iter("ULNG_value")})]
        # dispatched: running (status 128), or started and now ending (a start time: its status is then another,
        # while Grid Engine takes the job down). A pending job has no started task.
        running = any(_text(t, "JAT_status") == "128" or (_text(t, "JAT_start_time") or "0").strip() not in ("", "0")
                      for t in job.iter("ulong_sublist"))
        return JobInfo(job_id, RUNNING if running else PENDING, "r" if running else "qw",
                       "" if running else "; ".join(w for w in why if w and w not in _NO_REASON),
                       user=_text(job, "JB_owner"))

    def _parse_accounting(self, stdout: str) -> JobInfo | None:
        records = [r for r in stdout.split("=" * 62) if "jobnumber" in r]
        if not records:
            return None
        fields = dict(line.split(None, 1) if len(line.split(None, 1)) == 2 else (line.strip(), "")
                      for line in records[-1].strip().splitlines() if line.strip())
        fields = {k: v.strip() for k, v in fields.items()}
        job_id = fields.get("jobnumber", "")
        if not _JOB_ID.fullmatch(job_id):
            return None
        failed, status = fields.get("failed", "0") or "0", fields.get("exit_status", "")
        broke = failed.split()[0] != "0"  # Grid Engine's own failure code (e.g. 100: the job was killed)
        state = "FAILED" if broke or status not in ("", "0") else "COMPLETED"
        reason = f"failed {failed}" if broke else (f"exit status {status}" if status not in ("", "0") else "")
        return JobInfo(job_id, ENDED, state, reason, batch_host=fields.get("hostname", ""), exit_code=status,
                       user=fields.get("owner", ""))

    def named_jobs_argv(self, job_name: str) -> list[str]:
        return ["qstat", "-u", "*", "-xml"]

    def parse_job_ids(self, stdout: str, job_name: str = "") -> list[str]:
        root = _xml(stdout)
        return [_text(j, "JB_job_number") for j in (root.iter("job_list") if root is not None else ())
                if _text(j, "JB_name") == job_name and _JOB_ID.fullmatch(_text(j, "JB_job_number"))]

    def comment_argv(self, job_id: str) -> list[str]:
        return ["qstat", "-j", job_id, "-xml"]

    def parse_comment(self, stdout: str) -> str:
        root = _xml(stdout)
        for var in root.iter("context_list") if root is not None else ():
            if _text(var, "VA_variable") == MARK_VARIABLE:
                return _text(var, "VA_value")
        return ""

    def job_forgotten(self, stderr: str) -> bool:
        return "do not exist" in stderr or "not found" in stderr or "does not exist" in stderr

    def cancel_argv(self, job_id: str) -> list[str]:
        return ["qdel", job_id]

    def availability_argv(self) -> list[str]:
        # -r: each running job's request, so the GPUs in use (per slot x slots) give the total beside what is free.
        return ["qstat", "-f", "-r", "-u", "*", "-F", self.gpu_resource, "-xml"]

    def parse_availability(self, stdout: str) -> dict[str, Availability]:
        root = _xml(stdout)
        acc: dict[str, list[int]] = {}
        for qi in root.iter("Queue-List") if root is not None else ():
            queue = _text(qi, "name").partition("@")[0]
            if not queue:
                continue
            up = not any(c in _text(qi, "state") for c in "uadECsS")  # unknown, alarm, disabled, error, suspended
            free = sum(int(float(r.text or 0)) for r in qi.findall("resource") if r.get("name") == self.gpu_resource)
            used = 0
            for job in qi.findall("job_list"):
                per_slot = sum(int(float(r.text or 0)) for r in job.findall("hard_request")
                               if r.get("name") == self.gpu_resource)
                used += per_slot * int(_text(job, "slots") or 1)
            a = acc.setdefault(queue, [0, 0, 0, 0])
            a[0] += 1
            a[1] += int(up and _text(qi, "slots_used") == "0")
            a[2] += free + used
            a[3] += free if up else 0
        return {q: Availability(q, *a) for q, a in acc.items()}

    # -- jobs whose tasks are ranks ------------------------------------------------------------------------------
    def rank_job_options(self, job: RankJob) -> list[str]:
        """One slot per rank (in a parallel environment when there are several), ``gpus_per_rank`` GPUs per slot.
        Nothing of the submitter's environment goes with it (no ``-V``: every user could read it in ``qstat -j``);
        what the ranks need is in the script."""
        lines = [f"-N {job.job_name}", f"-o {job.output}", "-j y", "-r n", "-S /bin/bash",
                 f"-wd {job.workdir}" if job.workdir else "-cwd"]
        if job.ranks > 1:
            if job.ranks % job.nodes:
                raise ValueError(f"{job.ranks} ranks cannot be spread evenly over {job.nodes} nodes, as Grid Engine's "
                                 "parallel environments place them: give a multiple of the node count")
            pe = (self.pe_single_node if job.nodes == 1
                  else self.pe_multi_node.format(gpus_per_node=job.ranks // job.nodes))
            lines.append(f"-pe {pe} {job.ranks}")
        resources = [f"h_rt={job.walltime_min * 60}",
                     *([f"{self.gpu_resource}={job.gpus_per_rank}"] if job.gpus_per_rank else [])]
        lines.append(f"-l {','.join(resources)}")
        if job.partition is not None:
            lines.append(f"-q {job.partition}")
        if job.account is not None:
            lines.append(f"-A {job.account}")
        if job.reservation:
            lines.append(f"-ar {job.reservation}")
        return lines

    def submit_file_argv(self, path: str) -> list[str]:
        return ["qsub", "-terse", path]

    # -- inside a job ----------------------------------------------------------------------------------------------
    def in_job(self, env) -> bool:
        return bool(env.get("JOB_ID") and env.get("SGE_ROOT"))

    def hosts_argv(self, env) -> list[str] | None:
        return ["cat", env["PE_HOSTFILE"]] if env.get("PE_HOSTFILE") else None

    def parse_hosts(self, stdout: str, env) -> list[tuple[str, int]]:
        """The PE's hosts; a job without a parallel environment has one slot, here."""
        if stdout.strip() or env.get("PE_HOSTFILE"):
            return self.parse_pe_hostfile(stdout)
        return [(env.get(self.node_env, ""), 1)]

    def resources_argv(self, job_id: str) -> list[str]:
        return ["qstat", "-j", job_id, "-xml"]

    def parse_resources(self, stdout: str, now: float) -> JobResources | None:
        """Time left from the job's ``h_rt`` and its start; the queue it asked for; its GPUs per slot."""
        root = _xml(stdout)
        job = root.find("djob_info/element") if root is not None else None
        if job is None:
            return None
        requests = {_text(r, "CE_name"): _text(r, "CE_stringval") for r in job.iter("qstat_l_requests")}
        starts = [int(t) for t in (_text(s, "JAT_start_time") for s in job.iter("ulong_sublist")) if t.isdigit()]
        limit = _seconds(requests.get("h_rt", ""))
        left = None
        if limit is not None and starts and starts[0] > 0:
            left = max(int(limit - (now - starts[0])), 0)
        queues = [_text(q, "QR_name") for q in job.iter("destin_ident_list")]
        gpus = requests.get(self.gpu_resource, "")
        return JobResources(left, queues[0] if queues else "", None,
                            int(float(gpus)) if re.fullmatch(r"\d+(\.\d*)?", gpus) else 0,
                            "" if left is None else f"{left // 3600}:{left % 3600 // 60:02d}:{left % 60:02d}")

    def parse_pe_hostfile(self, text: str) -> list[tuple[str, int]]:
        """``$PE_HOSTFILE`` (``host slots queue processors`` a line) as (host, slots), in order."""
        hosts = []
        for line in text.splitlines():
            fields = line.split()
            if len(fields) >= 2 and fields[1].isdigit():
                hosts.append((fields[0], int(fields[1])))
        if not hosts:
            raise ValueError("the job's PE_HOSTFILE names no host: submit it with a parallel environment (-pe)")
        return hosts

    def task_argv(self, host: str, env_names: Sequence[str], argv: Sequence[str]) -> list[str]:
        """One task of this job on ``host``, the parallel environment's way (``qrsh -inherit``: the PE needs
        control_slaves), with the named variables (values from this process's environment) and the command's
        words quoted for the remote shell."""
        return ["qrsh", "-inherit", *(["-v", ",".join(env_names)] if env_names else []), host,
                " ".join(shlex.quote(a) for a in argv)]
