"""The batch commands of a kernel without a scheduler client (inside its container): ipyparallel's batch launcher
calls ``python -m jupyter_hpcdl.job.client submit FILE`` and ``... cancel JOBID`` in place of the scheduler's, and
the allocation's owner on the host runs them."""
from __future__ import annotations

import os
import sys

from .owner import SOCKET_ENV, request

SUBMIT = [sys.executable, "-m", "jupyter_hpcdl.job.client", "submit"]
CANCEL = [sys.executable, "-m", "jupyter_hpcdl.job.client", "cancel"]


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    socket_path = os.environ.get(SOCKET_ENV)
    if len(args) != 2 or args[0] not in ("submit", "cancel") or not socket_path:
        print("usage: python -m jupyter_hpcdl.job.client submit FILE | cancel JOBID (inside a jupyter-hpcdl job)",
              file=sys.stderr)
        return 2
    try:
        if args[0] == "submit":
            print(request(socket_path, "POST", "/jobs", {"batch_file": os.path.abspath(args[1])})["output"])
        else:
            if not args[1].isdigit():
                raise RuntimeError(f"{args[1]!r} is not a job id")
            request(socket_path, "DELETE", f"/jobs/{args[1]}")
    except (OSError, RuntimeError) as e:
        print(f"jobclient: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
