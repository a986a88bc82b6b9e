"""TensorRT-LLM's facts that kvtune relies on (`trtllm-serve`), each stated once: its server's
defaults and the scheduler policies that decide admission.

Read from TensorRT-LLM's source (`tensorrt_llm/commands/serve.py`, `llmapi/llm_args.py`,
`cpp/tensorrt_llm/batch_manager/capacityScheduler.cpp`); reference/engines.md gives the details.
It cannot be installed here, so nothing in this module was run. Its default scheduler,
GUARANTEED_NO_EVICT, reserves KV for prompt + max_tokens before it starts a request (the seeds'
policy, natively); a request without max_tokens reserves the whole max_seq_len window.
"""

from __future__ import annotations

CURRENT_VERSION = "1.2"  # the release line these defaults were read from
SERVE_COMMAND = "trtllm-serve"

# --- `trtllm-serve serve` defaults (commands/serve.py) ---------------------------------------------

MAX_BATCH_SIZE = 2_048  # --max_batch_size
MAX_NUM_TOKENS = 8_192  # --max_num_tokens
KV_CACHE_FREE_GPU_MEMORY_FRACTION = 0.9  # --kv_cache_free_gpu_memory_fraction

# --- kv_cache_config (llmapi/llm_args.py KvCacheConfig) --------------------------------------------

TOKENS_PER_BLOCK = 32
ENABLE_BLOCK_REUSE = True

# --- scheduler_config.capacity_scheduler_policy (CapacitySchedulerPolicy) -------------------------

GUARANTEED_NO_EVICT = "GUARANTEED_NO_EVICT"  # trtllm-serve's default: reserve to completion
MAX_UTILIZATION = "MAX_UTILIZATION"  # schedule for the next step, pause the last started
STATIC_BATCH = "STATIC_BATCH"
CAPACITY_SCHEDULER_POLICIES = (GUARANTEED_NO_EVICT, MAX_UTILIZATION, STATIC_BATCH)

GENERATE_PATHS: dict[str, str] = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "completions",
}

# Whether the server counts a prompt for the gateway: trtllm-serve serves /v1/models,
# /v1/completions, /v1/chat/completions, /health, /metrics and /version only
# (docs/source/commands/trtllm-serve.rst): no /tokenize

HAS_TOKENIZE = False

__all__ = [
    "HAS_TOKENIZE",
    "CURRENT_VERSION", "SERVE_COMMAND", "MAX_BATCH_SIZE", "MAX_NUM_TOKENS", "KV_CACHE_FREE_GPU_MEMORY_FRACTION",
    "TOKENS_PER_BLOCK", "ENABLE_BLOCK_REUSE", "GUARANTEED_NO_EVICT", "MAX_UTILIZATION", "STATIC_BATCH",
    "CAPACITY_SCHEDULER_POLICIES", "GENERATE_PATHS",
]
