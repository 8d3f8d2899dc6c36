"""Copy the workshop's material into an attendee's home, run as the attendee: files that are not there yet are
copied; files the attendee already has are kept as they are (their edits survive a second prepare, as with
nbgitpuller). Prints one JSON line: what was copied and what was kept.

    python -m jupyter_hpcdl.workshop.place SOURCE DEST
"""
from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path


def place(source: Path, dest: Path) -> dict[str, list[str]]:
    copied, kept = [], []
    for path in sorted(source.rglob("*")):
        if any(part.startswith(".") for part in path.relative_to(source).parts):
            continue  # checkpoints and caches of the instructor's copy
        target = dest / path.relative_to(source)
        if path.is_dir():
            target.mkdir(parents=True, exist_ok=True)
        elif target.exists():
            kept.append(str(target.relative_to(dest)))
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, target)
            copied.append(str(target.relative_to(dest)))
    return {"copied": copied, "kept": kept}


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print(__doc__.split("\n\n")[1].strip(), file=sys.stderr)
        return 2
    source, dest = Path(args[0]), Path(os.path.expanduser(args[1]))
    if not source.is_dir():
        print(f"place: {source} is not a directory this user can read", file=sys.stderr)
        return 2
    print(json.dumps(place(source, dest)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
