"""What one hub process shares between its HpcdlSpawners, installed into the hub by one explicit call: ``install``.

- The hardened API routes (api.py), in front of the hub's own: batchspawner's attribute-setting callback route is
  never reached; the hardened callback answers it.
- The queue of each scheduler (queue.py): one query per interval serves every server.
- The orphan sweep (orphans.py), one per hub process, with the settings of the first HpcdlSpawner made.
- The proxy's routes, refreshed while spawns that were pending at a hub restart are followed (``get_url``).

HpcdlSpawner calls ``install()`` as it is made, before it has a token: so the routes are hardened before any job of
it could call back; its settings start the sweep if none runs yet. A ``jupyterhub_config.py`` may call ``install()``
as well: then, as the hub starts its spawners (before it listens), the routes are hardened and the sweep starts even
with no server running; without it, the sweep starts with the hub's first server. Importing this package changes
nothing in JupyterHub.
"""
from __future__ import annotations

import asyncio
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any, Iterator

from .api import hardened_routes
from .orphans import JobMark, OrphanSweeper
from .queue import JobQueue
from ..batchsystems.scheduler import Scheduler

if TYPE_CHECKING:
    from jupyterhub.app import JupyterHub
    from .spawner import HpcdlSpawner


@dataclass(eq=False)
class HubWide:
    """The hub process's shared pieces (one per process: :func:`install` gives it)."""

    app: JupyterHub | None = None
    queues: dict[tuple[str, float], JobQueue] = field(default_factory=dict)
    sweeper: OrphanSweeper | None = None
    following: set[HpcdlSpawner] = field(default_factory=set)  # following, in a start-up check, a pending job
    refresher: asyncio.Task | None = None
    said: set[str] = field(default_factory=set)  # what the hub's log has told once
    hardened: Any = None  # the tornado application the routes are hardened in
    start_hooked: Any = None  # the JupyterHub whose start makes the sweep's spawner

    def queue(self, scheduler: Scheduler, interval: float, max_backoff: float) -> JobQueue:
        """The hub-wide queue for this scheduler and interval."""
        key = (scheduler.name, interval)
        if key not in self.queues:
            self.queues[key] = JobQueue(scheduler, interval, max_backoff=max_backoff)
        return self.queues[key]

    def first_time(self, what: str) -> bool:
        """True the first time ``what`` is asked about in this hub process (for what its log tells once)."""
        if what in self.said:
            return False
        self.said.add(what)
        return True

    @contextmanager
    def following_pending(self, spawner: HpcdlSpawner) -> Iterator[None]:
        """While ``spawner`` follows a pending job in JupyterHub's start-up check (which routes the servers it kept
        only once every check is done), one task for the hub brings the proxy's routes up to date every
        ``route_refresh_interval`` s."""
        self.following.add(spawner)
        if self.refresher is None or self.refresher.done():
            self.refresher = asyncio.ensure_future(self._refresh_routes(spawner.route_refresh_interval, spawner.log))
        try:
            yield
        finally:
            self.following.discard(spawner)

    async def _refresh_routes(self, interval: float, log) -> None:
        while self.following:
            await asyncio.sleep(interval)
            app = self._ready_app()
            if app is None or getattr(app, "proxy", None) is None:
                continue
            try:
                await app.proxy.check_routes(app.users, getattr(app, "_service_map", {}))
            except Exception as e:  # the proxy may be restarting: try again next time
                log.warning("jupyter-hpcdl: refreshing the proxy's routes failed: %s", e)

    def _ready_app(self) -> JupyterHub | None:
        """The hub, once its database is open (None outside a hub, e.g. in tests)."""
        app = self.app
        return app if getattr(app, "db", None) is not None and getattr(app, "hub", None) is not None else None

    def harden(self, app: JupyterHub) -> None:
        """Put the hardened routes in front of every route of the hub's (built) application: tornado's
        ``add_handlers`` rules are matched before the application's own, so batchspawner's route, wherever it
        stands in the hub's list, is never reached."""
        web_app = app.tornado_application
        if self.hardened is web_app:
            return
        web_app.add_handlers(".*$", app.add_url_prefix(app.hub_prefix, hardened_routes()))
        self.hardened = web_app

    def hook_start(self, app: JupyterHub) -> None:
        """For a hub that has not built its application yet (``install`` from its configuration): as it starts its
        spawners (after building its routes, before it listens), harden the routes and make one spawner, whose
        settings start the sweep, even with no server running. JupyterHub has no start-up hook: this wraps the
        given hub's ``init_spawners`` (that instance's only, once); a hub whose spawner is not HpcdlSpawner gets
        the routes only."""
        if self.start_hooked is app:
            return
        original = app.init_spawners

        async def init_spawners():
            self.harden(app)
            spawner_class = app.spawner_class
            if getattr(spawner_class, "starts_orphan_sweep", False):
                try:
                    spawner_class(config=app.config, hub=app.hub, db=app.db)  # its __init__ starts the sweep
                except Exception:  # the hub must start even if the sweep cannot
                    app.log.exception("jupyter-hpcdl: the orphan sweep did not start")
            return await original()

        app.init_spawners = init_spawners
        self.start_hooked = app

    def start_sweep(self, spawner: HpcdlSpawner) -> OrphanSweeper | None:
        """Start the hub's orphan sweep, once per hub process, with the settings of the first spawner (a no-op
        outside a running hub, or with ``orphan_interval = 0``)."""
        if self.sweeper is not None or spawner.orphan_interval <= 0:
            return self.sweeper
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return None
        app = self._ready_app()
        if app is None:
            return None
        self.sweeper = OrphanSweeper(spawner.queue, spawner.hub_tag, spawner.job_name, partial(_owned_jobs, app),
                                     partial(_tell_user, app), spawner.exec_prefix, spawner.orphan_interval,
                                     spawner.log)
        self.sweeper.start()
        spawner.log.info("jupyter-hpcdl: sweeping for jobs of hub %r without a server every %.0f s", spawner.hub_tag,
                         spawner.orphan_interval)
        return self.sweeper


_HUB = HubWide()


def running_hub() -> JupyterHub | None:
    """The JupyterHub of this process, if one was made (None outside a hub, e.g. in tests)."""
    from jupyterhub.app import JupyterHub

    return JupyterHub.instance() if JupyterHub.initialized() else None


def install(app: JupyterHub | None = None) -> HubWide:
    """Install jupyter-hpcdl's hub-wide pieces into ``app`` (default: this process's hub, if any) and give them;
    idempotent. A hub that has built its routes gets the hardened ones now; one that has not (a call from
    ``jupyterhub_config.py``) gets them as it starts its spawners, before it listens (see the module's docstring)."""
    app = running_hub() if app is None else app
    if app is not None:
        _HUB.app = app
        if getattr(app, "tornado_application", None) is not None:
            _HUB.harden(app)
        else:
            _HUB.hook_start(app)
    return _HUB


def _owned_jobs(app: JupyterHub) -> set[str]:
    """Every job id a server's saved state names (the database is the record: spawns commit their job at once)."""
    from jupyterhub import orm

    return {str((row.state or {}).get("job_id") or "") for row in app.db.query(orm.Spawner)} - {""}


def _tell_user(app: JupyterHub, mark: JobMark, message: str) -> None:
    """Put ``message`` on the user's next form (the named server's, or the default one's if that server is gone)."""
    try:
        user = app.users[mark.user]
    except KeyError:
        return
    spawner = user.spawners[mark.server if mark.server in user.orm_spawners else ""]
    tell = getattr(spawner, "tell_next_form", None)  # an HpcdlSpawner's
    if tell is not None:
        tell(message)
