"""What the admission gateway costs: latency added (p50, p99) and the request rate it sustains, on
loopback, against an instant upstream in its own process, next to the same load sent directly.

Three measurements, each direct and through `kvtune gateway` (a separate process, as deployed):
  latency     one request at a time (concurrency 1): p50/p99; "added" = gateway - direct
  open 1000   an open loop at --rate requests/s for --seconds: achieved rate, p50/p99 from the
              scheduled send time (so queueing shows up, no coordinated omission)
  ceiling     a closed loop at --concurrency for --seconds: completed requests/s

The gateway runs once per prompt-counting method: `upstream-tokenize` (an extra round trip to the
upstream's /tokenize per request, the default) and `estimate` (no round trip). Each figure is the
median over --runs runs. Prints a table and, with --json, one JSON object.

    python bench/gateway_bench.py --runs 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import aiohttp

UPSTREAM_SRC = textwrap.dedent("""
    import json, sys
    from aiohttp import web
    ANSWER = json.dumps({"id": "x", "object": "chat.completion", "choices": [{"index": 0,
        "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 12, "completion_tokens": 1, "total_tokens": 13}}).encode()
    async def chat(request):
        await request.read()
        return web.Response(body=ANSWER, content_type="application/json")
    async def tokenize(request):
        await request.read()
        return web.Response(body=b'{"count": 12, "max_model_len": 4096, "tokens": []}',
                            content_type="application/json")
    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_post("/tokenize", tokenize)
    web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), access_log=None, print=None)
""")

BODY = json.dumps({"model": "m", "messages": [{"role": "user", "content": "Say ok, briefly please."}],
                   "max_tokens": 16}).encode()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_http(url: str, deadline_s: float = 20) -> None:
    import urllib.error
    import urllib.request

    end = time.monotonic() + deadline_s
    while True:
        try:
            urllib.request.urlopen(url, timeout=1).close()
            return
        except urllib.error.HTTPError:
            return  # it answers
        except OSError:
            if time.monotonic() > end:
                raise RuntimeError(f"{url} did not come up")
            time.sleep(0.05)


class Proc:
    """A child process stopped with SIGTERM → wait → kill."""

    def __init__(self, args: list[str], **kw) -> None:
        self.p = subprocess.Popen(args, **kw)

    def stop(self) -> None:
        if self.p.poll() is None:
            self.p.send_signal(signal.SIGTERM)
            try:
                self.p.wait(10)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait(5)


def start_upstream() -> tuple[Proc, str]:
    port = _free_port()
    proc = Proc([sys.executable, "-c", UPSTREAM_SRC, str(port)])
    url = f"http://127.0.0.1:{port}"
    _wait_http(url + "/")
    return proc, url


def start_gateway(upstream: str, method: str, workdir: Path) -> tuple[Proc, str]:
    import yaml

    counting = {"method": method}
    if method == "estimate":
        counting.update(chars_per_token=3, margin_tokens=16)
    config = {
        "version": 1, "upstream": upstream, "block_size": 16, "block_budget": 10_000_000,
        "max_model_len": 4096, "prompt_tokens": counting,
        "routes": [{"name": "chat", "match": {"path": "/v1/chat/completions"}, "max_new_tokens": 64},
                   {"name": "default", "max_new_tokens": 64}],
    }
    path = workdir / f"gateway-{method}.yaml"
    path.write_text(yaml.safe_dump(config))
    port = _free_port()
    proc = Proc([sys.executable, "-m", "kvtune", "gateway", "--config", str(path), "--port", str(port)],
                stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    _wait_http(url + "/healthz")
    return proc, url


def _pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, max(0, int(q * len(s) + 0.5) - 1))]


async def _one(session: aiohttp.ClientSession, url: str) -> None:
    async with session.post(url, data=BODY, headers={"Content-Type": "application/json"}) as resp:
        await resp.read()
        if resp.status != 200:
            raise RuntimeError(f"{url} answered {resp.status}")


async def latency(base: str, n: int) -> dict:
    url = base + "/v1/chat/completions"
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1)) as session:
        for _ in range(200):
            await _one(session, url)
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            await _one(session, url)
            times.append((time.perf_counter() - t0) * 1000)
    return {"p50_ms": _pct(times, 0.50), "p99_ms": _pct(times, 0.99)}


async def open_loop(base: str, rate: float, seconds: float) -> dict:
    url = base + "/v1/chat/completions"
    lat: list[float] = []
    errors = 0
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=256)) as session:
        for _ in range(200):
            await _one(session, url)

        async def fire(scheduled: float) -> None:
            nonlocal errors
            try:
                await _one(session, url)
                lat.append((time.perf_counter() - scheduled) * 1000)
            except Exception:
                errors += 1

        start = time.perf_counter()
        total = int(rate * seconds)
        tasks = []
        for i in range(total):
            scheduled = start + i / rate
            delay = scheduled - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(fire(scheduled)))
        await asyncio.gather(*tasks)
        elapsed = time.perf_counter() - start
    return {"offered_rps": rate, "achieved_rps": len(lat) / elapsed, "errors": errors,
            "p50_ms": _pct(lat, 0.5), "p99_ms": _pct(lat, 0.99)}


async def ceiling(base: str, concurrency: int, seconds: float) -> dict:
    url = base + "/v1/chat/completions"
    done = 0
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency)) as session:
        for _ in range(200):
            await _one(session, url)
        end = time.perf_counter() + seconds

        async def worker() -> None:
            nonlocal done
            while time.perf_counter() < end:
                await _one(session, url)
                done += 1

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = time.perf_counter() - start
    return {"rps": done / elapsed}


async def measure(base: str, args: argparse.Namespace) -> dict:
    return {
        "latency": await latency(base, args.requests),
        "open": await open_loop(base, args.rate, args.seconds),
        "ceiling": await ceiling(base, args.concurrency, args.seconds),
    }


def _median(runs: list[dict]) -> dict:
    out: dict = {}
    for key, value in runs[0].items():
        if isinstance(value, dict):
            out[key] = _median([r[key] for r in runs])
        else:
            out[key] = statistics.median(r[key] for r in runs)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--requests", type=int, default=2000, help="sequential requests for latency")
    ap.add_argument("--rate", type=float, default=1000.0, help="open-loop requests/s")
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--methods", default="upstream-tokenize,estimate")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    methods = [m for m in args.methods.split(",") if m]
    results: dict[str, list[dict]] = {"direct": [], **{m: [] for m in methods}}
    upstream, up_url = start_upstream()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for run in range(args.runs):
                results["direct"].append(asyncio.run(measure(up_url, args)))
                for method in methods:
                    gw, gw_url = start_gateway(up_url, method, Path(tmp))
                    try:
                        results[method].append(asyncio.run(measure(gw_url, args)))
                    finally:
                        gw.stop()
                print(f"run {run + 1}/{args.runs} done", file=sys.stderr)
    finally:
        upstream.stop()

    med = {k: _median(v) for k, v in results.items()}
    d = med["direct"]
    summary = {"runs": args.runs, "cpus": os.cpu_count(), "median": med, "gateway": {}}
    for m in methods:
        g = med[m]
        summary["gateway"][m] = {
            "added_p50_ms": g["latency"]["p50_ms"] - d["latency"]["p50_ms"],
            "added_p99_ms": g["latency"]["p99_ms"] - d["latency"]["p99_ms"],
            "open_achieved_ratio": g["open"]["achieved_rps"] / d["open"]["achieved_rps"],
            "ceiling_ratio": g["ceiling"]["rps"] / d["ceiling"]["rps"],
        }
    if args.json:
        print(json.dumps(summary, indent=2))
        return 0
    print(f"median of {args.runs} runs, {os.cpu_count()} CPUs, loopback; upstream answers instantly")
    print(f"{'target':<22}{'p50 ms':>8}{'p99 ms':>8}{'open rps':>10}{'open p50':>10}{'open p99':>10}"
          f"{'ceiling rps':>13}")
    for name in ["direct", *methods]:
        r = med[name]
        label = name if name == "direct" else f"gateway/{name}"
        print(f"{label:<22}{r['latency']['p50_ms']:>8.3f}{r['latency']['p99_ms']:>8.3f}"
              f"{r['open']['achieved_rps']:>10.0f}{r['open']['p50_ms']:>10.3f}{r['open']['p99_ms']:>10.3f}"
              f"{r['ceiling']['rps']:>13.0f}")
    for m, s in summary["gateway"].items():
        print(f"gateway/{m}: added p50 {s['added_p50_ms']:.3f} ms, p99 {s['added_p99_ms']:.3f} ms; "
              f"at {args.rate:.0f} rps offered {s['open_achieved_ratio']:.2f}x direct; "
              f"ceiling {s['ceiling_ratio']:.2f}x direct")
    return 0


if __name__ == "__main__":
    sys.exit(main())
