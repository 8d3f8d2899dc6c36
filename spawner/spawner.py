"""HpcdlSpawner: a user's JupyterLab as one batch job on GPU nodes, kernels in the user's udocker container.

Its settings, the pieces of a spawn (the site profile as the user sees it, the validated request, the batch script,
the scheduler and the hub's shared queue), the options form and the server's state; the job's life (start, poll,
stop) is lifecycle.py's, what one hub process shares (the sweep, the hardened routes) hub.py's. State (job id, port,
token digest, why the last server ended) survives a hub restart: a running server is polled again, and a pending
spawn's job is adopted instead of submitting another.
"""
from __future__ import annotations

import asyncio
import html
import ipaddress
import os
import pwd
import sys
from dataclasses import replace

from jupyterhub.spawner import Spawner
from tornado import web
from traitlets import Dict, Float, Instance, Integer, List, Unicode, default, validate

from ..commands import run
from .envfile import TLS_BUNDLE_ENV, TLS_FILES, env_file_path, tls_bundle_path, tls_dir
from .form import render_form
from .hub import HubWide, install
from .lifecycle import JobLifecycle
from .orphans import JobMark, check_hub_tag
from .options import JobRequest, OptionsError, request_to_options, validate_options
from .profile import Profile, SiteProfile, offer_json
from .queue import JobQueue
from ..batchsystems.scheduler import ROLES, Scheduler, load_scheduler, require, serves
from .script import ScriptContext, build_batch_script


class HpcdlSpawner(JobLifecycle, Spawner):
    """Spawn JupyterLab in a batch job (Slurm first; other schedulers through adapters)."""

    #: hub.install makes one as the hub starts (when the hub's configuration installs it), for the sweep's settings
    starts_orphan_sweep = True

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
        self.hub_wide: HubWide = install()  # the routes hardened before any job of this server can call back
        self.hub_wide.start_sweep(self)

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
            if missing and self.hub_wide.first_time(f"roles of {self.profile.scheduler}"):
                self.log.warning("jupyter-hpcdl: the %s adapter does not serve %s yet: in its jobs, a training session "
                                 "runs its ranks on the job's first node only, with where='local' (docs/spawner.md, "
                                 "'What each adapter serves')", self.profile.scheduler, " or ".join(missing))
        return self._scheduler

    @property
    def queue(self) -> JobQueue:
        queue = self.hub_wide.queue(self.scheduler, self.queue_interval, self.queue_max_backoff)
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
        await self.user_files().write_private(path, texts, "handing the server its TLS key", self.scheduler_timeout)
        d = tls_dir(self.user_home(), self.name)
        return {key: os.path.join(d, name) for key, name in TLS_FILES.values()}

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

    def commit_state(self) -> None:
        """Commit the state now (not only when start returns), so a restarted hub knows a pending job."""
        if self.orm_spawner is not None:
            self.orm_spawner.state = self.get_state()
            from sqlalchemy import inspect as sa_inspect

            session = sa_inspect(self.orm_spawner).session
            if session is not None:
                session.commit()

    def tell_next_form(self, message: str) -> None:
        """Put ``message`` on this server's next form (why its last job ended), committed at once."""
        self.last_end = message
        self.commit_state()


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
