"""The allocation's owner, on the host side of a batch job (beside srun and the scheduler's client): it describes the
allocation and starts the training engines in it, each inside the user's container, when a kernel asks.

Kernels run inside containers, where there is no srun and no scheduler: they ask this owner over a Unix socket in the
user's private job directory (file permissions are the authentication). The Jupyter server extension
(``jupyter_hpcdl.serverext``) runs it for the job that runs the user's JupyterLab."""
from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from typing import Mapping

from .containers.kernelspec import KERNEL_ENV, in_container_argv
from .containers.spec import check_image_ref
from .jobvalues import gres_count

SOCKET_ENV = "HPCDL_ALLOCATION_FILE"
#: What MPI in the container needs from srun's PMIx: its per-task variables, and its rendezvous under /tmp.
MPI_IN_CONTAINER = ("--env-prefix=PMIX_", "--env-prefix=SLURM_", "--env-prefix=OMPI_", "--volume=/tmp")
#: What an engine in a container gets by name: the kernel's variables, its Slurm task, and ipyparallel's cluster.
ENGINE_ENV = (*KERNEL_ENV, "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NODEID", "SLURM_STEP_TASKS_PER_NODE",
              "SLURM_STEP_NODELIST", "IPP_CLUSTER_ID", "IPP_PROFILE_DIR", "IPP_CONNECTION_INFO")


def default_socket_path(job_id: str) -> str:
    return os.path.expanduser(f"~/.jupyter-hpcdl/jobs/{job_id}/allocation.sock")


def engine_srun_argv(ranks: int, nodes: int, image: str, connection_file: str, python: str = sys.executable,
                     gpus_per_rank: int = 0, mpi: bool = False) -> list[str]:
    """srun that starts ``ranks`` ipyparallel engines spread block-wise over ``nodes`` nodes, each in the user's
    container for ``image`` (created on first use), with its own GPU where there are GPUs."""
    check_image_ref(image)
    if ranks < 1 or nodes < 1 or ranks < nodes:
        raise ValueError(f"need at least one rank per node: {ranks} ranks on {nodes} nodes")
    if not os.path.isabs(connection_file) or "\n" in connection_file:
        raise ValueError("the connection file must be an absolute path")
    argv = ["srun", f"--ntasks={ranks}", f"--nodes={nodes}", "--distribution=block", "--kill-on-bad-exit=0",
            "--job-name=hpcdl-engines"]
    if gpus_per_rank:
        argv.append(f"--gpus-per-task={gpus_per_rank}")
    if mpi:
        argv.append("--mpi=pmix")  # the ranks' MPI world comes from srun
    return argv + in_container_argv(image, python, ENGINE_ENV,
                                    ["python3", "-m", "ipyparallel.engine", f"--file={connection_file}", "--quiet"],
                                    MPI_IN_CONTAINER if mpi else ())


SESSION_STATES = ("none", "starting", "idle", "training", "stopped", "failed", "walltime")
#: A session not reported for this many seconds is forgotten (its kernel gone without saying "none", say) ...
SESSION_KEEP_S = 3600.0
#: ... and at most this many sessions are kept: beyond it, the least recently reported one is forgotten.
MAX_SESSIONS = 32
RANK_FIELDS = {"rank": int, "node": str, "gpu": str, "state": str, "straggler": bool, "loss": float,
               "samples_per_s": float}


def parse_time_left(text: str) -> int | None:
    """Seconds in squeue's ``%L`` ("[days-]hours:minutes:seconds", "minutes:seconds"), or None for UNLIMITED,
    NOT_SET, INVALID or anything else."""
    m = re.fullmatch(r"(?:(\d+)-)?(?:(\d+):)?(\d+):(\d+)", text.strip())
    if not m:
        return None
    days, hours, minutes, seconds = (int(g or 0) for g in m.groups())
    return ((days * 24 + hours) * 60 + minutes) * 60 + seconds


def squeue_time_left(job_id: str, timeout: float = 15) -> int | None:
    """Seconds left for ``job_id`` as squeue says (``%L``), or None (no limit, or the job is not known)."""
    try:
        out = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%L"], capture_output=True, text=True,
                             timeout=timeout)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return parse_time_left(out.stdout.strip()) if out.returncode == 0 and out.stdout.strip() else None


def session_report(body: dict) -> dict:
    """A kernel's report of its training session (its id, state and ranks), checked field by field: only plain
    values of the known fields are kept (a number that is not finite becomes None), so what the panel shows cannot
    carry anything else."""
    state, session_id = body.get("session"), body.get("id", "")
    if state not in SESSION_STATES:
        raise ValueError(f"session must be one of {', '.join(SESSION_STATES)}")
    if not isinstance(session_id, str) or len(session_id) > 64:
        raise ValueError("id must be a string of at most 64 characters")
    ranks = body.get("ranks", [])
    if not isinstance(ranks, list) or len(ranks) > 4096:
        raise ValueError("ranks must be a list of at most 4096 rank records")
    clean = []
    for rank in ranks:
        if not isinstance(rank, dict) or not isinstance(rank.get("rank"), int) or isinstance(rank["rank"], bool):
            raise ValueError("each rank record needs a whole-number 'rank'")
        row = {}
        for name, kind in RANK_FIELDS.items():
            value = rank.get(name)
            if value is None or isinstance(value, bool) and kind is not bool:
                row[name] = None
            elif isinstance(value, (int, float, str, bool)):
                row[name] = str(value)[:64] if kind is str else kind(value)
                if kind is float and not math.isfinite(row[name]):
                    row[name] = None
            else:
                raise ValueError(f"rank field {name!r} must be a plain value")
        clean.append(row)
    message = body.get("message")
    if message is not None and not isinstance(message, str):
        raise ValueError("message must be a string")
    return {"id": session_id, "session": state, "ranks": clean, **({"message": message[:500]} if message else {})}


