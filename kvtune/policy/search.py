"""`recommend --objective`: simulate candidate configurations on the traffic, choose the best
feasible one, and keep every row as the what-if table.

The grid (SearchGrid, stated in the output), in table order: straight to vLLM with today's
defaults (a reference row, never chosen), then the guaranteed policy at every cap level (by tail
class as today, p90, p95, p99, p99.9) × every budget level (safety 0.8, 0.9, 1.0 of the usable
blocks, or the one --safety-fraction), then every other policy the gateway enforces (statistical
at ε = 0.001, 0.01, 0.05; overcommit k = 1.25, 1.5, 2, 3) at every cap level on the 0.9 budget,
then the gateway reserving the whole context (the other reference row); identical candidates
once. Each candidate is `recommend()` at that level with that admission policy, so its engine
settings, and for statistical each route's output law (kvtune.policy.route_table.route_output_law),
are the ones its files would deploy. All rows serve the same requests: bench's draws for each
seed at the objective's load, each capped by its row's route caps; a row's figures are the mean
over the objective's seeds (DEFAULT_SEEDS, seed, seed + 1, ...). Clients do not announce their
lengths: each request asks for no max_tokens, so a gateway reserves prompt + its route's cap
(bench's own clients send the drawn length, which a gateway could reserve exactly), and every
request streams, so the statistical ledger hears its progress as the live relay reports it.
Clients retry 429s as `kvtune bench --retry` does.

Why these ε: each is a bound on P(the held KV outgrows the budget) checked at every admission,
conservative by construction (bin upper edges, union bound over step intervals, Chernoff), so
the preemptions it lets through are far rarer than ε; 0.001 sits next to guaranteed, 0.01
between, and past 0.05 the gain levels off (on the CPU test bed at 32 clients, 0.2 and 0.5 add
≤ 4 % output tokens/s and start to preempt). The simulator, not ε, says what each costs.

Chosen: the row with the highest objective (output tokens/s, or goodput under --slo) among the
candidates that meet every constraint; ties go to more output tokens/s, then fewer
preemptions, fewer 429s, less truncation, a smaller budget (more margin), the earlier row.
`simulate_deployment` is also what `kvtune check` runs on a deployed config, so check and the
table agree.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from kvtune.capacity.measured import CapacitySource
from kvtune.domain.engine_settings import EngineSettings
from kvtune.domain.flow_control import FlowControl
from kvtune.domain.load_shape import LoadShape
from kvtune.domain.output_law import OutputLaw
from kvtune.domain.recommendation import Recommendation, RouteRecommendation, flow_control_of
from kvtune.domain.route import Route, RouteMatch
from kvtune.domain.slo import Slo
from kvtune.domain.whatif import (
    ENGINE_ROWS,
    MAX_SEEDS,
    Goal,
    Load,
    Objective,
    Policy,
    PolicyKind,
    Predicted,
    ReplicaRow,
    SimBasis,
    Violation,
    WhatIfRow,
)
from kvtune.errors import CapacityError, KvtuneError, OptionError
from kvtune.planning import Plan
from kvtune.policy.recommend import CAP_LEVELS, RecommendOptions, recommend
from kvtune.policy.route_table import route_table
from kvtune.policy.rules import CAP_PERCENTILE
from kvtune.policy.whatif import compute_bound_note
from kvtune.profile.histogram import Histogram
from kvtune.profile.routes import CensoredHistogram, Profile
from kvtune.sim.admission import Admission, LedgerAdmission
from kvtune.sim.engine import CLIENT_RETRY, ClosedLoop, simulate
from kvtune.sim.report import summarize_sim
from kvtune.sim.requests import Outcome, Workload
from kvtune.sim.results import OUTCOMES
from kvtune.sim.rules import EngineRule, SGLangRule, engine_rule
from kvtune.sim.setup import engine_setup, given_pool, offline_capacity, plan_timing
from kvtune.sim.traffic import Traffic, draw_profile, logged_rate, send_offsets

if TYPE_CHECKING:
    from kvtune.sim.results import SimResult
    from kvtune.sim.traffic import Traffic

TAIL_LEVEL = "tail"  # each route capped by its tail class (p95 light, p99 heavy), as without --objective
DEFAULT_CAP_LEVELS = (TAIL_LEVEL, *CAP_LEVELS)
DEFAULT_SAFETY_FRACTIONS = (0.8, 0.9, 1.0)
DEFAULT_OVERCOMMIT_FACTORS = (1.25, 1.5, 2.0, 3.0)
DEFAULT_EPSILONS = (0.001, 0.01, 0.05)
DEFAULT_REQUESTS = 1000
DEFAULT_SEEDS = 3
MAX_REQUESTS = 100_000
GUARANTEED = Policy(PolicyKind.GUARANTEED)
STATISTICALS = tuple(Policy(PolicyKind.STATISTICAL, epsilon=e) for e in DEFAULT_EPSILONS)
OVERCOMMITS = tuple(Policy(PolicyKind.OVERCOMMIT, factor=k) for k in DEFAULT_OVERCOMMIT_FACTORS)
# Retry-After bounds the rendered gateway configs use (kvtune.deploy.render.RenderOptions' defaults)
RETRY_AFTER_MIN_S, RETRY_AFTER_MAX_S = 1, 60

Progress = Callable[[int, int], None]  # (rows simulated, rows in the grid)


class InfeasibleObjectiveError(KvtuneError):
    """No candidate configuration meets the objective's constraints; `rows` is the what-if table."""

    def __init__(self, message: str, rows: tuple[WhatIfRow, ...], objective: Objective) -> None:
        super().__init__(message)
        self.rows = rows
        self.objective = objective


