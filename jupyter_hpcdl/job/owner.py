"""The allocation's owner as kernels and the job's server know it: its socket (:data:`SOCKET_ENV`), its deadlines,
the engines' command line it starts (:func:`engines_argv`), the job's time left (:func:`job_time_left`) and the
kernels' client (:func:`request`). The owner itself (on the host side of a batch job, beside the scheduler's client)
is :class:`jupyter_hpcdl.job.allocation.AllocationOwner`; its API is :func:`jupyter_hpcdl.job.ownerapi.handle`.

Kernels run inside containers, where there is no scheduler client: they ask the owner over a Unix socket in the
user's private job directory (file permissions are the authentication). What the owner asks the batch system goes
through the job's adapter (``jupyter_hpcdl.batchsystems.scheduler``): it names no command. :func:`request` and
:func:`job_time_left` are synchronous (kernels, and where there is no event loop)."""
from __future__ import annotations

import os
import sys
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING

import httpx

from ..commands import Result, run, run_sync
from ..containers.kernelspec import KERNEL_ENV, in_container_argv
from ..containers.spec import check_image_ref
from .tasks import TASK_NODE_ENV, TASK_RANK_ENV

if TYPE_CHECKING:
    from ..batchsystems.scheduler import JobResources, Scheduler

SOCKET_ENV = "HPCDL_ALLOCATION_FILE"
#: Deadlines, in seconds: for submitting and cancelling; for the queries (time left, hosts).
COMMAND_TIMEOUT_S = 60.0
QUERY_TIMEOUT_S = 15.0
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

def scheduler_of(env: Mapping[str, str]) -> Scheduler | None:
    """The batch system of the job ``env`` is in, or None."""
    from ..batchsystems.scheduler import job_scheduler

    return job_scheduler(env)


def job_resources(sched: Scheduler, out: Result) -> JobResources | None:
    """What the batch system's answer ``out`` (to its resources query) says the job has, or None."""
    return sched.parse_resources(out.stdout, time.time()) if out.returncode == 0 else None


def job_time_left(job_id: str | None = None, sched: Scheduler | None = None, timeout: float = QUERY_TIMEOUT_S,
                  env: Mapping[str, str] | None = None) -> int | None:
    """Seconds left for ``job_id`` (by default this process's job) as the batch system (by default this job's) says,
    or None (no limit, not in a job, the job is not known, or the scheduler did not answer in ``timeout`` s)."""
    env = os.environ if env is None else env
    sched = sched or scheduler_of(env)
    job_id = job_id or (sched.job_id(env) if sched else "")
    if sched is None or not job_id:
        return None
    try:
        found = job_resources(sched, run_sync(sched.resources_argv(job_id), timeout, env))
    except (OSError, ValueError, NotImplementedError):
        return None
    return found.time_left_s if found else None


async def job_time_left_async(sched: Scheduler, job_id: str, env: Mapping[str, str],
                              timeout: float = QUERY_TIMEOUT_S) -> int | None:
    """:func:`job_time_left` on the event loop."""
    try:
        found = job_resources(sched, await run(sched.resources_argv(job_id), env=env, timeout=timeout))
    except (OSError, ValueError, NotImplementedError):
        return None
    return found.time_left_s if found else None

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
