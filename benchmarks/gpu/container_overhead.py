"""GPU work in the user's container against native, in the same run: the CUDA probe's ``bench`` (a kernel launch and
a wait for it, allocation and release, host<->device copies from pageable memory, an FMA-bound kernel) natively, on
the fast path and in P1, in rounds that rotate the order. Reports the medians of per-round ratios (speed against
native: above 1 is faster) and each mode's medians.

On the bed's GPU node (as a user whose udocker may be a fresh one: a repository of its own is made under /tmp)::

    /opt/jupyter-hpcdl/venv/bin/python benchmarks/gpu/container_overhead.py --rounds 5

On a lent GPU machine without the bed, ``benchmarks/gpu/device_check.sh`` runs it with the kit's variables set.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "testbed"))
from gpukit import IMAGE, MODES, find_kit, client, last_json, probe_spec  # noqa: E402

RATES = ("h2d_gb_s", "d2h_gb_s", "fma_tflop_s")  # higher is faster
TIMES = ("launch_sync_us", "malloc_free_us")  # lower is faster
SITE_FAST_PATH = {mode: fast_path for fast_path, mode in MODES.items()}  # the mode -> the site setting that gives it


def run_native(probe: str) -> dict:
    return last_json(subprocess.run([probe, "bench"], capture_output=True, text=True, check=True, timeout=600).stdout)


def speed_against(native: dict, other: dict) -> dict[str, float]:
    """Each figure of ``other`` as a speed relative to native (1.0 = native; above 1 = faster)."""
    out = {k: other[k] / native[k] for k in RATES}
    out.update({k: native[k] / other[k] for k in TIMES})
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--modes", default="userns,P1")
    p.add_argument("--out", help="write every round's figures here as JSON")
    args = p.parse_args()
    modes = [m for m in args.modes.split(",") if m]
    with tempfile.TemporaryDirectory(prefix="hpcdl-gpu-bench-", dir="/tmp") as work:
        kit = find_kit(work)
        containers = {}
        for mode in modes:
            ud = client(kit, Path(work) / f"repo-{mode}", SITE_FAST_PATH[mode])
            ud.import_tarball(kit.rootfs, IMAGE)
            name = ud.ensure_container(IMAGE)
            assert ud.mode_for(name).mode == mode, (mode, ud.mode_for(name))
            containers[mode] = (ud, name)
        rounds = []
        order = ["native", *modes]
        for i in range(args.rounds):
            figures = {}
            for who in order[i % len(order):] + order[:i % len(order)]:
                if who == "native":
                    figures[who] = run_native(kit.probe)
                else:
                    ud, name = containers[who]
                    r = ud.run(probe_spec(name, kit, "bench"), timeout=600)
                    figures[who] = last_json(r.stdout)
                assert figures[who].get("ok"), (who, figures[who])
            rounds.append(figures)
            print(json.dumps({"round": i + 1, **figures}), flush=True)
    summary = {"rounds": len(rounds), "medians": {}, "speed_vs_native": {}}
    for who in ["native", *modes]:
        summary["medians"][who] = {k: statistics.median(r[who][k] for r in rounds) for k in RATES + TIMES}
    for mode in modes:
        ratios = [speed_against(r["native"], r[mode]) for r in rounds]
        summary["speed_vs_native"][mode] = {k: {"median": round(statistics.median(x[k] for x in ratios), 3),
                                                "rounds": [round(x[k], 3) for x in ratios]} for k in RATES + TIMES}
    for mode, figures in summary["speed_vs_native"].items():
        for k, v in figures.items():
            print(f"{mode:>6} {k:<15} {v['median']:6.3f} of native (rounds {', '.join(map(str, v['rounds']))}); "
                  f"native {summary['medians']['native'][k]:.2f}, {mode} {summary['medians'][mode][k]:.2f}")
    if args.out:
        Path(args.out).write_text(json.dumps({"rounds": rounds, **summary}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
