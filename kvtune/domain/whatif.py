"""The objective a recommendation was searched for, and its what-if table, as typed documents.

`recommend --objective` simulates each candidate configuration on the logged traffic and keeps
one row per candidate (kvtune.policy.search builds them): its policy, caps, budget and predicted
figures, whether it meets the constraints (and which one it broke if not), and which row was
chosen and why. The objective travels in recommendation.json with everything a later `kvtune
check` needs to simulate a deployed config the same way: the load, the seed, the step-time
model, the engine's defaults on the measured capacity, and the traffic profile itself. Both read
back strictly (`read`); the traffic profile is kvtune.profile's type, so its reader is passed in
(`read_traffic`) and the objective is generic in it.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

from kvtune.domain.admission_policy import GUARANTEED, MAX_FACTOR, AdmissionPolicy
from kvtune.domain.admission_policy import PolicyKind as AdmissionKind
from kvtune.domain.engine_settings import EngineSettings
from kvtune.domain.fields import Fields
from kvtune.domain.slo import Slo
from kvtune.domain.step_time import StepTimeModel, TimingSource
from kvtune.errors import OptionError


class _NamedRoute(Protocol):
    @property
    def route(self) -> str: ...


class TrafficProfile(Protocol):
    """What the documents need of the traffic a search drew its requests from (kvtune.profile.
    routes.Profile): its routes' names and its saved form."""

    @property
    def routes(self) -> Sequence[_NamedRoute]: ...

    def to_dict(self) -> dict[str, Any]: ...


TrafficT = TypeVar("TrafficT", bound=TrafficProfile)
#: Reads the saved traffic profile at `objective.traffic` (kvtune.policy.recommendation passes
#: kvtune.profile's reader); an InputError names the field.
TrafficReader = Callable[[Fields], TrafficT]


class Goal(enum.Enum):
    """What the search maximises: output tokens/s, or requests/s that meet --slo."""

    THROUGHPUT = "throughput"
    GOODPUT = "goodput"


GOALS = tuple(g.value for g in Goal)


class PolicyKind(enum.Enum):
    """How requests reach the engine in one what-if row."""

    DIRECT = "direct"  # straight to vLLM with its defaults: no gateway, no caps
    WORST_CASE = "worst-case"  # the gateway reserving the whole context for every request
    GUARANTEED = "guaranteed"  # the gateway reserving prompt + cap for each request's whole life
    OVERCOMMIT = "overcommit"  # guaranteed reservations held against factor × the budget
    STATISTICAL = "statistical"  # admit while P(KV overflow) ≤ epsilon
    ENGINE = "engine"  # another engine's own admission rule (kvtune.sim.rules), no gateway admitting


POLICY_KINDS = tuple(k.value for k in PolicyKind)
# rows shown for comparison, never chosen: they are not a kvtune deployment
REFERENCE_KINDS = frozenset({PolicyKind.DIRECT, PolicyKind.WORST_CASE, PolicyKind.ENGINE})
# the engine rows `recommend --objective --compare-engines` adds, and what each one is
ENGINE_ROWS = {
    "sglang-rendered": "SGLang as rendered (ratio pinned at 1 by the env kvtune renders)",
    "sglang": "SGLang (defaults)",
    "trtllm-gne": "TensorRT-LLM GUARANTEED_NO_EVICT",
    "trtllm-maxutil": "TensorRT-LLM MAX_UTILIZATION",
}


