"""The rules behind the settings only SGLang or TensorRT-LLM have, and the engine-specific reading
of the shared ones (the output backstop, the pinned KV pool). Pure functions returning Decisions,
as kvtune.policy.rules; kvtune.policy.recommend calls the engine's `settings` function.

SGLang charges each running request min(remaining, CLIP) × new_token_ratio and retracts when it
guessed short (kvtune.engines.sglang); TensorRT-LLM's GUARANTEED_NO_EVICT reserves prompt +
max_tokens (kvtune.engines.trtllm). Under the guaranteed policy both are set to reserve exactly
what the gateway reserves, so the engine never evicts what the gateway admitted; under a policy
that bets on the output distribution they are set to bet the same way.
"""

from __future__ import annotations

from kvtune.domain.admission_policy import AdmissionPolicy, PolicyKind
from kvtune.domain.recommendation import Decision
from kvtune.engines import sglang, trtllm
from kvtune.errors import OptionError

# kvtune's --kv-cache-dtype names (vLLM's) -> each engine's spelling of the same cache layout
SGLANG_KV_CACHE_DTYPES = {"auto": "auto", "fp8": "fp8_e4m3", "fp8_e4m3": "fp8_e4m3", "fp8_e5m2": "fp8_e5m2",
                          "bfloat16": "bfloat16", "float16": "float16", "half": "float16"}
TRTLLM_KV_CACHE_DTYPES = {"auto": "auto", "fp8": "fp8", "fp8_e4m3": "fp8", "nvfp4": "nvfp4"}


def engine_kv_cache_dtype(engine: str, decision: Decision) -> Decision:
    """The cache dtype in the engine's own spelling; a layout the engine has no name for is an error."""
    table = {"sglang": SGLANG_KV_CACHE_DTYPES, "trtllm": TRTLLM_KV_CACHE_DTYPES}.get(engine)
    if table is None:
        return decision
    name = str(decision.value)
    if name not in table:
        raise OptionError(f"{engine} has no KV cache dtype for {name!r} (it has: {', '.join(sorted(set(table)))})",
                          field="kv_cache_dtype")
    spelled = table[name]
    reason = decision.reason if spelled == name else f"{decision.reason} ({engine} spells {name} {spelled!r})"
    return Decision(spelled, decision.rule, reason)


def kv_cache_tokens(engine: str, tokens: int, source: str) -> Decision:
    """The KV pool pinned in tokens: both engines size it as the smaller of this and what their
    memory fraction leaves, so the pool is never larger than the one the budget was computed from."""
    flag = "--max-total-tokens" if engine == "sglang" else "kv_cache_config.max_tokens"
    basis = "measured" if source != "estimate" else "estimated"
    return Decision(tokens, "pool-pinned",
                    f"{flag} caps the pool at the {tokens:,} tokens the block budget was computed from ({basis}); "
                    "the engine takes the smaller of it and what its memory fraction leaves")


def sglang_settings(*, admission: AdmissionPolicy, largest_cap: int, max_num_seqs: int) -> dict[str, Decision | None]:
    """The SGLang server's queue, its estimate's environment and its conservativeness."""
    pinned = admission.kind is PolicyKind.GUARANTEED
    clip = Decision(max(largest_cap, 1), "clip-at-largest-cap",
                    f"SGLang counts at most {sglang.ENV_CLIP_MAX_NEW_TOKENS_ESTIMATION} tokens of a request's "
                    f"remaining output (default {sglang.CLIP_MAX_NEW_TOKENS_ESTIMATION:,}); at the largest route cap "
                    f"{largest_cap} no route's charge is clipped short")
    queue = Decision(max_num_seqs, "queue-holds-gateway-admits",
                     f"the gateway admits at most {max_num_seqs} requests at once, so SGLang's queue never fills "
                     "(a full one answers 503 without Retry-After, which clients cannot pace on)")
    conservativeness = Decision(sglang.SCHEDULE_CONSERVATIVENESS, "conservativeness-neutral",
                                "the ratio's start is INIT × conservativeness; the environment sets the ratio itself")
    if pinned:
        init = Decision(1.0, "ratio-pinned",
                        "the estimate starts at the full remaining output: SGLang charges each running request what "
                        "the guaranteed gateway reserved for it")
        floor = Decision(1.0, "ratio-pinned",
                         "the estimate never decays below its start, so SGLang never admits on a guess that a "
                         "later step has to retract")
    else:
        init = Decision(sglang.INIT_NEW_TOKEN_RATIO, "ratio-default",
                        f"the {admission.name} gateway bets on the output distribution; SGLang's own estimate "
                        "(start 0.7) bets the same way and retracts when it loses")
        floor = Decision(sglang.MIN_NEW_TOKEN_RATIO_FACTOR, "ratio-default",
                         "SGLang's default decay (to 0.14 × the start over 600 steps) under a betting gateway")
    return {"init_new_token_ratio": init, "min_new_token_ratio_factor": floor,
            "clip_max_new_tokens_estimation": clip, "engine_max_queued_requests": queue,
            "schedule_conservativeness": conservativeness}


def sglang_backstop(cap: int) -> Decision:
    return Decision(cap, "backstop-largest-route-cap",
                    f"{sglang.ENV_MAX_NEW_TOKENS_LIMIT} is SGLang's server-wide hard cap on output; the largest "
                    f"route cap {cap} never clamps a route below its own cap")


def trtllm_settings(*, admission: AdmissionPolicy) -> dict[str, Decision | None]:
    """TensorRT-LLM's capacity scheduler policy for the gateway's admission policy."""
    if admission.kind is PolicyKind.GUARANTEED:
        policy = Decision(trtllm.GUARANTEED_NO_EVICT, "no-evict-reserves-cap",
                          "reserves prompt + max_tokens before a request starts, as the guaranteed gateway does; "
                          "with the route cap written into every request nothing is ever evicted")
    else:
        policy = Decision(trtllm.MAX_UTILIZATION, "max-utilization-bets",
                          f"the {admission.name} gateway admits on the output distribution; GUARANTEED_NO_EVICT would "
                          "hold each request's worst case back again, MAX_UTILIZATION schedules for the next step "
                          "and pauses the last started request when KV runs out")
    return {"capacity_scheduler_policy": policy}


def trtllm_backstop(cap: int) -> Decision:
    return Decision(cap, "backstop-largest-route-cap",
                    "TensorRT-LLM has no server-wide output cap: the gateway's catch-all route caps other requests "
                    f"at the largest route cap {cap}, and --max_seq_len bounds the rest")


__all__ = ["SGLANG_KV_CACHE_DTYPES", "TRTLLM_KV_CACHE_DTYPES", "engine_kv_cache_dtype", "kv_cache_tokens",
           "sglang_settings", "sglang_backstop", "trtllm_settings", "trtllm_backstop"]