# ---------------------------------------------------------------- what the user asks


@dataclass(frozen=True, slots=True)
class ObjectiveSpec:
    """`--objective` and its options as the user gave them; `build_objective` resolves the rest."""

    goal: Goal
    slo: Slo | None = None
    max_preemption_rate: float | None = None
    max_429_share: float | None = None
    rate_rps: float | None = None
    concurrency: int | None = None
    requests: int = DEFAULT_REQUESTS
    seed: int = 0
    seeds: int = DEFAULT_SEEDS
    compare_engines: bool = False  # add the engine rows (SearchGrid.engines)
    max_truncation: float | None = None  # None: what the tail cap rule cuts (truncation_limit)

    def __post_init__(self) -> None:
        for name in ("max_preemption_rate", "max_429_share", "max_truncation"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and 0 <= value <= 1):
                raise OptionError(f"must be a share between 0 and 1, got {value:g}", field=name)
        if self.rate_rps is not None and self.concurrency is not None:
            raise OptionError("give a rate or a concurrency, not both", field="concurrency")
        if self.rate_rps is not None and not (math.isfinite(self.rate_rps) and self.rate_rps > 0):
            raise OptionError(f"must be a positive number of requests per second, got {self.rate_rps:g}",
                              field="rate")
        if self.concurrency is not None and self.concurrency < 1:
            raise OptionError(f"must be at least 1, got {self.concurrency}", field="concurrency")
        if not 1 <= self.requests <= MAX_REQUESTS:
            raise OptionError(f"must be from 1 to {MAX_REQUESTS:,}, got {self.requests}", field="requests")
        if not 1 <= self.seeds <= MAX_SEEDS:
            raise OptionError(f"must be from 1 to {MAX_SEEDS}, got {self.seeds}", field="seeds")


@dataclass(frozen=True, slots=True)
class SearchGrid:
    """The candidates simulated, besides the two reference rows: guaranteed at every cap level ×
    safety fraction; each other policy (statistical ε, overcommit k) at every cap level on the
    default budget (`overcommit_safety`: they bet on the recommended budget, ε or k is their own
    axis). `engines` (keys of kvtune.domain.whatif.ENGINE_ROWS) adds a reference row per
    engine rule after the direct one: the same requests straight to SGLang or TensorRT-LLM."""

    cap_levels: tuple[str, ...] = DEFAULT_CAP_LEVELS
    safety_fractions: tuple[float, ...] = DEFAULT_SAFETY_FRACTIONS
    policies: tuple[Policy, ...] = (GUARANTEED, *STATISTICALS, *OVERCOMMITS)
    overcommit_safety: float = 0.9
    engines: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        unknown = [e for e in self.engines if e not in ENGINE_ROWS]
        if unknown:
            raise OptionError(f"unknown engine row {unknown[0]!r}; choose from {', '.join(ENGINE_ROWS)}",
                              field="engines")

    def for_objective(self, objective: Objective) -> SearchGrid:
        """A preemption budget of 0 asks for the policy that guarantees it: guaranteed only."""
        if objective.max_preemption_rate == 0:
            return dataclasses.replace(self, policies=tuple(p for p in self.policies
                                                            if p.kind is PolicyKind.GUARANTEED) or (GUARANTEED,))
        return self

    def cells(self) -> list[tuple[str, float, Policy]]:
        """(cap level, safety fraction, policy) of every candidate, in table order."""
        out = [(level, safety, p) for p in self.policies if p.kind is PolicyKind.GUARANTEED
               for level in self.cap_levels for safety in self.safety_fractions]
        out += [(level, self.overcommit_safety, p) for p in self.policies if p.kind is not PolicyKind.GUARANTEED
                for level in self.cap_levels]
        return out

    @property
    def candidates(self) -> int:
        return len(self.cells())

    def describe(self) -> str:
        safeties = ", ".join(f"{s:g}" for s in self.safety_fractions)
        parts = [f"guaranteed × caps {' / '.join(self.cap_levels)} × safety {safeties}"]
        others = [p.label for p in self.policies if p.kind is not PolicyKind.GUARANTEED]
        if others:
            parts.append(f"{', '.join(others)} × the same caps at safety {self.overcommit_safety:g}")
        engines = f", {len(self.engines)} engine rows" if self.engines else ""
        return (f"{'; '.join(parts)} (≤ {self.candidates} candidates, identical ones once) + direct{engines} and "
                "whole-context reference rows")


