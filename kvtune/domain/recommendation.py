"""The recommendation as a document: what `kvtune recommend` decided, typed, and what it writes as
recommendation.json.

Everything after the policy takes this object, never the JSON dict: the renderer, `check`,
`bench --expect` and the terminal view read attributes, and `Recommendation.from_dict` reads a
recommendation.json back strictly, so a damaged file is one error naming the field. Every number
is a `Decision` (value, the rule that produced it, why), and each route carries its exact output
distribution (censored lengths included), so `check` judges a deployed cap by the same
Kaplan–Meier truncation share the recommendation was made with.

Reading one back takes two of kvtune's behaviours, so the door is
kvtune.policy.recommendation.read_recommendation (and load_recommendation, for a file): it passes
the traffic profile's reader and decides the feasibility verdict again from its inputs.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from kvtune.domain.admission_policy import GUARANTEED, AdmissionPolicy, parse_admission
from kvtune.domain.censored_lengths import CensoredLengths
from kvtune.domain.deployment import ENGINES
from kvtune.domain.feasibility import Verdict
from kvtune.domain.fields import MAX_INTEGER, Fields
from kvtune.domain.flow_control import Band, FlowControl
from kvtune.domain.route import RouteMatch
from kvtune.domain.tail_class import TAIL_CLASSES, TailClass
from kvtune.domain.whatif import Objective, Predicted, TrafficReader, TrafficT, WhatIfRow, read_what_if
from kvtune.errors import InputError
from kvtune.userfiles import brief

SCHEMA_VERSION = 2
CAPACITY_SOURCES = ("estimate", "kv-tokens", "vllm-log", "metrics")
# settings.<name>.value: (kind, minimum, maximum); kind "str" for text settings
SETTINGS: dict[str, tuple[str, float, float]] = {
    "tensor_parallel_size": ("int", 1, MAX_INTEGER),
    "pipeline_parallel_size": ("int", 1, MAX_INTEGER),
    "max_model_len": ("int", 1, MAX_INTEGER),
    "max_num_seqs": ("int", 1, MAX_INTEGER),
    "max_num_batched_tokens": ("int", 1, MAX_INTEGER),
    "gpu_memory_utilization": ("number", 0, 1),
    "kv_cache_memory_bytes": ("int", 1, MAX_INTEGER),
    "kv_cache_dtype": ("str", 0, 0),
    "block_size": ("int", 1, MAX_INTEGER),
    "preemption_mode": ("str", 0, 0),
    "swap_space": ("number", 0, MAX_INTEGER),
    "max_new_tokens_backstop": ("int", 1, MAX_INTEGER),
    "kv_cache_tokens": ("int", 1, MAX_INTEGER),  # SGLang --max-total-tokens, TensorRT-LLM max_tokens
    "schedule_conservativeness": ("number", 0, MAX_INTEGER),  # SGLang
    "init_new_token_ratio": ("number", 0, 1),  # SGLang's estimate
    "min_new_token_ratio_factor": ("number", 0, 1),
    "clip_max_new_tokens_estimation": ("int", 1, MAX_INTEGER),
    "engine_max_queued_requests": ("int", 1, MAX_INTEGER),  # SGLang --max-queued-requests
    "capacity_scheduler_policy": ("str", 0, 0),  # TensorRT-LLM
    "gateway_queue_max_waiting": ("int", 0, MAX_INTEGER),
    "gateway_queue_timeout_s": ("number", 0, MAX_INTEGER),
    # flow control (recommend --flow-control; absent otherwise): gateway.yaml `flow:` replaces `queue:`
    "gateway_flow_token_time_s": ("number", 0, MAX_INTEGER),
    "gateway_flow_interactive_deadline_s": ("number", 0, MAX_INTEGER),
    "gateway_flow_batch_deadline_s": ("number", 0, MAX_INTEGER),
    "gateway_flow_max_waiting": ("int", 0, MAX_INTEGER),
    "gateway_flow_max_waiting_per_flow": ("int", 1, MAX_INTEGER),
    "gateway_flow_interactive_reserve_blocks": ("int", 0, MAX_INTEGER),  # absent in files written before it
    "served_model": ("str", 0, 0),  # the id the files serve and why (absent in files written before it)
}
# Settings every recommendation has (the others may be null: they do not apply to the engine).
REQUIRED_SETTINGS = ("max_model_len", "gpu_memory_utilization", "kv_cache_dtype", "block_size",
                     "max_new_tokens_backstop")


@dataclass(frozen=True, slots=True)
class Decision:
    """One recommended setting with the rule that produced it and why."""

    value: int | float | str | bool | None
    rule: str
    reason: str

    def to_dict(self) -> dict:
        return {"value": self.value, "rule": self.rule, "reason": self.reason}

    @classmethod
    def read(cls, f: Fields, kind: str = "int", minimum: float = 0, maximum: float = MAX_INTEGER) -> Decision:
        if kind == "int":
            value: Any = f.integer("value", minimum=int(minimum), maximum=int(maximum))
        elif kind == "number":
            value = f.number("value", minimum=minimum, maximum=maximum)
        else:
            value = f.string("value")
        return cls(value, f.string("rule"), f.string("reason"))

    @property
    def fraction(self) -> float:
        """The value of a share (safety fraction, utilization)."""
        if isinstance(self.value, bool) or not isinstance(self.value, (int, float)):
            raise TypeError(f"{self.rule}: {self.value!r} is not a number")
        return float(self.value)

    @property
    def tokens(self) -> int:
        """The value of an integer setting (caps, lengths, budgets)."""
        if isinstance(self.value, bool) or not isinstance(self.value, int):
            raise TypeError(f"{self.rule}: {self.value!r} is not a token count")
        return self.value


@dataclass(frozen=True, slots=True)
class Distribution:
    """Nearest-rank summary of an integer quantity weighted by request counts."""

    p50: int
    p90: int
    p99: int
    max: int
    mean: float

    def to_dict(self) -> dict:
        return {"p50": self.p50, "p90": self.p90, "p99": self.p99, "max": self.max, "mean": round(self.mean, 3)}

    @classmethod
    def read(cls, f: Fields) -> Distribution:
        return cls(f.integer("p50"), f.integer("p90"), f.integer("p99"), f.integer("max"), f.number("mean"))


PERCENTILE_KEYS = ("p50", "p90", "p95", "p99")


@dataclass(frozen=True, slots=True)
class Lengths:
    """Percentiles of a token-length distribution. An output distribution also has p99.9 and
    `lower_bound`, which says which figures are only lower bounds (responses were cut at their
    own cap beyond them); a prompt distribution has neither."""

    p50: int
    p90: int
    p95: int
    p99: int
    max: int
    mean: float
    p999: int | None = None
    lower_bound: Mapping[str, bool] | None = None

    def to_dict(self) -> dict:
        out: dict[str, Any] = {k: getattr(self, k) for k in PERCENTILE_KEYS}
        if self.p999 is not None:
            out["p999"] = self.p999
        out["max"], out["mean"] = self.max, self.mean
        if self.lower_bound is not None:
            out["lower_bound"] = dict(self.lower_bound)
        return out

    @classmethod
    def from_summary(cls, data: Mapping[str, Any]) -> Lengths:
        """From a LengthSummary.to_dict()."""
        bound = data.get("lower_bound")
        return cls(int(data["p50"]), int(data["p90"]), int(data["p95"]), int(data["p99"]), int(data["max"]),
                   float(data["mean"]), int(data["p999"]) if data.get("p999") is not None else None,
                   dict(bound) if bound is not None else None)

    @classmethod
    def read(cls, f: Fields) -> Lengths:
        bound = f.obj("lower_bound", optional=True)
        flags = None if bound is None else {k: bool(bound.boolean(k)) for k in bound.data}
        return cls(f.integer("p50"), f.integer("p90"), f.integer("p95"), f.integer("p99"), f.integer("max"),
                   f.number("mean"), f.integer("p999", optional=True), flags)


@dataclass(frozen=True, slots=True)
class Requested:
    """What clients asked for in max_tokens on a route, against its cap."""

    requests: int
    p50: int | None
    p99: int | None
    max: int | None
    share_above_cap: float

    def to_dict(self) -> dict:
        return {"requests": self.requests, "p50": self.p50, "p99": self.p99, "max": self.max,
                "share_above_cap": self.share_above_cap}

    @classmethod
    def read(cls, f: Fields) -> Requested:
        return cls(f.integer("requests"), f.integer("p50", optional=True), f.integer("p99", optional=True),
                   f.integer("max", optional=True), f.number("share_above_cap", maximum=1))


@dataclass(frozen=True, slots=True)
class Binned:
    """Output lengths in equal-width bins, for the report's chart."""

    edges: tuple[int, ...]
    counts: tuple[int, ...]

    def to_dict(self) -> dict:
        return {"edges": list(self.edges), "counts": list(self.counts)}

    @classmethod
    def read(cls, f: Fields) -> Binned:
        edges, counts = f.integers("edges"), f.integers("counts")
        if len(edges) != len(counts) + 1 or any(b <= a for a, b in zip(edges, edges[1:], strict=False)):
            raise f.fail(None, "expected increasing edges, one more than counts")
        return cls(tuple(edges), tuple(counts))


