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

__all__ = [
    "HAS_TOKENIZE",
    "CURRENT_VERSION", "LAUNCH_MODULE", "PAGE_SIZE", "SCHEDULE_CONSERVATIVENESS", "MAX_PREFILL_TOKENS",
    "RETRACTION_POLICY", "default_chunked_prefill_size", "default_max_running_requests",
    "DEFAULT_MAX_RUNNING_REQUESTS",
    "INIT_NEW_TOKEN_RATIO", "MIN_NEW_TOKEN_RATIO_FACTOR", "NEW_TOKEN_RATIO_DECAY_STEPS",
    "CLIP_MAX_NEW_TOKENS_ESTIMATION", "ENV_INIT_NEW_TOKEN_RATIO", "ENV_MIN_NEW_TOKEN_RATIO_FACTOR",
    "ENV_NEW_TOKEN_RATIO_DECAY_STEPS", "ENV_CLIP_MAX_NEW_TOKENS_ESTIMATION", "ENV_MAX_NEW_TOKENS_LIMIT",
    "QUEUE_FULL_STATUS", "GENERATE_PATHS",
]