def objective_load(profile: Profile, spec: ObjectiveSpec) -> Load:
    """The load to simulate: --rate / --concurrency, else the logs' mean arrival rate."""
    if spec.concurrency is not None:
        return Load(None, spec.concurrency, "option")
    if spec.rate_rps is not None:
        return Load(spec.rate_rps, None, "option")
    rate = logged_rate(profile)  # as `kvtune simulate` takes it
    if rate is None:
        raise OptionError("the logs carry no timestamps to take an arrival rate from: give --rate RPS or "
                          "--concurrency N", field="rate")
    return Load(round(rate, 6), None, "logs")


def sim_basis(plan: Plan) -> SimBasis:
    """The simulator's footing on the plan's capacity: a measured one's timing (or the roofline
    for the plan's model and GPU) and the engine with today's defaults; without a capacity file
    (or with only a pool size given), the plan's own estimate, as `kvtune simulate` takes it
    (kvtune.sim.setup.offline_capacity)."""
    measured = plan.measured
    labels = None
    if measured is None or given_pool(measured):
        if plan.gpu_model is None:
            raise OptionError("an objective without a capacity file is simulated on the roofline step time of a "
                              "catalog GPU: give --gpu (or --gpu-spec FILE), or --capacity FILE from "
                              "`kvtune calibrate --timing`", field="gpu")
        measured, labels = offline_capacity(plan)
    gpu = plan.gpu_model
    timing = plan_timing(plan)
    engine = engine_setup(measured, gpu=gpu, recorded_from=labels).settings
    return SimBasis(timing.model, timing.http_overhead_s, engine)


def build_objective(profile: Profile, plan: Plan, spec: ObjectiveSpec) -> Objective:
    for route in profile.routes:
        if route.prompt.total == 0:
            raise OptionError(f"route {route.route[:80]!r} logs no prompt lengths; simulating it needs them",
                              field="objective")
    return Objective(spec.goal, spec.slo, spec.max_preemption_rate, spec.max_429_share, objective_load(profile, spec),
                     spec.requests, spec.seed, sim_basis(plan), traffic_profile(profile), spec.seeds,
                     max_truncation=spec.max_truncation)


def traffic_profile(profile: Profile) -> Profile:
    """Only what the requests are drawn from (kvtune.workload.draw.PairSampler: output and
    prompt lengths, their joint histogram) and what truncation is estimated from."""
    return Profile(routes=tuple(dataclasses.replace(
        r, total=CensoredHistogram.empty(), max_tokens=Histogram.empty(), finish_reasons={}, models={},
        arrival=None, latency_ms=None, ttft_ms=None) for r in profile.routes))


# ---------------------------------------------------------------- one deployment, simulated


@dataclass(frozen=True, slots=True)
class Deployment:
    """A configuration as the simulator sees it: the engine's settings, each traffic route's
    output cap (None: uncapped, vLLM lets it grow to the context), the gateway's policy and
    budget (None: straight to vLLM), each route's output law as the gateway's route carries it
    (what the statistical policy bets on; None or absent: its requests reach their cap), and the
    gateway's wait queue (gateway.yaml `queue`; 0 waiting: a full budget answers 429 at once)."""

    engine: EngineSettings
    caps: Mapping[str, int | None]
    policy: Policy
    budget_blocks: int | None
    laws: Mapping[str, OutputLaw | None] = dataclasses.field(default_factory=dict)
    queue_max_waiting: int = 0
    queue_timeout_s: float = 30.0
    rule: EngineRule = None  # the engine's scheduling rule (kvtune.sim.rules; None: vLLM)
    flow: FlowControl | None = None  # gateway.yaml flow: (the flow-control queue) instead of the FIFO queue


@dataclass(frozen=True, slots=True)
class Draws:
    """The requests every row serves: bench's draws for the seed and their send times."""

    route: tuple[str, ...]
    prompt: np.ndarray
    output: np.ndarray
    send_s: np.ndarray | None  # None: a closed loop sends them


def objective_seeds(objective: Objective) -> range:
    """The seeds each row is simulated with: seed, seed + 1, ..."""
    return range(objective.seed, objective.seed + objective.seeds)


