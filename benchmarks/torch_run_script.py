"""An unchanged ``torchrun`` script through ``TrainingSession(backend="torch").run_script`` against ``torchrun``
itself, on the same file in the same run: ``benchmarks/torch_synthetic.py`` (a small CNN, random images), images/s
after the warm-up as the script measures them. Rounds alternate which goes first; the ratio (session / torchrun) of
each round, its median and its spread are printed with the command. The session's ranks stay up between rounds (as
in a notebook); the session's step hook publishes step times and checks Stop every 20 steps. ``--profile`` adds
the same script on the session's ranks without that hook, to tell the hook's cost from the ranks' own.

    HOME=/tmp/benchhome python benchmarks/torch_run_script.py --rounds 5 [--profile]
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

from fit_profile import spread

from jupyter_hpcdl.training import TrainingSession

SCRIPT = Path(__file__).resolve().parent / "torch_synthetic.py"


def images_per_s(text: str) -> float:
    line = [line for line in text.splitlines() if '"images_per_s"' in line][-1]
    return json.loads(line[line.index("{"):])["images_per_s"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(ranks: int, script_args: list[str]) -> float:
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={ranks}",
                           "--master-addr=127.0.0.1", f"--master-port={free_port()}", str(SCRIPT), *script_args],
                          capture_output=True, text=True, timeout=900, check=True,
                          env={**os.environ, "GLOO_SOCKET_IFNAME": "lo"})
    return images_per_s(done.stdout)


def without_the_hook(path: str, args: list[str]) -> str:
    """On a rank: the script in the rank's world as ``run_script`` runs it, but without the session's step hook (no
    step publication, no Stop check); its output."""
    import contextlib
    import io

    from jupyter_hpcdl.backends.pytorch.scripts import joined_world
    from jupyter_hpcdl.backends.scriptrun import run_main

    out = io.StringIO()
    with joined_world(), contextlib.redirect_stdout(out):
        end = run_main(path, args)
    if end.exit_code:
        raise RuntimeError(f"the script exited with {end.exit_code}")
    return out.getvalue()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--profile", action="store_true",
                   help="also the script on the session's ranks without the step hook (three variants in turn)")
    args = p.parse_args()
    script_args = ["--steps", str(args.steps)]
    rows = []
    with TrainingSession(ranks=args.ranks, where="local", backend="torch") as session:
        variants = {
            "session": lambda: images_per_s(session.run_script(str(SCRIPT), script_args, echo=False).stdout[0]),
            "torchrun": lambda: torchrun(args.ranks, script_args),
        }
        if args.profile:
            variants["no_hook"] = lambda: images_per_s(session.run(without_the_hook, str(SCRIPT), script_args)[0])
        names = list(variants)
        for r in range(args.rounds):
            order = names[r % len(names):] + names[:r % len(names)]  # each variant goes first in turn
            row: dict = {"round": r, "order": order}
            for name in order:
                row[name] = variants[name]()
            row["ratio"] = row["session"] / row["torchrun"]
            if args.profile:
                row["no_hook_ratio"] = row["no_hook"] / row["torchrun"]
                row["hook_cost"] = row["session"] / row["no_hook"]
            rows.append(row)
            print(json.dumps(row), flush=True)
    summary = {"command": " ".join(sys.argv), "ranks": args.ranks, "ratio": spread([row["ratio"] for row in rows])}
    if args.profile:
        summary["no_hook_ratio"] = spread([row["no_hook_ratio"] for row in rows])
        summary["hook_cost"] = spread([row["hook_cost"] for row in rows])
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
