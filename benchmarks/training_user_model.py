"""A researcher's own Keras work through the session, measured against horovodrun in the same run (the
user's own model, data and scripts).

1. Throughput: Horovod's synthetic Keras benchmark (``benchmarks/keras_synthetic.py``: a tf.keras.applications
   model, ``weights=None``, random inputs) under ``horovodrun --gloo`` against the same file, unchanged, through
   ``TrainingSession.run_script`` (the session's callbacks streaming its metrics live, the agreed stop check every
   20 batches), alternating rounds: images/s after the warm-up batches, as the script itself measures them.
2. The same model compiled by the user and trained by ``session.setup(...)``/``fit`` (the session's own data
   stream), its second fit: images/s after the same warm-up batches, timed by a callback on rank 0 as the script
   times them, and over the whole call of ``fit()`` (round trip and the weights check included); meanwhile, the CPU
   that the kernel and the session's other processes (controller, nannies) use beside the ranks.
3. Rank-to-kernel metric latency with ``--latency-ranks`` local ranks (default 8): publication on the rank to
   arrival in the session's table, p50/p95 (target p95 <= 100 ms).

    runuser -u alice -- /opt/jupyter-hpcdl/venv/bin/python benchmarks/training_user_model.py --rounds 3
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
from fit_profile import spread  # this folder is on the path
from jupyter_hpcdl.training import TrainingSession

SCRIPT = Path(__file__).resolve().parent / "keras_synthetic.py"


def horovodrun(ranks: int, script_args: list[str]) -> float:
    venv_bin = Path(sys.executable).parent
    out = subprocess.run([str(venv_bin / "horovodrun"), "--gloo", "-np", str(ranks), "-H", f"localhost:{ranks}",
                          sys.executable, str(SCRIPT), *script_args], capture_output=True, text=True, check=True,
                         timeout=900, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2",
                                           "PATH": f"{venv_bin}:{os.environ.get('PATH', '')}"}).stdout
    line = [line for line in out.splitlines() if '"images_per_s"' in line][-1]  # "[0]<stdout>:{...}"
    return json.loads(line[line.index("{"):])["images_per_s"]


def through_run_script(session: TrainingSession, script_args: list[str]) -> float:
    result = session.run_script(str(SCRIPT), script_args, echo=False)
    line = [line for line in result.stdout[0].splitlines() if '"images_per_s"' in line][-1]
    return json.loads(line)["images_per_s"]


def synthetic_model(name: str, size: int):
    def build():
        import tensorflow as tf
        model = getattr(tf.keras.applications, name)(weights=None, input_shape=(size, size, 3), classes=1000)
        model.compile(optimizer=tf.keras.optimizers.SGD(0.01), loss=tf.keras.losses.SparseCategoricalCrossentropy())
        return model
    return build


def synthetic_data(batch: int, size: int):
    def data(rank, world):
        import tensorflow as tf
        images = tf.random.uniform([batch, size, size, 3])
        labels = tf.random.uniform([batch], maxval=1000, dtype=tf.int64)
        return tf.data.Dataset.from_tensors((images, labels)).repeat()
    return data


def steady_timer(path: str, warmup: int):
    """Callbacks for ``setup``: on rank 0, a timer of the batches after ``warmup``, as keras_synthetic.py's own
    (its figures written to ``path`` at the end of each fit)."""
    def callbacks(rank, size):
        import tensorflow as tf

        class Timer(tf.keras.callbacks.Callback):
            def on_train_batch_end(self, batch, logs=None):
                if batch == warmup - 1:
                    self.t0 = time.perf_counter()
                self.t1 = time.perf_counter()

            def on_train_end(self, logs=None):
                Path(path).write_text(json.dumps({"seconds": self.t1 - self.t0}))

        return [Timer()] if rank == 0 else []
    return callbacks


@dataclass
class FitFigures:
    """Images/s of a fit in its steady state and over its whole call; CPU beside the ranks (:class:`Beside`)."""
    steady: float
    whole: float
    kernel_cpu: float
    others_cpu: float


class Beside:
    """The CPU that the session's processes other than its ranks use while they train, as a share of one core: the
    kernel (this process: the fit's call, the metrics' collection) and the others on this machine (ipyparallel's
    controller, the engines' nannies, the reaper)."""

    def __init__(self, session: TrainingSession):
        ranks = {int(w["pid"]) for w in session.world}
        kernel = psutil.Process()
        self.processes = [kernel] + [p for p in kernel.children(recursive=True) if p.pid not in ranks]
        self.t0, self.cpu0 = time.perf_counter(), self.cpu()

    def cpu(self) -> dict[int, float]:
        """Each process's CPU seconds so far, by pid; one that has ended is left out."""
        used = {}
        for p in self.processes:
            try:
                used[p.pid] = sum(p.cpu_times()[:2])
            except psutil.Error:
                pass
        return used

    def shares(self) -> tuple[float, float]:
        """The kernel's share of a core since the start, and the others' together (those up at both ends)."""
        seconds, cpu = time.perf_counter() - self.t0, self.cpu()
        grew = {pid: cpu[pid] - self.cpu0[pid] for pid in cpu.keys() & self.cpu0.keys()}
        kernel = self.processes[0].pid
        return grew.get(kernel, 0.0) / seconds, sum(v for pid, v in grew.items() if pid != kernel) / seconds


def through_fit(session: TrainingSession, args, timer_path: str) -> FitFigures:
    """Images/s of the user's compiled model through ``setup()``/``fit()``: in the steady state (the batches after
    the warm-up, timed on rank 0 as the script times them) and over the whole call of ``fit()``."""
    warmup = 5
    session.setup(synthetic_model(args.model, args.image_size), synthetic_data(args.batch_size, args.image_size),
                  batch_size=args.batch_size, steps_per_epoch=warmup + args.batches, scale_lr=True,
                  callbacks=steady_timer(timer_path, warmup))
    session.fit(epochs=1)  # warm-up: tracing, the first broadcast
    beside = Beside(session)
    result = session.fit(epochs=1)  # the same model again, not rebuilt
    images = args.batches * args.batch_size * session.ranks
    steady = images / json.loads(Path(timer_path).read_text())["seconds"]
    return FitFigures(steady, (images + warmup * args.batch_size * session.ranks) / result.seconds, *beside.shares())


def latency(ranks: int, poll: float) -> dict:
    import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    # more ranks than cores trace the model's first batch slowly: latency is measured here, not that deadline
    with TrainingSession(ranks=ranks, where="local", stall_timeout=600) as s:
        s.setup(synthetic_model("MobileNetV2", 32), synthetic_data(4, 32), batch_size=4, steps_per_epoch=40)
        s.fit(epochs=1, poll=poll)
        s.fit(epochs=1, poll=poll)
        lat = (s.metrics["arrived"] - s.metrics["time"]).dropna()
    return {"ranks": ranks, "records": len(lat), "p50_ms": float(lat.quantile(0.5) * 1000),
            "p95_ms": float(lat.quantile(0.95) * 1000)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--model", default="MobileNetV2")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--image-size", type=int, default=64)
    p.add_argument("--batches", type=int, default=30)
    p.add_argument("--latency-ranks", type=int, default=8)
    p.add_argument("--poll", type=float, default=0.05)
    args = p.parse_args()
    import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    script_args = ["--model", args.model, "--batch-size", str(args.batch_size), "--image-size",
                   str(args.image_size), "--batches", str(args.batches)]
    timer_path = os.path.join(tempfile.mkdtemp(prefix="hpcdl-bench-"), "fit_timer.json")
    rows = []
    for r in range(args.rounds):
        row: dict = {}
        order = ("horovodrun", "session") if r % 2 == 0 else ("session", "horovodrun")
        for which in order:
            if which == "horovodrun":
                row["horovodrun"] = horovodrun(args.ranks, script_args)
            else:  # TF's own thread defaults, as under horovodrun
                with TrainingSession(ranks=args.ranks, where="local", tf_threads=0) as s:
                    row["run_script"] = through_run_script(s, script_args)
                    fit = through_fit(s, args, timer_path)
                    row.update(fit=fit.steady, fit_whole=fit.whole, kernel_cpu=fit.kernel_cpu,
                               others_cpu=fit.others_cpu)
        row["ratio_run_script"] = row["run_script"] / row["horovodrun"]
        row["ratio_fit"] = row["fit"] / row["horovodrun"]
        row["ratio_fit_whole"] = row["fit_whole"] / row["horovodrun"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    lat = latency(args.latency_ranks, args.poll) if args.latency_ranks else None
    summary = {"model": args.model, "ranks": args.ranks, "batch_size": args.batch_size, "image_size": args.image_size,
               "rounds": args.rounds, "metric_latency": lat, "when": time.strftime("%Y-%m-%d %H:%M")}
    if rows:  # --rounds 0: the latency alone
        summary.update({f"{k}_images_per_s": spread([r[k] for r in rows]) for k in ("horovodrun", "run_script", "fit")})
        summary.update({f"{k}_over_horovodrun": spread([r[k] for r in rows])
                        for k in ("ratio_run_script", "ratio_fit", "ratio_fit_whole")})
        summary.update({f"{k}_share_of_a_core": spread([r[k] for r in rows]) for k in ("kernel_cpu", "others_cpu")})
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