def draw_requests(objective: Objective, seed: int | None = None) -> Draws:
    """Bench's draws for `seed` (default: the objective's first)."""
    seed = objective.seed if seed is None else seed
    load, n = objective.load, objective.requests
    sends = None
    if load.rate_rps is not None:
        sends = np.asarray(send_offsets(LoadShape.rate(load.rate_rps), seed=seed, max_requests=n,
                                        duration_s=None), dtype=np.float64)
        n = len(sends)
    draws, _ = draw_profile(objective.traffic, (), seed=seed, n=n,
                            max_model_len=objective.basis.engine.max_model_len)
    return Draws(tuple(r for r, _, _ in draws), np.array([p for _, p, _ in draws], dtype=np.int64),
                 np.array([o for _, _, o in draws], dtype=np.int64), sends)


def _admission(d: Deployment, routes: Sequence[str]) -> Admission | None:
    """The gateway's admission for a policy, in simulated time (the live gateway's own code);
    request i is of route routes[i]."""
    if d.policy.kind in (PolicyKind.DIRECT, PolicyKind.ENGINE) or d.budget_blocks is None:
        return None
    laws = None
    if d.policy.kind is PolicyKind.STATISTICAL:
        laws = [d.laws.get(r) for r in routes]
    return LedgerAdmission(d.budget_blocks, block_size=d.engine.block_size, max_model_len=d.engine.max_model_len,
                           retry_after_min_s=RETRY_AFTER_MIN_S, retry_after_max_s=RETRY_AFTER_MAX_S,
                           queue_max_waiting=d.queue_max_waiting, queue_timeout_s=d.queue_timeout_s,
                           policy=d.policy.admission(), request_laws=laws, flow=d.flow)


def truncation_share(traffic: Profile, caps: Mapping[str, int | None]) -> float:
    """Expected share of requests cut by their route's cap: each route's Kaplan–Meier estimate
    (as the recommendation reports it), weighted by its requests."""
    total = sum(r.requests for r in traffic.routes)
    cut = sum(r.requests * r.output.truncation_share(cap) for r in traffic.routes
              if (cap := caps.get(r.route)) is not None)
    return round(cut / total, 6) if total else 0.0


def tail_rule_truncation(traffic: Profile) -> float:
    """The share of answers the default cap rule cuts: each route capped at its tail class's
    percentile (kvtune.policy.rules.CAP_PERCENTILE), as truncation_share weighs them."""
    caps = {r.route: r.output.quantile(CAP_PERCENTILE[r.tail.class_]).value_tokens
            for r in traffic.routes if r.output.total}
    return truncation_share(traffic, caps)


def truncation_limit(objective: Objective, candidates: Sequence[Candidate]) -> Objective:
    """The objective with its truncation bound: --max-truncation as given, else what the tail
    rule accepts (the larger of its share unclipped and its rows' as deployed, whose caps the
    context may clip), so truncation is a constraint of the search, never a lever it pulls."""
    if objective.max_truncation is not None:
        return objective
    tail = [truncation_share(objective.traffic, c.deployment.caps) for c in candidates
            if c.cap_level == TAIL_LEVEL and c.rec is not None]
    return dataclasses.replace(objective, max_truncation=max([tail_rule_truncation(objective.traffic), *tail]))


def simulate_deployment(objective: Objective, deployment: Deployment,
                        draws: Sequence[Draws] | None = None) -> Predicted:
    """Serve the objective's requests on `deployment`, once per seed, and predict its figures:
    the mean over the seeds (of each seed's rates and percentiles; sent and completed add up)."""
    draws = draws or [draw_requests(objective, seed) for seed in objective_seeds(objective)]
    return mean_predicted([_simulate_once(objective, deployment, d) for d in draws])


def mean_predicted(runs: Sequence[Predicted]) -> Predicted:
    """The mean of each figure over `runs` (None where any run has none); sent and completed summed."""
    if len(runs) == 1:
        return runs[0]

    def mean(name: str, digits: int = 3) -> float | None:
        values = [getattr(p, name) for p in runs]
        return None if any(v is None for v in values) else round(sum(values) / len(values), digits)

    def share(name: str) -> float:
        return round(sum(getattr(p, name) for p in runs) / len(runs), 6)

    return Predicted(
        output_tokens_per_s=mean("output_tokens_per_s") or 0.0, requests_per_s=mean("requests_per_s") or 0.0,
        goodput_rps=mean("goodput_rps"), ttft_p50_ms=mean("ttft_p50_ms"), ttft_p99_ms=mean("ttft_p99_ms"),
        e2e_p50_ms=mean("e2e_p50_ms"), e2e_p99_ms=mean("e2e_p99_ms"), preemption_rate=share("preemption_rate"),
        share_429=share("share_429"), truncation_share=share("truncation_share"),
        sent=sum(p.sent for p in runs), completed=sum(p.completed for p in runs),
        kv_peak_blocks=None if any(p.kv_peak_blocks is None for p in runs) else max(
            p.kv_peak_blocks or 0 for p in runs),
        waiting_peak=None if any(p.waiting_peak is None for p in runs) else max(p.waiting_peak or 0 for p in runs),
        running_peak=None if any(p.running_peak is None for p in runs) else max(p.running_peak or 0 for p in runs))


