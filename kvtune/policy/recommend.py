"""The policy: traffic profile + plan (model, KV cost, capacity) → caps, budget and engine settings.

Pure: it takes a Profile and a Plan and returns a Recommendation whose every number is a
`Decision` from one rule in `kvtune.policy.rules`; `Recommendation.to_dict()` is the stable
shape written as recommendation.json and rendered into the deploy files.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from urllib.parse import urlsplit

import numpy as np

from kvtune.capacity.measured import CapacitySource
from kvtune.capacity.plan import Capacity, is_context_note
from kvtune.capacity.reservation import reserved_blocks
from kvtune.domain.admission_policy import GUARANTEED, AdmissionPolicy
from kvtune.domain.feasibility import Reason, Verdict
from kvtune.domain.recommendation import (
    SETTINGS,
    Binned,
    CapacitySummary,
    Concurrency,
    Decision,
    Engine,
    Hardware,
    KvCost,
    Lengths,
    MeasuredBasis,
    Recommendation,
    Requested,
    RouteConcurrency,
    RouteRecommendation,
)
from kvtune.domain.route import RouteMatch
from kvtune.domain.slo import Slo
from kvtune.endpoint import url_problem
from kvtune.engines import ENGINE_NAMES, sglang, trtllm, vllm
from kvtune.errors import CapacityError, InputError, OptionError
from kvtune.gateway.config import HEADER_NAME, MAX_ROUTE_HEADER_VALUE, ROUTE_HEADER_VALUE
from kvtune.gateway.endpoints import why_not_a_route_path
from kvtune.kv import KvBytes
from kvtune.model.config import HUB_ID
from kvtune.planning import Plan, replan
from kvtune.policy import engine_rules, feasibility, latency, rules
from kvtune.profile.histogram import Histogram
from kvtune.profile.routes import Profile, RouteProfile
from kvtune.userfiles import brief
from kvtune.version import __version__

HISTOGRAM_BINS = 40
# The cap levels the what-if search tries, as percentiles of each route's output tokens.
CAP_LEVELS = {"p90": 0.9, "p95": 0.95, "p99": 0.99, "p99.9": 0.999}
ROUTE_BY_MATCH = {"path": "path", "model": "model"}  # route key → gateway match key
DEFAULT_UPSTREAM = "http://127.0.0.1:8000"


@dataclass(frozen=True, slots=True)
class RecommendOptions:
    """What the user decided; everything else is derived from the profile and the plan."""

    safety_fraction: float | None = None
    max_truncation: float | None = None
    vllm_version: str = rules.CURRENT_VLLM_VERSION
    engine: str = "vllm"  # the engine the settings are for (kvtune.engines.ENGINE_NAMES)
    engine_version: str | None = None  # its release (None: the release kvtune's facts were read from)
    upstream: str = DEFAULT_UPSTREAM
    route_by: str = "path"
    # The request header that carries a --route-by FIELD's value at request time (a group such
    # as a team): gateway routes match it. None: per-group caps are refused, none could be enforced.
    route_header: str | None = None
    served_model: str | None = None  # what `vllm serve` loads; default the logs' model, else the model's hub id
    logged_model: str | None = None  # the one model the profiled rows name (kvtune.profile.logged_model)
    # The what-if search (kvtune.policy.search) sets these: every route capped at this percentile
    # (CAP_LEVELS; None: by its tail class), and the caps and safety fraction said to be searched.
    cap_level: str | None = None
    searched: bool = False
    admission: AdmissionPolicy = GUARANTEED  # the gateway's admission policy
    # Latency objectives the scheduler limits must meet by the step-time model (kvtune.policy.latency):
    # max_num_seqs (and max_num_batched_tokens, for TTFT) bounded so the predicted TPOT/TTFT do.
    slo: Slo | None = None
    # gateway.yaml `flow:` (docs/guides/flow-control.md) sized from these objectives (their ttft
    # the interactive band's deadline); None: today's FIFO queue
    flow_control: Slo | None = None

    def __post_init__(self) -> None:
        if self.safety_fraction is not None and not 0 < self.safety_fraction <= 1:
            raise OptionError(f"must be between 0 and 1 (a share of the usable KV blocks, at most all of them), "
                              f"got {self.safety_fraction:g}", field="safety_fraction")
        if self.max_truncation is not None and not 0 <= self.max_truncation < 1:
            raise OptionError(f"must be between 0 and 1 (a share of requests that may be cut short, below "
                              f"all of them), got {self.max_truncation:g}", field="max_truncation")
        try:
            rules.parse_vllm_version(self.vllm_version)
        except ValueError:
            raise OptionError(f"not a vLLM version: {self.vllm_version!r} (a release number such as "
                              f"{rules.CURRENT_VLLM_VERSION})", field="vllm_version") from None
        if self.engine not in ENGINE_NAMES:
            raise OptionError(f"unknown engine {self.engine!r} (known: {', '.join(ENGINE_NAMES)})", field="engine")
        problem = url_problem(self.upstream)
        if problem is None and urlsplit(self.upstream).path not in ("", "/"):
            problem = (f"must be the server's root (the gateway forwards each request's own path), "
                       f"got {brief(self.upstream)}")
        if problem is not None:
            raise OptionError(problem, field="upstream")
        if not self.route_by:
            raise OptionError("names no route key: path, model or a log field", field="route_by")
        if self.route_header is not None:
            if self.route_by in ROUTE_BY_MATCH:
                raise OptionError(f"only with --route-by FIELD: routes by {self.route_by} are matched on the "
                                  f"request's {self.route_by}, not a header", field="route_header")
            if not HEADER_NAME.fullmatch(self.route_header):
                raise OptionError(f"{brief(self.route_header)} is not a header name", field="route_header")
        if self.cap_level is not None and self.cap_level not in CAP_LEVELS:
            raise OptionError(f"not a cap level: {self.cap_level!r} (one of {', '.join(CAP_LEVELS)})",
                              field="cap_level")
        if self.searched and self.safety_fraction is None:
            raise OptionError("a searched budget needs its safety fraction", field="safety_fraction")


def _route_match(route: str, route_by: str, route_header: str | None = None) -> RouteMatch | None:
    """What a gateway matches this route on: its path, model or the value of the header that
    carries its group; everything for the unnamed route `*`; None when a logged path is no
    literal request path a gateway could govern (the catch-all serves them)."""
    if route == "*":
        return RouteMatch()
    if route_header is not None:
        return RouteMatch(header=route_header.lower(), value=route)
    key = ROUTE_BY_MATCH.get(route_by)
    if key is None or (key == "path" and why_not_a_route_path(route) is not None):
        return None
    return RouteMatch(path=route) if key == "path" else RouteMatch(model=route)


def _enforceable_groups(profile: Profile, options: RecommendOptions) -> None:
    """Per-group caps (--route-by FIELD) only where a gateway can tell the groups apart: by the
    header --route-header names, each group's value a header value it can match exactly."""
    if options.route_by in ROUTE_BY_MATCH:
        return
    groups = [r.route for r in profile.routes if r.route != "*"]
    if options.route_header is None:
        if len(profile.routes) > 1:
            raise OptionError(f"routes by {options.route_by!r} give {len(groups)} groups a cap each, but no "
                              "gateway sees that field: name the request header a trusted layer in front "
                              "sets to it with --route-header NAME (e.g. X-Team), or drop --route-by",
                              field="route_header")
        return
    for group in groups:
        if not ROUTE_HEADER_VALUE.fullmatch(group):
            raise OptionError(f"the group {brief(group)} is not a header value a gateway can match exactly "
                              f"(printable ASCII, no comma, no space at either end, at most "
                              f"{MAX_ROUTE_HEADER_VALUE} characters)", field="route_header")


