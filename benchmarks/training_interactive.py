"""Interactive training, measured against its baselines in the same run.

1. Throughput of 2 ranks trained from the session (with live metrics) against the same training under horovodrun
   (Gloo), alternating rounds: ratio of samples/s after a warm-up epoch (target >= 0.97).
2. Rank-to-kernel metric latency: publication on the rank to arrival in the session's table, p50/p95 (target p95
   <= 250 ms; the kernel polls every ``--poll`` s).
3. Weak scaling 1 -> 2 ranks on this machine (efficiency; the test bed's "nodes" share one machine's cores).
4. Engine start-up: engines in the user's container (``--image``) against plain local engines.

    runuser -u alice -- /opt/jupyter-hpcdl/venv/bin/python benchmarks/training_interactive.py --rounds 3
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import cloudpickle

from jupyter_hpcdl.training import TrainingSession

EPOCHS = 3
HOROVODRUN_SCRIPT = '''
import json, os, sys, time
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
import tensorflow as tf
tf.config.threading.set_intra_op_parallelism_threads(1); tf.config.threading.set_inter_op_parallelism_threads(1)
import horovod.tensorflow.keras as hvd
sys.path.insert(0, os.path.dirname(__file__))
from workload import model, shard
hvd.init()
tf.keras.utils.set_random_seed(1234)
x, y = shard(hvd.rank(), hvd.size())
m = model()
m.compile(optimizer=hvd.DistributedOptimizer(tf.keras.optimizers.SGD(0.05)),
          loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True), experimental_run_tf_function=False)
cb = [hvd.callbacks.BroadcastGlobalVariablesCallback(0), hvd.callbacks.MetricAverageCallback()]
m.fit(x, y, batch_size=32, epochs=1, verbose=0, callbacks=cb)
t0 = time.perf_counter()
m.fit(x, y, batch_size=32, epochs=int(sys.argv[1]), verbose=0, callbacks=cb[1:])
if hvd.rank() == 0:
    print(json.dumps({"seconds": time.perf_counter() - t0, "samples": len(x) * hvd.size() * int(sys.argv[1])}))
'''
WORKLOAD = '''
def model():
    import tensorflow as tf
    return tf.keras.Sequential([tf.keras.layers.Input((64,)), tf.keras.layers.Dense(256, activation="relu"),
                                tf.keras.layers.Dense(256, activation="relu"), tf.keras.layers.Dense(10)])

def shard(rank, size):
    import numpy as np
    from sklearn.datasets import load_digits
    x, y = load_digits(return_X_y=True)
    x, y = np.tile(x, (4, 1)), np.tile(y, 4)
    return (x[rank::size] / 16.0).astype("float32"), y[rank::size]
'''


def interactive(session, epochs: int) -> float:
    import tensorflow as tf

    from workload import model, shard
    session.setup(model, shard, loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True), lr=0.05)
    session.fit(epochs=1)
    result = session.fit(epochs=epochs)
    return sum(session.shard_sizes().values()) * epochs / result.seconds


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--poll", type=float, default=0.05)
    p.add_argument("--epochs", type=int, default=EPOCHS, help="measured epochs per run (after a warm-up epoch); "
                   "the session's fixed cost per fit (a round trip, the weights check) weighs less in longer fits")
    p.add_argument("--image", default="hpcdl/base:latest", help="for the engine start-up in containers ('' to skip)")
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="hpcdl-bench-", dir=os.path.expanduser("~")))
    (work / "workload.py").write_text(WORKLOAD)
    (work / "hvd_train.py").write_text(HOROVODRUN_SCRIPT)
    sys.path.insert(0, str(work))
    import workload
    cloudpickle.register_pickle_by_value(workload)
    venv_bin = Path(sys.executable).parent
    rows = []
    try:
        for r in range(args.rounds):
            row = {}
            for which in (("session", "horovodrun") if r % 2 == 0 else ("horovodrun", "session")):
                if which == "horovodrun":
                    out = subprocess.run([str(venv_bin / "horovodrun"), "--gloo", "-np", "2", "-H", "localhost:2",
                                          sys.executable, str(work / "hvd_train.py"), str(args.epochs)],
                                         capture_output=True, text=True, check=True, env={**os.environ,
                                         "PATH": f"{venv_bin}:{os.environ.get('PATH', '')}"}).stdout
                    # horovodrun prefixes each line with the rank ("[0]<stdout>:")
                    res = json.loads([line[line.index("{"):] for line in out.splitlines() if '{"seconds"' in line][-1])
                    row["horovodrun"] = res["samples"] / res["seconds"]
                else:
                    t0 = time.perf_counter()
                    with TrainingSession(ranks=2, where="local") as s:
                        row["start_local_s"] = time.perf_counter() - t0
                        s_fit = s.fit
                        s.fit = lambda epochs=1, **kw: s_fit(epochs=epochs, poll=args.poll, **kw)
                        row["session"] = interactive(s, args.epochs)
                        lat = (s.metrics["arrived"] - s.metrics["time"]).dropna()
                        row["latency_p50_ms"] = float(lat.quantile(0.5) * 1000)
                        row["latency_p95_ms"] = float(lat.quantile(0.95) * 1000)
            row["ratio"] = row["session"] / row["horovodrun"]
            rows.append(row)
            print(json.dumps(row), flush=True)
        with TrainingSession(ranks=1, where="local") as s:
            import tensorflow as tf
            s.setup(workload.model, workload.shard, loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
            weak = s.scaling([1, 2], epochs=EPOCHS, mode="weak")
            print(weak.to_string(), flush=True)
        container_start = None
        if args.image:
            t0 = time.perf_counter()
            with TrainingSession(ranks=2, where="local", containers=True, image=args.image):
                container_start = time.perf_counter() - t0
    finally:
        shutil.rmtree(work, ignore_errors=True)
    med = statistics.median
    summary = {
        "rounds": args.rounds, "epochs": args.epochs,
        "session_samples_per_s": med(r["session"] for r in rows),
        "horovodrun_samples_per_s": med(r["horovodrun"] for r in rows),
        "ratio_session_over_horovodrun": med(r["ratio"] for r in rows),
        "metric_latency_p50_ms": med(r["latency_p50_ms"] for r in rows),
        "metric_latency_p95_ms": med(r["latency_p95_ms"] for r in rows),
        "weak_scaling_efficiency_2_ranks": float(weak.loc[weak["ranks"] == 2, "efficiency"].iloc[0]),
        "engine_start_local_s": med(r["start_local_s"] for r in rows),
        "engine_start_container_s": container_start,
    }
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
