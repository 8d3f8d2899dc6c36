"""The life of a server's batch job, for HpcdlSpawner (mixed into it; it uses its settings and pieces: ``request``,
``queue``, ``scheduler``, ``batch_script``, ``log_path``, ``user_home``, ``commit_state``, ``hub_wide``).

start: validate the options, submit the script (as the user, no shell), follow the job through the shared queue
(pending reason and expected start, then the node), wait for the job to report its port, return the node's address.
poll: the job's phase from the shared queue (one scheduler query per interval for all servers). While the scheduler
cannot be asked, the phase is UNKNOWN, and a running server is kept for ``unknown_grace`` seconds.
stop: cancel the job and wait until the scheduler says it is gone; while the scheduler is not answering, the job is
left to the orphan sweep (orphans.py), which cancels it as soon as the scheduler answers again.
A start finds a job of a spawn that was pending (the state survives a hub restart) and adopts it instead of
submitting another; ``get_url`` follows such a job in the hub's start-up check.
"""
from __future__ import annotations

import asyncio
import os
from functools import partial

from jupyterhub.utils import exponential_backoff
from tornado import web

from .api import token_digest
from ..commands import run
from .commands import as_user, cancel_as_user
from .envfile import TLS_BUNDLE_ENV, TLS_FILES, env_file_path, tls_bundle_path, tls_dir
from .options import JobRequest, OptionsError, request_to_options
from .userfiles import UserFiles
from ..batchsystems.scheduler import ENDED, PENDING, RUNNING, UNKNOWN, JobInfo

JOB_ENV = ("PATH", "HOME", "USER", "LANG")