@dataclass(frozen=True, slots=True)
class Policy:
    kind: PolicyKind
    factor: float | None = None  # overcommit
    epsilon: float | None = None  # statistical
    engine: str | None = None  # engine: a key of ENGINE_ROWS
    flow: bool = False  # the gateway's flow-control queue (gateway.yaml flow:) instead of the FIFO one

    @property
    def label(self) -> str:
        if self.kind is PolicyKind.ENGINE:
            return ENGINE_ROWS.get(self.engine or "", str(self.engine))
        if self.kind is PolicyKind.OVERCOMMIT:
            base = f"overcommit ×{self.factor:g}"
        elif self.kind is PolicyKind.STATISTICAL:
            base = f"statistical ε={self.epsilon:g}"
        else:
            base = self.kind.value
        return f"{base} + flow control" if self.flow else base

    @property
    def reference(self) -> bool:
        return self.kind in REFERENCE_KINDS

    def admission(self) -> AdmissionPolicy:
        """The gateway's admission policy this row deploys (the whole-context row: guaranteed)."""
        if self.kind in (PolicyKind.DIRECT, PolicyKind.ENGINE):
            raise ValueError("straight to the engine, no gateway admits anything")
        if self.kind is PolicyKind.OVERCOMMIT:
            return AdmissionPolicy.overcommit(self.factor or 1.0)
        if self.kind is PolicyKind.STATISTICAL:
            return AdmissionPolicy.statistical(self.epsilon or 0.0)
        return GUARANTEED

    @classmethod
    def of(cls, admission: AdmissionPolicy) -> Policy:
        """The row policy of a gateway's admission policy."""
        if admission.kind is AdmissionKind.OVERCOMMIT:
            return cls(PolicyKind.OVERCOMMIT, factor=admission.factor)
        if admission.kind is AdmissionKind.STATISTICAL:
            return cls(PolicyKind.STATISTICAL, epsilon=admission.epsilon)
        return cls(PolicyKind.GUARANTEED)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": self.kind.value, "factor": self.factor, "epsilon": self.epsilon}
        if self.engine is not None:
            out["engine"] = self.engine
        if self.flow:
            out["flow_control"] = True
        return out

    @classmethod
    def read(cls, f: Fields) -> Policy:
        kind = PolicyKind(f.choice("kind", POLICY_KINDS))
        factor = f.number("factor", minimum=1.0, maximum=MAX_FACTOR, optional=True)
        epsilon = f.number("epsilon", maximum=1.0, optional=True)
        engine = f.choice("engine", tuple(ENGINE_ROWS), optional=True)
        if (engine is not None) != (kind is PolicyKind.ENGINE):
            raise f.fail("engine", "an engine row names its engine, no other row does")
        if (factor is not None) != (kind is PolicyKind.OVERCOMMIT):
            raise f.fail("factor", "an overcommit policy has a factor, no other policy has one")
        if (epsilon is not None) != (kind is PolicyKind.STATISTICAL):
            raise f.fail("epsilon", "a statistical policy has an epsilon, no other policy has one")
        flow = f.boolean("flow_control", optional=True) or False
        return cls(kind, factor, epsilon, engine, flow)


@dataclass(frozen=True, slots=True)
class Load:
    """The load simulated: an open loop at `rate_rps` (Poisson) or a closed loop of `concurrency`
    clients; `source` says where it came from: "logs" (their timestamps) or "option"."""

    rate_rps: float | None
    concurrency: int | None
    source: str

    def __post_init__(self) -> None:
        if (self.rate_rps is None) == (self.concurrency is None):
            both = "not both" if self.rate_rps is not None else "got neither"
            raise OptionError(f"a load is a rate or a concurrency, {both}", field="rate_rps")
        if self.rate_rps is not None and not self.rate_rps > 0:
            raise OptionError(f"must be a positive number of requests per second, got {self.rate_rps:g}",
                              field="rate_rps")
        if self.concurrency is not None and self.concurrency < 1:
            raise OptionError(f"must be at least 1, got {self.concurrency}", field="concurrency")

    @property
    def label(self) -> str:
        if self.rate_rps is not None:
            return f"Poisson arrivals at {self.rate_rps:.3g} req/s ({'logged' if self.source == 'logs' else 'given'})"
        return f"{self.concurrency} concurrent clients"

    def to_dict(self) -> dict[str, Any]:
        return {"rate_rps": self.rate_rps, "concurrency": self.concurrency, "from": self.source}

    @classmethod
    def read(cls, f: Fields) -> Load:
        try:
            return cls(f.number("rate_rps", optional=True), f.integer("concurrency", minimum=1, optional=True),
                       f.choice("from", ("logs", "option")))
        except OptionError as exc:
            raise f.fail(exc.field, exc.message) from None


MAX_SEEDS = 10  # seeds a row may be averaged over (each one more simulation per row)

