"""Exact integer histograms: nearest-rank quantiles, exact merges, sparse JSON.

Token counts are small integers bounded by the context window, so counting each value is exact,
takes memory bounded by the largest value rather than the number of rows, and merges by addition.
Two coarser companions live here too: a log-binned histogram for latencies (float milliseconds)
and a log-binned 2D (prompt, output) histogram for drawing correlated pairs.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvtune.domain.fields import MAX_INTEGER
from kvtune.errors import InputError
from kvtune.userfiles import brief

__all__ = [
    "Histogram",
    "LogHistogram",
    "JointHistogram",
    "nearest_rank_index",
    "log_bin_edges",
]


def nearest_rank_index(n: int, q: float) -> int:
    """0-based index of the q-quantile (0 ≤ q ≤ 1) in a sorted sample of n.

    Replicates numpy's `method="inverted_cdf"` float arithmetic step by step (virtual index
    n*q - 1, then the next index when its fractional part is positive) so results are identical
    to `np.percentile(x, 100*q, method="inverted_cdf")` even where n*q is not exact.
    """
    if n <= 0:
        raise ValueError("quantile of an empty sample")
    virtual = float(n) * float(q) - 1.0
    if virtual >= n - 1:
        return n - 1
    if virtual < 0:
        return 0
    previous = math.floor(virtual)
    return int(previous + (1 if virtual - previous > 0 else 0))


def _frozen(array: np.ndarray) -> np.ndarray:
    array.setflags(write=False)
    return array


def distinct(values: np.ndarray) -> np.ndarray:
    """np.unique(values) (sorted distinct values) without importing numpy.ma, which np.unique
    does on its plain path (~8 ms of a profile's start)."""
    values = np.sort(values, axis=None)
    if values.size < 2:
        return values
    return values[np.concatenate([[True], values[1:] != values[:-1]])]


#: Bounds on what a saved histogram may hold: each value and each histogram's total count stay
#: exact in a double, so int64 sums cannot overflow and every reader sees the same number.
MAX_SAVED_INTEGER = MAX_INTEGER


def _int_list(data: Mapping[str, Any], key: str, where: str, maximum: int = MAX_SAVED_INTEGER) -> np.ndarray:
    """A list of integers in 0..maximum from a parsed JSON object, or an InputError naming it."""
    raw = data.get(key)
    if not isinstance(raw, list) or not all(
        isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in raw
    ):
        raise InputError("expected a list of non-negative integers", field=f"{where}.{key}")
    if raw and max(raw) > maximum:
        raise InputError(f"{brief(max(raw))} is above {maximum}, the largest allowed here", field=f"{where}.{key}")
    return np.asarray(raw, dtype=np.int64).reshape(-1)


def _counts(data: Mapping[str, Any], key: str, where: str) -> np.ndarray:
    """Counts whose total stays within MAX_SAVED_INTEGER (summed exactly, in Python ints)."""
    counts = _int_list(data, key, where)
    if sum(data[key]) > MAX_SAVED_INTEGER:
        raise InputError(f"counts add up to more than {MAX_SAVED_INTEGER}", field=f"{where}.{key}")
    return counts


@dataclass(frozen=True, slots=True, eq=False)
class Histogram:
    """Exact counts of non-negative integer values, stored sparse: sorted `values`, `counts` > 0."""

    values: np.ndarray
    counts: np.ndarray

    def __post_init__(self) -> None:
        values = np.asarray(self.values, dtype=np.int64).reshape(-1)
        counts = np.asarray(self.counts, dtype=np.int64).reshape(-1)
        if values.shape != counts.shape:
            raise ValueError("values and counts differ in length")
        keep = counts != 0
        if not keep.all():
            values, counts = values[keep], counts[keep]
        if values.size > 1 and not (np.diff(values) > 0).all():
            order = np.argsort(values, kind="stable")
            values, counts = values[order], counts[order]
            if not (np.diff(values) > 0).all():  # duplicates: sum them
                uniq, inverse = np.unique(values, return_inverse=True)
                counts = np.bincount(inverse, weights=counts, minlength=uniq.size).astype(np.int64)
                values = uniq
        if (counts < 0).any() or (values < 0).any():
            raise ValueError("histogram values and counts must be non-negative")
        object.__setattr__(self, "values", _frozen(values.copy()))
        object.__setattr__(self, "counts", _frozen(counts.copy()))

    @classmethod
    def empty(cls) -> Histogram:
        return cls(np.zeros(0, np.int64), np.zeros(0, np.int64))

    @classmethod
    def from_dense(cls, dense_counts: np.ndarray) -> Histogram:
        """From counts indexed by value (index i holds how often value i occurred)."""
        dense_counts = np.asarray(dense_counts, dtype=np.int64)
        values = np.flatnonzero(dense_counts)
        return cls(values, dense_counts[values])

    @classmethod
    def of(cls, samples: Any) -> Histogram:
        """From raw integer samples (tests, small inputs)."""
        samples = np.asarray(samples, dtype=np.int64).reshape(-1)
        if samples.size == 0:
            return cls.empty()
        values, counts = np.unique(samples, return_counts=True)
        return cls(values, counts)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Histogram):
            return NotImplemented
        return np.array_equal(self.values, other.values) and np.array_equal(self.counts, other.counts)

    # unhashable, like the arrays it holds: a class that defines __eq__ gets __hash__ = None

    @property
    def total(self) -> int:
        return int(self.counts.sum())

    def __len__(self) -> int:
        return self.total

    @property
    def max(self) -> int | None:
        return int(self.values[-1]) if self.values.size else None

    @property
    def min(self) -> int | None:
        return int(self.values[0]) if self.values.size else None

    @property
    def mean(self) -> float | None:
        total = self.total
        if total == 0:
            return None
        return float(np.dot(self.values.astype(np.float64), self.counts)) / total

    def quantile(self, q: float) -> int | None:
        """Nearest-rank q-quantile (0 ≤ q ≤ 1), equal to numpy's `inverted_cdf`; None if empty."""
        total = self.total
        if total == 0:
            return None
        rank = nearest_rank_index(total, q) + 1
        cumulative = np.cumsum(self.counts)
        return int(self.values[int(np.searchsorted(cumulative, rank, side="left"))])

    def percentile(self, p: float) -> int | None:
        """Like `np.percentile(x, p, method="inverted_cdf")`: p in percent, divided as numpy does."""
        return self.quantile(float(np.float64(p) / 100))

    def count_le(self, t: float) -> int:
        """How many values are ≤ t."""
        return int(self.counts[: int(np.searchsorted(self.values, t, side="right"))].sum())

    def to_dense(self, length: int | None = None) -> np.ndarray:
        """Counts indexed by value, `length` long (default max + 1)."""
        size = (int(self.values[-1]) + 1 if self.values.size else 0) if length is None else length
        dense = np.zeros(size, dtype=np.int64)
        inside = self.values < size
        dense[self.values[inside]] = self.counts[inside]
        return dense

    def merge(self, other: Histogram) -> Histogram:
        """Exact sum of two histograms (order-independent)."""
        if not other.values.size:
            return self
        if not self.values.size:
            return other
        return Histogram(
            np.concatenate([self.values, other.values]), np.concatenate([self.counts, other.counts])
        )

    __add__ = merge

    def to_dict(self) -> dict[str, list[int]]:
        return {"values": self.values.tolist(), "counts": self.counts.tolist()}

    @classmethod
    def from_dict(cls, data: Any, where: str, max_value: int = MAX_SAVED_INTEGER) -> Histogram:
        """Parse the JSON form; `where` is the field path used in errors."""
        if not isinstance(data, Mapping):
            raise InputError("expected an object with values and counts", field=where)
        values = _int_list(data, "values", where, max_value)
        counts = _counts(data, "counts", where)
        if values.shape != counts.shape:
            raise InputError("values and counts differ in length", field=where)
        if values.size > 1 and not (np.diff(values) > 0).all():
            raise InputError("values must be strictly increasing", field=f"{where}.values")
        return cls(values, counts)


