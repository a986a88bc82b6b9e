"""Planning one file before any row is read: its container, its schema, and which path reads it.

`_plan` reads the head of a file (HEAD_BYTES), samples up to SAMPLE_RECORDS records, detects the
log schema (or takes --format), applies --field and --route-by, and decides whether the
vectorized (flat) paths apply. `check_options` fails on a typo before any file is opened. Kept
apart from the readers so every file's problems surface before the first batch.
"""

from __future__ import annotations

import csv
import io
import json
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa

from kvtune.errors import InputError, KvtuneError, UnknownNameError
from kvtune.ingest import IngestOptions, OnError, arrays
from kvtune.ingest.compression import open_bytes
from kvtune.ingest.own_outputs import kvtune_output, kvtune_text_output
from kvtune.ingest.paths import LogFile
from kvtune.ingest.remote import RemoteFile
from kvtune.ingest.schemas import ADAPTERS, BY_NAME, Adapter, Flat
from kvtune.ingest.schemas._base import TARGETS

HEAD_BYTES = 1 << 20  # bytes read for detection
SAMPLE_RECORDS = 200


def _container(path: LogFile, head: bytes) -> str:
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


# Containers a log is often shipped in that are not themselves logs, by magic bytes after any
# gzip/zstd layer: (offset, magic, what it is, what to do).
_EXTRACT = "extract it ({}) and pass the files or their directory"
_RECOMPRESS = "kvtune reads gzip and zstd: recompress it ({} -dc {{name}} | gzip > {{stem}}.gz)"
# What logs are often shipped in but kvtune does not read, by magic bytes after any gzip/zstd
# layer: (offset, magic, what it is, what to do with it).
_ARCHIVES = (
    (257, b"ustar", "a tar archive", _EXTRACT.format("tar xf {name}")),
    (0, b"PK\x03\x04", "a zip archive", _EXTRACT.format("unzip {name}")),
    (0, b"PK\x05\x06", "an empty zip archive", "nothing to read"),
    (0, b"7z\xbc\xaf\x27\x1c", "a 7z archive", _EXTRACT.format("7z x {name}")),
    (0, b"Rar!\x1a\x07", "a RAR archive", _EXTRACT.format("unrar x {name}")),
    (0, b"BZh", "bzip2-compressed", _RECOMPRESS.format("bzip2")),
    (0, b"\xfd7zXZ\x00", "xz-compressed", _RECOMPRESS.format("xz")),
)


def _refuse_archive(path: LogFile, head: bytes) -> None:
    """An archive was read as CSV ("not CSV text: NUL bytes"): say what it is and what to do."""
    for offset, magic, kind, remedy in _ARCHIVES:
        if head[offset : offset + len(magic)] == magic:
            todo = remedy.format(name=path.name, stem=path.name.rsplit(".", 1)[0])
            raise InputError(f"{kind}, not a log file: {todo}", path=str(path))


@dataclass
class FilePlan:
    """How one file will be read, decided from its head before any row is: plain data, so a
    parallel map step plans in one process and reads in another."""

    path: LogFile  # a local file, or an object in a store (kvtune.ingest.remote)
    container: str  # json, csv, tsv, parquet
    adapter: Adapter | None  # None: --format fields
    flat: Flat | None = None  # effective flat spec (with --field overrides)
    fast: bool = False
    document: list[Any] | None = None  # a whole-file JSON document's records
    columns: list[str] = field(default_factory=list)  # CSV header / Parquet columns
    ts_type: pa.DataType | None = None  # CSV timestamp column type
    bytes_per_record: float = 256.0  # JSONL: from the head, for progress where only rows are known
    size: int | None = None  # bytes when planned: every read stops there, and fails if the file shrank
    group_rows: list[int] = field(default_factory=list)  # Parquet: rows in each row group, from the footer
    row_groups: tuple[int, int] | None = None  # Parquet: read only row groups [start, stop) (one task's part)
    kvtune_output: str | None = None  # what kvtune file this is (`own_outputs`): skipped, not read

    @property
    def format(self) -> str:
        return self.adapter.name if self.adapter else "fields"


def _head(path: LogFile) -> bytes:
    stream, raw = open_bytes(path)
    try:
        return stream.read(HEAD_BYTES)
    finally:
        stream.close()
        raw.close()


def _json_sample(plan: FilePlan, head: bytes) -> list[Any]:
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


def _load_document(path: LogFile) -> list[Any] | None:
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


def _csv_sample(plan: FilePlan, head: bytes) -> list[dict[str, str]]:
    if b"\x00" in head:
        raise InputError("not CSV text: the file holds NUL bytes (binary data, or UTF-16)", path=str(plan.path))
    text = head.decode("utf-8-sig", errors="replace")
    if len(head) == HEAD_BYTES and "\n" in text:
        text = text[: text.rindex("\n")]
    reader = csv.reader(io.StringIO(text, newline=""), delimiter="\t" if plan.container == "tsv" else ",")
    try:
        header = next(reader, None)
    except csv.Error as exc:
        raise InputError(f"not CSV text: bad header line: {exc}", path=str(plan.path)) from None
    if not header or not any(h.strip() for h in header):
        raise InputError("empty CSV file: no header", path=str(plan.path))
    plan.columns = header
    rows: list[dict[str, str]] = []
    while len(rows) < SAMPLE_RECORDS:
        try:
            values = next(reader)
        except StopIteration:
            break
        except csv.Error:  # a malformed row: the reader counts it; detection looks at the others
            continue
        if values:
            rows.append(dict(zip(header, values, strict=False)))  # a short or long row: its own fields
    if not rows:
        raise InputError("CSV file has a header but no data rows", path=str(plan.path))
    return rows