def hostnames(nodelist: str) -> list[str]:
    out = subprocess.run(["scontrol", "show", "hostnames", nodelist], check=True, capture_output=True, text=True)
    return out.stdout.split()


class AllocationOwner:
    """Describe the current allocation and run engine steps in it."""

    def __init__(self, environ: Mapping[str, str] | None = None):
        self.environ = dict(os.environ if environ is None else environ)
        self.job_id = self.environ.get("SLURM_JOB_ID", "")
        self._steps: list[subprocess.Popen] = []
        self._jobs: set[str] = set()  # new allocations submitted for kernels
        self.sessions: dict[str, tuple[float, dict]] = {}  # by session id: (when reported, report)

    def describe(self) -> dict:
        if not self.job_id:
            return {"in_job": False, "job_id": None,
                    "message": "Not in a batch job: this server runs outside Slurm, so training sessions start "
                               "their ranks as local engines on this machine."}
        now = time.time()
        nodes = hostnames(self.environ.get("SLURM_JOB_NODELIST", ""))
        left = subprocess.run(["squeue", "-h", "-j", self.job_id, "-o", "%L|%P|%b"], capture_output=True, text=True)
        time_left, partition, gres = (left.stdout.strip().split("|") + ["", "", ""])[:3]
        return {"in_job": True, "job_id": self.job_id, "nodes": nodes, "partition": partition, "gres": gres,
                "host_python": sys.executable,
                "gpus_per_node": gres_count(gres), "time_left": time_left,
                "time_left_s": parse_time_left(time_left),
                "cuda_visible_devices": self.environ.get("CUDA_VISIBLE_DEVICES"),
                "engine_steps": [{"pid": p.pid, "running": p.poll() is None} for p in self._steps],
                **self.current_session(now), "all_sessions": self.all_sessions(now)}

    def report(self, report: dict, now: float | None = None) -> None:
        """Keep a kernel's session report; a closed session ("none") is forgotten. So that kernels that never say
        "none" cannot grow it without bound, a session not reported for :data:`SESSION_KEEP_S` seconds is forgotten,
        and at most :data:`MAX_SESSIONS` are kept (the least recently reported go first)."""
        now = time.time() if now is None else now
        if report["session"] == "none":
            self.sessions.pop(report["id"], None)
        else:
            self.sessions[report["id"]] = (now, report)
        for session_id, (when, _) in list(self.sessions.items()):
            if now - when > SESSION_KEEP_S:
                del self.sessions[session_id]
        while len(self.sessions) > MAX_SESSIONS:
            del self.sessions[min(self.sessions, key=lambda session_id: self.sessions[session_id][0])]

    def all_sessions(self, now: float | None = None, stale_after: float = 30.0) -> list[dict]:
        """Every kept session, the most recently reported first: its id, state, ranks, message (or None) and when
        it was reported (seconds since the epoch). One reported as training but silent for ``stale_after`` seconds
        (its kernel gone, say) is shown as "stale"; one silent for :data:`SESSION_KEEP_S` seconds is left out (and
        forgotten at the next report)."""
        now = time.time() if now is None else now
        kept = sorted((item for item in self.sessions.values() if now - item[0] <= SESSION_KEEP_S),
                      key=lambda item: item[0], reverse=True)
        return [{"id": report["id"],
                 "session": "stale" if report["session"] == "training" and now - when > stale_after
                 else report["session"],
                 "ranks": report["ranks"], "message": report.get("message"), "reported_at": when}
                for when, report in kept]

    def current_session(self, now: float | None = None, stale_after: float = 30.0) -> dict:
        """The most recently reported session (as :meth:`all_sessions` gives it), and how many sessions there are."""
        sessions = self.all_sessions(now, stale_after)
        if not sessions:
            return {"session": "none", "ranks": []}
        newest = sessions[0]
        return {"session": newest["session"], "ranks": newest["ranks"], "sessions": len(sessions),
                "message": newest["message"]}

    def start_engines(self, ranks: int, image: str, connection_file: str, gpus_per_rank: int = 0,
                      mpi: bool = False) -> dict:
        if not self.job_id:
            raise ValueError("not inside a batch job")
        nodes = len(hostnames(self.environ["SLURM_JOB_NODELIST"]))
        nodes = min(nodes, ranks)
        argv = engine_srun_argv(ranks, nodes, image, connection_file, gpus_per_rank=gpus_per_rank, mpi=mpi)
        log = open(os.path.join(os.path.dirname(connection_file), f"engines-{len(self._steps)}.log"), "ab")
        step = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=self.environ)
        self._steps.append(step)
        return {"pid": step.pid, "argv": argv}

    def submit_job(self, batch_file: str) -> dict:
        """sbatch a kernel's batch script for a new allocation (the kernel, in its container, has no sbatch). The
        script must be a file in the user's home; the job gets none of this job's SLURM_* variables."""
        home = os.path.realpath(os.path.expanduser("~"))
        path = os.path.realpath(batch_file) if isinstance(batch_file, str) else ""
        if not path.startswith(home + os.sep) or not os.path.isfile(path):
            raise ValueError("batch_file must be an existing file in your home directory")
        env = {k: v for k, v in self.environ.items() if not k.startswith("SLURM_")}
        out = subprocess.run(["sbatch", path], capture_output=True, text=True, env=env, timeout=60)
        if out.returncode:
            raise ValueError(f"sbatch refused the job: {out.stderr.strip() or out.stdout.strip()}")
        job_id = re.search(r"\d+", out.stdout).group()
        self._jobs.add(job_id)
        return {"job_id": job_id, "output": out.stdout.strip()}

    def job_time_left(self, job_id: str) -> dict:
        """Walltime left of a job this owner submitted (a kernel's new allocation), as squeue says."""
        if job_id not in self._jobs:
            raise ValueError(f"job {job_id!r} was not submitted through this allocation's owner")
        return {"job_id": job_id, "time_left_s": squeue_time_left(job_id)}

    def cancel_job(self, job_id: str) -> dict:
        if job_id not in self._jobs:
            raise ValueError(f"job {job_id!r} was not submitted through this allocation's owner")
        subprocess.run(["scancel", job_id], check=True, capture_output=True, timeout=60)
        self._jobs.discard(job_id)
        return {"cancelled": job_id}

    def stop_all(self) -> None:
        """When the server ends: no engine step and no job it submitted outlives it."""
        for job_id in list(self._jobs):
            try:
                self.cancel_job(job_id)
            except (subprocess.SubprocessError, OSError, ValueError):
                pass
        self.stop_engines()

    def stop_engines(self) -> int:
        stopped = 0
        for step in self._steps:
            if step.poll() is None:
                os.killpg(step.pid, signal.SIGTERM)
                try:
                    step.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    os.killpg(step.pid, signal.SIGKILL)
                    step.wait()
                stopped += 1
        self._steps.clear()
        return stopped


