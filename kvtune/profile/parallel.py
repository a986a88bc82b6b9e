"""The map step of profiling in several local processes, merged exactly (`on_ray` runs the same
tasks on a Ray cluster).

Histograms add, so the profiles of an input's parts, merged, are the profile of the whole. The
merged result is byte-identical to one process's because:
- the parent plans every file first (`ingest.readers.plan_logs`: the same checks and errors, in
  the same order, before any row is read), then cuts the input into tasks: a file each, and a
  Parquet file of several row groups into runs of them. Rows keep their file's own numbers, so a
  bad row in file 37 is named as file 37, line N, wherever it was read;
- each task profiles its part with every route kept; the parts merge in input order (the first
  example of each skip reason stays the first in input order), and routes fold to --max-routes
  once, over the whole (folding parts would keep each part's busiest routes, not the input's);
- a failed task raises in input order, so the error is the one a single process meets first.

Batch API input files are joined onto their output files by custom_id across files, and
`memory://` files live in this process's memory only: an input holding either is read here, in
one process (and refused by `--ray`).
"""

from __future__ import annotations

import bisect
import functools
import itertools
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from kvtune.ingest import set_threads
from kvtune.ingest.remote import RemoteFile
from kvtune.ingest.window import WindowReport
from kvtune.profile.build import PREFETCH_BATCHES, profile_read
from kvtune.profile.routes import InputFile, Profile, fold_routes, merge_profiles

if TYPE_CHECKING:  # pragma: no cover
    from concurrent.futures import Future

    from kvtune.ingest import IngestOptions
    from kvtune.ingest.paths import LogFile, SkippedFile
    from kvtune.ingest.plan import FilePlan

__all__ = ["Task", "auto_workers", "parallel_safe", "split", "profile_part", "merge_parts", "profile_parallel"]

#: Tasks per worker a big input is cut into, so a slow part does not leave the others idle.
TASKS_PER_WORKER = 4
#: Cores one reading process keeps busy by itself: its reader's threads decode (pyarrow, the
#: JSONL scanner) while its main thread counts. On this project's 2-core machine one process
#: matched two at every size measured (benchmarks/profile_bench.py, kvtune-w2), so `auto` starts
#: a second process only where there are cores the first cannot use.
CORES_PER_WORKER = 2
#: Below this many bytes of input, starting processes costs more than it saves (each imports
#: pyarrow and numpy, about half a second on a 2-core machine): `auto_workers` picks one.
AUTO_MIN_BYTES = 256 << 20

ProgressCallback = Callable[[int, int], None]

#: Imported once by the fork server, before it forks each worker: a worker's first task would
#: otherwise import the readers and pyarrow's formats itself (~0.4 s each on this machine).
_WORKER_MODULES = ("kvtune.profile.parallel", "kvtune.ingest.readers", "pyarrow.parquet", "pyarrow.csv",
                   "pyarrow.json")


@dataclass(frozen=True, slots=True)
class Task:
    """One part of the map step: a planned file, or a run of a Parquet file's row groups."""

    index: int  # the file's position in the input: parts merge in this order
    plan: FilePlan  # with row_groups set for a run of a Parquet file
    weight: int  # bytes (a run: its share of the file's, by rows), for balance and progress


def usable_cores() -> int:
    """The cores this process may run on (its affinity, which a container's limit sets)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover (not Linux)
        return os.cpu_count() or 1


def auto_workers(plans: Sequence[FilePlan]) -> int:
    """What `--workers` defaults to: one process per CORES_PER_WORKER cores once the input is big
    enough to pay for the processes, else one."""
    size = sum(p.size or 0 for p in plans)
    if size < AUTO_MIN_BYTES or not parallel_safe(plans):
        return 1
    return max(1, usable_cores() // CORES_PER_WORKER)


def parallel_safe(plans: Sequence[FilePlan]) -> bool:
    """Whether the plans may be read apart: no Batch API inputs (joined across files by
    custom_id) and no memory:// files (in this process's memory only)."""
    return not any(p.format == "openai-batch-input" or (isinstance(p.path, RemoteFile)
                                                          and p.path.url.startswith("memory:"))
                   for p in plans)


