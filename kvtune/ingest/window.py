"""A time window on the request timestamp (`--since`/`--until`), and what it left out.

Since is inclusive and until exclusive, so consecutive windows (`--since D1 --until D2`, then
`--since D2 …`) count every request exactly once. Instants are ISO 8601 dates or datetimes; one
without a UTC offset is UTC, like the naive timestamps kvtune reads from logs. A row whose
timestamp is missing cannot be placed in the window: it is a bad row for this run (counted under
NO_TIMESTAMP, or an error naming its line with --on-error fail / --strict), never silently kept
or dropped. Rows with a timestamp outside the window are not errors: they are counted apart
(`WindowReport.outside_rows`), as are the files pruned by their partition date.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import numpy as np

from kvtune.errors import InputError
from kvtune.ingest.schemas._fields import parse_iso

#: The skip reason of a row without a timestamp when a window is given.
NO_TIMESTAMP = "no timestamp (needed by --since/--until)"


def parse_instant(text: str, option: str = "--since") -> float:
    """Epoch seconds of an ISO 8601 date (`2026-11-30`: its midnight) or datetime
    (`2026-11-30T12:00`, `2026-11-30 12:00:00.5+02:00`, `…Z`); no offset means UTC.

    Anything else is a ValueError whose message says what is expected (the CLI names the option).
    """
    value = text.strip()
    shown = repr(text) if len(text) <= 40 else repr(text[:37] + "...")
    if not value or not value[:4].isdigit():
        raise ValueError(f"expected an ISO date or datetime such as 2026-11-30 or 2026-11-30T12:00:00+02:00 "
                         f"for {option}, got {shown}")
    try:
        seconds = parse_iso(value)  # as timestamps in logs are read; a date alone is its midnight
    except (ValueError, OverflowError):
        seconds = math.nan
    if not math.isfinite(seconds):
        raise ValueError(f"expected an ISO date or datetime such as 2026-11-30 or 2026-11-30T12:00:00+02:00 "
                         f"for {option}, got {shown}")
    return seconds


def format_instant(seconds: float) -> str:
    """Epoch seconds as an ISO 8601 UTC datetime (`2026-11-30T00:00:00Z`), for reports."""
    try:
        text = datetime.fromtimestamp(seconds, UTC).isoformat()
    except (ValueError, OverflowError, OSError):  # beyond datetime's years: the seconds as they are
        return f"{seconds!r} s"
    return text.replace("+00:00", "Z")


@dataclass(frozen=True, slots=True)
class Window:
    """[since_s, until_s) in epoch seconds; either end may be open (None)."""

    since_s: float | None = None
    until_s: float | None = None

    def __post_init__(self) -> None:
        for name in ("since_s", "until_s"):
            value = getattr(self, name)
            if value is not None and not math.isfinite(value):
                raise InputError(f"not a finite time: {value}", field="--" + name[:-2])
        if self.since_s is not None and self.until_s is not None and self.since_s >= self.until_s:
            raise InputError(f"--since {format_instant(self.since_s)} is not before --until "
                             f"{format_instant(self.until_s)}: the window is empty", field="--until")

    @classmethod
    def parse(cls, since: str | None, until: str | None) -> Window | None:
        """The window of the two option values (None when neither is given)."""
        if since is None and until is None:
            return None
        return cls(None if since is None else parse_instant(since, "--since"),
                   None if until is None else parse_instant(until, "--until"))

    def inside(self, seconds: np.ndarray) -> np.ndarray:
        """Which timestamps (float seconds) fall in the window; NaN (missing) never does."""
        keep = np.isfinite(seconds)
        if self.since_s is not None:
            keep &= seconds >= self.since_s
        if self.until_s is not None:
            keep &= seconds < self.until_s
        return keep

    def overlaps(self, start_s: float, end_s: float) -> bool:
        """Whether [start_s, end_s) shares any instant with the window."""
        if self.since_s is not None and end_s <= self.since_s:
            return False
        return not (self.until_s is not None and start_s >= self.until_s)


@dataclass(frozen=True, slots=True)
class WindowReport:
    """What a window left out of a profile: files never opened (their partition date lies wholly
    outside it) and rows whose timestamp does. Rows without a timestamp are skips, not here."""

    since: str | None = None  # ISO UTC, as the window was given
    until: str | None = None
    pruned_files: int = 0
    outside_rows: int = 0

    @classmethod
    def of(cls, window: Window, pruned_files: int, outside_rows: int) -> WindowReport:
        return cls(None if window.since_s is None else format_instant(window.since_s),
                   None if window.until_s is None else format_instant(window.until_s),
                   pruned_files, outside_rows)

    def merge(self, other: WindowReport | None) -> WindowReport:
        """Counts add up; the bounds stay where both profiles agree (None where they differ)."""
        if other is None:
            return self
        return WindowReport(self.since if self.since == other.since else None,
                            self.until if self.until == other.until else None,
                            self.pruned_files + other.pruned_files, self.outside_rows + other.outside_rows)

    def to_dict(self) -> dict[str, Any]:
        return {"since": self.since, "until": self.until, "pruned_files": self.pruned_files,
                "outside_rows": self.outside_rows}

    @classmethod
    def from_dict(cls, data: Any, where: str = "window") -> WindowReport:
        if not isinstance(data, Mapping):
            raise InputError("expected {since, until, pruned_files, outside_rows}", field=where)
        bounds = [data.get(k) for k in ("since", "until")]
        counts = [data.get(k, 0) for k in ("pruned_files", "outside_rows")]
        if not all(b is None or isinstance(b, str) for b in bounds) or not all(
            isinstance(c, int) and not isinstance(c, bool) and 0 <= c < 2**63 for c in counts
        ):
            raise InputError("expected {since: str|null, until: str|null, pruned_files: int, outside_rows: int}",
                             field=where)
        return cls(bounds[0], bounds[1], counts[0], counts[1])


def merge_reports(a: WindowReport | None, b: WindowReport | None) -> WindowReport | None:
    """Two profiles' reports as one (None when neither was windowed)."""
    if a is None:
        return b
    return a.merge(b)
