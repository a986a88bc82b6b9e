"""`run_bench`: one benchmark run against a live OpenAI-compatible server, end to end.

Probe the server (/v1/models), calibrate prompts on its tokenizer, scrape /metrics, drive the
load, scrape again, aggregate, judge. One aiohttp session with explicit limits serves it all;
every request task lives in one TaskGroup, so an interrupt cancels them and each records its
partial outcome in the run's `BenchRecorder` before cancellation reaches the caller.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from kvtune.bench.client import Target, send_request
from kvtune.bench.loads import drive
from kvtune.bench.prompts import calibrate_prompts, check_prompts
from kvtune.bench.report import summarize, verdict
from kvtune.bench.scrape import MetricsScraper, MetricsSnapshot
from kvtune.capacity.measured import MODELS_MAX_BYTES, parse_models_body
from kvtune.domain.load_shape import LoadShape
from kvtune.domain.recommendation import Recommendation
from kvtune.domain.retry_policy import RetryPolicy
from kvtune.domain.slo import Slo
from kvtune.endpoint import get
from kvtune.errors import EndpointError
from kvtune.version import __version__
from kvtune.workload.draw import PromptSynth, Workload
from kvtune.workload.requests import RequestResult, RequestSpec

__all__ = ["BenchConfig", "BenchProgress", "BenchRecorder", "run_bench"]

PROBE_TIMEOUT_S = 10.0
PROMPT_CHECKS = 8


@dataclass(frozen=True, slots=True)
class BenchConfig:
    """Everything one run needs besides the workload; times in seconds."""

    base_url: str
    load: LoadShape
    max_requests: int | None = None
    duration_s: float | None = None
    endpoint: str = "chat"
    model: str | None = None
    ignore_eos: bool = True
    length_control: str = "max-tokens"  # or "min-tokens" (see Target)
    eos_token_id: int | None = None
    timeout_s: float = 300.0
    retry: RetryPolicy = RetryPolicy()
    slo: Slo | None = None
    metrics_url: str | None = None  # default base_url + /metrics
    scrape_interval_s: float = 1.0
    max_connections: int | None = None  # default: the concurrency, else 4096
    seed: int = 0
    api_key: str | None = None
    expect: Recommendation | None = None
    slo_attainment: float = 0.99

    @property
    def connections(self) -> int:
        return self.max_connections or self.load.concurrency or 4096


class BenchProgress(Protocol):
    """Live display hooks; the CLI passes a rich one, None is silent."""

    def on_start(self, info: Mapping[str, Any]) -> None: ...
    def on_result(self, result: RequestResult) -> None: ...
    def on_server(self, snapshot: MetricsSnapshot) -> None: ...
    def on_finish(self) -> None: ...


class TextSink(Protocol):
    """Where each request's line goes: a text file, or kvtune.writer's staged one."""

    def write(self, text: str, /) -> int: ...


@dataclass(slots=True)
class BenchRecorder:
    """Results as they arrive (so an interrupted run keeps what it saw) and the run's context."""

    requests_log: TextSink | None = None
    progress: BenchProgress | None = None
    results: list[RequestResult] = field(default_factory=list)
    t0_s: float | None = None
    end_s: float | None = None
    context: dict[str, Any] = field(default_factory=dict)

    def record(self, result: RequestResult) -> None:
        self.results.append(result)
        if self.requests_log is not None and self.t0_s is not None:
            self.requests_log.write(json.dumps(result.to_dict(self.t0_s), separators=(",", ":")) + "\n")
        if self.progress is not None:
            self.progress.on_result(result)

    def report(self, *, server: Mapping[str, Any] | None, slo: Slo | None,
               expect: Recommendation | None, slo_attainment: float | None = None,
               interrupted: bool = False) -> dict[str, Any]:
        """The results JSON from whatever has been recorded so far."""
        end = self.end_s or time.perf_counter()
        duration = 0.0 if self.t0_s is None else end - self.t0_s
        summary = summarize(self.results, duration_s=duration, slo=slo, server=server)
        out = {"kvtune_version": __version__, "interrupted": interrupted, **self.context, **summary}
        out["verdict"] = verdict(expect, summary, self.results, slo_attainment=slo_attainment)
        return out


