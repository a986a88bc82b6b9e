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
"""

from __future__ import annotations

import csv
import io
import json
import os
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from kvtune.errors import InputError, KvtuneError, UnknownNameError
from kvtune.ingest import COLUMNS, FileInfo, IngestOptions, IngestStats, arrays, flatscan
from kvtune.ingest.compression import compression_of, open_bytes
from kvtune.ingest.paths import expand_paths
from kvtune.ingest.schemas import ADAPTERS, BY_NAME, Adapter, Flat
from kvtune.ingest.schemas._base import (
    FLOAT_TARGETS,
    INT_TARGETS,
    STR_TARGETS,
    TARGETS,
    as_bool,
    flat_rows,
)
from kvtune.ingest.schemas._fields import (
    BAD_NUMBER,
    FAILED,
    MALFORMED_CSV,
    MALFORMED_JSON,
    MISSING_OUTPUT,
    NEGATIVE_TOKENS,
    NO_TOKENIZER,
    NOT_GENERATION,
    NOT_OBJECT,
    RowError,
    as_float,
    as_int,
    as_str,
    as_time,
    dig,
)
from kvtune.ingest.schemas.openai import batch_input_entry

BLOCK_BYTES = 4 << 20  # JSONL bytes per pyarrow parse
SCAN_BLOCK_BYTES = 16 << 20  # JSONL bytes per C scan: ~150k rows, so per-batch costs stay small
BISECT_MIN_LINES = 64  # below this a failed block is read line by line
SINK_ROWS = 32768  # rows per batch on the slow path
DUCKDB_BATCH_ROWS = 1 << 19  # rows per Arrow batch from DuckDB's JSON reader
DUCKDB_MEMORY = "1GB"  # DuckDB's own memory limit (it streams; this bounds its buffers)
PARQUET_MIN_BATCH, PARQUET_MAX_BATCH = 1 << 16, 1 << 19  # rows per Parquet batch: a row group within these
HEAD_BYTES = 1 << 20  # bytes read for detection
SAMPLE_RECORDS = 200

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
_SCAN_KINDS = {pa.int64(): flatscan.INT, pa.float64(): flatscan.FLOAT, pa.string(): flatscan.LABEL, pa.bool_(): flatscan.BOOL}
_SCAN_TYPES = {kind: pa.dictionary(pa.int32(), pa.string()) if typ == pa.string() else typ for typ, kind in _SCAN_KINDS.items()}
_SECONDS = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}


def _container(path: Path, head: bytes) -> str:
    name = path.name.lower()
    for comp in (".gz", ".zst", ".zstd"):
        if name.endswith(comp):
            name = name[: -len(comp)]
    if name.endswith((".parquet", ".pq")):
        return "parquet"
    if name.endswith(".csv"):
        return "csv"
    if name.endswith(".tsv"):
        return "tsv"
    if name.endswith((".jsonl", ".ndjson", ".json")):
        return "json"
    if head.startswith(b"PAR1"):
        return "parquet"
    return "json" if head.lstrip()[:1] in (b"{", b"[") else "csv"


# --- per-file plan ----------------------------------------------------------------------------


@dataclass
class _Plan:
    path: Path
    container: str  # json, csv, tsv, parquet
    adapter: Adapter | None  # None: --format fields
    flat: Flat | None = None  # effective flat spec (with --field overrides)
    fast: bool = False
    document: list[Any] | None = None  # a whole-file JSON document's records
    columns: list[str] = field(default_factory=list)  # CSV header / Parquet columns
    ts_type: pa.DataType | None = None  # CSV timestamp column type
    bytes_per_record: float = 256.0  # JSONL: from the head, for progress where only rows are known

    @property
    def format(self) -> str:
        return self.adapter.name if self.adapter else "fields"


def _head(path: Path) -> bytes:
    stream, raw = open_bytes(path)
    try:
        return stream.read(HEAD_BYTES)
    finally:
        stream.close()
        raw.close()


def _json_sample(plan: _Plan, head: bytes) -> list[Any]:
    lines = [ln for ln in head.split(b"\n")[:SAMPLE_RECORDS] if ln.strip()]
    if lines:
        plan.bytes_per_record = sum(len(ln) + 1 for ln in lines) / len(lines)
    if len(head) == HEAD_BYTES and lines and not head.endswith(b"\n"):
        lines = lines[:-1] or lines  # last line may be cut by the head size
    records = []
    for ln in lines:
        try:
            records.append(json.loads(ln))
        except (ValueError, RecursionError):
            continue
    whole = len(head) < HEAD_BYTES
    if head.lstrip()[:1] == b"[" or (lines and lines[0].strip() == b"{") or (whole and len(lines) == 1):
        document = _load_document(plan.path)
        if document is not None:
            plan.document = document
            return document[:SAMPLE_RECORDS]
    return records


def _load_document(path: Path) -> list[Any] | None:
    """A whole-file JSON array or object (Helicone/Langfuse exports, pretty OTLP), or None."""
    stream, raw = open_bytes(path)
    try:
        data = stream.read()
    finally:
        stream.close()
        raw.close()
    try:
        doc = json.loads(data)
    except (ValueError, RecursionError):
        return None
    if isinstance(doc, list):
        return doc
    if isinstance(doc, dict) and isinstance(doc.get("data"), list) and "resourceSpans" not in doc:
        return doc["data"]  # an API page: {data: [...], meta: {...}}
    return [doc]


def _csv_sample(plan: _Plan, head: bytes) -> list[dict[str, Any]]:
    text = head.decode("utf-8-sig", errors="replace")
    if len(head) == HEAD_BYTES and "\n" in text:
        text = text[: text.rindex("\n")]
    reader = csv.reader(io.StringIO(text), delimiter="\t" if plan.container == "tsv" else ",")
    header = next(reader, None)
    if not header or not any(h.strip() for h in header):
        raise InputError("empty CSV file: no header", path=str(plan.path))
    plan.columns = header
    rows = []
    for values in reader:
        if values:
            rows.append(dict(zip(header, values)))
        if len(rows) >= SAMPLE_RECORDS:
            break
    if not rows:
        raise InputError("CSV file has a header but no data rows", path=str(plan.path))
    return rows


def _parquet_sample(plan: _Plan) -> list[dict[str, Any]]:
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(plan.path)
    except Exception as exc:
        raise InputError(f"not a readable Parquet file: {exc}", path=str(plan.path)) from exc
    plan.columns = pf.schema_arrow.names
    if pf.metadata.num_rows == 0:
        raise InputError("Parquet file has no rows", path=str(plan.path))
    try:
        first = next(pf.iter_batches(batch_size=SAMPLE_RECORDS))
    except Exception as exc:
        raise InputError(f"corrupt Parquet file: {exc}", path=str(plan.path)) from exc
    return first.to_pylist()


def _detect(records: list[Any], container: str) -> Adapter | None:
    votes: dict[str, int] = {}
    for rec in records:
        if not isinstance(rec, dict):
            continue
        for adapter in ADAPTERS:
            kind = "csv" if container == "tsv" else container
            if kind in adapter.containers and adapter.match(rec):
                votes[adapter.name] = votes.get(adapter.name, 0) + 1
                break
    if not votes:
        return None
    best = max(votes.values())
    return next(a for a in ADAPTERS if votes.get(a.name) == best)


def _plan(path: Path, options: IngestOptions) -> _Plan:
    try:
        size = path.stat().st_size
    except OSError as exc:
        raise InputError(f"cannot read: {exc.strerror or exc}", path=str(path)) from exc
    if size == 0:
        raise InputError("empty file", path=str(path))
    head = _head(path)
    if not head.strip():
        raise InputError("empty file (no data after decompression)", path=str(path))
    container = _container(path, head)
    plan = _Plan(path, container, None)
    if container == "parquet":
        if head[:4] != b"PAR1":
            raise InputError(
                "not a Parquet file (compressed Parquet is not supported: Parquet compresses "
                "internally)",
                path=str(path),
            )
        sample: list[Any] = _parquet_sample(plan)
    elif container == "json":
        sample = _json_sample(plan, head)
    else:
        sample = _csv_sample(plan, head)

    if options.format == "fields":
        adapter = None
    elif options.format:
        adapter = BY_NAME[options.format]
        kind = "csv" if container == "tsv" else container
        if kind not in adapter.containers:
            raise InputError(
                f"format {adapter.name} is read from JSON, not {container.upper()}", path=str(path)
            )
    else:
        adapter = _detect(sample, container)
        if adapter is None and "output_tokens" not in options.fields:
            keys = sorted({k for r in sample[:20] if isinstance(r, dict) for k in r})[:12]
            raise InputError(
                "no known log schema (keys seen: "
                + (", ".join(keys) or "none")
                + "); name one with --format, or map columns with --field output_tokens=COLUMN",
                path=str(path),
            )
    plan.adapter = adapter
    _plan_flat(plan, options, sample)
    return plan


def _plan_flat(plan: _Plan, options: IngestOptions, sample: list[Any]) -> None:
    """Decide the effective flat spec and whether the vectorized path applies."""
    adapter = plan.adapter
    if adapter is None:
        if "output_tokens" not in options.fields:
            raise InputError(
                "--format fields needs --field output_tokens=COLUMN", path=str(plan.path)
            )
        plan.flat = Flat(columns=dict(options.fields))
    elif adapter.flat is not None and adapter.rows is None:
        columns = dict(adapter.flat.columns)
        columns.update(options.fields)
        base = adapter.flat
        plan.flat = Flat(columns, base.time_unit, base.latency_unit, base.zero_output_failed)
    if plan.flat is None:
        return
    sources = dict(plan.flat.columns)
    route_field = _route_field(options)
    if route_field:
        sources["_route"] = route_field
    if plan.container in ("csv", "tsv", "parquet"):
        present = set(plan.columns)
        out_src = sources["output_tokens"]
        if out_src not in present:
            raise InputError(
                f"no column {out_src!r} for output_tokens (columns: {', '.join(plan.columns[:12])})",
                path=str(plan.path),
                field=out_src,
            )
        if route_field and route_field not in present:
            raise InputError(
                f"no column {route_field!r} to route by (columns: {', '.join(plan.columns[:12])})",
                path=str(plan.path),
                field=route_field,
            )
        kept = {t: s for t, s in plan.flat.columns.items() if s in present}
        plan.flat = Flat(kept, plan.flat.time_unit, plan.flat.latency_unit, plan.flat.zero_output_failed)
        plan.fast = True
        if plan.container != "parquet" and "timestamp_s" in kept:
            plan.ts_type = _csv_time_type(sample, kept["timestamp_s"])
    elif plan.document is None:
        keys = {k for r in sample if isinstance(r, dict) for k in r}
        plan.fast = all(
            "[" not in s and ("." not in s or s in keys) for s in sources.values()
        )


def _csv_time_type(sample: list[dict[str, Any]], column: str) -> pa.DataType:
    values = [r.get(column) for r in sample if r.get(column)]
    if not values:
        return pa.float64()
    try:
        float(values[0])
        return pa.float64()
    except ValueError:
        pass
    text = values[0].strip()
    has_zone = text.endswith(("Z", "z")) or (len(text) > 6 and text[-6] in "+-" and text[-3] == ":")
    return pa.timestamp("ns", tz="UTC") if has_zone else pa.timestamp("ns")


def _route_field(options: IngestOptions) -> str | None:
    return options.route_by if options.route_by not in (None, "path", "model") else None


def check_options(options: IngestOptions) -> None:
    """Fail on a typo in an option before any file is opened."""
    if options.format is not None and options.format not in BY_NAME and options.format != "fields":
        raise UnknownNameError(
            f"unknown format {options.format!r}; known: {', '.join([*BY_NAME, 'fields'])}",
            field="--format",
        )
    for target in options.fields:
        if target not in TARGETS:
            raise UnknownNameError(
                f"unknown field target {target!r}; known: {', '.join(TARGETS)}", field="--field"
            )
        if not options.fields[target]:
            raise InputError(f"empty source path for {target}", field="--field")
    if options.on_error not in ("skip", "fail"):
        raise UnknownNameError(
            f"unknown on_error {options.on_error!r}; use skip or fail", field="--on-error"
        )
    if options.assume_cap is not None and options.assume_cap <= 0:
        raise InputError(f"assume_cap must be positive, got {options.assume_cap}", field="--assume-cap")
    if options.route_by == "":
        raise InputError("empty --route-by", field="--route-by")


# --- reading ----------------------------------------------------------------------------------


def open_logs(
    paths: Sequence[str],
    options: IngestOptions,
    *,
    progress: Callable[[int, int], None] | None = None,
    prefetch: int = 0,
) -> tuple[Iterator[pa.RecordBatch], IngestStats]:
    check_options(options)
    files = expand_paths(paths)
    plans = [_plan(p, options) for p in files]
    tokenizer = None
    if options.tokenizer:
        from kvtune.ingest.tokenize import load_tokenizer

        tokenizer = load_tokenizer(options.tokenizer)
    stats = IngestStats(files=[FileInfo(str(p.path), p.format) for p in plans])
    reader = _Reader(options, stats, tokenizer, progress, sum(p.path.stat().st_size for p in plans))
    batches = reader.run(plans)
    return (_ahead(batches, prefetch) if prefetch else batches), stats


def _ahead(batches: Iterator[pa.RecordBatch], depth: int) -> Iterator[pa.RecordBatch]:
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


class _Reader:
    """Runs the plans; owns stats, the error policy, the Batch API join and progress."""

    def __init__(self, options, stats, tokenizer, progress, total_bytes) -> None:
        self.options = options
        self.stats = stats
        self.tokenizer = tokenizer
        self.progress = progress
        self.total = total_bytes
        self.done_before = 0  # bytes of files finished
        self.fail = options.on_error == "fail" or options.strict
        self.batch_inputs: dict[str, dict[str, Any]] = {}
        self.route_field = _route_field(options)

    # -- driver

    def run(self, plans: list[_Plan]) -> Iterator[pa.RecordBatch]:
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
            self.done_before += plan.path.stat().st_size
            self._progress(0)

    def _progress(self, pos: int) -> None:
        if self.progress is not None:
            self.progress(min(self.done_before + pos, self.total), self.total)

    # -- skips and errors

    def _where(self, line: int | None, index: int | None, field: str | None) -> tuple[int | None, str | None]:
        if line is None and index is not None:  # a record of a JSON document
            field = f"[{index}]" + ("." + field if field else "")
        return line, field

    def skip(self, reason: str, message: str, line: int | None, field: str | None, index: int | None = None, count: int = 1) -> None:
        line, field = self._where(line, index, field)
        err = InputError(message, path=self.path, line=line, field=field)
        if self.fail:
            raise err
        self.stats.skip(reason, str(err), count)

    def _need_example(self, reason: str) -> bool:
        return self.fail or reason not in self.stats.examples

    # -- Batch API input

    def _read_batch_input(self, plan: _Plan) -> None:
        for line, index, record in self._json_records(plan):
            if isinstance(record, RowError):
                self.stats.ignored["Batch API input line unreadable"] += 1
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

    def _json_records(self, plan: _Plan) -> Iterator[tuple[int | None, int | None, Any]]:
        if plan.document is not None:
            for i, rec in enumerate(plan.document):
                yield None, i, rec
            return
        stream, raw = open_bytes(plan.path)
        try:
            for lineno, line in enumerate(stream, 1):
                if not line.strip():
                    continue
                yield lineno, None, _parse_line(line)
                if lineno % 65536 == 0:
                    self._progress(raw.tell())
        finally:
            stream.close()
            raw.close()

    def _json_slow(self, plan: _Plan) -> Iterator[pa.RecordBatch]:
        yield from self._records(plan, self._json_records(plan))

    def _records(self, plan: _Plan, records: Iterator[tuple[int | None, int | None, Any]]) -> Iterator[pa.RecordBatch]:
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

    def _complete(self, row: dict[str, Any], record: Mapping[str, Any], plan: _Plan) -> dict[str, Any]:
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

    # -- fast path: JSONL blocks

    def _json_scan(self, plan: _Plan) -> Iterator[pa.RecordBatch]:
        """Flat JSONL through kvtune's C scanner (kvtune.ingest.flatscan), blocks in parallel.

        The scanner takes a block only when every record in it is one it reads exactly as the
        per-line reading would; any other block goes to the exact block reader (`_json_block`:
        pyarrow, bisection, then line by line), which reports each bad line with its number.
        """
        sources = self._sources(plan)
        keys = list(dict.fromkeys(sources.values()))
        kinds = [_SCAN_KINDS[_TYPES[next(t for t, s in sources.items() if s == key)]] for key in keys]
        parse = _json_parse_options(sources)
        stream, raw = open_bytes(plan.path)
        # a plain file is scanned where it lies in the page cache (mmap: no copy); a compressed
        # one is decompressed into blocks
        mapped = _MappedFile(raw) if stream is raw else None
        blocks = mapped.blocks(SCAN_BLOCK_BYTES) if mapped else _line_blocks(stream, raw, size=SCAN_BLOCK_BYTES)
        workers = max(1, os.cpu_count() or 1)
        pending: deque[tuple[Any, memoryview, int]] = deque()
        line0 = 1
        try:
            # blocks scan in parallel (the scanner releases the GIL); results are used in file order
            with ThreadPoolExecutor(workers) as pool:
                for block, pos in blocks:
                    pending.append((pool.submit(flatscan.scan_block, block, keys, kinds), block, pos))
                    if len(pending) > workers:
                        line0 = yield from self._json_scanned(plan, *pending.popleft(), line0, keys, kinds, sources, parse)
                        if mapped:
                            mapped.release(pending[0][2] - pending[0][1].nbytes)  # up to the oldest block in flight
                while pending:
                    line0 = yield from self._json_scanned(plan, *pending.popleft(), line0, keys, kinds, sources, parse)
        finally:
            for future, *_ in pending:
                future.cancel()
            stream.close()
            raw.close()

    def _json_scanned(self, plan, future, block, pos, line0, keys, kinds, sources, parse):
        """Use one scanned block, or read it exactly when the scanner declined; returns the next
        block's first line number."""
        scanned = future.result()
        if scanned is None:
            yield from self._json_block(plan, bytes(block), line0, sources, parse)
            lines = block.nbytes and (bytes(block).count(b"\n") + (0 if block[-1] == 10 else 1))
        else:
            n, lines = scanned.rows, scanned.lines
            self.info.rows += n
            self.stats.rows_read += n
            by_key = {}
            for key, kind, column, vocab in zip(keys, kinds, scanned.columns, scanned.vocabs):
                if column is None:  # in no record of the block
                    by_key[key] = arrays.nulls(n, _SCAN_TYPES[kind])
                elif kind == flatscan.LABEL:
                    by_key[key] = arrays.dictionary(column[0], vocab, column[1])
                else:
                    by_key[key] = arrays.numeric_array(*column)
            where = scanned.record_lines

            def locate(i: int) -> int:
                return line0 + (i if where is None else int(where[i]))

            if n:
                batch = self._finalize(plan, {t: by_key[s] for t, s in sources.items()}, n, locate)
                if batch is not None:
                    yield batch
        self._progress(pos)
        return line0 + lines

    def _json_duckdb(self, plan: _Plan) -> Iterator[pa.RecordBatch]:
        """Flat JSONL through DuckDB's JSON reader (about twice pyarrow's speed), strictly.

        DuckDB converts leniently (12.5 → 12 for an integer column, numbers and objects → text
        for a string column), so every column is read as JSON text and converted here with
        kvtune's own rules: integers must be integer literals, labels must be JSON strings. A
        batch that is not entirely clean (anything the reference reading would turn into a skip
        or treat differently), or any DuckDB error, hands the rest of the file from that batch's
        first record to the block reader (`_json_fast`), which reports exact lines. DuckDB keeps
        file order (preserve_insertion_order), so the records already used are known by count.
        """
        try:
            import duckdb
        except ImportError:  # an install without it: the pyarrow block reader does the same work
            yield from self._json_fast(plan)
            return
        sources = self._sources(plan)
        keys = list(dict.fromkeys(sources.values()))
        codec = compression_of(plan.path)
        con = duckdb.connect(config={
            "threads": max(1, os.cpu_count() or 1),
            "memory_limit": DUCKDB_MEMORY,
            "preserve_insertion_order": True,
        })
        done = 0  # records used, in file order
        size = plan.path.stat().st_size
        try:
            try:
                relation = con.read_json(
                    str(plan.path),
                    format="newline_delimited",
                    columns={k: "JSON" for k in keys},
                    compression=codec,
                )
                # to_arrow_reader since DuckDB 1.4; fetch_arrow_reader before (the same stream)
                to_reader = getattr(relation, "to_arrow_reader", None) or relation.fetch_arrow_reader
                stream = to_reader(DUCKDB_BATCH_ROWS)
            except Exception:  # any DuckDB failure: the block reader reads the file instead
                stream = None
            while stream is not None:
                try:
                    batch = stream.read_next_batch()
                except StopIteration:
                    return
                except Exception:  # parse errors, invalid UTF-8, memory: from here, the block reader
                    break
                cols = _strict_columns(batch, sources)
                n = batch.num_rows
                if cols is None or _bad_rows(cols, n, plan.flat.zero_output_failed):
                    break
                self.info.rows += n
                self.stats.rows_read += n
                out = self._finalize(plan, cols, n, lambda i: 0)  # clean: never locates
                done += n
                if out is not None:
                    yield out
                self._progress(min(size, int(done * plan.bytes_per_record)))
        finally:
            con.close()
        yield from self._json_fast(plan, skip_records=done)

    def _json_fast(self, plan: _Plan, skip_records: int = 0) -> Iterator[pa.RecordBatch]:
        assert plan.flat is not None
        sources = self._sources(plan)
        parse = _json_parse_options(sources)
        stream, raw = open_bytes(plan.path)
        workers = max(1, os.cpu_count() or 1)
        pending: deque[tuple[Any, bytes, int, int]] = deque()
        try:
            # blocks parse in parallel, one thread each; results are used in file order
            with ThreadPoolExecutor(workers) as pool:
                head, line0 = _skip_records(stream, skip_records) if skip_records else (b"", 1)
                for block, pos in _line_blocks(stream, raw, head):
                    pending.append((pool.submit(_parse_block, block, parse), block, pos))
                    if len(pending) > workers:
                        line0 = yield from self._json_parsed(plan, *pending.popleft(), line0, sources, parse)
                while pending:
                    line0 = yield from self._json_parsed(plan, *pending.popleft(), line0, sources, parse)
        finally:
            for future, *_ in pending:
                future.cancel()
            stream.close()
            raw.close()

    def _json_parsed(self, plan, future, block, pos, line0, sources, parse):
        """Use one parsed block (or bisect it when it failed); returns the next block's line."""
        table, lines = future.result()
        if table is None:  # some line does not fit the fast schema: find it by bisection
            yield from self._json_block(plan, bytes(block), line0, sources, parse)
        else:
            yield from self._json_table(plan, table, block, line0, sources)
        self._progress(pos)
        return line0 + lines

    def _json_block(self, plan, block: bytes, line0: int, sources, parse) -> Iterator[pa.RecordBatch]:
        import pyarrow.json as pj

        try:
            table = pj.read_json(pa.BufferReader(block), parse_options=parse)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
            nlines = block.count(b"\n") + (0 if block.endswith(b"\n") else 1)
            if nlines <= BISECT_MIN_LINES:
                lines = block.split(b"\n")
                yield from self._records(
                    plan,
                    ((line0 + i, None, _parse_line(ln)) for i, ln in enumerate(lines) if ln.strip()),
                )
                return
            mid = block.find(b"\n", len(block) // 2)
            if mid < 0 or mid == len(block) - 1:
                mid = block.rfind(b"\n", 0, len(block) // 2)
            left, right = block[: mid + 1], block[mid + 1 :]
            yield from self._json_block(plan, left, line0, sources, parse)
            yield from self._json_block(plan, right, line0 + left.count(b"\n"), sources, parse)
            return
        yield from self._json_table(plan, table, block, line0, sources)

    def _json_table(self, plan, table, block: bytes, line0: int, sources) -> Iterator[pa.RecordBatch]:
        n = table.num_rows
        self.info.rows += n
        self.stats.rows_read += n
        cols = {t: table.column(src).combine_chunks() for t, src in sources.items()}

        def locate(i: int) -> int:
            seen = -1
            for k, ln in enumerate(bytes(block).split(b"\n")):
                if ln.strip():
                    seen += 1
                    if seen == i:
                        return line0 + k
            return line0

        batch = self._finalize(plan, cols, n, locate)
        if batch is not None:
            yield batch

    def _sources(self, plan: _Plan) -> dict[str, str]:
        assert plan.flat is not None
        sources = {t: s for t, s in plan.flat.columns.items() if t in _TYPES}
        if self.route_field:
            sources["_route"] = self.route_field
        return sources

    # -- fast path: CSV

    def _csv(self, plan: _Plan) -> Iterator[pa.RecordBatch]:
        if plan.flat is None:  # a record adapter over CSV (LiteLLM, Helicone exports)
            yield from self._records(plan, self._csv_records(plan, 0))
            return
        import pyarrow.csv as pcsv

        sources = self._sources(plan)
        types = {}
        for t, src in sources.items():
            ts = t == "timestamp_s" and plan.ts_type is not None
            types.setdefault(src, plan.ts_type if ts else _TYPES[t])
        convert = pcsv.ConvertOptions(
            column_types=types,
            include_columns=list(dict.fromkeys(sources.values())),
            null_values=[""],
            strings_can_be_null=True,
            quoted_strings_can_be_null=True,
        )
        parse = pcsv.ParseOptions(delimiter="\t" if plan.container == "tsv" else ",", newlines_in_values=True)
        read = pcsv.ReadOptions(block_size=4 << 20)
        stream, raw = open_bytes(plan.path)
        done = 0
        try:
            try:
                reader = pcsv.open_csv(stream, read_options=read, parse_options=parse, convert_options=convert)
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
                reader = None
            while reader is not None:
                try:
                    batch = reader.read_next_batch()
                except StopIteration:
                    return
                except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
                    break  # finish the file row by row from the first unread row
                n = batch.num_rows
                self.info.rows += n
                self.stats.rows_read += n
                cols = {t: batch.column(src) for t, src in sources.items()}
                start = done
                out = self._finalize(plan, cols, n, lambda i, s=start: s + i + 2)
                done += n
                if out is not None:
                    yield out
                self._progress(raw.tell())
        finally:
            stream.close()
            raw.close()
        yield from self._records(plan, self._csv_records(plan, done))

    def _csv_records(self, plan: _Plan, skip_rows: int) -> Iterator[tuple[int | None, int | None, Any]]:
        stream, raw = open_bytes(plan.path)
        try:
            text = io.TextIOWrapper(stream, encoding="utf-8-sig", errors="strict", newline="")
            reader = csv.reader(text, delimiter="\t" if plan.container == "tsv" else ",")
            try:
                header = next(reader)
                seen = 0
                line = reader.line_num
                while True:
                    try:
                        values = next(reader)
                    except StopIteration:
                        break
                    except csv.Error as exc:
                        yield reader.line_num, None, RowError(None, f"bad CSV: {exc}", MALFORMED_CSV)
                        continue
                    line = reader.line_num
                    if not values:
                        continue
                    seen += 1
                    if seen <= skip_rows:
                        continue
                    if len(values) != len(header):
                        yield line, None, RowError(
                            None, f"{len(values)} fields, header has {len(header)}", MALFORMED_CSV
                        )
                        continue
                    yield line, None, dict(zip(header, values))
                    if seen % 65536 == 0:
                        self._progress(raw.tell())
            except UnicodeDecodeError as exc:
                raise InputError(f"not UTF-8 text: {exc.reason}", path=self.path) from exc
        finally:
            stream.close()
            raw.close()

    # -- fast path: Parquet

    def _parquet(self, plan: _Plan) -> Iterator[pa.RecordBatch]:
        import pyarrow.parquet as pq

        label_sources = []
        if plan.flat is not None:
            label_sources = [s for t, s in self._sources(plan).items() if t in ("route", "path", "_route", "model", "finish_reason")]
        pf = pq.ParquetFile(plan.path, read_dictionary=label_sources or None)
        size = plan.path.stat().st_size
        groups = max(pf.metadata.num_row_groups, 1)
        if plan.flat is None:
            columns = None
            sources: dict[str, str] = {}
        else:
            sources = self._sources(plan)
            columns = list(dict.fromkeys(sources.values()))
        done = 0
        try:
            # whole row groups per batch where they are of a sane size: no re-slicing across groups
            rows = max(pf.metadata.row_group(i).num_rows for i in range(pf.metadata.num_row_groups)) if pf.metadata.num_row_groups else 0
            batch_size = min(max(rows, PARQUET_MIN_BATCH), PARQUET_MAX_BATCH)
            batches = pf.iter_batches(batch_size=batch_size, columns=columns, use_threads=True)
            for batch in batches:
                n = batch.num_rows
                if plan.flat is None:
                    rows = batch.to_pylist()
                    yield from self._records(plan, ((done + i + 1, None, r) for i, r in enumerate(rows)))
                    done += n
                    continue
                try:
                    cols = {t: _cast(batch.column(src), t) for t, src in sources.items()}
                except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError):
                    rows = batch.to_pylist()
                    yield from self._records(plan, ((done + i + 1, None, r) for i, r in enumerate(rows)))
                    done += n
                    continue
                self.info.rows += n
                self.stats.rows_read += n
                start = done
                out = self._finalize(plan, cols, n, lambda i, s=start: s + i + 1)
                done += n
                if out is not None:
                    yield out
                self._progress(int(size * min(done / max(pf.metadata.num_rows, 1), 1.0)))
        except KvtuneError:
            raise
        except (OSError, pa.ArrowException) as exc:
            raise InputError(f"corrupt Parquet file: {exc}", path=self.path, line=done + 1 if done else None) from exc
        del groups

    # -- shared: checks and normalization over columns

    def _finalize(self, plan: _Plan, cols: dict[str, pa.Array], n: int, locate: Callable[[int], int]) -> pa.RecordBatch | None:
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
                    self.skip(reason, msg(value), locate(first), sources.get(target, target), count=count)
                else:
                    self.stats.skipped[reason] += count
            import pyarrow.compute as pc

            keep = arrays.bool_array(~drop)
            cols = {t: pc.filter(c, keep) for t, c in cols.items()}
            n = int((~drop).sum())
        if n == 0:
            return None
        return self._assemble(cols, n)

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
                over &= ~arrays.valid(finish)
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


def _bad_rows(cols: dict[str, pa.Array], n: int, zero_failed: bool) -> list[tuple[str, str, np.ndarray, Callable[[Any], str]]]:
    """Row-level checks as (reason, target, numpy mask, message) for the checks that fail somewhere.

    Each check first asks a cheap whole-column question (null count, min/max), so a clean batch
    costs a few passes over its numbers and builds no masks.
    """
    found: list[tuple[str, str, np.ndarray, Callable[[Any], str]]] = []
    out = cols["output_tokens"]
    if out.null_count:
        found.append((MISSING_OUTPUT, "output_tokens", ~arrays.valid(out), lambda v: "missing"))
    for t in INT_TARGETS:
        col = cols.get(t)
        if col is None or col.null_count == n:
            continue
        low = _int_min(col)
        if low is not None and low < 0:
            values, ok = arrays.ints(col)
            mask = values < 0 if ok is None else (values < 0) & ok
            found.append((NEGATIVE_TOKENS, t, mask, lambda v: f"negative count: {v}"))
    for t in (*FLOAT_TARGETS, "timestamp_s"):
        col = cols.get(t)
        if col is None or col.null_count == n:
            continue
        import pyarrow.compute as pc

        finite = pc.is_finite(col)
        if not pc.all(finite).as_py():
            found.append((BAD_NUMBER, t, ~arrays.flags(finite) & _not_null(col), lambda v: f"not a finite number: {v}"))
    if zero_failed and out.null_count < n and _int_min(out) == 0:
        values, ok = arrays.ints(out)
        mask = values == 0 if ok is None else (values == 0) & ok
        found.append((FAILED, "output_tokens", mask, lambda v: "0 response tokens (a failed request)"))
    return found


def _int_min(col: pa.Array) -> int | None:
    """The smallest non-null value of an integer column (None when all null): a numpy pass over
    the Arrow buffer when there are no nulls, Arrow's min_max otherwise."""
    view = arrays.values(col) if col.null_count == 0 and len(col) else None
    if view is not None and view.dtype.kind in "iu":
        return int(view.min())
    import pyarrow.compute as pc

    return pc.min_max(col)["min"].as_py()


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
    codes, ok = arrays.ints(col.indices)
    codes = remap[codes]
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

        ns = col.cast(pa.timestamp("ns", tz=col.type.tz)) if col.type.unit != "ns" else col
        seconds = pc.cast(ns.cast(pa.int64()), pa.float64(), safe=False)
        return arrays.numeric_array(arrays.values(seconds) / 1e9, arrays.valid(seconds))
    return arrays.scaled(col, _SECONDS[unit])


def _cast(col: pa.Array, target: str) -> pa.Array:
    """A Parquet column onto the target's type; a failed safe cast sends the batch row by row."""
    if isinstance(col, pa.ChunkedArray):
        col = col.combine_chunks()
    if target == "timestamp_s":
        if pa.types.is_timestamp(col.type) or pa.types.is_integer(col.type) or pa.types.is_floating(col.type):
            return col
        raise pa.ArrowInvalid("timestamp column needs the row path")
    typ = _TYPES[target]
    if col.type == typ:
        return col
    if pa.types.is_dictionary(col.type) and typ == pa.string():
        return col
    if typ == pa.string() and not (pa.types.is_string(col.type) or pa.types.is_large_string(col.type)):
        raise pa.ArrowInvalid("non-string label column needs the row path")
    return col.cast(typ)  # safe: fractional floats or text raise ArrowInvalid


def _json_parse_options(sources: Mapping[str, str]) -> Any:
    """pyarrow's JSON parse options for the block reader: one column per source key, typed by
    its first target."""
    import pyarrow.json as pj

    types: dict[str, pa.DataType] = {}
    for t, src in sources.items():
        types.setdefault(src, _TYPES[t])
    return pj.ParseOptions(explicit_schema=pa.schema(list(types.items())), unexpected_field_behavior="ignore")


class _MappedFile:
    """A plain file mapped into memory, read in blocks of whole lines: views into the page cache,
    no copy. Pages of blocks already used are unmapped from the process as it goes (`release`),
    so resident memory stays bounded by the blocks in flight, not the file's size."""

    def __init__(self, raw: Any) -> None:
        import mmap

        self.size = os.fstat(raw.fileno()).st_size
        self.map = mmap.mmap(raw.fileno(), 0, access=mmap.ACCESS_READ) if self.size else None
        if self.map is not None:
            self.map.madvise(mmap.MADV_SEQUENTIAL)
        self.released = 0

    def blocks(self, size: int) -> Iterator[tuple[memoryview, int]]:
        """(block of whole lines, end offset); a line longer than `size` makes its block longer."""
        if self.map is None:
            return
        view = memoryview(self.map)
        start, end = 0, self.size
        while start < end:
            stop = min(start + size, end)
            if stop < end:
                cut = self.map.rfind(b"\n", start, stop)
                stop = cut + 1 if cut >= 0 else (self.map.find(b"\n", stop) + 1 or end)
            yield view[start:stop], stop
            start = stop

    def release(self, upto: int) -> None:
        """Drop the process's mapping of the whole pages before `upto` (the page cache keeps them)."""
        import mmap

        upto -= upto % mmap.PAGESIZE
        if self.map is not None and upto > self.released:
            self.map.madvise(mmap.MADV_DONTNEED, self.released, upto - self.released)
            self.released = upto


def _line_blocks(stream: Any, raw: Any, head: bytes = b"", size: int = BLOCK_BYTES) -> Iterator[tuple[memoryview, int]]:
    """(block of whole lines, compressed position) over a byte stream, copying only line tails;
    `head` is input already read from the stream, to go first."""
    tail = head
    while True:
        buf = bytearray(len(tail) + size)
        buf[: len(tail)] = tail
        view = memoryview(buf)
        filled = len(tail)
        while filled < len(buf):
            got = stream.readinto(view[filled:])
            if not got:
                break
            filled += got
        if filled == len(tail):  # end of input
            if tail:
                yield memoryview(tail), raw.tell()
            return
        cut = buf.rfind(b"\n", 0, filled)
        if cut < 0 and filled == len(buf):  # one line longer than a block: grow
            tail = bytes(view[:filled])
            continue
        if filled < len(buf):  # last block: everything that is left
            cut = filled - 1
        tail = bytes(view[cut + 1 : filled])
        yield view[: cut + 1], raw.tell()


_BLANK = np.zeros(256, bool)
_BLANK[list(b" \t\n\r\x0b\x0c")] = True  # what bytes.strip() removes


def _skip_records(stream: Any, k: int) -> tuple[bytes, int]:
    """Read past the first `k` records (non-blank lines) of a JSONL stream.

    Returns the bytes read beyond them and the line number those start at, so the block reader
    can go on from record k + 1 with exact line numbers.
    """
    line0, seen, rest = 1, 0, b""
    while True:
        chunk = stream.read(BLOCK_BYTES)
        data = rest + chunk
        cut = data.rfind(b"\n") + 1 if chunk else len(data)
        if cut == 0:
            if not chunk:
                return b"", line0
            rest = data  # no line end yet: read on
            continue
        view = np.frombuffer(data, np.uint8, count=cut)
        newline = view == 10
        line_of = np.cumsum(newline) - newline  # a line's bytes, its newline included
        filled = np.bincount(line_of, weights=~_BLANK[view]) > 0
        records = np.cumsum(filled)
        if seen + int(records[-1]) >= k:
            last = int(np.searchsorted(records, k - seen))  # the line holding record k
            ends = np.flatnonzero(newline)
            start = int(ends[last]) + 1 if last < ends.size else cut
            return data[start:], line0 + last + 1
        seen += int(records[-1])
        line0 += int(newline.sum())
        rest = data[cut:]
        if not chunk:
            return b"", line0


def _strict_columns(batch: pa.RecordBatch, sources: Mapping[str, str]) -> dict[str, pa.Array] | None:
    """DuckDB's JSON texts → typed columns under kvtune's rules, or None when any value is not
    one the fast reading takes as it is (the block reader then decides what it is)."""
    cols: dict[str, pa.Array] = {}
    for target, source in sources.items():
        text = batch.column(source)
        typ = _TYPES[target]
        try:
            if typ == pa.string():
                col = _json_labels(text)
                if col is None:
                    return None
            else:  # JSON number (or true/false) texts; a JSON string is quoted and fails here
                col = text.cast(typ)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
            return None
        cols[target] = col
    return cols


def _json_labels(text: pa.Array) -> pa.DictionaryArray | None:
    """A column of JSON texts → dictionary of the strings they hold; None unless every value is
    a JSON string or null (decoded per distinct value, with Python's json: exact)."""
    if text.null_count == len(text):
        return arrays.nulls(len(text), pa.dictionary(pa.int32(), pa.string()))
    import pyarrow.compute as pc

    coded = pc.dictionary_encode(text)
    decoded = []
    for item in coded.dictionary.to_pylist():
        value = json.loads(item)
        if not isinstance(value, str):
            return None
        decoded.append(value)
    unique = list(dict.fromkeys(decoded))
    codes, ok = arrays.ints(coded.indices)
    if len(unique) < len(decoded):
        codes = np.array([unique.index(v) for v in decoded], np.int32)[codes]
    return arrays.dictionary(codes, unique, ok)


def _parse_block(block: memoryview, parse: Any) -> tuple[pa.Table | None, int]:
    """Parse one block with the fast schema on one thread (None when a line does not fit it),
    and count its newlines for line numbers, off the main thread."""
    import pyarrow.json as pj

    lines = int(np.count_nonzero(np.frombuffer(block, dtype=np.uint8) == 10))
    read = pj.ReadOptions(use_threads=False, block_size=len(block) + 1)
    try:
        table = pj.read_json(pa.BufferReader(pa.py_buffer(block)), read_options=read, parse_options=parse)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        table = None
    return table, lines


def _parse_line(line: bytes) -> Any:
    try:
        return json.loads(line)
    except RecursionError:
        return RowError(None, "JSON nested too deeply", MALFORMED_JSON)
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
        detail = exc.msg if isinstance(exc, json.JSONDecodeError) else "not UTF-8"
        return RowError(None, f"malformed JSON: {detail}", MALFORMED_JSON)


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

    def __init__(self, reader: _Reader, plan: _Plan) -> None:
        self.reader = reader
        self.plan = plan
        self.rows: list[dict[str, Any]] = []
        self.where: list[tuple[int | None, int | None]] = []

    def __len__(self) -> int:
        return len(self.rows)

    def add(self, row: dict[str, Any], line: int | None, index: int | None) -> None:
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
            from kvtune.ingest.tokenize import count_tokens

            for target, text_key in (("output_tokens", "output_text"), ("prompt_tokens", "prompt_text")):
                need = [i for i, r in enumerate(rows) if r.get(target) is None and r.get(text_key)]
                counts = count_tokens(tok, [rows[i][text_key] for i in need])
                for i, c in zip(need, counts):
                    rows[i][target] = c
                if target == "output_tokens":  # empty output text is zero tokens
                    for r in rows:
                        if r.get(target) is None and r.get(text_key) == "":
                            r[target] = 0
        cols = {}
        for t in (*_TYPES,):
            values = [r.get(t) for r in rows]
            if any(v is not None for v in values):
                cols[t] = pa.array(values, _TYPES[t])
        sink_plan = _Plan(self.plan.path, self.plan.container, self.plan.adapter)  # units done
        batch = self.reader._finalize(
            sink_plan, cols, len(rows), lambda i: where[i][0] or 0
        )
        if batch is not None:
            yield batch
