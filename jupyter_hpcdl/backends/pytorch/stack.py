"""The doctor's view of the PyTorch stack in an image (runs on the hub host, and ``PROBE_SCRIPT`` in a container of
the image): which PyTorch it has, whether ``torch.distributed`` loads with Gloo (and NCCL), and what is wrong."""
from __future__ import annotations

from typing import Sequence

from ..base import StackFinding

# Runs in the container: what the kernel side needs, and whether torch.distributed has what the ranks join with.
PROBE_SCRIPT = r"""
import importlib.metadata as m, json, os, sys
out = {"python": "%d.%d.%d" % sys.version_info[:3], "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")}
for name in ("jupyter-hpcdl", "torch", "ipykernel", "ipyparallel"):
    try:
        out[name] = m.version(name)
    except m.PackageNotFoundError:
        out[name] = None
try:
    import torch.distributed as dist
    out["torch_gloo"], out["torch_nccl"] = dist.is_gloo_available(), dist.is_nccl_available()
    out["torch_error"] = ""
except Exception as e:
    out["torch_error"] = (type(e).__name__ + ": " + str(e))[:400]
print("HPCDL-VERSIONS " + json.dumps(out))
"""


def pinned_version(requirements: Sequence[str]) -> str | None:
    """jupyter-hpcdl pins no PyTorch release (its ``torch`` extra takes any from 2.2 on)."""
    return None


def assess_stack(v: dict, ref: str, pinned: str | None) -> list[StackFinding]:
    """What is wrong with PyTorch in image ``ref`` (``v``: the probe's versions)."""
    if not v.get("torch"):
        return [StackFinding("fail", f"{ref} has no PyTorch", "install torch in the image (pip install "
                             "'jupyter-hpcdl[torch]'; the CPU build where the nodes have no GPU)")]
    if v.get("torch_error"):
        return [StackFinding("fail", f"{ref}: torch.distributed does not load: {v['torch_error']}",
                             "reinstall torch in the image")]
    if not v.get("torch_gloo"):
        return [StackFinding("fail", f"{ref}: this PyTorch {v['torch']} has no Gloo", "install a PyTorch build "
                             "with Gloo (PyPI's builds for Linux have it)")]
    return []


def stack_summary(v: dict) -> str:
    return f"PyTorch {v.get('torch')} (Gloo{', NCCL' if v.get('torch_nccl') else ''})"
