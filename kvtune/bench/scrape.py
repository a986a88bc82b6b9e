"""The server's side of a benchmark: vLLM's /metrics before, about once a second during, and after.

Why: the client sees latencies; only the engine knows whether it preempted, how full its KV cache
got and how many requests it ran at once, which is what a recommendation predicts. Peaks are
sampled (1 s by default), so a spike shorter than the interval can be missed; counters are exact
deltas of before and after. Pages are parsed with prometheus-client's text parser, keeping only
the lines of the metrics used here so a large exposition costs little CPU mid-run.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any

from kvtune.capacity.measured import METRICS_MAX_BYTES, MeasuredCapacity, parse_cache_config
from kvtune.endpoint import get
from kvtune.engines.vllm import (
    CACHE_CONFIG_INFO,
    GENERATION_TOKENS,
    GPU_CACHE_USAGE,
    KV_CACHE_USAGE,
    NUM_PREEMPTIONS,
    NUM_REQUESTS_RUNNING,
    NUM_REQUESTS_WAITING,
    PROMPT_TOKENS,
)
from kvtune.errors import EndpointError

__all__ = ["MetricsSnapshot", "ServerMetrics", "MetricsScraper", "parse_snapshot", "sum_samples"]

_WANTED = (NUM_PREEMPTIONS, GENERATION_TOKENS, PROMPT_TOKENS, KV_CACHE_USAGE, GPU_CACHE_USAGE, NUM_REQUESTS_RUNNING,
           NUM_REQUESTS_WAITING, CACHE_CONFIG_INFO)
_FAMILIES = tuple(
    name.removesuffix("_total") for name in _WANTED
)  # `# TYPE vllm:num_preemptions counter` names the family without _total


@dataclass(frozen=True, slots=True)
class MetricsSnapshot:
    """One /metrics page reduced to the numbers a verdict needs (summed over engines)."""

    t_s: float
    values: dict[str, float]  # sample name -> sum over label sets (kv usage: max)
    cache_config: dict[str, str] | None

    def get(self, name: str) -> float | None:
        return self.values.get(name)


def sum_samples(text: str, names: Collection[str]) -> dict[str, float]:
    """The named samples of a /metrics page, each summed over its label sets (over engines);
    only their lines are parsed. Raises ValueError if those lines are not an exposition."""
    from prometheus_client.parser import text_string_to_metric_families

    prefixes = tuple(name + c for name in names for c in "{ ")
    lines = [line for line in text.splitlines() if line.startswith(prefixes)]
    values: dict[str, float] = {}
    for family in text_string_to_metric_families("\n".join(lines) + "\n"):
        for sample in family.samples:
            if sample.name in names:
                values[sample.name] = values.get(sample.name, 0.0) + float(sample.value)
    return values


def parse_snapshot(text: str, t_s: float) -> MetricsSnapshot:
    """Parse the few metrics used here; raises ValueError if the page is not an exposition."""
    from prometheus_client.parser import text_string_to_metric_families

    keep = []
    for line in text.splitlines():
        if line.startswith("#"):
            parts = line.split(None, 3)
            if len(parts) >= 3 and parts[2] in _FAMILIES:
                keep.append(line)
        elif line.startswith(_WANTED):
            keep.append(line)
    values: dict[str, float] = {}
    cache_config = None
    for family in text_string_to_metric_families("\n".join(keep) + "\n"):
        for s in family.samples:
            if s.name == CACHE_CONFIG_INFO:
                cache_config = cache_config or dict(s.labels)
            elif s.name in (KV_CACHE_USAGE, GPU_CACHE_USAGE):
                values[KV_CACHE_USAGE] = max(values.get(KV_CACHE_USAGE, 0.0), float(s.value))
            elif s.name in _WANTED:
                values[s.name] = values.get(s.name, 0.0) + float(s.value)
    return MetricsSnapshot(t_s, values, cache_config)


def _capacity(labels: dict[str, str] | None, url: str) -> MeasuredCapacity | None:
    """The server's capacity from its cache_config_info labels; None while it is still profiling
    or when it reports none kvtune can read."""
    if labels is None:
        return None
    try:
        return parse_cache_config(labels, origin=url)
    except EndpointError:
        return None


@dataclass(slots=True)
class ServerMetrics:
    """Before/after snapshots and sampled peaks; `available` False when /metrics cannot be read."""

    url: str
    available: bool = False
    reason: str | None = None
    before: MetricsSnapshot | None = None
    after: MetricsSnapshot | None = None
    samples: int = 0
    failed_scrapes: int = 0
    peaks: dict[str, float] = field(default_factory=dict)

    def observe(self, snap: MetricsSnapshot) -> None:
        self.samples += 1
        for name in (KV_CACHE_USAGE, NUM_REQUESTS_RUNNING, NUM_REQUESTS_WAITING):
            v = snap.get(name)
            if v is not None:
                self.peaks[name] = max(self.peaks.get(name, v), v)

    def _delta(self, name: str) -> float | None:
        if self.before is None or self.after is None:
            return None
        a, b = self.before.get(name), self.after.get(name)
        return None if a is None or b is None else b - a

    def to_dict(self) -> dict[str, Any] | None:
        """The `server` section of the results; None when the server has no readable /metrics."""
        if not self.available:
            return None
        snapshot = self.after or self.before
        config = snapshot.cache_config if snapshot is not None else None
        capacity = _capacity(config, self.url)
        preemptions = self._delta(NUM_PREEMPTIONS)
        generation = self._delta(GENERATION_TOKENS)
        prompt = self._delta(PROMPT_TOKENS)
        return {
            "metrics_url": self.url,
            "preemptions": None if preemptions is None else int(preemptions),
            "kv_cache_usage_peak": self.peaks.get(KV_CACHE_USAGE),
            "running_peak": _int_or_none(self.peaks.get(NUM_REQUESTS_RUNNING)),
            "waiting_peak": _int_or_none(self.peaks.get(NUM_REQUESTS_WAITING)),
            "generation_tokens": None if generation is None else int(generation),
            "prompt_tokens": None if prompt is None else int(prompt),
            "num_blocks": capacity.num_blocks if capacity else None,
            "block_size": capacity.block_size if capacity else None,
            "samples": self.samples,
            "failed_scrapes": self.failed_scrapes,
        }


def _int_or_none(v: float | None) -> int | None:
    return None if v is None else int(v)


class MetricsScraper:
    """Scrapes one /metrics URL over the run's aiohttp session into a ServerMetrics."""

    def __init__(self, session: Any, url: str, *, interval_s: float = 1.0, timeout_s: float = 5.0,
                 on_snapshot: Callable[[MetricsSnapshot], None] | None = None) -> None:
        self.session = session
        self.metrics = ServerMetrics(url)
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.on_snapshot = on_snapshot

    async def scrape(self) -> MetricsSnapshot | None:
        """One page; None (and a reason kept) when it cannot be fetched or parsed."""
        try:
            page = await get(self.session, self.metrics.url, timeout_s=self.timeout_s,
                             max_bytes=METRICS_MAX_BYTES, accept="text/plain")
        except EndpointError as exc:
            self.metrics.reason = str(exc)
            return None
        if page.status != 200:
            self.metrics.reason = f"HTTP {page.status} from {self.metrics.url}"
            return None
        try:
            snap = parse_snapshot(page.text, time.perf_counter())
        except (ValueError, TypeError, IndexError) as exc:
            self.metrics.reason = f"{self.metrics.url} is not a Prometheus exposition: {exc}"
            return None
        if not snap.values and snap.cache_config is None:
            self.metrics.reason = f"{self.metrics.url} has no vLLM metrics"
            return None
        self.metrics.observe(snap)
        if self.on_snapshot is not None:
            self.on_snapshot(snap)
        return snap

    async def before(self) -> None:
        snap = await self.scrape()
        self.metrics.before = snap
        self.metrics.available = snap is not None

    async def during(self, stop: asyncio.Event) -> None:
        """Scrape every interval until `stop` is set (run it as a background task)."""
        if not self.metrics.available:
            return
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.interval_s):
                    await stop.wait()
            if stop.is_set():
                return
            if await self.scrape() is None:
                self.metrics.failed_scrapes += 1

    async def after(self, settle_s: float = 3.0, poll_s: float = 0.2) -> None:
        """Final page once the engine is idle and its counters stop moving (at most `settle_s`).

        vLLM updates counters from its engine loop, a moment after the last response is sent.
        """
        if not self.metrics.available:
            return
        deadline = time.perf_counter() + settle_s
        previous = None
        while True:
            snap = await self.scrape()
            if snap is None:
                self.metrics.failed_scrapes += 1
            else:
                idle = not snap.get(NUM_REQUESTS_RUNNING) and not snap.get(NUM_REQUESTS_WAITING)
                stable = previous is not None and previous.values.get(GENERATION_TOKENS) == snap.values.get(
                    GENERATION_TOKENS)
                self.metrics.after = snap
                if idle and stable:
                    return
                previous = snap
            if time.perf_counter() >= deadline:
                return
            await asyncio.sleep(poll_s)
