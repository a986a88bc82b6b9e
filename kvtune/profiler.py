"""Build profiles from normalized log batches, and load or save them.

`ProfileBuilder.add_batch` folds one pyarrow RecordBatch (columns of `kvtune.ingest.COLUMNS`)
into per-route dense count arrays with a handful of vectorized numpy passes, so memory is bounded
by routes × the largest token count, not by rows. `result()` freezes them into a `Profile`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from kvtune.errors import InputError, KvtuneError
from kvtune.files import write_text_atomic
from kvtune.histogram import (
    JOINT_EDGES,
    Histogram,
    JointHistogram,
    LogHistogram,
    joint_bin,
    log_bin,
)
from kvtune.profile import (
    Arrival,
    CensoredHistogram,
    InputFile,
    Profile,
    RouteProfile,
)

if TYPE_CHECKING:  # pragma: no cover
    import pyarrow as pa

__all__ = [
    "ProfileBuilder",
    "profile_logs",
    "load_profile",
    "save_profile",
    "load_profile_or_logs",
    "is_saved_profile",
]

#: Token counts at or above this go to a sparse overflow instead of the dense arrays, so one
#: absurd row (10^12 tokens) cannot allocate terabytes. 4M tokens is beyond any context window.
DENSE_LIMIT = 1 << 22

#: Batches ingest reads ahead in its own thread while this one aggregates (bounded memory).
PREFETCH_BATCHES = 1

_JOINT_WIDTH = JOINT_EDGES.size
_JOINT_TABLE_SIZE = 1 << 18  # lookup tables cover counts below 262144, past 128k contexts (above: a search)
_joint_tables: dict[int, np.ndarray] = {}


def _joint_table(scale: int) -> np.ndarray:
    """scale × joint bin of 0 … _JOINT_TABLE_SIZE-1, int32: 1 MiB, so lookups stay in cache."""
    table = _joint_tables.get(scale)
    if table is None:
        table = _joint_tables[scale] = (joint_bin(np.arange(_JOINT_TABLE_SIZE)) * scale).astype(np.int32)
    return table


def _add_joint_bins(key: np.ndarray, tokens: np.ndarray, top: int, scale: int = 1) -> None:
    """key += scale × joint bin of each token count (at most `top`), in place: a table lookup for
    common sizes."""
    table = _joint_table(scale)
    if top < _JOINT_TABLE_SIZE:
        key += table[tokens]
        return
    small = tokens < _JOINT_TABLE_SIZE
    key[small] += table[tokens[small]]
    key[~small] += joint_bin(tokens[~small]) * scale


def _keys(gid: np.ndarray, stride: int, values: np.ndarray | None = None, half: int = 0, cut: np.ndarray | None = None) -> np.ndarray:
    """gid·stride (+ values) (+ half where cut), int64, in as few passes as numpy allows.

    gid should be int64 already (add_batch widens it once): numpy's same-type multiply is about a
    third faster than one that widens int32 as it goes.
    """
    key = gid.astype(np.int64, copy=False) * np.int64(stride)
    if values is not None:
        key += values
    if cut is not None:
        np.add(key, half, out=key, where=cut)
    return key


class _Table:
    """Counts per (group, value) in one growable groups × width int64 array.

    Each batch adds its rows with one `np.add.at` on the combined key group·width + value: O(rows)
    whatever the width, with no per-batch result array to allocate, zero and add (which is what
    made np.bincount 2–4× slower on wide tables such as prompt + output). Values ≥ DENSE_LIMIT go
    to a sparse overflow per group. `halves` = 2 makes a censored table: row 2·route + censored.
    """

    __slots__ = ("counts", "overflow", "halves")

    def __init__(self, halves: int = 1) -> None:
        self.counts = np.zeros((0, 0), np.int64)
        self.overflow: dict[int, list[Histogram]] = {}
        self.halves = halves

    def ensure(self, groups: int, width: int) -> None:
        rows, cols = self.counts.shape
        if groups <= rows and width <= cols:
            return
        grown = np.zeros((max(groups, rows), max(width, 2 * cols)), np.int64)
        grown[:rows, :cols] = self.counts
        self.counts = grown

    def add(self, routes: int, gid: np.ndarray, values: np.ndarray, cut: np.ndarray | None = None, top: int | None = None) -> None:
        """Count `values` (non-negative int64) under route `gid` (< routes), in row
        gid·halves + cut. cut (bool) only for a censored table; `top`: values.max() or a bound
        of it, when the caller knows one."""
        if values.size == 0:
            return
        if top is None or top >= DENSE_LIMIT:
            top = int(values.max())
        if top >= DENSE_LIMIT:
            big = values >= DENSE_LIMIT
            group = gid.astype(np.int64) * self.halves
            if cut is not None:
                group += cut
            for g in np.unique(group[big]):
                self.overflow.setdefault(int(g), []).append(Histogram.of(values[big & (group == g)]))
            keep = ~big
            gid, values = gid[keep], values[keep]
            cut = None if cut is None else cut[keep]
            if values.size == 0:
                return
            top = int(values.max())
        self.ensure(routes * self.halves, top + 1)
        stride = self.counts.shape[1]
        self.add_keys(_keys(gid, self.halves * stride, values, stride, cut))

    def add_keys(self, keys: np.ndarray) -> None:
        """Count precomputed flat keys row·width + value (the table already wide enough)."""
        np.add.at(self.counts.reshape(-1), keys, 1)

    def histogram(self, group: int) -> Histogram:
        h = Histogram.from_dense(self.counts[group]) if group < self.counts.shape[0] else Histogram.empty()
        for extra in self.overflow.get(group, ()):
            h = h.merge(extra)
        return h


class _Vocab:
    """Global ids for the strings of a column, stable across batches."""

    def __init__(self) -> None:
        self.ids: dict[str, int] = {}

    def id(self, name: str) -> int:
        return self.ids.setdefault(name, len(self.ids))

    def encode(self, column: pa.Array) -> tuple[np.ndarray, np.ndarray | None]:
        """(global id per row, int32 or int64, with nulls as 0; valid mask or None when no nulls).

        Works on the dictionary: only its few values go through Python, the rows are one take,
        or none when the dictionary lists the names in id order (the usual case: one file).
        """
        import pyarrow as pa

        from kvtune.ingest import arrays

        if isinstance(column, pa.ChunkedArray):
            column = column.combine_chunks()
        if not pa.types.is_dictionary(column.type):
            import pyarrow.compute as pc

            column = pc.dictionary_encode(column)
        mapping = np.array([self.id(str(s)) for s in column.dictionary.to_pylist()] or [0], np.int64)
        codes, valid = arrays.codes(column.indices)
        if np.array_equal(mapping, np.arange(mapping.size)):
            return codes, valid
        return mapping[codes], valid

    @property
    def names(self) -> list[str]:
        return list(self.ids)


def _censored(column: pa.Array) -> np.ndarray | None:
    """The censored flags, or None when no row is censored (the common case: one cheap pass)."""
    from kvtune.ingest import arrays

    if column.true_count == 0:
        return None
    return arrays.flags(column)


def _where(ok: np.ndarray | None, *arrays: np.ndarray) -> tuple[np.ndarray, ...]:
    """The rows of each array where `ok` (all rows when ok is None or all true)."""
    if ok is None or ok.all():
        return arrays
    return tuple(a[ok] for a in arrays)


class ProfileBuilder:
    """Streaming accumulator: `add_batch` per RecordBatch, then `result()`.

    Rows must already be valid (ingest skips bad ones): output_tokens non-null and ≥ 0. Null or
    negative optional fields are left out of their own histograms only.
    """

    def __init__(self) -> None:
        self._routes, self._finish, self._models = _Vocab(), _Vocab(), _Vocab()
        # censored tables use row 2·route + censored
        self._output, self._total = _Table(halves=2), _Table(halves=2)
        self._prompt, self._max_tokens, self._joint = _Table(), _Table(), _Table()
        self._latency, self._ttft = _Table(), _Table()
        self._finish_counts = np.zeros((0, 0), np.int64)
        self._model_counts = np.zeros((0, 0), np.int64)
        self._seconds: dict[int, list[Histogram]] = {}
        self._first_s: dict[int, float] = {}
        self._last_s: dict[int, float] = {}

    def add_batch(self, batch: pa.RecordBatch) -> None:
        from kvtune.ingest import arrays

        n = batch.num_rows
        if n == 0:
            return
        # columns a log format never fills arrive all-null: skip them without touching the data
        names = {name for name, col in zip(batch.schema.names, batch.columns) if col.null_count < n}
        if "route" in names:
            gid, valid = self._routes.encode(batch.column("route"))
            if valid is not None:
                gid[~valid] = self._routes.id("*")
        else:
            gid = np.full(n, self._routes.id("*"), np.int64)
        gid = gid.astype(np.int64, copy=False)  # once: every table's key starts from it
        groups = len(self._routes.ids)

        output, out_valid = arrays.ints(batch.column("output_tokens"))
        if out_valid is not None or output.min() < 0:
            raise ValueError("output_tokens must be non-null and non-negative (ingest skips such rows)")
        out_top = int(output.max())
        cut = _censored(batch.column("censored")) if "censored" in names else None
        self._output.add(groups, gid, output, cut, out_top)

        if "prompt_tokens" in names:
            prompt, ok = arrays.ints(batch.column("prompt_tokens"))
            if ok is not None or prompt.min() < 0:
                ok = prompt >= 0 if ok is None else ok & (prompt >= 0)
            if ok is not None and ok.all():
                ok = None
            g, p, o = _where(ok, gid, prompt, output)
            c = None if cut is None or ok is None else cut[ok]
            if p.size:
                top = int(p.max())
                self._prompt.add(groups, g, p, top=top)
                self._total.add(groups, g, p + o, cut if ok is None else c, top + out_top)
                # joint cell = prompt bin · width + output bin, both from lookup tables, added
                # straight onto the route's row offset: one key array, no cell array
                self._joint.ensure(groups, _JOINT_WIDTH * _JOINT_WIDTH)
                key = _keys(g, self._joint.counts.shape[1])
                _add_joint_bins(key, p, top, _JOINT_WIDTH)
                _add_joint_bins(key, o, out_top)
                self._joint.add_keys(key)

        if "max_tokens" in names:
            requested, ok = arrays.ints(batch.column("max_tokens"))
            if ok is not None or requested.min() < 0:
                ok = requested >= 0 if ok is None else ok & (requested >= 0)
            self._max_tokens.add(groups, *_where(ok, gid, requested))

        if "finish_reason" in names:
            codes, ok = self._finish.encode(batch.column("finish_reason"))
            self._finish_counts = _count_pairs(
                self._finish_counts, groups, len(self._finish.ids), *_where(ok, gid, codes)
            )
        if "model" in names:
            codes, ok = self._models.encode(batch.column("model"))
            self._model_counts = _count_pairs(
                self._model_counts, groups, len(self._models.ids), *_where(ok, gid, codes)
            )

        if "timestamp_s" in names:
            self._add_arrivals(gid, arrays.floats(batch.column("timestamp_s")))
        for column, table in (("latency_ms", self._latency), ("ttft_ms", self._ttft)):
            if column in names:
                ms = arrays.floats(batch.column(column))
                ok = np.isfinite(ms) & (ms >= 0)
                if ok.any():
                    g, v = _where(ok, gid, ms)
                    table.add(groups, g, log_bin(v))

    def _add_arrivals(self, gid: np.ndarray, ts: np.ndarray) -> None:
        ok = np.isfinite(ts) & (ts >= 0)
        if not ok.any():
            return
        g, t = _where(ok, gid, ts)
        g = g.astype(np.int64, copy=False)
        seconds = np.floor(t).astype(np.int64)
        base = int(seconds.min())
        span = int(seconds.max()) - base + 1
        keys, counts = np.unique(g * span + (seconds - base), return_counts=True)
        owner = keys // span
        bounds = np.searchsorted(owner, np.arange(int(g.max()) + 2))
        firsts = np.full(bounds.size - 1, np.inf)
        lasts = np.full(bounds.size - 1, -np.inf)
        np.minimum.at(firsts, g, t)
        np.maximum.at(lasts, g, t)
        for r in np.flatnonzero(np.diff(bounds)):
            r = int(r)
            lo, hi = bounds[r], bounds[r + 1]
            pending = self._seconds.setdefault(r, [])
            pending.append(Histogram(keys[lo:hi] - r * span + base, counts[lo:hi]))
            if len(pending) > 64:  # keep the pending list short: fold it
                self._seconds[r] = [_merge_all(pending)]
            self._first_s[r] = min(self._first_s.get(r, np.inf), float(firsts[r]))
            self._last_s[r] = max(self._last_s.get(r, -np.inf), float(lasts[r]))

    def result(
        self,
        inputs: Sequence[InputFile] = (),
        skipped: dict[str, int] | None = None,
        skip_examples: dict[str, str] | None = None,
    ) -> Profile:
        """Freeze the counts so far into a Profile (the builder can keep adding afterwards)."""
        finish_names, model_names = self._finish.names, self._models.names
        routes = []
        for name, gid in self._routes.ids.items():
            output = CensoredHistogram(self._output.histogram(2 * gid), self._output.histogram(2 * gid + 1))
            if output.total == 0:
                continue
            cells = self._joint.histogram(gid)
            arrival = None
            if gid in self._seconds:
                arrival = Arrival(_merge_all(self._seconds[gid]), self._first_s[gid], self._last_s[gid])
            latency, ttft = self._latency.histogram(gid), self._ttft.histogram(gid)
            routes.append(
                RouteProfile(
                    route=name,
                    output=output,
                    total=CensoredHistogram(self._total.histogram(2 * gid), self._total.histogram(2 * gid + 1)),
                    prompt=self._prompt.histogram(gid),
                    max_tokens=self._max_tokens.histogram(gid),
                    joint=JointHistogram(cells.values // _JOINT_WIDTH, cells.values % _JOINT_WIDTH, cells.counts),
                    finish_reasons=_names_counts(finish_names, self._finish_counts, gid),
                    models=_names_counts(model_names, self._model_counts, gid),
                    arrival=arrival,
                    latency_ms=LogHistogram(latency) if latency.total else None,
                    ttft_ms=LogHistogram(ttft) if ttft.total else None,
                )
            )
        return Profile(
            routes=tuple(routes),
            inputs=tuple(inputs),
            skipped=dict(skipped or {}),
            skip_examples=dict(skip_examples or {}),
        )


def _merge_all(histograms: Sequence[Histogram]) -> Histogram:
    if len(histograms) == 1:
        return histograms[0]
    return Histogram(
        np.concatenate([h.values for h in histograms]), np.concatenate([h.counts for h in histograms])
    )


def _count_pairs(table: np.ndarray, groups: int, vocab: int, gid: np.ndarray, codes: np.ndarray) -> np.ndarray:
    """Add counts of (route, code) pairs to a routes × vocab table, growing it as needed."""
    if table.shape != (groups, vocab):
        grown = np.zeros((groups, vocab), np.int64)
        grown[: table.shape[0], : table.shape[1]] = table
        table = grown
    if gid.size:
        key = _keys(gid, vocab, codes)
        table += np.bincount(key, minlength=groups * vocab).reshape(groups, vocab)
    return table


def _names_counts(names: list[str], table: np.ndarray, gid: int) -> dict[str, int]:
    if gid >= table.shape[0]:
        return {}
    row = table[gid]
    return dict(sorted((names[i], int(row[i])) for i in np.flatnonzero(row)))


# ---------------------------------------------------------------------------------------------
# I/O edges: logs → profile, saved profiles

ProgressCallback = Callable[..., Any]


def profile_logs(
    paths: Sequence[str],
    options: Any,
    *,
    progress: ProgressCallback | None = None,
    trace_max_is_cap: bool = False,
) -> Profile:
    """Read logs through `kvtune.ingest` and profile them; skipped rows are kept in the profile.

    trace_max_is_cap: for traces without finish reasons whose largest output is a generation
    cap (Mooncake conversation: 30 rows at exactly 2000), read twice: once to find the largest
    output, then with outputs at that value treated as cut (ingest's assume_cap).
    """
    profile = _profile_once(paths, options, progress)
    if trace_max_is_cap and profile.routes:
        import dataclasses

        top = max(r.output.observed.max or 0 for r in profile.routes)
        if top > 0:
            profile = _profile_once(paths, dataclasses.replace(options, assume_cap=top), progress)
    return profile


def _profile_once(paths: Sequence[str], options: Any, progress: ProgressCallback | None) -> Profile:
    from kvtune.ingest import read_logs

    batches, stats = read_logs(list(paths), options, progress=progress, prefetch=PREFETCH_BATCHES)
    builder = ProfileBuilder()
    for batch in batches:
        builder.add_batch(batch)
    inputs = [InputFile(str(f.path), str(f.format), int(f.rows)) for f in stats.files]
    return builder.result(
        inputs=inputs, skipped=dict(stats.skipped), skip_examples=dict(getattr(stats, "examples", {}))
    )


def load_profile(path: str | os.PathLike[str]) -> Profile:
    """Read a saved profile (a regular file of strict JSON, at most PROFILE_MAX_BYTES); any problem
    is an InputError naming the file and field."""
    from kvtune import userfiles

    where = str(path)
    data = userfiles.load_json(path, max_bytes=userfiles.PROFILE_MAX_BYTES)
    try:
        return Profile.from_dict(data)
    except KvtuneError as exc:
        raise InputError(exc.message, path=where, field=exc.field) from exc
    except ValueError as exc:  # histogram invariants
        raise InputError(str(exc), path=where) from exc


def save_profile(profile: Profile, path: str | os.PathLike[str]) -> None:
    write_text_atomic(path, json.dumps(profile.to_dict(), separators=(",", ":")) + "\n")


def is_saved_profile(path: str | os.PathLike[str]) -> bool:
    """A regular .json file whose first bytes announce a kvtune profile (cheap: reads 256 bytes)."""
    from kvtune.userfiles import read_head

    if Path(path).suffix.lower() != ".json":
        return False
    head = read_head(path, 256)
    return head is not None and b'"kind"' in head and b"kvtune-profile" in head


def load_profile_or_logs(
    paths: Sequence[str], options: Any = None, *, progress: ProgressCallback | None = None
) -> Profile:
    """For later commands: one saved-profile .json loads it; anything else is read as logs."""
    if len(paths) == 1 and is_saved_profile(paths[0]):
        return load_profile(paths[0])
    if options is None:
        from kvtune.ingest import IngestOptions

        options = IngestOptions()
    return profile_logs(paths, options, progress=progress)


def merge_saved(paths: Iterable[str]) -> Profile:
    """Merge saved profiles exactly."""
    merged = Profile(routes=())
    for path in paths:
        merged = merged.merge(load_profile(path))
    return merged
