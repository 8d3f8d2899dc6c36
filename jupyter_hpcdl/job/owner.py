"""The allocation's owner, on the host side of a batch job (beside the scheduler's client): it describes the
allocation and starts the training engines in it, each inside the user's container, when a kernel asks. What it
asks the batch system goes through the job's adapter (``jupyter_hpcdl.batchsystems.scheduler``): it names no command.

Kernels run inside containers, where there is no scheduler client: they ask this owner over a Unix socket in the
user's private job directory (file permissions are the authentication). The Jupyter server extension
(``jupyter_hpcdl.job.serverext``) runs it for the job that runs the user's JupyterLab.

The owner and its router :func:`handle` are asynchronous: the extension serves them on JupyterLab's own event loop
(which alone owns the owner's state), so a slow submission or query must not stall every other request of the
lab. Each command runs as an asyncio subprocess with a deadline, and a command past it is killed with its process
group and named in the error ("sbatch did not answer in 60 s"). The synchronous parts are for where there is no
loop: the kernels' client :func:`request`, :func:`job_time_left`, and
:meth:`AllocationOwner.stop_all_sync` for ``atexit``."""
from __future__ import annotations

import asyncio
import math
import os
import re
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence

import httpx

from typing import TYPE_CHECKING

from ..containers.kernelspec import KERNEL_ENV, in_container_argv
from ..containers.spec import check_image_ref
from ..commands import Result, end_groups, end_groups_async, run, run_sync, start_group
from .tasks import TASK_NODE_ENV, TASK_RANK_ENV

if TYPE_CHECKING:
    from ..batchsystems.scheduler import JobResources, Scheduler

SOCKET_ENV = "HPCDL_ALLOCATION_FILE"
#: Deadlines, in seconds: for submitting and cancelling; for the queries (time left, hosts); and how long the
#: engines' tasks have between SIGTERM and SIGKILL.
COMMAND_TIMEOUT_S = 60.0
QUERY_TIMEOUT_S = 15.0
STOP_GRACE_S = 60.0  # longer than jupyter_hpcdl.job.tasks takes to end tasks started alone
#: What MPI in the container needs from srun's PMIx: its per-task variables, and its rendezvous under /tmp.
MPI_IN_CONTAINER = ("--env-prefix=PMIX_", "--env-prefix=SLURM_", "--env-prefix=OMPI_", "--volume=/tmp")
#: What an engine in a container gets by name: the kernel's variables, its task (the batch system's or
#: jupyter_hpcdl.job.tasks'), and ipyparallel's cluster.
ENGINE_ENV = (*KERNEL_ENV, TASK_RANK_ENV, TASK_NODE_ENV, "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NODEID", "SLURM_STEP_TASKS_PER_NODE",
              "SLURM_STEP_NODELIST", "IPP_CLUSTER_ID", "IPP_PROFILE_DIR", "IPP_CONNECTION_INFO")


def owner_socket() -> str | None:
    """The allocation owner's socket, when this kernel runs in a jupyter-hpcdl job."""
    path = os.environ.get(SOCKET_ENV)
    return path if path and os.path.exists(path) else None


def check_ranks_fit(ranks: int, hosts: list[tuple[str, int]]) -> None:
    """ValueError, saying the job's task slots and the ways out, when ``ranks`` (one per slot) do not fit the job."""
    slots = sum(n for _, n in hosts)
    if ranks <= slots:
        return
    where = ", ".join(f"{host}: {n}" for host, n in hosts)
    raise ValueError(
        f"{ranks} ranks do not fit this job: it has {slots} task slot(s), one rank each ({where}). Ask for at most "
        f"{slots} (TrainingSession(ranks={slots})), start your server with more nodes or GPUs per node (the "
        f"server's form), or train in a job of their own: TrainingSession(ranks={ranks}, where=\"new\", "
        f"new_allocation=NewAllocation(nodes=..., gpus_per_rank=...))")


def default_socket_path(job_id: str) -> str:
    return os.path.expanduser(f"~/.jupyter-hpcdl/jobs/{job_id}/allocation.sock")


