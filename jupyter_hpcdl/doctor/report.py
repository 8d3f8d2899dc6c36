"""Findings and how they are shown: to people (one line each, with what to do) and to scripts (JSON)."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Iterable, Sequence

from ..controls import escape_controls

OK, WARN, FAIL, SKIP = "ok", "warn", "fail", "skip"
_MARK = {OK: "ok  ", WARN: "WARN", FAIL: "FAIL", SKIP: "skip"}


@dataclass(frozen=True)
class Finding:
    """One check's verdict. ``where`` is "hub" or a node's name; ``fix`` says what to do (empty when ok)."""

    check: str
    status: str
    message: str
    fix: str = ""
    where: str = "hub"


def worst(findings: Iterable[Finding]) -> str:
    order = (SKIP, OK, WARN, FAIL)  # a skipped check does not make the whole report "skip"
    return max((f.status for f in findings), key=order.index, default=OK)


def exit_code(findings: Sequence[Finding]) -> int:
    """0 when nothing failed, 1 when something did (warnings alone are 0)."""
    return 1 if worst(findings) == FAIL else 0


def render_text(findings: Sequence[Finding]) -> str:
    """One line per finding (and its fix), for a terminal: what a node's probe or a user wrote is shown with its
    control characters escaped."""
    lines = []
    for f in findings:
        message = " / ".join(line.strip() for line in f.message.splitlines() if line.strip())
        lines.append(f"[{_MARK[f.status]}] {f.where:>6}  {f.check}: {message}")
        if f.fix and f.status in (FAIL, WARN):
            lines.append(f"{'':16}-> {f.fix}")
    failed = sum(f.status == FAIL for f in findings)
    warned = sum(f.status == WARN for f in findings)
    lines.append(f"{len(findings)} checks: {failed} failed, {warned} warnings" if failed or warned
                 else f"{len(findings)} checks: all passed")
    return escape_controls("\n".join(lines))


def render_json(findings: Sequence[Finding]) -> str:
    return json.dumps({"status": worst(findings), "findings": [asdict(f) for f in findings]}, indent=2)
