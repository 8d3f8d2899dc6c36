"""The site profile: partitions and their limits, accounts, the image catalogue — what the options form offers and
what every request is checked against. Configured the Jupyter way, e.g. in jupyterhub_config.py::

    c.SiteProfile.partitions = {"gpu": {"max_nodes": 2, "max_gpus_per_node": 4, "max_walltime": "08:00:00"}}
    c.SiteProfile.accounts = {"*": ["default"], "alice": ["proj-a", "proj-b"]}
    c.SiteProfile.images = {"base": {"ref": "hpcdl/base:latest", "description": "TensorFlow 2.15 + Horovod 0.28"}}
"""
from __future__ import annotations

from dataclasses import dataclass, field

from traitlets import Dict, Unicode, validate
from traitlets.config import Configurable

from jupyter_hpcdl.jobvalues import NAME as _NAME, format_walltime, parse_walltime  # noqa: F401 (re-exported)


@dataclass(frozen=True)
class Partition:
    name: str
    max_nodes: int = 1
    max_gpus_per_node: int = 1
    max_walltime: int = 60  # minutes
    max_memory_gb: int | None = None
    gpu_types: tuple[str, ...] = ()
    description: str = ""


@dataclass(frozen=True)
class Image:
    name: str
    ref: str
    description: str = ""
    training: bool = True  # False: no TensorFlow/Horovod in it (kernels run on the host's environment; no ranks)


@dataclass(frozen=True)
class Profile:
    """A plain, validated snapshot of the site profile (what the pure functions take)."""

    partitions: dict[str, Partition]
    images: dict[str, Image]
    accounts: dict[str, tuple[str, ...]] = field(default_factory=dict)

    def accounts_for(self, user: str) -> tuple[str, ...]:
        return self.accounts.get(user, self.accounts.get("*", ()))


class SiteProfile(Configurable):
    """What this site offers (see the module's docstring for an example)."""

    partitions = Dict(
        help="Partition name → limits: max_nodes, max_gpus_per_node, max_walltime (HH:MM:SS), max_memory_gb, "
             "gpu_types (list), description.",
    ).tag(config=True)
    accounts = Dict(help="User name (or '*') → accounts they may charge; no entry: no --account.").tag(config=True)
    images = Dict(help="Catalogue name → {ref: udocker image reference, description, training (default true; false: "
                       "no TensorFlow/Horovod in it, which the doctor then does not check)}.").tag(config=True)
    scheduler = Unicode("slurm", help="Batch system adapter (entry point group jupyter_hpcdl.schedulers).").tag(config=True)

    @validate("partitions", "images")
    def _names(self, proposal):
        for name in proposal["value"]:
            if not _NAME.match(str(name)):
                raise ValueError(f"{proposal['trait'].name}: {name!r} is not a valid name")
        return proposal["value"]

    def snapshot(self) -> Profile:
        from jupyter_hpcdl.containers.spec import check_image_ref

        parts = {}
        for name, p in self.partitions.items():
            parts[name] = Partition(
                name=name, max_nodes=int(p.get("max_nodes", 1)), max_gpus_per_node=int(p.get("max_gpus_per_node", 1)),
                max_walltime=parse_walltime(p.get("max_walltime", "01:00:00")),
                max_memory_gb=p.get("max_memory_gb"), gpu_types=tuple(p.get("gpu_types", ())),
                description=str(p.get("description", "")))
        images = {name: Image(name, check_image_ref(i["ref"]), str(i.get("description", "")), i.get("training", True) is not False)
                  for name, i in self.images.items()}
        accounts = {u: tuple(a) for u, a in self.accounts.items()}
        if not parts or not images:
            raise ValueError("the site profile needs at least one partition and one image (c.SiteProfile.partitions/images)")
        return Profile(parts, images, accounts)