ENGINE_FIELDS = ("num_blocks", "block_size", "max_num_seqs", "max_num_batched_tokens", "max_model_len")


@dataclass(frozen=True, slots=True)
class SimBasis:
    """What the simulator runs on: the step time (calibrated or a roofline estimate), the
    per-request HTTP overhead, and the engine with today's defaults on the measured capacity."""

    timing: StepTimeModel
    http_overhead_s: float
    engine: EngineSettings

    def to_dict(self) -> dict[str, Any]:
        e = self.engine
        return {"timing": {"source": self.timing.source.value, **self.timing.to_dict(),
                           "http_overhead_s": self.http_overhead_s},
                "engine": {**{k: getattr(e, k) for k in ENGINE_FIELDS},
                           "enable_prefix_caching": e.enable_prefix_caching}}

    @classmethod
    def read(cls, f: Fields) -> SimBasis:
        t, e = f.obj("timing"), f.obj("engine")
        source = TimingSource(t.choice("source", tuple(s.value for s in TimingSource)))
        try:
            timing = StepTimeModel(t.number("c0"), t.number("c1"), t.number("c2"), t.number("c3"),
                                   t.number("c4", optional=True) or 0.0, source=source,
                                   mixed_step_s=t.number("mixed_step_s", optional=True) or 0.0,
                                   largest_graph_tokens=t.integer("largest_graph_tokens", optional=True) or 0,
                                   past_knee_s=t.number("past_knee_s", optional=True) or 0.0,
                                   knee_tokens=t.integer("knee_tokens", optional=True) or 0)
            timing.ticks()
        except OptionError as exc:
            raise t.fail(exc.field, exc.message) from None
        try:
            # the search simulates the current release, whose admission needs the whole prompt's blocks
            engine = EngineSettings(**{k: e.integer(k, minimum=1) for k in ENGINE_FIELDS},
                                    enable_prefix_caching=e.boolean("enable_prefix_caching"),
                                    reserve_full_sequence=True)
        except OptionError as exc:
            raise e.fail(exc.field, exc.message) from None
        return cls(timing, t.number("http_overhead_s"), engine)


@dataclass(frozen=True, slots=True)
class ReplicaBasis:
    """One engine replica's footing in the simulator (several --capacity files): the file it was
    measured in, and its own step time and pool."""

    capacity_file: str
    basis: SimBasis

    def to_dict(self) -> dict[str, Any]:
        return {"capacity_file": self.capacity_file, "simulator": self.basis.to_dict()}

    @classmethod
    def read(cls, f: Fields) -> ReplicaBasis:
        return cls(f.string("capacity_file", nonempty=True), SimBasis.read(f.obj("simulator")))


