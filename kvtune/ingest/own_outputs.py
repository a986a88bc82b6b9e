"""Files kvtune itself writes, told apart from logs by their content, so that a recommendation.json
written by `recommend --out` into a log directory is skipped with a note instead of aborting the run.

Judged by the first record of the file, not by its name: every JSON file kvtune writes carries a
marker of its own (the `kvtune_version` key of a recommendation, a bench or simulate report; the
`kind: kvtune-profile` of a saved profile; the measured-capacity keys of a `calibrate` file; the
per-request keys of bench's --requests-log). No log schema kvtune reads carries any of them.
The rendered deploy files (gateway.yaml, nginx.conf, the launch scripts, report.md and .html) are
not log-like names, but a glob (`logs/*`) or a file argument reaches them: their first lines say
who rendered them (`kvtune_text_output`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

# The keys that make a record one of kvtune's outputs, most specific first: (keys, what it is).
_KEY_MARKERS: tuple[tuple[frozenset[str], str], ...] = (
    (frozenset({"kvtune_version", "block_budget", "routes"}), "written by kvtune recommend --out"),
    (frozenset({"source", "kv_cache_tokens", "num_blocks", "block_size"}), "written by kvtune calibrate"),
    (frozenset({"index", "start_ms", "outcome", "attempts", "prompt_tokens_requested"}),
     "written by kvtune bench --requests-log"),
    (frozenset({"kvtune_version"}), "a kvtune report (kvtune_version)"),
)
_PROFILE_KIND = "kvtune-profile"  # kvtune.profile.routes.PROFILE_KIND (ingest does not import profile)


def kvtune_output(sample: list[Any]) -> str | None:
    """What kvtune output a file is, from its first sampled record (None: not one of kvtune's)."""
    first = sample[0] if sample else None
    if not isinstance(first, Mapping):
        return None
    if first.get("kind") == _PROFILE_KIND:
        return "written by kvtune profile --save"
    keys = set(first)
    return next((what for marker, what in _KEY_MARKERS if marker <= keys), None)


# A comment line among the first few that says kvtune rendered the file (gateway.yaml, nginx.conf,
# the engines' launch scripts and YAML, report.md), or report.html's title.
_RENDERED = re.compile(rb"^#.*\b(rendered by kvtune|kvtune recommendation:)", re.IGNORECASE)
_HTML_TITLE = re.compile(rb"<title>kvtune: ", re.IGNORECASE)
_TEXT_LINES = 3


def kvtune_text_output(head: bytes) -> str | None:
    """What kvtune-rendered text file this is, from the head of a file that is not JSON (None: not
    one kvtune rendered). Only comment lines are looked at, never data rows."""
    lines = head.lstrip(b"\xef\xbb\xbf").splitlines()[:_TEXT_LINES]
    if any(_RENDERED.match(line) for line in lines):
        return "rendered by kvtune recommend --out"
    if lines and lines[0].lower().startswith((b"<!doctype html", b"<html")) and _HTML_TITLE.search(head[:2048]):
        return "rendered by kvtune recommend --out"
    return None