@dataclass(frozen=True, slots=True)
class RouteConcurrency:
    admitted: int
    worst_case: int

    @property
    def gain(self) -> float | None:
        return _ratio(self.admitted, self.worst_case)

    def to_dict(self) -> dict:
        return {"admitted": self.admitted, "worst_case": self.worst_case, "gain": self.gain}


@dataclass(frozen=True, slots=True, eq=False)
class RouteRecommendation:
    """One route's cap with what it costs: its reservations over the route's real prompts."""

    route: str
    match: RouteMatch | None  # None: a field no gateway sees names the route; the catch-all serves it
    requests: int
    share: float
    tail: TailClass
    max_new_tokens: Decision
    truncation_share: float
    output_tokens: Lengths
    prompt_tokens: Lengths | None
    requested_max_tokens: Requested | None
    reservation_blocks: Distribution
    concurrency: RouteConcurrency
    output_histogram: Binned
    output_lengths: CensoredLengths  # exact: check's truncation shares are Kaplan–Meier too

    @property
    def cap(self) -> int:
        return self.max_new_tokens.tokens

    @property
    def prompt_max(self) -> int:
        return self.prompt_tokens.max if self.prompt_tokens else 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "route": self.route,
            "match": None if self.match is None else self.match.to_dict(),
            "requests": self.requests,
            "share": round(self.share, 6),
            "tail": self.tail.value,
            "max_new_tokens": self.max_new_tokens.to_dict(),
            "truncation_share": round(self.truncation_share, 6),
            "output_tokens": self.output_tokens.to_dict(),
            "prompt_tokens": None if self.prompt_tokens is None else self.prompt_tokens.to_dict(),
            "requested_max_tokens": None if self.requested_max_tokens is None else self.requested_max_tokens.to_dict(),
            "reservation_blocks": self.reservation_blocks.to_dict(),
            "concurrency": self.concurrency.to_dict(),
            "output_histogram": self.output_histogram.to_dict(),
            "output_lengths": self.output_lengths.to_dict(),
        }

    @classmethod
    def read(cls, f: Fields) -> RouteRecommendation:
        m = f.obj("match", optional=True)
        match = None if m is None else RouteMatch(
            path=m.string("path", optional=True), model=m.string("model", optional=True),
            header=m.string("header", optional=True), value=m.string("value", optional=True))
        prompt = f.obj("prompt_tokens", optional=True)
        requested = f.obj("requested_max_tokens", optional=True)
        lengths = f.obj("output_lengths")
        try:
            output_lengths = CensoredLengths.from_dict(lengths.data, lengths.where)
        except InputError as exc:
            raise InputError(exc.message, path=f.path, field=exc.field) from None
        if output_lengths.total == 0:
            raise lengths.fail(None, "a route with no logged requests")
        concurrency = f.obj("concurrency")
        return cls(
            route=f.string("route"),
            match=match,
            requests=f.integer("requests", minimum=1),
            share=f.number("share", maximum=1),
            tail=TailClass(f.choice("tail", TAIL_CLASSES)),
            max_new_tokens=Decision.read(f.obj("max_new_tokens"), "int", 1),
            truncation_share=f.number("truncation_share", maximum=1),
            output_tokens=Lengths.read(f.obj("output_tokens")),
            prompt_tokens=None if prompt is None else Lengths.read(prompt),
            requested_max_tokens=None if requested is None else Requested.read(requested),
            reservation_blocks=Distribution.read(f.obj("reservation_blocks")),
            concurrency=_with_gain(concurrency, RouteConcurrency(concurrency.integer("admitted"),
                                                                 concurrency.integer("worst_case"))),
            output_histogram=Binned.read(f.obj("output_histogram")),
            output_lengths=output_lengths,
        )


