"""Engines in a new batch job of their own (runs in the kernel): a controller here, and a job whose tasks are the
engines, submitted by ipyparallel's engine launcher for the batch system with our script, from here or by the
allocation's owner, within the form's limits, and cancelled when the world ends."""
from __future__ import annotations

import getpass
import os
import re
import shutil
import subprocess
import sys

import ipyparallel as ipp

from ..job.owner import job_time_left, owner_socket, request
from ..job.newjob import NewAllocation, engines_job_template
from .placement import Engines, Placement, container_engine_cmd


#: ipyparallel's engine launcher for each batch system's adapter.
ENGINE_LAUNCHERS = {"slurm": ("slurm", "SlurmEngineSetLauncher"), "gridengine": ("sge", "SGEEngineSetLauncher")}


def _client_here(sched) -> bool:
    from ..batchsystems.scheduler import serves

    return serves(sched, "ranks") and shutil.which(sched.submit_file_argv("job")[0]) is not None


def submitting_scheduler(env=None):
    """The batch system a new job goes to from here (outside an owner): this job's, or the one whose client is
    installed; None if there is none."""
    from ..batchsystems.scheduler import job_scheduler, load_scheduler

    env = os.environ if env is None else env
    found = job_scheduler(env)
    if found is not None:
        return found
    for name in ENGINE_LAUNCHERS:
        try:
            sched = load_scheduler(name)
        except ValueError:
            continue
        if _client_here(sched):
            return sched
    return None


class NewAllocationPlacement(Placement):
    """A controller here; a new batch job whose tasks are the engines, submitted by ipyparallel's engine launcher
    for the batch system with our script (and cancelled by it when the world ends)."""

    kind = "new"

    def start(self, on_controller, get) -> Engines:
        from traitlets.config import Config

        from ..batchsystems.scheduler import OFFER_ENV, owners_scheduler
        from ..job.offer import within_offer

        o = self.options
        submit, python, sock = {}, sys.executable, owner_socket()
        offer = os.environ.get(OFFER_ENV, "")
        sched = submitting_scheduler()
        if sched is None or not _client_here(sched):
            if not sock:
                raise RuntimeError("where='new' submits a batch job, but there is no batch system's client here "
                                   "and no jupyter-hpcdl job whose owner could submit it")
            from ..job.client import CANCEL, SUBMIT

            submit = {"submit_command": SUBMIT, "delete_command": CANCEL}  # the owner submits and cancels
            told = request(sock, "GET", "/allocation")
            python = told["host_python"]  # the job runs on the host
            sched, offer = owners_scheduler(told), told.get("offer") or offer
        if sched.name not in ENGINE_LAUNCHERS:
            raise RuntimeError(f"where='new' has no ipyparallel launcher for {sched.name}")
        engines, launcher = ENGINE_LAUNCHERS[sched.name]
        addr = self.controller_address()
        alloc = within_offer(o.new_allocation or NewAllocation(), o.ranks, o.image, offer, getpass.getuser()).alloc
        try:
            template = engines_job_template(sched, alloc, o.ranks, python, o.mpi)
        except (ValueError, NotImplementedError) as e:
            raise RuntimeError(f"the ranks' job cannot be written for {sched.name}: {e or 'not supported yet'}") from None
        config = Config({launcher: {
            **submit,
            "batch_template": template,
            "batch_file_name": os.path.join(o.session_dir, "engines.job"),  # not the kernel's working directory
            "engine_cmd": o.engine_cmd or container_engine_cmd(o.image, o.mpi, python)}})
        self.cluster = ipp.Cluster(n=o.ranks, controller_ip=addr, engines=engines, config=config, log_level=40,
                                   engine_timeout=o.start_timeout)  # the queue wait counts
        if not re.fullmatch(r"/[\w./-]+", self.cluster.profile_dir):  # it goes into the batch script
            raise RuntimeError(f"the IPython profile directory {self.cluster.profile_dir!r} has characters a "
                               "batch script cannot carry safely: use a profile path of letters, digits, . _ - /")
        self._sched = sched
        try:
            self.cluster.start_controller_sync()
            on_controller()  # before the submission: a kernel that dies in the queue wait leaves no job behind
            self.engines_connection_file(60.0)
            self.cluster.start_engines_sync()
            self.client = self.cluster.connect_client_sync()
        except BaseException as e:
            for key, engine_set in list(self.cluster.engines.items()):
                if not getattr(engine_set, "job_id", None):  # never submitted: nothing to cancel
                    del self.cluster.engines[key]
            if isinstance(e, subprocess.CalledProcessError):
                said = e.output.decode(errors="replace") if isinstance(e.output, bytes) else str(e.output or "")
                raise RuntimeError(f"the batch system refused the ranks' job: {said.strip() or e}") from None
            raise
        return self.engines_by_task(addr, get)

    def stop(self) -> None:
        self.shutdown_engines()  # before the job is cancelled
        super().stop()

    @property
    def job_id(self) -> str | None:
        for launcher in (self.cluster.engines.values() if self.cluster is not None else ()):
            return getattr(launcher, "job_id", None) or None
        return None

    def time_left(self) -> float | None:
        job = self.job_id
        if not job:
            return None
        sched = getattr(self, "_sched", None)
        if sched is not None and shutil.which(sched.resources_argv(job)[0]):
            return job_time_left(job, sched)
        sock = owner_socket()
        return request(sock, "GET", f"/jobs/{job}", timeout=15).get("time_left_s") if sock else None
