"""Text that a user wrote, made safe to show on a terminal or a page: control characters other than tab and newline
become ``\\xNN``, so that no escape sequence a user planted (clearing a screen, retitling a window, hiding a line)
reaches an admin's terminal or the hub's log as one."""
from __future__ import annotations

import re

#: The C0 controls but tab and newline, DEL, and the C1 controls.
CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def escape_controls(text: str) -> str:
    return CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text)
