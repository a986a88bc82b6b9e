"""The console a command prints its data to: as wide as a terminal, and never 80 columns in a pipe.

rich lays out a console that is no terminal at 80 columns (or $COLUMNS), which folds or cuts
table cells: piped, `/v1/chat/completions` and `/v1/code/completions` both printed as `/v1/c…`.
So a pipe or file gets $COLUMNS when the user set it, else PIPED_WIDTH, wide enough that no
route name or reason is cut (tables keep their natural width; only longer lines stop wrapping).
"""

from __future__ import annotations

import os
from typing import IO, Any

from rich.console import Console
from rich.markup import escape

from kvtune.controls import escape_controls

PIPED_WIDTH = 10_000  # columns of a pipe or file without $COLUMNS: no cell is ever folded or cut


def output_console(file: IO[str] | None = None, **options: Any) -> Console:
    """A console on `file` (default stdout): a terminal's own width; else $COLUMNS, else PIPED_WIDTH."""
    console = Console(file=file, **options)
    if console.is_terminal or os.environ.get("COLUMNS", "").strip().isdigit():
        return console
    return Console(file=file, width=PIPED_WIDTH, **options)


def shown(text: object) -> str:
    """A string from a log (route, model id, path) as rich prints it: control characters escaped
    and `[` taken literally, so neither a terminal sequence nor rich markup in it takes effect."""
    return escape(escape_controls(str(text)))


__all__ = ["PIPED_WIDTH", "output_console", "shown"]
