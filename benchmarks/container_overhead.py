"""Container overhead, measured against native in the same run: native, the fast path (user namespaces, no
ptrace) and udocker's P1, in alternating rounds (containers at native speed).

1. Training throughput (images/s after a warm-up) of a small Keras CNN and of ``tf.keras.applications`` models
   (``--models``, weights=None, random inputs, small batch), each inside the container in both modes and on the
   host's Python environment: medians over rounds of mode/native.
2. Small-file I/O (``io_workload.py``: 2,000 files of 4 KiB written and read, a 64 MB checkpoint with fsync).
3. Start-up of one containerized command: ``hpcdl-containers run IMAGE -- python3 -c pass`` in each mode against
   ``python3 -c pass`` natively, and the same with ``/bin/true`` (the launch alone, without the command's own start).
4. One system call (``getppid``) in each: Debian's proot has no seccomp accelerator, so in P1 every system call
   stops in the tracer; the fast path has no tracer.

Run as a test-bed user whose udocker holds the image (the bed gives alice hpcdl/base:latest)::

    runuser -u alice -- /opt/jupyter-hpcdl/venv/bin/python benchmarks/container_overhead.py --rounds 3

Start-up alone, with more samples: ``--parts start --rounds 10 --start-samples 5``.
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

from jupyter_hpcdl.containers.site import DEFAULT_SITE_CONFIG, SITE_CONFIG_ENV

HERE = Path(__file__).resolve().parent
SYSCALLS = 20000
SYSCALL_PROBE = (f"import os, time; t = time.perf_counter()\nfor _ in range({SYSCALLS}): os.getppid()\n"
                 "print(time.perf_counter() - t)")
MODES = {"userns": "userns", "P1": "off"}  # mode -> the site's fast_path that gives it


def timed(argv: list[str], env: dict | None = None) -> tuple[float, str]:
    t0 = time.perf_counter()
    out = subprocess.run(argv, check=True, capture_output=True, text=True, env=env).stdout
    return time.perf_counter() - t0, out


def site_for(mode: str, work: Path) -> str:
    """A copy of the site's configuration with the fast path as ``mode`` needs it."""
    path = os.environ.get(SITE_CONFIG_ENV) or DEFAULT_SITE_CONFIG
    config = json.loads(Path(path).read_text()) if os.path.exists(path) else {}
    config.setdefault("ContainerSite", {})["fast_path"] = MODES[mode]
    out = work / f"site-{mode}.json"
    out.write_text(json.dumps(config))
    return str(out)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--image", default="hpcdl/base:latest")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--models", default="cnn:32:32,MobileNetV2:64:16,ResNet50:64:8",
                   help="model:image size:batch, comma-separated (cnn is the small CNN)")
    p.add_argument("--parts", default="train,io,start,syscall",
                   help="what to measure, comma-separated: train, io, start, syscall")
    p.add_argument("--start-samples", type=int, default=1,
                   help="start-ups timed per mode and round (their median is the round's figure)")
    p.add_argument("--out", help="also write the results as JSON here")
    args = p.parse_args()
    python = sys.executable
    work = Path(tempfile.mkdtemp(prefix="hpcdl-bench-", dir=os.path.expanduser("~")))  # the home is bound inside
    try:
        for name in ("cnn_workload.py", "io_workload.py"):
            shutil.copy(HERE / name, work)
        tool = str(Path(python).parent / "hpcdl-containers")
        prefix = {"native": [python], **{m: [tool, "--site", site_for(m, work), "run", args.image, "--", "python3"]
                                         for m in MODES}}
        for m in MODES:  # create the container, probe the node, and check each mode runs where it says
            said = timed(prefix[m] + ["-c", "import os; print(os.environ['HPCDL_CONTAINER_MODE'])"])[1].strip()
            if said != m:
                raise SystemExit(f"asked for {m}, the container ran in {said}: this node cannot run {m}")
        parts = set(args.parts.split(","))
        if parts - {"train", "io", "start", "syscall"}:
            raise SystemExit(f"unknown parts {sorted(parts - {'train', 'io', 'start', 'syscall'})}")
        models = [(m, int(s), int(b)) for m, s, b in (spec.split(":") for spec in args.models.split(","))] \
            if "train" in parts else []
        rows = []
        for r in range(args.rounds):
            order = ["native", *MODES][r % 3:] + ["native", *MODES][: r % 3]
            row: dict = {"round": r, "order": order}
            for model, size, batch in models:
                row[model] = {where: json.loads(timed(prefix[where] + [
                    str(work / "cnn_workload.py"), f"--steps={args.steps}", f"--model={model}",
                    f"--image-size={size}", f"--batch={batch}"])[1].strip().splitlines()[-1])["images_per_s"]
                    for where in order}
            if "io" in parts:
                row["io"] = {where: json.loads(timed(prefix[where] + [str(work / "io_workload.py"), str(work)])[1]
                                               .strip().splitlines()[-1]) for where in order}
            if "start" in parts:
                row["start_s"] = {where: statistics.median(
                    timed((prefix[where] if where != "native" else ["/usr/bin/python3"]) + ["-c", "pass"])[0]
                    for _ in range(args.start_samples)) for where in order}
                # the same start with a command that costs nothing itself: what the container's launch alone costs
                row["start_true_s"] = {where: statistics.median(
                    timed(([*prefix[where][:-1], "/bin/true"] if where != "native" else ["/bin/true"]))[0]
                    for _ in range(args.start_samples)) for where in order}
            if "syscall" in parts:
                row["syscall_us"] = {where: float(timed(prefix[where] + ["-c", SYSCALL_PROBE])[1].split()[-1])
                                     / SYSCALLS * 1e6 for where in order}
            rows.append(row)
            print(json.dumps(row), flush=True)
        med = statistics.median
        summary: dict = {"rounds": args.rounds, "steps": args.steps, "image": args.image}
        for model, _, _ in models:
            for m in MODES:
                summary[f"{model}_{m}_over_native"] = med(x[model][m] / x[model]["native"] for x in rows)
            summary[f"{model}_native_images_per_s"] = med(x[model]["native"] for x in rows)
        for m in MODES:
            if "io" in parts:
                for part in ("write_files_s", "read_files_s", "checkpoint_s"):
                    summary[f"io_{part}_{m}_over_native"] = med(x["io"][m][part] / x["io"]["native"][part]
                                                                for x in rows)
            if "start" in parts:
                summary[f"start_{m}_minus_native_s"] = med(x["start_s"][m] - x["start_s"]["native"] for x in rows)
                summary[f"start_true_{m}_minus_native_s"] = med(x["start_true_s"][m] - x["start_true_s"]["native"]
                                                                 for x in rows)
            if "syscall" in parts:
                summary[f"syscall_{m}_us"] = med(x["syscall_us"][m] for x in rows)
        if "syscall" in parts:
            summary["syscall_native_us"] = med(x["syscall_us"]["native"] for x in rows)
        if "start" in parts:
            summary["start_native_s"] = med(x["start_s"]["native"] for x in rows)
        print(json.dumps(summary, indent=2))
        if args.out:
            Path(args.out).write_text(json.dumps({"summary": summary, "rounds": rows}, indent=2) + "\n")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
