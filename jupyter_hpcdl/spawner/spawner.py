"""HpcdlSpawner: a user's JupyterLab as one batch job on GPU nodes, kernels in the user's udocker container.

start: validate the options, submit the script (as the user, no shell), follow the job through the shared queue
(pending reason and expected start, then the node), wait for the job to report its port, return the node's address.
poll: the job's phase from the shared queue (one scheduler query per interval for all servers). While the scheduler
cannot be asked, the phase is UNKNOWN, and a running server is kept for ``unknown_grace`` seconds.
stop: cancel the job and wait until the scheduler says it is gone; while the scheduler is not answering, the job is
left to the orphan sweep (orphans.py), which cancels it as soon as the scheduler answers again.
State (job id, port, token digest, why the last server ended) survives a hub restart: a running server is polled
again, and a start finds a job of a spawn that was pending and adopts it instead of submitting another.
"""
from __future__ import annotations

import asyncio
import html
import ipaddress
import json
import os
import pwd
import sys
from dataclasses import replace
from functools import partial

from jupyterhub.spawner import Spawner
from tornado import web
from jupyterhub.utils import exponential_backoff
from traitlets import Dict, Float, Instance, Integer, List, Unicode, default, validate

from . import api  # noqa: F401 -- installs the hardened callback routes
from .api import token_digest
from ..commands import run
from .commands import as_user, cancel_as_user
from .envfile import TLS_BUNDLE_ENV, TLS_FILES, env_file_path, tls_bundle_path, tls_dir
from .form import render_form
from .orphans import JobMark, OrphanSweeper, check_hub_tag
from .options import JobRequest, OptionsError, request_to_options, validate_options
from .profile import Profile, SiteProfile, offer_json
from .queue import JobQueue, shared_queue
from ..controls import escape_controls
from ..batchsystems.scheduler import (ENDED, PENDING, ROLES, RUNNING, UNKNOWN, JobInfo, Scheduler, load_scheduler,
                                      require, serves)
from .script import ScriptContext, build_batch_script

JOB_ENV = ("PATH", "HOME", "USER", "LANG")


#: The hub's Python run as a user (a module follows): no user site directory (``-s``) and nothing from the working
#: directory (``-P``), so only the hub's installation runs; sudo leaves out the caller's PYTHON* variables.
USER_PYTHON = (sys.executable, "-s", "-P", "-m")


