"""SGLang's facts that kvtune relies on, each stated once: its server's defaults, the environment
variables that steer its admission estimate, and its overload behaviour.

Values are SGLang 0.5.23's (its PyPI wheel), read from source; reference/engines.md gives the
file of each. SGLang does not reserve KV for a request's output: it *estimates* it
(`PrefillAdder.add_one_req`, `managers/schedule_policy.py`), charging each running request
min(remaining output, CLIP) × new_token_ratio, and retracts (recomputes) requests when the
estimate was wrong.
"""

from __future__ import annotations

import re

from kvtune.hardware import MiB

CURRENT_VERSION = "0.5.23"  # the release these defaults were read from
LAUNCH_MODULE = "sglang.launch_server"

# --- server defaults (srt/server_args.py, arg_groups/fields/schedule.py) ---------------------------

PAGE_SIZE = 1  # --page-size: tokens per KV page (arg_groups/overrides.py `_page_size_default`; some
#                attention backends raise it: trtllm_mha 64, fa4 on SM100 128, MUSA 64)
SCHEDULE_CONSERVATIVENESS = 1.0  # --schedule-conservativeness
MAX_PREFILL_TOKENS = 16_384  # --max-prefill-tokens
RETRACTION_POLICY = "length"  # --retraction-policy

# --- the memory budget (arg_groups/memory_hook.py `handle_gpu_memory_settings`) -----------------
#
# GPU memory is what nvidia-smi reports, in MiB (utils/common.py `get_device_memory_capacity`). It
# picks chunked_prefill_size and the decode CUDA-graph max batch by tier, then derives
#   mem_fraction_static = round((gpu_mem − reserved_mem) / gpu_mem, 3)
#   reserved_mem (MiB)  = 512 + 1.5 × max(chunked_prefill_size, 2048) + tp × pp / 8 × 1024
#                         + 2 × decode max_bs + 8 × (prefill capture sizes)   [graph reserve]
#                         and at least 10 GiB on GPUs above 60 GiB
# (non-MLA, no DP attention, no DeepEP, no post-capture KV sizing: SGLang's defaults on CUDA).

# (GPU memory below this many MiB, chunked_prefill_size, decode max_bs at tp < 4, at tp ≥ 4)
MEMORY_TIERS: tuple[tuple[float, int, int, int], ...] = (
    (20 * 1024, 2_048, 8, 8),  # T4, 4080
    (35 * 1024, 4_096, 48, 160),  # A10, 4090, 5090
    (60 * 1024, 4_096, 32, 160),  # A100 40GB, L40
    (90 * 1024, 8_192, 256, 512),  # H100, A100 80GB
    (160 * 1024, 8_192, 256, 512),  # H20, H200
    (float("inf"), 16_384, 512, 512),  # B200, MI300
)
RESERVED_BASE_MIB = 512  # "constant meta data (e.g., from attention backend)"
RESERVED_MIB_PER_ACTIVATION_TOKEN = 1.5
MIN_ACTIVATION_TOKENS = 2_048
RESERVED_MIB_PER_DECODE_GRAPH_BS = 2  # reserve_for_graph_mb: 2 MiB per decode max_bs
RESERVED_MIB_PER_PREFILL_GRAPH = 8  # reserve_for_graph_mb: 8 MiB per prefill capture size (non-MLA)
RESERVED_MIB_MLA_PREFILL_GRAPHS = 1.5 * 1024  # reserve_for_graph_mb: MLA backends instead
RESERVED_FLOOR_MIB = 10 * 1024  # on GPUs above RESERVED_FLOOR_ABOVE_MIB
RESERVED_FLOOR_ABOVE_MIB = 60 * 1024
MEM_FRACTION_WITHOUT_GPU = 0.95  # when the GPU's memory is unknown


