"""Batch runs from a notebook (runs in the kernel): submit a script as Horovod ranks in a job of its own, watch it,
collect what it left, without keeping the notebook open while it runs.

The same calls work in two places:

- in a jupyter-hpcdl job (the kernel in the user's container, with the allocation's owner beside it): a new job of
  that job's batch system (Slurm, Grid Engine), submitted by the owner, whose tasks are the ranks, each in the user's container (``hpcdl-launch``);
- on a laptop or binder (no batch system): ``hpcdl-launch --local`` runs the ranks as processes of this machine, in
  a session of their own, so they outlive the kernel as a batch job would.

Each run has a directory (by default ``$HPCDL_BATCH_ROOT/NAME-TIME``, ``~/hpcdl-batch`` unless set; on a site whose
homes are small, point it at a scratch file system the nodes share): its script, ``output.log`` (every rank's lines,
labelled ``N: ``), ``status.json`` (the ranks' exit code, written when they end) and ``run.json`` (how to find the
run again: :meth:`BatchRun.attach`). The script runs in that directory, so what it writes there is collected too."""
from __future__ import annotations

import getpass
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path
from typing import Sequence

import psutil

from ..commands import end_group_by_id, start_group
from ..containers.kernelspec import kernel_image
from ..job.owner import SOCKET_ENV, owner_socket, request
from ..atomic import write_json
from ..backends import load_backend
from ..jobvalues import check_name, parse_walltime
from ..job.newjob import NewAllocation, batch_run_script, check_job_dir

PENDING, RUNNING, ENDED, UNKNOWN = "pending", "running", "ended", "unknown"
PLACES = ("auto", "batch", "local")
#: Earlier names of a place, still taken.
ALIASES = {"slurm": "batch"}
#: Seconds for each question to the allocation's owner while watching (a query, not a submission).
QUERY_TIMEOUT_S = 30.0
QUEUE_ALLOWANCE_S = 600.0  # what wait() allows for the queue by default, beyond the walltime
ROOT_ENV = "HPCDL_BATCH_ROOT"
#: What the ranks' exit code says, in the words a scheduler would use (for a run whose scheduler has not said yet).
EXIT_STATES = {0: "COMPLETED", 124: "TIMEOUT"}
_STOP_CODES = (128 + signal.SIGTERM, 128 + signal.SIGINT)
_LOCAL_PROCS: dict[int, subprocess.Popen] = {}  # launchers this kernel started, so that they are reaped


@dataclass(frozen=True)
class BatchStatus:
    """Where a run is: ``phase`` is pending, running, ended or unknown (the scheduler could not be asked);
    ``state`` and ``reason`` are the scheduler's words (PENDING / Resources, TIMEOUT, ...); ``exit_code`` is the
    ranks' once they have ended (None before, or when they never reported one)."""

    job_id: str
    where: str
    phase: str
    state: str = ""
    reason: str = ""
    exit_code: int | None = None
    time_left_s: int | None = None

    def __str__(self) -> str:
        words = [f"batch run {self.job_id} ({self.where}): {self.phase}"]
        if self.state:
            words.append(self.state + (f" ({self.reason})" if self.reason else ""))
        elif self.reason:
            words.append(self.reason)
        if self.exit_code is not None:
            words.append(f"exit code {self.exit_code}")
        if self.time_left_s is not None and self.phase == RUNNING:
            words.append(f"{self.time_left_s // 60} min left")
        return ", ".join(words)


@dataclass(frozen=True)
class BatchResult:
    """What an ended run left: its exit code (None if it never reported one: cancelled, out of walltime, lost),
    why it ended, every rank's output, and its directory (with whatever the script wrote there)."""

    job_id: str
    exit_code: int | None
    why: str
    output: str
    directory: Path

    @property
    def ok(self) -> bool:
        return self.exit_code == 0

    def rank_output(self, rank: int) -> str:
        """The lines rank ``rank`` wrote (without their label)."""
        prefix = f"{rank}: "
        return "".join(line[len(prefix):] for line in self.output.splitlines(keepends=True) if line.startswith(prefix))


def state_from_exit(code: int | None, why: str) -> str:
    """The scheduler's word for how the ranks ended, from the launcher's status: CANCELLED only when the launcher
    itself was stopped (a rank that srun ended with SIGTERM because another failed is part of a FAILED run)."""
    if code in _STOP_CODES and why.startswith("stopped by"):
        return "CANCELLED"
    return EXIT_STATES.get(code, "FAILED")


