"""Which engine's scheduling rule a simulation runs: vLLM's (the default), SGLang's, TensorRT-LLM's.

All of them share the event loop (kvtune.sim.engine), the step-time model and SimResult; a rule
only decides, each step, who runs, who is admitted and who is evicted. The engine settings
(kvtune.domain.engine_settings.EngineSettings) size every engine the same way: its KV pool holds
usable_blocks × block_size tokens, max_num_seqs is SGLang's --max-running-requests and
TensorRT-LLM's --max_batch_size, max_num_batched_tokens SGLang's --chunked-prefill-size and
TensorRT-LLM's --max_num_tokens, max_model_len SGLang's --context-length and TensorRT-LLM's
--max_seq_len. The rule objects carry the knobs that exist in one engine only.

    "vllm"            kvtune.sim.scheduler (vLLM V1; no rule object: None)
    "sglang"          SGLangRule(): the new_token_ratio estimate with SGLang's defaults
    "trtllm-gne"      TrtllmRule(): GUARANTEED_NO_EVICT, trtllm-serve's default
    "trtllm-maxutil"  TrtllmRule(MAX_UTILIZATION)

Each rule's docstring (kvtune.sim.sglang, kvtune.sim.trtllm) cites the source it follows.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from kvtune.errors import OptionError

# SGLang's environment defaults (python/sglang/srt/environ.py: SGLANG_INIT_NEW_TOKEN_RATIO 0.7,
# SGLANG_MIN_NEW_TOKEN_RATIO_FACTOR 0.14, SGLANG_NEW_TOKEN_RATIO_DECAY_STEPS 600,
# SGLANG_RETRACT_DECODE_STEPS 20, SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION 4096) and server_args
# (--schedule-conservativeness 1.0, --max-prefill-tokens 16384, --page-size 1)
SGLANG_INIT_NEW_TOKEN_RATIO = 0.7
SGLANG_MIN_NEW_TOKEN_RATIO_FACTOR = 0.14
SGLANG_NEW_TOKEN_RATIO_DECAY_STEPS = 600
SGLANG_RETRACT_DECODE_STEPS = 20
SGLANG_CLIP_MAX_NEW_TOKENS = 4096
SGLANG_MAX_PREFILL_TOKENS = 16384
TRTLLM_TOKENS_PER_BLOCK = 32  # llmapi/llm_args.py KvCacheConfig.tokens_per_block


@dataclass(frozen=True, slots=True)
class SGLangRule:
    """SGLang's scheduler knobs: --schedule-conservativeness, the SGLANG_* ratio and clip
    environment, --page-size and --max-prefill-tokens (defaults as SGLang ships them)."""

    schedule_conservativeness: float = 1.0
    init_new_token_ratio: float = SGLANG_INIT_NEW_TOKEN_RATIO
    min_new_token_ratio_factor: float = SGLANG_MIN_NEW_TOKEN_RATIO_FACTOR
    new_token_ratio_decay_steps: int = SGLANG_NEW_TOKEN_RATIO_DECAY_STEPS
    clip_max_new_tokens: int = SGLANG_CLIP_MAX_NEW_TOKENS
    retract_decode_steps: int = SGLANG_RETRACT_DECODE_STEPS
    page_size: int = 1
    max_prefill_tokens: int = SGLANG_MAX_PREFILL_TOKENS

    def __post_init__(self) -> None:
        for name in ("schedule_conservativeness", "init_new_token_ratio", "min_new_token_ratio_factor"):
            if not getattr(self, name) > 0:
                raise OptionError(f"must be positive, got {getattr(self, name)}", field=name)
        for name in ("new_token_ratio_decay_steps", "clip_max_new_tokens", "page_size", "max_prefill_tokens"):
            if getattr(self, name) < 1:
                raise OptionError(f"must be at least 1, got {getattr(self, name)}", field=name)
        if self.retract_decode_steps < 0:
            raise OptionError(f"must be ≥ 0, got {self.retract_decode_steps}", field="retract_decode_steps")

    @property
    def name(self) -> str:
        return "sglang"

    @property
    def init_ratio(self) -> float:
        """NewTokenRatioTracker.from_server_args: min(SGLANG_INIT_NEW_TOKEN_RATIO × conservativeness, 1)."""
        return min(self.init_new_token_ratio * self.schedule_conservativeness, 1.0)

    @property
    def min_ratio(self) -> float:
        return min(self.init_ratio * self.min_new_token_ratio_factor, 1.0)

    @property
    def ratio_decay(self) -> float:
        return (self.init_ratio - self.min_ratio) / self.new_token_ratio_decay_steps

    @classmethod
    def as_rendered(cls, largest_cap: int | None) -> SGLangRule:
        """The environment kvtune renders for SGLang under the guaranteed policy
        (kvtune.policy.engine_rules.sglang_settings): the ratio starts at 1 and never decays
        (SGLANG_INIT_NEW_TOKEN_RATIO=1, SGLANG_MIN_NEW_TOKEN_RATIO_FACTOR=1) and
        SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION is the largest route cap (None: SGLang's 4096)."""
        clip = SGLANG_CLIP_MAX_NEW_TOKENS if largest_cap is None else max(largest_cap, 1)
        return cls(init_new_token_ratio=1.0, min_new_token_ratio_factor=1.0, clip_max_new_tokens=clip)


class CapacityPolicy(enum.Enum):
    """TensorRT-LLM's scheduler_config.capacity_scheduler_policy values the simulator follows."""

    GUARANTEED_NO_EVICT = "GUARANTEED_NO_EVICT"
    MAX_UTILIZATION = "MAX_UTILIZATION"


@dataclass(frozen=True, slots=True)
class TrtllmRule:
    """TensorRT-LLM's capacity policy, kv_cache_config.tokens_per_block and chunked context."""

    capacity_policy: CapacityPolicy = CapacityPolicy.GUARANTEED_NO_EVICT
    tokens_per_block: int = TRTLLM_TOKENS_PER_BLOCK
    enable_chunked_context: bool = True

    def __post_init__(self) -> None:
        if self.tokens_per_block < 1:
            raise OptionError(f"must be at least 1, got {self.tokens_per_block}", field="tokens_per_block")

    @property
    def name(self) -> str:
        return "trtllm-gne" if self.capacity_policy is CapacityPolicy.GUARANTEED_NO_EVICT else "trtllm-maxutil"


EngineRule = SGLangRule | TrtllmRule | None  # None: vLLM

ENGINE_RULES: dict[str, EngineRule] = {
    "vllm": None,
    "sglang": SGLangRule(),
    "trtllm-gne": TrtllmRule(),
    "trtllm-maxutil": TrtllmRule(CapacityPolicy.MAX_UTILIZATION),
}
ENGINE_NAMES = tuple(ENGINE_RULES)


def engine_rule(name: str) -> EngineRule:
    """The rule simulated for an engine name ("vllm", "sglang", "trtllm-gne", "trtllm-maxutil")."""
    try:
        return ENGINE_RULES[name]
    except KeyError:
        raise OptionError(f"unknown engine {name!r}; choose one of {', '.join(ENGINE_NAMES)}",
                          field="engine") from None


def rule_name(rule: EngineRule) -> str:
    return "vllm" if rule is None else rule.name


__all__ = ["SGLangRule", "TrtllmRule", "CapacityPolicy", "EngineRule", "ENGINE_RULES", "ENGINE_NAMES",
           "engine_rule", "rule_name"]
