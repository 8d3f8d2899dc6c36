"""Text that a user wrote, made safe to show on a terminal or a page: control characters other than tab and newline
become ``\\xNN``, so that no escape sequence a user planted (clearing a screen, retitling a window, hiding or reordering a line)
reaches an admin's terminal or the hub's log as one."""
from __future__ import annotations

import re

#: The C0 controls but tab and newline, DEL, the C1 controls, and the marks that reorder or hide text (bidirectional
#: embeddings, overrides and isolates, zero-width marks, the line and paragraph separators).
CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\u200b-\u200f\u2028-\u202e\u2066-\u2069\ufeff]")


def escape_controls(text: str) -> str:
    return CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}" if ord(m.group()) < 0x100 else f"\\u{ord(m.group()):04x}",
                       text)
