"""A Jupyter kernelspec whose kernels run inside the user's udocker container (a pure builder)."""
from __future__ import annotations

import json
import os
from typing import Mapping, Sequence

from .spec import check_image_ref

#: The image a containerized kernel runs in (its kernelspec sets it): what the ranks it starts run in unless told.
IMAGE_ENV = "HPCDL_IMAGE"
DEFAULT_IMAGE = "hpcdl/base:latest"  # where a kernel runs in no container of ours
#: Variables a containerized kernel gets by name: its GPUs, the allocation it runs in and its image.
KERNEL_ENV = (IMAGE_ENV, "CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES", "SLURM_JOB_ID", "SLURM_JOB_NODELIST", "SLURM_NNODES",
              "SLURM_JOB_PARTITION", "SLURMD_NODENAME", "HPCDL_ALLOCATION_FILE", "HPCDL_JOB_ID",
              "HPCDL_NODE")


def in_container_argv(image: str, host_python: str, env_names: Sequence[str], command: Sequence[str],
                      options: Sequence[str] = ()) -> list[str]:
    """``command`` run by ``hpcdl-containers run`` in the user's container for ``image``, with the host's variables
    ``env_names`` passed in by name (never their values on a command line), and further run ``options``."""
    check_image_ref(image)
    return [host_python, "-m", "jupyter_hpcdl.containers", "run", *(f"--env={n}" for n in env_names), *options,
            image, "--", *command]


def container_kernelspec(image: str, host_python: str, display_name: str | None = None,
                         env_names: Sequence[str] = KERNEL_ENV) -> dict:
    """kernel.json for an ipykernel started by ``hpcdl-containers run`` in ``image`` (created on first use)."""
    argv = in_container_argv(image, host_python, env_names,
                             ["python3", "-m", "ipykernel_launcher", "-f", "{connection_file}"])
    return {"argv": argv, "display_name": display_name or f"Python 3 ({image}, container)", "language": "python",
            "env": {IMAGE_ENV: image}, "interrupt_mode": "signal", "metadata": {"jupyter_hpcdl": {"image": image}}}


def kernel_image(environ: Mapping[str, str] = os.environ) -> str:
    """The image this kernel runs in (as its kernelspec says), else :data:`DEFAULT_IMAGE`."""
    return environ.get(IMAGE_ENV) or DEFAULT_IMAGE


def write_kernelspec(kernels_dir: str, name: str, spec: dict) -> str:
    path = os.path.join(kernels_dir, name)
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "kernel.json"), "w") as f:
        json.dump(spec, f, indent=1)
    return path
