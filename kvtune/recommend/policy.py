"""The policy: traffic profile + KV cost + capacity → caps, budget and engine settings.

Pure: it takes a Profile, a KvBytes and a Capacity and returns a Recommendation whose every
number is a `Decision` from one rule in `kvtune.recommend.rules`. `Recommendation.to_dict()` is the stable
shape written as recommendation.json and rendered into the deploy files.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvtune import __version__
from kvtune.recommend import rules
from kvtune.capacity.measured import CapacitySource
from kvtune.capacity.plan import Capacity
from kvtune.engines import vllm
from kvtune.errors import KvtuneError
from kvtune.gateway.endpoints import why_not_a_route_path
from kvtune.kv import KvBytes
from kvtune.profile.routes import Profile, RouteProfile
from kvtune.recommend.rules import Decision, Distribution

SCHEMA_VERSION = 1
HISTOGRAM_BINS = 40
ROUTE_BY_MATCH = {"path": "path", "model": "model"}  # route key → gateway match key


@dataclass(frozen=True, slots=True)
class RecommendOptions:
    """What the user decided; everything else is derived."""

    safety_fraction: float | None = None
    max_truncation: float | None = None
    vllm_version: str = rules.CURRENT_VLLM_VERSION
    upstream: str = "http://127.0.0.1:8000"
    route_by: str = "path"
    gpu: str | None = None
    gpu_memory_bytes: int | None = None
    gpu_memory_utilization: float = vllm.GPU_MEMORY_UTILIZATION
    engine_default_batched_tokens: int = vllm.MAX_NUM_BATCHED_TOKENS
    served_model: str | None = None
    model_limit: int | None = None  # the model's own context limit; None = capacity.max_model_len


@dataclass(frozen=True, slots=True)
class RouteRecommendation:
    route: str
    match: dict[str, str | None] | None
    requests: int
    share: float
    tail: str
    max_new_tokens: Decision
    truncation_share: float
    output_tokens: dict[str, Any]
    prompt_tokens: dict[str, Any] | None
    requested_max_tokens: dict[str, Any] | None
    reservation_blocks: Distribution
    reservation_values: np.ndarray = field(repr=False, compare=False)
    reservation_counts: np.ndarray = field(repr=False, compare=False)
    concurrency: int
    worst_case_concurrency: int
    output_histogram: dict[str, list[int]]

    def to_dict(self) -> dict[str, Any]:
        return {
            "route": self.route,
            "match": None if self.match is None else dict(self.match),
            "requests": self.requests,
            "share": round(self.share, 6),
            "tail": self.tail,
            "max_new_tokens": self.max_new_tokens.to_dict(),
            "truncation_share": round(self.truncation_share, 6),
            "output_tokens": self.output_tokens,
            "prompt_tokens": self.prompt_tokens,
            "requested_max_tokens": self.requested_max_tokens,
            "reservation_blocks": self.reservation_blocks.to_dict(),
            "concurrency": {
                "admitted": self.concurrency,
                "worst_case": self.worst_case_concurrency,
                "gain": _ratio(self.concurrency, self.worst_case_concurrency),
            },
            "output_histogram": self.output_histogram,
        }


@dataclass(frozen=True, slots=True)
class Recommendation:
    model: str
    served_model: str
    vllm_version: str
    v1_engine: bool
    upstream: str
    gpu: str | None
    gpu_memory_bytes: int | None
    kv: KvBytes
    capacity: Capacity
    safety_fraction: Decision
    block_budget: Decision
    routes: tuple[RouteRecommendation, ...]
    mean_reservation_blocks: float
    admitted_concurrency: int
    worst_case_reservation_blocks: int
    worst_case_concurrency: int
    settings: dict[str, Decision | None]
    notes: tuple[str, ...] = field(default=())

    @property
    def gain(self) -> float | None:
        return _ratio(self.admitted_concurrency, self.worst_case_concurrency)

    def to_dict(self) -> dict[str, Any]:
        cap = self.capacity
        memory = cap.memory
        return {
            "schema_version": SCHEMA_VERSION,
            "kvtune_version": __version__,
            "model": self.model,
            "served_model": self.served_model,
            "engine": {"name": "vllm", "version": self.vllm_version, "v1": self.v1_engine},
            "upstream": self.upstream,
            "hardware": {
                "gpu": self.gpu,
                "gpu_memory_bytes": self.gpu_memory_bytes,
                "tensor_parallel_size": self.kv.tensor_parallel_size,
                "pipeline_parallel_size": self.kv.pipeline_parallel_size,
            },
            "kv": {
                "kv_cache_dtype": self.kv.kv_cache_dtype,
                "bytes_per_element": self.kv.bytes_per_element,
                "kv_bytes_per_token": self.kv.kv_bytes_per_token,
                "kv_bytes_per_token_per_gpu": self.kv.kv_bytes_per_token_per_gpu,
            },
            "capacity": {
                "source": cap.source.value,
                "num_blocks": cap.num_blocks,
                "usable_blocks": cap.usable_blocks,
                "block_size": cap.block_size,
                "kv_cache_tokens": cap.kv_cache_tokens,
                "kv_cache_bytes": cap.kv_cache_bytes,
                "weights_bytes": memory.weights_bytes if memory else None,
                "overhead_bytes": memory.overhead.total_bytes if memory else None,
                "assumptions": list(memory.overhead.assumptions) if memory else [],
            },
            "safety_fraction": self.safety_fraction.to_dict(),
            "block_budget": self.block_budget.to_dict(),
            "routes": [r.to_dict() for r in self.routes],
            "concurrency": {
                "admitted": self.admitted_concurrency,
                "worst_case": self.worst_case_concurrency,
                "gain": self.gain,
                "mean_reservation_blocks": round(self.mean_reservation_blocks, 3),
                "worst_case_reservation_blocks": self.worst_case_reservation_blocks,
                "context_tokens": self._context_tokens,
            },
            "settings": {k: (None if d is None else d.to_dict()) for k, d in self.settings.items()},
            "notes": list(self.notes),
        }

    @property
    def _context_tokens(self) -> int:
        return int(self.settings["max_model_len"].value)  # type: ignore[union-attr]


def _ratio(a: int, b: int) -> float | None:
    return None if b == 0 else round(a / b, 3)


def _route_match(route: str, route_by: str) -> dict[str, str | None] | None:
    """What a gateway matches this route on: its path or model; everything for the unnamed
    route `*`; None when routes come from a field a gateway cannot see, or when a logged path
    is no literal request path a gateway could govern (the catch-all serves them)."""
    match: dict[str, str | None] = {"path": None, "model": None}
    if route == "*":
        return match
    key = ROUTE_BY_MATCH.get(route_by)
    if key is None or (key == "path" and why_not_a_route_path(route) is not None):
        return None
    match[key] = route
    return match


def _cap(route: RouteProfile, options: RecommendOptions, context_cap: int) -> Decision:
    if options.max_truncation is not None:
        candidates = route.output.observed.values
        shares = np.array([route.output.truncation_share(int(t)) for t in candidates])
        return rules.cap_by_truncation(candidates, shares, options.max_truncation, context_cap)
    tail = route.tail.class_
    q = route.output.quantile(rules.CAP_PERCENTILE[tail])
    return rules.cap_by_tail(tail, q.value_tokens, q.lower_bound, context_cap)


def _output_histogram(route: RouteProfile, cap: int) -> dict[str, list[int]]:
    """Output lengths in equal-width bins up to past the cap, for the report's chart."""
    observed = route.output.observed
    top = max(int(observed.max or 0), cap) + 1
    width = max(1, -(-top // HISTOGRAM_BINS))
    edges = np.arange(0, width * (HISTOGRAM_BINS + 1), width, dtype=np.int64)
    bins = np.minimum(observed.values // width, HISTOGRAM_BINS - 1)
    counts = np.bincount(bins, weights=observed.counts, minlength=HISTOGRAM_BINS).astype(np.int64)
    return {"edges": edges.tolist(), "counts": counts.tolist()}


def _requested(route: RouteProfile, cap: int) -> dict[str, Any] | None:
    asked = route.max_tokens
    if asked.total == 0:
        return None
    return {
        "requests": asked.total,
        "p50": asked.quantile(0.5),
        "p99": asked.quantile(0.99),
        "max": asked.max,
        "share_above_cap": round(1 - asked.count_le(cap) / asked.total, 6),
    }


def _route_recommendation(route: RouteProfile, cap: Decision, route_by: str, *, block_size: int,
                          budget_blocks: int, worst_concurrency: int, total_requests: int) -> RouteRecommendation:
    """One route's cap with what it costs: reservations over the route's real prompts."""
    cap_tokens = int(cap.value)  # type: ignore[arg-type]
    prompt = route.prompt if route.prompt.total else None
    if prompt is not None:
        reservations = rules.reservation_blocks(prompt.values, cap_tokens, block_size)
        counts = prompt.counts
    else:
        reservations = np.array([rules.reservation_blocks(0, cap_tokens, block_size)])
        counts = np.array([route.requests])
    dist = rules.weighted_distribution(reservations, counts)
    return RouteRecommendation(
        route=route.route,
        match=_route_match(route.route, route_by),
        requests=route.requests,
        share=route.requests / total_requests,
        tail=route.tail.class_,
        max_new_tokens=cap,
        truncation_share=route.output.truncation_share(cap_tokens),
        output_tokens=route.output.summary().to_dict(),
        prompt_tokens=None if prompt is None else _plain_summary(prompt),
        requested_max_tokens=_requested(route, cap_tokens),
        reservation_blocks=dist,
        reservation_values=reservations,
        reservation_counts=counts,
        concurrency=rules.admitted_concurrency(budget_blocks, dist.mean),
        worst_case_concurrency=worst_concurrency,
        output_histogram=_output_histogram(route, cap_tokens),
    )


def recommend(profile: Profile, kv: KvBytes, capacity: Capacity, options: RecommendOptions,
              *, model: str) -> Recommendation:
    """Apply every rule; the result says which rule produced each number."""
    if not profile.routes:
        raise KvtuneError("the profile has no requests to recommend from")
    block_size = capacity.block_size
    model_limit = options.model_limit or capacity.max_model_len
    version = rules.parse_vllm_version(options.vllm_version)
    notes: list[str] = []
    measured = capacity.source is not CapacitySource.ESTIMATE

    safety = rules.safety_fraction(options.safety_fraction, measured)
    budget = rules.block_budget(capacity.num_blocks, float(safety.value))  # type: ignore[arg-type]
    budget_blocks = int(budget.value)  # type: ignore[arg-type]
    if budget_blocks < 1:
        raise KvtuneError(f"no KV blocks to budget: capacity has {capacity.num_blocks} block(s)")

    total_requests = profile.requests
    drafts = []
    for route in profile.routes:
        min_prompt = route.prompt.min or 0
        context_cap = max(1, model_limit - min_prompt)
        cap = _cap(route, options, context_cap)
        drafts.append((route, cap))
        if route.prompt.total == 0:
            notes.append(f"route {route.route!r} logs no prompt lengths: reservations count the cap only")
        if options.route_by == "path" and route.route != "*":
            why = why_not_a_route_path(route.route)
            if why is not None:
                notes.append(f"route {route.route[:80]!r} cannot be matched by path ({why}): gateway configs "
                             "cap its requests with the catch-all route")

    caps = [int(c.value) for _, c in drafts]  # type: ignore[arg-type]
    longest = rules.longest_request([r.prompt.max or 0 for r, _ in drafts], caps)
    max_len = rules.max_model_len(longest, model_limit, block_size)
    context_tokens = int(max_len.value)  # type: ignore[arg-type]
    worst_blocks = rules.worst_case_reservation_blocks(context_tokens, block_size)
    worst_concurrency = budget_blocks // worst_blocks

    routes = [
        _route_recommendation(route, cap, options.route_by, block_size=block_size, budget_blocks=budget_blocks,
                              worst_concurrency=worst_concurrency, total_requests=total_requests)
        for route, cap in drafts
    ]

    # Gateways match routes in order: specific matches first, catch-alls (no key) after them.
    routes.sort(key=lambda r: r.match is None or (r.match["path"] is None and r.match["model"] is None))
    mean_reservation = sum(r.share * r.reservation_blocks.mean for r in routes)
    admitted = rules.admitted_concurrency(budget_blocks, mean_reservation)
    if options.route_by not in ROUTE_BY_MATCH and len(routes) > 1:
        notes.append(f"routes come from the field {options.route_by!r}, which a gateway cannot match on; "
                     "gateway configs send every request to the catch-all route, capped at the largest route cap")

    settings = _engine_settings(profile, routes, kv, capacity, options, version=version,
                                budget_blocks=budget_blocks, max_len=max_len)
    if not measured:
        notes.append("KV capacity is an estimate; measure it (--vllm-log, --metrics-url, --capacity from "
                     "`kvtune calibrate`) before trusting the budget to the block")
    notes.extend(capacity.notes)
    return Recommendation(
        model=model,
        served_model=options.served_model or model,
        vllm_version=options.vllm_version,
        v1_engine=rules.is_v1_engine(version),
        upstream=options.upstream,
        gpu=options.gpu,
        gpu_memory_bytes=options.gpu_memory_bytes,
        kv=kv,
        capacity=capacity,
        safety_fraction=safety,
        block_budget=budget,
        routes=tuple(routes),
        mean_reservation_blocks=mean_reservation,
        admitted_concurrency=admitted,
        worst_case_reservation_blocks=worst_blocks,
        worst_case_concurrency=worst_concurrency,
        settings=settings,
        notes=tuple(notes),
    )


def _engine_settings(profile: Profile, routes: list[RouteRecommendation], kv: KvBytes, capacity: Capacity,
                     options: RecommendOptions, *, version: tuple[int, ...], budget_blocks: int,
                     max_len: Decision) -> dict[str, Decision | None]:
    """The vLLM flags, each from its rule: scheduler limits sized for what the budget admits."""
    block_size = capacity.block_size
    context_tokens = int(max_len.value)  # type: ignore[arg-type]
    caps = [int(r.max_new_tokens.value) for r in routes]  # type: ignore[arg-type]
    sequence_p99 = max(
        (r.prompt_tokens["p99"] if r.prompt_tokens else 0) + int(r.max_new_tokens.value)  # type: ignore[arg-type]
        for r in routes
    )
    preemption = rules.preemption_mode(version, sequence_p99)
    kv_pool = capacity.kv_cache_bytes or capacity.num_blocks * block_size * kv.kv_bytes_per_token_per_gpu
    p1_reservation = rules.weighted_quantile(np.concatenate([r.reservation_values for r in routes]),
                                             np.concatenate([r.reservation_counts for r in routes]), 0.01)
    seqs = rules.max_num_seqs(budget_blocks, p1_reservation)
    combined_prompt = profile.combined().prompt
    p95_prompt = int(combined_prompt.quantile(0.95) or 0) if combined_prompt.total else 0
    batched = rules.max_num_batched_tokens(p95_prompt, options.engine_default_batched_tokens,
                                           int(seqs.value), context_tokens)  # type: ignore[arg-type]
    backstop = max(caps)
    return {
        "tensor_parallel_size": Decision(kv.tensor_parallel_size, "tp-given", _tp_reason(kv, capacity)),
        "pipeline_parallel_size": Decision(kv.pipeline_parallel_size, "pp-given",
                                           f"pipeline parallel {kv.pipeline_parallel_size} as given"),
        "max_model_len": max_len,
        "max_num_seqs": seqs,
        "max_num_batched_tokens": batched,
        "gpu_memory_utilization": Decision(
            options.gpu_memory_utilization, "gpu-util-capacity-basis",
            "the utilization the KV capacity was computed or measured at; changing it changes the block budget"),
        "kv_cache_dtype": Decision(
            kv.kv_cache_dtype, "kv-dtype-given",
            f"{kv.bytes_per_element} byte(s) per element; fp8 would halve a 16-bit cache at some accuracy cost"
            if kv.bytes_per_element >= 2 else f"{kv.bytes_per_element} byte per element"),
        "block_size": Decision(block_size, "block-size-capacity",
                               f"the block size the capacity counts in ({capacity.source.value}); "
                               "gateway reservations use the same blocks"),
        "preemption_mode": preemption,
        "swap_space": rules.swap_space_gib(kv_pool, str(preemption.value)),
        "max_new_tokens_backstop": Decision(
            backstop, "backstop-largest-route-cap",
            f"--override-generation-config max_new_tokens is a server-wide default and cap in vLLM; "
            f"the largest route cap {backstop} never clamps a route below its own cap"),
    }


def _tp_reason(kv: KvBytes, capacity: Capacity) -> str:
    """Why this tensor-parallel size serves: what each GPU holds at it."""
    per_gpu = f"{kv.kv_bytes_per_token_per_gpu:,} KV bytes per token per GPU"
    memory = capacity.memory
    if memory is None:
        return f"{per_gpu} at tensor parallel {kv.tensor_parallel_size}; capacity measured on the server"
    return (f"at tensor parallel {kv.tensor_parallel_size} each GPU holds {memory.weights_bytes / 2**30:.1f} GiB "
            f"of weights and a {memory.kv_cache_bytes / 2**30:.1f} GiB KV pool ({capacity.num_blocks:,} blocks); "
            f"{per_gpu}")


def _plain_summary(histogram) -> dict[str, Any]:
    return {
        "p50": histogram.quantile(0.5),
        "p90": histogram.quantile(0.9),
        "p95": histogram.quantile(0.95),
        "p99": histogram.quantile(0.99),
        "max": histogram.max,
        "mean": round(float(histogram.mean or 0.0), 3),
    }
