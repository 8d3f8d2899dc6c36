"""How long a session takes to be ready, against plain ipyparallel engines that import the same stack, in
alternating rounds on this machine (local engines, and with ``--image`` local engines in the user's containers).

- baseline: ``ipyparallel.Cluster(n=N)``: the controller, N engines connected, then TensorFlow and Horovod imported
  on every engine, each part timed;
- session: ``TrainingSession(ranks=N, where="local").start()`` (the same, plus the session's rendezvous and every
  rank joining one Horovod world), and its ``close()``; meanwhile what a rank that is up and idle holds (its
  memory, the CPU its threads use): what engines started before the user asks would hold until the first session;
- containers (``--image``): the session with each engine in a container of the image
  (``containers=True``), as a job's ranks run on their node; the baseline stays plain local engines.

    runuser -u alice -- /opt/jupyter-hpcdl/venv/bin/python benchmarks/start_profile.py --rounds 5 --image hpcdl/base:latest

Prints one JSON line per round and a summary: medians with the spread (min, max) and the ratio session/baseline per
round."""
from __future__ import annotations

import argparse
import json
import sys
import time

import ipyparallel as ipp

from fit_profile import spread  # this folder is on the path
from jupyter_hpcdl.training import TrainingSession


def import_stack() -> None:
    """On an engine: what a rank imports before it can join (the Horovod backend's stack)."""
    import os

    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import horovod.tensorflow.keras  # noqa: F401
    import tensorflow  # noqa: F401


def footprint(seconds: float) -> dict:
    """On a rank that is up and idle: its memory (unique to it, and resident) and the CPU its threads use meanwhile
    (the engine's heartbeat, the framework's), as a share of one core over ``seconds``."""
    import time

    import psutil

    me = psutil.Process()
    cpu0, t0 = sum(me.cpu_times()[:2]), time.perf_counter()
    time.sleep(seconds)
    cpu = (sum(me.cpu_times()[:2]) - cpu0) / (time.perf_counter() - t0)
    mem = me.memory_full_info()
    return {"uss_mb": mem.uss / 2**20, "rss_mb": mem.rss / 2**20, "idle_cpu": cpu}


def most_held(held: list[dict]) -> dict:
    """The most any rank of ``held`` (each a :func:`footprint`) holds."""
    return {f"rank_{k}": max(h[k] for h in held) for k in ("uss_mb", "rss_mb", "idle_cpu")}


def baseline(ranks: int, timeout: float) -> dict:
    """Plain ipyparallel engines importing the stack: the time of each part."""
    t0 = time.perf_counter()
    cluster = ipp.Cluster(n=ranks, log_level=40)
    try:
        cluster.start_controller_sync()
        t_controller = time.perf_counter()
        cluster.start_engines_sync()
        client = cluster.connect_client_sync()
        client.wait_for_engines(ranks, timeout=timeout)
        t_engines = time.perf_counter()
        client[:].apply_sync(import_stack)
        t_imports = time.perf_counter()
        held = client[:].apply_sync(footprint, 2.0)  # not part of the start
        client.close()
    finally:
        t_stop = time.perf_counter()
        cluster.stop_cluster_sync()
    return {"controller_s": t_controller - t0, "engines_s": t_engines - t_controller, "imports_s": t_imports - t_engines,
            "ready_s": t_imports - t0, "stop_s": time.perf_counter() - t_stop, **most_held(held)}


def session(ranks: int, timeout: float, image: str | None = None) -> dict:
    t0 = time.perf_counter()
    s = TrainingSession(ranks=ranks, where="local", start_timeout=timeout,
                        **({"containers": True, "image": image} if image else {}))
    try:
        s.start()
        t_ready = time.perf_counter()
        held = list(s.run(footprint, 2.0).values())
    finally:
        t_close = time.perf_counter()
        s.close()
    return {"ready_s": t_ready - t0, "close_s": time.perf_counter() - t_close, **most_held(held)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--timeout", type=float, default=300.0, help="for each start")
    p.add_argument("--image", help="also start the session's engines in containers of this image (pulled already)")
    args = p.parse_args()
    if args.rounds < 1 or args.ranks < 1:
        p.error("--rounds and --ranks at least 1")
    rows = []
    for r in range(args.rounds):
        row = {"round": r}
        variants = ["baseline", "session", *(["containers"] if args.image else [])]
        for which in variants[r % len(variants):] + variants[:r % len(variants)]:  # the order rotates
            row[which] = (baseline(args.ranks, args.timeout) if which == "baseline" else
                          session(args.ranks, args.timeout, args.image if which == "containers" else None))
        row["ratio"] = row["session"]["ready_s"] / row["baseline"]["ready_s"]
        if args.image:
            row["ratio_containers"] = row["containers"]["ready_s"] / row["baseline"]["ready_s"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    summary = {
        "date": time.strftime("%Y-%m-%d"), "rounds": args.rounds, "ranks": args.ranks,
        "baseline": {k: spread([row["baseline"][k] for row in rows]) for k in rows[0]["baseline"]},
        "session": {k: spread([row["session"][k] for row in rows]) for k in rows[0]["session"]},
        "ratio_session_over_baseline": spread([row["ratio"] for row in rows]),
    }
    if args.image:
        summary.update(image=args.image,
                       containers={k: spread([row["containers"][k] for row in rows]) for k in rows[0]["containers"]},
                       ratio_containers_over_baseline=spread([row["ratio_containers"] for row in rows]))
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
