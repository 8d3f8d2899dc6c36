"""The site's container settings as plain values (standard library only), so that the commands that start containers
(``hpcdl-containers run``, once per rank or kernel) read ``site.json`` without importing traitlets' configuration
machinery, which costs most of such a command's start-up. :class:`~.site.ContainerSite` is the same settings as a
traitlets ``Configurable`` (for Python config files and JupyterHub-style configuration); its defaults and checks
are the ones here."""
from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, fields
from typing import Mapping

from .spec import DEFAULT_MODES, FAST_PATH_CHOICES, MODE_NOTES, SitePolicy, UdockerInstall

SITE_CONFIG_ENV = "HPCDL_SITE_CONFIG"
DEFAULT_SITE_CONFIG = "/etc/jupyter-hpcdl/site.json"
SECTION = "ContainerSite"


def check_fast_path(value: str) -> str:
    if value not in FAST_PATH_CHOICES:
        raise ValueError(f"fast_path must be one of {', '.join(FAST_PATH_CHOICES)}")
    return value


def check_modes(modes) -> list[str]:
    unknown = [m for m in modes if m not in MODE_NOTES]
    if unknown:
        raise ValueError(f"unknown udocker modes {unknown}: choose from {', '.join(MODE_NOTES)}")
    return list(modes)


@dataclass(frozen=True)
class SiteSettings:
    """Where udocker and its tools are, and what users may do with containers on this site (the traits of
    :class:`~.site.ContainerSite` carry the same names, defaults and help)."""

    udocker: str = "udocker"
    tools_dir: str | None = None
    udocker_dir: str = "~/.udocker"
    execution_mode: str = "P1"
    allowed_modes: tuple[str, ...] = DEFAULT_MODES
    allowed_mounts: tuple[str, ...] = ("~", "/tmp")
    system_mounts: tuple[str, ...] = ("/etc/hosts",)
    registry: str | None = None
    fast_path: str = "auto"
    allow_root: bool = False

    def install(self) -> UdockerInstall:
        return UdockerInstall(executable=self.udocker, udocker_dir=self.udocker_dir, tools_dir=self.tools_dir,
                              allow_root=self.allow_root or os.geteuid() == 0, default_mode=self.execution_mode)

    def policy(self) -> SitePolicy:
        return SitePolicy(allowed_mount_roots=tuple(self.allowed_mounts), allowed_modes=tuple(self.allowed_modes),
                          system_mounts=tuple(self.system_mounts), fast_path=self.fast_path)

    def client(self, environ: Mapping[str, str] | None = None):
        from .udocker import Udocker

        return Udocker(self.install(), self.policy(), environ)


#: Each setting's kind, for checking a JSON file as traitlets would.
_KINDS = {"udocker": str, "tools_dir": (str, type(None)), "udocker_dir": str, "execution_mode": str,
          "allowed_modes": list, "allowed_mounts": list, "system_mounts": list, "registry": (str, type(None)),
          "fast_path": str, "allow_root": bool}


def settings_from(values: Mapping, where: str) -> SiteSettings:
    """Checked settings from a ``ContainerSite`` section; an unknown name is a warning (as traitlets gives)."""
    known = {f.name for f in fields(SiteSettings)}
    given = {}
    for name, value in values.items():
        if name not in known:
            print(f"{where}: ContainerSite has no setting {name!r} (ignored)", file=sys.stderr)
            continue
        if not isinstance(value, _KINDS[name]) or (
                _KINDS[name] is list and not all(isinstance(item, str) for item in value)):
            raise ValueError(f"{where}: ContainerSite.{name} has the wrong type: {value!r}")
        given[name] = tuple(value) if isinstance(value, list) else value
    if "fast_path" in given:
        check_fast_path(given["fast_path"])
    if "allowed_modes" in given:
        check_modes(given["allowed_modes"])
    return SiteSettings(**given)


def load_settings(path: str | None = None) -> SiteSettings:
    """The site's settings from ``path``, ``$HPCDL_SITE_CONFIG`` or /etc/jupyter-hpcdl/site.json: a JSON file is read
    here; a Python config file through traitlets (:func:`~.site.load_site`); defaults where there is no such file."""
    path = path or os.environ.get(SITE_CONFIG_ENV) or DEFAULT_SITE_CONFIG
    if path.endswith(".py"):
        from .site import load_site

        return load_site(path).settings()
    try:
        with open(path) as f:
            data = json.load(f)
    except FileNotFoundError:
        if path != DEFAULT_SITE_CONFIG:
            raise FileNotFoundError(f"site configuration {path} does not exist") from None
        return SiteSettings()
    except ValueError as e:
        raise ValueError(f"site configuration {path} is not valid JSON: {e}") from None
    if not isinstance(data, dict) or not isinstance(data.get(SECTION, {}), dict):
        raise ValueError(f"site configuration {path}: expected {{\"{SECTION}\": {{...}}}}")
    return settings_from(data.get(SECTION, {}), path)