@dataclass(frozen=True, slots=True)
class Engine:
    name: str
    version: str
    v1: bool

    def to_dict(self) -> dict:
        return {"name": self.name, "version": self.version, "v1": self.v1}


@dataclass(frozen=True, slots=True)
class Hardware:
    gpu: str | None
    gpu_memory_bytes: int | None
    tensor_parallel_size: int
    pipeline_parallel_size: int

    @property
    def gpus(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def to_dict(self) -> dict:
        return {"gpu": self.gpu, "gpu_memory_bytes": self.gpu_memory_bytes,
                "tensor_parallel_size": self.tensor_parallel_size,
                "pipeline_parallel_size": self.pipeline_parallel_size}


@dataclass(frozen=True, slots=True)
class KvCost:
    kv_cache_dtype: str
    bytes_per_element: int
    kv_bytes_per_token: int
    kv_bytes_per_token_per_gpu: int

    def to_dict(self) -> dict:
        return {"kv_cache_dtype": self.kv_cache_dtype, "bytes_per_element": self.bytes_per_element,
                "kv_bytes_per_token": self.kv_bytes_per_token,
                "kv_bytes_per_token_per_gpu": self.kv_bytes_per_token_per_gpu}


@dataclass(frozen=True, slots=True)
class MeasuredBasis:
    """The server settings a measured capacity was taken at: a deploy file that changed them
    would change the capacity it was computed from."""

    origin: str | None
    kv_cache_dtype: str | None
    gpu_memory_utilization: float | None
    kv_cache_memory_bytes: int | None
    block_size: int | None

    def to_dict(self) -> dict:
        return {"origin": self.origin, "kv_cache_dtype": self.kv_cache_dtype,
                "gpu_memory_utilization": self.gpu_memory_utilization,
                "kv_cache_memory_bytes": self.kv_cache_memory_bytes, "block_size": self.block_size}


@dataclass(frozen=True, slots=True)
class CapacitySummary:
    source: str
    num_blocks: int
    usable_blocks: int
    block_size: int
    kv_cache_tokens: int
    kv_cache_bytes: int | None
    weights_bytes: int | None
    overhead_bytes: int | None
    assumptions: tuple[str, ...] = ()
    measured: MeasuredBasis | None = None

    def to_dict(self) -> dict:
        return {"source": self.source, "num_blocks": self.num_blocks, "usable_blocks": self.usable_blocks,
                "block_size": self.block_size, "kv_cache_tokens": self.kv_cache_tokens,
                "kv_cache_bytes": self.kv_cache_bytes, "weights_bytes": self.weights_bytes,
                "overhead_bytes": self.overhead_bytes, "assumptions": list(self.assumptions),
                "measured": None if self.measured is None else self.measured.to_dict()}


@dataclass(frozen=True, slots=True)
class Concurrency:
    admitted: int
    worst_case: int
    mean_reservation_blocks: float
    worst_case_reservation_blocks: int
    context_tokens: int

    @property
    def gain(self) -> float | None:
        return _ratio(self.admitted, self.worst_case)

    def to_dict(self) -> dict:
        return {"admitted": self.admitted, "worst_case": self.worst_case, "gain": self.gain,
                "mean_reservation_blocks": round(self.mean_reservation_blocks, 3),
                "worst_case_reservation_blocks": self.worst_case_reservation_blocks,
                "context_tokens": self.context_tokens}


@dataclass(frozen=True, slots=True)
class UpstreamBudget:
    """One engine replica's own budget (`recommend --capacity A --capacity B`), from its own
    measured capacity; `kvtune check` holds that upstream's deployed budget to it."""

    url: str
    block_budget: int
    num_blocks: int  # the replica's measured KV blocks (one is vLLM's null block)
    capacity_file: str
    # its own engine limits (the rules on its capacity, or what `recommend --objective`'s search gave
    # it) and with the search its part of the chosen row's figures (kvtune.policy.replica_search);
    # None: every replica runs the launch file's
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    predicted: Predicted | None = None
    kv_cache_memory_bytes: int | None = None  # the replica's measured --kv-cache-memory-bytes, when it has one

    @property
    def usable_blocks(self) -> int:
        return self.num_blocks - 1

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"url": self.url, "block_budget": self.block_budget, "num_blocks": self.num_blocks,
                               "capacity_file": self.capacity_file}
        if self.max_num_seqs is not None:
            out.update(max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens)
        if self.predicted is not None:
            out["predicted"] = self.predicted.to_dict()
        if self.kv_cache_memory_bytes is not None:
            out["kv_cache_memory_bytes"] = self.kv_cache_memory_bytes
        return out

    @classmethod
    def read(cls, f: Fields) -> UpstreamBudget:
        known = {"url", "block_budget", "num_blocks", "capacity_file", "max_num_seqs", "max_num_batched_tokens",
                 "predicted", "kv_cache_memory_bytes"}
        unknown = sorted(str(k) for k in set(f.data) - known)
        if unknown:
            raise f.fail(unknown[0] if len(unknown[0]) <= 40 else brief(unknown[0], 40), "unknown field")
        predicted = f.obj("predicted", optional=True)
        budget = cls(f.string("url", nonempty=True), f.integer("block_budget", minimum=1),
                     f.integer("num_blocks", minimum=2), f.string("capacity_file", nonempty=True),
                     f.integer("max_num_seqs", minimum=1, optional=True),
                     f.integer("max_num_batched_tokens", minimum=1, optional=True),
                     None if predicted is None else Predicted.read(predicted),
                     f.integer("kv_cache_memory_bytes", minimum=1, optional=True))
        if budget.block_budget > budget.usable_blocks:
            raise f.fail("block_budget", f"{budget.block_budget} is above the replica's "
                         f"{budget.usable_blocks} usable blocks")
        return budget


