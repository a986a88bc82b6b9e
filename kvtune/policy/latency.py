"""What a batch does to each token's latency: the TPOT and TTFT a rendered max_num_seqs and
max_num_batched_tokens imply, from the step-time model the simulator uses (kvtune.domain.step_time), and
the largest batch that keeps them within an SLO.

The budget alone would admit every short request it has blocks for (1,752 on an H100 for the
sample logs), whatever that does to the time between tokens; these figures are what bounds it.

Steady state of a full batch of N running requests, the logged traffic's mix (caps applied):
  - every step decodes N tokens, each attending to its context; a request of prompt P and O
    output tokens decodes at a mean context of P + O/2 (the step model's n·(ctx + n/2) with n = 1);
  - the batch stays full, so the prompts of the requests that replace finished ones are prefilled
    beside the decodes: P̄/Ō prompt tokens per output token, whose attention, whatever the chunking,
    sums to P²/2 per prompt (Σ n·(ctx + n/2) over the chunks of a prompt is P²/2);
  TPOT(N) = c0 + N·(c1·(1 + P̄/Ō) + c2·(ctx̄ + E[P²]/2Ō) + c3 + c4·(ctx̄ + ½ + P̄/Ō)) + m·(1 − e^(−(N−1)/Ō))
            + k·max(0, N·(1 + P̄/Ō) − K):
  one step, the same for every token (c4: each decode reads its KV once, ctx + 1 tokens; a prompt's
  chunks read about P, counted as if prefilled in one chunk; m, the step time's `mixed_step_s`, is
  paid by the steps that prefill: while a request decodes, the other N − 1 finish, and are replaced,
  at (N − 1)/Ō per step, so with finishes counted as Poisson a share 1 − e^(−(N−1)/Ō) of its steps
  admits at least one; by every step when N is more than vLLM's largest CUDA graph; k per token
  past the step's knee K, a silicon fit's bend: the step computes about N·(1 + P̄/Ō) tokens).
A p99 prompt arriving at that batch prefills in chunks of max_num_batched_tokens less the N − 1
decodes beside it (vLLM V1 schedules decodes first, then chunks prefills into the rest of the
token budget); its TTFT is those steps, queueing and the API server excluded (`--objective`
simulates those).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from kvtune.domain.slo import Slo
from kvtune.domain.step_time import StepTimeModel, TimingSource, replays_one_graph
from kvtune.errors import KvtuneError
from kvtune.planning import Plan
from kvtune.profile.routes import Profile
from kvtune.sim.setup import plan_timing


@dataclass(frozen=True, slots=True)
class StepTime:
    """A step-time model and, in words, where it came from (the reason lines quote it)."""

    model: StepTimeModel
    source: str


@dataclass(frozen=True, slots=True)
class TrafficShape:
    """The logged traffic as the step model prices it, per output token of the capped mix."""

    decode_context_tokens: float  # mean context a decoding token attends to (P + O/2, weighted by O)
    prefill_tokens_per_output: float  # P̄ / Ō
    prefill_attention_per_output: float  # E[P²] / 2Ō
    p99_prompt_tokens: int
    requests_per_output: float = 0.0  # 1 / Ō: how many requests start per output token


@dataclass(frozen=True, slots=True)
class BatchLatency:
    """The predicted per-token latency of one batch: TPOT of a full batch, TTFT of a p99 prompt."""

    max_num_seqs: int
    max_num_batched_tokens: int
    tpot_s: float
    ttft_s: float


def plan_step_time(plan: Plan) -> StepTime | None:
    """The step time `simulate` and `recommend --objective` run the plan on (kvtune.sim.setup.plan_timing:
    the capacity file's calibrated timing, else silicon data, else the roofline for the plan's model
    on its GPU), so the bound and the simulation agree; None when none is known (no catalog GPU)."""
    measured = plan.measured
    if measured is not None and measured.timing is not None:
        origin = measured.timing.measured_against.url
        return StepTime(measured.timing.model, f"calibrated step time (`kvtune calibrate --timing` on {origin})")
    if plan.gpu_model is None:
        return None
    try:
        timing = plan_timing(plan)
    except KvtuneError:  # a GPU with no peak FLOPs on record
        return None
    gpu = plan.gpu_model
    if timing.model.source is TimingSource.SILICON:
        return StepTime(timing.model, f"{timing.detail['label']} for {gpu.name} "
                                      "(aiconfigurator-core's measured kernels, not this server: "
                                      "`kvtune calibrate URL --timing` measures it)")
    return StepTime(timing.model, f"roofline estimate for {gpu.name} × {plan.kv.tensor_parallel_size} (peak "
                                  "bandwidth and FLOPs, not measured: `kvtune calibrate URL --timing` measures it)")


def traffic_shape(profile: Profile, caps: dict[str, int]) -> TrafficShape:
    """The profile's routes mixed by their request counts, each output cut at its route's cap
    (`caps`: route → tokens); prompts and outputs independent within a route."""
    output = prompt = context = attention = requests = 0.0
    for route in profile.routes:
        o = route.output.observed
        if not o.total:
            continue
        capped = np.minimum(o.values.astype(np.float64), caps[route.route])
        weights = o.counts / o.total
        mean_o, mean_o2 = float(capped @ weights), float((capped * capped) @ weights)
        if route.prompt.total:
            p_values, p_weights = route.prompt.values.astype(np.float64), route.prompt.counts / route.prompt.total
            mean_p, mean_p2 = float(p_values @ p_weights), float((p_values * p_values) @ p_weights)
        else:
            mean_p = mean_p2 = 0.0
        n = route.requests
        requests += n
        output += n * mean_o
        prompt += n * mean_p
        context += n * (mean_p * mean_o + mean_o2 / 2)
        attention += n * mean_p2 / 2
    combined = profile.combined().prompt
    p99 = int(combined.quantile(0.99) or 0) if combined.total else 0
    if output <= 0:
        return TrafficShape(0.0, 0.0, 0.0, p99)
    return TrafficShape(context / output, prompt / output, attention / output, p99, requests / output)


def tpot_s(model: StepTimeModel, shape: TrafficShape, max_num_seqs: int) -> float:
    """Seconds per output token when `max_num_seqs` requests run at once (module docstring)."""
    # the share of a request's decode steps in which one of the other N − 1 is replaced (prefills);
    # all of them when N decodes are more than vLLM replays as one CUDA graph (module docstring)
    prefilling = -math.expm1(-(max_num_seqs - 1) * shape.requests_per_output)
    if not replays_one_graph(max_num_seqs, max_num_seqs, model.largest_graph_tokens):
        prefilling = 1.0
    tokens = max_num_seqs * (1 + shape.prefill_tokens_per_output)  # a step's decodes and its share of prefill
    return (model.c0 + max_num_seqs * _per_request_s(model, shape) + model.mixed_step_s * prefilling
            + model.past_knee_s * max(0.0, tokens - model.knee_tokens))


def ttft_s(model: StepTimeModel, shape: TrafficShape, max_num_seqs: int, max_num_batched_tokens: int) -> float:
    """Seconds to the first token of a p99 prompt that joins max_num_seqs − 1 decoding requests;
    inf when their decodes leave no room in the token budget for a chunk."""
    others = max_num_seqs - 1
    chunk = max_num_batched_tokens - others
    prompt = max(1, shape.p99_prompt_tokens)
    if chunk < 1:
        return math.inf
    steps = -(-prompt // chunk)
    decode = others * (model.c1 + model.c2 * shape.decode_context_tokens + model.c3
                       + model.c4 * (shape.decode_context_tokens + 0.5))
    read = chunk * (steps - 1) * steps // 2 + prompt  # Σ (ctx + n) over the chunks: each reads up to its end
    last = prompt - chunk * (steps - 1)
    mixed = 0 if chunk == 1 else steps - (last == 1)  # chunks of more than one token: not a uniform decode
    past_knee = (steps - 1) * max(0, others + chunk - model.knee_tokens) + max(0, others + last - model.knee_tokens)
    return (steps * (model.c0 + decode + model.c3) + mixed * model.mixed_step_s + model.c1 * prompt
            + model.c2 * prompt * prompt / 2 + model.c4 * read + model.past_knee_s * past_knee)


def batch_latency(model: StepTimeModel, shape: TrafficShape, max_num_seqs: int,
                  max_num_batched_tokens: int) -> BatchLatency:
    return BatchLatency(max_num_seqs, max_num_batched_tokens, tpot_s(model, shape, max_num_seqs),
                        ttft_s(model, shape, max_num_seqs, max_num_batched_tokens))


def most_seqs_within(slo: Slo, model: StepTimeModel, shape: TrafficShape, max_num_batched_tokens: int,
                     at_most: int) -> int:
    """The largest batch (≤ at_most) whose predicted TPOT and TTFT meet `slo`; 0 when none does.
    Both grow with the batch, so the bound is found by bisection."""
    lo, hi = 0, at_most
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if meets(slo, batch_latency(model, shape, mid, max_num_batched_tokens)):
            lo = mid
        else:
            hi = mid - 1
    return lo


def meets(slo: Slo, latency: BatchLatency) -> bool:
    if slo.tpot_ms is not None and latency.tpot_s * 1000 > slo.tpot_ms:
        return False
    return not (slo.ttft_ms is not None and latency.ttft_s * 1000 > slo.ttft_ms)


def _per_request_s(model: StepTimeModel, shape: TrafficShape) -> float:
    """What one more running request adds to every step: its decode, and its share of prefill."""
    return (model.c1 * (1 + shape.prefill_tokens_per_output)
            + model.c2 * (shape.decode_context_tokens + shape.prefill_attention_per_output) + model.c3
            + model.c4 * (shape.decode_context_tokens + 0.5 + shape.prefill_tokens_per_output))


def ms(seconds: float) -> str:
    """Milliseconds as the reason lines print them."""
    if not math.isfinite(seconds):
        return "∞ ms"
    return f"{seconds * 1000:,.2f} ms" if seconds < 1 else f"{seconds:,.2f} s"


__all__ = ["StepTime", "TrafficShape", "BatchLatency", "plan_step_time", "traffic_shape", "tpot_s", "ttft_s",
           "batch_latency", "most_seqs_within", "meets", "ms"]
