"""Values that go into a batch job request, checked before they reach a script (pure): names (partition, account,
GPU type) and walltimes. Shared by the spawner's options and the training session's new allocations."""
from __future__ import annotations

import re

NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


def parse_walltime(value: str | int) -> int:
    """Minutes from ``D-HH:MM:SS``, ``HH:MM:SS``, ``HH:MM`` or a number of minutes; ValueError otherwise."""
    if isinstance(value, bool):
        raise ValueError("walltime must be HH:MM, HH:MM:SS, D-HH:MM:SS or minutes")
    if isinstance(value, int):
        minutes = value
    else:
        m = re.fullmatch(r"(?:(\d{1,2})-)?(\d{1,3}):(\d{2})(?::(\d{2}))?|(\d{1,5})", str(value).strip())
        if not m or (m.group(3) and int(m.group(3)) > 59) or (m.group(4) and int(m.group(4)) > 59):
            raise ValueError("walltime must be HH:MM, HH:MM:SS, D-HH:MM:SS or minutes")
        if m.group(5):
            minutes = int(m.group(5))
        else:
            minutes = int(m.group(1) or 0) * 1440 + int(m.group(2)) * 60 + int(m.group(3)) + (1 if int(m.group(4) or 0) else 0)
    if minutes < 1:
        raise ValueError("walltime must be at least one minute")
    return minutes


def format_walltime(minutes: int) -> str:
    return f"{minutes // 60:02d}:{minutes % 60:02d}:00"


def check_name(kind: str, value: str) -> str:
    """A partition, account or similar name as Slurm takes it; ValueError saying what is allowed otherwise."""
    if not isinstance(value, str) or not NAME.match(value):
        raise ValueError(f"{kind} {value!r} is not a valid name: letters, digits, '_', '.', '-' (at most 64)")
    return value


def gres_count(gres: str, kind: str = "gpu") -> int:
    """How many of ``kind`` a GRES string holds: ``gpu:4``, ``gpu:a100-sxm:2(S:0-1)``, ``gres/gpu:2`` (squeue),
    ``gres:gpu:0,tmpdisk:10``; 0 when there are none."""
    total = 0
    for item in (gres or "").split(","):
        parts = item.split("(")[0].strip().split(":")
        if parts[0] == "gres":
            parts = parts[1:]
        elif parts[0].startswith("gres/"):
            parts[0] = parts[0][len("gres/"):]
        if len(parts) > 1 and parts[0] == kind and parts[-1].isdigit():
            total += int(parts[-1])
    return total
