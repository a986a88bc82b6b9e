"""Types of the C extension `_flatscan.c` (read through `kvtune.ingest.flatscan`)."""

from typing import Any

import numpy as np
from _typeshed import ReadableBuffer
from numpy.typing import NDArray

def scan_block(
    block: ReadableBuffer, keys: tuple[bytes, ...], kinds: bytes, /
) -> (
    tuple[
        int,  # rows: records (non-blank lines)
        int,  # lines in the block, a last one without "\n" included
        bytearray | None,  # int64 line index of each record; None: record i is line i
        list[bytearray | None],  # per key: values (int64, float64, int32 codes or bool); None: in no record
        list[bytearray | None],  # per key: valid flags (bool); None: all valid, or in no record
        list[list[str] | None],  # per key: LABEL texts in first-seen order; None for other kinds
    ]
    | None
):
    """The typed columns of `keys` over the whole lines of `block`, or None if any record is not clean."""

def add_counts(
    counts: NDArray[Any], rows: NDArray[np.int64], stride: int, values: NDArray[np.int64],
    cut: NDArray[np.bool_] | None, half: int, /
) -> None:
    """counts[rows[i]*stride + values[i] + (half if cut[i] else 0)] += 1 (int64 buffers), without the GIL."""

def add_pair_counts(
    counts: NDArray[Any], rows: NDArray[np.int64], stride: int, first: NDArray[np.int64], second: NDArray[np.int64],
    table: NDArray[np.int32], scale: int, /
) -> None:
    """counts[rows[i]*stride + table[first[i]]*scale + table[second[i]]] += 1 (table int32), without the GIL."""
