"""SGLang's facts that kvtune relies on, each stated once: its server's defaults, the environment
variables that steer its admission estimate, and its overload behaviour.

Values are SGLang 0.5.23's (its PyPI wheel), read from source; reference/engines.md gives the
file of each. SGLang does not reserve KV for a request's output: it *estimates* it
(`PrefillAdder.add_one_req`, `managers/schedule_policy.py`), charging each running request
min(remaining output, CLIP) × new_token_ratio, and retracts (recomputes) requests when the
estimate was wrong.
"""

from __future__ import annotations

CURRENT_VERSION = "0.5.23"  # the release these defaults were read from
LAUNCH_MODULE = "sglang.launch_server"

# --- server defaults (srt/server_args.py, arg_groups/fields/schedule.py) ---------------------------

PAGE_SIZE = 1  # --page-size: tokens per KV page
SCHEDULE_CONSERVATIVENESS = 1.0  # --schedule-conservativeness
MAX_PREFILL_TOKENS = 16_384  # --max-prefill-tokens
RETRACTION_POLICY = "length"  # --retraction-policy



def default_max_running_requests(max_total_num_tokens: int, context_len: int) -> int:
    """The request slots SGLang makes when --max-running-requests is not given (ModelRunner's
    memory-pool setup): max_total_num_tokens / context_len × 512, clamped to [2048, 4096]."""
    return min(max(int(max_total_num_tokens / max(1, context_len) * 512), 2_048), 4_096)


# when neither the flag nor the pool is known: the lower clamp
DEFAULT_MAX_RUNNING_REQUESTS = 2_048


def default_chunked_prefill_size(gpu_memory_bytes: int | None) -> int:
    """--chunked-prefill-size when not given (ServerArgs: by the GPU's memory in MiB): 2048 under
    35 GiB (A10, L40, 4090), 8192 under 160 GiB (A100, H100, H200), 16384 above; 4096 unknown."""
    if not gpu_memory_bytes:
        return 4_096
    mib = gpu_memory_bytes / 2**20
    if mib < 35 * 1024:
        return 2_048
    return 8_192 if mib < 160 * 1024 else 16_384


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
