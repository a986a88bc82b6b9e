"""What an adapter is: a name, a detection test, per-record extraction, and optionally a flat spec.

Per-record extraction (`rows`) works on any parsed record and is the reference behaviour. A flat
spec (`Flat`: target column ← source column) additionally lets the reader take the vectorized
Arrow path for files whose fields are plain top-level columns; both paths must agree.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from kvtune.ingest.schemas._fields import (
    BAD_TEXT,
    FAILED,
    RowError,
    as_float,
    as_int,
    as_str,
    as_time,
    dig,
    show,
)

# Row keys an adapter may fill: the output COLUMNS (route is the adapter's natural route, if any),
# plus `path` (request path when logged) and `prompt_text`/`output_text` for tokenizing.
INT_TARGETS = ("prompt_tokens", "output_tokens", "max_tokens")
STR_TARGETS = ("route", "path", "model", "finish_reason")
FLOAT_TARGETS = ("latency_ms", "ttft_ms")
TEXT_TARGETS = ("prompt_text", "output_text")
TARGETS = (*STR_TARGETS, *INT_TARGETS, "censored", "timestamp_s", *FLOAT_TARGETS, *TEXT_TARGETS)

Row = dict[str, Any]


@dataclass(frozen=True)
class Flat:
    """A schema whose fields are top-level columns: target → source column name."""

    columns: Mapping[str, str]
    time_unit: str = "s"  # unit of the timestamp column: s, ms, us, ns (strings: ISO 8601)
    latency_unit: str = "ms"  # unit of latency_ms / ttft_ms sources: ms or s
    zero_output_failed: bool = False  # BurstGPT logs failed requests as 0 response tokens


@dataclass(frozen=True)
class Adapter:
    """One log family: how to recognise a record of it and how to turn a record into rows."""

    name: str
    description: str
    match: Callable[[Mapping[str, Any]], bool]
    rows: Callable[[Mapping[str, Any]], Iterator[Row | RowError]] | None = None
    flat: Flat | None = None
    containers: frozenset[str] = field(default=frozenset({"json", "csv", "parquet"}))

    def __reduce__(self) -> tuple[Callable[[str], Adapter], tuple[str]]:
        """Pickled by name: a file's plan crosses to a worker process (`kvtune.profile.parallel`),
        and an adapter's functions are lambdas, which pickle cannot carry; every adapter is one
        module-level instance in the registry."""
        return (adapter_named, (self.name,))

    def extract(self, record: Mapping[str, Any]) -> Iterator[Row | RowError]:
        if self.flat is not None and self.rows is None:
            yield from flat_rows(self.flat, record)
        else:
            assert self.rows is not None
            yield from self.rows(record)


#: The registered adapters by name: kvtune.ingest.schemas fills it (Python runs that package
#: before this module of it, so a worker unpickling an adapter finds it filled).
REGISTRY: dict[str, Adapter] = {}


def adapter_named(name: str) -> Adapter:
    """The registered adapter of this name (how a pickled adapter comes back)."""
    return REGISTRY[name]


def flat_rows(flat: Flat, record: Mapping[str, Any]) -> Iterator[Row | RowError]:
    """The per-record reading of a flat spec; the vectorized path must give the same result."""
    try:
        yield convert_flat(flat, record)
    except RowError as err:
        yield err


def convert_flat(flat: Flat, record: Mapping[str, Any]) -> Row:
    row: Row = {"_out": flat.columns.get("output_tokens")}
    lat_scale = 1000.0 if flat.latency_unit == "s" else 1.0
    for target, source in flat.columns.items():
        value = dig(record, source)
        if target in INT_TARGETS:
            row[target] = as_int(value, source)
        elif target in STR_TARGETS or target in TEXT_TARGETS:
            row[target] = as_str(value, source)
        elif target == "timestamp_s":
            row[target] = as_time(value, source, flat.time_unit)
        elif target in FLOAT_TARGETS:
            v = as_float(value, source)
            row[target] = None if v is None else v * lat_scale
        elif target == "censored":
            row[target] = as_bool(value, source)
    if flat.zero_output_failed and row.get("output_tokens") == 0:
        raise RowError(flat.columns["output_tokens"], "0 response tokens (a failed request)", FAILED)
    return row


def as_bool(value: Any, field: str) -> bool | None:
    if value is None or value == "":
        return None
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "false", "1", "0"):
        return value.strip().lower() in ("true", "1")
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    raise RowError(field, f"not a boolean: {show(value)}", BAD_TEXT)


def has(record: Mapping[str, Any], *keys: str) -> bool:
    return all(k in record for k in keys)
