"""Column checks and normalization shared by every fast path (and the slow path's batches).

Each path hands over typed Arrow columns keyed by target; `ColumnChecks._finalize` counts and drops
the rows that cannot be used (missing output, negative counts, non-finite numbers, failed
requests) and `_assemble` builds the batch with exactly `SCHEMA`: seconds and milliseconds, the
route, finish reasons on the OpenAI words, censoring. The work is on whole columns (numpy views of
Arrow buffers, dictionaries), so one place decides what a row means whichever path read it.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa

from kvtune.errors import InputError
from kvtune.ingest import COLUMNS, FileInfo, IngestOptions, IngestStats, arrays
from kvtune.ingest.schemas._base import FLOAT_TARGETS, INT_TARGETS, STR_TARGETS
from kvtune.ingest.schemas._fields import (
    BAD_NUMBER,
    BAD_TIME,
    FAILED,
    MAX_TIME_S,
    MAX_TOKEN_COUNT,
    MISSING_OUTPUT,
    NEGATIVE_TOKENS,
    TOO_MANY_TOKENS,
)
from kvtune.ingest.window import NO_TIMESTAMP

if TYPE_CHECKING:
    from kvtune.ingest.plan import FilePlan

#: Where a row was read: its line, or (line, index) where records come from a JSON document
#: (line None) or a slow-path batch (`readers._Sink`).
Location = int | tuple[int | None, int | None]
#: The slow path's input: (line, index in a JSON document, parsed record or RowError) per record.
Records = Iterator[tuple[int | None, int | None, Any]]

SCHEMA = pa.schema(
    [
        ("route", pa.dictionary(pa.int32(), pa.string())),
        ("model", pa.dictionary(pa.int32(), pa.string())),
        ("prompt_tokens", pa.int64()),
        ("output_tokens", pa.int64()),
        ("max_tokens", pa.int64()),
        ("finish_reason", pa.dictionary(pa.int32(), pa.string())),
        ("censored", pa.bool_()),
        ("timestamp_s", pa.float64()),
        ("latency_ms", pa.float64()),
        ("ttft_ms", pa.float64()),
    ]
)
assert tuple(SCHEMA.names) == COLUMNS

# finish reasons of every family, lower-cased, onto the OpenAI words; others pass through raw
FINISH = {
    "stop": "stop",
    "end_turn": "stop",
    "stop_sequence": "stop",
    "eos": "stop",
    "eos_token": "stop",
    "length": "length",
    "max_tokens": "length",
    "max_output_tokens": "length",
    "max_length": "length",
    "model_context_window_exceeded": "length",
    "incomplete": "length",
    "tool_calls": "tool_calls",
    "tool_use": "tool_calls",
    "function_call": "tool_calls",
    "content_filter": "content_filter",
    "safety": "content_filter",
}

_TYPES: dict[str, pa.DataType] = {
    **{t: pa.int64() for t in INT_TARGETS},
    **{t: pa.string() for t in (*STR_TARGETS, "_route")},
    **{t: pa.float64() for t in (*FLOAT_TARGETS, "timestamp_s")},
    "censored": pa.bool_(),
}
_SECONDS = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}


class ColumnChecks(abc.ABC):
    """The reader's shared end of every path: skips, checks and the normalized batch.

    The base of the reading paths (`jsonl.JsonlPaths`, `tabular.TabularPaths`), which
    `readers._Reader` joins: it declares the reader state they share, which `_Reader` sets, and
    the hooks `_Reader` defines (progress, the slow path, a flat plan's source fields).
    """

    options: IngestOptions
    stats: IngestStats
    fail: bool  # the first bad row raises (on_error fail, or strict) instead of being counted
    info: FileInfo  # the file being read
    path: str  # its path, as errors name it

    @abc.abstractmethod
    def _progress(self, pos: int) -> None:
        """Report `pos` bytes of the current file as read."""

    @abc.abstractmethod
    def _records(self, plan: FilePlan, records: Records) -> Iterator[pa.RecordBatch]:
        """The slow path: records one at a time through the plan's flat spec or adapter."""

    @abc.abstractmethod
    def _sources(self, plan: FilePlan) -> dict[str, str]:
        """The source field of each target column of a flat plan."""

    # -- skips and errors

    def _where(self, line: int | None, index: int | None, field: str | None) -> tuple[int | None, str | None]:
        if line is None and index is not None:  # a record of a JSON document
            field = f"[{index}]" + ("." + field if field else "")
        return line, field

    def skip(
        self, reason: str, message: str, line: int | None, field: str | None, index: int | None = None, count: int = 1
    ) -> None:
        line, field = self._where(line, index, field)
        err = InputError(message, path=self.path, line=line, field=field)
        if self.fail:
            raise err
        self.stats.skip(reason, str(err), count)

    def _need_example(self, reason: str) -> bool:
        return self.fail or reason not in self.stats.examples

    # -- checks and the normalized batch

    def _finalize(
        self, plan: FilePlan, cols: dict[str, pa.Array], n: int, locate: Callable[[int], Location]
    ) -> pa.RecordBatch | None:
        flat = plan.flat
        sources = flat.columns if flat is not None else {}
        cols = {t: c.combine_chunks() if isinstance(c, pa.ChunkedArray) else c for t, c in cols.items()}
        if "timestamp_s" in cols:
            cols["timestamp_s"] = _seconds(cols["timestamp_s"], flat.time_unit if flat else "s")
        if flat is not None and flat.latency_unit == "s":
            for t in FLOAT_TARGETS:
                if t in cols:
                    cols[t] = arrays.scaled(cols[t], 1000.0)
        out = cols.get("output_tokens")
        if out is None:
            out = pa.nulls(n, pa.int64())
            cols["output_tokens"] = out
        bad = _bad_rows(cols, n, flat is not None and flat.zero_output_failed)
        if bad:
            drop = np.zeros(n, dtype=bool)
            found = []
            for reason, target, mask, msg in bad:
                m = mask & ~drop
                if m.any():
                    first = int(np.argmax(m))
                    found.append((first, reason, target, msg, int(m.sum())))
                    drop |= m
            found.sort()
            for first, reason, target, msg, count in found:
                if self._need_example(reason) or self.fail:
                    col = cols.get(target)
                    value = col[first].as_py() if col is not None else None
                    line, index = _line_and_index(locate(first))
                    self.skip(reason, msg(value), line, sources.get(target, target), index, count=count)
                else:
                    self.stats.skipped[reason] += count
            import pyarrow.compute as pc

            keep = arrays.bool_array(~drop)
            cols = {t: pc.filter(c, keep) for t, c in cols.items()}
            n = int((~drop).sum())
            if self.options.window is not None:
                kept = np.flatnonzero(~drop)
                locate = (lambda at: lambda i: at(int(kept[i])))(locate)
        if self.options.window is not None and n:
            cols, n = self._in_window(cols, n, sources, locate)
        if n == 0:
            return None
        return self._assemble(cols, n)

    def _in_window(
        self, cols: dict[str, pa.Array], n: int, sources: Mapping[str, str], locate: Callable[[int], Location]
    ) -> tuple[dict[str, pa.Array], int]:
        """The rows inside --since/--until: a row without a timestamp is a bad row (NO_TIMESTAMP),
        one outside the window is counted in `stats.outside_window`."""
        window = self.options.window
        assert window is not None
        times = cols.get("timestamp_s")
        stamps = arrays.floats(times) if times is not None else np.full(n, np.nan)
        missing = np.isnan(stamps)
        if missing.any():
            first = int(np.argmax(missing))
            line, index = _line_and_index(locate(first))
            self.skip(NO_TIMESTAMP, "missing: a row without a timestamp cannot be placed in the --since/--until "
                      "window", line, sources.get("timestamp_s", "timestamp_s"), index, count=int(missing.sum()))
        inside = window.inside(stamps)
        self.stats.outside_window += int((~missing & ~inside).sum())
        kept = int(inside.sum())
        if kept == n:
            return cols, n
        import pyarrow.compute as pc

        keep = arrays.bool_array(inside)
        return {t: pc.filter(c, keep) for t, c in cols.items()}, kept

    def _route(self, cols: dict[str, pa.Array], n: int) -> pa.DictionaryArray:
        """The route column, always dictionary<int32, string>: few distinct values, cheap group-by."""
        rb = self.options.route_by
        if rb is None:
            candidates = [cols.get("route"), cols.get("path")]
        elif rb == "path":
            candidates = [cols.get("path")]
        elif rb == "model":
            candidates = [cols.get("model")]
        else:
            candidates = [cols.get("_route")]
        present = [_labels(c) for c in candidates if c is not None and c.null_count < n]
        if not present:
            return arrays.dictionary(np.zeros(n, np.int32), ["*"])
        if len(present) == 1:
            return _route_dictionary(present[0])
        # the first non-empty candidate per row: codes into the union of the dictionaries
        names: dict[str, int] = {}
        codes = np.full(n, -1, np.int64)
        for col in present:
            remap = np.array([names.setdefault(v, len(names)) for v in col.dictionary.to_pylist()] or [0], np.int64)
            idx, ok = arrays.ints(col.indices)
            take = codes < 0 if ok is None else (codes < 0) & ok
            codes[take] = remap[idx[take]]
        star = codes < 0
        if star.any():
            codes[star] = names.setdefault("*", len(names))
        return arrays.dictionary(codes, list(names))

    def _assemble(self, cols: dict[str, pa.Array], n: int) -> pa.RecordBatch:
        route = self._route(cols, n)
        out, _ = arrays.ints(cols["output_tokens"])
        finish = cols.get("finish_reason")
        finish = _normalize_finish(_labels(finish)) if finish is not None and finish.null_count < n else None
        model = cols.get("model")
        model = _labels(model) if model is not None and model.null_count < n else None
        censored = np.zeros(n, dtype=bool)
        if finish is not None:
            cut = np.array([v == "length" for v in finish.dictionary.to_pylist()] + [False])
            codes, ok = arrays.ints(finish.indices)
            censored |= cut[codes] if ok is None else cut[codes] & ok
        mx = cols.get("max_tokens")
        if mx is not None and mx.null_count < n:
            requested, ok = arrays.ints(mx)
            over = out >= requested
            if ok is not None:
                over &= ok
            if finish is not None and finish.null_count:
                over &= arrays.missing(finish)
            elif finish is not None:
                over[:] = False
            censored |= over
        given = cols.get("censored")
        if given is not None and given.null_count < n:
            censored |= arrays.flags(given)
        if self.options.assume_cap is not None:
            censored |= out >= self.options.assume_cap
        built = {"route": route, "model": model, "finish_reason": finish, "censored": arrays.bool_array(censored)}
        result = []
        for name in COLUMNS:
            arr = built[name] if name in built else cols.get(name)
            typ = SCHEMA.field(name).type
            if arr is None:
                arr = arrays.nulls(n, typ)
            elif arr.type != typ:
                arr = arr.cast(typ)
            result.append(arr)
        self.stats.rows_ok += n
        return pa.RecordBatch.from_arrays(result, schema=SCHEMA)


def _line_and_index(where: int | tuple[int | None, int | None]) -> tuple[int | None, int | None]:
    """A row's location from `locate`: a line number, or (line, index in a JSON document)."""
    return where if isinstance(where, tuple) else (where, None)


#: One failed row check: (skip reason, target column, mask of the rows it fails, message for a value).
_Check = tuple[str, str, arrays.Mask, Callable[[Any], str]]


def _bad_rows(cols: dict[str, pa.Array], n: int, zero_failed: bool, time_unit: str = "s") -> list[_Check]:
    """Row-level checks as (reason, target, numpy mask, message) for the checks that fail somewhere.

    Each check first asks a cheap whole-column question (null count, min/max), so a clean batch
    costs a few passes over its numbers and builds no masks. time_unit: what timestamp_s counts
    in (seconds once `_finalize` has converted it).
    """
    found: list[_Check] = []
    out = cols["output_tokens"]
    if out.null_count:
        found.append((MISSING_OUTPUT, "output_tokens", arrays.missing(out), lambda v: "missing"))
    for t in INT_TARGETS:
        col = cols.get(t)
        if col is None or col.null_count == n:
            continue
        low, high = _int_range(col)
        if low < 0:
            values, ok = arrays.ints(col)
            mask = values < 0 if ok is None else (values < 0) & ok
            found.append((NEGATIVE_TOKENS, t, mask, lambda v: f"negative count: {v}"))
        if high > MAX_TOKEN_COUNT and t != "max_tokens":  # prompt + output must stay exact
            values, ok = arrays.ints(col)
            mask = values > MAX_TOKEN_COUNT if ok is None else (values > MAX_TOKEN_COUNT) & ok
            found.append((TOO_MANY_TOKENS, t, mask, lambda v: f"count too large: {v} (more than 2^53 tokens)"))
    for t in (*FLOAT_TARGETS, "timestamp_s"):
        col = cols.get(t)
        if col is None or col.null_count == n:
            continue
        import pyarrow.compute as pc

        finite = pc.is_finite(col)
        if not pc.all(finite).as_py():
            found.append((BAD_NUMBER, t, ~arrays.flags(finite) & _not_null(col), lambda v: f"not a finite number: {v}"))
    times = cols.get("timestamp_s")
    if times is not None and times.null_count < n:
        stamps, top = arrays.floats(times), MAX_TIME_S / _SECONDS[time_unit]  # nulls are NaN: never flagged
        if not (stamps.min() >= 0 and stamps.max() <= top):  # NaN (or a bad value) somewhere
            mask = (stamps < 0) | (stamps > top)
            if mask.any():
                found.append((BAD_TIME, "timestamp_s", mask,
                              lambda v: f"not a time from 1970 to the year 9999: {v}"))
    if zero_failed and out.null_count < n and _int_range(out)[0] == 0:
        values, ok = arrays.ints(out)
        mask = values == 0 if ok is None else (values == 0) & ok
        found.append((FAILED, "output_tokens", mask, lambda v: "0 response tokens (a failed request)"))
    return found


def _int_range(col: pa.Array) -> tuple[int, int]:
    """(smallest, largest) non-null value of an integer column with some non-null: numpy passes
    over the Arrow buffer when there are no nulls, Arrow's min_max otherwise."""
    view = arrays.values(col) if col.null_count == 0 and len(col) else None
    if view is not None and view.dtype.kind in "iu":
        return int(view.min()), int(view.max())
    import pyarrow.compute as pc

    both = pc.min_max(col)
    return both["min"].as_py(), both["max"].as_py()


def _not_null(col: pa.Array) -> np.ndarray:
    mask = arrays.valid(col)
    return np.ones(len(col), bool) if mask is None else mask


def _labels(col: pa.Array) -> pa.DictionaryArray:
    """A label column as dictionary<int32, string> with "" as null, working on the dictionary."""
    if not pa.types.is_dictionary(col.type):
        if not (pa.types.is_string(col.type) or pa.types.is_large_string(col.type)):
            col = col.cast(pa.string())
        import pyarrow.compute as pc

        col = pc.dictionary_encode(col)
    if col.type.index_type != pa.int32() or col.type.value_type != pa.string():
        col = col.cast(pa.dictionary(pa.int32(), pa.string()))
    values = col.dictionary.to_pylist()
    if "" not in values:
        return col
    codes, ok = arrays.ints(col.indices)
    keep = codes != values.index("")
    return arrays.dictionary(codes, values, keep if ok is None else keep & ok)


def _route_dictionary(col: pa.DictionaryArray) -> pa.DictionaryArray:
    """A dictionary route column with "" and null mapped to "*", on the dictionary values only."""
    values = [v if v else "*" for v in col.dictionary.to_pylist()]
    unique = list(dict.fromkeys([*values, *(["*"] if col.null_count else [])]))
    if unique == col.dictionary.to_pylist():
        return col
    position = {v: i for i, v in enumerate(unique)}
    remap = np.array([position[v] for v in values] or [0], np.int32)
    indices, ok = arrays.ints(col.indices)
    codes = remap[indices]
    if ok is not None:
        codes[~ok] = position["*"]
    return arrays.dictionary(codes, unique)


def _normalize_finish(finish: pa.DictionaryArray) -> pa.DictionaryArray:
    """Finish reasons onto the OpenAI words (FINISH), on the dictionary values only."""
    values = finish.dictionary.to_pylist()
    mapped = [FINISH.get(v.lower(), v) for v in values]
    if mapped == values:
        return finish
    unique = list(dict.fromkeys(mapped))
    remap = np.array([unique.index(v) for v in mapped], np.int32)
    codes, ok = arrays.ints(finish.indices)
    return arrays.dictionary(remap[codes], unique, ok)


def _seconds(col: pa.Array, unit: str) -> pa.Array:
    if pa.types.is_timestamp(col.type):
        import pyarrow.compute as pc

        try:
            ns = col.cast(pa.timestamp("ns", tz=col.type.tz)) if col.type.unit != "ns" else col
        except pa.ArrowInvalid:  # beyond year 2262 in ns: seconds straight from its own unit
            raw = pc.cast(col.cast(pa.int64()), pa.float64(), safe=False)
            return arrays.numeric_array(arrays.numbers(raw) * _SECONDS[col.type.unit], arrays.valid(raw))
        seconds = pc.cast(ns.cast(pa.int64()), pa.float64(), safe=False)
        return arrays.numeric_array(arrays.numbers(seconds) / 1e9, arrays.valid(seconds))
    return arrays.scaled(col, _SECONDS[unit])
