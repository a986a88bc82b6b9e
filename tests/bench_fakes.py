"""An in-process OpenAI-style streaming server for the bench tests, with scripted misbehaviour.

Tokens: a prompt costs one token per whitespace word (+1 BOS on /v1/completions; chat adds 4),
as /tokenize reports. A completion streams `max_tokens` one-word tokens, after `ttft_s` then
every `itl_s`, usage in the last chunk, then [DONE]. /metrics follows vLLM's names and counts what
it served, so the scrape and verdict code see a consistent engine.
"""

from __future__ import annotations

import asyncio
import json
from collections import deque
from dataclasses import dataclass, field

from aiohttp import web


@dataclass
class FakeConfig:
    ttft_s: float = 0.0
    itl_s: float = 0.0
    # failure script: each entry is consumed by one completion request; empty = succeed
    script: deque = field(default_factory=deque)
    retry_after: str | None = "0"
    split_lines: bool = False  # send each event in 2 TCP writes split mid-line
    batch_events: bool = False  # send all token events in one write
    no_usage: bool = False
    short_by: int = 0  # return this many fewer tokens than asked, finish_reason length
    finish_reason: str = "length"
    silent_tokens: bool = False  # tokens that decode to no text: as vLLM, only the finishing chunk is sent
    metrics: bool = True
    tokenize: bool = True
    max_model_len: int = 4096
    preemptions: int = 0
    preempt_per_request: int = 0  # preemptions counted for each completion served
    num_blocks: int = 100
    block_size: int = 16
    # observed
    calls: int = 0
    in_flight: int = 0
    peak_in_flight: int = 0
    generation_tokens: int = 0
    bodies: list = field(default_factory=list)


CONFIG = web.AppKey("config", FakeConfig)


def _words(text: str) -> int:
    return len(text.split())


async def models(request: web.Request) -> web.Response:
    cfg = request.app[CONFIG]
    return web.json_response({"object": "list", "data": [{"id": "fake", "max_model_len": cfg.max_model_len}]})


async def tokenize(request: web.Request) -> web.Response:
    cfg = request.app[CONFIG]
    if not cfg.tokenize:
        raise web.HTTPNotFound()
    body = await request.json()
    if "messages" in body:
        count = 2 + sum(2 + _words(m["content"]) for m in body["messages"])
    else:
        count = 1 + _words(body["prompt"])
    return web.json_response({"count": count, "tokens": [5] * count, "max_model_len": cfg.max_model_len})


async def metrics(request: web.Request) -> web.Response:
    cfg = request.app[CONFIG]
    if not cfg.metrics:
        raise web.HTTPNotFound()
    usage = min(1.0, cfg.in_flight * 4 / cfg.num_blocks)
    text = f"""# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{engine="0",model_name="fake"}} {cfg.in_flight}.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{{engine="0",model_name="fake"}} 0.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{{engine="0",model_name="fake"}} {usage}
# HELP vllm:num_preemptions_total Cumulative number of preemption from the engine.
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{{engine="0",model_name="fake"}} {float(cfg.preemptions)}
# HELP vllm:generation_tokens_total Number of generation tokens processed.
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{{engine="0",model_name="fake"}} {float(cfg.generation_tokens)}
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{{block_size="{cfg.block_size}",cache_dtype="auto",engine="0",num_gpu_blocks="{cfg.num_blocks}"}} 1.0
"""
    return web.Response(text=text, content_type="text/plain")


def _event(obj) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


async def completions(request: web.Request) -> web.StreamResponse:
    cfg = request.app[CONFIG]
    cfg.calls += 1
    body = await request.json()
    cfg.bodies.append(body)
    action = cfg.script.popleft() if cfg.script else "ok"
    if action == "429":
        headers = {"Retry-After": cfg.retry_after} if cfg.retry_after is not None else {}
        return web.json_response({"error": {"message": "busy"}}, status=429, headers=headers)
    if action in ("503", "500", "400"):
        return web.json_response({"error": {"message": f"status {action}"}}, status=int(action))
    chat = "messages" in body
    if "max_tokens" in body:
        n = int(body["max_tokens"])
    elif body.get("logit_bias"):  # as vLLM: EOS held back min_tokens tokens, then biased in, and counted
        n = int(body.get("min_tokens", 0)) + 1
    else:
        n = 16
    n = max(0, n - cfg.short_by)
    prompt_tokens = (2 + sum(2 + _words(m["content"]) for m in body["messages"])) if chat else 1 + _words(body["prompt"])
    cfg.preemptions += cfg.preempt_per_request
    cfg.in_flight += 1
    cfg.peak_in_flight = max(cfg.peak_in_flight, cfg.in_flight)
    try:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        if action == "hang":
            await asyncio.sleep(3600)
        if chat:
            await resp.write(_event({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}))
        events = []
        for i in range(n):
            if cfg.silent_tokens and i < n - 1:
                continue
            if chat:
                choice = {"index": 0, "delta": {"content": "" if cfg.silent_tokens else f" w{i}"},
                          "finish_reason": None}
            else:
                choice = {"index": 0, "text": "" if cfg.silent_tokens else f" w{i}", "finish_reason": None}
            if i == n - 1:
                choice["finish_reason"] = cfg.finish_reason
            events.append(_event({"choices": [choice]}))
        for i, ev in enumerate(events):
            if cfg.batch_events:
                break
            await asyncio.sleep(cfg.ttft_s if i == 0 else cfg.itl_s)
            if action == "disconnect" and i == n // 2:
                request.transport.close()
                return resp
            if action == "error_mid_stream" and i == n // 2:
                await resp.write(_event({"error": {"message": "engine died", "code": 500}}))
                return resp
            if cfg.split_lines:
                half = len(ev) // 2
                await resp.write(ev[:half])
                await asyncio.sleep(0.001)
                await resp.write(ev[half:])
            else:
                await resp.write(ev)
            cfg.generation_tokens += 1
        if cfg.batch_events:
            await asyncio.sleep(cfg.ttft_s)
            await resp.write(b"".join(events))
            cfg.generation_tokens += n
        tail = b""
        if not cfg.no_usage:
            tail += _event({"choices": [], "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": n,
                                                     "total_tokens": prompt_tokens + n}})
        tail += b"data: [DONE]\n\n"
        await resp.write(tail)
        await resp.write_eof()
        return resp
    finally:
        cfg.in_flight -= 1


def make_app(cfg: FakeConfig) -> web.Application:
    app = web.Application()
    app[CONFIG] = cfg
    app.router.add_get("/v1/models", models)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_get("/metrics", metrics)
    app.router.add_post("/v1/chat/completions", completions)
    app.router.add_post("/v1/completions", completions)
    return app


class FakeServer:
    """`async with FakeServer(cfg) as url:` runs the app on 127.0.0.1:<ephemeral>."""

    def __init__(self, cfg: FakeConfig | None = None) -> None:
        self.cfg = cfg or FakeConfig()
        self.runner: web.AppRunner | None = None

    async def __aenter__(self) -> str:
        self.runner = web.AppRunner(make_app(self.cfg), handle_signals=False, shutdown_timeout=0.2)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        port = self.runner.addresses[0][1]
        return f"http://127.0.0.1:{port}"

    async def __aexit__(self, *exc) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