class HpcdlSpawner(Spawner):
    """Spawn JupyterLab in a batch job (Slurm first; other schedulers through adapters)."""

    profile = Instance(SiteProfile)
    python = Unicode(sys.executable, help="Python on the compute nodes that has jupyter_hpcdl (host side).").tag(config=True)
    listen_ip = Unicode("", help="Address the server listens on, on its node. Empty (the default): the node's address "
                        "on the network it reaches the hub by (the source address of its route to the hub's API). "
                        "Never all interfaces unless set so (0.0.0.0).").tag(config=True)
    node_addresses = Dict(help="Node name → address the hub reaches it at; default: the name itself.").tag(config=True)
    exec_prefix = List(Unicode(), ["sudo", "-n", "-u", "{username}"],
                       help="How the hub runs the scheduler's commands as the user (argv, no shell).").tag(config=True)
    queue_interval = Float(5.0, help="Seconds between scheduler queries, shared by all servers.").tag(config=True)
    startup_poll_interval = Float(0.5, help="Seconds between queue readings while a server starts (the few starting "
                                            "servers share them too).").tag(config=True)
    log_tail_lines = Integer(20, help="Lines of the job's log shown when it fails.").tag(config=True)
    log_tail_bytes = Integer(65536, help="Bytes from the end of the job's log read for those lines, at most."
                             ).tag(config=True)
    job_name = Unicode("jupyterhub-hpcdl", help="The name of every server's batch job, as the queue shows it.").tag(
        config=True)
    hub_tag = Unicode("jupyterhub", help="Names this hub in its jobs' comments (letters, digits, '._-'); the orphan "
                      "sweep cancels only jobs with this tag. Give each hub that shares a cluster its own.").tag(config=True)
    unknown_grace = Float(1800.0, help="Seconds a running server is kept while the scheduler cannot be asked (an "
                          "overloaded or restarting controller); after that, poll reports it stopped.").tag(config=True)
    queue_max_backoff = Float(60.0, help="Longest wait between two tries while the scheduler is not answering "
                              "(the wait doubles from queue_interval).").tag(config=True)
    scheduler_timeout = Float(30.0, help="Seconds a scheduler command may take before it counts as not answering."
                              ).tag(config=True)
    cancel_timeout = Float(60.0, help="Seconds stop() tries to cancel the job and see it leave the queue.").tag(config=True)
    route_refresh_interval = Float(10.0, help="While a spawn that was pending at a hub restart is followed, seconds "
                                   "between two updates of the proxy's routes (so the servers kept meanwhile are "
                                   "reachable before every start-up check is done).").tag(config=True)
    orphan_interval = Float(300.0, help="Seconds between two sweeps for this hub's jobs that no server owns (0: no "
                            "sweep).").tag(config=True)

    job_id = Unicode("")
    job_port = Integer(0)
    job_host = Unicode("")
    token_sha = Unicode("")
    last_end = Unicode("")

    @validate("hub_tag")
    def _check_hub_tag(self, proposal):
        return check_hub_tag(proposal["value"])

    @default("profile")
    def _profile(self):
        return SiteProfile(parent=self)

    @default("start_timeout")
    def _start_timeout(self):
        return 3600  # includes the wait in the queue

    @default("http_timeout")
    def _http_timeout(self):
        return 120

    @default("options_form")
    def _options_form(self):
        return HpcdlSpawner.render_options_form

    @default("apply_user_options")
    def _apply_user_options(self):
        # JupyterHub's hook before start: a refused option becomes HTTP 400 with our message (REST and form alike).
        return HpcdlSpawner.check_user_options

    def check_user_options(self, user_options: dict) -> None:
        try:
            self.request(user_options)
        except OptionsError as e:
            orm = getattr(self, "orm_spawner", None)
            if orm is not None and orm.user_options == user_options:
                # JupyterHub saved them as the defaults of the next spawn without options: not refused ones
                orm.user_options = {}
            raise web.HTTPError(400, f"Not started: {e}") from None

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self._events: list[dict] = []
        self._event_added = asyncio.Event()
        self._port_reported = asyncio.Event()
        self._start_done = False
        self._unknown_said = False
        start_sweeper(self)

    @default("ssl_alt_names")
    def _ssl_alt_names(self):
        # internal_ssl: the hub checks the server's name against its certificate; it reaches a server by the node's
        # address (node_addresses) or name, which only the queue knows, so every known one goes in, with the hub's
        # trusted_alt_names (where a site lists its nodes, or a wildcard such as DNS:*.nodes.example.org)
        names = list(self.trusted_alt_names)
        for node, address in self.node_addresses.items():
            for name in (node, address):
                entry = ("IP:" if _is_ip(name) else "DNS:") + name
                if entry not in names:
                    names.append(entry)
        return names

    # -- pieces ----------------------------------------------------------------------------------------------------
    @property
    def scheduler(self) -> Scheduler:
        if getattr(self, "_scheduler", None) is None or self._scheduler.name != self.profile.scheduler:
            self._scheduler = load_scheduler(self.profile.scheduler, parent=self)
            require(self._scheduler, "hub")
            missing = [ROLES[r].what for r in ROLES if not serves(self._scheduler, r)]
            if missing and self.profile.scheduler not in _SAID_ROLES:
                _SAID_ROLES.add(self.profile.scheduler)
                self.log.warning("jupyter-hpcdl: the %s adapter does not serve %s yet: in its jobs, a training session "
                                 "runs its ranks on the job's first node only, with where='local' (docs/spawner.md, "
                                 "'What each adapter serves')", self.profile.scheduler, " or ".join(missing))
        return self._scheduler

    @property
    def queue(self) -> JobQueue:
        queue = shared_queue(self.scheduler, self.queue_interval, self.queue_max_backoff)
        queue.timeout = self.scheduler_timeout
        return queue

    def job_mark(self) -> JobMark:
        return JobMark(self.hub_tag, self.user.name, self.name or "")

    def user_home(self) -> str:
        return pwd.getpwnam(self.user.name).pw_dir

    def log_path(self, job_id: str = "") -> str:
        """The job's log; without ``job_id``, the path with the scheduler's placeholder for it."""
        return os.path.join(self.user_home(), ".jupyter-hpcdl", "jobs",
                            f"{job_id or self.scheduler.job_id_placeholder}.log")

    def user_profile(self) -> Profile:
        """The site profile as this user sees it: narrowed by the limits for them and their JupyterHub groups."""
        try:
            return self.profile.snapshot().for_user(self.user.name, [g.name for g in self.user.groups])
        except ValueError as e:
            raise OptionsError(str(e)) from None

    def request(self, raw: dict | None = None) -> JobRequest:
        return validate_options(self.user_options if raw is None else raw, self.user_profile(), self.user.name)

    def script_context(self) -> ScriptContext:
        singleuser = os.path.join(os.path.dirname(self.python), self.cmd[0]) if not os.path.isabs(self.cmd[0]) else self.cmd[0]
        return ScriptContext(python=self.python, output=self.log_path(), workdir=self.user_home(), listen_ip=self.listen_ip,
                             job_name=self.job_name, singleuser_cmd=(singleuser, *self.cmd[1:], *self.get_args()),
                             comment=self.job_mark().comment(),
                             env_file="" if self.scheduler.private_env else env_file_path(self.user_home(), self.name))

    def batch_script(self, req: JobRequest) -> str:
        offer = offer_json(self.user_profile(), self.user.name, req.partition, req.image, req.account)
        return build_batch_script(req, self.scheduler, replace(self.script_context(), offer=offer))

    def preview(self, raw: dict) -> dict:
        """What the form shows for ``raw`` options: the exact script and GPU-hours (ValueError if not allowed)."""
        req = self.request(raw)
        return {"script": self.batch_script(req), "gpu_hours": round(req.gpu_hours, 2)}

    def get_env(self) -> dict:
        env = super().get_env()
        if self.cert_paths:  # internal_ssl: the job unpacks the server's key and certificates from this file
            env[TLS_BUNDLE_ENV] = tls_bundle_path(self.user_home(), self.name)
        return env

    async def move_certs(self, paths: dict) -> dict:
        """JupyterHub's ``internal_ssl``: hand the server's key, certificate and CA bundle (made by the hub in its
        own ``internal_certs_location``) to the job. They are written as the user, into a file of mode 0600 that
        only the user can read (through the sudo rule's ``envfile`` helper, on its stdin: never on a command line,
        never with the hub's rights in a home); the job unpacks them into ``~/.jupyter-hpcdl/tls/<server>/`` and
        removes that file. Returns the paths the server will find them at."""
        texts = await asyncio.to_thread(_read_texts, {TLS_FILES[var][0]: var for var in TLS_FILES}, paths)
        path = tls_bundle_path(self.user_home(), self.name)
        (await run([*as_user(self.exec_prefix, self.user.name), *USER_PYTHON, "jupyter_hpcdl.spawner.envfile", path],
                   input=json.dumps(texts), timeout=self.scheduler_timeout)).check("handing the server its TLS key")
        d = tls_dir(self.user_home(), self.name)
        return {key: os.path.join(d, name) for key, name in TLS_FILES.values()}

    def _event(self, message: str, progress: int) -> None:
        self.log.info("%s: %s", self._log_name, message)
        self._events.append({"progress": progress, "message": message})
        self._event_added.set()

    # -- form ------------------------------------------------------------------------------------------------------
    async def render_options_form(self) -> str:
        try:
            profile = self.user_profile()
        except OptionsError as e:  # nothing to offer this user: say why instead of a form
            return f'<div class="alert alert-danger">{html.escape(str(e))}</div>'

        result = await run(self.scheduler.availability_argv())
        availability = self.scheduler.parse_availability(result.stdout) if result.returncode == 0 else {}
        defaults = request_to_options(self.request({}))
        return render_form(profile, self.user.name, availability, self.preview({}), defaults,
                           preview_url=self.hub.base_url + "api/hpcdl/preview", server_name=self.name,
                           last_end=self.last_end)

    def run_options_from_form(self, form_data):
        form_data = {k: v for k, v in form_data.items() if k != "_xsrf"}  # the form's own protection, not an option
        return request_to_options(self.request(form_data))

    def options_from_query(self, query_data):
        return request_to_options(self.request(query_data))

    # -- state -----------------------------------------------------------------------------------------------------
    def get_state(self):
        state = super().get_state()
        state.update(job_id=self.job_id, job_port=self.job_port, job_host=self.job_host, token_sha=self.token_sha,
                     last_end=self.last_end)
        return state

    def load_state(self, state):
        super().load_state(state)
        self.job_id = state.get("job_id", "")
        self.job_port = state.get("job_port", 0)
        self.job_host = state.get("job_host", "")
        self.token_sha = state.get("token_sha", "")
        self.last_end = state.get("last_end", "")

    def clear_state(self):
        super().clear_state()
        self.job_id, self.job_port, self.job_host, self.token_sha = "", 0, "", ""

    def _save_state(self) -> None:
        """Commit the state now (not only when start returns), so a restarted hub knows a pending job."""
        if self.orm_spawner is not None:
            self.orm_spawner.state = self.get_state()
            from sqlalchemy import inspect as sa_inspect

            session = sa_inspect(self.orm_spawner).session
            if session is not None:
                session.commit()

    def _forget_job(self, why: str) -> None:
        """The job is over: keep why (shown on the next form), drop the rest, and commit at once."""
        self.last_end = why
        self.job_id, self.job_port, self.token_sha = "", 0, ""
        self._save_state()

    # -- the callback ----------------------------------------------------------------------------------------------
    def accept_port(self, digest: str, port: int) -> bool:
        """Called by the callback handler: record ``port`` if ``digest`` is this server's token and its job runs."""
        if not self.job_id or not self.token_sha or digest != self.token_sha:
            return False
        self.job_port = port
        self._save_state()
        self._port_reported.set()
        return True

    # -- start / poll / stop ---------------------------------------------------------------------------------------
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
            self._save_state()
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
            (await run([*as_user(self.exec_prefix, self.user.name), *USER_PYTHON, "jupyter_hpcdl.spawner.envfile",
                        path], input=json.dumps(secrets))).check("writing the job's private environment")
            names = [n for n in names if n in JOB_ENV]
            prefix = as_user(self.exec_prefix, self.user.name, names)
        result = (await run([*prefix, *self.scheduler.submit_argv(names)], env=env, input=self.batch_script(req))
                  ).check("submitting the job")
        self.job_id = self.scheduler.parse_submit(result.stdout)
        self.token_sha = token_digest(self.api_token)
        self.job_port, self.job_host = 0, ""
        self._save_state()
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
        tail = await self._log_tail(log)
        if info is not None and info.job_id in self.queue.jobs():  # ended, yet held (Grid Engine's Eqw): let it go
            await self._cancel(info.job_id)
        await self._remove_env_file()
        self._forget_job(what)
        return what + (f"\nLast lines of its log ({log}):\n{tail}" if tail else "")

    async def _log_tail(self, path: str) -> str:
        """The end of the job's log, read as the user (``usertail``: a regular file only, bounded in bytes and in
        ``scheduler_timeout``), or why it is not shown; never with the hub's rights, never on the event loop."""
        argv = [*as_user(self.exec_prefix, self.user.name), *USER_PYTHON, "jupyter_hpcdl.spawner.usertail",
                "--lines", str(self.log_tail_lines), "--max-bytes", str(self.log_tail_bytes), "--", path]
        try:
            result = await run(argv, timeout=self.scheduler_timeout)
        except (OSError, RuntimeError) as e:
            self.log.warning("%s: reading the end of %s as %s: %s", self._log_name, path, self.user.name, e)
            return ""
        if result.returncode == 3:  # not shown, with the reason
            return f"(not shown: {escape_controls(result.stderr.strip()[-300:])})\n"
        if result.returncode:
            self.log.warning("%s: %s", self._log_name, escape_controls(result.failure(f"reading the end of {path}")))
            return ""
        return escape_controls(result.stdout[-4 * self.log_tail_bytes:])  # as usertail gives it, whatever ran

    async def get_url(self):
        """After a hub restart, JupyterHub asks a server it thinks is running for its URL. A spawn that was pending
        then (its job queued, or running without a port yet) is followed here to its end: once the job reports its
        port, the hub adopts the server like any running one. If the job ended, the old URL is returned and the hub
        finds it unreachable and cleans up.

        JupyterHub routes the servers it kept only once every start-up check is done, so while this one follows its
        job, the proxy's routes are brought up to date every ``route_refresh_interval`` seconds: the other servers
        are reachable meanwhile."""
        if self.job_id and not self.job_port and not self._start_pending:
            _FOLLOWING.add(self)
            _start_route_refresher(self.route_refresh_interval, self.log)
            try:
                req = self.request(self.user_options or self.orm_spawner.user_options or {})
                self._port_reported.clear()
                self.log.info("%s: following job %s of a spawn that was pending when the hub stopped", self._log_name, self.job_id)
                await asyncio.wait_for(self._follow(req), self.start_timeout)  # a spawn's own limit, queue included
                self._save_state()
            except Exception as e:  # never break the hub's start-up checks (a timeout included)
                self.log.warning("%s: pending job not adopted: %s", self._log_name, e or type(e).__name__)
                return await super().get_url()
            finally:
                _FOLLOWING.discard(self)
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
            self._save_state()
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
        result = await run([*as_user(self.exec_prefix, self.user.name), "rm", "-f", "--", *paths],
                           timeout=self.scheduler_timeout)
        if result.returncode:
            self.log.warning("%s: could not remove %s: %s", self._log_name, " ".join(paths), result.failure("rm"))


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def _read_texts(names: dict[str, str], paths: dict[str, str]) -> dict[str, str]:
    """``{name: text of paths[key]}`` for each ``key → name`` of ``names``: the hub's own files."""
    out = {}
    for key, name in names.items():
        with open(paths[key]) as f:
            out[name] = f.read()
    return out


