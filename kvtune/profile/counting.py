"""Dense counting of one batch, counts[row·stride + value] += 1, in C without the GIL.

numpy counts in two passes that hold the GIL (the key array, then `np.add.at`), so a profile's
counting took turns with the reader thread's decoding instead of running beside it on the other
core. The C kernels (`kvtune.ingest._flatscan`: add_counts, add_pair_counts) count in one pass
with the GIL released; `kvtune.profile.build` calls them where `available()`, and counts with
numpy as before otherwise (tests compare the two paths' profiles byte for byte).
"""

from __future__ import annotations

import numpy as np

try:
    from kvtune.ingest import _flatscan
except ImportError:  # installed without a C compiler: build.py counts with numpy
    _KERNELS = False
else:
    _KERNELS = True

__all__ = ["available", "add_counts", "add_pair_counts"]


def available() -> bool:
    """Whether the C kernels were built (else numpy counts)."""
    return _KERNELS


def _int64(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, np.int64)


def add_counts(counts: np.ndarray, rows: np.ndarray, stride: int, values: np.ndarray,
               cut: np.ndarray | None = None, half: int = 0) -> None:
    """counts.flat[rows·stride + values (+ half where cut)] += 1, in place (counts: C-contiguous
    int64). A key outside it is a ValueError that stops the count there: a caller's bug, like
    np.add.at's IndexError (checking every key first cost a second pass: half the kernel's time)."""
    if rows.size:
        _flatscan.add_counts(counts.reshape(-1), _int64(rows), int(stride), _int64(values),
                             None if cut is None else np.ascontiguousarray(cut, np.bool_), int(half))


def add_pair_counts(counts: np.ndarray, rows: np.ndarray, stride: int, first: np.ndarray, second: np.ndarray,
                    table: np.ndarray, scale: int) -> None:
    """counts.flat[rows·stride + table[first]·scale + table[second]] += 1, in place: the joint
    histogram's cells, `table` (int32) mapping a token count to its bin (first and second must
    index it)."""
    if rows.size:
        _flatscan.add_pair_counts(counts.reshape(-1), _int64(rows), int(stride), _int64(first), _int64(second),
                                  np.ascontiguousarray(table, np.int32), int(scale))
