"""The site's container settings, configured the Jupyter way (traitlets), e.g. in ``/etc/jupyter-hpcdl/site.json``::

    {"ContainerSite": {"tools_dir": "/opt/jupyter-hpcdl/udocker-tools", "allowed_mounts": ["~", "/scratch"]}}
"""
from __future__ import annotations

import os

from traitlets import Bool, List, Unicode, validate
from traitlets.config import Configurable
from traitlets.config.loader import JSONFileConfigLoader, PyFileConfigLoader

from .quickstart import DEFAULT_SITE_CONFIG, SITE_CONFIG_ENV  # noqa: F401 (the site's file, named once)
from .spec import DEFAULT_MODES, FAST_PATH_CHOICES, MODE_NOTES, PROOT_MODE, SitePolicy, UdockerInstall
from .udocker import Udocker



class ContainerSite(Configurable):
    """Where udocker and its tools are, and what users may do with containers on this site."""

    udocker = Unicode("udocker", help="The udocker command (a path, or a name found on PATH).").tag(config=True)
    tools_dir = Unicode(
        None, allow_none=True,
        help="Shared directory with udocker's engine tools (bin/, lib/), built by hpcdl-udocker-tools; "
             "None lets udocker use the user's own ~/.udocker/bin.",
    ).tag(config=True)
    udocker_dir = Unicode("~/.udocker", help="Each user's udocker repository (images, containers).").tag(config=True)
    execution_mode = Unicode(PROOT_MODE, help="Execution mode of new containers.").tag(config=True)
    allowed_modes = List(Unicode(), list(DEFAULT_MODES), help="Execution modes that work on this site.").tag(config=True)
    allowed_mounts = List(
        Unicode(), ["~", "/tmp"], help="Host directories under which users may bind-mount paths ('~' is their home)."
    ).tag(config=True)
    system_mounts = List(
        Unicode(), ["/etc/hosts"], help="Host files bound into every container at the same path (site-controlled)."
    ).tag(config=True)
    registry = Unicode(None, allow_none=True, help="The site's image registry URL, e.g. http://127.0.0.1:5000").tag(config=True)
    fast_path = Unicode(
        "auto", help="Containers without ptrace where the node allows unprivileged user namespaces: "
                     + ", ".join(f"'{choice}' ({gives})" for choice, gives in FAST_PATH_CHOICES.items()) + ".",
    ).tag(config=True)
    allow_root = Bool(False, help="Pass --allow-root to udocker (test beds that run as root).").tag(config=True)

    @validate("fast_path")
    def _known_fast_path(self, proposal):
        if proposal["value"] not in FAST_PATH_CHOICES:
            raise ValueError(f"fast_path must be one of {', '.join(FAST_PATH_CHOICES)}")
        return proposal["value"]

    @validate("allowed_modes")
    def _known_modes(self, proposal):
        unknown = [m for m in proposal["value"] if m not in MODE_NOTES]
        if unknown:
            raise ValueError(f"unknown udocker modes {unknown}: choose from {', '.join(MODE_NOTES)}")
        return proposal["value"]

    def install(self) -> UdockerInstall:
        return UdockerInstall(executable=self.udocker, udocker_dir=self.udocker_dir, tools_dir=self.tools_dir,
                              allow_root=self.allow_root or os.geteuid() == 0, default_mode=self.execution_mode)

    def policy(self) -> SitePolicy:
        return SitePolicy(allowed_mount_roots=tuple(self.allowed_mounts), allowed_modes=tuple(self.allowed_modes),
                          system_mounts=tuple(self.system_mounts), fast_path=self.fast_path)

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
