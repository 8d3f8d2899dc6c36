"""The batch script that runs a user's JupyterLab in a job: a pure function of a validated request, so it can be
previewed on the form and tested alone. It carries no secret: the hub's token reaches the job through the
submitting process's environment (named in the submission's --export), never through the script, which other
users can read (``scontrol show job``, ``scontrol write batch_script``)."""
from __future__ import annotations

import ipaddress
import re
import shlex
from dataclasses import dataclass
from typing import Sequence

from .options import JobRequest
from ..batchsystems.scheduler import CONFIG_ENV, OFFER_ENV, Scheduler


@dataclass(frozen=True)
class ScriptContext:
    """What the site fixes (not the user): where the job-side Python is, where logs go, how the server listens."""

    python: str
    output: str
    workdir: str
    listen_ip: str = ""  # empty: the job picks the node's address on its route to the hub
    job_name: str = "jupyterhub-hpcdl"
    singleuser_cmd: Sequence[str] = ("jupyterhub-singleuser",)
    comment: str = ""  # the hub's mark (orphans.JobMark), already encoded to safe characters
    env_file: str = ""  # where the job finds its secrets, where the scheduler shows a job's environment to all
    offer: str = ""  # what the user may ask for (profile.offer_json): the limits of the jobs a kernel submits


def build_batch_script(req: JobRequest, scheduler: Scheduler, ctx: ScriptContext) -> str:
    if ctx.listen_ip:
        ipaddress.ip_address(ctx.listen_ip)  # ValueError for anything else
    if not re.fullmatch(r"[A-Za-z0-9=._:%/-]*", ctx.comment):
        raise ValueError(f"job comment {ctx.comment!r} has characters other than letters, digits and =._:%/-")
    command = [ctx.python, "-m", "jupyter_hpcdl.job.server", f"--image={req.image_ref}",
               *([f"--listen-ip={ctx.listen_ip}"] if ctx.listen_ip else []),
               *([f"--env-file={ctx.env_file}"] if ctx.env_file else []), "--", *ctx.singleuser_cmd]
    run = " ".join(shlex.quote(a) for a in command)
    lines = [
        "#!/bin/bash",
        *scheduler.header(req, ctx.job_name, ctx.output, ctx.workdir, ctx.comment),
        f"# jupyter-hpcdl: JupyterLab on the first node; kernels in the udocker image {req.image_ref}",
        f"# {req.nodes} node(s) x {req.gpus_per_node} GPU(s) for {req.walltime}: {req.gpu_hours:g} GPU-hours",
        *(["# the site's prologue", *scheduler.prologue] if scheduler.prologue else []),
        "set -eu",
        f'export HPCDL_JOB_ID="${{{scheduler.job_id_env}:-}}" HPCDL_NODE="${{{scheduler.node_env}:-}}"',
    ]
    if scheduler.job_config():
        lines += ["# the site's configuration of the batch system, for the jobs a kernel submits from here",
                  f"export {CONFIG_ENV}={shlex.quote(scheduler.job_config())}"]
    if ctx.offer:
        lines += ["# what this user may ask for (the form's limits): the jobs a kernel submits from here keep to it",
                  f"export {OFFER_ENV}={shlex.quote(ctx.offer)}"]
    if scheduler.epilogue:  # the server runs as a child, so the site's epilogue runs after it, whatever its end
        lines += ["code=0", f"{run} || code=$?", "set +eu", "# the site's epilogue", *scheduler.epilogue, 'exit "$code"']
    else:
        lines.append("exec " + run)
    return "\n".join(lines) + "\n"