# ---------------------------------------------------------------------------------------------
# Log-binned histograms

#: Bins per factor of e for latencies: bin i holds v with floor(LOG_BINS_PER_E * ln(1 + v)) == i,
#: i.e. about 1% relative width, so a reported latency percentile is within ~1% of the exact one.
LOG_BINS_PER_E = 100
#: No latency is longer than 1e12 ms (31 years): a longer one is not a latency (the profile leaves it
#: out, as it does a negative one), and a bin much beyond it has a value that overflows a float.
MAX_LATENCY_MS = 1e12
MAX_LOG_BIN = int(LOG_BINS_PER_E * math.log1p(MAX_LATENCY_MS))


def log_bin(values_ms: np.ndarray) -> np.ndarray:
    """Bin index of non-negative float values (ms) on a ~1% log scale."""
    return np.floor(LOG_BINS_PER_E * np.log1p(np.maximum(values_ms, 0.0))).astype(np.int64)


def log_bin_value(index: np.ndarray | int) -> np.ndarray | float:
    """Representative value of a log bin: its geometric centre (within ~0.5% of any member)."""
    return np.expm1((np.asarray(index, dtype=np.float64) + 0.5) / LOG_BINS_PER_E)


@dataclass(frozen=True, slots=True, eq=False)
class LogHistogram:
    """A latency distribution on ~1%-wide log bins: mergeable, bounded, quantiles within ~1%."""

    bins: Histogram  # bin index -> count

    def __eq__(self, other: object) -> bool:
        return isinstance(other, LogHistogram) and self.bins == other.bins

    # unhashable, like the arrays it holds: a class that defines __eq__ gets __hash__ = None

    @property
    def total(self) -> int:
        return self.bins.total

    def quantile(self, q: float) -> float | None:
        index = self.bins.quantile(q)
        return None if index is None else round(float(log_bin_value(index)), 3)

    def merge(self, other: LogHistogram) -> LogHistogram:
        return LogHistogram(self.bins.merge(other.bins))

    def to_dict(self) -> dict[str, Any]:
        return {"bins_per_e": LOG_BINS_PER_E, **self.bins.to_dict()}

    @classmethod
    def from_dict(cls, data: Any, where: str) -> LogHistogram:
        if not isinstance(data, Mapping) or data.get("bins_per_e") != LOG_BINS_PER_E:
            raise InputError(f"expected bins_per_e = {LOG_BINS_PER_E}", field=f"{where}.bins_per_e")
        return cls(Histogram.from_dict(data, where, max_value=MAX_LOG_BIN))