@dataclass(frozen=True, slots=True, eq=False)
class Objective(Generic[TrafficT]):
    """What the recommendation was searched for, and what it takes to simulate it again."""

    goal: Goal
    slo: Slo | None
    max_preemption_rate: float | None  # share of requests preempted at least once
    max_429_share: float | None  # share of requests answered 429 after all their retries
    load: Load
    requests: int
    seed: int
    basis: SimBasis
    traffic: TrafficT  # the profile the requests are drawn from (as `kvtune bench` draws them)
    seeds: int = 1  # each row is the mean over seeds seed, seed + 1, ... (files before it: one seed)
    # several engine replicas (kvtune.policy.replica_search): each one's footing, in upstream
    # order; `basis` is then the smallest one's (whose caps and max_model_len they all run)
    replicas: tuple[ReplicaBasis, ...] = ()
    # the largest share of answers a row's caps may cut (kvtune.policy.search.truncation_limit:
    # --max-truncation, else what the tail cap rule cuts); None: unbounded (files before it)
    max_truncation: float | None = None

    def __post_init__(self) -> None:
        for name in ("max_preemption_rate", "max_429_share", "max_truncation"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= 1:
                raise OptionError(f"must be a share between 0 and 1, got {value:g}", field=name)
        if self.seeds < 1:
            raise OptionError(f"must be at least 1, got {self.seeds}", field="seeds")
        if self.goal is Goal.GOODPUT and self.slo is None:
            raise OptionError("the goodput objective needs latency objectives, e.g. --slo ttft=500,e2e=10000",
                              field="slo")

    @property
    def seeds_label(self) -> str:
        """The seeds each row is simulated with, e.g. "seed 0" or "mean of seeds 0–2"."""
        if self.seeds == 1:
            return f"seed {self.seed}"
        return f"mean of seeds {self.seed}–{self.seed + self.seeds - 1}"

    @property
    def metric(self) -> str:
        """The predicted figure maximised (a Predicted attribute)."""
        return "goodput_rps" if self.goal is Goal.GOODPUT else "output_tokens_per_s"

    @property
    def metric_label(self) -> str:
        return "goodput (req/s within the SLO)" if self.goal is Goal.GOODPUT else "output tokens/s"

    def constraints(self) -> list[tuple[str, float, str]]:
        """(name, limit, Predicted attribute) of each constraint set."""
        out = []
        if self.max_preemption_rate is not None:
            out.append(("max_preemption_rate", self.max_preemption_rate, "preemption_rate"))
        if self.max_429_share is not None:
            out.append(("max_429_share", self.max_429_share, "share_429"))
        if self.max_truncation is not None:
            out.append(("max_truncation", self.max_truncation, "truncation_share"))
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.goal.value, "slo": None if self.slo is None else self.slo.to_dict(),
                "max_preemption_rate": self.max_preemption_rate, "max_429_share": self.max_429_share,
                "max_truncation": self.max_truncation, "load": self.load.to_dict(), "requests": self.requests,
                "seed": self.seed, "seeds": self.seeds,
                "simulator": self.basis.to_dict(), "traffic": self.traffic.to_dict(),
                **({"replicas": [r.to_dict() for r in self.replicas]} if self.replicas else {})}

    @classmethod
    def read(cls, f: Fields, read_traffic: TrafficReader[TrafficT]) -> Objective[TrafficT]:
        slo_f = f.obj("slo", optional=True)
        slo = None if slo_f is None else Slo(*(slo_f.number(k, optional=True)
                                               for k in ("ttft_ms", "tpot_ms", "e2e_ms")))
        traffic = f.obj("traffic")
        profile = read_traffic(traffic)
        if not profile.routes:
            raise traffic.fail("routes", "no routes to draw requests from")
        try:
            return cls(Goal(f.choice("kind", GOALS)), slo, f.number("max_preemption_rate", maximum=1, optional=True),
                       f.number("max_429_share", maximum=1, optional=True), Load.read(f.obj("load")),
                       f.integer("requests", minimum=1), f.integer("seed"), SimBasis.read(f.obj("simulator")),
                       profile, f.integer("seeds", minimum=1, maximum=MAX_SEEDS, optional=True) or 1,
                       tuple(ReplicaBasis.read(r) for r in f.items("replicas", optional=True, nonempty=True)),
                       f.number("max_truncation", maximum=1, optional=True))
        except OptionError as exc:
            raise f.fail(exc.field, exc.message) from None


@dataclass(frozen=True, slots=True)
class Predicted:
    """What the simulator predicts for one configuration (latencies of completed requests, ms)."""

    output_tokens_per_s: float
    requests_per_s: float
    goodput_rps: float | None
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    e2e_p50_ms: float | None
    e2e_p99_ms: float | None
    preemption_rate: float
    share_429: float
    truncation_share: float
    sent: int
    completed: int
    # the engine's peaks: KV blocks held, requests in its waiting queue and running at once;
    # None: not known (files written before them)
    kv_peak_blocks: int | None = None
    waiting_peak: int | None = None
    running_peak: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"output_tokens_per_s": self.output_tokens_per_s, "requests_per_s": self.requests_per_s,
                "goodput_rps": self.goodput_rps,
                "ttft_ms": {"p50": self.ttft_p50_ms, "p99": self.ttft_p99_ms},
                "e2e_ms": {"p50": self.e2e_p50_ms, "p99": self.e2e_p99_ms},
                "preemption_rate": self.preemption_rate, "share_429": self.share_429,
                "truncation_share": self.truncation_share, "sent": self.sent, "completed": self.completed,
                **({} if self.kv_peak_blocks is None else {"kv_peak_blocks": self.kv_peak_blocks}),
                **({} if self.waiting_peak is None else {"waiting_peak": self.waiting_peak}),
                **({} if self.running_peak is None else {"running_peak": self.running_peak})}

    @classmethod
    def read(cls, f: Fields) -> Predicted:
        ttft, e2e = f.obj("ttft_ms"), f.obj("e2e_ms")
        return cls(f.number("output_tokens_per_s"), f.number("requests_per_s"), f.number("goodput_rps", optional=True),
                   ttft.number("p50", optional=True), ttft.number("p99", optional=True),
                   e2e.number("p50", optional=True), e2e.number("p99", optional=True),
                   f.number("preemption_rate", maximum=1), f.number("share_429", maximum=1),
                   f.number("truncation_share", maximum=1), f.integer("sent"), f.integer("completed"),
                   f.integer("kv_peak_blocks", optional=True), f.integer("waiting_peak", optional=True),
                   f.integer("running_peak", optional=True))


