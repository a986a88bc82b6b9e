"""Whether a deployment can run the logged traffic at all, per engine: one verdict that
`recommend`, `check` and `capacity` share, so advice that cannot work is refused, not written.

A deployment is infeasible when
  - the engine would refuse to start, or silently serve a shorter context than the one rendered:
    one request at max_model_len does not fit the KV pool (vLLM 0.32
    vllm/v1/core/kv_cache_utils.py `check_enough_kv_cache_memory` raises at startup unless
    cdiv(max_model_len, block_size) blocks fit the pool less its null block; SGLang caps each
    request at min(context_len, max_total_num_tokens) − 1 tokens (tp_worker.py `max_req_len`);
    TensorRT-LLM lowers max_seq_len to the pool's tokens, "Adjusted max_seq_len to N"),
  - the budget admits no logged request (the smallest logged reservation is above it), or
  - the pool is smaller than the budget the gateway admits to.

Pure: plain numbers in, a frozen `Verdict` (kvtune.domain.feasibility) out. The pool is whichever the caller holds (the
recommendation's, or one recomputed from deployed flags).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvtune.capacity.plan import Capacity
from kvtune.capacity.reservation import reserved_blocks
from kvtune.domain.feasibility import Reason, Verdict
from kvtune.engines import ENGINE_TITLES

# what each engine does with a max_model_len one request cannot fill
ENGINE_REFUSES = "engine-refuses-start"  # vLLM
ENGINE_SHORTENS = "engine-shortens-context"  # SGLang, TensorRT-LLM
BUDGET_ADMITS_NOTHING = "budget-admits-nothing"
POOL_BELOW_BUDGET = "pool-below-budget"
REQUEST_DOES_NOT_FIT = "request-does-not-fit"  # `kvtune capacity`'s asked request shapes
SLO_UNMET = "slo-unmet"  # `recommend --slo`: even one request alone misses it (kvtune.policy.latency)
CODES = (ENGINE_REFUSES, ENGINE_SHORTENS, BUDGET_ADMITS_NOTHING, POOL_BELOW_BUDGET, REQUEST_DOES_NOT_FIT, SLO_UNMET)


def longest_held_tokens(engine: str, pool_blocks: int, block_size: int) -> int:
    """The longest max_model_len the engine serves as given from a pool of `pool_blocks`.

    vLLM plans the startup check against the blocks less the null block BlockPool holds back
    (kv_cache_utils.py `check_enough_kv_cache_memory`); SGLang's and TensorRT-LLM's limit is
    the pool's tokens (SGLang then serves one token less: max_req_len = tokens − 1)."""
    if engine == "vllm":
        return max(0, pool_blocks - 1) * block_size
    return pool_blocks * block_size


def _engine_reason(engine: str, pool_blocks: int, block_size: int, max_model_len: int) -> Reason | None:
    held = longest_held_tokens(engine, pool_blocks, block_size)
    if max_model_len <= held:
        return None
    need = reserved_blocks(max_model_len, 0, block_size)
    if engine == "vllm":
        return Reason(ENGINE_REFUSES,
                      f"vLLM would refuse to start: one request at max_model_len {max_model_len:,} needs {need:,} "
                      f"blocks of {block_size}, the pool has {pool_blocks:,} ({max(0, pool_blocks - 1):,} usable "
                      f"beside the null block), so at most {held:,} tokens")
    said = {"sglang": f"SGLang starts but serves at most {held - 1:,} tokens per request "
                      f"(min(--context-length, pool tokens) − 1), not --context-length {max_model_len:,}",
            "trtllm": f"TensorRT-LLM starts but lowers --max_seq_len {max_model_len:,} to the pool's {held:,} tokens "
                      "(\"Adjusted max_seq_len\")"}
    who = said.get(engine, ENGINE_TITLES.get(engine, engine))
    return Reason(ENGINE_SHORTENS, f"{who}: the pool of {pool_blocks:,} blocks × {block_size} holds no request "
                                   f"of {max_model_len:,} tokens")


