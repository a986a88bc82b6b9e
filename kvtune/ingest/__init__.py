"""Ingest: production request logs of many shapes → normalized Arrow batches, one row per request.

`read_logs` expands paths, detects each file's container (JSONL, CSV, Parquet; plain, .gz, .zst)
and schema (OpenAI, Anthropic, LiteLLM, Langfuse, Helicone, OTel GenAI, public traces, kvtune's
own flat format), and streams `pyarrow.RecordBatch`es with exactly `COLUMNS`. Rows that cannot be
used are counted in `IngestStats.skipped` with a reason, or raise with `OnError.FAIL`/`strict`.
pyarrow is imported lazily so that `kvtune --help` stays fast.
"""

from __future__ import annotations

import enum
import os
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvtune.errors import UnknownNameError
from kvtune.ingest.paths import SkippedFile, expand_inputs, expand_paths
from kvtune.ingest.schemas import FORMATS

if TYPE_CHECKING:
    import pyarrow

    from kvtune.domain.log_reading import LogReading
    from kvtune.ingest.window import Window

COLUMNS = (
    "route",
    "model",
    "prompt_tokens",
    "output_tokens",
    "max_tokens",
    "finish_reason",
    "censored",
    "timestamp_s",
    "latency_ms",
    "ttft_ms",
)


@dataclass
class FileInfo:
    """One input file: its path, the format detected (or forced) and the data rows read from it."""

    path: str
    format: str
    rows: int = 0
    partitions: dict[str, str] = field(default_factory=dict)  # Hive keys of its path (dt=…), outermost first


@dataclass
class IngestStats:
    """What was read: files, rows read, rows kept, and skipped rows by reason.

    Invariant: rows_read == rows_ok + sum(skipped.values()) + outside_window.
    `examples` holds the first location (`path:line: field: message`) of each skip reason so a
    summary can point at a line to look at.
    """

    files: list[FileInfo] = field(default_factory=list)
    rows_read: int = 0
    rows_ok: int = 0
    skipped: Counter[str] = field(default_factory=Counter)
    examples: dict[str, str] = field(default_factory=dict)
    # Records that are not requests (OTel spans without gen_ai attributes, Langfuse SPAN/EVENT
    # observations, Batch API input lines): reported, never fatal, not part of rows_read.
    ignored: Counter[str] = field(default_factory=Counter)
    # With a --since/--until window: files never opened (partition date outside it, not in `files`)
    # and rows read whose timestamp lies outside it.
    pruned: list[str] = field(default_factory=list)
    outside_window: int = 0
    # Files never read on purpose: an --exclude pattern matched them, or kvtune wrote them.
    skipped_files: list[SkippedFile] = field(default_factory=list)

    def skip(self, reason: str, where: str, count: int = 1) -> None:
        self.skipped[reason] += count
        self.examples.setdefault(reason, where)


class OnError(enum.Enum):
    """What a row that cannot be used does: counted in `IngestStats.skipped` (SKIP), or raised as
    an InputError naming its line (FAIL). The values are the words of `--on-error`."""

    SKIP = "skip"
    FAIL = "fail"


def parse_on_error(name: str) -> OnError:
    """The OnError a word of `--on-error` names ("skip" or "fail")."""
    try:
        return OnError(name)
    except ValueError:
        raise UnknownNameError(f"unknown on_error {name!r}; use skip or fail", field="on_error") from None


@dataclass(frozen=True)
class IngestOptions:
    """How to read logs: forced format, field mapping, route choice, tokenizer, error policy.

    fields maps a target column (COLUMNS, or `path`, `prompt_text`, `output_text`) to a dotted
    source path such as `usage.completion_tokens` or `choices[0].finish_reason`.
    route_by is "path", "model" or a source field path; None means the request path when logged.
    assume_cap treats outputs >= this value as cut at a cap (for traces without finish reasons).
    window keeps only rows whose timestamp falls in it (`kvtune.ingest.window`) and prunes the
    partitions outside it (`kvtune.ingest.partitions`). exclude: glob patterns of files not to read
    (`kvtune.ingest.paths.excluded_by`).
    log_model keeps only the rows that name this logged model (ignoring case); the profile
    builder selects them, in every worker, and counts what it left out (`kvtune.profile.logged_model`).
    """

    format: str | None = None
    fields: Mapping[str, str] = field(default_factory=dict)
    route_by: str | None = None
    tokenizer: str | None = None
    on_error: OnError = OnError.SKIP
    strict: bool = False
    assume_cap: int | None = None
    window: Window | None = None
    exclude: tuple[str, ...] = ()  # --exclude globs: files whose relative path or base name match are not read
    log_model: str | None = None


def options_for(reading: LogReading) -> IngestOptions:
    """How to read the logs a kvtune.domain LogReading describes (kvtune.api's profile_logs,
    simulate and benchmark take one): its window parsed, InputError when since is not before until."""
    from kvtune.ingest.window import Window  # numpy: only to read logs

    return IngestOptions(format=reading.format, fields=dict(reading.fields), route_by=reading.route_by,
                         tokenizer=reading.tokenizer, on_error=parse_on_error(reading.on_error), strict=reading.strict,
                         assume_cap=reading.assume_cap, window=Window.parse(reading.since, reading.until),
                         exclude=tuple(reading.exclude), log_model=reading.log_model)


_threads: int | None = None


def set_threads(count: int | None) -> None:
    """The threads one reader uses (its JSONL blocks in flight, pyarrow's decoding); None: one per
    core. A parallel map step gives each worker process its share of the cores, not all of them."""
    global _threads
    _threads = count
    if count is not None:
        import pyarrow

        pyarrow.set_cpu_count(count)


def reader_threads() -> int:
    """The threads a reader runs (`set_threads`)."""
    return _threads or max(1, os.cpu_count() or 1)


def read_logs(
    paths: Sequence[str],
    options: IngestOptions,
    *,
    progress: Callable[[int, int], None] | None = None,
    prefetch: int = 0,
) -> tuple[Iterator[pyarrow.RecordBatch], IngestStats]:
    """Stream normalized batches from log files; stats fill in as the iterator runs.

    Options, paths and every file's format are checked before this returns, so a typo fails
    before any work; row-level problems surface while iterating. prefetch > 0 reads that many
    batches ahead in a background thread (progress is then called from that thread), so reading
    overlaps with whatever the caller does with each batch.
    """
    from kvtune.ingest.readers import open_logs  # pyarrow, only when logs are read

    return open_logs(paths, options, progress=progress, prefetch=prefetch)


__all__ = [
    "COLUMNS",
    "FORMATS",
    "FileInfo",
    "IngestOptions",
    "IngestStats",
    "OnError",
    "SkippedFile",
    "expand_inputs",
    "expand_paths",
    "parse_on_error",
    "read_logs",
    "reader_threads",
    "set_threads",
]
