"""The last lines of a file in a user's home, for the hub to show (a failed job's log): run as that user through
the hub's ``exec_prefix``, never with the hub's rights. Only a regular file is read, opened without following a link
in its last component and without blocking (a FIFO or a device is refused, not read), at most ``max_bytes`` from
its end, in any encoding (invalid bytes are replaced), with control characters other than tab and newline shown
escaped so that nothing the user wrote reaches a terminal or a page as a control sequence."""
from __future__ import annotations

import argparse
import errno
import os
import stat
import sys

from jupyter_hpcdl.controls import escape_controls


class NotShown(Exception):
    """The file is not one the hub shows: a link, not a regular file, or not readable by its user."""


def tail(path: str, lines: int = 20, max_bytes: int = 65536) -> str:
    """The last ``lines`` lines of the regular file ``path``, from at most its last ``max_bytes`` bytes (a missing
    file raises FileNotFoundError; one not shown, NotShown)."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise
    except OSError as e:
        raise NotShown(f"{path}: {'a symbolic link' if e.errno == errno.ELOOP else e.strerror}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise NotShown(f"{path}: not a regular file")
        start = max(0, info.st_size - max_bytes)
        data = os.pread(fd, max_bytes + (1 if start else 0), start - 1 if start else 0)
    finally:
        os.close(fd)
    if start:  # the byte before the part read says whether its first line is whole
        data = data[1:] if data[:1] == b"\n" else data[data.find(b"\n") + 1:] if b"\n" in data else b""
    parts = data.decode("utf-8", errors="replace").split("\n")  # only newlines end lines: what is shown is what was read
    kept = [line + "\n" for line in parts[:-1]] + ([parts[-1]] if parts[-1] else [])
    return escape_controls("".join(kept[-lines:] if lines > 0 else []))


def main(argv: list[str] | None = None) -> int:
    """``python -m jupyter_hpcdl.spawner.usertail [--lines N] [--max-bytes B] PATH``, as the user: the tail on stdout;
    a missing file prints nothing; a file not shown exits 3 with the reason on stderr."""
    parser = argparse.ArgumentParser(prog="python -m jupyter_hpcdl.spawner.usertail", description=__doc__)
    parser.add_argument("--lines", type=int, default=20)
    parser.add_argument("--max-bytes", type=int, default=65536)
    parser.add_argument("path")
    args = parser.parse_args(argv)
    try:
        sys.stdout.write(tail(args.path, args.lines, args.max_bytes))
    except FileNotFoundError:  # the job ended before writing it
        pass
    except NotShown as e:
        print(e, file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