def engines_argv(ranks: int, image: str, connection_file: str, python: str = sys.executable,
                 gpus_per_rank: int = 0, mpi: bool = False, env: Mapping[str, str] | None = None) -> list[str]:
    """``ranks`` ipyparallel engines as tasks over the job's allocation (``jupyter_hpcdl.job.tasks``: block-wise, the
    batch system's way), each in the user's container for ``image`` (created on first use), each with its own
    GPU(s). ``env``: where the variables an engine gets by name are looked up (those set are passed to tasks that
    are started alone)."""
    check_image_ref(image)
    if not 1 <= ranks <= 4096 or not 0 <= gpus_per_rank <= 16:
        raise ValueError(f"need 1 to 4096 ranks with 0 to 16 GPUs each, not {ranks} with {gpus_per_rank}")
    if not os.path.isabs(connection_file) or "\n" in connection_file:
        raise ValueError("the connection file must be an absolute path")
    names = [n for n in ENGINE_ENV if n in (os.environ if env is None else env)]
    return [python, "-m", "jupyter_hpcdl.job.tasks", f"--ranks={ranks}", f"--gpus-per-rank={gpus_per_rank}",
            "--name=hpcdl-engines", *(["--mpi"] if mpi else []), *(f"--env={n}" for n in names), "--",
            *in_container_argv(image, python, ENGINE_ENV,
                               ["python3", "-m", "ipyparallel.engine", f"--file={connection_file}", "--quiet"],
                               MPI_IN_CONTAINER if mpi else ())]


SESSION_STATES = ("none", "starting", "idle", "training", "stopped", "failed", "walltime")
#: A session not reported for this many seconds is forgotten (its kernel gone without saying "none", say) ...
SESSION_KEEP_S = 3600.0
#: ... and at most this many sessions are kept: beyond it, the least recently reported one is forgotten.
MAX_SESSIONS = 32
RANK_FIELDS = {"rank": int, "node": str, "gpu": str, "container": str, "state": str, "straggler": bool,
               "loss": float, "samples_per_s": float}


def _scheduler(env: Mapping[str, str]) -> Scheduler | None:
    from ..batchsystems.scheduler import job_scheduler

    return job_scheduler(env)


def _resources(sched: Scheduler, out: Result) -> JobResources | None:
    return sched.parse_resources(out.stdout, time.time()) if out.returncode == 0 else None


def job_time_left(job_id: str | None = None, sched: Scheduler | None = None, timeout: float = QUERY_TIMEOUT_S,
                  env: Mapping[str, str] | None = None) -> int | None:
    """Seconds left for ``job_id`` (by default this process's job) as the batch system (by default this job's) says,
    or None (no limit, not in a job, the job is not known, or the scheduler did not answer in ``timeout`` s)."""
    env = os.environ if env is None else env
    sched = sched or _scheduler(env)
    job_id = job_id or (sched.job_id(env) if sched else "")
    if sched is None or not job_id:
        return None
    try:
        found = _resources(sched, run_sync(sched.resources_argv(job_id), timeout, env))
    except (OSError, ValueError, NotImplementedError):
        return None
    return found.time_left_s if found else None


async def job_time_left_async(sched: Scheduler, job_id: str, env: Mapping[str, str],
                              timeout: float = QUERY_TIMEOUT_S) -> int | None:
    """:func:`job_time_left` on the event loop."""
    try:
        found = _resources(sched, await run(sched.resources_argv(job_id), env=env, timeout=timeout))
    except (OSError, ValueError, NotImplementedError):
        return None
    return found.time_left_s if found else None


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


def container_mode(environ: Mapping[str, str]) -> dict | None:
    """How containers run on this node (the kernels', the engines' here): the mode and why, as the site's settings
    and the node's cached probe say, without starting one. None until a first start has probed the node, or where
    the site's settings cannot be read (the kernels' own start says why)."""
    from ..containers.site import SITE_CONFIG_ENV, load_site  # traitlets: only where asked

    try:
        decision = load_site(environ.get(SITE_CONFIG_ENV)).client(dict(environ)).known_mode()
    except Exception:  # noqa: BLE001 (a broken site file is the container start's error to report, not the panel's)
        return None
    return {"mode": decision.mode, "reason": decision.reason} if decision else None


def _start_step(argv: list[str], log_path: str, env: Mapping[str, str]) -> subprocess.Popen:
    """Start an engine step in a process group of its own, its output appended to ``log_path``; this does not wait
    for it (a fork and an exec), so the event loop may call it."""
    with open(log_path, "ab") as log:
        return start_group(argv, stdout=log, stderr=subprocess.STDOUT, env=env)