def handle(owner: AllocationOwner, method: str, path: str, body: dict) -> tuple[int, dict]:
    """The owner's tiny API (pure routing, so it is tested alone)."""
    try:
        if method == "GET" and path == "/allocation":
            return 200, owner.describe()
        if method == "POST" and path == "/engines":
            ranks, image, conn = body.get("ranks"), body.get("image"), body.get("connection_file")
            if not isinstance(ranks, int) or isinstance(ranks, bool) or not 1 <= ranks <= 4096:
                return 400, {"message": "ranks must be a whole number from 1 to 4096"}
            if not isinstance(image, str) or not isinstance(conn, str):
                return 400, {"message": "image and connection_file are required strings"}
            return 201, owner.start_engines(ranks, image, conn, int(body.get("gpus_per_rank", 0)),
                                            body.get("mpi") is True)
        if method == "PUT" and path == "/session":
            owner.report(session_report(body))
            return 200, owner.current_session()
        if method == "POST" and path == "/jobs":
            return 201, owner.submit_job(body.get("batch_file"))
        if method == "GET" and re.fullmatch(r"/jobs/\d+", path):
            return 200, owner.job_time_left(path.rsplit("/", 1)[1])
        if method == "DELETE" and re.fullmatch(r"/jobs/\d+", path):
            return 200, owner.cancel_job(path.rsplit("/", 1)[1])
        if method == "DELETE" and path == "/engines":
            return 200, {"stopped": owner.stop_engines()}
        return 404, {"message": f"no {method} {path}"}
    except (ValueError, OSError, subprocess.SubprocessError) as e:
        return 400, {"message": str(e)}


def request(socket_path: str, method: str, path: str, body: dict | None = None, timeout: float = 60) -> dict:
    """Call the owner from a kernel (inside the container) over its Unix socket."""
    import http.client
    import socket as socketlib

    class UnixConnection(http.client.HTTPConnection):
        def connect(self):
            self.sock = socketlib.socket(socketlib.AF_UNIX, socketlib.SOCK_STREAM)
            self.sock.settimeout(timeout)
            self.sock.connect(socket_path)

    conn = UnixConnection("localhost", timeout=timeout)
    try:
        conn.request(method, path, body=json.dumps(body or {}), headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        data = json.loads(resp.read() or b"{}")
    finally:
        conn.close()
    if resp.status >= 400:
        raise RuntimeError(f"the allocation owner refused {method} {path}: {data.get('message')}")
    return data
