"""Anything on every rank of a training session (runs in the kernel): a function, a notebook cell (what ``%%ranks``
runs), or an existing Horovod script, unchanged, whose ``model.fit`` streams its metrics like a session's fit (what
each rank does: the backend's ``run_script``)."""
from __future__ import annotations

import os
import time
from typing import Sequence

from .fitting import CallSettings, Fitting
from .rankworld import RankWorld
from .reporting import Reporter
from .results import ScriptFailed, ScriptResult


class EveryRank:
    """Calls, cells and scripts on ``ranks``; a script's training goes through ``fitting`` (its metrics, Stop,
    stalls, the walltime)."""

    def __init__(self, ranks: RankWorld, fitting: Fitting, reporter: Reporter):
        self.ranks, self.fitting, self.reporter = ranks, fitting, reporter

    def run(self, fn, *args, **kwargs) -> dict[int, object]:
        if not callable(fn):
            raise ValueError("run() takes a function (and its arguments) to call on every rank")
        return dict(zip(self.ranks.ranks, self.ranks.call(fn, *args, **kwargs)))

    def run_cell(self, code: str, timeout: float | None = None) -> dict[int, dict]:
        if not isinstance(code, str):
            raise ValueError("run_cell() takes the cell's code as a string")
        self.ranks.require("the cell")
        ar = self.ranks.view.execute(code, silent=False, block=False)
        self.ranks.get(ar, "the cell", timeout)
        ar.wait_for_output(timeout=5)  # output streams may trail the reply
        out = {}
        for i, r in enumerate(self.ranks.ranks):
            result = ar.execute_result[i] if ar.execute_result else None
            data = (result.get("data") if isinstance(result, dict) else getattr(result, "data", None)) or {}
            out[r] = {"stdout": ar.stdout[i], "stderr": ar.stderr[i], "result": data.get("text/plain")}
        return out

    def run_script(self, path: str, args: Sequence[str], on_metrics, echo: bool, first_batch_timeout: float | None,
                   poll: float, settings: CallSettings) -> ScriptResult:
        path = os.path.abspath(os.path.expanduser(path))
        if not os.path.isfile(path):
            raise ValueError(f"no script {path}: the ranks run it from the shared file system")
        if isinstance(args, str) or not all(isinstance(a, str) for a in args):
            raise ValueError("args must be a list of strings, as sys.argv[1:] of the script")
        self.ranks.require("the script")
        self.fitting.clear_stop()
        t0 = time.perf_counter()
        self.reporter.report("training")
        ar = self.ranks.view.apply_async(self.ranks.backend.run_script, path, list(args), self.fitting.stop_file)
        echoed: dict[int, int] = {}
        ranks = self.ranks.ranks

        def output(ar) -> bool:
            moved = False
            for i, r in enumerate(ranks):
                text = ar.stdout[i] if i < len(ar.stdout) else ""
                new, echoed[r] = text[echoed.get(r, 0):], len(text)
                if new:
                    moved = True
                    if echo:
                        print("".join(f"[rank {r}] {line}\n" for line in new.splitlines()), end="", flush=True)
            return moved

        name = f"the script {os.path.basename(path)}"
        drive = self.fitting.drive(ar, name, on_metrics, poll, 20, settings,
                                   first_batch_timeout or settings.call_timeout, output)
        results = self.ranks.results(ar, name)
        ar.wait_for_output(timeout=5)  # output streams may trail the reply
        output(ar)
        stopped = next((r["stopped"] for r in results if r["stopped"]), None)
        if stopped and drive.walltime_stop:
            stopped = f"stopped before the walltime ends ({drive.walltime_stop}): {stopped}"
        result = ScriptResult({r: res["exit_code"] for r, res in zip(ranks, results)},
                              dict(zip(ranks, ar.stdout)), dict(zip(ranks, ar.stderr)), stopped,
                              time.perf_counter() - t0)
        self.reporter.report("stopped" if stopped else "idle" if result.ok else "failed")
        if not result.ok:
            failed = ", ".join(f"rank {r}: exit code {c}" for r, c in result.exit_codes.items() if c)
            last = {r: result.stderr[r].strip().splitlines()[-1:] for r, c in result.exit_codes.items() if c}
            said = "; ".join(f"rank {r} said: {lines[0]}" for r, lines in last.items() if lines)
            raise ScriptFailed(f"{os.path.basename(path)} failed on {failed}" + (f" ({said})" if said else ""), result)
        return result