def verdict(engine: str, *, pool_blocks: int, block_size: int, max_model_len: int, budget_blocks: int | None = None,
            smallest_reservation_blocks: int | None = None, longest_request_tokens: int | None = None,
            fix: str | None = None) -> Verdict:
    """Every condition checked against one pool. `budget_blocks` and `smallest_reservation_blocks`
    are the gateway's budget and the smallest reservation of the logged mix (None: not checked,
    as for `kvtune capacity`, which has no traffic)."""
    reasons: list[Reason] = []
    engine_reason = _engine_reason(engine, pool_blocks, block_size, max_model_len)
    if engine_reason is not None:
        reasons.append(engine_reason)
    if budget_blocks is not None and smallest_reservation_blocks is not None \
            and smallest_reservation_blocks > budget_blocks:
        reasons.append(Reason(BUDGET_ADMITS_NOTHING,
                              f"the budget of {budget_blocks:,} blocks admits no logged request: the smallest "
                              f"reserves {smallest_reservation_blocks:,} blocks (prompt + its route's cap)"))
    usable = max(0, pool_blocks - 1)
    if budget_blocks is not None and budget_blocks > usable:
        reasons.append(Reason(POOL_BELOW_BUDGET,
                              f"the pool has {usable:,} usable blocks, below the {budget_blocks:,}-block budget the "
                              "gateway admits to: the engine preempts what the gateway promised"))
    return Verdict(engine, pool_blocks, block_size, max_model_len, longest_held_tokens(engine, pool_blocks, block_size),
                   budget_blocks, smallest_reservation_blocks, longest_request_tokens, tuple(reasons),
                   None if not reasons else fix)


def capacity_verdict(engine: str, capacity: Capacity) -> Verdict:
    """`kvtune capacity`'s verdict: one request at its max_model_len fits the pool (the engine starts
    and serves it), and so does one of each asked request shape."""
    v = verdict(engine, pool_blocks=capacity.num_blocks, block_size=capacity.block_size,
                max_model_len=capacity.max_model_len)
    shapes = tuple(Reason(REQUEST_DOES_NOT_FIT, f"a request of prompt {r.prompt_tokens:,} + max_tokens "
                                                f"{r.max_tokens:,}: {r.note}")
                   for r in capacity.requests if r.max_concurrent < 1)
    return dataclasses.replace(v, reasons=v.reasons + shapes)


@dataclass(frozen=True, slots=True)
class Remedy:
    """One change that was tried: the option a user would pass and whether the deployment then fits."""

    option: str  # "--tp 4", "--kv-cache-dtype fp8", "--max-model-len 40000"
    fits: bool
    pool_blocks: int | None = None  # the pool it would give (None: not estimated)
    note: str = field(default="")


def fix_line(remedies: Sequence[Remedy], *, fallback: str) -> str:
    """What would fix it, as one line: each tried change that fits, in the order tried, else `fallback`."""
    working = [r for r in remedies if r.fits]
    if not working:
        return fallback
    parts = [r.option + (f" (pool {r.pool_blocks:,} blocks)" if r.pool_blocks is not None else "")
             + (f" {r.note}" if r.note else "") for r in working]
    return "fits with " + "; or ".join(parts)


def max_model_len_remedy(v: Verdict, given: int | None) -> Remedy | None:
    """A max_model_len the pool holds, when the user gave a longer one and the shorter one still holds
    the longest logged request (without --max-model-len, recommend renders that length itself)."""
    fitting = v.longest_held_tokens // v.block_size * v.block_size
    if given is None or fitting < 1 or fitting < (v.longest_request_tokens or 0):
        return None
    return Remedy(f"--max-model-len {fitting}", True)


def fallback_fix(v: Verdict) -> str:
    """What to change when no tried change fits: the pool the traffic needs (a missed SLO: the
    verdict's own fix, which names the step time and the objective one request meets)."""
    if v.fix is not None and all(r.code == SLO_UNMET for r in v.reasons):
        return v.fix
    if v.longest_request_tokens is not None and v.longest_request_tokens > v.longest_held_tokens:
        return (f"needs a KV pool that holds the longest logged prompt + cap ({v.longest_request_tokens:,} tokens, "
                f"the pool holds {v.longest_held_tokens:,}): more GPUs (--tp), a larger GPU or fp8 KV "
                "(--kv-cache-dtype fp8)")
    return "needs a larger KV pool: more GPUs (--tp), a larger GPU or fp8 KV (--kv-cache-dtype fp8)"


__all__ = ["Remedy", "verdict", "capacity_verdict", "fix_line", "longest_held_tokens",
           "max_model_len_remedy", "fallback_fix", "CODES", "ENGINE_REFUSES", "ENGINE_SHORTENS",
           "BUDGET_ADMITS_NOTHING", "POOL_BELOW_BUDGET", "REQUEST_DOES_NOT_FIT", "SLO_UNMET"]
