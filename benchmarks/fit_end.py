"""The end of a fit: how long ``fit()`` takes beyond its batches when the session streams the user's arrays
untuned (the session's stream) against the same stream autotuned by TensorFlow (the baseline), in one session.

2 local ranks, a ``tf.keras.applications`` model compiled by the user (``weights=None``), random arrays of
``--batches`` batches per rank per fit. Each round fits once with each variant, the order alternating between
rounds. For each fit: the whole call of ``fit()`` in the kernel, the batches' time on rank 0 (its first to last
batch, by a callback), and what is left: the call's start and end (the round trips, the new stream, the weights
check and the stream's teardown). An autotuned iterator's teardown waits for the tuning thread's next round.

    HOME=/tmp/benchhome PYTHONPATH=$PWD /opt/jupyter-hpcdl-ci/venv/bin/python benchmarks/fit_end.py --rounds 7
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np

from fit_profile import spread  # this folder is on the path
from jupyter_hpcdl.training import TrainingSession
from training_user_model import synthetic_model

VARIANTS = ("untuned", "autotuned")


def batch_timer(path: str):
    """Callbacks for ``setup``: rank 0 writes the time from its first batch's start to its last batch's end."""
    def callbacks(rank, size):
        import tensorflow as tf

        class Timer(tf.keras.callbacks.Callback):
            def on_train_batch_begin(self, batch, logs=None):
                if batch == 0:
                    self.t0 = time.perf_counter()

            def on_train_batch_end(self, batch, logs=None):
                self.t1 = time.perf_counter()

            def on_train_end(self, logs=None):
                Path(path).write_text(json.dumps({"seconds": self.t1 - self.t0}))

        return [Timer()] if rank == 0 else []
    return callbacks


def tune(autotuned: bool) -> None:
    """On a rank: the streams the session makes from arrays autotuned (TensorFlow's default) or not (the
    session's)."""
    import tensorflow as tf

    from jupyter_hpcdl.backends.horovod import rank_data

    if not hasattr(rank_data, "_untuned"):
        rank_data._untuned = rank_data.untuned
    rank_data.untuned = (lambda dataset=None: tf.data.Options()) if autotuned else rank_data._untuned


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--model", default="MobileNetV2")
    p.add_argument("--image-size", type=int, default=32)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--batches", type=int, default=45)
    args = p.parse_args()
    rng = np.random.default_rng(0)
    n = 2 * args.batches * args.batch_size
    x = rng.random((n, args.image_size, args.image_size, 3), dtype=np.float32)
    y = rng.integers(0, 1000, n)
    timer = Path(tempfile.mkdtemp(prefix="hpcdl-fit-end-")) / "batches.json"
    rows: dict[str, list[dict]] = {v: [] for v in VARIANTS}
    with TrainingSession(ranks=2, where="local", tf_threads=0, stall_timeout=600) as s:
        s.setup(synthetic_model(args.model, args.image_size), (x, y), batch_size=args.batch_size,
                callbacks=batch_timer(str(timer)), shuffle=False)
        s.fit(epochs=1)  # traced and warm
        for r in range(args.rounds):
            for variant in (VARIANTS if r % 2 == 0 else VARIANTS[::-1]):
                s.run(tune, variant == "autotuned")
                t0 = time.perf_counter()
                s.fit(epochs=1)
                call = time.perf_counter() - t0
                batches = json.loads(timer.read_text())["seconds"]
                rows[variant].append({"call_s": call, "batches_s": batches, "rest_s": call - batches})
                print(json.dumps({"round": r, "variant": variant, **{k: round(v, 3) for k, v in
                                                                     rows[variant][-1].items()}}), flush=True)
    summary = {v: {k: spread([row[k] for row in rows[v]]) for k in ("call_s", "batches_s", "rest_s")}
               for v in VARIANTS}
    summary["rests_over_1s"] = {v: sum(row["rest_s"] > 1.0 for row in rows[v]) for v in VARIANTS}
    summary["command"] = f"benchmarks/fit_end.py --rounds {args.rounds} --batches {args.batches}"
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
