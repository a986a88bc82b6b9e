"""Build profiles from normalized log batches, and load or save them.

`ProfileBuilder.add_batch` folds one pyarrow RecordBatch (columns of `kvtune.ingest.COLUMNS`)
into per-route counts with a handful of vectorized numpy passes, so memory is bounded by what
the routes have seen, not by rows. A busy route counts in dense arrays (one row per histogram,
one np.add.at per batch); a route with few rows counts sparse (sorted keys), so 100k routes of a
few rows each cost a few hundred bytes apiece, not a dense row of every histogram (~70 KB).
`result()` freezes the counts into a `Profile`, keeping the `max_routes` busiest routes and
folding the rest into `*`.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from kvtune import userfiles
from kvtune.domain.log_reading import DEFAULT_MAX_ROUTES as MAX_ROUTES
from kvtune.errors import InputError, KvtuneError
from kvtune.ingest.window import WindowReport
from kvtune.profile import counting
from kvtune.profile.histogram import (
    JOINT_EDGES,
    MAX_LATENCY_MS,
    Histogram,
    JointHistogram,
    LogHistogram,
    distinct,
    joint_bin,
    log_bin,
)
from kvtune.profile.logged_model import ModelSelection, same_model
from kvtune.profile.routes import (
    Arrival,
    CensoredHistogram,
    InputFile,
    Profile,
    RouteProfile,
    busiest_routes,
)
from kvtune.userfiles import read_head

if TYPE_CHECKING:  # pragma: no cover
    import pyarrow as pa

    from kvtune.ingest import IngestOptions, IngestStats

__all__ = [
    "MAX_ROUTES",
    "ProfileBuilder",
    "profile_read",
    "load_profile",
    "save_profile",
    "is_saved_profile",
]

#: Token counts at or above this go to a sparse overflow instead of the dense arrays, so one
#: absurd row (10^12 tokens) cannot allocate terabytes. 4M tokens is beyond any context window.
DENSE_LIMIT = 1 << 22
_VALUE_BITS = 22  # sparse keys: (route row << _VALUE_BITS) | value, for values below DENSE_LIMIT

#: A route counts sparse until it has this many rows, then gets a dense row in every table: at
#: ~8 bytes per sparse entry and a few entries per row, about where a dense row costs as much.
DENSE_ROWS = 4096
#: Each table's dense array stays within this: routes beyond it stay sparse (exact, slower to
#: add), and values beyond the width it allows go sparse too, so a log of many busy routes or a
#: wide one (128k-token prompts) cannot grow dense rows without bound.
DENSE_TABLE_BYTES = 128 << 20


_SECOND_BITS = 38  # arrival keys: (route << _SECOND_BITS) | whole second; 2^38 s is past year 9999
_MAX_ARRIVAL_ROUTES = 1 << (63 - _SECOND_BITS)

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


def _keys(
    gid: np.ndarray, stride: int, values: np.ndarray | None = None, half: int = 0, cut: np.ndarray | None = None
) -> np.ndarray:
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


class _Sparse:
    """Counts of int64 keys: sorted unique keys with their counts, plus keys not yet merged in.

    Pending keys are merged (one sort) once they outnumber the merged ones, so adding n keys
    costs O(n log n) in all and memory stays at the number of distinct keys plus one batch.
    """

    __slots__ = ("keys", "counts", "pending", "pending_size")

    def __init__(self) -> None:
        self.keys = np.zeros(0, np.int64)
        self.counts = np.zeros(0, np.int64)
        self.pending: list[tuple[np.ndarray, np.ndarray | None]] = []
        self.pending_size = 0

    def add(self, keys: np.ndarray, counts: np.ndarray | None = None) -> None:
        """Count each key once, or `counts` times."""
        if keys.size == 0:
            return
        self.pending.append((keys.astype(np.int64, copy=False), counts))
        self.pending_size += keys.size
        if self.pending_size > max(1 << 20, self.keys.size):
            self.merge()

    def merge(self) -> tuple[np.ndarray, np.ndarray]:
        """(sorted unique keys, counts) of everything added."""
        if self.pending:
            keys = np.concatenate([self.keys, *(k for k, _ in self.pending)])
            counts = np.concatenate(
                [self.counts, *(np.ones(k.size, np.int64) if c is None else c for k, c in self.pending)]
            )
            order = np.argsort(keys, kind="stable")
            keys, counts = keys[order], counts[order]
            starts = np.flatnonzero(np.concatenate([[True], keys[1:] != keys[:-1]]))
            self.keys, self.counts = keys[starts], np.add.reduceat(counts, starts)
            self.pending, self.pending_size = [], 0
        return self.keys, self.counts


class _Routes:
    """Route ids, and which routes count densely.

    Each table takes per row an id: the route's dense slot (≥ 0), or −(gid + 1) while the route
    counts sparse. A route gets a slot once it has DENSE_ROWS rows, busiest first, if every
    table can hold one more dense row within DENSE_TABLE_BYTES.
    """

    def __init__(self) -> None:
        self.vocab = _Vocab()
        self.rows = np.zeros(0, np.int64)  # rows counted sparse, per gid (what promotion looks at)
        self.slot = np.zeros(0, np.int64)  # dense slot per gid; -1 while sparse
        self.gid_of_slot = np.zeros(0, np.int64)
        self.slots = 0

    def ids(self, gid: np.ndarray, tables: Sequence[_Table],
            known: np.ndarray | None = None) -> tuple[np.ndarray, bool]:
        """(id per row, whether every row's route is dense) for a batch's global route ids; `known`:
        the rows' slots when the caller has them already (`slots_of`)."""
        groups = len(self.vocab.ids)
        if self.slot.size < groups:
            grow = max(groups, 2 * self.slot.size) - self.slot.size
            self.slot = np.concatenate([self.slot, np.full(grow, -1, np.int64)])
            self.rows = np.concatenate([self.rows, np.zeros(grow, np.int64)])
        ids = self.slot[gid] if known is None else known
        if ids.min() >= 0:
            return ids, True
        sparse = ids < 0
        g = gid[sparse]
        np.add.at(self.rows, g, 1)
        hot = g[self.rows[g] >= DENSE_ROWS]  # rows of routes that have enough now
        ready = np.flatnonzero(np.bincount(hot, minlength=groups)) if hot.size > groups else distinct(hot)
        ready = ready[self.slot[ready] < 0]
        if ready.size:
            for route in ready[np.argsort(-self.rows[ready], kind="stable")]:  # busiest first
                if not all(t.can_hold(self.slots + 1) for t in tables):
                    break
                self.slot[route] = self.slots
                self.gid_of_slot = np.append(self.gid_of_slot, route)
                self.slots += 1
            ids = self.slot[gid]
            sparse = ids < 0
            if not sparse.any():
                return ids, True
        return np.where(sparse, -gid - 1, ids), False

    def slots_of(self, codes: np.ndarray, mapping: np.ndarray) -> np.ndarray | None:
        """Each row's dense slot (−1: sparse) straight from its dictionary code, slot[mapping][codes]:
        one take of the rows instead of global ids, then slots; None when the dictionary names a
        route past the slots kept so far."""
        if int(mapping.max()) >= self.slot.size:
            return None
        return self.slot[mapping][codes]

    def gids(self, ids: np.ndarray) -> np.ndarray:
        """The global route id of each row id."""
        dense = ids >= 0
        return np.where(dense, self.gid_of_slot[np.where(dense, ids, 0)] if self.slots else 0, -ids - 1)


class _Table:
    """Counts per (route row, value) for one histogram: route row = gid·halves + censored.

    Dense routes count in one slots·halves × width int64 array: a batch adds its rows with one
    `np.add.at` on the combined key slot·width + value, O(rows) whatever the width, with no
    per-batch result array to allocate, zero and add (which made np.bincount 2–4× slower on wide
    tables such as prompt + output). Everything else is sparse (`_Sparse`): routes without a
    slot, and values past the width DENSE_TABLE_BYTES allows; values ≥ DENSE_LIMIT go to a
    per-row overflow. A histogram is the sum of the three. `halves` = 2 makes a censored table;
    `bincount` adds with np.bincount (narrow tables such as finish reasons per route).
    """

    __slots__ = ("counts", "sparse", "overflow", "halves", "bincount")

    def __init__(self, halves: int = 1, bincount: bool = False) -> None:
        self.counts = np.zeros((0, 0), np.int64)
        self.sparse = _Sparse()
        self.overflow: dict[int, list[Histogram]] = {}
        self.halves = halves
        self.bincount = bincount

    def can_hold(self, slots: int) -> bool:
        """Whether `slots` dense routes fit the budget at the current width."""
        return slots * self.halves * max(self.counts.shape[1], 1) * 8 <= DENSE_TABLE_BYTES

    def _grow(self, slots: int, width: int) -> int:
        """Room for `slots` dense routes and, within the budget, values below `width`; returns
        the width the dense rows now have (values at or past it count sparse)."""
        rows, cols = self.counts.shape
        need = slots * self.halves
        if need <= rows and width <= cols:
            return cols
        new_rows = rows if need <= rows else max(need, 2 * rows)
        if new_rows * max(cols, 1) * 8 > DENSE_TABLE_BYTES:
            new_rows = max(need, rows)
        new_cols = cols
        if width > cols:
            new_cols = min(max(width, 2 * cols), DENSE_LIMIT)
            room = DENSE_TABLE_BYTES // (8 * max(new_rows, 1))
            new_cols = max(cols, min(new_cols, room if room >= width else max(room, cols)))
        grown = np.zeros((new_rows, new_cols), np.int64)
        grown[:rows, :cols] = self.counts
        self.counts = grown
        return new_cols

    def add(self, routes: _Routes, ids: np.ndarray, values: np.ndarray, all_dense: bool,
            cut: np.ndarray | None = None, top: int | None = None) -> None:
        """Count `values` (non-negative int64) under their route ids (`_Routes.ids`), in row
        route·halves + cut; `top`: values.max() or a bound of it, when the caller knows one."""
        if values.size == 0:
            return
        if top is None or top >= DENSE_LIMIT:
            top = int(values.max())
        if top >= DENSE_LIMIT:
            big = values >= DENSE_LIMIT
            group = routes.gids(ids[big]) * self.halves
            if cut is not None:
                group += cut[big]
            for g in distinct(group):
                self.overflow.setdefault(int(g), []).append(Histogram.of(values[big][group == g]))
            keep = ~big
            ids, values = ids[keep], values[keep]
            cut = None if cut is None else cut[keep]
            if values.size == 0:
                return
            top = int(values.max())
        if not all_dense:
            dense = ids >= 0
            self.add_sparse(-ids[~dense] - 1, values[~dense], None if cut is None else cut[~dense])
            if not dense.any():
                return
            ids, values = ids[dense], values[dense]
            cut = None if cut is None else cut[dense]
        width = self._grow(routes.slots, top + 1)
        if top >= width:  # past the width the budget allows: those values count sparse
            wide = values >= width
            self.add_sparse(routes.gid_of_slot[ids[wide]], values[wide], None if cut is None else cut[wide])
            ids, values = ids[~wide], values[~wide]
            cut = None if cut is None else cut[~wide]
        if counting.available():  # one pass without the GIL: counts beside the reader thread's decoding
            counting.add_counts(self.counts, ids, self.halves * width, values, cut, width)
        else:
            self.add_keys(_keys(ids, self.halves * width, values, width, cut))

    def add_keys(self, keys: np.ndarray) -> None:
        """Count precomputed dense keys row·width + value (the table already wide enough)."""
        if self.bincount:
            self.counts += np.bincount(keys, minlength=self.counts.size).reshape(self.counts.shape)
        else:
            np.add.at(self.counts.reshape(-1), keys, 1)

    def add_sparse(self, gid: np.ndarray, values: np.ndarray, cut: np.ndarray | None) -> None:
        """Count values below DENSE_LIMIT under global route ids, sparse."""
        if gid.size:
            row = gid * self.halves if cut is None else gid * self.halves + cut
            self.sparse.add((row << _VALUE_BITS) | values)

    def requests(self, routes: _Routes, groups: int) -> np.ndarray:
        """Counts per global route id (all values, both halves)."""
        total = np.zeros(groups, np.int64)
        slots = min(routes.slots, self.counts.shape[0] // self.halves)
        if slots:
            dense = self.counts[: slots * self.halves].sum(axis=1).reshape(slots, self.halves).sum(axis=1)
            total[routes.gid_of_slot[:slots]] += dense
        keys, counts = self.sparse.merge()
        np.add.at(total, (keys >> _VALUE_BITS) // self.halves, counts)
        for row, parts in self.overflow.items():
            total[row // self.halves] += sum(h.total for h in parts)
        return total

    def histograms(self, routes: _Routes, out_of_gid: np.ndarray, n_out: int) -> list[Histogram]:
        """One Histogram per output row out·halves + cut, where route gid goes to out_of_gid[gid]
        (several routes to one output row: folding sums them exactly)."""
        size = n_out * self.halves
        dense: list[np.ndarray | None] = [None] * size
        parts: list[list[Histogram]] = [[] for _ in range(size)]
        for s in range(min(routes.slots, self.counts.shape[0] // self.halves)):  # slots this table has rows for
            out = int(out_of_gid[routes.gid_of_slot[s]]) * self.halves
            for h in range(self.halves):
                row = self.counts[s * self.halves + h]
                dense[out + h] = row if dense[out + h] is None else dense[out + h] + row
        keys, counts = self.sparse.merge()
        if keys.size:
            row = keys >> _VALUE_BITS
            out_row = out_of_gid[row // self.halves] * self.halves + row % self.halves
            order = np.argsort(out_row, kind="stable")
            out_row, values, counts = out_row[order], (keys & (DENSE_LIMIT - 1))[order], counts[order]
            bounds = np.searchsorted(out_row, np.arange(size + 1))
            for r in np.flatnonzero(np.diff(bounds)):
                lo, hi = bounds[r], bounds[r + 1]
                parts[r].append(Histogram(values[lo:hi], counts[lo:hi]))
        for row, extra in self.overflow.items():
            parts[int(out_of_gid[row // self.halves]) * self.halves + row % self.halves].extend(extra)
        result: list[Histogram] = []
        for d, extra in zip(dense, parts, strict=True):
            histogram = Histogram.from_dense(d) if d is not None else Histogram.empty()
            for e in extra:
                histogram = histogram.merge(e)
            result.append(histogram)
        return result


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
        codes, mapping, valid = self.dictionary_codes(column)
        if np.array_equal(mapping, np.arange(mapping.size)):
            return codes, valid
        return mapping[codes], valid

    def dictionary_codes(self, column: pa.Array) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """(dictionary code per row, with nulls as 0; global id of each code, int64; valid mask or
        None): global ids are mapping[codes], taken only where a caller needs them."""
        import pyarrow as pa

        from kvtune.ingest import arrays  # pyarrow, only when logs are read

        if isinstance(column, pa.ChunkedArray):
            column = column.combine_chunks()
        if not pa.types.is_dictionary(column.type):
            import pyarrow.compute as pc

            column = pc.dictionary_encode(column)
        mapping = np.array([self.id(str(s)) for s in column.dictionary.to_pylist()] or [0], np.int64)
        codes, valid = arrays.codes(column.indices)
        return codes, mapping, valid

    @property
    def names(self) -> list[str]:
        return list(self.ids)


def _censored(column: pa.Array) -> np.ndarray | None:
    """The censored flags, or None when no row is censored (the common case: one cheap pass)."""
    from kvtune.ingest import arrays  # pyarrow, only when logs are read

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
    negative optional fields are left out of their own histograms only. `max_routes`: how many
    routes `result()` keeps (the busiest; the rest fold into `*`); None keeps them all.
    `log_model`: count only the rows naming this logged model (ignoring case), and how many rows
    of each other model (or of none) were left out (`kvtune.profile.logged_model`).
    """

    def __init__(self, max_routes: int | None = MAX_ROUTES, log_model: str | None = None) -> None:
        if max_routes is not None and max_routes < 1:
            raise ValueError("max_routes must be at least 1")
        self.max_routes = max_routes
        self.log_model = log_model
        self._left_out: Counter[str] = Counter()
        self._unnamed_rows = 0
        self._routes, self._finish, self._models = _Routes(), _Vocab(), _Vocab()
        # censored tables use row 2·route + censored
        self._output, self._total = _Table(halves=2), _Table(halves=2)
        self._prompt, self._max_tokens, self._joint = _Table(), _Table(), _Table()
        self._latency, self._ttft = _Table(), _Table()
        self._finish_counts, self._model_counts = _Table(bincount=True), _Table(bincount=True)
        self._tables = (self._output, self._total, self._prompt, self._max_tokens, self._joint,
                        self._latency, self._ttft, self._finish_counts, self._model_counts)
        self._arrivals = _Sparse()  # (route << _SECOND_BITS) | whole second
        self._first_s = np.zeros(0)
        self._last_s = np.zeros(0)

    def add_batch(self, batch: pa.RecordBatch) -> None:
        from kvtune.ingest import arrays  # pyarrow, only when logs are read

        if self.log_model is not None:
            batch = self._select_model(batch)
        n = batch.num_rows
        if n == 0:
            return
        # columns a log format never fills arrive all-null: skip them without touching the data
        names = {name for name, col in zip(batch.schema.names, batch.columns, strict=True) if col.null_count < n}
        routes = self._routes
        vocab = routes.vocab
        ids = slots = gid = None  # gid: global route id per row, int64, taken only where needed
        if "route" in names:
            codes, mapping, valid = vocab.dictionary_codes(batch.column("route"))
            slots = routes.slots_of(codes, mapping) if valid is None else None
            if slots is not None and slots.min() >= 0:  # the usual case: every row's route dense already
                ids = slots
            if ids is None or "timestamp_s" in names:
                gid = codes if np.array_equal(mapping, np.arange(mapping.size)) else mapping[codes]
                if valid is not None:
                    gid[~valid] = vocab.id("*")
                gid = gid.astype(np.int64, copy=False)  # once: every table's key starts from it
        else:
            gid = np.full(n, vocab.id("*"), np.int64)

        output, out_valid = arrays.ints(batch.column("output_tokens"))
        if out_valid is not None or output.min() < 0:
            raise ValueError("output_tokens must be non-null and non-negative (ingest skips such rows)")
        if ids is not None:
            dense = True
        else:
            assert gid is not None
            ids, dense = routes.ids(gid, self._tables, slots)
        out_top = int(output.max())
        cut = _censored(batch.column("censored")) if "censored" in names else None
        self._output.add(routes, ids, output, dense, cut, out_top)

        if "prompt_tokens" in names:
            prompt, ok = arrays.ints(batch.column("prompt_tokens"))
            if ok is not None or prompt.min() < 0:
                ok = prompt >= 0 if ok is None else ok & (prompt >= 0)
            if ok is not None and ok.all():
                ok = None
            i, p, o = _where(ok, ids, prompt, output)
            c = None if cut is None or ok is None else cut[ok]
            if p.size:
                top = int(p.max())
                self._prompt.add(routes, i, p, dense, top=top)
                self._total.add(routes, i, p + o, dense, cut if ok is None else c, top + out_top)
                joint_cells = _JOINT_WIDTH * _JOINT_WIDTH
                wide = self._joint._grow(routes.slots, joint_cells) if dense else 0
                if wide >= joint_cells and counting.available() and max(top, out_top) < _JOINT_TABLE_SIZE:
                    counting.add_pair_counts(self._joint.counts, i, wide, p, o, _joint_table(1), _JOINT_WIDTH)
                elif wide >= joint_cells:
                    # joint cell = prompt bin · width + output bin, both from lookup tables, added
                    # straight onto the route's row offset: one key array, no cell array
                    key = _keys(i, self._joint.counts.shape[1])
                    _add_joint_bins(key, p, top, _JOINT_WIDTH)
                    _add_joint_bins(key, o, out_top)
                    self._joint.add_keys(key)
                else:
                    cell = np.zeros(p.size, np.int64)
                    _add_joint_bins(cell, p, top, _JOINT_WIDTH)
                    _add_joint_bins(cell, o, out_top)
                    self._joint.add(routes, i, cell, dense, top=joint_cells - 1)

        if "max_tokens" in names:
            requested, ok = arrays.ints(batch.column("max_tokens"))
            if ok is not None or requested.min() < 0:
                ok = requested >= 0 if ok is None else ok & (requested >= 0)
            i, r = _where(ok, ids, requested)
            self._max_tokens.add(routes, i, r, dense)

        for column, table, labels in (("finish_reason", self._finish_counts, self._finish),
                                      ("model", self._model_counts, self._models)):
            if column in names:
                codes, ok = labels.encode(batch.column(column))
                i, c = _where(ok, ids, codes)
                table.add(routes, i, c.astype(np.int64, copy=False), dense, top=len(labels.ids) - 1)

        if "timestamp_s" in names:
            assert gid is not None
            self._add_arrivals(gid, arrays.floats(batch.column("timestamp_s")))
        for column, table in (("latency_ms", self._latency), ("ttft_ms", self._ttft)):
            if column in names:
                ms = arrays.floats(batch.column(column))
                ok = np.isfinite(ms) & (ms >= 0) & (ms <= MAX_LATENCY_MS)
                if ok.any():
                    i, v = _where(ok, ids, ms)
                    table.add(routes, i, log_bin(v), dense)

    def _select_model(self, batch: pa.RecordBatch) -> pa.RecordBatch:
        """The rows naming `log_model`; the others counted by their model (or as unnamed)."""
        import pyarrow as pa
        import pyarrow.compute as pc

        assert self.log_model is not None
        if batch.schema.get_field_index("model") < 0 or batch.column("model").null_count == batch.num_rows:
            self._unnamed_rows += batch.num_rows
            return batch.slice(0, 0)
        column = batch.column("model")
        if not pa.types.is_dictionary(column.type):
            column = pc.dictionary_encode(column)
        names = column.dictionary.to_pylist()
        wanted = pa.array([same_model(str(name), self.log_model) for name in names], pa.bool_())
        keep = pc.fill_null(pc.take(wanted, column.indices), False)
        if keep.true_count == batch.num_rows:
            return batch
        self._unnamed_rows += column.null_count
        other = pc.drop_null(pc.filter(column.indices, pc.invert(keep)))
        if len(other):
            codes, counts = np.unique(other.to_numpy(zero_copy_only=False), return_counts=True)
            for code, count in zip(codes.tolist(), counts.tolist(), strict=True):
                self._left_out[str(names[code])] += count
        return batch.filter(keep)

    def _add_arrivals(self, gid: np.ndarray, ts: np.ndarray) -> None:
        ok = np.isfinite(ts) & (ts >= 0) & (ts < 2.0**_SECOND_BITS)
        if not ok.any():
            return
        g, t = _where(ok, gid, ts)
        groups = len(self._routes.vocab.ids)
        if groups > _MAX_ARRIVAL_ROUTES:
            raise InputError(f"more than {_MAX_ARRIVAL_ROUTES:,} distinct routes: route by a field with fewer "
                             "values (--route-by)", field="route")
        keys, counts = np.unique((g << _SECOND_BITS) | np.floor(t).astype(np.int64), return_counts=True)
        self._arrivals.add(keys, counts)
        if self._first_s.size < groups:
            grow = max(groups, 2 * self._first_s.size) - self._first_s.size
            self._first_s = np.concatenate([self._first_s, np.full(grow, np.inf)])
            self._last_s = np.concatenate([self._last_s, np.full(grow, -np.inf)])
        np.minimum.at(self._first_s, g, t)
        np.maximum.at(self._last_s, g, t)

    def result(
        self,
        inputs: Sequence[InputFile] = (),
        skipped: dict[str, int] | None = None,
        skip_examples: dict[str, str] | None = None,
    ) -> Profile:
        """Freeze the counts so far into a Profile (the builder can keep adding afterwards).

        Beyond `max_routes` routes, the busiest keep their own profile (exact) and the others
        are summed into `*` (exact too: histograms merge by addition); the profile says how many.
        """
        routes = self._routes
        names = routes.vocab.names
        groups = len(names)
        requests = self._output.requests(routes, groups)
        present = {names[g]: int(requests[g]) for g in np.flatnonzero(requests)}
        kept = busiest_routes(present, self.max_routes) if self.max_routes is not None else set(present)
        folded = {name: n for name, n in present.items() if name not in kept and name != "*"}
        out_names = sorted(kept | ({"*"} if folded else set()))
        index = {name: i for i, name in enumerate(out_names)}
        star = index.get("*", -1)
        out_of_gid = np.array([index.get(name, star) for name in names] or [0], np.int64)
        out_of_gid[out_of_gid < 0] = 0  # routes without requests: counted nowhere, mapped anywhere
        n_out = len(out_names)

        output = self._output.histograms(routes, out_of_gid, n_out)
        total = self._total.histograms(routes, out_of_gid, n_out)
        prompt = self._prompt.histograms(routes, out_of_gid, n_out)
        max_tokens = self._max_tokens.histograms(routes, out_of_gid, n_out)
        joint = self._joint.histograms(routes, out_of_gid, n_out)
        latency = self._latency.histograms(routes, out_of_gid, n_out)
        ttft = self._ttft.histograms(routes, out_of_gid, n_out)
        finish = self._finish_counts.histograms(routes, out_of_gid, n_out)
        models = self._model_counts.histograms(routes, out_of_gid, n_out)
        arrivals = self._arrival_profiles(out_of_gid, n_out)
        finish_names, model_names = self._finish.names, self._models.names
        built = []
        for i, name in enumerate(out_names):
            cells = joint[i]
            built.append(
                RouteProfile(
                    route=name,
                    output=CensoredHistogram(output[2 * i], output[2 * i + 1]),
                    total=CensoredHistogram(total[2 * i], total[2 * i + 1]),
                    prompt=prompt[i],
                    max_tokens=max_tokens[i],
                    joint=JointHistogram(cells.values // _JOINT_WIDTH, cells.values % _JOINT_WIDTH, cells.counts),
                    finish_reasons=_names_counts(finish_names, finish[i]),
                    models=_names_counts(model_names, models[i]),
                    arrival=arrivals[i],
                    latency_ms=LogHistogram(latency[i]) if latency[i].total else None,
                    ttft_ms=LogHistogram(ttft[i]) if ttft[i].total else None,
                )
            )
        return Profile(
            routes=tuple(built),
            inputs=tuple(inputs),
            skipped=dict(skipped or {}),
            skip_examples=dict(skip_examples or {}),
            folded_routes=len(folded),
            folded_requests=sum(folded.values()),
            log_model=(None if self.log_model is None
                       else ModelSelection(self.log_model, dict(self._left_out), self._unnamed_rows)),
        )

    def _arrival_profiles(self, out_of_gid: np.ndarray, n_out: int) -> list[Arrival | None]:
        keys, counts = self._arrivals.merge()
        found: list[Arrival | None] = [None] * n_out
        if not keys.size:
            return found
        gid = keys >> _SECOND_BITS
        out = out_of_gid[gid]
        order = np.argsort(out, kind="stable")
        out, seconds, counts = out[order], (keys & ((1 << _SECOND_BITS) - 1))[order], counts[order]
        bounds = np.searchsorted(out, np.arange(n_out + 1))
        first = np.full(n_out, np.inf)
        last = np.full(n_out, -np.inf)
        seen = distinct(gid)
        np.minimum.at(first, out_of_gid[seen], self._first_s[seen])
        np.maximum.at(last, out_of_gid[seen], self._last_s[seen])
        for r in np.flatnonzero(np.diff(bounds)):
            lo, hi = bounds[r], bounds[r + 1]
            found[r] = Arrival(Histogram(seconds[lo:hi], counts[lo:hi]), float(first[r]), float(last[r]))
        return found


def _names_counts(names: list[str], counts: Histogram) -> dict[str, int]:
    return dict(sorted((names[int(v)], int(c)) for v, c in zip(counts.values, counts.counts, strict=True)))


# ---------------------------------------------------------------------------------------------
# I/O edges: batches as read → a profile (logs.py drives the reading), saved profiles

ProgressCallback = Callable[[int, int], None]  # (bytes read, bytes in all), as kvtune.ingest.read_logs calls it


def profile_read(batches: Iterable[pa.RecordBatch], stats: IngestStats, options: IngestOptions,
                 max_routes: int | None) -> Profile:
    """The profile of batches as they are read (stats fill in as they come): inputs, skips and,
    with a window, what it left out."""
    builder = ProfileBuilder(max_routes, log_model=options.log_model)
    for batch in batches:
        builder.add_batch(batch)
    inputs = [InputFile(str(f.path), str(f.format), int(f.rows)) for f in stats.files]
    profile = replace(builder.result(inputs=inputs, skipped=dict(stats.skipped), skip_examples=dict(stats.examples)),
                      skipped_files=tuple(stats.skipped_files))
    if options.window is None:
        return profile

    return replace(profile, window=WindowReport.of(options.window, len(stats.pruned), stats.outside_window))


def load_profile(path: str | os.PathLike[str]) -> Profile:
    """Read a saved profile (a regular file of strict JSON, at most PROFILE_MAX_BYTES); any problem
    is an InputError naming the file and field."""
    where = str(path)
    data = userfiles.load_json(path, max_bytes=userfiles.PROFILE_MAX_BYTES)
    try:
        return Profile.from_dict(data)
    except KvtuneError as exc:
        raise InputError(exc.message, path=where, field=exc.field) from exc
    except ValueError as exc:  # histogram invariants
        raise InputError(str(exc), path=where) from exc


def save_profile(profile: Profile, path: str | os.PathLike[str]) -> None:
    """Write the profile as JSON, whole or not at all (kvtune.writer)."""
    from kvtune.writer import write_text  # tempfile, only when a profile is saved

    write_text(path, json.dumps(profile.to_dict(), separators=(",", ":")) + "\n")


def is_saved_profile(path: str | os.PathLike[str]) -> bool:
    """A regular .json file whose first bytes announce a kvtune profile (cheap: reads 256 bytes)."""
    if Path(path).suffix.lower() != ".json":
        return False
    head = read_head(path, 256)
    return head is not None and b'"kind"' in head and b"kvtune-profile" in head


def merge_saved(paths: Iterable[str]) -> Profile:
    """Merge saved profiles exactly."""
    merged = Profile(routes=())
    for path in paths:
        merged = merged.merge(load_profile(path))
    return merged