@dataclass(frozen=True, slots=True, eq=False)
class Recommendation(Generic[TrafficT]):
    """What `kvtune recommend` decided; `to_dict()` is recommendation.json, `from_dict` reads it back
    (generic in the objective's traffic profile: kvtune.profile.routes.Profile)."""

    model: str
    served_model: str
    engine: Engine
    upstream: str
    hardware: Hardware
    kv: KvCost
    capacity: CapacitySummary
    safety_fraction: Decision
    block_budget: Decision
    routes: tuple[RouteRecommendation, ...]
    concurrency: Concurrency
    settings: Mapping[str, Decision | None]
    kvtune_version: str  # the kvtune that decided it (kvtune.version)
    notes: tuple[str, ...] = ()
    # The admission policy the gateway enforces (gateway.yaml and nginx.conf `admission`);
    # a file written before the field existed reads as guaranteed.
    admission: AdmissionPolicy = GUARANTEED
    # `recommend --objective`: what the search was for, and every configuration it simulated
    objective: Objective[TrafficT] | None = None
    what_if: tuple[WhatIfRow, ...] | None = None
    # `recommend --capacity A --capacity B`: one budget per engine replica, in upstream order;
    # () when every replica has the one budget above (a file written before the field reads so).
    upstreams: tuple[UpstreamBudget, ...] = ()
    # whether the deployment runs the logged traffic at all (kvtune.policy.feasibility); None in a
    # file written before the field existed
    feasibility: Verdict | None = None

    # ------------------------------------------------------------ what the files need most

    @property
    def budget_blocks(self) -> int:
        return self.block_budget.tokens

    @property
    def max_model_len(self) -> int:
        return self.setting("max_model_len").tokens

    @property
    def backstop(self) -> int:
        """The server-wide cap (--override-generation-config max_new_tokens)."""
        return self.setting("max_new_tokens_backstop").tokens

    @property
    def gain(self) -> float | None:
        return self.concurrency.gain

    @property
    def chosen(self) -> WhatIfRow | None:
        """The what-if row this recommendation is (None without --objective)."""
        return next((r for r in self.what_if if r.chosen), None) if self.what_if else None

    @property
    def direct(self) -> WhatIfRow | None:
        """The what-if row of straight-to-vLLM with today's defaults, the baseline."""
        return next((r for r in self.what_if if r.policy.kind.value == "direct"), None) if self.what_if else None

    def setting(self, name: str) -> Decision:
        """A setting every recommendation has; KeyError names it if a caller asks for another."""
        decision = self.settings[name]
        if decision is None:
            raise KeyError(name)
        return decision

    # ------------------------------------------------------------ the file

    def to_dict(self) -> dict[str, Any]:
        out = self._to_dict()
        if self.objective is not None and self.what_if is not None:
            out["objective"] = self.objective.to_dict()
            out["what_if"] = [r.to_dict() for r in self.what_if]
        if self.upstreams:
            out["upstreams"] = [u.to_dict() for u in self.upstreams]
        if self.feasibility is not None:
            out["feasibility"] = self.feasibility.to_dict()
        return out

    def _to_dict(self) -> dict[str, Any]:
        return {
            "schema_version": SCHEMA_VERSION,
            "kvtune_version": self.kvtune_version,
            "model": self.model,
            "served_model": self.served_model,
            "engine": self.engine.to_dict(),
            "upstream": self.upstream,
            "hardware": self.hardware.to_dict(),
            "kv": self.kv.to_dict(),
            "capacity": self.capacity.to_dict(),
            "safety_fraction": self.safety_fraction.to_dict(),
            "block_budget": self.block_budget.to_dict(),
            "routes": [r.to_dict() for r in self.routes],
            "concurrency": self.concurrency.to_dict(),
            "settings": {k: (None if d is None else d.to_dict()) for k, d in self.settings.items()},
            "admission": self.admission.to_dict(),
            "notes": list(self.notes),
        }

    def to_json(self) -> str:
        """recommendation.json's text, as `kvtune recommend --out` writes it."""
        return json.dumps(self.to_dict(), indent=2) + "\n"

    @classmethod
    def from_dict(cls, data: Any, *, read_traffic: TrafficReader[TrafficT],
                  path: str | None = None) -> Recommendation[TrafficT]:
        """A recommendation.json read back strictly: an InputError names the missing or wrong field.
        The feasibility verdict is read as written (kvtune.policy.recommendation decides it again)."""
        f = Fields(data, path=path)
        if not f.has("block_budget") or not f.has("settings") or not f.has("routes"):
            missing = next(k for k in ("block_budget", "settings", "routes") if not f.has(k))
            raise f.fail(missing, "missing: not a recommendation.json? (`kvtune recommend --out DIR` writes one)")
        version = f.integer("schema_version", minimum=1)
        if version != SCHEMA_VERSION:
            raise f.fail("schema_version", f"version {version} was written by an older kvtune; this one reads "
                         f"{SCHEMA_VERSION}: run `kvtune recommend` again")
        engine, hardware, kv, capacity = f.obj("engine"), f.obj("hardware"), f.obj("kv"), f.obj("capacity")
        measured = capacity.obj("measured", optional=True)
        settings_f = f.obj("settings")
        settings: dict[str, Decision | None] = {}
        for name in settings_f.data:
            if name not in SETTINGS:
                raise settings_f.fail(name, "unknown setting")
        for name, (kind, low, high) in SETTINGS.items():
            if name not in settings_f.data and name not in REQUIRED_SETTINGS:
                continue  # a setting another engine has
            sub = settings_f.obj(name) if name in REQUIRED_SETTINGS else settings_f.obj(name, optional=True)
            settings[name] = None if sub is None else Decision.read(sub, kind, low, high)
        concurrency = f.obj("concurrency")
        routes = tuple(RouteRecommendation.read(r) for r in f.items("routes", nonempty=True))
        notes = f.strings("notes", optional=True) or []

        searched = read_what_if(f, read_traffic)
        if searched is not None and {r.route for r in searched[0].traffic.routes} != {r.route for r in routes}:
            raise f.fail("objective.traffic.routes", "are not the recommendation's routes")
        return cls(
            model=f.string("model", nonempty=True),
            served_model=f.string("served_model", nonempty=True),
            engine=Engine(engine.choice("name", ENGINES), engine.string("version"),
                          engine.boolean("v1")),
            upstream=f.string("upstream", nonempty=True),
            hardware=Hardware(hardware.string("gpu", optional=True),
                              hardware.integer("gpu_memory_bytes", minimum=1, optional=True),
                              hardware.integer("tensor_parallel_size", minimum=1),
                              hardware.integer("pipeline_parallel_size", minimum=1)),
            kv=KvCost(kv.string("kv_cache_dtype"), kv.integer("bytes_per_element", minimum=1),
                      kv.integer("kv_bytes_per_token"), kv.integer("kv_bytes_per_token_per_gpu")),
            capacity=CapacitySummary(
                source=capacity.choice("source", CAPACITY_SOURCES),
                num_blocks=capacity.integer("num_blocks", minimum=1),
                usable_blocks=capacity.integer("usable_blocks"),
                block_size=capacity.integer("block_size", minimum=1),
                kv_cache_tokens=capacity.integer("kv_cache_tokens"),
                kv_cache_bytes=capacity.integer("kv_cache_bytes", optional=True),
                weights_bytes=capacity.integer("weights_bytes", optional=True),
                overhead_bytes=capacity.integer("overhead_bytes", optional=True),
                assumptions=tuple(capacity.strings("assumptions", optional=True) or ()),
                measured=None if measured is None else MeasuredBasis(
                    measured.string("origin", optional=True), measured.string("kv_cache_dtype", optional=True),
                    measured.number("gpu_memory_utilization", maximum=1, optional=True),
                    measured.integer("kv_cache_memory_bytes", optional=True),
                    measured.integer("block_size", minimum=1, optional=True)),
            ),
            safety_fraction=Decision.read(f.obj("safety_fraction"), "number", 0, 1),
            block_budget=Decision.read(f.obj("block_budget"), "int", 1),
            routes=routes,
            concurrency=_with_gain(concurrency, Concurrency(
                admitted=concurrency.integer("admitted"),
                worst_case=concurrency.integer("worst_case"),
                mean_reservation_blocks=concurrency.number("mean_reservation_blocks"),
                worst_case_reservation_blocks=concurrency.integer("worst_case_reservation_blocks"),
                context_tokens=concurrency.integer("context_tokens", minimum=1),
            )),
            settings=settings,
            notes=tuple(notes),
            kvtune_version=f.string("kvtune_version"),
            admission=parse_admission(f.data["admission"], f.fail) if "admission" in f.data else GUARANTEED,
            objective=None if searched is None else searched[0],
            what_if=None if searched is None else searched[1],
            upstreams=tuple(UpstreamBudget.read(u) for u in f.items("upstreams", optional=True, nonempty=True)),
            feasibility=_verdict(f.obj("feasibility", optional=True)),
        )


