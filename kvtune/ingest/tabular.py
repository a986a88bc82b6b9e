"""CSV and Parquet: columnar readers for flat schemas, row by row for record adapters and bad batches.

CSV streams through `pyarrow.csv.open_csv` until a batch fails to convert, then the rest of the
file goes row by row (`_csv_records`, Python's csv, exact line numbers); Parquet streams by row
group through `ParquetFile.iter_batches`, and a batch whose columns do not cast safely goes row
by row. Both hand typed columns to the shared checks (`columns.ColumnChecks._finalize`).
"""

from __future__ import annotations

import csv
import io
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pyarrow as pa

from kvtune.errors import InputError, KvtuneError
from kvtune.ingest import arrays
from kvtune.ingest.columns import _TYPES, ColumnChecks, Records
from kvtune.ingest.compression import open_bytes
from kvtune.ingest.plan import FilePlan, parquet_source
from kvtune.ingest.schemas._fields import MALFORMED_CSV, RowError

if TYPE_CHECKING:
    import pyarrow.parquet as pq

#: Rows per Parquet batch: a row group within these. Small enough that a batch's columns and the
#: profile's temporaries stay in cache and reuse the same freed memory: on 10M rows in row groups of 1M,
#: 2^17 rather than 2^19 held peak RSS at 226 MiB instead of 281, and CPU 0.93 s instead of 1.08
#: (fewer page faults: sys 0.10 s instead of 0.24; medians of 7 whole processes on a loaded 2-core machine).
PARQUET_MIN_BATCH, PARQUET_MAX_BATCH = 1 << 16, 1 << 17
CSV_BLOCK_BYTES = 4 << 20  # CSV bytes per pyarrow batch


class TabularPaths(ColumnChecks):
    """The reader's CSV and Parquet paths, joined in `readers._Reader` (reader state and hooks:
    `columns.ColumnChecks`)."""

    # -- fast path: CSV

    def _csv(self, plan: FilePlan) -> Iterator[pa.RecordBatch]:
        if plan.flat is None:  # a record adapter over CSV (LiteLLM, Helicone exports)
            yield from self._records(plan, self._csv_records(plan, 0))
            return
        import pyarrow.csv as pcsv

        sources = self._sources(plan)
        types: dict[str, pa.DataType] = {}
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
        read = pcsv.ReadOptions(block_size=CSV_BLOCK_BYTES)
        stream, raw = open_bytes(plan.path, plan.size)
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
                out = self._finalize(plan, cols, n, _lines_from(done + 2))  # line 1: the header
                done += n
                if out is not None:
                    yield out
                self._progress(raw.tell())
        finally:
            stream.close()
            raw.close()
        yield from self._records(plan, self._csv_records(plan, done))

    def _csv_records(self, plan: FilePlan, skip_rows: int) -> Records:
        stream, raw = open_bytes(plan.path, plan.size)
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
                    yield line, None, dict(zip(header, values, strict=True))
                    if seen % 65536 == 0:
                        self._progress(raw.tell())
            except UnicodeDecodeError as exc:
                raise InputError(f"not UTF-8 text: {exc.reason}", path=self.path) from exc
        finally:
            stream.close()
            raw.close()

    # -- fast path: Parquet

    def _parquet(self, plan: FilePlan) -> Iterator[pa.RecordBatch]:
        import pyarrow.parquet as pq

        label_sources = []
        if plan.flat is not None:
            labels = ("route", "path", "_route", "model", "finish_reason")
            label_sources = [s for t, s in self._sources(plan).items() if t in labels]
        source = parquet_source(plan.path)
        try:
            yield from self._parquet_batches(plan, pq.ParquetFile(source, read_dictionary=label_sources or None))
        finally:
            if not isinstance(source, Path):
                source.close()

    def _parquet_batches(self, plan: FilePlan, pf: pq.ParquetFile) -> Iterator[pa.RecordBatch]:
        size = plan.size or 0
        if plan.flat is None:
            columns = None
            sources: dict[str, str] = {}
        else:
            sources = self._sources(plan)
            columns = list(dict.fromkeys(sources.values()))
        group_rows = [pf.metadata.row_group(i).num_rows for i in range(pf.metadata.num_row_groups)]
        start, stop = plan.row_groups or (0, len(group_rows))
        if not 0 <= start <= stop <= len(group_rows):
            raise InputError(f"row groups {start}..{stop} asked of a file of {len(group_rows)}", path=self.path)
        done = sum(group_rows[:start])  # rows before this part: row numbers stay the file's own
        first, part_rows = done, max(sum(group_rows[start:stop]), 1)
        try:
            # whole row groups per batch where they are of a sane size: no re-slicing across groups
            batch_size = min(max(max(group_rows, default=0), PARQUET_MIN_BATCH), PARQUET_MAX_BATCH)
            batches = pf.iter_batches(batch_size=batch_size, row_groups=range(start, stop), columns=columns,
                                      use_threads=True)
            for batch in batches:
                n = batch.num_rows
                if plan.flat is None:
                    rows = arrays.rows(batch)
                    yield from self._records(plan, ((done + i + 1, None, r) for i, r in enumerate(rows)))
                    done += n
                    continue
                try:
                    cols = {t: _cast(batch.column(src), t) for t, src in sources.items()}
                except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError):
                    rows = arrays.rows(batch)
                    yield from self._records(plan, ((done + i + 1, None, r) for i, r in enumerate(rows)))
                    done += n
                    continue
                self.info.rows += n
                self.stats.rows_read += n
                out = self._finalize(plan, cols, n, _lines_from(done + 1))
                done += n
                if out is not None:
                    yield out
                self._progress(int(size * min((done - first) / part_rows, 1.0)))
        except KvtuneError:
            raise
        except (OSError, pa.ArrowException) as exc:
            raise InputError(f"corrupt Parquet file: {exc}", path=self.path, line=done + 1 if done else None) from exc


def _lines_from(first: int) -> Callable[[int], int]:
    """`locate` for a batch whose row i is row (line) first + i of the file."""
    return lambda i: first + i


def _cast(col: pa.Array, target: str) -> pa.Array:
    """A Parquet column onto the target's type; a failed safe cast sends the batch row by row."""
    if isinstance(col, pa.ChunkedArray):
        col = col.combine_chunks()
    if target == "timestamp_s":
        if pa.types.is_timestamp(col.type) or pa.types.is_integer(col.type) or pa.types.is_floating(col.type):
            return col
        raise pa.ArrowInvalid("timestamp column needs the row path")
    typ = _TYPES[target]
    if typ == pa.string() and not arrays.utf8(col):
        raise pa.ArrowInvalid("a label column that is not UTF-8 needs the row path")
    if col.type == typ:
        return col
    if pa.types.is_dictionary(col.type) and typ == pa.string():
        return col
    if typ == pa.string() and not (pa.types.is_string(col.type) or pa.types.is_large_string(col.type)):
        raise pa.ArrowInvalid("non-string label column needs the row path")
    return col.cast(typ)  # safe: fractional floats or text raise ArrowInvalid