def memory_tier(gpu_memory_bytes: int, tp: int = 1) -> tuple[int, int]:
    """(chunked_prefill_size, decode CUDA-graph max batch) SGLang picks for this GPU size."""
    mib = gpu_memory_bytes / MiB
    for below, chunk, bs_small_tp, bs_large_tp in MEMORY_TIERS:
        if mib < below:
            return chunk, bs_small_tp if tp < 4 else bs_large_tp
    raise AssertionError("the last tier is unbounded")


def prefill_capture_sizes(max_bs: int) -> list[int]:
    """The token counts SGLang captures prefill CUDA graphs for, up to max_bs
    (arg_groups/cuda_graph_hook.py `generate_prefill_cuda_graph_batch_sizes`)."""
    sizes = (list(range(4, 33, 4)) + list(range(48, 257, 16)) + list(range(288, 513, 32))
             + list(range(576, 1025, 64)) + list(range(1280, 4097, 256)) + list(range(4608, max_bs + 1, 512)))
    return [s for s in sizes if s <= max_bs]


def default_mem_fraction_static(gpu_memory_bytes: int | None, *, tp: int = 1, pp: int = 1,
                                chunked_prefill_size: int | None = None, mla: bool = False,
                                max_running_requests: int | None = None) -> float:
    """SGLang's derived --mem-fraction-static for this GPU (`handle_gpu_memory_settings`)."""
    if gpu_memory_bytes is None:
        return MEM_FRACTION_WITHOUT_GPU
    gpu_mib = gpu_memory_bytes / MiB
    tier_chunk, decode_bs = memory_tier(gpu_memory_bytes, tp)
    chunk = tier_chunk if chunked_prefill_size is None else chunked_prefill_size
    if max_running_requests is not None:
        decode_bs = min(decode_bs, max_running_requests)
    activation_tokens = max(chunk if chunk > 0 else MAX_PREFILL_TOKENS, MIN_ACTIVATION_TOKENS)
    reserved = RESERVED_BASE_MIB + activation_tokens * RESERVED_MIB_PER_ACTIVATION_TOKEN
    reserved += tp * pp / 8 * 1024
    reserved += decode_bs * RESERVED_MIB_PER_DECODE_GRAPH_BS
    if mla:
        reserved += RESERVED_MIB_MLA_PREFILL_GRAPHS
    elif chunk > 0:
        reserved += len(prefill_capture_sizes(chunk)) * RESERVED_MIB_PER_PREFILL_GRAPH
    if gpu_mib > RESERVED_FLOOR_ABOVE_MIB:
        reserved = max(reserved, RESERVED_FLOOR_MIB)
    return round((gpu_mib - reserved) / gpu_mib, 3)


# --- the KV pool (mem_cache/kv_cache_configurator.py, model_executor/pool_configurator.py) ---------
#
#   pool bytes = free memory after loading − free memory before loading × (1 − mem_fraction_static)
#   max_total_num_tokens = pool // cell size, floored to the page size, then min(--max-total-tokens)
#   max_running_requests = min(clamp(tokens / context_len × 512, 2048, 4096), tokens // 2)
#                          (or min(--max-running-requests / dp, tokens // 2))

MAX_RUNNING_REQUESTS_PER_CONTEXT = 512
MAX_RUNNING_REQUESTS_FLOOR = 2_048
MAX_RUNNING_REQUESTS_CEILING = 4_096


