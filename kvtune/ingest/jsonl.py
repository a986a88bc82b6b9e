"""JSONL: the C scanner, DuckDB and pyarrow block paths for flat schemas, and line-by-line records.

A file is read (decompressed where it is compressed) into blocks cut at line ends (`_line_blocks`),
not mapped: a mapped log truncated under the reader kills the process with SIGBUS, a read one
ends in an InputError (`compression._Sized`). `JsonlPaths._json_scan` scans blocks in parallel with
kvtune's C scanner, `_json_duckdb` streams through DuckDB where the scanner is not built, and any
block they decline is read exactly by `_json_block` (pyarrow, bisection, then line by line) so
every bad line keeps its number. `_json_records` is the per-line reading all of them must equal.
"""

from __future__ import annotations

import io
import json
from collections import deque
from collections.abc import Callable, Generator, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
import pyarrow as pa

from kvtune.ingest import arrays, flatscan, reader_threads
from kvtune.ingest.columns import _TYPES, ColumnChecks, Records, _bad_rows
from kvtune.ingest.compression import Stream, _Sized, check_not_shrunk, compression_of, open_bytes
from kvtune.ingest.plan import FilePlan
from kvtune.ingest.remote import RemoteFile
from kvtune.ingest.schemas._fields import MALFORMED_JSON, RowError, is_unicode

if TYPE_CHECKING:
    from concurrent.futures import Future

    import pyarrow.json as pj

BLOCK_BYTES = 4 << 20  # JSONL bytes per pyarrow parse
SCAN_BLOCK_BYTES = 16 << 20  # JSONL bytes per C scan: ~150k rows, so per-batch costs stay small
READ_PAST_BYTES = 64 << 10  # read beyond a block's range to find where its last line ends
BISECT_MIN_LINES = 64  # below this a failed block is read line by line
DUCKDB_BATCH_ROWS = 1 << 19  # rows per Arrow batch from DuckDB's JSON reader
DUCKDB_MEMORY = "1GB"  # DuckDB's own memory limit (it streams; this bounds its buffers)

_SCAN_KINDS = {
    pa.int64(): flatscan.INT, pa.float64(): flatscan.FLOAT, pa.string(): flatscan.LABEL, pa.bool_(): flatscan.BOOL
}
_SCAN_TYPES = {
    kind: pa.dictionary(pa.int32(), pa.string()) if typ == pa.string() else typ for typ, kind in _SCAN_KINDS.items()
}