# -- hub-wide helpers: the routes while pending spawns are followed, the orphan sweep (one per hub process) ---------
_FOLLOWING: set[HpcdlSpawner] = set()  # spawners following, in a start-up check, a job that was pending
_ROUTES: list[asyncio.Task] = []
_SWEEPER: OrphanSweeper | None = None
_SAID_ROLES: set[str] = set()  # adapters whose missing roles the hub's log has told


def _start_route_refresher(interval: float, log) -> None:
    """One task for the hub: while any spawner follows a pending job in JupyterHub's start-up check (which routes the
    servers it kept only once every check is done), bring the proxy's routes up to date every ``interval`` s."""
    if _ROUTES and not _ROUTES[0].done():
        return

    async def refresh() -> None:
        while _FOLLOWING:
            await asyncio.sleep(interval)
            app = _hub_app()
            if app is None or getattr(app, "proxy", None) is None:
                continue
            try:
                await app.proxy.check_routes(app.users, getattr(app, "_service_map", {}))
            except Exception as e:  # the proxy may be restarting: try again next time
                log.warning("jupyter-hpcdl: refreshing the proxy's routes failed: %s", e)

    _ROUTES[:] = [asyncio.ensure_future(refresh())]


def _hub_app():
    """The running JupyterHub, once its database is open (None outside a hub, e.g. in tests)."""
    from jupyterhub.app import JupyterHub

    if not JupyterHub.initialized():
        return None
    app = JupyterHub.instance()
    return app if getattr(app, "db", None) is not None and getattr(app, "hub", None) is not None else None


