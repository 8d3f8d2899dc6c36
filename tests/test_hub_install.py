"""The hub side is installed into a JupyterHub by one explicit call (``jupyter_hpcdl.spawner.hub.install``), never by
an import: importing the spawner changes none of JupyterHub's classes or routes; once installed, batchspawner's
attribute-setting route is answered by the hardened callback, whether the hub had built its routes (the spawner's
own call) or not yet (a call from ``jupyterhub_config.py``)."""
import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from jupyterhub import apihandlers
from jupyterhub.app import JupyterHub
from tornado import httputil, web
from traitlets.config import Config

from jupyter_hpcdl.batchsystems.slurm import Slurm
from jupyter_hpcdl.commands import Result
from jupyter_hpcdl.spawner.api import CallbackHandler, PreviewHandler
from jupyter_hpcdl.spawner.hub import install
from jupyter_hpcdl.spawner.queue import JobQueue
from jupyter_hpcdl.spawner.spawner import HpcdlSpawner

ROOT = Path(__file__).resolve().parents[1]

IMPORT_CHANGES = """
import json, sys
from jupyterhub import apihandlers
from jupyterhub.app import JupyterHub
try:
    import batchspawner.api  # noqa: F401 -- its route is in the hub's list, as in a hub that loads batchspawner
except ImportError:
    pass
assert not any(m.startswith("jupyter_hpcdl") for m in sys.modules), "imported before the test"
members = dict(vars(JupyterHub))
routes = list(apihandlers.default_handlers)
import jupyter_hpcdl.spawner.spawner, jupyter_hpcdl.spawner.hub, jupyter_hpcdl.spawner.api  # noqa: E401,F401
from jupyter_hpcdl.spawner import HpcdlSpawner  # noqa: F401 -- as the entry point "hpcdl" loads it
now = dict(vars(JupyterHub))
print(json.dumps({
    "members": sorted(k for k in set(members) | set(now) if members.get(k) is not now.get(k)),
    "init_spawners": JupyterHub.init_spawners is members["init_spawners"],
    "routes": len(routes) == len(apihandlers.default_handlers)
              and all(a is b for a, b in zip(routes, apihandlers.default_handlers)),
}))
"""


def test_importing_the_spawner_changes_nothing_in_jupyterhub():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", IMPORT_CHANGES], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.splitlines()[-1]) == {"members": [], "init_spawners": True, "routes": True}


def _hub_routes() -> list:
    """The routes JupyterHub builds from its API handlers (batchspawner's among them where it is loaded)."""
    return JupyterHub.add_url_prefix("/hub/", [*apihandlers.default_handlers,
                                               ("/api/batchspawner", apihandlers.base.API404),
                                               (r"/api/(.*)", apihandlers.base.API404)])


def _handler(web_app: web.Application, method: str, path: str) -> type:
    request = httputil.HTTPServerRequest(start_line=httputil.RequestStartLine(method, path, "HTTP/1.1"),
                                         headers=httputil.HTTPHeaders({"Host": "hub.local"}))
    return web_app.find_handler(request).handler_class


@pytest.fixture
def hub_wide():
    hub = install()
    queues = dict(hub.queues)
    yield hub
    hub.app = hub.hardened = hub.start_hooked = hub.sweeper = None
    hub.queues.clear()
    hub.queues.update(queues)


def test_install_into_a_running_hub_answers_batchspawners_route_with_the_hardened_callback(hub_wide):
    web_app = web.Application(_hub_routes())
    app = SimpleNamespace(tornado_application=web_app, hub_prefix="/hub/", add_url_prefix=JupyterHub.add_url_prefix)
    assert _handler(web_app, "POST", "/hub/api/batchspawner") is not CallbackHandler
    install(app)
    rules = len(web_app.default_router.rules)
    assert install(app) is hub_wide and len(web_app.default_router.rules) == rules  # once
    assert _handler(web_app, "POST", "/hub/api/batchspawner") is CallbackHandler
    assert _handler(web_app, "POST", "/hub/api/hpcdl/callback") is CallbackHandler
    assert _handler(web_app, "GET", "/hub/api/hpcdl/preview") is PreviewHandler
    assert _handler(web_app, "GET", "/hub/api/users") is apihandlers.users.UserListAPIHandler  # the hub's own


@pytest.mark.parametrize("ours", [True, False])
def test_install_from_the_configuration_acts_as_the_hub_starts_its_spawners(hub_wide, ours):
    made, started = [], []

    class SpawnerClass:
        starts_orphan_sweep = ours

        def __init__(self, **kwargs):
            made.append(sorted(kwargs))

    async def init_spawners():
        started.append(_handler(app.tornado_application, "POST", "/hub/api/batchspawner"))
        return 0

    app = SimpleNamespace(hub_prefix="/hub/", add_url_prefix=JupyterHub.add_url_prefix, init_spawners=init_spawners,
                          spawner_class=SpawnerClass, config={}, hub=None, db=None, log=None)
    install(app)
    install(app)  # once
    assert made == started == []  # nothing before the hub starts
    app.tornado_application = web.Application(_hub_routes())  # the hub builds its routes, then starts its spawners
    assert asyncio.run(app.init_spawners()) == 0
    assert started == [CallbackHandler]
    assert made == ([["config", "db", "hub"]] if ours else [])  # the sweep's spawner, HpcdlSpawner's only


def test_the_hubs_start_makes_an_hpcdlspawner_whose_settings_start_the_one_sweep(hub_wide):
    async def down(argv, timeout=60, **kw):  # the sweep finds the scheduler not answering and does nothing
        return Result(tuple(argv), 1, "", "Unable to contact slurm controller")

    hub_wide.queues[("slurm", 5.0)] = JobQueue(Slurm(), 5.0, runner=down)
    config = Config()
    config.HpcdlSpawner.hub_tag = "starthub"
    config.HpcdlSpawner.orphan_interval = 3600.0
    app = SimpleNamespace(hub_prefix="/hub/", add_url_prefix=JupyterHub.add_url_prefix, spawner_class=HpcdlSpawner,
                          config=config, hub=object(), db=object(), log=None)

    async def init_spawners():
        return 0

    app.init_spawners = init_spawners
    install(app)  # from jupyterhub_config.py
    app.tornado_application = web.Application(_hub_routes())

    async def start():
        await app.init_spawners()
        first = hub_wide.sweeper
        HpcdlSpawner(config=config, hub=app.hub, db=app.db)  # a user's spawner later: the same sweep
        return first

    sweeper = asyncio.run(start())
    assert sweeper is not None and hub_wide.sweeper is sweeper
    assert (sweeper.hub, sweeper.interval, sweeper.queue.interval) == ("starthub", 3600.0, 5.0)
    assert _handler(app.tornado_application, "POST", "/hub/api/batchspawner") is CallbackHandler