def split(plans: Sequence[FilePlan], workers: int) -> list[Task]:
    """The input as tasks, in input order: a file each, and a Parquet file bigger than the input's
    share of one task (1 / (TASKS_PER_WORKER · workers)) as runs of consecutive row groups of
    about that many bytes, so that a few big files still keep every worker busy."""
    total = sum(p.size or 0 for p in plans)
    target = max(total // max(TASKS_PER_WORKER * workers, 1), 1)
    tasks: list[Task] = []
    for index, plan in enumerate(plans):
        size = plan.size or 0
        groups = plan.group_rows
        if plan.container != "parquet" or len(groups) < 2 or size <= target:
            tasks.append(Task(index, plan, size))
            continue
        runs = min(len(groups), math.ceil(size / target))
        ends = list(itertools.accumulate(groups))  # rows up to and including each group
        rows = ends[-1] or 1
        # each run ends at the first group boundary at or past its share of the file's rows
        stops = sorted({min(bisect.bisect_left(ends, rows * r / runs) + 1, len(groups)) for r in range(1, runs)}
                       | {len(groups)})
        start = 0
        for stop in stops:
            if stop > start:
                held = ends[stop - 1] - (ends[start - 1] if start else 0)
                tasks.append(Task(index, replace(plan, row_groups=(start, stop)), size * held // rows))
            start = stop
    return tasks


def profile_part(task: Task, options: IngestOptions) -> Profile:
    """One task's part, profiled with every route kept (runs in a worker process or Ray task)."""
    from kvtune.ingest.readers import open_plans  # pyarrow, only when logs are read

    batches, stats = open_plans([task.plan], options)
    return profile_read(batches, stats, options, max_routes=None)


def merge_parts(tasks: Sequence[Task], parts: Sequence[Profile], pruned: int, skipped: Sequence[SkippedFile],
                options: IngestOptions, max_routes: int | None) -> Profile:
    """The parts (in task order) as one profile, as a single reader would have built it: a file
    read in several runs is one input with all their rows, the files planned but not read are the
    parent's, and routes fold once, at the end."""
    merged = merge_profiles(parts)
    inputs: list[InputFile] = []
    last = -1
    for task, part in zip(tasks, parts, strict=True):
        (read,) = part.inputs
        if task.index == last:
            inputs[-1] = replace(inputs[-1], rows=inputs[-1].rows + read.rows)
        else:
            inputs.append(read)
        last = task.index
    merged = replace(merged, inputs=tuple(inputs), skipped_files=tuple(skipped))
    if options.window is not None:
        outside = merged.window.outside_rows if merged.window is not None else 0
        merged = replace(merged, window=WindowReport.of(options.window, pruned, outside))
    return fold_routes(merged, max_routes)


def profile_parallel(
    paths: Sequence[str],
    options: IngestOptions,
    *,
    workers: int | None,
    progress: ProgressCallback | None = None,
    max_routes: int | None,
) -> Profile:
    """Profile logs with the map step in `workers` local processes (None: `auto_workers`); the
    same bytes as one process. An input that pays for no second process is read here."""
    from kvtune.ingest.readers import plan_logs  # pyarrow, only when logs are read

    plans, pruned, skipped = plan_logs(paths, options)
    count = auto_workers(plans) if workers is None else workers
    tasks = split(plans, count) if count > 1 and parallel_safe(plans) else []
    if len(tasks) < 2:
        return in_process(plans, pruned, skipped, options, progress, max_routes)
    parts = _run_local(tasks, options, min(count, len(tasks)), progress)
    return merge_parts(tasks, parts, len(pruned), skipped, options, max_routes)


def in_process(plans: Sequence[FilePlan], pruned: Sequence[LogFile], skipped: Sequence[SkippedFile],
               options: IngestOptions, progress: ProgressCallback | None, max_routes: int | None) -> Profile:
    """The planned files read here, in this process (an input that pays for no second one)."""
    from kvtune.ingest.readers import open_plans  # pyarrow, only when logs are read

    batches, stats = open_plans(plans, options, pruned=pruned, skipped_files=skipped, progress=progress,
                                prefetch=PREFETCH_BATCHES)
    return profile_read(batches, stats, options, max_routes)


def _run_local(tasks: Sequence[Task], options: IngestOptions, workers: int,
               progress: ProgressCallback | None) -> list[Profile]:
    """The tasks in a pool of `workers` fresh processes (forkserver: each worker forks from one
    process that imported kvtune and pyarrow once, and no thread of this one is copied into it)."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(list(_WORKER_MODULES))
    total = sum(t.weight for t in tasks) or 1
    done = [0]

    def finished(future: Future[Any], weight: int) -> None:  # in the pool's own thread
        done[0] += weight
        if progress is not None and not future.cancelled():
            progress(min(done[0], total), total)

    threads = max(1, usable_cores() // workers)
    pool = ProcessPoolExecutor(max_workers=workers, mp_context=context, initializer=_worker_init,
                               initargs=(threads,))
    try:
        futures = []
        for task in tasks:
            future = pool.submit(profile_part, task, options)
            future.add_done_callback(functools.partial(finished, weight=task.weight))
            futures.append(future)
        return [f.result() for f in futures]  # the first failure in input order raises
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _worker_init(threads: int) -> None:
    """A worker process's share of the cores for its reader's threads (`ingest.set_threads`)."""
    set_threads(threads)