#: Joint (prompt, output) bins: 4 per octave. Bin i covers [JOINT_EDGES[i], JOINT_EDGES[i+1]).
JOINT_BINS_PER_OCTAVE = 4
JOINT_MAX_OCTAVE = 24  # 16M tokens; anything larger lands in the last bin


def log_bin_edges(bins_per_octave: int = JOINT_BINS_PER_OCTAVE, octaves: int = JOINT_MAX_OCTAVE) -> np.ndarray:
    """Integer lower edges 0, 1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16, 20, …: distinct, increasing."""
    raw = np.ceil(2.0 ** (np.arange(bins_per_octave * octaves + 1) / bins_per_octave)).astype(np.int64)
    return distinct(np.concatenate([[0], raw]))


JOINT_EDGES = _frozen(log_bin_edges())


@dataclass(frozen=True, slots=True, eq=False)
class JointHistogram:
    """Counts of (prompt bin, output bin) pairs on JOINT_EDGES, stored sparse.

    The marginals are exact elsewhere; this coarse joint keeps the prompt/output correlation so
    a benchmark can draw realistic pairs: pick a cell by count, then values within it.
    """

    prompt_bins: np.ndarray
    output_bins: np.ndarray
    counts: np.ndarray

    def __post_init__(self) -> None:
        p = np.asarray(self.prompt_bins, dtype=np.int64).reshape(-1)
        o = np.asarray(self.output_bins, dtype=np.int64).reshape(-1)
        c = np.asarray(self.counts, dtype=np.int64).reshape(-1)
        if not (p.shape == o.shape == c.shape):
            raise ValueError("joint histogram arrays differ in length")
        width = JOINT_EDGES.size
        key = Histogram(p * width + o, c)  # sums duplicates, drops zeros, sorts
        object.__setattr__(self, "prompt_bins", _frozen(key.values // width))
        object.__setattr__(self, "output_bins", _frozen(key.values % width))
        object.__setattr__(self, "counts", key.counts)

    @classmethod
    def empty(cls) -> JointHistogram:
        z = np.zeros(0, np.int64)
        return cls(z, z, z)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, JointHistogram):
            return NotImplemented
        return all(
            np.array_equal(a, b)
            for a, b in (
                (self.prompt_bins, other.prompt_bins),
                (self.output_bins, other.output_bins),
                (self.counts, other.counts),
            )
        )

    # unhashable, like the arrays it holds: a class that defines __eq__ gets __hash__ = None

    @property
    def edges(self) -> np.ndarray:
        return JOINT_EDGES

    @property
    def total(self) -> int:
        return int(self.counts.sum())

    def merge(self, other: JointHistogram) -> JointHistogram:
        return JointHistogram(
            np.concatenate([self.prompt_bins, other.prompt_bins]),
            np.concatenate([self.output_bins, other.output_bins]),
            np.concatenate([self.counts, other.counts]),
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "bins_per_octave": JOINT_BINS_PER_OCTAVE,
            "prompt_bins": self.prompt_bins.tolist(),
            "output_bins": self.output_bins.tolist(),
            "counts": self.counts.tolist(),
        }

    @classmethod
    def from_dict(cls, data: Any, where: str) -> JointHistogram:
        if not isinstance(data, Mapping) or data.get("bins_per_octave") != JOINT_BINS_PER_OCTAVE:
            raise InputError(
                f"expected bins_per_octave = {JOINT_BINS_PER_OCTAVE}", field=f"{where}.bins_per_octave"
            )
        p = _int_list(data, "prompt_bins", where)
        o = _int_list(data, "output_bins", where)
        c = _counts(data, "counts", where)
        if not (p.shape == o.shape == c.shape):
            raise InputError("prompt_bins, output_bins and counts differ in length", field=where)
        if p.size and max(int(p.max()), int(o.max())) >= JOINT_EDGES.size:
            raise InputError("bin index out of range", field=where)
        return cls(p, o, c)


def joint_bin(tokens: np.ndarray) -> np.ndarray:
    """JOINT_EDGES bin index of each token count."""
    return np.searchsorted(JOINT_EDGES, tokens, side="right") - 1
