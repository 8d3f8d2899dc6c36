"""The allocation owner's API: the routes a kernel (over the owner's socket) and JupyterLab (through the server
extension) may call, each request's values checked before the owner (:mod:`jupyter_hpcdl.job.allocation`) acts.
Pure routing and validation, so it is tested alone."""
from __future__ import annotations

import math
import re
import subprocess

from .allocation import AllocationOwner

SESSION_STATES = ("none", "starting", "idle", "training", "stopped", "failed", "walltime")
RANK_FIELDS = {"rank": int, "node": str, "gpu": str, "container": str, "state": str, "straggler": bool,
               "loss": float, "samples_per_s": float}


def session_report(body: dict) -> dict:
    """A kernel's report of its training session (its id, state and ranks), checked field by field: only plain
    values of the known fields are kept (a number that is not finite becomes None), so what the panel shows cannot
    carry anything else."""
    state, session_id = body.get("session"), body.get("id", "")
    if state not in SESSION_STATES:
        raise ValueError(f"session must be one of {', '.join(SESSION_STATES)}")
    if not isinstance(session_id, str) or len(session_id) > 64:
        raise ValueError("id must be a string of at most 64 characters")
    ranks = body.get("ranks", [])
    if not isinstance(ranks, list) or len(ranks) > 4096:
        raise ValueError("ranks must be a list of at most 4096 rank records")
    clean = []
    for rank in ranks:
        if not isinstance(rank, dict) or not isinstance(rank.get("rank"), int) or isinstance(rank["rank"], bool):
            raise ValueError("each rank record needs a whole-number 'rank'")
        row = {}
        for name, kind in RANK_FIELDS.items():
            value = rank.get(name)
            if value is None or isinstance(value, bool) and kind is not bool:
                row[name] = None
            elif isinstance(value, (int, float, str, bool)):
                row[name] = str(value)[:64] if kind is str else kind(value)
                if kind is float and not math.isfinite(row[name]):
                    row[name] = None
            else:
                raise ValueError(f"rank field {name!r} must be a plain value")
        clean.append(row)
    message = body.get("message")
    if message is not None and not isinstance(message, str):
        raise ValueError("message must be a string")
    return {"id": session_id, "session": state, "ranks": clean, **({"message": message[:500]} if message else {})}


async def handle(owner: AllocationOwner, method: str, path: str, body: dict) -> tuple[int, dict]:
    """The owner's tiny API: a status and a JSON reply for ``method`` and ``path``."""
    try:
        if method == "GET" and path == "/allocation":
            return 200, await owner.describe()
        if method == "POST" and path == "/engines":
            ranks, image, conn = body.get("ranks"), body.get("image"), body.get("connection_file")
            if not isinstance(ranks, int) or isinstance(ranks, bool) or not 1 <= ranks <= 4096:
                return 400, {"message": "ranks must be a whole number from 1 to 4096"}
            if not isinstance(image, str) or not isinstance(conn, str):
                return 400, {"message": "image and connection_file are required strings"}
            return 201, await owner.start_engines(ranks, image, conn, int(body.get("gpus_per_rank", 0)),
                                                  body.get("mpi") is True)
        if method == "PUT" and path == "/session":
            owner.report(session_report(body))
            return 200, owner.current_session()
        if method == "POST" and path == "/jobs":
            return 201, await owner.submit_job(body.get("batch_file"), body.get("keep") is True)
        if method == "GET" and re.fullmatch(r"/jobs/\d+", path):
            return 200, await owner.job_status(path.rsplit("/", 1)[1])
        if method == "DELETE" and re.fullmatch(r"/jobs/\d+", path):
            return 200, await owner.cancel_job(path.rsplit("/", 1)[1])
        if method == "DELETE" and path == "/engines":
            return 200, {"stopped": await owner.stop_engines()}
        return 404, {"message": f"no {method} {path}"}
    except (ValueError, OSError, subprocess.SubprocessError) as e:
        return 400, {"message": str(e)}
    except NotImplementedError:  # a member an adapter's roles do not cover
        name = owner.sched.name if owner.sched else "this batch system"
        return 400, {"message": f"{method} {path} is not supported in a {name} job yet (Slurm and Grid Engine are)"}
