"""The site profile: partitions and their limits, accounts, the image catalogue — what the options form offers and
what every request is checked against. Configured the Jupyter way, e.g. in jupyterhub_config.py::

    c.SiteProfile.partitions = {"gpu": {"max_nodes": 2, "max_gpus_per_node": 4, "max_walltime": "08:00:00"}}
    c.SiteProfile.accounts = {"*": ["default"], "alice": ["proj-a", "proj-b"]}
    c.SiteProfile.images = {"base": {"ref": "hpcdl/base:latest", "description": "TensorFlow 2.15 + Horovod 0.28"}}
    c.SiteProfile.limits = {"group:workshop": {"partitions": ["cpu"], "max_walltime": "02:00:00",
                                               "reservation": "workshop"}}
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from typing import Iterable

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
    reservation: str = ""  # the scheduler's reservation every job here runs in (set by a user's or group's limits)


@dataclass(frozen=True)
class Limits:
    """What one user, or the members of one JupyterHub group, may ask for: a narrowing of the site's offer (a
    workshop's partition, its GPUs and walltime, its reservation). Empty tuples and None leave that part as it is."""

    partitions: tuple[str, ...] = ()
    images: tuple[str, ...] = ()
    max_nodes: int | None = None
    max_gpus_per_node: int | None = None
    max_walltime: int | None = None  # minutes
    reservation: str = ""

    def narrow(self, partition: Partition) -> Partition:
        def least(mine: int, cap: int | None) -> int:
            return mine if cap is None else min(mine, cap)

        return replace(partition, max_nodes=least(partition.max_nodes, self.max_nodes),
                       max_gpus_per_node=least(partition.max_gpus_per_node, self.max_gpus_per_node),
                       max_walltime=least(partition.max_walltime, self.max_walltime),
                       reservation=partition.reservation or self.reservation)


@dataclass(frozen=True)
class Image:
    name: str
    ref: str
    description: str = ""
    training: bool = True  # False: no TensorFlow/Horovod in it (kernels run on the host's environment; no ranks)
    #: The training backends whose stack the image holds, for the doctor to check (empty: the site's default one).
    backends: tuple[str, ...] = ()


@dataclass(frozen=True)
class Profile:
    """A plain, validated snapshot of the site profile (what the pure functions take)."""

    partitions: dict[str, Partition]
    images: dict[str, Image]
    accounts: dict[str, tuple[str, ...]] = field(default_factory=dict)
    limits: dict[str, Limits] = field(default_factory=dict)  # a user name, or "group:NAME"

    def accounts_for(self, user: str) -> tuple[str, ...]:
        return self.accounts.get(user, self.accounts.get("*", ()))

    def for_user(self, user: str, groups: Iterable[str] = ()) -> "Profile":
        """What ``user`` (a member of the JupyterHub ``groups``) is offered: the site's partitions and images
        narrowed by every limit that names the user or one of the groups (the narrowest of each; the user's own
        reservation first, then the groups' in name order). ValueError if nothing is left to offer."""
        rules = [self.limits[key] for key in (user, *(f"group:{g}" for g in sorted(set(groups))))
                 if key in self.limits]
        if not rules:
            return self
        partitions, images = dict(self.partitions), dict(self.images)
        for rule in rules:
            partitions = {n: rule.narrow(p) for n, p in partitions.items() if not rule.partitions or n in rule.partitions}
            images = {n: i for n, i in images.items() if not rule.images or n in rule.images}
        who = f"{user} (groups: {', '.join(sorted(groups)) or 'none'})"
        if not partitions:
            raise ValueError(f"the site's limits for {who} leave no partition to offer: ask the site's admins")
        if not images:
            raise ValueError(f"the site's limits for {who} leave no image to offer: ask the site's admins")
        return replace(self, partitions=partitions, images=images)


def offer_json(profile: Profile, user: str, partition: str, image: str, account: str | None) -> str:
    """What ``user`` may ask for (``profile`` already narrowed for them), as JSON for their job: the jobs a kernel
    submits from there are checked against it as the form checks a spawn. The job's own partition, image and
    account come first, so that they are the defaults there."""
    def first(names, chosen):
        return sorted(names, key=lambda n: n != chosen)

    accounts = first(profile.accounts_for(user), account)
    return json.dumps({"partitions": [asdict(profile.partitions[n]) for n in first(profile.partitions, partition)],
                       # an image's backends are the doctor's concern: the offer stays as older jobs read it
                       "images": [{k: v for k, v in asdict(profile.images[n]).items() if k != "backends"}
                                  for n in first(profile.images, image)],
                       "accounts": accounts}, separators=(",", ":"))