def _simulate_once(objective: Objective, deployment: Deployment, draws: Draws) -> Predicted:
    return predicted_of(objective, deployment, *simulate_run(objective, deployment, draws))


def simulate_run(objective: Objective, deployment: Deployment, draws: Draws,
                 concurrency: int | None = None) -> tuple[SimResult, Traffic]:
    """One seed's requests served on `deployment` (a closed loop of `concurrency` clients,
    default the objective's), as the simulator returns them."""
    overhead = objective.basis.http_overhead_s
    cap = np.array([-1 if (c := deployment.caps.get(r)) is None else c for r in draws.route], dtype=np.int64)
    output = np.where(cap > 0, np.minimum(draws.output, cap), draws.output)
    n = len(draws.route)
    arrival = np.zeros(n) if draws.send_s is None else draws.send_s + overhead
    workload = Workload.from_columns(arrival, draws.prompt, np.maximum(output, 1), cap)
    clients = objective.load.concurrency if concurrency is None else concurrency
    loop = None if clients is None or objective.load.concurrency is None else ClosedLoop(clients, overhead, None)
    traffic = Traffic(workload, draws.output, draws.route, tuple(sorted(set(draws.route))), loop, overhead, Counter())
    result = simulate(workload, deployment.engine, objective.basis.timing,
                      admission=_admission(deployment, draws.route), retry=CLIENT_RETRY, closed_loop=loop,
                      engine=deployment.rule)
    return result, traffic


def predicted_of(objective: Objective, deployment: Deployment, result: SimResult, traffic: Traffic) -> Predicted:
    """A run's figures as the what-if table shows them."""
    summary = summarize_sim(result, traffic, slo=objective.slo)
    r = result.requests
    sent_mask = r.outcome != OUTCOMES.index(Outcome.NOT_SENT)
    sent = int(sent_mask.sum())
    latency = summary["latency_ms"]
    goodput = summary["goodput"]
    return Predicted(
        output_tokens_per_s=summary["throughput"]["output_tokens_per_s"],
        requests_per_s=summary["throughput"]["requests_per_s"],
        goodput_rps=None if goodput is None else goodput["requests_per_s"],
        ttft_p50_ms=latency["ttft"]["p50"], ttft_p99_ms=latency["ttft"]["p99"],
        e2e_p50_ms=latency["e2e"]["p50"], e2e_p99_ms=latency["e2e"]["p99"],
        preemption_rate=round(int((r.preemptions[sent_mask] > 0).sum()) / sent, 6) if sent else 0.0,
        share_429=round(summary["requests"]["failed"]["429"] / sent, 6) if sent else 0.0,
        truncation_share=truncation_share(objective.traffic, deployment.caps),
        sent=sent, completed=summary["requests"]["completed"], kv_peak_blocks=result.blocks_used_peak,
        waiting_peak=result.waiting_peak, running_peak=result.running_peak,
    )


# ---------------------------------------------------------------- candidates


def route_caps(table: Sequence[Route], routes: Sequence[RouteRecommendation]) -> dict[str, int | None]:
    """Each logged route's output cap under a gateway's route table, matched as the gateways
    (and `kvtune check`) match it: the first route that matches its path or model; none, uncapped."""
    return {name: None if hit is None else hit.max_new_tokens for name, hit in _matched(table, routes).items()}


def route_laws(table: Sequence[Route], routes: Sequence[RouteRecommendation]) -> dict[str, OutputLaw | None]:
    """Each logged route's output law under a gateway's route table (its output_histogram),
    matched as route_caps matches; None where the matching route carries none."""
    return {name: None if hit is None else hit.output_law for name, hit in _matched(table, routes).items()}


def _matched(table: Sequence[Route], routes: Sequence[RouteRecommendation]) -> dict[str, Route | None]:
    out: dict[str, Route | None] = {}
    for route in routes:
        match = route.match or RouteMatch()
        out[route.route] = next((r for r in table if r.matches(match.path, match.model, match.headers)), None)
    return out


def rendered_deployment(rec: Recommendation, basis: SimBasis, policy: Policy) -> Deployment:
    """What the files rendered from `rec` deploy: its engine settings on the measured pool, the
    route table gateway.yaml carries (kvtune.policy.route_table), its budget."""
    table = route_table(rec)
    return Deployment(recommended_engine(rec, basis), route_caps(table, rec.routes), policy, rec.budget_blocks,
                      route_laws(table, rec.routes), *rendered_queue(rec))