# each constraint (its option's name) as a row's verdict names it
CONSTRAINT_NAMES = {"max_preemption_rate": "preemption rate", "max_429_share": "429 share",
                    "max_truncation": "truncated"}


@dataclass(frozen=True, slots=True)
class Violation:
    """A constraint a row broke: its name (the option), its limit and the predicted value."""

    constraint: str
    limit: float
    value: float

    @property
    def text(self) -> str:
        what = CONSTRAINT_NAMES[self.constraint]
        return f"{what} {self.value:.1%} > {self.limit:.1%}"

    def to_dict(self) -> dict[str, Any]:
        return {"constraint": self.constraint, "limit": self.limit, "value": self.value}

    @classmethod
    def read(cls, f: Fields) -> Violation:
        return cls(f.choice("constraint", tuple(CONSTRAINT_NAMES)), f.number("limit", maximum=1),
                   f.number("value", maximum=1))


@dataclass(frozen=True, slots=True)
class ReplicaRow:
    """One engine replica's part of a what-if row (`recommend --objective` with one --capacity
    FILE per replica): its own budget and engine limits, its share of the load, its figures."""

    capacity_file: str
    budget_blocks: int | None  # None: no gateway in front of it
    max_num_seqs: int
    max_num_batched_tokens: int
    share: float  # of the requests (and, in a closed loop, of the clients) sent to it
    predicted: Predicted

    def to_dict(self) -> dict[str, Any]:
        return {"capacity_file": self.capacity_file, "budget_blocks": self.budget_blocks,
                "max_num_seqs": self.max_num_seqs, "max_num_batched_tokens": self.max_num_batched_tokens,
                "share": self.share, "predicted": self.predicted.to_dict()}

    @classmethod
    def read(cls, f: Fields) -> ReplicaRow:
        return cls(f.string("capacity_file", nonempty=True), f.integer("budget_blocks", minimum=1, optional=True),
                   f.integer("max_num_seqs", minimum=1), f.integer("max_num_batched_tokens", minimum=1),
                   f.number("share", maximum=1), Predicted.read(f.obj("predicted")))


