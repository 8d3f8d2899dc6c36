"""The attendee list: one user name per line; blank lines and ``#`` comments are ignored."""
from __future__ import annotations

import pwd

from jupyter_hpcdl.jobvalues import NAME


def parse_attendees(text: str) -> list[str]:
    """The names in ``text``, in order, each once; ValueError naming the line of anything that is not a user name."""
    names: list[str] = []
    for number, line in enumerate(text.splitlines(), 1):
        name = line.split("#", 1)[0].strip()
        if not name:
            continue
        if not NAME.match(name):
            raise ValueError(f"line {number}: {name[:40]!r} is not a user name (letters, digits, _.-)")
        if name not in names:
            names.append(name)
    if not names:
        raise ValueError("the attendee list names nobody")
    return names


def check_accounts(names: list[str]) -> list[str]:
    """The names that have no account on this machine (the hub's users are Unix users)."""
    missing = []
    for name in names:
        try:
            pwd.getpwnam(name)
        except KeyError:
            missing.append(name)
    return missing
