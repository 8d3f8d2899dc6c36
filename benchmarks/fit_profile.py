"""Where a fit's time goes, measured in one session of local ranks: the same model and data fitted with the live
metrics and the agreed stop check on and off, each for one epoch and for several, in alternating rounds.

- Per epoch (the slope between the short and the long fits): the rank-side cost of the metric publication and of
  the stop check's allreduce, against a fit with both turned off.
- Per fit (the intercept): the fixed cost of a fit (the kernel's round trips to start and collect it, the ranks'
  fit set-up, the weights check), and, measured alone, one call on every rank and one weights check.
- The first metric: from the call of ``fit()`` on ranks that are up (and trained before) to the first metrics in
  the session's table.

    runuser -u alice -- /opt/jupyter-hpcdl/venv/bin/python benchmarks/fit_profile.py --rounds 5

Prints one JSON line per round and a summary: medians with the spread (min, max) over the rounds."""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import cloudpickle

from jupyter_hpcdl.training import TrainingSession
from training_interactive import WORKLOAD  # the digits MLP, the same work as there (this folder is on the path)

NEVER = 10**9
#: The fit settings compared: as a user gets them, and with the publication, the stop check or both left out.
SETTINGS = {
    "default": {},
    "no_metrics": {"publish_every": NEVER, "publish_interval": 3600.0},
    "no_stop_check": {"stop_check_every": NEVER},
    "neither": {"publish_every": NEVER, "publish_interval": 3600.0, "stop_check_every": NEVER},
}


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--epochs", type=int, default=4, help="the long fit's epochs (the short fit has one)")
    args = p.parse_args()
    if args.rounds < 1 or args.ranks < 1 or args.epochs < 2:
        p.error("--rounds and --ranks at least 1, --epochs at least 2")
    work = Path(tempfile.mkdtemp(prefix="hpcdl-bench-", dir=os.path.expanduser("~")))
    (work / "workload.py").write_text(WORKLOAD)
    sys.path.insert(0, str(work))
    import workload

    cloudpickle.register_pickle_by_value(workload)
    rows = []
    try:
        t0 = time.perf_counter()
        with TrainingSession(ranks=args.ranks, where="local") as s:
            start_s = time.perf_counter() - t0
            import tensorflow as tf

            s.setup(workload.model, workload.shard, loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                    lr=0.05)
            samples = sum(s.shard_sizes().values())
            s.fit(epochs=1)  # warm-up: tracing and the first epoch's costs stay out
            names = list(SETTINGS)
            for r in range(args.rounds):
                order = names[r % len(names):] + names[:r % len(names)]  # each setting leads once in four rounds
                row = {"round": r}
                for name in order:
                    first: list[float] = []
                    called = time.perf_counter()
                    short = s.fit(epochs=1, on_metrics=lambda table: first or first.append(time.perf_counter()),
                                  **SETTINGS[name]).seconds
                    if name == "default":
                        row["first_metric_s"] = first[0] - called
                    long = s.fit(epochs=args.epochs, **SETTINGS[name]).seconds
                    per_epoch = (long - short) / (args.epochs - 1)
                    row[name] = {"epoch_s": per_epoch, "fixed_s": short - per_epoch,
                                 "samples_per_s": samples / per_epoch}
                row["call_every_rank_s"] = timed(lambda: s.run(int, 0))
                row["weights_check_s"] = timed(s.weights_digest)
                rows.append(row)
                print(json.dumps(row), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    def of(name: str, key: str) -> list[float]:
        return [row[name][key] for row in rows]

    base = of("neither", "epoch_s")
    summary = {
        "date": time.strftime("%Y-%m-%d"), "rounds": args.rounds, "ranks": args.ranks, "epochs": args.epochs,
        "samples_per_epoch": samples, "start_s": start_s,
        "epoch_s": {name: spread(of(name, "epoch_s")) for name in SETTINGS},
        # per round, against the fit with neither in the same round: the cost of each part per epoch
        "epoch_ratio_to_neither": {name: spread([a / b for a, b in zip(of(name, "epoch_s"), base)])
                                   for name in SETTINGS},
        "fixed_s": {name: spread(of(name, "fixed_s")) for name in SETTINGS},
        "first_metric_s": spread([row["first_metric_s"] for row in rows]),
        "call_every_rank_s": spread([row["call_every_rank_s"] for row in rows]),
        "weights_check_s": spread([row["weights_check_s"] for row in rows]),
    }
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