async def _probe(session: Any, base_url: str, model: str | None) -> tuple[str, int | None]:
    """Served model name and max_model_len from /v1/models; an unreachable server is an error,
    and so is one without /v1/models unless --model names the model."""
    url = f"{base_url}/v1/models"
    page = await get(session, url, timeout_s=PROBE_TIMEOUT_S, max_bytes=MODELS_MAX_BYTES,
                     accept="application/json", field="URL")
    if page.status != 200:
        if model is None:
            raise EndpointError(f"/v1/models answered {page.status} without a model; pass --model", path=url,
                                field="--model")
        return model, None
    models = parse_models_body(page.body, origin=url)
    if model is None:
        model = models[0].id
    chosen = next((m for m in models if m.id == model), None)
    return model, chosen.max_model_len if chosen else None


async def run_bench(
    config: BenchConfig,
    build_workload: Callable[[PromptSynth], Workload],
    *,
    tokenizer: Any = None,
    recorder: BenchRecorder | None = None,
) -> dict[str, Any]:
    """Run the benchmark and return the results JSON (see `kvtune bench --help` for its fields)."""
    import aiohttp

    rec = recorder or BenchRecorder()
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    connector = aiohttp.TCPConnector(limit=config.connections, limit_per_host=0, ttl_dns_cache=300)
    # the per-request limit is one asyncio.timeout around each attempt (client.py); a sock_read
    # timer here would be re-armed on every chunk, which costs more than it adds
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=min(config.timeout_s, PROBE_TIMEOUT_S))
    async with aiohttp.ClientSession(connector=connector, timeout=timeout, headers=headers,
                                     auto_decompress=False) as session:
        model, max_model_len = await _probe(session, config.base_url, config.model)
        synth = await calibrate_prompts(session, config.base_url, model, config.endpoint,
                                        tokenizer=tokenizer, max_model_len=max_model_len)
        workload = build_workload(synth)
        target = Target(config.base_url, model, config.endpoint, config.ignore_eos,
                        length_control=config.length_control, eos_token_id=config.eos_token_id)
        rows = len(workload.rows) if workload.rows is not None else PROMPT_CHECKS
        first = [workload.spec(i) for i in range(min(PROMPT_CHECKS, config.max_requests or PROMPT_CHECKS, rows))]
        prompt_check = (await check_prompts(session, config.base_url, model, config.endpoint, first)
                        if synth.method != "assumed" else {"checked": 0, "exact": 0})

        scraper = MetricsScraper(session, config.metrics_url or f"{config.base_url}/metrics",
                                 interval_s=config.scrape_interval_s,
                                 on_snapshot=rec.progress.on_server if rec.progress else None)
        await scraper.before()
        rec.context.update({
            "target": {"url": config.base_url, "endpoint": config.endpoint, "model": model,
                       "max_model_len": synth.max_model_len, "ignore_eos": config.ignore_eos,
                       "length_control": config.length_control},
            "load": {**config.load.to_dict(), "max_requests": config.max_requests,
                     "duration_s": config.duration_s, "timeout_s": config.timeout_s,
                     "max_connections": config.connections, "retry": config.retry.enabled},
            "workload": {"routes": list(workload.routes), "seed": config.seed, "prompts": synth.to_dict(),
                         "prompt_check": prompt_check, "clamped": workload.clamped},
            "server_note": None if scraper.metrics.available else
            f"no server metrics: {scraper.metrics.reason}",
        })
        if rec.progress is not None:
            rec.progress.on_start({"max_requests": config.max_requests, "duration_s": config.duration_s,
                                   "load": config.load.kind.value, "model": model,
                                   "metrics": scraper.metrics.available})

        max_requests = config.max_requests
        if workload.rows is not None:
            max_requests = min(max_requests or len(workload.rows), len(workload.rows))

        async def launch(i: int) -> None:
            spec: RequestSpec = first[i] if i < len(first) else workload.spec(i)
            await send_request(session, target, spec, timeout_s=config.timeout_s, retry=config.retry,
                               on_done=rec.record)

        stop = asyncio.Event()
        rec.t0_s = time.perf_counter()
        try:
            async with asyncio.TaskGroup() as tg:
                tg.create_task(scraper.during(stop))
                try:
                    await drive(config.load, launch, max_requests=max_requests, duration_s=config.duration_s,
                                rng=np.random.default_rng(config.seed + 1))
                finally:
                    rec.end_s = time.perf_counter()
                    stop.set()
        finally:
            if rec.progress is not None:
                rec.progress.on_finish()
        await scraper.after()
        rec.context["server_note"] = None if scraper.metrics.available else \
            f"no server metrics: {scraper.metrics.reason}"
    return rec.report(server=scraper.metrics.to_dict(), slo=config.slo, expect=config.expect,
                      slo_attainment=config.slo_attainment)