class JobLifecycle:
    """start / poll / stop of the server's job, its progress events and the port its job reports."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self._events: list[dict] = []
        self._event_added = asyncio.Event()
        self._port_reported = asyncio.Event()
        self._start_done = False
        self._unknown_said = False

    def user_files(self) -> UserFiles:
        return UserFiles(self.exec_prefix, self.user.name, self.scheduler_timeout)

    def _event(self, message: str, progress: int) -> None:
        self.log.info("%s: %s", self._log_name, message)
        self._events.append({"progress": progress, "message": message})
        self._event_added.set()

    def _forget_job(self, why: str) -> None:
        """The job is over: keep why (shown on the next form), drop the rest, and commit at once."""
        self.last_end = why
        self.job_id, self.job_port, self.token_sha = "", 0, ""
        self.commit_state()

    def accept_port(self, digest: str, port: int) -> bool:
        """Called by the callback handler: record ``port`` if ``digest`` is this server's token and its job runs."""
        if not self.job_id or not self.token_sha or digest != self.token_sha:
            return False
        self.job_port = port
        self.commit_state()
        self._port_reported.set()
        return True

    async def start(self):
        self._events, self._start_done = [], False
        self._port_reported.clear()
        try:
            req = self.request()
        except OptionsError as e:
            raise web.HTTPError(400, f"Not started: {e}") from None
        # the server's model (the admin page, the instructor's page, the REST API) shows what was asked for, defaults
        # filled in; a restart's request is the same
        self.user_options = request_to_options(req)
        if getattr(self, "orm_spawner", None) is not None:
            self.orm_spawner.user_options = self.user_options
        try:
            if self.job_id and (info := await self.queue.job(self.job_id, max_age=0)) and info.phase != ENDED:
                self._event(f"Found job {self.job_id} of an earlier spawn ({info.state}): following it", 10)
                if info.phase == RUNNING and self.job_port:
                    self._port_reported.set()
                    await self._remove_env_file(server_ended=False)  # this spawn's: the running job has its own
            else:
                await self._submit(req)
            host = await self._wait_running(req)
            await self._wait_port(req, host)
            self.job_host = host
            self.commit_state()
            ip = self.node_addresses.get(host, host)
            self._event(f"JupyterLab starting on {host} ({ip}:{self.job_port}); kernels run in {req.image_ref}", 90)
            return (ip, self.job_port)
        finally:
            self._start_done = True
            self._event_added.set()

    async def _submit(self, req: JobRequest) -> None:
        env = self.get_env()
        home = self.user_home()
        env.update(PATH=f"{os.path.dirname(self.python)}:/usr/local/bin:/usr/bin:/bin", HOME=home, USER=self.user.name,
                   LANG="C.UTF-8")
        names = sorted({*JOB_ENV, *(k for k in env if k.startswith(("JUPYTERHUB_", "JPY_")) or k == TLS_BUNDLE_ENV)})
        prefix = as_user(self.exec_prefix, self.user.name, names)
        (await run([*prefix, "mkdir", "-p", os.path.dirname(self.log_path())], env=env)).check("creating the log directory")
        if not self.scheduler.private_env:  # every user could read the job's environment: its secrets go in a file
            secrets = {k: env[k] for k in names if k not in JOB_ENV}
            path = env_file_path(home, self.name)
            await self.user_files().write_private(path, secrets, "writing the job's private environment")
            names = [n for n in names if n in JOB_ENV]
            prefix = as_user(self.exec_prefix, self.user.name, names)
        result = (await run([*prefix, *self.scheduler.submit_argv(names)], env=env, input=self.batch_script(req))
                  ).check("submitting the job")
        self.job_id = self.scheduler.parse_submit(result.stdout)
        self.token_sha = token_digest(self.api_token)
        self.job_port, self.job_host = 0, ""
        self.commit_state()
        self._event(f"Submitted job {self.job_id} to partition {req.partition}: {req.nodes} node(s) × "
                    f"{req.gpus_per_node} GPU(s) for {req.walltime}", 10)

    async def _wait_running(self, req: JobRequest) -> str:
        said = None
        while True:
            info = await self.queue.job(self.job_id, max_age=self.startup_poll_interval)
            if info is None or info.phase == ENDED:
                raise RuntimeError(await self._ended_message(info))
            if info.phase == UNKNOWN:
                now = ("unknown",)
                if now != said:
                    self._event(f"The scheduler is not answering ({self.queue.error}); job {self.job_id} is kept and "
                                "asked about again with backoff", 20)
                    said = now
                await asyncio.sleep(self.startup_poll_interval)
                continue
            if info.phase == RUNNING and info.batch_host:
                self._event(f"Job {self.job_id} is running on {info.batch_host}; preparing the container {req.image_ref}", 50)
                return info.batch_host
            now = (info.state, info.reason, info.expected_start)
            if now != said:
                start = f"; expected start {info.expected_start}" if info.expected_start else ""
                self._event(f"Job {self.job_id} is queued ({info.state.lower()}, reason: {info.reason or 'none given'}{start})", 20)
                said = now
            await asyncio.sleep(self.startup_poll_interval)

    async def _wait_port(self, req: JobRequest, host: str) -> None:
        while not self._port_reported.is_set():
            try:
                await asyncio.wait_for(self._port_reported.wait(), timeout=self.queue_interval)
            except asyncio.TimeoutError:
                info = await self.queue.job(self.job_id)
                if info is None or info.phase == ENDED:
                    raise RuntimeError(await self._ended_message(info))
        self._event(f"Container ready on {host}; the server reported port {self.job_port}", 75)

    async def _ended_message(self, info: JobInfo | None) -> str:
        what = (f"job {self.job_id} ended: {info.state}" + (f" ({info.reason})" if info.reason else "")
                + (f", exit code {info.exit_code}" if info.exit_code else "")) if info else \
            f"job {self.job_id} is no longer known to the scheduler"
        log = self.log_path(self.job_id)
        tail = await self.log_tail(log)
        if info is not None and info.job_id in self.queue.jobs():  # ended, yet held (Grid Engine's Eqw): let it go
            await self._cancel(info.job_id)
        await self._remove_env_file()
        self._forget_job(what)
        return what + (f"\nLast lines of its log ({log}):\n{tail}" if tail else "")

    async def log_tail(self, path: str) -> str:
        """The end of the job's log at ``path``, read as the user (``log_tail_lines``, ``log_tail_bytes``), or why it
        is not shown."""
        return await self.user_files().log_tail(path, self.log_tail_lines, self.log_tail_bytes, self.log,
                                                self._log_name)

    async def get_url(self):
        """After a hub restart, JupyterHub asks a server it thinks is running for its URL. A spawn that was pending
        then (its job queued, or running without a port yet) is followed here to its end: once the job reports its
        port, the hub adopts the server like any running one. If the job ended, the old URL is returned and the hub
        finds it unreachable and cleans up.

        JupyterHub routes the servers it kept only once every start-up check is done, so while this one follows its
        job, the proxy's routes are brought up to date every ``route_refresh_interval`` seconds: the other servers
        are reachable meanwhile."""
        if self.job_id and not self.job_port and not self._start_pending:
            with self.hub_wide.following_pending(self):
                try:
                    req = self.request(self.user_options or self.orm_spawner.user_options or {})
                    self._port_reported.clear()
                    self.log.info("%s: following job %s of a spawn that was pending when the hub stopped",
                                  self._log_name, self.job_id)
                    await asyncio.wait_for(self._follow(req), self.start_timeout)  # a spawn's own limit, queue included
                    self.commit_state()
                except Exception as e:  # never break the hub's start-up checks (a timeout included)
                    self.log.warning("%s: pending job not adopted: %s", self._log_name, e or type(e).__name__)
                    return await super().get_url()
        if self.job_id and self.job_port and self.job_host and self.server is not None:
            ip = self.node_addresses.get(self.job_host, self.job_host)
            return f"http://{ip}:{self.job_port}{self.server.base_url}"
        return await super().get_url()

    async def _follow(self, req: JobRequest) -> None:
        self.job_host = await self._wait_running(req)
        await self._wait_port(req, self.job_host)

    async def progress(self):
        seen = 0
        while True:
            while seen < len(self._events):
                yield self._events[seen]
                seen += 1
            if self._start_done:
                return
            self._event_added.clear()
            try:
                await asyncio.wait_for(self._event_added.wait(), timeout=1)
            except asyncio.TimeoutError:
                pass

    async def poll(self):
        if not self.job_id:
            return 0
        info = await self.queue.job(self.job_id)
        if info is not None and info.phase in (PENDING, RUNNING):
            if self._unknown_said:
                self.log.info("%s: the scheduler answers again; job %s is %s", self._log_name, self.job_id, info.state)
                self._unknown_said = False
            return None
        if info is not None and info.phase == UNKNOWN:
            waited = self.queue.unreachable_for()
            if waited < self.unknown_grace:
                if not self._unknown_said:
                    self.log.warning("%s: job %s: %s; the server is kept (up to %.0f s)", self._log_name, self.job_id,
                                     info.reason, self.unknown_grace)
                    self._unknown_said = True
                return None
            self.last_end = (f"job {self.job_id}: the scheduler did not answer for {waited:.0f} s (more than the "
                             f"site's {self.unknown_grace:.0f} s), so the hub stopped following the server")
            self.commit_state()
            self.log.warning("%s: %s", self._log_name, self.last_end)
            return 1
        message = await self._ended_message(info)
        self.log.warning("%s: %s", self._log_name, message)
        return 1

    async def _cancel(self, job_id: str) -> bool:
        """One try at cancelling ``job_id``: True once the scheduler took the cancellation (or forgot the job)."""
        failed = await cancel_as_user(self.exec_prefix, self.user.name, self.scheduler.cancel_argv(job_id),
                                      self.scheduler.job_forgotten, self.scheduler_timeout)
        if failed:
            self.log.warning("%s: %s", self._log_name, failed)
        return failed is None

    async def _gone(self, job_id: str) -> bool:
        info = await self.queue.job(job_id, max_age=0, force=True)  # the scheduler just took the cancellation
        return info is None or info.phase == ENDED

    async def stop(self, now=False):
        """Cancel the job and wait until it has left the queue, retrying with backoff within ``stop_timeout``
        (``cancel_timeout``). A scheduler that does not answer meanwhile does not keep the hub
        from stopping the server: the job is left to the orphan sweep, which cancels it once the scheduler
        answers, and the next form says so."""
        if not self.job_id:
            return
        job_id = self.job_id
        timeout = max(self.cancel_timeout, 2)
        try:
            await exponential_backoff(partial(self._cancel, job_id), f"cancelling job {job_id}", start_wait=0.5,
                                      max_wait=5, timeout=timeout / 2)
            await exponential_backoff(partial(self._gone, job_id), f"job {job_id} leaving the queue", start_wait=0.5,
                                      max_wait=2, timeout=timeout / 2)
        except (TimeoutError, asyncio.TimeoutError):  # the same from Python 3.11 on
            reason = self.queue.error or "the scheduler did not confirm it"
            why = (f"job {job_id} could not be cancelled when the server was stopped ({reason}); the hub cancels it "
                   "as soon as the scheduler answers")
            self.log.warning("%s: %s", self._log_name, why)
            self._forget_job(why)
            return
        await self._remove_env_file()
        self._forget_job(f"job {job_id} cancelled when the server was stopped")

    async def _remove_env_file(self, server_ended: bool = True) -> None:
        """A job cancelled before it started never read its secrets' files: remove them (as the user); and once
        the server has ended, its TLS key (a job that is killed cannot remove it)."""
        home = self.user_home()
        paths = [] if self.scheduler.private_env else [env_file_path(home, self.name)]
        if self.internal_ssl:
            paths.append(tls_bundle_path(home, self.name))
            if server_ended:
                paths += [os.path.join(tls_dir(home, self.name), name) for _, name in TLS_FILES.values()]
        if not paths:
            return
        failed = await self.user_files().remove(paths)
        if failed:
            self.log.warning("%s: could not remove %s: %s", self._log_name, " ".join(paths), failed)
