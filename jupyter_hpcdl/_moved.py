"""Module names from before the job's side moved into :mod:`jupyter_hpcdl.job` (and batch runs into
:mod:`jupyter_hpcdl.training`). Each old name *is* the new module, so user code and job scripts written before the
move (a job queued across an upgrade runs ``python -m jupyter_hpcdl.tasks``) keep working."""
from __future__ import annotations

import importlib
import runpy
import sys


def alias(old: str, new: str) -> None:
    """Make module ``old`` the module ``new``; run ``new`` as the program where ``old`` was run with ``-m``."""
    if old == "__main__":
        runpy.run_module(new, run_name="__main__", alter_sys=True)
    else:
        sys.modules[old] = importlib.import_module(new)
