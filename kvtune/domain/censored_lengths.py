"""A route's logged output lengths as plain counts: those that ended on their own and those cut
at their cap (right-censored), each as sorted lengths with their counts.

recommendation.json carries them per route so `kvtune check` judges a deployed cap by the same
Kaplan–Meier truncation share the recommendation was made with. The estimate itself is
kvtune.profile.routes.CensoredHistogram's (`CensoredHistogram.from_lengths`); this is the data.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvtune.domain.fields import MAX_INTEGER
from kvtune.errors import InputError
from kvtune.userfiles import brief

__all__ = ["LengthCounts", "CensoredLengths"]


@dataclass(frozen=True, slots=True)
class LengthCounts:
    """Exact counts of lengths: strictly increasing `values`, each with its count (> 0)."""

    values: tuple[int, ...] = ()
    counts: tuple[int, ...] = ()

    @property
    def total(self) -> int:
        return sum(self.counts)

    def to_dict(self) -> dict[str, list[int]]:
        return {"values": list(self.values), "counts": list(self.counts)}

    @classmethod
    def from_dict(cls, data: Any, where: str) -> LengthCounts:
        """The saved form (a profile histogram's), strictly; `where` is the field path in errors.
        A zero count is dropped, as the histogram it was written from holds none."""
        if not isinstance(data, Mapping):
            raise InputError("expected an object with values and counts", field=where)
        values = _integers(data, "values", where)
        counts = _integers(data, "counts", where)
        if sum(counts) > MAX_INTEGER:
            raise InputError(f"counts add up to more than {MAX_INTEGER}", field=f"{where}.counts")
        if len(values) != len(counts):
            raise InputError("values and counts differ in length", field=where)
        if any(b <= a for a, b in zip(values, values[1:], strict=False)):
            raise InputError("values must be strictly increasing", field=f"{where}.values")
        kept = [(v, c) for v, c in zip(values, counts, strict=True) if c]
        return cls(tuple(v for v, _ in kept), tuple(c for _, c in kept))


def _integers(data: Mapping[str, Any], key: str, where: str) -> list[int]:
    raw = data.get(key)
    if not isinstance(raw, list) or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in raw):
        raise InputError("expected a list of non-negative integers", field=f"{where}.{key}")
    if raw and max(raw) > MAX_INTEGER:
        raise InputError(f"{brief(max(raw))} is above {MAX_INTEGER}, the largest allowed here", field=f"{where}.{key}")
    return raw


@dataclass(frozen=True, slots=True)
class CensoredLengths:
    """Lengths of completions that ended on their own (`uncensored`) and of responses cut at
    their cap (`censored`: the true length is at least the logged one)."""

    uncensored: LengthCounts
    censored: LengthCounts

    @property
    def total(self) -> int:
        return self.uncensored.total + self.censored.total

    def to_dict(self) -> dict[str, Any]:
        return {"uncensored": self.uncensored.to_dict(), "censored": self.censored.to_dict()}

    @classmethod
    def from_dict(cls, data: Any, where: str) -> CensoredLengths:
        if not isinstance(data, Mapping):
            raise InputError("expected an object with uncensored and censored", field=where)
        return cls(LengthCounts.from_dict(data.get("uncensored"), f"{where}.uncensored"),
                   LengthCounts.from_dict(data.get("censored"), f"{where}.censored"))
