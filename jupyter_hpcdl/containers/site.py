"""The site's container settings, configured the Jupyter way (traitlets), e.g. in ``/etc/jupyter-hpcdl/site.json``::

    {"ContainerSite": {"tools_dir": "/opt/jupyter-hpcdl/udocker-tools", "allowed_mounts": ["~", "/scratch"]}}
"""
from __future__ import annotations

import os

from traitlets import Bool, List, Unicode, validate
from traitlets.config import Configurable
from traitlets.config.loader import JSONFileConfigLoader, PyFileConfigLoader

from .settings import DEFAULT_SITE_CONFIG, SITE_CONFIG_ENV, SiteSettings, check_fast_path, check_modes
from .spec import SitePolicy, UdockerInstall
from .udocker import Udocker

_D = SiteSettings()  # the defaults, kept in one place (settings.py, which the run path reads without traitlets)


class ContainerSite(Configurable):
    """Where udocker and its tools are, and what users may do with containers on this site."""

    udocker = Unicode(_D.udocker, help="The udocker command (a path, or a name found on PATH).").tag(config=True)
    tools_dir = Unicode(
        _D.tools_dir, allow_none=True,
        help="Shared directory with udocker's engine tools (bin/, lib/), built by hpcdl-udocker-tools; "
             "None lets udocker use the user's own ~/.udocker/bin.",
    ).tag(config=True)
    udocker_dir = Unicode(_D.udocker_dir, help="Each user's udocker repository (images, containers).").tag(config=True)
    execution_mode = Unicode(_D.execution_mode, help="Execution mode of new containers.").tag(config=True)
    allowed_modes = List(Unicode(), list(_D.allowed_modes), help="Execution modes that work on this site.").tag(config=True)
    allowed_mounts = List(
        Unicode(), list(_D.allowed_mounts), help="Host directories under which users may bind-mount paths ('~' is their home)."
    ).tag(config=True)
    system_mounts = List(
        Unicode(), list(_D.system_mounts), help="Host files bound into every container at the same path (site-controlled)."
    ).tag(config=True)
    registry = Unicode(_D.registry, allow_none=True, help="The site's image registry URL, e.g. http://127.0.0.1:5000").tag(config=True)
    fast_path = Unicode(
        _D.fast_path, help="Containers without ptrace where the node allows unprivileged user namespaces: 'auto' (probe "
                     "each node once, P1 where it fails), 'userns' (always: an error where it can't run), 'off' (P1).",
    ).tag(config=True)
    allow_root = Bool(_D.allow_root, help="Pass --allow-root to udocker (test beds that run as root).").tag(config=True)

    @validate("fast_path")
    def _known_fast_path(self, proposal):
        return check_fast_path(proposal["value"])

    @validate("allowed_modes")
    def _known_modes(self, proposal):
        return check_modes(proposal["value"])

    def settings(self) -> SiteSettings:
        """The same settings as plain values."""
        return SiteSettings(udocker=self.udocker, tools_dir=self.tools_dir, udocker_dir=self.udocker_dir,
                            execution_mode=self.execution_mode, allowed_modes=tuple(self.allowed_modes),
                            allowed_mounts=tuple(self.allowed_mounts), system_mounts=tuple(self.system_mounts),
                            registry=self.registry, fast_path=self.fast_path, allow_root=self.allow_root)

    def install(self) -> UdockerInstall:
        return self.settings().install()

    def policy(self) -> SitePolicy:
        return self.settings().policy()

    def client(self, environ=None) -> Udocker:
        return Udocker(self.install(), self.policy(), environ)


def load_site(path: str | None = None) -> ContainerSite:
    """The site's settings from ``path``, ``$HPCDL_SITE_CONFIG`` or /etc/jupyter-hpcdl/site.json (JSON or Python);
    defaults where there is no such file."""
    path = path or os.environ.get(SITE_CONFIG_ENV) or DEFAULT_SITE_CONFIG
    if not os.path.exists(path):
        if path != DEFAULT_SITE_CONFIG:
            raise FileNotFoundError(f"site configuration {path} does not exist")
        return ContainerSite()
    loader_cls = PyFileConfigLoader if path.endswith(".py") else JSONFileConfigLoader
    loader = loader_cls(os.path.basename(path), os.path.dirname(os.path.abspath(path)))
    return ContainerSite(config=loader.load_config())