def _parquet_sample(plan: FilePlan) -> list[dict[str, Any]]:
    import pyarrow.parquet as pq

    source = parquet_source(plan.path)
    try:
        try:
            pf = pq.ParquetFile(source)
        except KvtuneError:
            raise
        except Exception as exc:
            raise InputError(f"not a readable Parquet file: {exc}", path=str(plan.path)) from exc
        plan.columns = pf.schema_arrow.names
        plan.group_rows = [pf.metadata.row_group(i).num_rows for i in range(pf.metadata.num_row_groups)]
        if pf.metadata.num_rows == 0:
            raise InputError("Parquet file has no rows", path=str(plan.path))
        try:
            first = next(pf.iter_batches(batch_size=SAMPLE_RECORDS, row_groups=_first_groups(pf)))
        except KvtuneError:
            raise
        except Exception as exc:
            raise InputError(f"corrupt Parquet file: {exc}", path=str(plan.path)) from exc
        return arrays.rows(first)
    finally:
        if not isinstance(source, Path):
            source.close()


def _first_groups(pf: Any) -> list[int]:
    """The row groups that hold the first SAMPLE_RECORDS rows: only those are read for the sample
    (a remote file is not fetched whole to sniff it)."""
    groups, rows = [], 0
    for i in range(pf.metadata.num_row_groups):
        groups.append(i)
        rows += pf.metadata.row_group(i).num_rows
        if rows >= SAMPLE_RECORDS:
            break
    return groups


def parquet_source(path: LogFile) -> Path | io.RawIOBase:
    """What pyarrow opens a Parquet file from: the local path, or a store's file object (ranged
    reads: the footer, then the column chunks wanted). The caller closes a file object."""
    return path.open(readahead=False) if isinstance(path, RemoteFile) else path


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


_NOT_REGULAR = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO or pipe"), (stat.S_ISCHR, "a character device"),
                (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def _plan(path: LogFile, options: IngestOptions) -> FilePlan:
    size = path.size if isinstance(path, RemoteFile) else _local_size(path)
    if size == 0:
        raise InputError("empty file", path=str(path))
    if isinstance(path, RemoteFile) and _container(path, b"") == "parquet":
        head = path.read_range(0, 4)  # by its name: only the magic, the footer tells the rest
    else:
        head = _head(path)
    if not head.strip():
        raise InputError("empty file (no data after decompression)", path=str(path))
    _refuse_archive(path, head)
    container = _container(path, head)
    plan = FilePlan(path, container, None, size=size)
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
        plan.kvtune_output = kvtune_output(sample)
        if plan.kvtune_output is not None:
            return plan
    else:
        plan.kvtune_output = kvtune_text_output(head)
        if plan.kvtune_output is not None:
            return plan
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
                + "); name one with `format_`, or map columns with `fields` output_tokens=COLUMN",
                path=str(path),
            )
    plan.adapter = adapter
    _plan_flat(plan, options, sample)
    return plan


def _local_size(path: Path) -> int:
    try:
        info = path.stat()
    except OSError as exc:
        raise InputError(f"cannot read: {exc.strerror or exc}", path=str(path)) from exc
    if not stat.S_ISREG(info.st_mode):  # a FIFO would block the open, a device never end
        kind = next((name for test, name in _NOT_REGULAR if test(info.st_mode)), "not a regular file")
        raise InputError(f"not a log file but {kind}: kvtune reads each file more than once, so save "
                         "a stream to a file first", path=str(path))
    return info.st_size


def _plan_flat(plan: FilePlan, options: IngestOptions, sample: list[Any]) -> None:
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
    """The timestamp column's type for pyarrow's CSV reader, from the sample's first value."""
    values = [v for r in sample if (v := r.get(column))]
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
                f"unknown field target {target!r}; known: {', '.join(TARGETS)}", field="fields"
            )
        if not options.fields[target]:
            raise InputError(f"empty source path for {target}", field="fields")
    if not isinstance(options.on_error, OnError):  # a caller without type checks passed a word
        raise UnknownNameError(
            f"on_error must be OnError.SKIP or OnError.FAIL, not {options.on_error!r} "
            "(kvtune.ingest.parse_on_error reads the words)",
            field="--on-error",
        )
    if options.assume_cap is not None and options.assume_cap <= 0:
        raise InputError(f"assume_cap must be positive, got {options.assume_cap}", field="assume_cap")
    if options.route_by == "":
        raise InputError("empty `route_by`", field="route_by")