def offer_profile(text: str) -> Profile:
    """The :class:`Profile` that :func:`offer_json` wrote (ValueError if it is not that)."""
    try:
        data = json.loads(text)
        partitions = {p["name"]: Partition(**{**p, "gpu_types": tuple(p.get("gpu_types", ()))})
                      for p in data["partitions"]}
        images = {i["name"]: Image(**i) for i in data["images"]}
        return Profile(partitions, images, {"*": tuple(data.get("accounts", ()))})
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"the job's offer is not what the hub writes ({e})") from None


class SiteProfile(Configurable):
    """What this site offers (see the module's docstring for an example)."""

    partitions = Dict(
        help="Partition name → limits: max_nodes, max_gpus_per_node, max_walltime (HH:MM:SS), max_memory_gb, "
             "gpu_types (list), description.",
    ).tag(config=True)
    accounts = Dict(help="User name (or '*') → accounts they may charge; no entry: no --account.").tag(config=True)
    images = Dict(help="Catalogue name → {ref: udocker image reference, description, training (default true; false: "
                       "no TensorFlow/Horovod in it, which the doctor then does not check), backends (the training "
                       "backends whose stack it holds, e.g. [\"horovod\", \"torch\"], which the doctor checks; "
                       "default: the site's)}.").tag(config=True)
    limits = Dict(
        help="A user name, or 'group:NAME' for the members of a JupyterHub group → what they may ask for: "
             "partitions (list), images (list of catalogue names), max_nodes, max_gpus_per_node, max_walltime "
             "(HH:MM:SS), reservation (every job of theirs runs in it). A user named by several gets the narrowest.",
    ).tag(config=True)
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
        images = {name: Image(name, check_image_ref(i["ref"]), str(i.get("description", "")),
                              i.get("training", True) is not False, _backend_names(name, i.get("backends", ())))
                  for name, i in self.images.items()}
        accounts = {u: tuple(a) for u, a in self.accounts.items()}
        if not parts or not images:
            raise ValueError("the site profile needs at least one partition and one image (c.SiteProfile.partitions/images)")
        return Profile(parts, images, accounts, {key: _limits(key, rule, parts, images)
                                                 for key, rule in self.limits.items()})


def _backend_names(image: str, names) -> tuple[str, ...]:
    """An image's ``backends``: a list of plain names (the doctor loads them; an unknown one it reports)."""
    if names is None or isinstance(names, (str, bytes)) or not all(isinstance(n, str) and _NAME.match(n)
                                                                     for n in names):
        raise ValueError(f"SiteProfile.images[{image!r}]['backends'] must be a list of backend names, such as "
                         f"['horovod', 'torch'], not {names!r}")
    return tuple(names)


LIMIT_KEYS = ("partitions", "images", "max_nodes", "max_gpus_per_node", "max_walltime", "reservation")


def _limits(key: str, rule: dict, partitions: dict[str, Partition], images: dict[str, Image]) -> Limits:
    """One entry of ``SiteProfile.limits``, checked: known keys, existing partitions and images, plain names."""
    where = f"SiteProfile.limits[{key!r}]"
    name = key[len("group:"):] if key.startswith("group:") else key
    if not isinstance(rule, dict) or not _NAME.match(name):
        raise ValueError(f"{where}: give a user name or 'group:NAME' and a dict of limits")
    unknown = sorted(set(rule) - set(LIMIT_KEYS))
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {', '.join(unknown)}; known: {', '.join(LIMIT_KEYS)}")
    for field_name, known in (("partitions", partitions), ("images", images)):
        missing = [n for n in rule.get(field_name, ()) if n not in known]
        if missing:
            raise ValueError(f"{where}: {field_name} {', '.join(map(str, missing))} not in the site's "
                             f"{field_name} ({', '.join(known)})")
    reservation = str(rule.get("reservation", ""))
    if reservation and not _NAME.match(reservation):
        raise ValueError(f"{where}: reservation {reservation!r} is not a plain name")

    def count(k: str) -> int | None:
        return None if rule.get(k) is None else int(rule[k])

    return Limits(tuple(rule.get("partitions", ())), tuple(rule.get("images", ())), count("max_nodes"),
                  count("max_gpus_per_node"),
                  None if rule.get("max_walltime") is None else parse_walltime(rule["max_walltime"]), reservation)
