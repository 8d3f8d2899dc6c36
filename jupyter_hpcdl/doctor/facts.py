"""What the doctor's job is asked (``ProbeRequest``) and what it reports (``NodeFacts``): plain, typed values that
travel as JSON files in the exchange directory, which must be shared between the hub host and the nodes."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from typing import Any


@dataclass(frozen=True)
class ProbeRequest:
    nonce: str
    hub_url: str
    result: str  # where the probe writes its NodeFacts (JSON), next to the request
    images: tuple[str, ...] = ()
    gpus: int = 1
    site_config: str | None = None
    step_timeout: float = 120.0  # for each udocker step and each command in a container
    #: image reference → the training backends whose stack to probe in it (an image not named: the site's default)
    backends: dict[str, list[str]] = field(default_factory=dict)


@dataclass(frozen=True)
class ImageFacts:
    ref: str
    present: bool = False  # in the user's repository before the probe
    pull_error: str | None = None  # None: no pull was needed; "": pulled
    container: str = ""
    error: str = ""  # why it could not be prepared or started
    versions: dict[str, Any] = field(default_factory=dict)  # what the container's Python reports
    nvidia_error: str | None = None  # None: not tried (no NVIDIA driver); "": udocker setup --nvidia worked
    nvidia_smi: str = ""  # `nvidia-smi -L` inside the container
    container_mode: str = ""  # what the container runs in on this node: "userns" (the fast path) or a udocker mode
    container_mode_reason: str = ""


@dataclass(frozen=True)
class NodeFacts:
    node: str
    nonce: str
    hub_url: str
    hub_status: int = 0
    hub_error: str = ""
    gpus_requested: int = 0
    cuda_visible_devices: str | None = None
    nvidia_driver: bool = False
    udocker_version: str = ""
    udocker_error: str = ""
    tools_dir: str | None = None
    mode: str = ""
    images: tuple[ImageFacts, ...] = ()

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)


def _build(cls, data: dict):
    known = {f.name for f in fields(cls)}
    return cls(**{k: v for k, v in data.items() if k in known})


def request_from_json(text: str) -> ProbeRequest:
    data = json.loads(text)
    data["images"] = tuple(data.get("images", ()))
    return _build(ProbeRequest, data)


def facts_from_json(text: str) -> NodeFacts:
    data = json.loads(text)
    data["images"] = tuple(_build(ImageFacts, i) for i in data.get("images", ()))
    return _build(NodeFacts, data)
