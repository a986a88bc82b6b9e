"""A strict C scan of flat JSONL blocks into typed columns, several blocks at once across threads.

The extension (`_flatscan.c`, optional at install) reads the top-level keys of every line exactly
as `json.loads` followed by `as_int` / `as_float` / `as_str` / `as_bool` would, except that a
negative INT is returned as it is (the caller reports it). Whatever it cannot read exactly that
way makes the whole block "not clean" (None): the caller then reads the block line by line in
Python, which names the bad line. The scan releases the GIL.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

try:
    from kvtune.ingest import _flatscan
except ImportError:  # installed without a C compiler
    _AVAILABLE = False
else:
    _AVAILABLE = True

__all__ = ["BOOL", "FLOAT", "INT", "LABEL", "ScannedBlock", "available", "scan_block"]

INT, FLOAT, LABEL, BOOL = 0, 1, 2, 3
_DTYPES = {INT: np.int64, FLOAT: np.float64, LABEL: np.int32, BOOL: np.bool_}


def available() -> bool:
    """Whether the C extension was built and imported."""
    return _AVAILABLE


@dataclass(frozen=True, slots=True)
class ScannedBlock:
    """The columns of one clean block; invalid rows (absent, null, "") hold 0."""

    rows: int  # records (non-blank lines)
    lines: int  # lines in the block, a last one without "\n" included
    record_lines: NDArray[np.int64] | None  # line index (0-based) of each record; None: record i is line i
    # per key: values, valid (None: all valid); None for a key that is in no record of the block
    columns: list[tuple[NDArray[Any], NDArray[np.bool_] | None] | None]
    vocabs: list[list[str] | None]  # per key: LABEL texts in first-seen order (codes index them)


def scan_block(
    block: bytes | bytearray | memoryview, keys: Sequence[str], kinds: Sequence[int]
) -> ScannedBlock | None:
    """The typed columns of `keys` over the whole lines of `block`, or None if any record is not clean."""
    if not _AVAILABLE:
        raise RuntimeError("kvtune.ingest._flatscan is not built: check available() first")
    if len(keys) != len(kinds) or any(kind not in _DTYPES for kind in kinds):
        raise ValueError(f"need one kind per key, each one of {sorted(_DTYPES)}")
    raw = _flatscan.scan_block(block, tuple(key.encode() for key in keys), bytes(kinds))
    if raw is None:
        return None
    rows, lines, record_lines, values, valid, vocabs = raw
    columns: list[tuple[NDArray[Any], NDArray[np.bool_] | None] | None] = [
        None if v is None else (np.frombuffer(v, _DTYPES[kind]), None if ok is None else np.frombuffer(ok, np.bool_))
        for v, ok, kind in zip(values, valid, kinds, strict=True)
    ]
    return ScannedBlock(
        rows=rows,
        lines=lines,
        record_lines=None if record_lines is None else np.frombuffer(record_lines, np.int64),
        columns=columns,
        vocabs=vocabs,
    )
