"""Hive-style partitions (`logs/dt=2026-11-30/part-0.parquet`): the keys a file's path carries,
the span of time a date partition covers, and pruning by a `--since`/`--until` window.

A directory of partitions is read as one dataset by walking it (`paths.expand_paths`); this
module only reads the `key=value` segments of each file's directory path. Date keys: `dt`,
`date` or `day` holding a date (2026-11-30 or 20261130), or nested `year=`/`month=`/`day=`, each
optionally refined by `hour=`. Partition dates carry no time zone, so a partition is pruned only
when it lies outside the window whatever zone its date was written in (UTC−12 … UTC+14): a
partition never costs a request that the window would keep, at worst a neighbour is opened and
its rows filtered one by one. A value that is not a date (`dt=latest`) is never pruned.
"""

from __future__ import annotations

import calendar
import os
import re
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from typing import TypeVar
from urllib.parse import unquote, urlsplit

from kvtune.ingest.paths import LogFile
from kvtune.ingest.remote import RemoteFile
from kvtune.ingest.window import Window

#: How far a partition's local date can sit from UTC: zones run from UTC−12 to UTC+14.
EARLIEST_ZONE_S = 14 * 3600
LATEST_ZONE_S = 12 * 3600

DATE_KEYS = ("dt", "date", "day")
HOUR_KEYS = ("hour", "hr")
_SEGMENT = re.compile(r"(?P<key>[A-Za-z_][A-Za-z0-9_]*)=(?P<value>.*)")
_DATE = re.compile(r"(?P<y>\d{4})-?(?P<m>\d{2})-?(?P<d>\d{2})")
_NUMBER = re.compile(r"\d{1,4}")

P = TypeVar("P", bound="LogFile | str")


def partition_keys(path: LogFile | str) -> dict[str, str]:
    """The `key=value` segments of a file's directory path (a URL's path for a remote file),
    outermost first, keys lower-cased and values unescaped as Hive writes them (`%3A` → `:`); the
    file's own name is not a partition."""
    if isinstance(path, RemoteFile):
        split = urlsplit(path.url)
        text = split.netloc + split.path
    else:
        text = os.fspath(path).replace(os.sep, "/")
    keys: dict[str, str] = {}
    for segment in text.split("/")[:-1]:
        m = _SEGMENT.fullmatch(segment)
        if m:
            keys[m["key"].lower()] = unquote(m["value"])
    return keys


def _number(keys: dict[str, str], names: Sequence[str]) -> int | None:
    for name in names:
        value = keys.get(name)
        if value is not None:
            return int(value) if _NUMBER.fullmatch(value) else -1  # -1: present but not a number
    return None


def partition_span(keys: dict[str, str]) -> tuple[datetime, datetime] | None:
    """[start, end) of the date (or hour, month, year) a file's partition keys name, as naive
    datetimes in the partition's own (unknown) zone; None when they name no date."""
    hour = _number(keys, HOUR_KEYS)
    start: datetime | None = None
    step = None
    for name in DATE_KEYS:
        m = _DATE.fullmatch(keys.get(name, ""))
        if m:
            try:
                start = datetime(int(m["y"]), int(m["m"]), int(m["d"]))
            except ValueError:
                return None
            step = "day"
            break
    if start is None:
        year, month, day = _number(keys, ("year", "yyyy")), _number(keys, ("month", "mm")), _number(keys, ("day",))
        if year is None or year < 1:
            return None
        try:
            if month is None:
                start, step = datetime(year, 1, 1), "year"
            elif day is None:
                start, step = datetime(year, month, 1), "month"
            else:
                start, step = datetime(year, month, day), "day"
        except ValueError:
            return None
    if hour is not None and step == "day":
        if not 0 <= hour <= 23:
            return None
        return start + timedelta(hours=hour), start + timedelta(hours=hour + 1)
    if step == "year":
        return start, _year_after(start)
    if step == "month":
        days = calendar.monthrange(start.year, start.month)[1]
        return start, start + timedelta(days=days)
    return start, start + timedelta(days=1)


def _year_after(start: datetime) -> datetime:
    return datetime(start.year + 1, 1, 1) if start.year < 9999 else datetime.max


def may_overlap(keys: dict[str, str], window: Window) -> bool:
    """False only when the partition's span, read in any time zone, lies wholly outside the window."""
    span = partition_span(keys)
    if span is None:
        return True
    start, end = (t.replace(tzinfo=UTC).timestamp() for t in span)
    return window.overlaps(start - EARLIEST_ZONE_S, end + LATEST_ZONE_S)


def prune(files: Sequence[P], window: Window | None) -> tuple[list[P], list[P]]:
    """(files to read, files pruned): a file is pruned when its partition date is outside the window."""
    if window is None:
        return list(files), []
    kept: list[P] = []
    pruned: list[P] = []
    for f in files:
        (kept if may_overlap(partition_keys(f), window) else pruned).append(f)
    return kept, pruned
