"""Micro-benchmark of `kvtune.ingest.flatscan.scan_block`: MB/s on flat JSONL lines, in memory.

Generates (seeded) about --mb MB of lines like
    {"route":"/v1/chat/completions","prompt_tokens":732,"output_tokens":6,"finish_reason":"stop"}
cuts them into --block-mb blocks at line ends, and times, as the median of --repeat runs:
    scan 1 thread    every block in turn
    scan N threads   the blocks over a thread pool (the scan releases the GIL)
    json.loads       per line, on the first 10 MB only (it is slow), without any conversion
    orjson.loads     the same, for scale

    python benchmarks/flatscan_bench.py --mb 100 --repeat 9 --threads 2   # ~10M lines per measurement
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import orjson

from kvtune.ingest.flatscan import INT, LABEL, available, scan_block

KEYS = ("route", "prompt_tokens", "output_tokens", "finish_reason")
KINDS = (LABEL, INT, INT, LABEL)
ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/code/completions", "/v1/summarize")
LOADS_MB = 10


def generate(total_bytes: int, seed: int = 7) -> bytes:
    rng = random.Random(seed)
    lines, size = [], 0
    while size < total_bytes:
        line = (
            f'{{"route":"{rng.choice(ROUTES)}","prompt_tokens":{int(rng.lognormvariate(6.6, 1.0))},'
            f'"output_tokens":{int(rng.lognormvariate(5.0, 0.9))},'
            f'"finish_reason":"{"stop" if rng.random() < 0.9 else "length"}"}}\n'
        )
        lines.append(line)
        size += len(line)
    return "".join(lines).encode()


def blocks_of(data: bytes, block_bytes: int) -> list[memoryview]:
    """Whole-line blocks of about block_bytes, as views (no copies)."""
    view, out, start = memoryview(data), [], 0
    while start < len(data):
        end = data.find(b"\n", min(start + block_bytes, len(data)) - 1)
        end = len(data) if end < 0 else end + 1
        out.append(view[start:end])
        start = end
    return out


def scan_all(blocks: list[memoryview], pool: ThreadPoolExecutor | None) -> int:
    scan = partial(scan_block, keys=KEYS, kinds=KINDS)
    results = list(pool.map(scan, blocks)) if pool else [scan(b) for b in blocks]
    assert all(r is not None for r in results), "bench lines must be clean"
    return sum(r.rows for r in results)


def mb_per_s(run: Callable[[], object], nbytes: int, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return nbytes / 1e6 / statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=float, default=100.0, help="data generated in memory")
    parser.add_argument("--block-mb", type=float, default=4.0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=9)
    args = parser.parse_args()
    if not available():
        raise SystemExit("kvtune.ingest._flatscan is not built (pip install -e . with a C compiler)")

    data = generate(int(args.mb * 1e6))
    blocks = blocks_of(data, int(args.block_mb * 1e6))
    sample = data[: data.find(b"\n", LOADS_MB * 1_000_000) + 1].splitlines()
    sample_bytes = sum(len(line) + 1 for line in sample)
    nlines = data.count(b"\n")
    print(f"{len(data) / 1e6:.0f} MB, {nlines:,} lines, {len(blocks)} blocks of ~{args.block_mb:g} MB")

    print(f"scan 1 thread      {mb_per_s(lambda: scan_all(blocks, None), len(data), args.repeat):8.0f} MB/s")
    with ThreadPoolExecutor(args.threads) as pool:
        rate = mb_per_s(lambda: scan_all(blocks, pool), len(data), args.repeat)
    print(f"scan {args.threads} threads     {rate:8.0f} MB/s")
    for name, loads in (("json.loads", json.loads), ("orjson.loads", orjson.loads)):
        rate = mb_per_s(lambda loads=loads: [loads(line) for line in sample], sample_bytes, args.repeat)
        print(f"{name:<18} {rate:8.0f} MB/s (per line, {sample_bytes / 1e6:.0f} MB)")


if __name__ == "__main__":
    main()