def rendered_queue(rec: Recommendation) -> tuple[int, float]:
    """The wait queue gateway.yaml renders for `rec` (max waiting, timeout); none: (0, 30 s)."""
    waiting, timeout = rec.settings.get("gateway_queue_max_waiting"), rec.settings.get("gateway_queue_timeout_s")
    if waiting is None or timeout is None or not isinstance(waiting.value, int) \
            or not isinstance(timeout.value, (int, float)):
        return 0, 30.0
    return waiting.value, float(timeout.value)


def recommended_engine(rec: Recommendation, basis: SimBasis) -> EngineSettings:
    """The engine vllm-serve.sh starts for `rec`, on the simulator's measured pool."""
    return EngineSettings(num_blocks=basis.engine.num_blocks, block_size=rec.capacity.block_size,
                          max_num_seqs=rec.setting("max_num_seqs").tokens,
                          max_num_batched_tokens=rec.setting("max_num_batched_tokens").tokens,
                          max_model_len=rec.max_model_len, enable_prefix_caching=basis.engine.enable_prefix_caching)


@dataclass(frozen=True, slots=True)
class Candidate:
    """One row of the grid before it is simulated (rec None: a reference row)."""

    policy: Policy
    cap_level: str | None
    safety_fraction: float | None
    deployment: Deployment
    rec: Recommendation | None  # None: a reference row


def grid_candidates(profile: Profile, plan: Plan, options: RecommendOptions, objective: Objective,
                    grid: SearchGrid, left_out: list[str] | None = None) -> list[Candidate]:
    """The grid's rows in table order. On an estimated pool a cell's engine settings can leave no
    memory for KV (its max_num_seqs' sampler, replanned as vLLM profiles it): with `left_out`
    given, such a cell is no candidate and its label and reason are appended there (the search
    says so in its notes); without it, the CapacityError propagates."""
    basis = objective.basis
    uncapped: dict[str, int | None] = {r.route: None for r in profile.routes}
    default = recommend(profile, plan, options)
    direct, worst = Policy(PolicyKind.DIRECT), Policy(PolicyKind.WORST_CASE)
    out = [Candidate(direct, None, None, Deployment(basis.engine, uncapped, direct, None), None)]
    out += engine_candidates(default, basis, uncapped, grid.engines, options.cap_level or TAIL_LEVEL)
    user_safety = options.safety_fraction is not None
    seen: set[tuple] = set()
    for level, safety, policy in grid.cells():
        try:
            rec = recommend(profile, plan, dataclasses.replace(
                options, cap_level=None if level == TAIL_LEVEL else level, safety_fraction=safety,
                searched=not user_safety, admission=policy.admission()))
        except CapacityError as exc:
            if left_out is None or plan.capacity.source is not CapacitySource.ESTIMATE:
                raise
            left_out.append(f"{policy.label}, caps {level}, safety {safety:g}: {exc.message}")
            continue
        deployment = rendered_deployment(rec, basis, policy)
        key = (policy, tuple(sorted(deployment.caps.items())), deployment.budget_blocks, deployment.engine)
        if key in seen:
            continue
        seen.add(key)
        out.append(Candidate(policy, level, safety, deployment, rec))
        flow = flow_control_of(rec)
        if flow is not None:  # recommend --flow-control: the same row with the flow-control queue beside it
            out.append(Candidate(dataclasses.replace(policy, flow=True), level, safety,
                                 dataclasses.replace(deployment, flow=flow), rec))
    out.append(Candidate(worst, None, default.safety_fraction.fraction,
                         Deployment(basis.engine, uncapped, worst, default.budget_blocks,
                                    queue_max_waiting=rendered_queue(default)[0],
                                    queue_timeout_s=rendered_queue(default)[1]), None))
    return out


def engine_candidates(default: Recommendation, basis: SimBasis, uncapped: dict[str, int | None],
                      engines: Sequence[str], cap_level: str) -> list[Candidate]:
    """The engine rows: each engine's own admission on the same requests, no ledger admitting.
    "SGLang (defaults)" is the analogue of direct to vLLM (vLLM's engine defaults on the measured
    pool, no caps: SGLang reserves context − prompt, clipped at 4096). The rendered SGLang and
    both TensorRT-LLM rows run what kvtune renders for them from the default recommendation: its
    engine limits, its route caps in every request (the gateway clamps max_tokens), the pool
    pinned at its block budget (--max-total-tokens, kv_cache_config.max_tokens) where that still
    holds max_model_len, and for SGLang the ratio pinned at 1 with the estimate clipped at the
    largest cap (kvtune.policy.engine_rules.sglang_settings)."""
    rendered = rendered_deployment(default, basis, GUARANTEED)
    engine = rendered.engine
    if default.budget_blocks is not None:
        try:
            engine = dataclasses.replace(engine, num_blocks=min(engine.num_blocks, default.budget_blocks + 1))
        except OptionError:
            pass  # a budget below one max_model_len sequence: the whole pool, as the engine would refuse it
    caps = [c for c in rendered.caps.values() if c is not None]
    out = []
    for name in engines:
        policy = Policy(PolicyKind.ENGINE, engine=name)
        if name == "sglang":
            out.append(Candidate(policy, None, None, Deployment(basis.engine, uncapped, policy, None,
                                                                rule=engine_rule("sglang")), None))
            continue
        rule = SGLangRule.as_rendered(max(caps, default=None)) if name == "sglang-rendered" else engine_rule(name)
        out.append(Candidate(policy, cap_level, None, Deployment(engine, rendered.caps, policy, None, rule=rule),
                             None))
    return out


