"""The doctor's view of the PyTorch stack in an image (runs on the hub host, and ``PROBE_SCRIPT`` in a container of
the image): which PyTorch it has, whether ``torch.distributed`` loads with Gloo (and NCCL), whether one
``DistributedDataParallel`` step of 2 processes works there, and what is wrong."""
from __future__ import annotations

from typing import Sequence

from ..base import StackFinding

# One DistributedDataParallel step on each of 2 processes over Gloo, their store a file in a private temporary
# directory: prints DDP-OK where both ranks hold the same weights after it.
DDP_STEP = r"""
import datetime, sys, torch, torch.distributed as dist
rank = int(sys.argv[1])
dist.init_process_group("gloo", store=dist.FileStore(sys.argv[2], 2), rank=rank, world_size=2,
                        timeout=datetime.timedelta(seconds=40))
torch.manual_seed(rank)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
model(torch.randn(8, 4) + rank).sum().backward()
optimizer.step()
mine = model.module.weight.detach().clone()
total = mine.clone()
dist.all_reduce(total)
print("DDP-OK" if torch.allclose(total / 2, mine) else "DDP-DIFFER", flush=True)
dist.destroy_process_group()
"""

# Runs in the container: what the kernel side needs, whether torch.distributed has what the ranks join with, and
# the DDP step above.
PROBE_SCRIPT = r"""
import importlib.metadata as m, json, os, subprocess, sys, tempfile
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
if out.get("torch") and not out["torch_error"] and out.get("torch_gloo"):
    import time
    deadline = time.monotonic() + 60  # both ranks together, within the doctor's step timeout (120 s by default)
    try:
        with tempfile.TemporaryDirectory() as d:
            env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo"}
            procs = [subprocess.Popen([sys.executable, "-c", STEP, str(r), os.path.join(d, "store")], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in (0, 1)]
            said = []
            for p in procs:
                try:
                    o, e = p.communicate(timeout=max(1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    p.kill()
                    o, e = p.communicate()
                    e = "did not finish within 60 s"
                said.append((p.returncode, o, e))
        out["torch_ddp"] = "; ".join(f"rank {r}: exit {rc}: {(e or o).strip()[-300:]}"
                                     for r, (rc, o, e) in enumerate(said) if rc or "DDP-OK" not in o)
    except Exception as e:
        out["torch_ddp"] = ("could not start it: " + type(e).__name__ + ": " + str(e))[:400]
print("HPCDL-VERSIONS " + json.dumps(out))
""".replace("STEP,", repr(DDP_STEP) + ",")


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
    if v.get("torch_ddp"):
        return [StackFinding("fail", f"{ref}: one DistributedDataParallel step of 2 processes over Gloo failed in "
                             f"the container: {v['torch_ddp']}", "run the image's python3 with torch.distributed "
                             "by hand to see why (a missing library, no loopback interface, a full /tmp)")]
    return []


def stack_summary(v: dict) -> str:
    return f"PyTorch {v.get('torch')} (Gloo{', NCCL' if v.get('torch_nccl') else ''}; one DDP step on 2 processes)"
