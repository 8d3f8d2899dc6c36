"""The doctor's job on a node: submitted as the user, waited for (and cancelled past its deadline), its probe's
result read back through the shared home."""
from __future__ import annotations

import shlex
import subprocess
import time

from jupyter_hpcdl.batchsystems.scheduler import ENDED, JobRequest, Scheduler

from .exchange import collect, run_as
from .facts import NodeFacts, ProbeRequest, facts_from_json
from .hubchecks import KEEP_ENV, Target, become, run_cli
from .report import FAIL, OK, Finding

JOB_ENV = ("PATH", "HOME", "USER", "LANG")


def job_script(sched: Scheduler, req: JobRequest, python: str, work: str, home: str) -> str:
    header = sched.header(req, "hpcdl-doctor", f"{work}/job.out", home)
    probe = [python, "-m", "jupyter_hpcdl.doctor.probe", f"{work}/request.json"]
    return "\n".join(["#!/bin/bash", *header, "exec " + " ".join(shlex.quote(a) for a in probe)]) + "\n"


def _cancel(sched: Scheduler, target: Target, env: dict, job_id: str) -> None:
    try:
        run_cli([*become(target), *sched.cancel_argv(job_id)], env, 30)
    except (OSError, subprocess.TimeoutExpired):
        pass


def wait_for_job(sched: Scheduler, env: dict, job_id: str, timeout: float) -> tuple[bool, str, str]:
    """Poll the queue until ``job_id`` has ended (gone from it, or ENDED) or ``timeout`` passes; return (ended,
    node, last state). A failed or missing first reading is retried, not taken for the end."""
    deadline, node, state, seen, misses = time.monotonic() + timeout, "", "not seen yet", False, 0
    while time.monotonic() < deadline:
        try:
            q = run_cli(sched.queue_argv(), env, 30)
        except (OSError, subprocess.TimeoutExpired):
            q = None
        if q is not None and q.returncode == 0:
            info = sched.parse_queue(q.stdout).get(job_id)
            if info is None:
                misses += 1
                if seen or misses >= 5:  # gone from the queue (a very short job may never be seen running)
                    return True, node, state
            else:
                seen, state = True, f"{info.state} ({info.reason})" if info.reason else info.state
                node = info.batch_host or node
                if info.phase == ENDED:
                    return True, node, state
        time.sleep(1)
    return False, node, state


def run_node_job(sched: Scheduler, target: Target, env: dict, probe_req: ProbeRequest, req: JobRequest, python: str,
                 work: str, timeout: float) -> tuple[NodeFacts | None, list[Finding]]:
    """Submit the probe, wait for it (at most ``timeout`` s, then cancel it), return its facts. The job never
    outlives the doctor: any way out of the wait before it ended cancels it."""
    script = job_script(sched, req, python, work, target.home)
    names = JOB_ENV + tuple(n for n in KEEP_ENV if n in env)
    why = ""
    try:
        r = run_cli([*become(target, names), *sched.submit_argv(names)], env, 60, input=script)
        job_id = sched.parse_submit(r.stdout) if r.returncode == 0 else None
        why = (r.stderr or r.stdout).strip()[-300:]
    except (OSError, subprocess.TimeoutExpired, ValueError) as e:
        job_id, why = None, str(e)
    if job_id is None:
        return None, [Finding("node job", FAIL, f"submitting the doctor's job as {target.user} failed: {why}",
                              f"check that {target.user} may submit to partition {req.partition} with --gres=gpu:"
                              f"{req.gpus_per_node}")]
    ended = False
    try:
        ended, node, state = wait_for_job(sched, env, job_id, timeout)
    finally:
        if not ended:
            _cancel(sched, target, env, job_id)
    if not ended:
        return None, [Finding("node job", FAIL, f"job {job_id} still {state} after {timeout:.0f} s; cancelled",
                              f"are the nodes of partition {req.partition} up and free? (sinfo); or give a longer "
                              "--timeout")]
    found: dict = {}
    for _ in range(10):  # a shared file system may show the file a moment later
        found = run_as(target.user, collect, work)
        if found["result"] is not None:
            break
        time.sleep(0.5)
    if found["result"] is None:
        lines = (found["job_out"] or "").strip().splitlines()[-3:]
        tail = " / ".join(lines) if lines else "no job output"
        return None, [Finding("shared home", FAIL, f"job {job_id} ran{' on ' + node if node else ''} but its result "
                              f"never appeared in {work} on the hub host ({tail})",
                              "home directories (or the doctor's --exchange-dir) must be shared between the hub host "
                              "and the nodes, at the same path, and writable by the user there; also check that "
                              f"{python} exists on the nodes", where=node or "node")]
    try:
        facts = facts_from_json(found["result"])
    except (ValueError, TypeError) as e:
        return None, [Finding("node job", FAIL, f"job {job_id}'s result in {work} is not the probe's: {e}",
                              "check that the nodes run the same jupyter-hpcdl as the hub host", where=node or "node")]
    if facts.nonce != probe_req.nonce:
        return facts, [Finding("shared home", FAIL, f"the result in {work} is not this run's", "run the doctor again",
                               where=facts.node)]
    return facts, [Finding("shared home", OK, f"{work} is shared: the node read the request and the hub host reads "
                           f"the result (job {job_id})", where=facts.node)]
