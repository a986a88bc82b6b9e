"""Micro-benchmark of the shared ledger (kvtune.gateway.redis_ledger): reserve + release latency on
loopback, beside the in-memory BlockLedger it would replace.

Starts its own redis-server (no persistence, or --appendonly for AOF with fsync every second, as a
deployment would run it) on a free port unless --url names one, then times:
    memory        BlockLedger.try_reserve + Reservation.release, one after the other
    redis c=1     RedisLedger.reserve + release, one after the other (two EVALSHA round trips)
    redis c=N     the same from N concurrent asyncio tasks (one event loop, as one gateway process)
    redis R/s     pairs started at R per second whatever the others do (open loop, as requests arrive)
on uvloop by default, as the gateway runs
and prints p50 / p99 / p99.9 of one reserve+release pair in microseconds, and pairs per second.

    python benchmarks/redis_ledger_bench.py --pairs 5000 --concurrency 32
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import socket
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from kvtune.gateway.ledger import BlockLedger
from kvtune.gateway.redis_ledger import RedisLedger


def percentiles(samples_s: list[float]) -> str:
    xs = sorted(samples_s)
    q = statistics.quantiles(xs, n=1000, method="inclusive")
    return f"p50 {q[499] * 1e6:7.1f} us  p99 {q[989] * 1e6:7.1f} us  p99.9 {q[998] * 1e6:7.1f} us"


def memory(pairs: int) -> list[float]:
    ledger = BlockLedger(1000)
    out = []
    for _ in range(pairs):
        began = time.perf_counter()
        reservation = ledger.try_reserve(4)
        assert reservation is not None
        reservation.release()
        out.append(time.perf_counter() - began)
    return out


async def shared(url: str, pairs: int, concurrency: int) -> tuple[list[float], float]:
    out: list[float] = []
    async with RedisLedger(url, owner="bench", key_prefix="bench") as ledger:
        for i in range(200):  # warm the pool and the scripts
            await ledger.reserve("u", f"w{i}", 1, 10**9)
            await ledger.release(f"w{i}")
        serial = iter(range(pairs))

        async def task() -> None:
            for i in serial:
                began = time.perf_counter()
                assert await ledger.reserve("u", f"r{i}", 4, 10**9)
                assert await ledger.release(f"r{i}")
                out.append(time.perf_counter() - began)

        began = time.perf_counter()
        async with asyncio.TaskGroup() as group:
            for _ in range(concurrency):
                group.create_task(task())
        return out, pairs / (time.perf_counter() - began)


async def shared_at_rate(url: str, pairs: int, rate_per_s: float) -> list[float]:
    """Open loop: a pair starts every 1/rate s whatever the others do, as requests arrive."""
    out: list[float] = []
    async with RedisLedger(url, owner="bench-rate", key_prefix="bench") as ledger:
        async def pair(i: int) -> None:
            began = time.perf_counter()
            assert await ledger.reserve("u", f"q{i}", 4, 10**9)
            assert await ledger.release(f"q{i}")
            out.append(time.perf_counter() - began)

        loop = asyncio.get_running_loop()
        start = loop.time()
        async with asyncio.TaskGroup() as group:
            for i in range(pairs):
                delay = start + i / rate_per_s - loop.time()
                if delay > 0:
                    await asyncio.sleep(delay)
                group.create_task(pair(i))
    return out


def start_redis(directory: Path, appendonly: bool) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    binary = shutil.which("redis-server") or "/usr/bin/redis-server"
    persistence = ["--appendonly", "yes", "--appendfsync", "everysec"] if appendonly else ["--appendonly", "no"]
    process = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(directory),
                                "--save", "", *persistence], stdout=subprocess.DEVNULL)
    for _ in range(500):
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2) as c:
                c.sendall(b"PING\r\n")
                if c.recv(16).startswith(b"+PONG"):
                    return process, f"redis://127.0.0.1:{port}/0"
        except OSError:
            pass
        time.sleep(0.02)
    process.kill()
    raise SystemExit("redis-server did not start")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="an existing Redis (default: start one)")
    parser.add_argument("--pairs", type=int, default=5000)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--rate", type=float, default=1000.0, help="open-loop pairs per second (the last line)")
    parser.add_argument("--appendonly", action="store_true", help="the started Redis writes an AOF")
    parser.add_argument("--loop", choices=("asyncio", "uvloop"), default="uvloop",
                        help="the event loop (the gateway runs on uvloop when it is installed)")
    args = parser.parse_args()
    loop_factory = None
    if args.loop == "uvloop":
        import uvloop

        loop_factory = uvloop.new_event_loop
    with tempfile.TemporaryDirectory() as tmp:
        process, url = (None, args.url) if args.url else start_redis(Path(tmp), args.appendonly)
        try:
            mem = memory(args.pairs * 4)
            print(f"memory       {percentiles(mem)}  {len(mem) / sum(mem):10.0f} pairs/s")
            for c in (1, args.concurrency):
                with asyncio.Runner(loop_factory=loop_factory) as runner:
                    lat, rate = runner.run(shared(url, args.pairs, c))
                print(f"redis c={c:<4} {percentiles(lat)}  {rate:10.0f} pairs/s")
            with asyncio.Runner(loop_factory=loop_factory) as runner:
                lat = runner.run(shared_at_rate(url, args.pairs, args.rate))
            print(f"redis {args.rate:g}/s {percentiles(lat)}  (open loop)")
        finally:
            if process is not None:
                process.terminate()
                process.wait(10)


if __name__ == "__main__":
    main()