def _cap(route: RouteProfile, options: RecommendOptions, context_cap: int) -> Decision:
    floor = None
    if options.max_truncation is not None:
        candidates = route.output.observed.values
        shares = np.array([route.output.truncation_share(int(t)) for t in candidates])
        floor = rules.cap_by_truncation(candidates, shares, options.max_truncation, context_cap)
    if options.cap_level is not None:
        level = route.output.quantile(CAP_LEVELS[options.cap_level])
        return rules.cap_at_level(options.cap_level, level.value_tokens, level.lower_bound, context_cap, floor)
    if floor is not None:
        return floor
    tail = route.tail.class_
    q = route.output.quantile(rules.CAP_PERCENTILE[tail])
    return rules.cap_by_tail(tail, q.value_tokens, q.lower_bound, context_cap)


def _output_histogram(route: RouteProfile, cap: int) -> Binned:
    """Output lengths in equal-width bins up to past the cap, for the report's chart."""
    observed = route.output.observed
    top = max(int(observed.max or 0), cap) + 1
    width = max(1, -(-top // HISTOGRAM_BINS))
    edges = np.arange(0, width * (HISTOGRAM_BINS + 1), width, dtype=np.int64)
    bins = np.minimum(observed.values // width, HISTOGRAM_BINS - 1)
    counts = np.bincount(bins, weights=observed.counts, minlength=HISTOGRAM_BINS).astype(np.int64)
    return Binned(tuple(edges.tolist()), tuple(counts.tolist()))


def _requested(route: RouteProfile, cap: int) -> Requested | None:
    asked = route.max_tokens
    if asked.total == 0:
        return None
    return Requested(asked.total, asked.quantile(0.5), asked.quantile(0.99), asked.max,
                     round(1 - asked.count_le(cap) / asked.total, 6))


@dataclass(frozen=True, slots=True)
class _Reservations:
    """A route's reservations over its real prompts: blocks and how many requests reserve each."""

    blocks: np.ndarray
    counts: np.ndarray


def _reservations(route: RouteProfile, cap_tokens: int, block_size: int) -> _Reservations:
    if route.prompt.total:
        return _Reservations(reserved_blocks(route.prompt.values, cap_tokens, block_size), route.prompt.counts)
    return _Reservations(np.array([reserved_blocks(0, cap_tokens, block_size)]), np.array([route.requests]))


def _route_recommendation(route: RouteProfile, cap: Decision, reservations: _Reservations, route_by: str, *,
                          budget_blocks: int, worst_concurrency: int, total_requests: int,
                          route_header: str | None = None) -> RouteRecommendation:
    """One route's cap with what it costs: reservations over the route's real prompts."""
    cap_tokens = cap.tokens
    dist = rules.weighted_distribution(reservations.blocks, reservations.counts)
    return RouteRecommendation(
        route=route.route,
        match=_route_match(route.route, route_by, route_header),
        requests=route.requests,
        share=route.requests / total_requests,
        tail=route.tail.class_,
        max_new_tokens=cap,
        truncation_share=route.output.truncation_share(cap_tokens),
        output_tokens=Lengths.from_summary(route.output.summary().to_dict()),
        prompt_tokens=_plain_summary(route.prompt) if route.prompt.total else None,
        requested_max_tokens=_requested(route, cap_tokens),
        reservation_blocks=dist,
        concurrency=RouteConcurrency(rules.admitted_concurrency(budget_blocks, dist.mean), worst_concurrency),
        output_histogram=_output_histogram(route, cap_tokens),
        output_lengths=route.output.lengths(),
    )


# Rounds of settings → memory → pool → budget → settings; two replans always settle (see recommend).
FIXED_POINT_ROUNDS = 4


def recommend(profile: Profile, plan: Plan, options: RecommendOptions | None = None) -> Recommendation:
    """Apply every rule to the traffic and the plan; the result says which rule produced each number.

    On a vLLM memory estimate the rendered scheduler limits are the ones the estimate assumed:
    vLLM's startup profile runs its dummy sampler over max_num_seqs sequences and its forward over
    max_num_batched_tokens tokens, so the plan is estimated again at the limits the rules chose,
    with max_num_seqs never below the count it was estimated at, until the limits repeat. It
    settles: the pool, hence the budget and the count it admits, f(s), only shrink as s grows;
    s_next = max(f(s), s) never decreases, and after a step up to s' = f(s) > s, f(s') <= f(s) = s',
    so the next round keeps s'. An SLO (options.slo) caps it at B, the largest batch whose predicted
    TPOT/TTFT meet it (kvtune.policy.latency), which depends on the step time and the caps, not on
    the pool: s_next = min(B, max(f(s), s)) still never decreases until it reaches B, where it
    stays. The bound FIXED_POINT_ROUNDS only guards that argument.

    >>> import kvtune
    >>> rec = kvtune.recommend(kvtune.load_profile("profile.json"), kvtune.Deployment("llama-3.1-8b", gpu="H100-80GB"))
    >>> rec.block_budget.value, rec.routes[0].max_new_tokens.rule          # doctest: +SKIP
    (25883, 'cap-p99-heavy-tail')
    """
    options = options or RecommendOptions()
    rec = _recommend_at(profile, plan, options)
    if plan.engine != "vllm" or plan.capacity.source is not CapacitySource.ESTIMATE or plan.inputs is None:
        return rec
    for _ in range(FIXED_POINT_ROUNDS):
        seqs, batched = _scheduler_limits(rec)
        if (plan.report.max_num_seqs, plan.report.max_num_batched_tokens) == (seqs, batched):
            return rec
        plan = replan(plan, max_num_seqs=seqs, max_num_batched_tokens=batched)
        rec = _recommend_at(profile, plan, options, profiled_seqs=seqs)
    raise RuntimeError(f"the scheduler limits did not settle in {FIXED_POINT_ROUNDS} rounds")


def _scheduler_limits(rec: Recommendation) -> tuple[int, int]:
    seqs, batched = rec.settings["max_num_seqs"], rec.settings["max_num_batched_tokens"]
    assert seqs is not None and batched is not None
    return seqs.tokens, batched.tokens


def _recommend_at(profile: Profile, plan: Plan, options: RecommendOptions,
                  profiled_seqs: int | None = None) -> Recommendation:
    """The rules on one plan; `profiled_seqs`, the sequence count the plan's memory estimate
    profiled the sampler at, is max_num_seqs' floor."""
    capacity = plan.capacity
    if not profile.routes:
        raise InputError("the profile has no requests to recommend from")
    block_size = capacity.block_size
    model_limit = capacity.max_model_len
    version = rules.parse_vllm_version(options.vllm_version)
    notes: list[str] = list(profile.notes)  # the files its logs did not read, first
    measured = capacity.source is not CapacitySource.ESTIMATE

    safety = (rules.safety_searched(options.safety_fraction) if options.searched and options.safety_fraction is not None
              else rules.safety_fraction(options.safety_fraction, measured))
    budget = rules.block_budget(capacity.num_blocks, safety.fraction)
    budget_blocks = budget.tokens
    if budget_blocks < 1:
        raise CapacityError(f"no KV blocks to budget: capacity has {capacity.num_blocks} block(s)")

    _enforceable_groups(profile, options)
    total_requests = profile.requests
    drafts = []
    for route in profile.routes:
        min_prompt = route.prompt.min or 0
        context_cap = max(1, model_limit - min_prompt)
        cap = _cap(route, options, context_cap)
        drafts.append((route, cap, _reservations(route, cap.tokens, block_size)))
        if route.prompt.total == 0:
            notes.append(f"route {route.route!r} logs no prompt lengths: reservations count the cap only")
        if options.route_by == "path" and route.route != "*":
            why = why_not_a_route_path(route.route)
            if why is not None:
                notes.append(f"route {route.route[:80]!r} cannot be matched by path ({why}): gateway configs "
                             "cap its requests with the catch-all route")

    caps = [c.tokens for _, c, _ in drafts]
    longest = rules.longest_request([r.prompt.max or 0 for r, _, _ in drafts], caps)
    held = feasibility.longest_held_tokens(options.engine, capacity.num_blocks, block_size)
    if plan.replica_context_tokens is not None:  # one launch file for every replica: the least any holds
        held = min(held, plan.replica_context_tokens)
    max_len = rules.max_model_len(context_tokens=plan.spec.max_position_embeddings or model_limit,
                                  longest_request_tokens=longest, held_tokens=held, block_size=block_size,
                                  given=plan.max_model_len_given,
                                  measured=capacity.measured.max_model_len if capacity.measured else None,
                                  measured_origin=capacity.measured.origin if capacity.measured else None,
                                  engine=options.engine)
    context_tokens = max_len.tokens
    smallest = min(int(r.blocks.min()) for _, _, r in drafts)
    verdict = feasibility.verdict(options.engine, pool_blocks=capacity.num_blocks, block_size=block_size,
                                  max_model_len=context_tokens, budget_blocks=budget_blocks,
                                  smallest_reservation_blocks=smallest, longest_request_tokens=longest)
    if not verdict.fits:
        remedy = feasibility.max_model_len_remedy(verdict, plan.max_model_len_given)
        verdict = dataclasses.replace(verdict, fix=feasibility.fix_line(
            [remedy] if remedy else [], fallback=feasibility.fallback_fix(verdict)))
    worst_blocks = rules.worst_case_reservation_blocks(context_tokens, block_size)
    worst_concurrency = budget_blocks // worst_blocks

    routes = [
        _route_recommendation(route, cap, reservations, options.route_by, budget_blocks=budget_blocks,
                              worst_concurrency=worst_concurrency, total_requests=total_requests,
                              route_header=options.route_header)
        for route, cap, reservations in drafts
    ]
    # Gateways match routes in order: specific matches first, catch-alls (no key) after them.
    order = sorted(range(len(routes)), key=lambda i: routes[i].match is None or routes[i].match == RouteMatch())
    routes = [routes[i] for i in order]
    reservations = [drafts[i][2] for i in order]
    mean_reservation = sum(r.share * r.reservation_blocks.mean for r in routes)
    admitted = rules.admitted_concurrency(budget_blocks, mean_reservation)

    step = latency.plan_step_time(plan)
    if options.slo is not None and step is None:
        raise OptionError("bounds the batch by the step time, and this deployment has none: give --gpu (a "
                          "roofline estimate) or --capacity FILE from `kvtune calibrate URL --timing`", field="slo")
    settings = _engine_settings(profile, routes, reservations, plan, options, version=version,
                                budget_blocks=budget_blocks, limit_blocks=options.admission.limit_blocks(budget_blocks),
                                max_len=max_len, step=step, profiled_seqs=profiled_seqs)
    if options.slo is not None and step is not None:
        verdict = _slo_verdict(verdict, options.slo, step, profile, routes, settings)
    settings["gateway_queue_max_waiting"] = rules.queue_max_waiting(admitted)
    settings["gateway_queue_timeout_s"] = rules.queue_timeout_s()
    if options.flow_control is not None:
        settings.update(_flow_settings(options.flow_control, step, profile, routes, settings, admitted, budget_blocks))
    if not measured:
        notes.append("KV capacity is an estimate; measure it (--vllm-log, --metrics-url, --capacity from "
                     "`kvtune calibrate`) before trusting the budget to the block")
    notes.extend(n for n in capacity.notes if not is_context_note(n))  # the verdict says it, for the rendered length
    served = settings["served_model"] = _served_model(options, plan)
    return Recommendation(
        model=plan.model,
        served_model=str(served.value),
        engine=_engine(options, version),
        upstream=options.upstream,
        hardware=Hardware(plan.gpu, plan.gpu_memory_bytes, plan.kv.tensor_parallel_size,
                          plan.kv.pipeline_parallel_size),
        kv=KvCost(plan.kv.kv_cache_dtype, plan.kv.bytes_per_element, plan.kv.kv_bytes_per_token,
                  plan.kv.kv_bytes_per_token_per_gpu),
        capacity=_capacity_summary(capacity),
        safety_fraction=safety,
        block_budget=budget,
        routes=tuple(routes),
        concurrency=Concurrency(admitted, worst_concurrency, mean_reservation, worst_blocks, context_tokens),
        settings=settings,
        kvtune_version=__version__,
        notes=tuple(notes),
        admission=options.admission,
        feasibility=verdict,
    )


def _served_model(options: RecommendOptions, plan: Plan) -> Decision:
    """What the deploy files serve, and where that id came from. The logs' id is what clients send,
    so the engine must answer to it; an id that is neither a hub id nor a path is a name no engine
    could load (a gateway alias), so the model's own id is served and the reason says so."""
    own = plan.spec.serve_id or plan.model
    logged = options.logged_model
    if options.served_model is not None:
        if logged is None or options.served_model == logged:
            return Decision(options.served_model, "served-model-given", "--served-model")
        return Decision(options.served_model, "served-model-given",
                        f"--served-model, though the logged rows name {logged}")
    if logged is None:
        return Decision(own, "served-model-own-id", "the model's own id; the logs name no model")
    if HUB_ID.fullmatch(logged) or logged.startswith("/"):
        differs = "" if logged == own else f"; the model's own id is {own}"
        return Decision(logged, "served-model-logged",
                        f"the model every logged row names (--served-model overrides){differs}")
    return Decision(own, "served-model-own-id",
                    f"the model's own id: the logs name {logged!r}, which is not a hub id (owner/name) or a path an "
                    "engine could load; give --served-model if the engine loads another checkpoint")


def _engine(options: RecommendOptions, vllm_version: tuple[int, ...]) -> Engine:
    """The engine and release the settings are for; `v1` says whether a vLLM runs its V1 engine
    (False for the other engines, whose flags have no V0/V1 split)."""
    if options.engine == "vllm":
        return Engine("vllm", options.engine_version or options.vllm_version, rules.is_v1_engine(vllm_version))
    facts = sglang if options.engine == "sglang" else trtllm
    return Engine(options.engine, options.engine_version or facts.CURRENT_VERSION, False)


def _capacity_summary(capacity: Capacity) -> CapacitySummary:
    memory, measured = capacity.memory, capacity.measured
    basis = None
    if measured is not None:
        basis = MeasuredBasis(measured.origin, measured.kv_cache_dtype, measured.gpu_memory_utilization,
                              measured.kv_cache_memory_bytes, measured.block_size)
    return CapacitySummary(
        source=capacity.source.value, num_blocks=capacity.num_blocks, usable_blocks=capacity.usable_blocks,
        block_size=capacity.block_size, kv_cache_tokens=capacity.kv_cache_tokens,
        kv_cache_bytes=capacity.kv_cache_bytes,
        weights_bytes=memory.weights_bytes if memory else None,
        overhead_bytes=memory.overhead.total_bytes if memory else None,
        assumptions=tuple(memory.overhead.assumptions) if memory else (),
        measured=basis,
    )


def _engine_settings(profile: Profile, routes: list[RouteRecommendation], reservations: list[_Reservations],
                     plan: Plan, options: RecommendOptions, *, version: tuple[int, ...], budget_blocks: int,
                     limit_blocks: int, max_len: Decision, step: latency.StepTime | None,
                     profiled_seqs: int | None = None) -> dict[str, Decision | None]:
    """The engine's settings, each from its rule: scheduler limits sized for what the budget admits,
    and the settings the capacity rests on, as the plan resolved them (measured ones win). Settings
    only one engine has (vLLM's preemption mode, SGLang's estimate, TensorRT-LLM's scheduler
    policy) come from that engine's rules; the others are None."""
    kv, capacity = plan.kv, plan.capacity
    engine = options.engine
    block_size = capacity.block_size
    context_tokens = max_len.tokens
    caps = [r.cap for r in routes]
    kv_pool = capacity.kv_cache_bytes or capacity.num_blocks * block_size * kv.kv_bytes_per_token_per_gpu
    p1_reservation = rules.weighted_quantile(np.concatenate([r.blocks for r in reservations]),
                                             np.concatenate([r.counts for r in reservations]), 0.01)
    seqs = rules.max_num_seqs(budget_blocks, p1_reservation, limit_blocks)
    if profiled_seqs is not None:
        seqs = rules.max_num_seqs_profiled(seqs, profiled_seqs)
    combined_prompt = profile.combined().prompt
    p95_prompt = int(combined_prompt.quantile(0.95) or 0) if combined_prompt.total else 0
    if engine == "sglang":
        engine_default = sglang.default_chunked_prefill_size(plan.gpu_memory_bytes)
    elif engine == "trtllm":
        engine_default = trtllm.MAX_NUM_TOKENS
    else:
        engine_default = (vllm.default_batch_limits(plan.gpu_memory_bytes, plan.gpu)[0]
                          if plan.gpu_memory_bytes else vllm.MAX_NUM_BATCHED_TOKENS)
    raised_batched = None
    if step is not None:
        shape = latency.traffic_shape(profile, {r.route: r.cap for r in routes})
        chunk = rules.max_num_batched_tokens(p95_prompt, engine_default, 1, context_tokens).tokens
        seqs, raised_batched = _latency_bound(seqs, step, shape, options.slo, chunk, context_tokens)
    batched = rules.max_num_batched_tokens(p95_prompt, engine_default, seqs.tokens, context_tokens)
    if raised_batched is not None and raised_batched.tokens > batched.tokens:
        batched = raised_batched
    if profiled_seqs is not None:
        batched = rules.batched_tokens_profiled(batched)
    backstop = max(caps)
    settings: dict[str, Decision | None] = {
        "tensor_parallel_size": Decision(kv.tensor_parallel_size, "tp-given", _tp_reason(kv, capacity)),
        "pipeline_parallel_size": Decision(kv.pipeline_parallel_size, "pp-given",
                                           f"pipeline parallel {kv.pipeline_parallel_size} as given"),
        "max_model_len": max_len,
        "max_num_seqs": seqs,
        "max_num_batched_tokens": batched,
        "gpu_memory_utilization": rules.gpu_memory_utilization(plan.gpu_memory_utilization, engine),
        "kv_cache_dtype": engine_rules.engine_kv_cache_dtype(
            engine, rules.kv_cache_dtype(plan.kv_cache_dtype, kv.bytes_per_element)),
        "block_size": rules.block_size(block_size, capacity.source.value, capacity.measured),
    }
    if engine == "vllm":
        sequence_p99 = max((r.prompt_tokens.p99 if r.prompt_tokens else 0) + r.cap for r in routes)
        preemption = rules.preemption_mode(version, sequence_p99)
        settings.update({
            "kv_cache_memory_bytes": rules.kv_cache_memory_bytes(plan.kv_cache_memory_bytes, plan.measured),
            "preemption_mode": preemption,
            "swap_space": rules.swap_space_gib(kv_pool, str(preemption.value)),
            "max_new_tokens_backstop": Decision(
                backstop, "backstop-largest-route-cap",
                f"--override-generation-config max_new_tokens is a server-wide default and cap in vLLM; "
                f"the largest route cap {backstop} never clamps a route below its own cap"),
        })
        return _in_file_order(settings)
    settings["kv_cache_tokens"] = engine_rules.kv_cache_tokens(engine, capacity.kv_cache_tokens,
                                                               capacity.source.value)
    if engine == "sglang":
        settings.update(engine_rules.sglang_settings(admission=options.admission, largest_cap=backstop,
                                                     max_num_seqs=seqs.tokens))
        settings["max_new_tokens_backstop"] = engine_rules.sglang_backstop(backstop)
    else:
        settings.update(engine_rules.trtllm_settings(admission=options.admission))
        settings["max_new_tokens_backstop"] = engine_rules.trtllm_backstop(backstop)
    return _in_file_order(settings)


def _latency_bound(seqs: Decision, step: latency.StepTime, shape: latency.TrafficShape, slo: Slo | None,
                   chunk: int, context_tokens: int) -> tuple[Decision, Decision | None]:
    """max_num_seqs within the SLO by the step-time model (kvtune.policy.latency), and the
    max_num_batched_tokens a TTFT objective needs when even one request misses it at `chunk`
    (a p99 prompt prefilled in one step); without an SLO, the reason states the TPOT it implies."""
    model = step.model
    if slo is None or (slo.tpot_ms is None and slo.ttft_ms is None):
        implied = latency.tpot_s(model, shape, seqs.tokens)
        return Decision(seqs.value, seqs.rule,
                        f"{seqs.reason}; at {seqs.tokens:,} running, each output token takes "
                        f"{latency.ms(implied)} (the predicted TPOT of a full batch, by the {step.source}): "
                        "--slo tpot=MS bounds it"), None
    most = latency.most_seqs_within(slo, model, shape, chunk, seqs.tokens)
    raised = None
    if most == 0 and slo.ttft_ms is not None:
        one_step = min(context_tokens, 1 << max(0, (max(1, shape.p99_prompt_tokens) - 1).bit_length()))
        if one_step > chunk and latency.most_seqs_within(slo, model, shape, one_step, seqs.tokens):
            chunk = one_step
            most = latency.most_seqs_within(slo, model, shape, chunk, seqs.tokens)
            raised = Decision(chunk, "batched-tokens-ttft-slo",
                              f"the p99 prompt ({shape.p99_prompt_tokens:,} tokens) prefills in one step, as "
                              f"TTFT ≤ {slo.ttft_ms:g} ms needs (by the {step.source})")
    objective = _slo_words(slo)
    if most == 0:  # nothing meets it; the verdict refuses the recommendation (_slo_verdict)
        return Decision(1, "max-num-seqs-slo", f"no batch meets {objective} (by the {step.source})"), raised
    at = latency.batch_latency(model, shape, most, chunk)
    figures = f"TPOT {latency.ms(at.tpot_s)}, TTFT of a p99 prompt {latency.ms(at.ttft_s)}"
    if most >= seqs.tokens:
        return Decision(seqs.value, seqs.rule, f"{seqs.reason}; at {seqs.tokens:,} running the predicted "
                        f"{figures} meet {objective} (by the {step.source})"), raised
    return Decision(most, "max-num-seqs-slo",
                    f"the most requests that run at once within {objective}: at {most:,} the predicted {figures} "
                    f"(by the {step.source}; queueing excluded); the budget alone would admit "
                    f"{seqs.tokens:,} ({seqs.reason})"), raised


def _slo_words(slo: Slo) -> str:
    parts = [f"{name} ≤ {value:g} ms" for name, value in (("TPOT", slo.tpot_ms), ("TTFT", slo.ttft_ms))
             if value is not None]
    return " and ".join(parts)


def _flow_settings(slo: Slo, step: latency.StepTime | None, profile: Profile, routes: list[RouteRecommendation],
                   settings: dict[str, Decision | None], admitted: int, budget_blocks: int) -> dict[str, Decision]:
    """gateway.yaml `flow:` from the SLO and the predicted latency of the rendered batch."""
    if slo.ttft_ms is None:
        raise OptionError("flow control takes its interactive band's deadline from --slo ttft=MS", field="flow_control")
    if step is None:
        raise OptionError("flow control forecasts with the step time, and this deployment has none: give --gpu or "
                          "--capacity FILE from `kvtune calibrate URL --timing`", field="flow_control")
    seqs, batched = settings["max_num_seqs"], settings["max_num_batched_tokens"]
    if seqs is None or batched is None:
        raise OptionError("flow control is sized on vLLM's batch limits (max_num_seqs, max_num_batched_tokens)",
                          field="flow_control")
    caps = {r.route: r.cap for r in routes}
    at = latency.batch_latency(step.model, latency.traffic_shape(profile, caps), seqs.tokens, batched.tokens)
    total = output = 0.0
    for route in profile.routes:
        o = route.output.observed
        if o.total:
            output += float(np.minimum(o.values.astype(np.float64), caps[route.route]) @ o.counts)
            total += o.total
    mean_output = output / total if total else 0.0
    out = rules.flow_control(slo.ttft_ms, slo.e2e_ms, at.tpot_s, at.ttft_s, admitted, mean_output)
    out["gateway_flow_interactive_reserve_blocks"] = _flow_reserve(routes, profile, caps, at, admitted, mean_output,
                                                                   budget_blocks)
    return out


def _flow_reserve(routes: list[RouteRecommendation], profile: Profile, caps: dict[str, int],
                  at: latency.BatchLatency, admitted: int, mean_output: float, budget_blocks: int) -> Decision:
    """The interactive band's reserve from its traffic (rules.flow_reserve_blocks): routes named
    batch are the batch band, the rest the default (interactive) one."""
    interactive = [r for r in routes if r.route != rules.FLOW_BATCH_ROUTE]
    batch = [r for r in routes if r.route == rules.FLOW_BATCH_ROUTE]
    share = sum(r.share for r in interactive) / (sum(r.share for r in routes) or 1.0)
    if not batch:
        share = 1.0
    served_s = at.ttft_s + mean_output * at.tpot_s
    rate = admitted / served_s if served_s > 0 else float(admitted)
    weight = sum(r.share for r in interactive)
    mean_blocks = sum(r.share * r.reservation_blocks.mean for r in interactive) / weight if weight else 0.0
    names = {r.route for r in interactive}
    output = total = 0.0
    for route in profile.routes:
        o = route.output.observed
        if route.route in names and o.total:
            output += float(np.minimum(o.values.astype(np.float64), caps[route.route]) @ o.counts)
            total += o.total
    hold_s = at.ttft_s + (output / total if total else 0.0) * at.tpot_s
    largest = max((r.reservation_blocks.max for r in batch), default=0)
    return rules.flow_reserve_blocks(share, rate, hold_s, mean_blocks, budget_blocks, largest)


def _slo_verdict(verdict: Verdict, slo: Slo, step: latency.StepTime, profile: Profile,
                 routes: list[RouteRecommendation], settings: dict[str, Decision | None]) -> Verdict:
    """The verdict, refusing settings whose predicted TPOT/TTFT miss the SLO: only when no batch
    meets it, since the limits are bounded to meet it otherwise."""
    if slo.tpot_ms is None and slo.ttft_ms is None:
        return verdict
    seqs, batched = settings["max_num_seqs"], settings["max_num_batched_tokens"]
    assert seqs is not None and batched is not None
    shape = latency.traffic_shape(profile, {r.route: r.cap for r in routes})
    at = latency.batch_latency(step.model, shape, seqs.tokens, batched.tokens)
    if latency.meets(slo, at):
        return verdict
    missed = []
    if slo.tpot_ms is not None and at.tpot_s * 1000 > slo.tpot_ms:
        missed.append(f"TPOT {latency.ms(at.tpot_s)} > {slo.tpot_ms:g} ms")
    if slo.ttft_ms is not None and at.ttft_s * 1000 > slo.ttft_ms:
        missed.append(f"TTFT of a p99 prompt ({shape.p99_prompt_tokens:,} tokens) {latency.ms(at.ttft_s)} > "
                      f"{slo.ttft_ms:g} ms")
    reason = Reason(feasibility.SLO_UNMET,
                                f"no batch meets {_slo_words(slo)}: one request alone is predicted at "
                                f"{', '.join(missed)} (by the {step.source})")
    fix = feasibility.fix_line([], fallback=f"a faster GPU or a larger --tp, or --slo {_slo_fix(slo, at)}")
    if not verdict.fits:
        return dataclasses.replace(verdict, reasons=(*verdict.reasons, reason))
    return dataclasses.replace(verdict, reasons=(reason,), fix=fix)


def _slo_fix(slo: Slo, at: latency.BatchLatency) -> str:
    """The loosest objectives one request alone meets, rounded up."""
    parts = []
    if slo.tpot_ms is not None:
        parts.append(f"tpot={math.ceil(max(slo.tpot_ms, at.tpot_s * 1000))}")
    if slo.ttft_ms is not None:
        parts.append(f"ttft={math.ceil(max(slo.ttft_ms, at.ttft_s * 1000))}")
    return ",".join(parts)


def _in_file_order(settings: dict[str, Decision | None]) -> dict[str, Decision | None]:
    """recommendation.json lists settings in one order (SETTINGS'), whichever engine set them."""
    return {name: settings[name] for name in SETTINGS if name in settings}


def _tp_reason(kv: KvBytes, capacity: Capacity) -> str:
    """Why this tensor-parallel size serves: what each GPU holds at it."""
    per_gpu = f"{kv.kv_bytes_per_token_per_gpu:,} KV bytes per token per GPU"
    memory = capacity.memory
    if memory is None:
        return f"{per_gpu} at tensor parallel {kv.tensor_parallel_size}; capacity measured on the server"
    return (f"at tensor parallel {kv.tensor_parallel_size} each GPU holds {memory.weights_bytes / 2**30:.1f} GiB "
            f"of weights and a {memory.kv_cache_bytes / 2**30:.1f} GiB KV pool ({capacity.num_blocks:,} blocks); "
            f"{per_gpu}")


def _plain_summary(histogram: Histogram) -> Lengths:
    """Nearest-rank percentiles of an uncensored, non-empty histogram (prompt lengths)."""
    p50, p90, p95, p99 = (histogram.quantile(q) for q in (0.5, 0.9, 0.95, 0.99))
    if p50 is None or p90 is None or p95 is None or p99 is None or histogram.max is None:
        raise ValueError("no lengths to summarize")
    return Lengths(p50, p90, p95, p99, histogram.max, round(float(histogram.mean or 0.0), 3))
