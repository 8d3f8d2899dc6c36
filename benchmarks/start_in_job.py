"""How long a session takes to be ready in a batch job, ranks across its nodes in the user's containers, against
plain ipyparallel engines beside the kernel that import the same stack; in alternating rounds, in a kernel of
alice's JupyterLab on the test bed (a 2-node Slurm job started through the hub).

- baseline: in the kernel, ``ipyparallel.Cluster(n=N)``: the controller, N local engines connected, then TensorFlow
  and Horovod imported on every engine (as ``start_profile.py``'s baseline);
- session: ``TrainingSession(ranks=N, where="allocation").start()``: the controller in the kernel, the engines
  started by the job's owner as ``srun`` steps on each node, each in alice's container, the framework imported, the
  ranks joined into one Horovod world; then ``close()``.

    /opt/jupyter-hpcdl/venv/bin/python benchmarks/start_in_job.py --rounds 5   # as root, with the bed up

Prints one JSON line per round and a summary: medians with the spread (min, max), and the ratio session/baseline of
each round. alice's server is started for the run and stopped after it."""
from __future__ import annotations

import argparse
import inspect
import json
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "testbed"))
STATE = Path(os.environ.get("HPCDL_TESTBED_STATE", "/var/lib/jupyter-hpcdl-testbed"))

import start_profile  # noqa: E402  (this folder is on the path)
from fit_profile import spread  # noqa: E402
from hubclient import Hub  # noqa: E402  (the bed's client)

IN_JOB = """
def session_in_job(ranks, timeout):
    import time
    from jupyter_hpcdl.training import TrainingSession

    t0 = time.perf_counter()
    s = TrainingSession(ranks=ranks, where="allocation", start_timeout=timeout)
    try:
        world = s.start()
        t_ready = time.perf_counter()
    finally:
        t_close = time.perf_counter()
        s.close()
    return {"ready_s": t_ready - t0, "close_s": time.perf_counter() - t_close,
            "nodes": sorted({w["node"] for w in world})}


rows = []
for r in range(ROUNDS):
    row = {"round": r}
    for which in (["baseline", "session"] if r % 2 == 0 else ["session", "baseline"]):
        row[which] = baseline(RANKS, TIMEOUT) if which == "baseline" else session_in_job(RANKS, TIMEOUT)
    row["ratio"] = row["session"]["ready_s"] / row["baseline"]["ready_s"]
    rows.append(row)
print(json.dumps(rows))
"""


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--timeout", type=float, default=300.0, help="for each start")
    args = p.parse_args()
    if args.rounds < 1:
        p.error("--rounds at least 1")
    ranks = 2  # one on each of the job's 2 nodes
    hub = Hub(json.loads((STATE / "bed.json").read_text()))
    status, body = hub.api("POST", "/hub/api/users/alice/server",
                           {"nodes": ranks, "gpus_per_node": 1, "walltime": "00:30:00"}, timeout=120)
    if status not in (201, 202):
        raise SystemExit(f"alice's server did not start: {status} {body}")
    try:
        hub.wait_ready("alice", timeout=300)
        hub.wait_routed("alice")
        code = "\n".join([
            "import json, sys, time", "import ipyparallel as ipp",
            inspect.getsource(start_profile.import_stack), inspect.getsource(start_profile.baseline),
            f"ROUNDS, RANKS, TIMEOUT = {args.rounds}, {ranks}, {args.timeout}", IN_JOB])
        out = hub.run_in_kernel("alice", code, timeout=args.rounds * 2 * (args.timeout + 60))
    finally:
        hub.stop("alice")
    rows = json.loads(out.strip().splitlines()[-1])
    for row in rows:
        print(json.dumps(row), flush=True)
    summary = {
        "date": time.strftime("%Y-%m-%d"), "rounds": args.rounds, "ranks": ranks,
        "nodes": rows[0]["session"]["nodes"],
        "baseline": {k: spread([row["baseline"][k] for row in rows]) for k in rows[0]["baseline"]},
        "session": {k: spread([row["session"][k] for row in rows]) for k in ("ready_s", "close_s")},
        "ratio_session_over_baseline": spread([row["ratio"] for row in rows]),
    }
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
