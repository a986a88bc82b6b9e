"""What the caller decides besides the deployment: the `Policy` the rules follow (caps, budget,
what the files serve and route by) and the `Objective` a simulated search meets. kvtune.api's
recommend takes them whole; the CLI builds them from its options."""

from __future__ import annotations

from dataclasses import dataclass

from kvtune.domain.slo import Slo

__all__ = ["Policy", "Objective", "DEFAULT_UPSTREAM", "GOALS"]

DEFAULT_UPSTREAM = "http://127.0.0.1:8000"  # kvtune.policy.recommend.DEFAULT_UPSTREAM (a test ties them)
GOALS = ("throughput", "goodput")


@dataclass(frozen=True, slots=True)
class Policy:
    """The rules' inputs a person decides. `route_by` must be what the profile's routes were named
    by; with a log field, `route_header` names the request header that carries each group.
    `slo` bounds max_num_seqs by the step-time model's TPOT/TTFT (without an objective).
    `vllm_version` is the older name of Deployment.engine_version (both given must agree).
    `flow_control` renders gateway.yaml `flow:` (docs/guides/flow-control.md) instead of the FIFO
    queue, its bands' deadlines from the SLO (`slo`, or the objective's), which must give ttft."""

    served_model: str | None = None
    upstream: str = DEFAULT_UPSTREAM
    safety_fraction: float | None = None
    max_truncation: float | None = None
    route_by: str | None = None
    route_header: str | None = None
    slo: Slo | None = None
    vllm_version: str | None = None
    flow_control: bool = False


@dataclass(frozen=True, slots=True)
class Objective:
    """`recommend --objective`: the goal ("throughput", or "goodput" under `slo`; None: the rules
    alone, and then no other field but `slo` may be given), the constraints a row must meet, and
    the simulated load (`rate_rps` or `concurrency`; None: the logs' mean arrival rate)."""

    goal: str | None = "throughput"
    slo: Slo | None = None
    max_preemption_rate: float | None = None
    max_429_share: float | None = None
    rate_rps: float | None = None
    concurrency: int | None = None
    requests: int | None = None
    seed: int = 0
    compare_engines: bool = False
