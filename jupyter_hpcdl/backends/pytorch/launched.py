"""One rank of ``hpcdl-launch`` for a ``torchrun`` script (runs on the ranks, in the user's container):
``python -m jupyter_hpcdl.backends.pytorch.launched script.py args`` (or ``-m module args``) joins the world that
the launcher's environment describes, through its private file store, then runs the script unchanged as
``__main__``: its ``init_process_group()`` is that world, as under ``torchrun`` without a TCP store that any user
of the node could reach. The exit code is the script's."""
from __future__ import annotations

import sys

from ..scriptrun import run_main
from . import dist
from .scripts import joined_world

USAGE = "usage: python -m jupyter_hpcdl.backends.pytorch.launched (SCRIPT | -m MODULE) [ARGS...]"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or (argv[0].startswith("-") and argv[0] != "-m") or argv[:1] == ["-m"] and len(argv) < 2:
        print(USAGE, file=sys.stderr)
        return 2
    module = argv[0] == "-m"
    target, args = (argv[1], argv[2:]) if module else (argv[0], argv[1:])
    dist.init()
    try:
        with joined_world():
            return run_main(target, args, module).exit_code
    finally:
        dist.shutdown()


if __name__ == "__main__":
    sys.exit(main())
