"""The job's secrets in a file only its user can read, for batch systems that show a job's environment to every
user (Grid Engine's ``qstat -j``): the hub writes it as the user (values on stdin, never on a command line), and the
job's side reads it once and removes it."""
from __future__ import annotations

import json
import os
import sys

from jupyter_hpcdl.atomic import write_json


def env_file_path(home: str, server_name: str = "") -> str:
    return os.path.join(home, ".jupyter-hpcdl", "jobs", f"env-{server_name or 'default'}.json")


def load(path: str) -> dict[str, str]:
    """The variables in ``path``, which is then removed (one job, one reading)."""
    with open(path) as f:
        values = json.load(f)
    os.unlink(path)
    if not isinstance(values, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in values.items()):
        raise ValueError(f"{path}: not an object of strings")
    return values


def main(argv: list[str] | None = None) -> int:
    """``python -m jupyter_hpcdl.spawner.envfile PATH`` (as the user): the JSON object on stdin, written 0600."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m jupyter_hpcdl.spawner.envfile PATH  (a JSON object of strings on stdin)", file=sys.stderr)
        return 2
    old = os.umask(0o077)
    try:
        write_json(args[0], json.load(sys.stdin))  # mkstemp's file is 0600; the rename keeps it
    finally:
        os.umask(old)
    return 0


if __name__ == "__main__":
    sys.exit(main())
