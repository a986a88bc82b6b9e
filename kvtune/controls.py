"""Control characters from logs made visible: the one way a logged string reaches a terminal.

A route, a model id or a path comes from a log file someone else wrote. Printed raw, an ESC
sequence in it clears the screen or retitles the terminal (`\\x1b[2J`, `\\x1b]0;…\\x07`), a `\\r`
overprints the line before it, and a bidi override (`\\u202e`) shows text reversed. Every human
output — tables, stderr lines, error lines, report.md and report.html — shows such a character
as its Python escape (`\\x1b`, `\\u202e`) instead. JSON output keeps the exact string: JSON
escapes the C0 controls itself, and a machine reading it wants the bytes the log holds.
"""

from __future__ import annotations

import re

#: C0 controls, DEL, C1 controls, the bidi embeddings, overrides, isolates and marks, and the
#: Unicode line and paragraph separators: the characters that move the cursor, start a terminal
#: command or reorder what follows them.
CONTROLS = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069]")


def _escape(match: re.Match[str]) -> str:
    code = ord(match.group(0))
    return f"\\x{code:02x}" if code <= 0xFF else f"\\u{code:04x}"


def escape_controls(text: str) -> str:
    """`text` with each control character written as its escape (`\\x1b`, `\\r`→`\\x0d`, `\\u202e`)."""
    return CONTROLS.sub(_escape, text)


__all__ = ["CONTROLS", "escape_controls"]
