"""What the GPU checks of containers need, found on the bed or handed over by a GPU machine without it.

On the bed's GPU node: the bed's udocker, its tools and its OS image, and the CUDA probe (`benchmarks/gpu/probe.cu`)
built with ``nvcc``. On a machine lent for a GPU check, without the bed: the four ``HPCDL_GPU_*`` variables that
``benchmarks/gpu/device_check.sh`` sets from the bundle ``benchmarks/gpu/bundle.sh`` made.
"""
from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from jupyter_hpcdl.containers.spec import RunSpec, Mount, SitePolicy, UdockerInstall
from jupyter_hpcdl.containers.udocker import Udocker

REPO = Path(__file__).resolve().parents[1]
PROBE_SOURCE = REPO / "benchmarks" / "gpu" / "probe.cu"
PROBE_IN_CONTAINER = "/hpcdl-gpu-probe"
VARIABLES = ("HPCDL_GPU_UDOCKER", "HPCDL_GPU_TOOLS", "HPCDL_GPU_ROOTFS", "HPCDL_GPU_PROBE")
MODES = {"userns": "userns", "off": "P1"}  # the site's fast_path -> the mode containers run in
IMAGE = "gpu/os:1"
STATE = Path(os.environ.get("HPCDL_TESTBED_STATE", "/var/lib/jupyter-hpcdl-testbed"))


class NoKit(Exception):
    """The GPU checks cannot run here; the message says what is missing."""


@dataclass(frozen=True)
class GpuKit:
    udocker: str  # udocker's executable
    tools_dir: str  # its engine tools (hpcdl-udocker-tools install)
    rootfs: str  # an image's file system as a tarball (udocker import)
    probe: str  # the CUDA probe, built for this node


def build_probe(out_dir: str | os.PathLike) -> str:
    """Compile the CUDA probe with ``nvcc`` (the CUDA runtime linked in: only the driver is needed to run it)."""
    nvcc = shutil.which("nvcc") or next(iter(glob.glob("/usr/local/cuda*/bin/nvcc")), None)
    if not nvcc:
        raise NoKit("nvcc not found: build benchmarks/gpu/probe.cu on a machine with CUDA and set HPCDL_GPU_PROBE")
    out = os.path.join(out_dir, "gpu_probe")
    built = subprocess.run([nvcc, "-O2", "-cudart", "static", "-gencode", "arch=compute_90,code=[sm_90,compute_90]",
                            "-gencode", "arch=compute_80,code=sm_80", "-o", out, str(PROBE_SOURCE)],
                           capture_output=True, text=True, timeout=300)
    if built.returncode:
        raise NoKit(f"nvcc could not build {PROBE_SOURCE} ({built.returncode}):\n{built.stderr[-2000:]}")
    return out


def find_kit(scratch: str | os.PathLike, state_dir: Path = STATE) -> GpuKit:
    """The kit from the ``HPCDL_GPU_*`` variables, else from the bed (``state_dir``), else :class:`NoKit`."""
    given = {v: os.environ.get(v, "") for v in VARIABLES}
    if all(given.values()):
        return GpuKit(*given.values())
    if any(given.values()):
        raise NoKit(f"set all of {', '.join(VARIABLES)} or none (missing: "
                    f"{', '.join(v for v, x in given.items() if not x)})")
    bed_file = state_dir / "bed.json"
    if not bed_file.exists():
        raise NoKit(f"neither the bed ({bed_file}) nor {', '.join(VARIABLES)} (benchmarks/gpu/device_check.sh)")
    bed = json.loads(bed_file.read_text())
    rootfs = sorted(glob.glob(f"{bed['cache']}/image/os-*.tar"))
    if not rootfs:
        raise NoKit(f"the bed's OS image is not built ({bed['cache']}/image)")
    return GpuKit(f"{bed['venv']}/bin/udocker", f"{bed['prefix']}/udocker-tools", rootfs[0], build_probe(scratch))


def client(kit: GpuKit, repo: str | os.PathLike, fast_path: str, **env: str) -> Udocker:
    """A udocker of its own (``repo``) for the calling user, the site's fast path as given, mounts under /tmp."""
    install = UdockerInstall(executable=kit.udocker, udocker_dir=str(repo), allow_root=os.geteuid() == 0,
                             tools_dir=kit.tools_dir)
    return Udocker(install, SitePolicy(allowed_mount_roots=("/tmp",), fast_path=fast_path),
                   environ={**os.environ, **env})


def probe_spec(container: str, kit: GpuKit, command: str, env_names: tuple[str, ...] = ()) -> RunSpec:
    """The probe run in ``container``: its directory bound read-only-by-convention where the container sees it."""
    return RunSpec(container, [f"{PROBE_IN_CONTAINER}/{os.path.basename(kit.probe)}", command],
                   mounts=[Mount(os.path.dirname(os.path.abspath(kit.probe)), PROBE_IN_CONTAINER)],
                   env_names=list(env_names))


def last_json(text: str) -> dict:
    """The probe's answer: its last line of output, parsed."""
    lines = [line for line in text.splitlines() if line.startswith("{")]
    if not lines:
        raise AssertionError(f"the probe printed no JSON line:\n{text}")
    return json.loads(lines[-1])