#: A step's group is signalled after its leader (srun, the tasks' launcher) exited too: what it left still goes.
SIGNAL_EXITED_STEPS = True


class AllocationOwner:
    """Describe the current allocation and run engine steps in it. The methods that run commands are coroutines,
    for the event loop that owns this object's state."""

    def __init__(self, environ: Mapping[str, str] | None = None):
        self.environ = dict(os.environ if environ is None else environ)
        self.sched = _scheduler(self.environ)  # the batch system of the job this runs in, or None
        self.job_id = self.sched.job_id(self.environ) if self.sched else ""
        self._steps: list[subprocess.Popen] = []
        self._jobs: set[str] = set()  # new allocations submitted for kernels (cancelled when the server ends)
        self._known: set[str] = set()  # every job submitted for kernels (batch runs too, which outlive the server)
        self.sessions: dict[str, tuple[float, dict]] = {}  # by session id: (when reported, report)

    async def hosts(self) -> list[tuple[str, int]]:
        """The job's hosts and their task slots."""
        from ..batchsystems.scheduler import RoleUnsupported, require

        try:
            require(self.sched, "job")
        except RoleUnsupported as e:
            raise RoleUnsupported(f"{e}; in this job, TrainingSession(where='local') runs ranks on its first node") \
                from None
        argv = self.sched.hosts_argv(self.environ)
        out = (await run(argv, env=self.environ, timeout=QUERY_TIMEOUT_S)) if argv else None
        if out is not None and out.returncode:
            raise ValueError(f"{argv[0]} could not list the job's hosts: {out.stderr.strip()[:300]}")
        return self.sched.parse_hosts(out.stdout if out else "", self.environ)

    async def describe(self) -> dict:
        if not self.job_id:
            return {"in_job": False, "job_id": None,
                    "message": "Not in a batch job: this server runs outside a batch system, so training sessions "
                               "start their ranks as local engines on this machine."}
        from ..batchsystems.scheduler import OFFER_ENV

        hosts = await self.hosts()
        out = await run(self.sched.resources_argv(self.job_id), env=self.environ, timeout=QUERY_TIMEOUT_S)
        found = _resources(self.sched, out)
        now = time.time()
        gpus = None
        if found is not None:
            gpus = found.gpus_per_node if found.gpus_per_node is not None else (found.gpus_per_task or 0) * hosts[0][1]
        return {"in_job": True, "job_id": self.job_id, "scheduler": self.sched.name,
                "scheduler_config": self.sched.job_config(), "offer": self.environ.get(OFFER_ENV, ""),
                "nodes": [h for h, _ in hosts],
                "slots": [n for _, n in hosts], "partition": found.partition if found else "",
                "host_python": sys.executable, "gpus_per_node": gpus,
                "time_left": found.time_left if found else "", "time_left_s": found.time_left_s if found else None,
                "cuda_visible_devices": self.environ.get("CUDA_VISIBLE_DEVICES"),
                "containers": container_mode(self.environ),
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

    async def start_engines(self, ranks: int, image: str, connection_file: str, gpus_per_rank: int = 0,
                            mpi: bool = False) -> dict:
        """Start ``ranks`` engines as tasks over this job (one process group, stopped on the loop or at exit); this
        returns once they are started, not when the engines are up."""
        if not self.job_id:
            raise ValueError("not inside a batch job")
        check_ranks_fit(ranks, await self.hosts())  # at once, not after the engines' start timeout
        argv = engines_argv(ranks, image, connection_file, gpus_per_rank=gpus_per_rank, mpi=mpi, env=self.environ)
        # beside the controller's connection file, named after it: two jobs of the user share the profile directory
        log = f"{os.path.splitext(connection_file)[0]}-engines-{len(self._steps)}.log"
        try:
            offset = os.path.getsize(log)  # (the log is appended to: an earlier step's lines are not this one's)
        except OSError:
            offset = 0
        step = _start_step(argv, log, self.environ)
        self._steps.append(step)
        return {"pid": step.pid, "argv": argv, "log": log, "log_offset": offset}

    def _submitted(self, job_id: str) -> None:
        if job_id not in self._known:
            raise ValueError(f"job {job_id!r} was not submitted through this allocation's owner")

    def _batch_system(self) -> Scheduler:
        if self.sched is None:
            raise ValueError("not inside a batch job: there is no batch system to submit to")
        return self.sched

    async def submit_job(self, batch_file: str, keep: bool = False) -> dict:
        """Submit a kernel's batch script (the kernel, in its container, has no scheduler client). The script must
        be a file in the user's home; the job gets none of this job's own variables that the submission would read
        as options. A job is cancelled when this server ends, unless ``keep`` (a batch run, which is meant to
        outlive the notebook)."""
        sched = self._batch_system()
        home = os.path.realpath(os.path.expanduser("~"))
        path = os.path.realpath(batch_file) if isinstance(batch_file, str) else ""
        if not path.startswith(home + os.sep) or not os.path.isfile(path):
            raise ValueError("batch_file must be an existing file in your home directory")
        from ..batchsystems.scheduler import require

        require(sched, "ranks")
        argv = sched.submit_file_argv(path)
        env = {k: v for k, v in self.environ.items() if not k.startswith(sched.job_env_prefixes or ("\0",))}
        out = await run(argv, env=env, timeout=COMMAND_TIMEOUT_S)
        if out.returncode:
            raise ValueError(f"{argv[0]} refused the job: {out.stderr.strip() or out.stdout.strip()}")
        job_id = sched.parse_submit(out.stdout)
        self._known.add(job_id)
        if not keep:
            self._jobs.add(job_id)
        return {"job_id": job_id, "output": out.stdout.strip()}

    async def job_status(self, job_id: str) -> dict:
        """A job this owner submitted: its phase (pending, running, ended or unknown), the scheduler's state and
        reason, and its walltime left, as the scheduler says. A job the scheduler has forgotten (some time after it
        ended) is "ended" with an empty state."""
        from ..batchsystems.scheduler import ENDED, UNKNOWN

        self._submitted(job_id)
        sched = self._batch_system()

        def unknown(why: str) -> dict:
            return {"job_id": job_id, "phase": UNKNOWN, "state": "", "reason": why[:300], "time_left_s": None}

        try:
            out = await run(sched.job_argv(job_id), env=self.environ, timeout=QUERY_TIMEOUT_S)
            info = sched.parse_job(out.stdout) if out.returncode == 0 else None
            if info is None and (out.returncode == 0 or sched.job_forgotten(out.stderr)):
                accounting = sched.accounting_argv(job_id)
                if accounting is None:
                    return {"job_id": job_id, "phase": ENDED, "state": "", "reason": "", "time_left_s": None}
                out = await run(accounting, env=self.environ, timeout=QUERY_TIMEOUT_S)
                info = sched.parse_job(out.stdout) if out.returncode == 0 else None
                if info is None:  # not (yet) in the accounting either
                    return unknown(f"{accounting[0]} does not know job {job_id} (yet)")
        except (OSError, TimeoutError, ValueError) as e:
            return unknown(str(e))
        if info is None:
            return unknown(out.stderr.strip())
        running = info.phase != ENDED
        time_left = await job_time_left_async(sched, job_id, self.environ) if running else None
        return {"job_id": job_id, "phase": info.phase, "state": info.state, "reason": info.reason,
                "exit_code": info.exit_code, "time_left_s": time_left}

    async def cancel_job(self, job_id: str) -> dict:
        self._submitted(job_id)
        argv = self._batch_system().cancel_argv(job_id)
        result = await run(argv, env=self.environ, timeout=COMMAND_TIMEOUT_S)
        if result.returncode:
            raise ValueError(result.failure(argv[0]))
        self._jobs.discard(job_id)  # still known: its state can be asked until the scheduler forgets it
        return {"cancelled": job_id}

    def _running_steps(self) -> list[subprocess.Popen]:
        return [step for step in self._steps if step.poll() is None]

    async def stop_engines(self) -> int:
        """Stop every engine step (SIGTERM to its process group, SIGKILL after :data:`STOP_GRACE_S` seconds); returns
        how many were running."""
        steps = self._running_steps()
        await end_groups_async(steps, STOP_GRACE_S, signal_exited=SIGNAL_EXITED_STEPS)
        self._steps = self._running_steps()  # a step started meanwhile stays
        return len(steps)

    def stop_all_sync(self) -> None:
        """When the server ends (``atexit``, the event loop gone): no engine step and no job it submitted outlives
        it. Best effort, blocking, with the same deadlines."""
        jobs, self._jobs = sorted(self._jobs), set()
        for job_id in jobs if self.sched else ():
            try:
                run_sync(self.sched.cancel_argv(job_id), COMMAND_TIMEOUT_S, self.environ)
            except OSError:
                pass
        end_groups(self._running_steps(), STOP_GRACE_S, signal_exited=SIGNAL_EXITED_STEPS)
        self._steps = self._running_steps()


async def handle(owner: AllocationOwner, method: str, path: str, body: dict) -> tuple[int, dict]:
    """The owner's tiny API (pure routing, so it is tested alone)."""
    try:
        if method == "GET" and path == "/allocation":
            return 200, await owner.describe()
        if method == "POST" and path == "/engines":
            ranks, image, conn = body.get("ranks"), body.get("image"), body.get("connection_file")
            if not isinstance(ranks, int) or isinstance(ranks, bool) or not 1 <= ranks <= 4096:
                return 400, {"message": "ranks must be a whole number from 1 to 4096"}
            if not isinstance(image, str) or not isinstance(conn, str):
                return 400, {"message": "image and connection_file are required strings"}
            return 201, await owner.start_engines(ranks, image, conn, int(body.get("gpus_per_rank", 0)),
                                                  body.get("mpi") is True)
        if method == "PUT" and path == "/session":
            owner.report(session_report(body))
            return 200, owner.current_session()
        if method == "POST" and path == "/jobs":
            return 201, await owner.submit_job(body.get("batch_file"), body.get("keep") is True)
        if method == "GET" and re.fullmatch(r"/jobs/\d+", path):
            return 200, await owner.job_status(path.rsplit("/", 1)[1])
        if method == "DELETE" and re.fullmatch(r"/jobs/\d+", path):
            return 200, await owner.cancel_job(path.rsplit("/", 1)[1])
        if method == "DELETE" and path == "/engines":
            return 200, {"stopped": await owner.stop_engines()}
        return 404, {"message": f"no {method} {path}"}
    except (ValueError, OSError, subprocess.SubprocessError) as e:
        return 400, {"message": str(e)}
    except NotImplementedError:  # a member an adapter's roles do not cover
        name = owner.sched.name if owner.sched else "this batch system"
        return 400, {"message": f"{method} {path} is not supported in a {name} job yet (Slurm and Grid Engine are)"}


#: The kernels' default wait for the owner: longer than the owner's own deadline for a command, so that a kernel
#: never gives up on (and then repeats) a submission that the owner still completes.
CLIENT_TIMEOUT_S = COMMAND_TIMEOUT_S + 30


def request(socket_path: str, method: str, path: str, body: dict | None = None,
            timeout: float = CLIENT_TIMEOUT_S) -> dict:
    """Call the owner from a kernel (inside the container) over its Unix socket; its JSON reply. Raises
    :class:`RuntimeError` when the owner refuses (status 400 or more), :class:`TimeoutError` when it does not answer in
    ``timeout`` seconds and :class:`ConnectionError` when nothing listens at ``socket_path`` (both are OSErrors)."""
    what = f"{method} {path}"
    transport = httpx.HTTPTransport(uds=socket_path, verify=False)  # plain HTTP: no CA bundle to load (~30 ms)
    try:
        with httpx.Client(transport=transport, timeout=timeout, trust_env=False) as client:
            resp = client.request(method, f"http://localhost{path}", json=body)
    except httpx.TimeoutException:
        raise TimeoutError(f"the allocation owner did not answer {what} in {timeout:g} s") from None
    except httpx.ConnectError as e:
        raise ConnectionError(f"no allocation owner answers at {socket_path} ({what}): {e}") from None
    except httpx.TransportError as e:
        raise ConnectionError(f"the allocation owner broke off {what}: {e}") from None
    try:
        data = resp.json() if resp.content else {}
    except ValueError:
        data = {"message": resp.text.strip()[:500]}
    if resp.status_code >= 400:
        raise RuntimeError(f"the allocation owner refused {what}: {data.get('message')}")
    return data