def _owned_jobs(app) -> set[str]:
    """Every job id a server's saved state names (the database is the record: spawns commit their job at once)."""
    from jupyterhub import orm

    return {str((row.state or {}).get("job_id") or "") for row in app.db.query(orm.Spawner)} - {""}


def _tell_user(app, mark: JobMark, message: str) -> None:
    """Put ``message`` on the user's next form (the named server's, or the default one's if that server is gone)."""
    try:
        user = app.users[mark.user]
    except KeyError:
        return
    spawner = user.spawners[mark.server if mark.server in user.orm_spawners else ""]
    if isinstance(spawner, HpcdlSpawner):
        spawner.last_end = message
        spawner._save_state()


def start_sweeper(spawner: HpcdlSpawner) -> OrphanSweeper | None:
    """Start the hub's orphan sweep, once per hub process, with the settings of the first spawner (a no-op outside
    a running hub, or with ``orphan_interval = 0``)."""
    global _SWEEPER
    if _SWEEPER is not None or spawner.orphan_interval <= 0:
        return _SWEEPER
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return None
    app = _hub_app()
    if app is None:
        return None
    _SWEEPER = OrphanSweeper(spawner.queue, spawner.hub_tag, spawner.job_name, partial(_owned_jobs, app), partial(_tell_user, app),
                             spawner.exec_prefix, spawner.orphan_interval, spawner.log)
    _SWEEPER.start()
    spawner.log.info("jupyter-hpcdl: sweeping for jobs of hub %r without a server every %.0f s", spawner.hub_tag,
                     spawner.orphan_interval)
    return _SWEEPER


def _sweep_from_hub_start() -> None:
    """Start the sweep when the hub checks its spawners at start-up, even with no server running (so no spawner
    made yet). JupyterHub has no start-up hook and imports spawner classes before its event loop runs, so this wraps
    its ``init_spawners`` (once; a hub without HpcdlSpawner is left as it is)."""
    try:
        from jupyterhub.app import JupyterHub
    except ImportError:
        return
    original = JupyterHub.init_spawners
    if getattr(original, "hpcdl_sweep", False):
        return

    async def init_spawners(self):
        if isinstance(self.spawner_class, type) and issubclass(self.spawner_class, HpcdlSpawner):
            try:
                self.spawner_class(config=self.config, hub=self.hub, db=self.db)  # its __init__ starts the sweep
            except Exception:  # the hub must start even if the sweep cannot
                self.log.exception("jupyter-hpcdl: the orphan sweep did not start")
        return await original(self)

    init_spawners.hpcdl_sweep = True
    JupyterHub.init_spawners = init_spawners


_sweep_from_hub_start()