def violations(objective: Objective, predicted: Predicted) -> tuple[Violation, ...]:
    """The constraints of `objective` that `predicted` breaks."""
    return tuple(Violation(name, limit, value) for name, limit, attr in objective.constraints()
                 if (value := getattr(predicted, attr)) > limit + 1e-12)


def _score(objective: Objective, p: Predicted, budget_blocks: int | None, index: int) -> tuple[float, ...]:
    """Higher is better: the objective, then output tokens/s, fewer preemptions, fewer 429s,
    less truncation, a smaller budget (more margin), the earlier row."""
    value = getattr(p, objective.metric)
    return (value if value is not None else -math.inf, p.output_tokens_per_s, -p.preemption_rate, -p.share_429,
            -p.truncation_share, -(budget_blocks or 0), -index)


def choose(objective: Objective, predicted: Sequence[Predicted], budgets: Sequence[int | None],
           reference: Sequence[bool]) -> int | None:
    """The index of the best row that is a candidate (not a reference) and breaks no
    constraint; None when there is none."""
    feasible = [i for i, p in enumerate(predicted) if not reference[i] and not violations(objective, p)]
    return max(feasible, key=lambda i: _score(objective, predicted[i], budgets[i], i)) if feasible else None


def _why(objective: Objective, i: int, chosen: int | None, predicted: list[Predicted],
         violations: tuple[Violation, ...], reference: bool, feasible: int) -> str:
    metric = objective.metric_label
    broke = "; ".join(v.text for v in violations)
    if reference:
        return "reference, not a kvtune deployment" + (f"; breaks {broke}" if broke else "")
    if violations:
        return f"rejected: {broke}"
    value = getattr(predicted[i], objective.metric) or 0.0
    if i == chosen:
        limits = ", ".join(f"{name.removeprefix('max_').replace('_', ' ')} ≤ {limit:.1%}"
                           for name, limit, _ in objective.constraints()) or "no constraints"
        return f"chosen: the highest {metric} ({value:,.2f}) of the {feasible} candidate(s) within {limits}"
    assert chosen is not None
    best = getattr(predicted[chosen], objective.metric) or 0.0
    if value == best:
        return (f"within the constraints; ties the chosen row on {metric}, which wins on the tie-breaks "
                "(output tokens/s, preemptions, 429s, truncation, smaller budget)")
    return f"within the constraints; {metric} {value:,.2f} < the chosen row's {best:,.2f}"


def _flow_note(objective: Objective, policy: Policy, predicted: Predicted, budget_blocks: int | None) -> str:
    """A flow-control row whose engine was compute-bound says that flow control cannot help it."""
    if not policy.flow:
        return ""
    note = compute_bound_note(predicted, budget_blocks, None if objective.slo is None else objective.slo.ttft_ms)
    return "" if note is None else f"; {note}"


def search(profile: Profile, plan: Plan, options: RecommendOptions, objective: Objective, *,
           grid: SearchGrid | None = None, progress: Progress | None = None) -> Recommendation:
    """Simulate the grid, choose the best feasible candidate, return its recommendation with the
    what-if table; InfeasibleObjectiveError (with the table) when no candidate meets the constraints."""
    grid = searched_grid(grid, options, objective)
    left_out: list[str] = []
    candidates = grid_candidates(profile, plan, options, objective, grid, left_out)
    draws = [draw_requests(objective, seed) for seed in objective_seeds(objective)]
    rec = chosen_recommendation(objective, grid, candidates,
                                lambda c: (simulate_deployment(objective, c.deployment, draws), ()), progress)
    if not left_out:
        return rec
    note = (f"{len(left_out)} candidate(s) of the grid left out: on the estimated pool their engine settings leave "
            f"no memory for KV (first: {left_out[0]})")
    return dataclasses.replace(rec, notes=(*rec.notes, note))


def searched_grid(grid: SearchGrid | None, options: RecommendOptions, objective: Objective) -> SearchGrid:
    """The grid as the objective and a --safety-fraction narrow it."""
    grid = (grid or SearchGrid()).for_objective(objective)
    if options.safety_fraction is not None:
        grid = dataclasses.replace(grid, safety_fractions=(options.safety_fraction,),
                                   overcommit_safety=options.safety_fraction)
    return grid


