"""The allocation's owner, on the host side of a batch job (beside the scheduler's client): it describes the
allocation, starts the training engines in it (each inside the user's container) when a kernel asks, submits and
cancels the jobs kernels ask for, and keeps the kernels' session reports for the panel. The Jupyter server extension
(``jupyter_hpcdl.job.serverext``) runs it for the job that runs the user's JupyterLab, behind its API
(:func:`jupyter_hpcdl.job.ownerapi.handle`); what kernels share with it is in :mod:`jupyter_hpcdl.job.owner`.

The owner is asynchronous: the extension serves it on JupyterLab's own event loop (which alone owns the owner's
state), so a slow submission or query must not stall every other request of the lab. Each command runs as an asyncio
subprocess with a deadline, and a command past it is killed with its process group and named in the error ("sbatch
did not answer in 60 s"). :meth:`AllocationOwner.stop_all_sync` is for ``atexit``, where there is no loop."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING

from ..commands import end_groups, end_groups_async, run, run_sync, start_group
from .owner import (COMMAND_TIMEOUT_S, QUERY_TIMEOUT_S, check_ranks_fit, engines_argv, job_resources,
                    job_time_left_async, scheduler_of)

if TYPE_CHECKING:
    from ..batchsystems.scheduler import Scheduler

#: How long the engines' tasks have between SIGTERM and SIGKILL.
STOP_GRACE_S = 60.0  # longer than jupyter_hpcdl.job.tasks takes to end tasks started alone
#: A session not reported for this many seconds is forgotten (its kernel gone without saying "none", say) ...
SESSION_KEEP_S = 3600.0
#: ... and at most this many sessions are kept: beyond it, the least recently reported one is forgotten.
MAX_SESSIONS = 32


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
        self.sched = scheduler_of(self.environ)  # the batch system of the job this runs in, or None
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
        found = job_resources(self.sched, out)
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