@dataclass(frozen=True, slots=True)
class WhatIfRow:
    """One simulated configuration: policy, per-route caps (None: uncapped), budget, engine
    limits, predictions, the constraints it broke, and whether (and why) it was chosen."""

    policy: Policy
    cap_level: str | None  # "tail" (p95/p99 by tail class), "p90" … "p99.9", None: no caps
    caps: Mapping[str, int | None]  # route → cap the gateway (or vLLM) applies
    budget_blocks: int | None  # the gateway's block budget; None: no gateway
    safety_fraction: float | None
    max_num_seqs: int
    max_num_batched_tokens: int
    predicted: Predicted
    violations: tuple[Violation, ...]
    chosen: bool
    why: str
    # several replicas: each one's part, in upstream order; `predicted` is then the deployment's
    # total (rates summed, shares and latency percentiles over all its requests), `budget_blocks`
    # the sum of theirs, max_num_seqs and max_num_batched_tokens the smallest replica's (vllm-serve.sh's)
    replicas: tuple[ReplicaRow, ...] = ()

    @property
    def reference(self) -> bool:
        return self.policy.reference

    @property
    def feasible(self) -> bool:
        return not self.violations

    @property
    def policy_cell(self) -> str:
        """The policy, as the what-if table names it."""
        return {PolicyKind.DIRECT: "direct (vLLM defaults)", PolicyKind.WORST_CASE: "whole context"}.get(
            self.policy.kind, self.policy.label)

    @property
    def verdict(self) -> str:
        """chosen, reference, ok, or the constraints broken."""
        if self.chosen:
            return "chosen"
        if self.violations:
            return "✗ " + "; ".join(v.text for v in self.violations)
        return "reference" if self.reference else "ok"

    @property
    def label(self) -> str:
        if self.policy.kind is PolicyKind.DIRECT:
            return "direct to vLLM (today's defaults)"
        if self.policy.kind is PolicyKind.WORST_CASE:
            return "gateway, whole-context reservation"
        if self.policy.kind is PolicyKind.ENGINE:
            return self.policy.label
        return f"{self.policy.label}, caps {self.cap_level}, safety {self.safety_fraction:g}"

    def to_dict(self) -> dict[str, Any]:
        return {"policy": self.policy.to_dict(), "reference": self.reference, "cap_level": self.cap_level,
                "caps": dict(self.caps), "budget_blocks": self.budget_blocks, "safety_fraction": self.safety_fraction,
                "max_num_seqs": self.max_num_seqs, "max_num_batched_tokens": self.max_num_batched_tokens,
                "predicted": self.predicted.to_dict(), "feasible": self.feasible,
                "violations": [v.to_dict() for v in self.violations], "chosen": self.chosen, "why": self.why,
                **({"replicas": [r.to_dict() for r in self.replicas]} if self.replicas else {})}

    @classmethod
    def read(cls, f: Fields) -> WhatIfRow:
        caps_f = f.obj("caps")
        caps = {name: caps_f.integer(name, minimum=1, optional=True) for name in caps_f.data}
        row = cls(Policy.read(f.obj("policy")), f.string("cap_level", optional=True), caps,
                  f.integer("budget_blocks", minimum=1, optional=True),
                  f.number("safety_fraction", maximum=1, optional=True), f.integer("max_num_seqs", minimum=1),
                  f.integer("max_num_batched_tokens", minimum=1), Predicted.read(f.obj("predicted")),
                  tuple(Violation.read(v) for v in f.items("violations")), f.boolean("chosen"), f.string("why"),
                  tuple(ReplicaRow.read(r) for r in f.items("replicas", optional=True, nonempty=True)))
        for key, derived in (("reference", row.reference), ("feasible", row.feasible)):
            if f.boolean(key) != derived:
                raise f.fail(key, f"is {f.data[key]}, but the row's policy and violations say {derived}")
        if row.chosen and (row.reference or not row.feasible):
            raise f.fail("chosen", "a reference or infeasible row cannot be the chosen one")
        return row


def read_what_if(f: Fields, read_traffic: TrafficReader[TrafficT]) -> tuple[Objective[TrafficT],
                                                                            tuple[WhatIfRow, ...]] | None:
    """recommendation.json's `objective` and `what_if`, both or neither (files before them: neither)."""
    if not f.has("objective") and not f.has("what_if"):
        return None
    if not f.has("objective") or not f.has("what_if"):
        missing = "objective" if not f.has("objective") else "what_if"
        raise f.fail(missing, "missing: a what-if table and its objective come together")
    objective = Objective.read(f.obj("objective"), read_traffic)
    rows = tuple(WhatIfRow.read(r) for r in f.items("what_if", nonempty=True))
    if sum(r.chosen for r in rows) != 1:
        raise f.fail("what_if", "expected exactly one chosen row")
    return objective, rows


__all__ = ["MAX_SEEDS", "Goal", "GOALS", "PolicyKind", "POLICY_KINDS", "REFERENCE_KINDS", "ENGINE_ROWS", "Policy",
           "Load", "SimBasis", "Objective", "Predicted", "Violation", "ReplicaBasis", "ReplicaRow", "WhatIfRow",
           "CONSTRAINT_NAMES", "TrafficProfile", "TrafficReader", "read_what_if"]