def _verdict(f: Fields | None) -> Verdict | None:
    return None if f is None else Verdict.read(f)


_C = TypeVar("_C", RouteConcurrency, Concurrency)


def _with_gain(f: Fields, concurrency: _C) -> _C:
    """`gain` is written for readers and derived, never read: a file whose gain is not the ratio
    of its own admitted and worst-case counts was edited by hand and half-updated."""
    if "gain" in f.data and f.number("gain", optional=True) != concurrency.gain:
        raise f.fail("gain", f"is {brief(f.data['gain'])}, but admitted / worst_case is {concurrency.gain}")
    return concurrency


def _ratio(a: int, b: int) -> float | None:
    return None if b == 0 else round(a / b, 3)


def flow_control_of(rec: Recommendation) -> FlowControl | None:
    """gateway.yaml's `flow:` (docs/guides/flow-control.md) as recommend --flow-control sized it;
    None without it."""
    s = rec.settings
    decisions = [d for k in FLOW_SETTINGS if (d := s.get(k)) is not None]
    if len(decisions) < len(FLOW_SETTINGS):
        return None
    token, interactive, batch, waiting, per_flow = decisions
    reserve = s.get(FLOW_RESERVE_SETTING)
    return FlowControl(token_time_s=token.fraction,
                       bands=(Band("interactive", interactive.fraction, 0 if reserve is None else reserve.tokens),
                              Band("batch", batch.fraction)),
                       max_waiting=waiting.tokens, max_waiting_per_flow=per_flow.tokens)


FLOW_SETTINGS = ("gateway_flow_token_time_s", "gateway_flow_interactive_deadline_s", "gateway_flow_batch_deadline_s",
                 "gateway_flow_max_waiting", "gateway_flow_max_waiting_per_flow")
#: The interactive band's reserve (optional: recommendations written before it have none).
FLOW_RESERVE_SETTING = "gateway_flow_interactive_reserve_blocks"


__all__ = [
    "Recommendation", "UpstreamBudget", "RouteRecommendation", "Decision", "Distribution", "Lengths", "Requested",
    "Binned", "RouteConcurrency", "Engine", "Hardware", "KvCost", "CapacitySummary", "MeasuredBasis",
    "Concurrency", "SCHEMA_VERSION", "SETTINGS", "REQUIRED_SETTINGS", "CAPACITY_SOURCES", "FLOW_SETTINGS",
    "FLOW_RESERVE_SETTING", "flow_control_of",
]
