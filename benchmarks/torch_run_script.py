"""An unchanged ``torchrun`` script through ``TrainingSession(backend="torch").run_script`` against ``torchrun``
itself, on the same file in the same run: ``benchmarks/torch_synthetic.py`` (a small CNN, random images), images/s
after the warm-up as the script measures them. Rounds alternate which goes first; the ratio (session / torchrun) of
each round, its median and its spread are printed with the command. The session's ranks stay up between rounds (as
in a notebook); the session's step hook publishes step times and checks Stop every 20 steps.

    HOME=/tmp/benchhome python benchmarks/torch_run_script.py --rounds 5
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


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--steps", type=int, default=60)
    args = p.parse_args()
    script_args = ["--steps", str(args.steps)]
    rows = []
    with TrainingSession(ranks=args.ranks, where="local", backend="torch") as session:
        for r in range(args.rounds):
            def through_session() -> float:
                return images_per_s(session.run_script(str(SCRIPT), script_args, echo=False).stdout[0])

            first, second = (through_session, lambda: torchrun(args.ranks, script_args))[::1 if r % 2 else -1]
            a, b = first(), second()
            ours, theirs = (a, b) if first is through_session else (b, a)
            rows.append({"round": r, "session": ours, "torchrun": theirs, "ratio": ours / theirs})
            print(json.dumps(rows[-1]), flush=True)
    print(json.dumps({"command": " ".join(sys.argv), "ranks": args.ranks,
                      "ratio": spread([row["ratio"] for row in rows])}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
