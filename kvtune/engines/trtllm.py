"""TensorRT-LLM's facts that kvtune relies on (`trtllm-serve`), each stated once: its server's
defaults and the scheduler policies that decide admission.

Read from TensorRT-LLM's source (`tensorrt_llm/commands/serve.py`, `llmapi/llm_args.py`,
`cpp/tensorrt_llm/batch_manager/capacityScheduler.cpp`); reference/engines.md gives the details.
It cannot be installed here, so nothing in this module was run. Its default scheduler,
GUARANTEED_NO_EVICT, reserves KV for prompt + max_tokens before it starts a request (the seeds'
policy, natively); a request without max_tokens reserves the whole max_seq_len window.
"""

from __future__ import annotations

import re

CURRENT_VERSION = "1.2"  # the release line these defaults were read from
SERVE_COMMAND = "trtllm-serve"

# --- `trtllm-serve serve` defaults (commands/serve.py) ---------------------------------------------

MAX_BATCH_SIZE = 2_048  # --max_batch_size
MAX_NUM_TOKENS = 8_192  # --max_num_tokens
KV_CACHE_FREE_GPU_MEMORY_FRACTION = 0.9  # --kv_cache_free_gpu_memory_fraction

# --- kv_cache_config (llmapi/llm_args.py KvCacheConfig) --------------------------------------------

TOKENS_PER_BLOCK = 32
ENABLE_BLOCK_REUSE = True

# --- the KV pool of the PyTorch backend (`trtllm-serve`'s default) ---------------------------------
#
# Read from stored copies of NVIDIA/TensorRT-LLM (no line numbers there): _torch/pyexecutor/_util.py
# at 0004396720054fd8e205cbf616f21f0b57c6b412, _torch/pyexecutor/resource_manager.py (the index's
# d2a5560abdadfbdf496ce057696103e0509a71ed) and cpp/tensorrt_llm/batch_manager/kvCacheManager.cpp at
# 002ba6a7cc5eb28f180d45d4a91142d9d927a606:
#   KvCacheCreator.configure_kv_cache_capacity runs dummy requests totalling max_num_tokens, then
#     peak = torch peak (weights + activations + the estimation's small KV cache)
#            + memory outside torch (NCCL, CUDA graphs, context)
#     available_kv_mem = (total − peak + estimation KV bytes) × free_gpu_memory_fraction
#                                                                   (`_cal_max_memory`)
#     then min(bytes for kv_cache_config.max_tokens) and min(max_gpu_total_bytes) when given
#   KVCacheManager.calculate_max_num_blocks: blocks = int(max_tokens // tokens_per_block)

ESTIMATION_MAX_NUM_TOKENS = MAX_NUM_TOKENS  # the dummy requests fill max_num_tokens

# --- startup-log lines that state the KV capacity ------------------------------------------------
#
#   [TensorRT-LLM][INFO] Number of tokens per block: 32.
#   [TensorRT-LLM][INFO] [MemUsageChange] Allocated 26.91 GiB for max tokens in paged KV cache (220480).
#       cpp/tensorrt_llm/batch_manager/kvCacheManager.cpp `KVCacheManager::allocatePools`:
#       TLLM_LOG_INFO("Number of tokens per block: %d.", ...) then
#       TLLM_LOG_INFO("[MemUsageChange] Allocated %0.2f GiB for max tokens in paged KV cache (%d).",
#                     cacheSizeBytes / 2^30, numPrimaryBlocks × tokensPerBlock)
#       The PyTorch backend logs it twice: first for the small cache of the estimation run, then
#       for the real one; the last wins.
#   [TRT-LLM] [I] max_seq_len=8224, max_num_requests=64, max_num_tokens=8192, max_batch_size=64
#       tensorrt_llm/_torch/pyexecutor/_util.py `create_py_executor_instance` (logger.info f-string;
#       older releases end at max_num_tokens)

TOKENS_PER_BLOCK_LINE = re.compile(r"Number of tokens per block: (?P<n>\d+)\.")
KV_ALLOCATED_LINE = re.compile(
    r"\[MemUsageChange\] Allocated (?P<gib>[\d.]+) GiB for max tokens in paged KV cache \((?P<tokens>\d+)\)"
)
EXECUTOR_LIMITS_LINE = re.compile(
    r"max_seq_len=(?P<max_seq_len>\d+), max_num_requests=(?P<max_num_requests>\d+), "
    r"max_num_tokens=(?P<max_num_tokens>\d+)(?:, max_batch_size=(?P<max_batch_size>\d+))?"
)

# --- GET /metrics: a JSON list of iteration stats, emptied as it is read, and only filled with
# `enable_iter_perf_stats: true`; each entry's "kvCacheStats" has maxNumBlocks, freeNumBlocks,
# usedNumBlocks, tokensPerBlock, allocTotalBlocks, allocNewBlocks, reusedBlocks, missedBlocks,
# cacheHitRate (tests/unittest/llmapi/apps/_test_openai_metrics.py asserts these keys). There is
# no endpoint that states the capacity before a request has run.

METRICS_PATH = "/metrics"
KV_CACHE_STATS = "kvCacheStats"
MAX_NUM_BLOCKS_FIELD = "maxNumBlocks"
TOKENS_PER_BLOCK_FIELD = "tokensPerBlock"

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
    "ESTIMATION_MAX_NUM_TOKENS", "TOKENS_PER_BLOCK_LINE", "KV_ALLOCATED_LINE", "EXECUTOR_LIMITS_LINE",
    "METRICS_PATH", "KV_CACHE_STATS", "MAX_NUM_BLOCKS_FIELD", "TOKENS_PER_BLOCK_FIELD", "HAS_TOKENIZE",
    "CURRENT_VERSION", "SERVE_COMMAND", "MAX_BATCH_SIZE", "MAX_NUM_TOKENS", "KV_CACHE_FREE_GPU_MEMORY_FRACTION",
    "TOKENS_PER_BLOCK", "ENABLE_BLOCK_REUSE", "GUARANTEED_NO_EVICT", "MAX_UTILIZATION", "STATIC_BATCH",
    "CAPACITY_SCHEDULER_POLICIES", "GENERATE_PATHS",
]
