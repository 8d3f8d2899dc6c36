"""Container overhead, measured against native in the same run (issue: foundation).

1. Training throughput of a small Keras CNN (cnn_workload.py) inside the udocker container (P1) against the same
   program on the host's Python environment: the median over alternating rounds of container/native images/s.
2. Start-up cost of one containerized command: wall time of ``hpcdl-containers run IMAGE -- python3 -c pass`` and of
   plain ``udocker run`` against ``python3 -c pass`` natively, medians over alternating rounds.
3. The cost of one system call (``getppid``) inside and outside: Debian's proot is built without its seccomp
   accelerator, so every system call of a containerized process stops in the tracer; this explains (1).

Run as a test-bed user whose udocker holds the image (the bed gives alice hpcdl/base:latest)::

    runuser -u alice -- /opt/jupyter-hpcdl/venv/bin/python benchmarks/container_overhead.py --rounds 5
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

from jupyter_hpcdl.containers.site import load_site
from jupyter_hpcdl.containers.spec import RunSpec, build_run_command

HERE = Path(__file__).resolve().parent
SYSCALLS = 20000
SYSCALL_PROBE = (f"import os, time; t = time.perf_counter()\nfor _ in range({SYSCALLS}): os.getppid()\n"
                 "print(time.perf_counter() - t)")


def timed(argv: list[str], env: dict | None = None) -> tuple[float, str]:
    t0 = time.perf_counter()
    out = subprocess.run(argv, check=True, capture_output=True, text=True, env=env).stdout
    return time.perf_counter() - t0, out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--image", default="hpcdl/base:latest")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--out", help="also write the results as JSON here")
    args = p.parse_args()

    site = load_site()
    ud = site.client()
    container = ud.ensure_container(args.image)
    python = sys.executable
    work = Path(tempfile.mkdtemp(prefix="hpcdl-bench-", dir=os.path.expanduser("~")))  # the home is bound inside
    try:
        shutil.copy(HERE / "cnn_workload.py", work)
        workload = ["python3", str(work / "cnn_workload.py"), f"--steps={args.steps}"]
        in_container = [str(Path(python).parent / "hpcdl-containers"), "run", args.image, "--"]
        plain_udocker = build_run_command(RunSpec(container, ["python3", "-c", "pass"]), site.install())
        rows = []
        for r in range(args.rounds):
            order = ("native", "container") if r % 2 == 0 else ("container", "native")
            result = {}
            for where in order:
                argv = ([python, *workload[1:]] if where == "native" else in_container + workload)
                _, out = timed(argv)
                result[where] = json.loads(out.strip().splitlines()[-1])["images_per_s"]
            start = {}
            for where in order:
                if where == "native":
                    start["native"], _ = timed(["/usr/bin/python3", "-c", "pass"])
                else:
                    start["hpcdl-containers"], _ = timed(in_container + ["python3", "-c", "pass"])
                    start["udocker"], _ = timed(plain_udocker, ud.env())
            syscall = {}
            for where in order:
                argv = ([python, "-c", SYSCALL_PROBE] if where == "native" else in_container + ["python3", "-c", SYSCALL_PROBE])
                syscall[where] = float(timed(argv)[1].split()[-1]) / SYSCALLS * 1e6
            rows.append({"round": r, "order": order, "images_per_s": result, "start_s": start, "syscall_us": syscall,
                         "throughput_ratio": result["container"] / result["native"]})
            print(json.dumps(rows[-1]), flush=True)
        med = lambda xs: statistics.median(xs)  # noqa: E731
        summary = {
            "rounds": args.rounds, "steps": args.steps, "image": args.image,
            "native_images_per_s": med([x["images_per_s"]["native"] for x in rows]),
            "container_images_per_s": med([x["images_per_s"]["container"] for x in rows]),
            "throughput_ratio_container_over_native": med([x["throughput_ratio"] for x in rows]),
            "start_native_s": med([x["start_s"]["native"] for x in rows]),
            "start_udocker_s": med([x["start_s"]["udocker"] for x in rows]),
            "start_hpcdl_containers_s": med([x["start_s"]["hpcdl-containers"] for x in rows]),
            "syscall_native_us": med([x["syscall_us"]["native"] for x in rows]),
            "syscall_container_us": med([x["syscall_us"]["container"] for x in rows]),
        }
        print(json.dumps(summary, indent=2))
        if args.out:
            Path(args.out).write_text(json.dumps({"summary": summary, "rounds": rows}, indent=2) + "\n")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
