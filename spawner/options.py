"""User options — from the form or from the REST API's ``user_options`` — checked against the site profile.
Every value is typed, bounded and allow-listed; anything else is refused with what is allowed. Only a
:class:`JobRequest` built here ever reaches a batch script."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from ..batchsystems.scheduler import JobRequest
from .profile import Profile, format_walltime, parse_walltime

FIELDS = ("partition", "nodes", "gpus_per_node", "walltime", "memory_gb", "account", "image", "gpu_type")


class OptionsError(ValueError):
    """A user option is not allowed; the message says which and what is."""


def _one(raw: Mapping[str, Any], key: str) -> Any:
    """Form data arrives as lists of strings, REST user_options as JSON values: take one value either way."""
    value = raw.get(key)
    if isinstance(value, list):
        if len(value) != 1:
            raise OptionsError(f"{key}: give exactly one value")
        value = value[0]
    if isinstance(value, bytes):
        value = value.decode("utf-8", "replace")
    return value


def _int(raw: Mapping[str, Any], key: str, low: int, high: int, default: int | None = None) -> int:
    value = _one(raw, key)
    if value in (None, "") and default is not None:
        return default
    if isinstance(value, bool) or not (isinstance(value, int) or (isinstance(value, str) and value.strip().isdigit()
                                                                  and value.strip().isascii())):
        raise OptionsError(f"{key}: a whole number from {low} to {high}")
    n = int(value)
    if not low <= n <= high:
        raise OptionsError(f"{key}: {n} is out of range; allowed: {low} to {high}")
    return n


def _choice(raw: Mapping[str, Any], key: str, allowed: list[str] | tuple[str, ...], default: str | None = None) -> str | None:
    value = _one(raw, key)
    if value in (None, "") and (default is not None or not allowed):
        return default
    if not isinstance(value, str) or value not in allowed:
        shown = repr(value)[:40]
        raise OptionsError(f"{key}: {shown} is not offered; choose one of: {', '.join(allowed) or '(none)'}")
    return value


def validate_options(raw: Mapping[str, Any], profile: Profile, user: str) -> JobRequest:
    """The :class:`JobRequest` for ``raw`` user options, or :class:`OptionsError`."""
    if not isinstance(raw, Mapping):
        raise OptionsError("user options must be a JSON object")
    unknown = sorted(str(k)[:40] for k in raw if k not in FIELDS)
    if unknown:
        raise OptionsError(f"unknown option(s) {', '.join(unknown)}; allowed: {', '.join(FIELDS)}")
    names = list(profile.partitions)
    partition = profile.partitions[_choice(raw, "partition", names, default=names[0])]
    nodes = _int(raw, "nodes", 1, partition.max_nodes, default=1)
    least = 0 if partition.max_gpus_per_node == 0 else 1  # a partition without GPUs takes 0
    gpus = _int(raw, "gpus_per_node", least, partition.max_gpus_per_node, default=least)
    walltime_raw = _one(raw, "walltime")
    if walltime_raw in (None, ""):
        minutes = min(60, partition.max_walltime)
    else:
        try:
            minutes = parse_walltime(walltime_raw if isinstance(walltime_raw, (str, int)) else repr(walltime_raw))
        except ValueError as e:
            raise OptionsError(f"walltime: {e}") from None
    if minutes > partition.max_walltime:
        raise OptionsError(f"walltime: {format_walltime(minutes)} is longer than partition {partition.name} allows "
                           f"({format_walltime(partition.max_walltime)})")
    if partition.max_memory_gb:
        memory = _int(raw, "memory_gb", 1, partition.max_memory_gb, default=partition.max_memory_gb)
    elif _one(raw, "memory_gb") not in (None, ""):
        raise OptionsError(f"memory_gb: partition {partition.name} takes no memory request")
    else:
        memory = None
    image = _choice(raw, "image", list(profile.images), default=next(iter(profile.images)))
    accounts = profile.accounts_for(user)
    account = _choice(raw, "account", accounts, default=accounts[0] if accounts else None)
    # a partition with GPU types: the first unless one is chosen (no GPUs asked for: no type, unless chosen)
    gpu_type = (_choice(raw, "gpu_type", partition.gpu_types, default=partition.gpu_types[0] if gpus else "") or None
                ) if partition.gpu_types else None
    if not partition.gpu_types and _one(raw, "gpu_type") not in (None, ""):
        raise OptionsError(f"gpu_type: partition {partition.name} has no GPU types to choose from")
    return JobRequest(partition.name, nodes, gpus, minutes, image, profile.images[image].ref, account, gpu_type, memory,
                      partition.reservation or None)


def request_to_options(req: JobRequest) -> dict:
    """The user_options that give back ``req`` (stored with the server; reused by a restart)."""
    opts = {"partition": req.partition, "nodes": req.nodes, "gpus_per_node": req.gpus_per_node,
            "walltime": req.walltime, "image": req.image}
    if req.account:
        opts["account"] = req.account
    if req.gpu_type:
        opts["gpu_type"] = req.gpu_type
    if req.memory_gb:
        opts["memory_gb"] = req.memory_gb
    return opts