Evaluate = Callable[[Candidate], tuple[Predicted, tuple[ReplicaRow, ...]]]  # a row's total and replicas


def chosen_recommendation(objective: Objective, grid: SearchGrid, candidates: Sequence[Candidate],
                          evaluate: Evaluate, progress: Progress | None) -> Recommendation:
    """Each candidate's figures (and, for several replicas, each replica's part) by `evaluate`,
    the best feasible one chosen: its recommendation with the what-if table attached."""
    objective = truncation_limit(objective, candidates)
    predicted: list[Predicted] = []
    parts: list[tuple[ReplicaRow, ...]] = []
    for done, c in enumerate(candidates, 1):
        total, replicas = evaluate(c)
        predicted.append(total)
        parts.append(replicas)
        if progress is not None:
            progress(done, len(candidates))
    broken = [violations(objective, p) for p in predicted]
    feasible = [i for i, c in enumerate(candidates) if c.rec is not None and not broken[i]]
    budgets = [c.deployment.budget_blocks if not parts[i] else _total_budget(parts[i])
               for i, c in enumerate(candidates)]
    chosen = choose(objective, predicted, budgets, [c.rec is None for c in candidates])
    rows = tuple(WhatIfRow(
        policy=c.policy, cap_level=c.cap_level, caps=dict(c.deployment.caps), budget_blocks=budgets[i],
        safety_fraction=c.safety_fraction, max_num_seqs=c.deployment.engine.max_num_seqs,
        max_num_batched_tokens=c.deployment.engine.max_num_batched_tokens, predicted=predicted[i],
        violations=broken[i], chosen=i == chosen,
        why=_why(objective, i, chosen, predicted, broken[i], c.rec is None, len(feasible))
        + _flow_note(objective, c.policy, predicted[i], budgets[i]), replicas=parts[i])
        for i, c in enumerate(candidates))
    if chosen is None:
        closest = min((i for i, c in enumerate(candidates) if c.rec is not None),
                      key=lambda i: (sum(v.value - v.limit for v in broken[i]), i))
        raise InfeasibleObjectiveError(
            f"no configuration meets the objective: of {sum(c.rec is not None for c in candidates)} candidates "
            f"the closest, "
            f"{rows[closest].label}, breaks {'; '.join(v.text for v in broken[closest])}; relax "
            "--max-preemption-rate / --max-429-share / --max-truncation or lower the load", rows, objective)
    rec = candidates[chosen].rec
    assert rec is not None
    notes = [f"what-if search at {objective.load.label}, {objective.requests:,} requests, "
             f"{objective.seeds_label}: {grid.describe()}; {len(rows)} rows simulated"]
    if objective.basis.timing.estimate:
        notes.append("the what-if figures rest on a roofline step-time estimate, not a calibration: run "
                     "`kvtune calibrate URL --timing --save FILE` and pass it with --capacity")
    return dataclasses.replace(rec, objective=objective, what_if=rows, notes=(*rec.notes, *notes))


def _total_budget(parts: tuple[ReplicaRow, ...]) -> int | None:
    """A row's budget over every replica (None: no gateway in front of them)."""
    budgets = [p.budget_blocks for p in parts]
    return None if any(b is None for b in budgets) else sum(b for b in budgets if b is not None)


def recommend_for_objective(profile: Profile, plan: Plan, options: RecommendOptions, spec: ObjectiveSpec, *,
                            grid: SearchGrid | None = None, progress: Progress | None = None) -> Recommendation:
    """`recommend --objective`: the objective resolved on the plan's measured capacity, then searched
    (with `spec.compare_engines`, the grid's engine rows are every engine in ENGINE_ROWS)."""
    grid = grid or SearchGrid()
    if spec.compare_engines and not grid.engines:
        grid = dataclasses.replace(grid, engines=tuple(ENGINE_ROWS))
    return search(profile, plan, options, build_objective(profile, plan, spec), grid=grid, progress=progress)


__all__ = ["ObjectiveSpec", "SearchGrid", "Deployment", "Draws", "InfeasibleObjectiveError", "build_objective",
           "draw_requests", "simulate_deployment", "rendered_deployment", "recommended_engine", "route_caps", "search",
           "violations", "choose", "GUARANTEED",
           "recommend_for_objective", "truncation_share", "truncation_limit",
           "tail_rule_truncation", "DEFAULT_CAP_LEVELS", "DEFAULT_SAFETY_FRACTIONS",
           "DEFAULT_OVERCOMMIT_FACTORS", "OVERCOMMITS", "DEFAULT_EPSILONS", "STATISTICALS",
           "DEFAULT_SEEDS", "mean_predicted", "objective_seeds", "route_laws",
           "DEFAULT_REQUESTS", "TAIL_LEVEL", "Candidate", "grid_candidates", "engine_candidates", "simulate_run",
           "predicted_of", "searched_grid", "chosen_recommendation"]
