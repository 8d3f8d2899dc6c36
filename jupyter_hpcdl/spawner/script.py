"""The batch script that runs a user's JupyterLab in a job: a pure function of a validated request, so it can be
previewed on the form and tested alone. It carries no secret: the hub's token reaches the job through the
submitting process's environment (named in the submission's --export), never through the script, which other
users can read (``scontrol show job``, ``scontrol write batch_script``)."""
from __future__ import annotations

import ipaddress
import shlex
from dataclasses import dataclass
from typing import Sequence

from .options import JobRequest
from .scheduler import Scheduler


@dataclass(frozen=True)
class ScriptContext:
    """What the site fixes (not the user): where the job-side Python is, where logs go, how the server listens."""

    python: str
    output: str
    workdir: str
    listen_ip: str = "0.0.0.0"
    job_name: str = "jupyterhub-hpcdl"
    singleuser_cmd: Sequence[str] = ("jupyterhub-singleuser",)


def build_batch_script(req: JobRequest, scheduler: Scheduler, ctx: ScriptContext) -> str:
    ipaddress.ip_address(ctx.listen_ip)  # ValueError for anything else
    command = [ctx.python, "-m", "jupyter_hpcdl.spawner.jobside", f"--image={req.image_ref}",
               f"--listen-ip={ctx.listen_ip}", "--", *ctx.singleuser_cmd]
    lines = [
        "#!/bin/bash",
        *scheduler.header(req, ctx.job_name, ctx.output, ctx.workdir),
        f"# jupyter-hpcdl: JupyterLab on the first node; kernels in the udocker image {req.image_ref}",
        f"# {req.nodes} node(s) x {req.gpus_per_node} GPU(s) for {req.walltime}: {req.gpu_hours:g} GPU-hours",
        "set -eu",
        "exec " + " ".join(shlex.quote(a) for a in command),
    ]
    return "\n".join(lines) + "\n"
