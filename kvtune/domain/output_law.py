"""A route's output-length law as data: the bins the gateway's statistical policy bounds with
(the maths stays in kvtune.gateway.overflow), written by deploy's renderer, read from gateway.yaml,
and used by policy's search and sim's admission, so it lives on the floor."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvtune.domain.fields import MAX_INTEGER

__all__ = ["MAX_BINS", "RENDERED_BINS", "OutputLaw", "parse_output_law"]

#: Most bins an output_histogram may carry (the renderer writes RENDERED_BINS).
MAX_BINS = 64
RENDERED_BINS = 32


@dataclass(frozen=True, slots=True)
class OutputLaw:
    """A route's output-length distribution: each bin's upper edge (tokens) and its count.

    A length is taken at its bin's upper edge, which overstates both how many blocks a sequence
    reaches and how long it holds them: the bound stays conservative for any length in the bin."""

    lengths: tuple[int, ...]
    counts: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.lengths or len(self.lengths) != len(self.counts):
            raise ValueError("an output law needs as many counts as lengths, at least one")
        if len(self.lengths) > MAX_BINS:
            raise ValueError(f"an output law has at most {MAX_BINS} bins, got {len(self.lengths)}")
        if any(b <= a for a, b in zip(self.lengths, self.lengths[1:], strict=False)) or self.lengths[0] < 1:
            raise ValueError("output law lengths must be positive and strictly increasing")
        if any(c < 0 for c in self.counts) or sum(self.counts) <= 0:
            raise ValueError("output law counts must be non-negative with a positive total")

    @classmethod
    def from_samples(cls, values: Sequence[int] | np.ndarray, counts: Sequence[int] | np.ndarray, cap: int,
                     bins: int = RENDERED_BINS) -> OutputLaw:
        """Bin exact (value, count) pairs into at most `bins` bins by quantile, lengths above the
        cap moved to the cap; the last edge is always the cap, so the worst case keeps its mass."""
        v = np.minimum(np.asarray(values, dtype=np.int64), cap)
        c = np.asarray(counts, dtype=np.int64)
        keep = c > 0
        v, c = v[keep], c[keep]
        if v.size == 0:
            return cls((max(cap, 1),), (1,))
        order = np.argsort(v, kind="stable")
        v, c = v[order], c[order]
        cum = np.cumsum(c)
        total = int(cum[-1])
        edges: list[int] = []
        for j in range(1, bins):  # the value at each quantile j / bins becomes an upper edge
            idx = int(np.searchsorted(cum, math.ceil(total * j / bins)))
            edge = int(v[min(idx, v.size - 1)])
            if edge >= 1 and (not edges or edge > edges[-1]) and edge < cap:
                edges.append(edge)
        edges.append(max(cap, 1))
        upper = np.asarray(edges, dtype=np.int64)
        where = np.searchsorted(upper, np.maximum(v, 1), side="left")
        binned = np.bincount(where, weights=c, minlength=upper.size).astype(np.int64)
        keep_bins = [(int(e), int(n)) for e, n in zip(upper, binned, strict=True) if n > 0 or e == upper[-1]]
        return cls(tuple(e for e, _ in keep_bins), tuple(n for _, n in keep_bins))

    @classmethod
    def worst_case(cls, cap: int) -> OutputLaw:
        """Every sequence reaches its cap: what a route without a histogram is assumed to do."""
        return cls((max(cap, 1),), (1,))

    def to_dict(self) -> dict[str, Any]:
        return {"lengths": list(self.lengths), "counts": list(self.counts)}

    def at_least(self, tokens: int) -> OutputLaw | None:
        """The law of a request that forces `tokens` output tokens (min_tokens): the bins that
        reach them; None (every sequence reaches its cap) when no logged length did."""
        kept = [(n, c) for n, c in zip(self.lengths, self.counts, strict=True) if n >= tokens and c > 0]
        if not kept:
            return None
        return OutputLaw(tuple(n for n, _ in kept), tuple(c for _, c in kept))

    def conditioned(self, cap: int, streamed: int) -> tuple[np.ndarray, np.ndarray]:
        """The lengths (each at most `cap`) and their probabilities given `streamed` tokens seen.

        A bin whose upper edge is below `streamed` is impossible now; if none is left (the request
        runs past every logged length), the sequence is assumed to run to its cap."""
        lengths = np.minimum(np.asarray(self.lengths, dtype=np.int64), cap)
        weights = np.asarray(self.counts, dtype=np.float64)
        keep = (lengths >= streamed) & (weights > 0)
        if not keep.any():
            return np.asarray([cap], dtype=np.int64), np.ones(1)
        lengths, weights = lengths[keep], weights[keep]
        uniq, inverse = np.unique(lengths, return_inverse=True)
        merged = np.bincount(inverse, weights=weights, minlength=uniq.size)
        return uniq, merged / merged.sum()


def parse_output_law(raw: Any, fail: Any, where: str) -> OutputLaw:
    """gateway.yaml's `output_histogram: {lengths: [...], counts: [...]}`, validated strictly."""
    if not isinstance(raw, Mapping):
        raise fail(where, "expected a mapping {lengths: [...], counts: [...]}")
    for key in raw:
        if key not in ("lengths", "counts"):
            raise fail(f"{where}.{key}" if isinstance(key, str) and key.isprintable() else where,
                       "unknown key (allowed: lengths, counts)")
    lists: dict[str, list[int]] = {}
    for key in ("lengths", "counts"):
        value = raw.get(key)
        if not isinstance(value, list) or not value:
            raise fail(f"{where}.{key}", "expected a non-empty list of integers")
        if len(value) > MAX_BINS:
            raise fail(f"{where}.{key}", f"at most {MAX_BINS} bins, got {len(value)}")
        for i, item in enumerate(value):
            if isinstance(item, bool) or not isinstance(item, int) or item < 0 or item > MAX_INTEGER:
                raise fail(f"{where}.{key}[{i}]", "expected a non-negative integer")
        lists[key] = value
    lengths, counts = lists["lengths"], lists["counts"]
    if len(lengths) != len(counts):
        raise fail(f"{where}.counts", f"has {len(counts)} entries for {len(lengths)} lengths")
    if lengths[0] < 1 or any(b <= a for a, b in zip(lengths, lengths[1:], strict=False)):
        raise fail(f"{where}.lengths", "must be positive and strictly increasing")
    if sum(counts) <= 0:
        raise fail(f"{where}.counts", "must add up to more than 0")
    return OutputLaw(tuple(lengths), tuple(counts))
