"""What the kernel spends on the ranks' live metrics, by simulation of the publication path (no ranks needed): N
ranks each publish every ``--interval`` s (a fit's ``publish_interval``, 0.1 s: the most a rank sends), each
publication repeating the rank's last 32 records (``OUTBOX_SIZE``), and the kernel reads every rank's latest
publication every ``--poll`` s (a fit's ``poll``) into the session's table, and every ``--refresh`` s draws what the
dashboard draws (the series of its three charts). Reported: the kernel's CPU seconds per second of training, for
the table alone and for the dashboard's draw, against a baseline in the same run: the table reading every record
of every publication (as before the tail read).

    /opt/jupyter-hpcdl/venv/bin/python benchmarks/metrics_scale.py --ranks 8,64,512 --rounds 5
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

from jupyter_hpcdl.dashboard.series import CHARTS, chart_series
from jupyter_hpcdl.training.metrics import MetricsTable
from jupyter_hpcdl.backends.publication import OUTBOX_SIZE


class ReadAll(MetricsTable):
    """The baseline: every record of every publication looked at (its seq compared), as before the tail read."""

    def add(self, records):
        flat = [r for rec in records if rec for r in (rec["records"] if "records" in rec else [rec])]
        return super().add(flat)


def simulate(table: MetricsTable, ranks: int, seconds: float, interval: float, poll: float, refresh: float,
             per_epoch: int = 100) -> dict:
    """Feed ``table`` as the kernel would over ``seconds`` of training; the CPU time of its reads and draws."""
    outbox: dict[int, list[dict]] = {r: [] for r in range(ranks)}
    seq = {r: 0 for r in range(ranks)}
    read_s = draw_s = 0.0
    next_draw = 0.0
    now = 0.0
    while now < seconds:
        now += poll
        for r in range(ranks):  # each rank published what its interval allows since the last read
            for _ in range(max(1, round(poll / interval))):
                seq[r] += 1
                record = {"rank": r, "epoch": 1 + seq[r] // per_epoch, "batch": seq[r] % per_epoch, "time": now,
                          "loss": 1.0 / seq[r], "step_time_s": 0.05, "samples_per_s": 640.0, "memory_mb": 900.0,
                          "seq": seq[r], "origin": f"node{r // 8}:{1000 + r}", "metrics": {"accuracy": 0.5}}
                outbox[r] = (outbox[r] + [record])[-OUTBOX_SIZE:]
        latest = [{"rank": r, "records": list(outbox[r])} for r in range(ranks)]
        t0 = time.process_time()
        table.add(latest)
        read_s += time.process_time() - t0
        if now >= next_draw:
            next_draw = now + refresh
            t0 = time.process_time()
            frame = table.frame()
            for column in CHARTS:
                chart_series(frame, column, per_epoch)
            draw_s += time.process_time() - t0
    return {"read_cpu_per_s": read_s / seconds, "draw_cpu_per_s": draw_s / seconds, "rows": len(table.frame())}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", default="8,64,512")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--seconds", type=float, default=30.0, help="simulated seconds of training per round")
    p.add_argument("--interval", type=float, default=0.1)
    p.add_argument("--poll", type=float, default=0.1)
    p.add_argument("--refresh", type=float, default=0.3)
    args = p.parse_args()
    out = {}
    for n in (int(x) for x in args.ranks.split(",")):
        rows = {"tail": [], "all": []}
        for i in range(args.rounds):  # alternating which goes first
            for kind in (("tail", "all") if i % 2 == 0 else ("all", "tail")):
                table = MetricsTable() if kind == "tail" else ReadAll()
                rows[kind].append(simulate(table, n, args.seconds, args.interval, args.poll, args.refresh))
        med = {k: {m: statistics.median(r[m] for r in v) for m in ("read_cpu_per_s", "draw_cpu_per_s")}
               for k, v in rows.items()}
        spread = {k: [round(min(r["read_cpu_per_s"] for r in v), 4), round(max(r["read_cpu_per_s"] for r in v), 4)]
                  for k, v in rows.items()}
        out[n] = {"read_cpu_per_s": {k: round(v["read_cpu_per_s"], 4) for k, v in med.items()},
                  "read_spread": spread,
                  "read_ratio_tail_over_all": round(med["tail"]["read_cpu_per_s"] / med["all"]["read_cpu_per_s"], 3),
                  "draw_cpu_per_s": round(med["tail"]["draw_cpu_per_s"], 4),
                  "records_per_s": round(n / args.interval), "rows_at_end": rows["tail"][0]["rows"]}
        print(json.dumps({n: out[n]}), flush=True)


if __name__ == "__main__":
    main()