def _resolve(where: str) -> str:
    where = ALIASES.get(where, where)
    if where not in PLACES:
        raise ValueError(f"where must be one of {', '.join(PLACES)}, not {where!r}")
    if where == "auto":
        return "batch" if owner_socket() else "local"
    if where == "batch" and not owner_socket():
        raise RuntimeError("where='batch' submits through the allocation's owner of a jupyter-hpcdl job, and this "
                           f"kernel has none (${SOCKET_ENV} unset): run it from your JupyterLab on the hub, or use "
                           "where='local' for ranks on this machine")
    return where


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


class BatchRun:
    """One batch run: :meth:`submit` starts it, :meth:`status` and :meth:`wait` watch it, :meth:`result` collects
    it, :meth:`cancel` ends it. :meth:`attach` finds a run again from its directory (after a kernel restart)."""

    def __init__(self, directory: Path, record: dict):
        self.directory = directory
        self.job_id: str = record["job_id"]
        self.where: str = ALIASES.get(record["where"], record["where"])
        self._record = record

    def __repr__(self) -> str:
        return f"<BatchRun {self.job_id} ({self.where}) in {self.directory}>"

    @classmethod
    def submit(cls, script: str | os.PathLike | None = None, args: Sequence[str] = (), *,
               command: Sequence[str] | None = None, ranks: int = 2, nodes: int = 1,
               walltime: str | int = "00:30:00", partition: str | None = None, account: str | None = None,
               gpus_per_rank: int | None = None, image: str | None = None, name: str = "batch",
               directory: str | os.PathLike | None = None, where: str = "auto",
               backend: str | None = None) -> "BatchRun":
        """Run the Python ``script`` with ``args`` (or any ``command``) as ``ranks`` ranks of the training
        ``backend`` (by default this kernel's ``HPCDL_BACKEND``, else "horovod"): Horovod's join one world at
        ``hvd.init()``, PyTorch's (``backend="torch"``) at a torchrun script's ``init_process_group()`` (the command
        must then be ``python script.py ...``). In a job: ``nodes`` nodes, ``gpus_per_rank`` GPUs each, the ``walltime``,
        ``partition`` and ``account`` of the new job (``gpus_per_rank`` by default one where this kernel's job has GPUs,
        as its own tasks do), ranks in the container of ``image`` (by default the one this kernel runs in). Locally: ``ranks``
        processes, ended at the walltime. Returns once the run is submitted (or started), not when it ends."""
        where = _resolve(where)
        if (script is None) == (command is None):
            raise ValueError("give the script to run (and its args), or a command, not both")
        check_name("name", name)
        minutes = parse_walltime(walltime)
        if script is not None:
            path = Path(script).expanduser().resolve()
            if not path.is_file():
                raise ValueError(f"there is no script {str(script)!r} (looked at {path})")
            if not isinstance(args, (list, tuple)) or not all(isinstance(a, str) for a in args):
                raise ValueError("args must be a list of strings, e.g. ['--epochs', '3']")
            # the ranks' Python: this kernel's here; the container's in a job (its python3 has the stack)
            command = [sys.executable if where == "local" else "python3", str(path), *args]
        command = list(command)
        if not command or not all(isinstance(word, str) and word for word in command):
            raise ValueError("the command must be a non-empty list of non-empty strings")
        backend = load_backend(backend)
        backend.rank_command(command)  # a command the backend cannot start as ranks fails here
        stamp = datetime.now().strftime("%Y%m%d-%H%M%S-%f")
        directory = Path(directory).expanduser().resolve() if directory else batch_root() / f"{name}-{stamp}"
        check_job_dir(str(directory))
        alloc = NewAllocation(nodes=nodes, walltime=minutes, partition=partition, account=account,
                              gpus_per_rank=gpus_per_rank or 0)
        scheduler = None
        if where == "batch":  # build (and check) the script before anything is made
            from ..batchsystems.scheduler import owners_scheduler
            from ..job.offer import within_offer

            sock = owner_socket()
            told = request(sock, "GET", "/allocation", timeout=QUERY_TIMEOUT_S)
            if not told.get("in_job"):
                raise RuntimeError("this kernel's server runs outside a batch job: there is no batch system to submit "
                                   "to; use where='local' for ranks on this machine")
            scheduler = told.get("scheduler") or "slurm"
            if gpus_per_rank is None and told.get("gpus_per_node"):  # the job's own choice: a GPU per task
                alloc = replace(alloc, gpus_per_rank=1)
            offered = within_offer(alloc, ranks, image or kernel_image(), told.get("offer"), getpass.getuser())
            text = batch_run_script(owners_scheduler(told), offered.alloc, ranks, str(directory), told["host_python"],
                                    offered.image_ref, command, f"hpcdl-batch-{name}", backend.name)
        elif not isinstance(ranks, int) or isinstance(ranks, bool) or not 1 <= ranks <= 256:
            raise ValueError(f"ranks must be a whole number from 1 to 256 on this machine, not {ranks!r}")
        directory.mkdir(parents=True, exist_ok=False)
        record = {"where": where, **({"scheduler": scheduler} if scheduler else {}), "name": name, "ranks": ranks,
                  "backend": backend.name, "command": command, "submitted_at": time.time(), "walltime_s": minutes * 60}
        try:
            if where == "batch":
                job_file = directory / "job.sh"
                job_file.write_text(text)
                reply = request(sock, "POST", "/jobs", {"batch_file": str(job_file), "keep": True})
                record["job_id"] = reply["job_id"]
            else:
                record.update(cls._start_local(directory, ranks, minutes * 60, command, backend.name))
        except BaseException:
            shutil.rmtree(directory, ignore_errors=True)  # nothing was submitted: leave no half-made run behind
            raise
        write_json(str(directory / "run.json"), record, indent=1)
        return cls(directory, record)

    @staticmethod
    def _start_local(directory: Path, ranks: int, time_limit_s: int, command: list[str], backend: str) -> dict:
        argv = [sys.executable, "-m", "jupyter_hpcdl.job.launch", f"--backend={backend}", f"--local={ranks}",
                f"--time-limit={time_limit_s}",
                "--label", f"--status-file={directory / 'status.json'}", "--", *command]
        with open(directory / "output.log", "ab") as log:
            proc = start_group(argv, cwd=directory, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
        _LOCAL_PROCS[proc.pid] = proc
        return {"job_id": f"local-{proc.pid}", "pid": proc.pid, "started_at": psutil.Process(proc.pid).create_time()}

    @classmethod
    def attach(cls, directory: str | os.PathLike) -> "BatchRun":
        """The run whose directory this is (as :meth:`submit` made it)."""
        directory = Path(directory).expanduser().resolve()
        record = _read_json(directory / "run.json")
        if not record or "job_id" not in record:
            raise ValueError(f"{directory} is not a batch run's directory (it has no readable run.json)")
        return cls(directory, record)

    def _ended(self) -> dict | None:
        return _read_json(self.directory / "status.json")

    def _local_alive(self) -> bool:
        pid = self._record["pid"]
        proc = _LOCAL_PROCS.get(pid)
        if proc is not None:
            return proc.poll() is None
        try:  # started by an earlier kernel: the same pid and start time, or it is gone
            return abs(psutil.Process(pid).create_time() - self._record["started_at"]) < 1.0
        except psutil.Error:
            return False

    def status(self) -> BatchStatus:
        """Where the run is now (one question to the scheduler, with a deadline)."""
        ended = self._ended()
        code = ended.get("exit_code") if ended else None
        if self.where == "local":
            if ended:
                state = state_from_exit(code, ended.get("why", ""))
                return BatchStatus(self.job_id, self.where, ENDED, state, ended.get("why", ""), code)
            if self._local_alive():
                return BatchStatus(self.job_id, self.where, RUNNING, "RUNNING")
            return BatchStatus(self.job_id, self.where, ENDED, "LOST",
                               "the launcher ended without writing its status (killed?): see output()")
        sock = owner_socket()
        try:
            if not sock:
                raise RuntimeError("this kernel has no allocation owner to ask")
            reply = request(sock, "GET", f"/jobs/{self.job_id}", timeout=QUERY_TIMEOUT_S)
        except (RuntimeError, OSError) as e:  # e.g. submitted by an earlier server: the files still tell the end
            if ended:
                return BatchStatus(self.job_id, self.where, ENDED, "", ended.get("why", ""), code)
            return BatchStatus(self.job_id, self.where, UNKNOWN, "", f"could not ask the scheduler: {e}")
        phase = reply.get("phase", UNKNOWN)
        if ended and phase in (ENDED, UNKNOWN, RUNNING):  # the ranks are done, the job is ending
            state = reply.get("state") if phase == ENDED and reply.get("state") else \
                state_from_exit(code, ended.get("why", ""))
            return BatchStatus(self.job_id, self.where, ENDED, state, ended.get("why", ""), code)
        return BatchStatus(self.job_id, self.where, phase, reply.get("state", ""), reply.get("reason", ""),
                           None, reply.get("time_left_s"))

    def wait(self, timeout: float | None = None, every: float = 5.0, show: bool = True) -> BatchStatus:
        """Watch the run until it ends: a line each time its phase, state or reason changes (``show``). Past
        ``timeout`` seconds (by default its walltime and 10 minutes more for the queue) :class:`TimeoutError` says
        where it is; the run goes on (wait again, or cancel it)."""
        if timeout is None:
            timeout = self._record.get("walltime_s", 3600) + QUEUE_ALLOWANCE_S
        if not timeout > 0 or not every > 0:
            raise ValueError("timeout and every must be positive numbers of seconds")
        deadline = time.monotonic() + timeout
        said = None
        while True:
            now = self.status()
            seen = (now.phase, now.state, now.reason)
            if show and seen != said:
                print(f"{datetime.now():%H:%M:%S} {now}", flush=True)
                said = seen
            if now.phase == ENDED:
                return now
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{now}; still not ended after {timeout:g} s. It goes on: wait() again, "
                                   "or cancel() it")
            time.sleep(min(every, left))

    def output(self, tail: int | None = None) -> str:
        """What the ranks have written so far (every rank's lines, labelled ``N: ``); the last ``tail`` lines."""
        try:
            text = (self.directory / "output.log").read_text(errors="replace")
        except FileNotFoundError:
            return ""
        return text if tail is None else "".join(text.splitlines(keepends=True)[-tail:])

    def result(self) -> BatchResult:
        """What the ended run left; :class:`RuntimeError` while it has not ended."""
        now = self.status()
        if now.phase != ENDED:
            raise RuntimeError(f"{now}: it has not ended yet (wait() for it first)")
        ended = self._ended()
        why = ended.get("why", "") if ended else \
            f"the ranks never reported an exit code: {now.state or 'ended'} {now.reason}".strip()
        return BatchResult(self.job_id, now.exit_code, why, self.output(), self.directory)

    def cancel(self, grace: float = 10.0) -> None:
        """End the run: the job is cancelled (its ranks get SIGTERM, then SIGKILL), or the local ranks' process
        group is ended after ``grace`` seconds."""
        if self.where == "local":
            if self._local_alive():
                end_group_by_id(self._record["pid"], grace)
            proc = _LOCAL_PROCS.pop(self._record["pid"], None)
            if proc is not None:
                proc.wait(5)
            return
        sock = owner_socket()
        if not sock:
            from ..batchsystems.scheduler import load_scheduler

            how = " ".join(load_scheduler(self._record.get("scheduler", "slurm")).cancel_argv(self.job_id))
            raise RuntimeError(f"this kernel has no allocation owner to cancel job {self.job_id}: cancel it with "
                               f"{how} in a terminal")
        request(sock, "DELETE", f"/jobs/{self.job_id}")


def batch_root() -> Path:
    """Where new runs' directories go: ``$HPCDL_BATCH_ROOT``, else ``~/hpcdl-batch``."""
    return Path(os.environ.get(ROOT_ENV) or Path.home() / "hpcdl-batch").expanduser().resolve()


def runs(root: str | os.PathLike | None = None) -> list[BatchRun]:
    """Every batch run under ``root`` (:func:`batch_root`), the newest first."""
    root = Path(root).expanduser() if root else batch_root()
    found = []
    for path in sorted(root.glob("*/run.json"), key=lambda p: p.stat().st_mtime, reverse=True):
        try:
            found.append(BatchRun.attach(path.parent))
        except ValueError:
            pass
    return found


__all__ = ["BatchRun", "BatchStatus", "BatchResult", "runs"]
