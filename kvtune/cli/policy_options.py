"""The policy and objective options `recommend` and `check` share, each group one object that
turns into kvtune.api's Policy and Objective (kvtune.domain.choices)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import click

from kvtune.cli._vocabulary import warn_if_given
from kvtune.cli.options import grouped
from kvtune.domain.choices import Objective, Policy
from kvtune.domain.slo import Slo, parse_slo
from kvtune.errors import OptionError


@dataclass(frozen=True, slots=True)
class PolicyArgs:
    """The model and what the user decided about the policy, as `recommend` and `check` take them."""

    model: str | None  # None: the model the logs name (kvtune.model.sources.model_for_logged_id)
    served_model: str | None
    upstream: str
    vllm_version: str | None  # --engine-version's older name
    safety_fraction: float | None
    max_truncation: float | None
    route_header: str | None  # the request header that carries --route-by FIELD's group

    def as_policy(self, route_by: str | None, slo: Slo | None = None) -> Policy:
        """These options as kvtune.api's Policy (`route_by` from the log options; `slo` the bound
        --slo sets without --objective)."""
        return Policy(served_model=self.served_model, upstream=self.upstream, safety_fraction=self.safety_fraction,
                      max_truncation=self.max_truncation, route_by=route_by, route_header=self.route_header,
                      slo=slo, vllm_version=self.vllm_version)


@dataclass(frozen=True, slots=True)
class ObjectiveArgs:
    """`--objective` and the constraints and load it is searched under."""

    objective: str | None
    slo: str | None
    max_preemption_rate: float | None
    max_429_share: float | None
    rate: float | None
    concurrency: int | None
    requests: int
    seed: int
    compare_engines: bool = False
    flow_control: bool = False

    def as_objective(self) -> Objective:
        """These options as kvtune.api's Objective (goal None without --objective: kvtune.api then
        refuses the search's options, and --slo is the rules' bound: `bound`)."""
        return Objective(self.objective, self.parsed_slo() if self.objective else None, self.max_preemption_rate,
                         self.max_429_share, self.rate, self.concurrency,
                         self.requests if self.objective else None, self.seed, self.compare_engines)

    def bound(self) -> Slo | None:
        """The --slo the rules' limits meet (without --objective; with it, the search judges it)."""
        return None if self.objective else self.parsed_slo()

    def parsed_slo(self) -> Slo | None:
        return parse_slo(self.slo) if self.slo else None

    def with_flow(self, policy: Policy) -> Policy:
        """The policy with --flow-control, which takes its band deadlines from --slo's ttft."""
        if not self.flow_control:
            return policy
        slo = self.parsed_slo()
        if slo is None or slo.ttft_ms is None:
            raise OptionError("takes its interactive band's deadline from --slo ttft=MS", field="--flow-control")
        return dataclasses.replace(policy, flow_control=True)


objective_options = grouped("objective", ObjectiveArgs, [
    click.option("--objective", type=click.Choice(["throughput", "goodput"]),
                 help="Search caps, budget and admission policy with the simulator for the most output tokens/s "
                      "(or goodput under --slo) within the constraints; show the what-if table.  [default: the "
                      "rules alone, no simulation]"),
    click.option("--slo", metavar="SPEC",
                 help="Latency objectives in ms, e.g. tpot=50,ttft=2000: max_num_seqs (and max_num_batched_tokens "
                      "for ttft) are bounded so the step-time model's predicted TPOT and TTFT meet them (refused, "
                      "exit 1, when no batch does); with --objective goodput, what a request must meet to count "
                      "(e2e too)."),
    click.option("--max-preemption-rate", type=float, metavar="R",
                 help="At most this share of requests preempted at least once; 0 allows only the guaranteed "
                      "policy.  [default: unconstrained]"),
    click.option("--max-429-share", type=float, metavar="S",
                 help="At most this share of requests answered 429 after their retries.  [default: unconstrained]"),
    click.option("--rate", type=float, metavar="RPS",
                 help="Simulate Poisson arrivals at RPS requests/s.  [default: the logs' mean arrival rate]"),
    click.option("--concurrency", type=int, metavar="N",
                 help="Simulate N closed-loop clients instead of an arrival rate."),
    click.option("--requests", type=int, default=1000, show_default=True, metavar="N",
                 help="Requests simulated per what-if row (at most 100,000)."),
    click.option("--seed", type=int, default=0, show_default=True,
                 help="Seed for lengths and arrivals: the requests `kvtune bench --seed` would send "
                      "(with --objective, each row is the mean of this seed and the next two)."),
    click.option("--compare-engines", is_flag=True,
                 help="Add reference rows for the same traffic on SGLang (as rendered, and its defaults) and "
                      "TensorRT-LLM (GUARANTEED_NO_EVICT, MAX_UTILIZATION), each simulated with its own "
                      "admission rule."),
    click.option("--flow-control", is_flag=True,
                 help="Render gateway.yaml's flow-control queue (priority bands, fair flows, 429 at once for a "
                      "request that cannot make its deadline) instead of the FIFO queue: the interactive band's "
                      "deadline is --slo's ttft, the batch band's its e2e (else 10x ttft); with --objective, "
                      "each gateway row is also simulated with it."),
])


policy_options = grouped("policy", PolicyArgs, [
    click.option("--model", "-m", "model",
                 help="config.json, model directory, preset name or hub id.  [default: the model the logs name, "
                      "when it is a preset's hub id (or its -Instruct/-Chat variant), a local model directory or "
                      "a hub id in the Hugging Face cache]"),
    click.option("--served-model", help="What the engine loads (hub id or path).  [default: the model the logs "
                 "name, else the model's hub id]"),
    click.option("--upstream", default="http://127.0.0.1:8000", show_default=True,
                 help="The engine server the gateway configs point at."),
    click.option("--vllm-version", metavar="TEXT", hidden=True,
                 callback=warn_if_given("--vllm-version", "--engine-version"),
                 help="The older name of --engine-version."),
    click.option("--safety-fraction", type=float,
                 help="Share of usable KV blocks the gateway may reserve.  [default: 0.9]"),
    click.option("--max-truncation", type=float,
                 help="Pick the smallest cap whose expected truncation share is ≤ F (e.g. 0.01) instead of p95/p99; "
                      "with --objective, rows whose caps cut more answers are infeasible.  [default with "
                      "--objective: the share the p95/p99 tail rule cuts]"),
    click.option("--route-header", metavar="NAME",
                 help="With --route-by FIELD: the request header that carries the group at request time; the "
                      "gateways cap each group by its exact value (set it in a trusted layer in front: a client "
                      "that sets it picks its own cap). Without it, per-group caps are refused."),
])


__all__ = ["PolicyArgs", "ObjectiveArgs", "policy_options", "objective_options"]
