"""The configuration reference (``docs/configuration.md``), written from the traitlets themselves, so that every
setting is in it::

    python -m jupyter_hpcdl.configref > docs/configuration.md
"""
from __future__ import annotations

import sys
from typing import Iterable

from traitlets import HasTraits, TraitType, Undefined
from traitlets.config import Configurable

#: Each configurable class, with where it is set. A base class's settings are listed once, under the base.
SECTIONS = (
    ("jupyter_hpcdl.spawner.spawner", "HpcdlSpawner", "the hub's `jupyterhub_config.py`"),
    ("jupyter_hpcdl.spawner.profile", "SiteProfile", "the hub's `jupyterhub_config.py`"),
    ("jupyter_hpcdl.containers.site", "ContainerSite", "`/etc/jupyter-hpcdl/site.json` (or `$HPCDL_SITE_CONFIG`)"),
    ("jupyter_hpcdl.batchsystems.scheduler", "Scheduler", "the hub's `jupyterhub_config.py`, for every batch system"),
    ("jupyter_hpcdl.batchsystems.slurm", "Slurm", "the hub's `jupyterhub_config.py`"),
    ("jupyter_hpcdl.batchsystems.gridengine", "GridEngine", "the hub's `jupyterhub_config.py`"),
    ("jupyter_hpcdl.batchsystems.pbs", "Pbs", "the hub's `jupyterhub_config.py`"),
    ("jupyter_hpcdl.batchsystems.lsf", "Lsf", "the hub's `jupyterhub_config.py`"),
)


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def _default(trait: TraitType) -> str:
    text = trait.default_value_repr()
    if text == repr(sys.executable):
        return "the hub's Python (`sys.executable`)"
    if text in ("", "traitlets.Undefined", repr(Undefined)):
        return ""
    return f"`{text}`" if len(text) <= 60 else f"`{text[:57]}...`"


def own_settings(cls: type[HasTraits]) -> list[tuple[str, TraitType]]:
    """The configurable traits ``cls`` itself defines (not those of its bases), by name."""
    return sorted(cls.class_own_traits(config=True).items())


def render(sections: Iterable[tuple[str, str, str]] = SECTIONS) -> str:
    """The reference, as Markdown."""
    import importlib

    out = ["# Configuration reference", "",
           "Every setting of jupyter-hpcdl, written from the code by `python -m jupyter_hpcdl.configref` (a test keeps",
           "this file the same). Set them the Jupyter way, e.g. `c.HpcdlSpawner.exec_prefix = [...]`; a batch system's",
           "settings apply to the adapter `c.SiteProfile.scheduler` names. See `docs/admin.md` for what to set first.", ""]
    for module, name, where in sections:
        cls = getattr(importlib.import_module(module), name)
        assert issubclass(cls, Configurable), name
        out += [f"## {name}", "", f"Set in {where}.", "", "| setting | type | default | what it does |",
                "|---|---|---|---|"]
        for trait_name, trait in own_settings(cls):
            out.append(f"| `c.{name}.{trait_name}` | {type(trait).__name__} | {_cell(_default(trait))} | "
                       f"{_cell(trait.help or '')} |")
        out.append("")
    return "\n".join(out)


def main() -> int:
    sys.stdout.write(render())
    return 0


if __name__ == "__main__":
    sys.exit(main())
