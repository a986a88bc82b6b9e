"""Reading log files into normalized Arrow batches: containers, compression, detection, two paths.

Fast path (flat schemas: kvtune rows, public traces, --field mappings): JSONL is cut into byte
blocks at line ends and each block is scanned by kvtune's C scanner (`flatscan`, several blocks
at once), which takes a block only when it reads every record exactly as the per-line reading
would; any other block is parsed by `pyarrow.json.read_json` with an explicit schema. Where the
scanner is not built (no C compiler at install), JSONL streams through DuckDB's JSON reader
instead (every value as JSON text, converted here under kvtune's rules), handing the rest of the
file to the pyarrow blocks from the first batch that is not entirely clean. CSV streams through
`pyarrow.csv.open_csv`; Parquet through `ParquetFile.iter_batches` by row group. Checks and
normalization work on whole columns (numpy views of Arrow buffers, dictionaries).

Slow path (nested schemas, and any fast block that fails to parse): one record at a time through
the adapter's `rows`, so every bad line is reported with its exact line number. A failed JSON
block is bisected first, so one bad line costs a few re-parses, not a whole block in Python.

Modules: `plan` (detection, the per-file plan), `jsonl` (JSONL paths), `tabular` (CSV and
Parquet), `columns` (checks and normalization shared by all paths); this one runs the plans:
`open_logs`, the Batch API input join and the record (slow) path.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterator, Mapping, Sequence
from typing import Any

import pyarrow as pa

from kvtune.ingest import FileInfo, IngestOptions, IngestStats, OnError, arrays, flatscan
from kvtune.ingest.columns import _TYPES, Records
from kvtune.ingest.jsonl import JsonlPaths
from kvtune.ingest.partitions import partition_keys, prune
from kvtune.ingest.paths import LogFile, SkippedFile, expand_inputs
from kvtune.ingest.plan import FilePlan, _plan, _route_field, check_options
from kvtune.ingest.schemas._base import FLOAT_TARGETS, INT_TARGETS, STR_TARGETS, TEXT_TARGETS, as_bool, flat_rows
from kvtune.ingest.schemas._fields import (
    BAD_TEXT,
    MISSING_OUTPUT,
    NO_TOKENIZER,
    NOT_GENERATION,
    NOT_OBJECT,
    RowError,
    as_float,
    as_int,
    as_str,
    as_time,
    dig,
    is_unicode,
)
from kvtune.ingest.schemas.openai import batch_input_entry
from kvtune.ingest.tabular import TabularPaths
from kvtune.ingest.tokenize import count_tokens, load_tokenizer

SINK_ROWS = 32768  # rows per batch on the slow path
_TEXT_COLUMNS = (*STR_TARGETS, *TEXT_TARGETS, "_route")


def open_logs(
    paths: Sequence[str],
    options: IngestOptions,
    *,
    progress: Callable[[int, int], None] | None = None,
    prefetch: int = 0,
) -> tuple[Iterator[pa.RecordBatch], IngestStats]:
    plans, pruned, skipped = plan_logs(paths, options)
    return open_plans(plans, options, pruned=pruned, skipped_files=skipped, progress=progress, prefetch=prefetch)


def plan_logs(paths: Sequence[str], options: IngestOptions) -> tuple[list[FilePlan], list[LogFile], list[SkippedFile]]:
    """(each file's plan, the files a window pruned, the files left unread: --exclude matched them,
    or kvtune wrote them): every path, option and format is checked here, before a row is read, so a
    typo in the last file fails before any work."""
    check_options(options)
    found, skipped = expand_inputs(paths, options.exclude)
    files, pruned = prune(found, options.window)
    plans = [_plan(p, options) for p in files]
    skipped += [SkippedFile(str(p.path), f"kvtune's own output: {p.kvtune_output}") for p in plans if p.kvtune_output]
    return [p for p in plans if p.kvtune_output is None], pruned, skipped


def open_plans(
    plans: Sequence[FilePlan],
    options: IngestOptions,
    *,
    pruned: Sequence[LogFile] = (),
    skipped_files: Sequence[SkippedFile] = (),
    progress: Callable[[int, int], None] | None = None,
    prefetch: int = 0,
) -> tuple[Iterator[pa.RecordBatch], IngestStats]:
    """Read planned files in order (a parallel map step reads one plan, or one plan's Parquet
    row groups, per task: rows keep the file's own numbers either way)."""
    tokenizer = None
    if options.tokenizer:
        tokenizer = load_tokenizer(options.tokenizer)
    stats = IngestStats(files=[FileInfo(str(p.path), p.format, partitions=partition_keys(p.path)) for p in plans],
                        pruned=[str(p) for p in pruned], skipped_files=list(skipped_files))
    reader = _Reader(options, stats, tokenizer, progress, sum(p.size or 0 for p in plans))
    batches = reader.run(list(plans))
    return (_ahead(batches, prefetch) if prefetch else batches), stats


def _ahead(batches: Generator[pa.RecordBatch, None, None], depth: int) -> Iterator[pa.RecordBatch]:
    """The same batches, produced by a background thread up to `depth` ahead of the consumer.

    Decoding (pyarrow) and much of the numpy work release the GIL, so reading the next batch
    overlaps with aggregating this one. Errors are raised in the consumer, in order; a consumer
    that stops early stops the thread.
    """
    import queue
    import threading

    slots: queue.Queue[tuple[str, Any]] = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def put(item: tuple[str, Any]) -> bool:
        while not stop.is_set():
            try:
                slots.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def produce() -> None:
        try:
            for batch in batches:
                if not put(("batch", batch)):
                    return
            put(("end", None))
        except Exception as exc:  # handed to the consumer, raised there
            put(("error", exc))
        finally:
            batches.close()

    worker = threading.Thread(target=produce, name="kvtune-ingest", daemon=True)
    worker.start()
    try:
        while True:
            kind, value = slots.get()
            if kind == "end":
                return
            if kind == "error":
                raise value
            yield value
    finally:
        stop.set()
        worker.join()


class _Reader(JsonlPaths, TabularPaths):
    """Runs the plans; owns stats, the error policy, the Batch API join and progress."""

    def __init__(
        self,
        options: IngestOptions,
        stats: IngestStats,
        tokenizer: Any,  # a tokenizers.Tokenizer (a library without type information) or None
        progress: Callable[[int, int], None] | None,
        total_bytes: int,
    ) -> None:
        self.options = options
        self.stats = stats
        self.tokenizer = tokenizer
        self.progress = progress
        self.total = total_bytes
        self.done_before = 0  # bytes of files finished
        self.fail = options.on_error is OnError.FAIL or options.strict
        self.batch_inputs: dict[str, dict[str, Any]] = {}
        self.route_field = _route_field(options)

    # -- driver

    def run(self, plans: list[FilePlan]) -> Generator[pa.RecordBatch, None, None]:
        # Batch API inputs first: their url and max_tokens join onto the outputs by custom_id
        order = sorted(range(len(plans)), key=lambda i: plans[i].format != "openai-batch-input")
        for i in order:
            plan, info = plans[i], self.stats.files[i]
            self.info = info
            self.path = str(plan.path)
            if plan.format == "openai-batch-input":
                self._read_batch_input(plan)
            elif plan.container == "parquet":
                yield from self._parquet(plan)
            elif plan.container == "json":
                if plan.document is not None:
                    yield from self._records(plan, ((None, i, r) for i, r in enumerate(plan.document)))
                elif plan.fast:
                    yield from self._json_scan(plan) if flatscan.available() else self._json_duckdb(plan)
                else:
                    yield from self._json_slow(plan)
            else:
                yield from self._csv(plan)
            self.done_before += plan.size or 0
            self._progress(0)

    def _progress(self, pos: int) -> None:
        if self.progress is not None:
            self.progress(min(self.done_before + pos, self.total), self.total)

    # -- Batch API input

    def _read_batch_input(self, plan: FilePlan) -> None:
        for _, _, record in self._json_records(plan):
            if isinstance(record, RowError):
                self.stats.ignored["Batch API input line unreadable"] += 1
                continue
            if not isinstance(record, dict):  # valid JSON, but a string, number or list
                self.stats.ignored["Batch API input line not a JSON object"] += 1
                continue
            try:
                custom_id, extra = batch_input_entry(record)
            except RowError:
                self.stats.ignored["Batch API input line without custom_id"] += 1
                continue
            self.batch_inputs[custom_id] = extra
            self.stats.ignored["Batch API input lines (joined by custom_id)"] += 1
            self.info.rows += 1

    # -- slow path: records one at a time

    def _records(self, plan: FilePlan, records: Records) -> Iterator[pa.RecordBatch]:
        sink = _Sink(self, plan)
        for line, index, record in records:
            if isinstance(record, RowError):
                self.info.rows += 1
                self.stats.rows_read += 1
                self.skip(record.reason, record.message, line, record.field, index)
                continue
            if not isinstance(record, dict):
                self.info.rows += 1
                self.stats.rows_read += 1
                self.skip(NOT_OBJECT, f"not a JSON object: {type(record).__name__}", line, None, index)
                continue
            if plan.flat is not None:
                items = flat_rows(plan.flat, record)
            else:
                assert plan.adapter is not None
                items = plan.adapter.extract(record)
            for item in items:
                if isinstance(item, RowError) and item.reason == NOT_GENERATION:
                    self.stats.ignored[item.message] += 1
                    continue
                self.info.rows += 1
                self.stats.rows_read += 1
                if isinstance(item, RowError):
                    self.skip(item.reason, item.message, line, item.field, index)
                    continue
                try:
                    row = self._complete(item, record, plan)
                except RowError as err:
                    self.skip(err.reason, err.message, line, err.field, index)
                    continue
                sink.add(row, line, index)
                if len(sink) >= SINK_ROWS:
                    yield from sink.flush()
        yield from sink.flush()

    def _complete(self, row: dict[str, Any], record: Mapping[str, Any], plan: FilePlan) -> dict[str, Any]:
        """--field overrides, --route-by FIELD and the Batch API join, on one extracted row."""
        ctx = row.pop("_ctx", record)
        if plan.flat is None:
            for target, source in self.options.fields.items():
                row[target] = _coerce(target, dig(ctx, source), source)
                if target == "output_tokens":
                    row["_out"] = source
        if self.route_field:
            row["_route"] = as_str(dig(ctx, self.route_field), self.route_field)
        custom_id = row.pop("_custom_id", None)
        if custom_id is not None and custom_id in self.batch_inputs:
            for key, value in self.batch_inputs[custom_id].items():
                if value is not None and row.get(key) is None:
                    row[key] = value
        return row

    # -- fast paths: the source field of each target column

    def _sources(self, plan: FilePlan) -> dict[str, str]:
        assert plan.flat is not None
        sources = {t: s for t, s in plan.flat.columns.items() if t in _TYPES}
        if self.route_field:
            sources["_route"] = self.route_field
        return sources


def _coerce(target: str, value: Any, source: str) -> Any:
    if target in INT_TARGETS:
        return as_int(value, source)
    if target == "timestamp_s":
        return as_time(value, source)
    if target in FLOAT_TARGETS:
        return as_float(value, source)
    if target == "censored":
        return as_bool(value, source)
    return as_str(value, source)


class _Sink:
    """Rows from the slow path, tokenized in batches and handed to the shared normalization."""

    def __init__(self, reader: _Reader, plan: FilePlan) -> None:
        self.reader = reader
        self.plan = plan
        self.rows: list[dict[str, Any]] = []
        self.where: list[tuple[int | None, int | None]] = []

    def __len__(self) -> int:
        return len(self.rows)

    def add(self, row: dict[str, Any], line: int | None, index: int | None) -> None:
        for target in _TEXT_COLUMNS:  # adapters that take a string as it is: no lone surrogates
            value = row.get(target)
            if isinstance(value, str) and not is_unicode(value):
                self.reader.skip(BAD_TEXT, "not valid Unicode (a lone surrogate)", line, target, index)
                return
        if row.get("output_tokens") is None:
            if row.get("output_text") is None:
                self.reader.skip(MISSING_OUTPUT, "missing", line, row.get("_out") or "output_tokens", index)
                return
            if self.reader.tokenizer is None:
                self.reader.skip(
                    NO_TOKENIZER, "text but no token counts: pass --tokenizer", line, row.get("_out"), index
                )
                return
        self.rows.append(row)
        self.where.append((line, index))

    def flush(self) -> Iterator[pa.RecordBatch]:
        if not self.rows:
            return
        rows, where = self.rows, self.where
        self.rows, self.where = [], []
        tok = self.reader.tokenizer
        if tok is not None:
            for target, text_key in (("output_tokens", "output_text"), ("prompt_tokens", "prompt_text")):
                need = [i for i, r in enumerate(rows) if r.get(target) is None and r.get(text_key)]
                counts = count_tokens(tok, [rows[i][text_key] for i in need])
                for i, c in zip(need, counts, strict=True):
                    rows[i][target] = c
                if target == "output_tokens":  # empty output text is zero tokens
                    for r in rows:
                        if r.get(target) is None and r.get(text_key) == "":
                            r[target] = 0
        cols = {}
        for t in (*_TYPES,):
            values = [r.get(t) for r in rows]
            if any(v is not None for v in values):
                cols[t] = arrays.from_pylist(values, _TYPES[t])
        sink_plan = FilePlan(self.plan.path, self.plan.container, self.plan.adapter)  # units done
        batch = self.reader._finalize(sink_plan, cols, len(rows), lambda i: where[i])
        if batch is not None:
            yield batch