def default_max_running_requests(max_total_num_tokens: int, context_len: int, given: int | None = None,
                                 dp: int = 1) -> int:
    """`KVCacheConfigurator.resolve_max_num_reqs`: the running-request limit for a pool."""
    if given is not None:
        return min(max(1, given // dp), max_total_num_tokens // 2)
    estimated = int(max_total_num_tokens / max(1, context_len) * MAX_RUNNING_REQUESTS_PER_CONTEXT)
    estimated = max(min(estimated, MAX_RUNNING_REQUESTS_CEILING), MAX_RUNNING_REQUESTS_FLOOR)
    return min(estimated, max_total_num_tokens // 2)


# when neither the flag nor the pool is known: the lower clamp
DEFAULT_MAX_RUNNING_REQUESTS = MAX_RUNNING_REQUESTS_FLOOR


def default_chunked_prefill_size(gpu_memory_bytes: int | None) -> int:
    """--chunked-prefill-size when not given (memory_hook.py:90-177, by the GPU's memory in MiB):
    2048 under 20 GiB, 4096 under 60 GiB, 8192 under 160 GiB, 16384 above; 4096 unknown."""
    return memory_tier(gpu_memory_bytes)[0] if gpu_memory_bytes else 4_096


# --- the admission estimate (scheduler_components/new_token_ratio_tracker.py) ---------------------
#
# new_token_ratio starts at min(INIT_NEW_TOKEN_RATIO × conservativeness, 1), decays linearly per
# decode step to start × MIN_NEW_TOKEN_RATIO_FACTOR over NEW_TOKEN_RATIO_DECAY_STEPS steps, and is
# reset upward after a retraction. A request's remaining output counts at most CLIP tokens.

INIT_NEW_TOKEN_RATIO = 0.7
MIN_NEW_TOKEN_RATIO_FACTOR = 0.14
NEW_TOKEN_RATIO_DECAY_STEPS = 600
CLIP_MAX_NEW_TOKENS_ESTIMATION = 4_096

# environment variables read at startup (srt/environ.py)
ENV_INIT_NEW_TOKEN_RATIO = "SGLANG_INIT_NEW_TOKEN_RATIO"
ENV_MIN_NEW_TOKEN_RATIO_FACTOR = "SGLANG_MIN_NEW_TOKEN_RATIO_FACTOR"
ENV_NEW_TOKEN_RATIO_DECAY_STEPS = "SGLANG_NEW_TOKEN_RATIO_DECAY_STEPS"
ENV_CLIP_MAX_NEW_TOKENS_ESTIMATION = "SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION"
# the server-wide hard cap on a request's output (unset: none; `init_req_max_new_tokens`)
ENV_MAX_NEW_TOKENS_LIMIT = "SGLANG_MAX_NEW_TOKENS_LIMIT"

# --- startup-log lines that state the KV capacity ------------------------------------------------
#
# Each line comes after the logging prefix `[%(asctime)s TP0] ` (utils/common.py `configure_logger`;
# the rank tags from managers/scheduler.py, e.g. " DP0 TP0", " PP1 TP0").
#
#   max_total_num_tokens=413556, chunked_prefill_size=8192, max_prefill_tokens=16384,
#   max_running_requests=2048, context_len=131072, available_gpu_mem=13.79 GB
#       managers/scheduler.py:1268-1276 (f-string; `available_cpu_mem` on CPU), tp_rank 0 of each
#       scheduler, after the pool is sized: the scheduler's own figures
#   KV Cache is allocated. dtype: torch.bfloat16, #tokens: 413556, K size: 25.24 GB, V size: 25.24 GB
#       mem_cache/memory_pool.py:2087-2098 `_finalize_allocation_log` (`KV size: X GB` for pools
#       that report one size; a label such as "SWA KV Cache" may precede it; with post-capture KV
#       sizing it says "VA upper bound" instead of "is allocated", and the real count follows:)
#   Post-capture KV sizing: KV cache allocated. dtype: torch.bfloat16, #tokens: N, KV size: X GB, ...
#       model_executor/model_runner_components/kv_pool_runtime.py:194-201
# GB there is 2^30 bytes (memory_pool.py:116 `GB = 1024 * 1024 * 1024`).

# Earlier releases print fewer fields (`…, max_running_requests=50, context_len=163840` without
# available_gpu_mem in early 2025), so the fields after the first are read by name. The line starts
# right after the prefix, which keeps out `(max_total_num_tokens=…` in other messages.
SCHEDULER_CAPACITY_LINE = re.compile(r"(?:^|\] )max_total_num_tokens=(?P<tokens>\d+)(?=,|\s*$)")
SCHEDULER_FIELD = re.compile(
    r"\b(?P<name>chunked_prefill_size|max_prefill_tokens|max_running_requests|context_len)=(?P<value>-?\d+|None)(?=,|\s*$)"
)
# "dtype: …, " appeared in 2025; earlier: `KV Cache is allocated. #tokens: 367404, K size: 8.23 GB, …`
KV_ALLOCATED_LINE = re.compile(
    r"KV Cache is allocated\. (?:dtype: (?P<dtype>[\w.]+), )?#tokens: (?P<tokens>\d+), "
    r"(?:K size: (?P<k_gib>[\d.]+) GB, V size: (?P<v_gib>[\d.]+) GB|KV size: (?P<kv_gib>[\d.]+) GB)"
)
POST_CAPTURE_KV_LINE = re.compile(
    r"Post-capture KV sizing: KV cache allocated\. dtype: (?P<dtype>[\w.]+), #tokens: (?P<tokens>\d+), "
    r"KV size: (?P<kv_gib>[\d.]+) GB"
)

# --- GET /server_info (srt/entrypoints/http_server.py:863-890): ServerArgs.resolved_dict() (every
# server argument as resolved: page_size, context_length (None unless given), mem_fraction_static,
# max_running_requests (the argument), chunked_prefill_size, kv_cache_dtype, tp_size, ...) updated
# with the scheduler's handshake (managers/scheduler.py:1943 `get_init_info`: max_total_num_tokens,
# max_req_input_len), plus internal_states[i].effective_max_running_requests_per_dp and version.

SERVER_INFO_PATH = "/server_info"

# --- /metrics with --enable-metrics (observability/metrics_collector.py:1289-1342, set once by
# `emit_constants`; labels include model_name)

MAX_TOTAL_NUM_TOKENS_METRIC = "sglang:max_total_num_tokens"
PAGE_SIZE_METRIC = "sglang:page_size"
NUM_PAGES_METRIC = "sglang:num_pages"
CONTEXT_LEN_METRIC = "sglang:context_len"

# --- overload (`_abort_on_queued_limit`): a full queue answers 503 without Retry-After ------------

QUEUE_FULL_STATUS = 503

# --- the OpenAI-compatible paths it serves (srt/entrypoints/http_server.py); /generate is SGLang's
# native API, which a gateway in front does not forward

GENERATE_PATHS: dict[str, str] = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "completions",
}

# Whether the server counts a prompt for the gateway: POST /tokenize and /v1/tokenize take vLLM's
# body ({model, prompt | messages, tools, chat_template_kwargs, add_special_tokens}) and answer
# {tokens, count, max_model_len} (srt/entrypoints/http_server.py, openai/protocol.py TokenizeRequest)
HAS_TOKENIZE = True

# --- the server's paths beyond vLLM's (srt/entrypoints/http_server.py, 0.5.23, read route by route)
#
# The gateway refuses what it does not know, but an allow-list must never open these: SGLang's
# own APIs generate or fill KV in request shapes the gateway does not read, and its control
# paths free memory, swap weights or pause the scheduler.

# pooling paths vLLM does not have, by the API the gateway reads them with (ClassifyRequest: input)
POOL_PATHS: dict[str, str] = {"/v1/classify": "embed"}
NATIVE_GENERATE_PATHS: dict[str, str] = {
    "/generate": "SGLang's native generate API (text or input_ids, sampling_params) is not read by the gateway",
    "/encode": "SGLang's native encode API fills KV in a request shape the gateway does not read",
    "/v1/decisions": "structured decisions are rendered server-side",
    "/api/chat": "the Ollama chat API (SGLANG_OLLAMA_CHAT_ROUTE) is not read by the gateway",
    "/api/generate": "the Ollama generate API (SGLANG_OLLAMA_GENERATE_ROUTE) is not read by the gateway",
    "/vertex_generate": "the Vertex AI predict route (AIP_PREDICT_ROUTE) is not read by the gateway",
}
OPERATOR_PATHS = frozenset({
    "/set_internal_state", "/flush_cache", "/configure_logging", "/slow_down", "/pd_role_switch",
    "/pause_generation", "/continue_generation", "/abort_request", "/freeze_gc", "/set_trace_level",
    "/add_external_corpus", "/remove_external_corpus", "/list_external_corpora",
    "/hicache/storage-backend", "/hicache/storage-backend/clear", "/get_hicache_l3_cache_layout",
    "/start_profile", "/stop_profile",
    "/start_expert_distribution_record", "/stop_expert_distribution_record", "/dump_expert_distribution_record",
    "/update_weights_from_disk", "/update_weights_from_tensor", "/update_weights_from_distributed",
    "/update_weights_from_ipc", "/update_weight_version", "/begin_weight_update", "/end_weight_update",
    "/init_weights_update_group", "/destroy_weights_update_group", "/init_weights_send_group_for_remote_instance",
    "/send_weights_to_remote_instance", "/get_remote_instance_transfer_engine_info",
    "/remote_instance_transfer_engine_info", "/get_weights_by_name", "/weights_checker",
    "/release_memory_occupation", "/resume_memory_occupation",
    "/load_lora_adapter", "/load_lora_adapter_from_tensors", "/unload_lora_adapter",
    "/open_session", "/close_session", "/get_server_info", "/server_info",
})
# paths that neither generate nor control the engine (refused unless allow-listed, like vLLM's)
OTHER_PATHS = frozenset({
    "/", "/ready", "/health", "/health_generate", "/ping", "/get_model_info", "/model_info",
    "/v1/models", "/v1/models/{model:path}", "/tokenize", "/v1/tokenize", "/detokenize", "/v1/detokenize",
    "/parse_function_call", "/separate_reasoning", "/v1/messages/count_tokens", "/api/tags", "/api/show",
    "/v1/responses/{response_id}", "/v1/responses/{response_id}/cancel",
})
# path prefixes of templated control routes (`/dumper/{method}`)
OPERATOR_PREFIXES = ("/dumper/",)

__all__ = [
    "MEMORY_TIERS", "memory_tier", "prefill_capture_sizes", "default_mem_fraction_static",
    "SCHEDULER_CAPACITY_LINE", "SCHEDULER_FIELD", "KV_ALLOCATED_LINE", "POST_CAPTURE_KV_LINE",
    "SERVER_INFO_PATH", "MAX_TOTAL_NUM_TOKENS_METRIC", "PAGE_SIZE_METRIC", "NUM_PAGES_METRIC", "CONTEXT_LEN_METRIC",
    "POOL_PATHS", "NATIVE_GENERATE_PATHS", "OPERATOR_PATHS", "OPERATOR_PREFIXES", "OTHER_PATHS",
    "HAS_TOKENIZE",
    "CURRENT_VERSION", "LAUNCH_MODULE", "PAGE_SIZE", "SCHEDULE_CONSERVATIVENESS", "MAX_PREFILL_TOKENS",
    "RETRACTION_POLICY", "default_chunked_prefill_size", "default_max_running_requests",
    "DEFAULT_MAX_RUNNING_REQUESTS",
    "INIT_NEW_TOKEN_RATIO", "MIN_NEW_TOKEN_RATIO_FACTOR", "NEW_TOKEN_RATIO_DECAY_STEPS",
    "CLIP_MAX_NEW_TOKENS_ESTIMATION", "ENV_INIT_NEW_TOKEN_RATIO", "ENV_MIN_NEW_TOKEN_RATIO_FACTOR",
    "ENV_NEW_TOKEN_RATIO_DECAY_STEPS", "ENV_CLIP_MAX_NEW_TOKENS_ESTIMATION", "ENV_MAX_NEW_TOKENS_LIMIT",
    "QUEUE_FULL_STATUS", "GENERATE_PATHS",
]
