"""A user's script run as ``python script.py args`` would, inside a rank (framework-free; runs on the ranks): each
backend wraps it in what joins the script to the session (callbacks, step hooks)."""
from __future__ import annotations

import os
import runpy
import sys
from dataclasses import dataclass

from .publication import TrainingStopped


@dataclass(frozen=True)
class ScriptEnd:
    """How the script ended: its exit code, and why the session stopped it (None if it ran to its end)."""

    exit_code: int
    stopped: str | None


def run_main(path: str, args: list[str], module: bool = False) -> ScriptEnd:
    """Run ``path`` as ``__main__`` with ``sys.argv = [path, *args]`` and its folder first on ``sys.path`` (or,
    with ``module``, the module of that name, as ``python -m`` would, the working directory first); both are
    restored after it."""
    argv, sys_path = sys.argv, list(sys.path)
    sys.argv = [path, *args]
    sys.path.insert(0, os.getcwd() if module else os.path.dirname(os.path.abspath(path)))
    code, stopped = 0, None
    try:
        if module:
            runpy.run_module(path, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(path, run_name="__main__")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if e.code is not None and not isinstance(e.code, int):
            print(e.code, file=sys.stderr)
    except TrainingStopped as e:
        stopped = str(e)
    finally:
        sys.argv, sys.path[:] = argv, sys_path
        sys.stdout.flush()
        sys.stderr.flush()
    return ScriptEnd(code, stopped)