class JsonlPaths(ColumnChecks):
    """The reader's JSONL paths, joined in `readers._Reader` (reader state and hooks:
    `columns.ColumnChecks`)."""

    # -- slow path: records one at a time

    def _json_records(self, plan: FilePlan) -> Records:
        if plan.document is not None:
            for i, rec in enumerate(plan.document):
                yield None, i, rec
            return
        stream, raw = open_bytes(plan.path, plan.size)
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

    def _json_slow(self, plan: FilePlan) -> Iterator[pa.RecordBatch]:
        yield from self._records(plan, self._json_records(plan))

    # -- fast path: JSONL blocks

    def _json_scan(self, plan: FilePlan) -> Iterator[pa.RecordBatch]:
        """Flat JSONL through kvtune's C scanner (kvtune.ingest.flatscan), blocks in parallel.

        The scanner takes a block only when every record in it is one it reads exactly as the
        per-line reading would; any other block goes to the exact block reader (`_json_block`:
        pyarrow, bisection, then line by line), which reports each bad line with its number.
        """
        sources = self._sources(plan)
        types = _source_types(sources)
        keys, kinds = list(types), [_SCAN_KINDS[t] for t in types.values()]
        parse = _json_parse_options(sources)
        stream, raw = open_bytes(plan.path, plan.size)
        line0 = 1
        try:
            for block, scanned, pos in _scanned_blocks(stream, raw, keys, kinds):
                line0 = yield from self._json_scanned(plan, scanned, block, pos, line0, keys, kinds, sources, parse)
        finally:
            stream.close()
            raw.close()

    def _json_scanned(
        self,
        plan: FilePlan,
        scanned: flatscan.ScannedBlock | None,
        block: memoryview,
        pos: int,
        line0: int,
        keys: list[str],
        kinds: list[int],
        sources: dict[str, str],
        parse: pj.ParseOptions,
    ) -> Generator[pa.RecordBatch, None, int]:
        """Use one scanned block, or read it exactly when the scanner declined; returns the next
        block's first line number."""
        if scanned is None:
            data = bytes(block)
            yield from self._json_block(plan, data, line0, sources, parse)
            lines = data.count(b"\n") + (0 if data.endswith(b"\n") or not data else 1)
        else:
            n, lines = scanned.rows, scanned.lines
            self.info.rows += n
            self.stats.rows_read += n
            by_key: dict[str, pa.Array] = {}
            for key, kind, column, vocab in zip(keys, kinds, scanned.columns, scanned.vocabs, strict=True):
                if column is None:  # in no record of the block
                    by_key[key] = arrays.nulls(n, _SCAN_TYPES[kind])
                elif kind == flatscan.LABEL:
                    assert vocab is not None  # every LABEL key has one
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

    def _json_duckdb(self, plan: FilePlan) -> Iterator[pa.RecordBatch]:
        """Flat JSONL through DuckDB's JSON reader (about twice pyarrow's speed), strictly.

        DuckDB converts leniently (12.5 → 12 for an integer column, numbers and objects → text
        for a string column), so every column is read as JSON text and converted here with
        kvtune's own rules: integers must be integer literals, labels must be JSON strings. A
        batch that is not entirely clean (anything the reference reading would turn into a skip
        or treat differently), or any DuckDB error, hands the rest of the file from that batch's
        first record to the block reader (`_json_fast`), which reports exact lines. DuckDB keeps
        file order (preserve_insertion_order), so the records already used are known by count.
        """
        if isinstance(plan.path, RemoteFile):  # DuckDB would open the URL itself: the block reader
            yield from self._json_fast(plan)
            return
        try:
            import duckdb
        except ImportError:  # an install without it: the pyarrow block reader does the same work
            yield from self._json_fast(plan)
            return
        flat = plan.flat
        assert flat is not None
        sources = self._sources(plan)
        keys = list(dict.fromkeys(sources.values()))
        codec = compression_of(plan.path)
        con = duckdb.connect(config={
            "threads": reader_threads(),
            "memory_limit": DUCKDB_MEMORY,
            "preserve_insertion_order": True,
        })
        done = 0  # records used, in file order
        size = plan.size or 0
        try:
            try:
                relation = con.read_json(
                    str(plan.path),
                    format="newline_delimited",
                    columns=dict.fromkeys(keys, "JSON"),
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
                except StopIteration:  # DuckDB reads the file as it finds it: had it shrunk?
                    check_not_shrunk(plan.path, size)
                    return
                except Exception:  # parse errors, invalid UTF-8, memory: from here, the block reader
                    break
                cols = _strict_columns(batch, sources)
                n = batch.num_rows
                if cols is None or _bad_rows(cols, n, flat.zero_output_failed, flat.time_unit) or (
                        self.options.window is not None  # rows without a timestamp: named by the block reader
                        and ("timestamp_s" not in cols or cols["timestamp_s"].null_count)):
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

    def _json_fast(self, plan: FilePlan, skip_records: int = 0) -> Iterator[pa.RecordBatch]:
        assert plan.flat is not None
        sources = self._sources(plan)
        parse = _json_parse_options(sources)
        stream, raw = open_bytes(plan.path, plan.size)
        try:
            head, line0 = _skip_records(stream, skip_records) if skip_records else (b"", 1)
            for future, block, pos in _in_order(_line_blocks(stream, raw, head), lambda b: _parse_block(b, parse)):
                line0 = yield from self._json_parsed(plan, future, block, pos, line0, sources, parse)
        finally:
            stream.close()
            raw.close()

    def _json_parsed(
        self,
        plan: FilePlan,
        future: Future[tuple[pa.Table | None, int]],
        block: memoryview,
        pos: int,
        line0: int,
        sources: dict[str, str],
        parse: pj.ParseOptions,
    ) -> Generator[pa.RecordBatch, None, int]:
        """Use one parsed block (or bisect it when it failed); returns the next block's line."""
        table, lines = future.result()
        if table is None:  # some line does not fit the fast schema: find it by bisection
            yield from self._json_block(plan, bytes(block), line0, sources, parse)
        else:
            yield from self._json_table(plan, table, block, line0, sources)
        self._progress(pos)
        return line0 + lines

    def _json_block(
        self, plan: FilePlan, block: bytes, line0: int, sources: dict[str, str], parse: pj.ParseOptions
    ) -> Iterator[pa.RecordBatch]:
        import pyarrow.json as pj

        try:
            table = _checked_text(pj.read_json(pa.BufferReader(block), parse_options=parse))
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

    def _json_table(
        self, plan: FilePlan, table: pa.Table, block: bytes | memoryview, line0: int, sources: dict[str, str]
    ) -> Iterator[pa.RecordBatch]:
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


def _scanned_blocks(
    stream: Stream, raw: io.BufferedReader[_Sized], keys: list[str], kinds: list[int]
) -> Iterator[tuple[memoryview, flatscan.ScannedBlock | None, int]]:
    """(block, its scan, compressed position) of each block of whole lines, in file order; the
    scanner releases the GIL, so blocks scan in parallel (`_in_order`)."""
    if stream is raw:  # plain: each worker reads its own lines, copying out of the page cache in parallel
        file = raw.raw

        def read_and_scan(lines: tuple[int, int]) -> tuple[memoryview, flatscan.ScannedBlock | None]:
            block = _read_lines(file, *lines)
            return block, flatscan.scan_block(block, keys, kinds)

        ranges = ((r, r[1]) for r in _line_ranges(file.size, SCAN_BLOCK_BYTES))
        for future, _, pos in _in_order(ranges, read_and_scan):
            yield (*future.result(), pos)
    else:

        def scan(block: memoryview) -> tuple[memoryview, flatscan.ScannedBlock | None]:
            return block, flatscan.scan_block(block, keys, kinds)

        for future, _, pos in _in_order(_line_blocks(stream, raw, size=SCAN_BLOCK_BYTES), scan):
            yield (*future.result(), pos)


_Block = TypeVar("_Block")
_Result = TypeVar("_Result")


def _in_order(
    blocks: Iterable[tuple[_Block, int]], work: Callable[[_Block], _Result]
) -> Iterator[tuple[Future[_Result], _Block, int]]:
    """(future of work(block), block, position) for each block, in file order, with the next
    blocks already running on one thread per CPU; a consumer that stops early cancels the rest."""
    from concurrent.futures import ThreadPoolExecutor  # here: Parquet and CSV reading skip its import

    workers = reader_threads()
    pending: deque[tuple[Future[_Result], _Block, int]] = deque()
    with ThreadPoolExecutor(workers) as pool:
        try:
            for block, pos in blocks:
                pending.append((pool.submit(work, block), block, pos))
                if len(pending) > workers:
                    yield pending.popleft()
            while pending:
                yield pending.popleft()
        finally:
            for future, *_ in pending:
                future.cancel()


def _source_types(sources: Mapping[str, str]) -> dict[str, pa.DataType]:
    """One column per source key, typed by its first target."""
    types: dict[str, pa.DataType] = {}
    for t, src in sources.items():
        types.setdefault(src, _TYPES[t])
    return types


def _json_parse_options(sources: Mapping[str, str]) -> pj.ParseOptions:
    """pyarrow's JSON parse options for the block reader (one typed column per source key)."""
    import pyarrow.json as pj

    schema = pa.schema(list(_source_types(sources).items()))
    return pj.ParseOptions(explicit_schema=schema, unexpected_field_behavior="ignore")


def _line_blocks(
    stream: Stream, raw: io.BufferedReader[_Sized], head: bytes = b"", size: int | None = None
) -> Iterator[tuple[memoryview, int]]:
    """(block of whole lines, compressed position) over a byte stream, copying only line tails;
    `head` is input already read from the stream, to go first; blocks of `size` (BLOCK_BYTES).

    Each block is a fresh uninitialized buffer (numpy.empty: no zero-filling pass before the
    read fills it), as blocks in flight on other threads still hold the earlier ones.
    """
    size = size or BLOCK_BYTES
    tail = head
    while True:
        buf = np.empty(len(tail) + size, np.uint8)
        view = buf.data  # memoryview(buf); numpy types its buffer protocol from Python 3.12 on
        view[: len(tail)] = tail
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
        cut = _last_newline(buf, filled)
        if cut < 0 and filled == len(buf):  # one line longer than a block: grow
            tail = bytes(view[:filled])
            continue
        if filled < len(buf):  # last block: everything that is left
            cut = filled - 1
        tail = bytes(view[cut + 1 : filled])
        yield view[: cut + 1], raw.tell()


def _line_ranges(size: int, block: int) -> Iterator[tuple[int, int]]:
    """Byte ranges [start, stop) of `block` bytes covering a file of `size`; a range stands for the
    lines that begin in it (`_read_lines`), so ranges cut anywhere and each block is whole lines."""
    for start in range(0, size, block):
        yield start, min(start + block, size)


def _read_lines(file: _Sized, start: int, stop: int) -> memoryview:
    """The lines that begin in [start, stop) of a plain file (`compression._Sized`), read with pread.

    A line begins at 0 and after each b"\\n", so those lines are the bytes from the first line
    start at or after `start` to the first at or after `stop`: reading one byte before the range
    and on past its end to the next newline finds both, whatever the neighbouring blocks hold.
    """
    begin = start - 1 if start else 0
    buf = np.empty(stop - begin + READ_PAST_BYTES, np.uint8)
    filled = file.read_at(begin, buf)
    first = 0
    if start:  # the first line start at or after `start`
        first = _first_newline(buf, 0, min(filled, stop - begin)) + 1
        if first == 0:  # no line begins in the range: one that began before runs through it
            return buf.data[:0]
    end = stop - begin - 1  # then the first line start at or after `stop`
    while True:
        found = _first_newline(buf, end, filled)
        if found >= 0:
            end = found + 1
            break
        if filled < len(buf):  # the file ends before another newline: the last line runs to it
            end = filled
            break
        grown = np.empty(2 * len(buf), np.uint8)  # a line longer than what was read: read on
        grown[:filled] = buf[:filled]
        buf, end = grown, filled
        filled += file.read_at(begin + filled, buf[filled:])
    return buf.data[first:max(first, end)]


def _first_newline(buf: np.ndarray, start: int, end: int) -> int:
    """Index of the first b"\\n" in buf[start:end], or -1: searched in growing windows, as lines
    are short and the next one is near."""
    window = 1 << 12
    while start < end:
        stop = min(end, start + window)
        found = np.flatnonzero(buf[start:stop] == 10)
        if found.size:
            return start + int(found[0])
        start, window = stop, 2 * window
    return -1


def _last_newline(buf: np.ndarray, end: int) -> int:
    """Index of the last b"\\n" in buf[:end], or -1: searched from the end in growing windows, as
    lines are short and the last one is near."""
    window = 1 << 16
    stop = end
    while stop > 0:
        start = max(0, stop - window)
        found = np.flatnonzero(buf[start:stop] == 10)
        if found.size:
            return start + int(found[-1])
        stop, window = start, 2 * window
    return -1


_BLANK = np.zeros(256, bool)
_BLANK[list(b" \t\n\r\x0b\x0c")] = True  # what bytes.strip() removes


def _skip_records(stream: io.BufferedIOBase, k: int) -> tuple[bytes, int]:
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
        if not isinstance(value, str) or not is_unicode(value):
            return None
        decoded.append(value)
    unique = list(dict.fromkeys(decoded))
    indices, ok = arrays.ints(coded.indices)
    if len(unique) < len(decoded):
        return arrays.dictionary(np.array([unique.index(v) for v in decoded], np.int32)[indices], unique, ok)
    return arrays.dictionary(indices, unique, ok)


def _parse_block(block: memoryview, parse: pj.ParseOptions) -> tuple[pa.Table | None, int]:
    """Parse one block with the fast schema on one thread (None when a line does not fit it),
    and count its newlines for line numbers, off the main thread."""
    import pyarrow.json as pj

    lines = int(np.count_nonzero(np.frombuffer(block, dtype=np.uint8) == 10))
    read = pj.ReadOptions(use_threads=False, block_size=len(block) + 1)
    try:
        source = pa.BufferReader(pa.py_buffer(block))
        table = _checked_text(pj.read_json(source, read_options=read, parse_options=parse))
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        table = None
    return table, lines


def _checked_text(table: pa.Table) -> pa.Table:
    """The table, after checking that its strings are UTF-8: pyarrow's JSON reader copies invalid
    bytes and lone surrogates (\\ud800) into string columns as they are; ArrowInvalid sends the
    block to the line-by-line reading, which skips such lines by name."""
    for column in table.columns:
        if pa.types.is_string(column.type):
            column.validate(full=True)
    return table


def _parse_line(line: bytes) -> Any:
    try:
        return json.loads(line)
    except RecursionError:
        return RowError(None, "JSON nested too deeply", MALFORMED_JSON)
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
        detail = exc.msg if isinstance(exc, json.JSONDecodeError) else "not UTF-8"
        return RowError(None, f"malformed JSON: {detail}", MALFORMED_JSON)
