"""Which request paths the gateway governs, and how: vLLM 0.32's OpenAI-compatible server
(`vllm/entrypoints/`, read router by router) sorted into classes.

A public gateway that forwards what it does not know is a hole: `/invocations` generates like
`/v1/chat/completions`, `/v1/embeddings` fills KV like a prompt, `/sleep` frees the engine's
memory. So every path is one of

  GENERATE     generates tokens; governed by its API's field rules (prompt, caps, sequences)
  POOL         fills KV for its input without generating (embeddings, scores); reserves the input
  UNCOUNTABLE  generates, but what it will use cannot be counted from the request (audio, a
               websocket, server-side state); refused with 501
  OPERATOR     controls the engine (sleep, reset, weights, profiling); never reachable, 404
  (passthrough) on the gateway.yaml allow-list: forwarded untouched
and anything else answers 404. The allow-list can never open a path of the first four classes.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass


class Api(enum.Enum):
    """The field rules a request is read by: where its prompt is, which fields cap its output."""

    CHAT = "chat"                # messages (+ tools, documents, template fields); max_tokens, max_completion_tokens
    CHAT_BATCH = "chat-batch"    # messages: a list of conversations, one output each
    COMPLETIONS = "completions"  # prompt: text, texts, token ids or lists of them; max_tokens
    RESPONSES = "responses"      # input + instructions; max_output_tokens
    MESSAGES = "messages"        # Anthropic: messages + system + tools; max_tokens
    INVOCATIONS = "invocations"  # SageMaker: vLLM tries chat, then completions, then pooling
    TOKENS = "tokens"            # token_ids; sampling_params.max_tokens (/inference/v1/generate)
    ANY = "any"                  # a route path that is not a vLLM endpoint: every prompt field counts
    EMBED = "embed"              # pooling: input (or messages)
    SCORE = "score"              # pooling pairs: data_1/data_2, text_1/text_2, queries/documents|items
    RERANK = "rerank"            # pooling pairs: query x documents
    COHERE_EMBED = "cohere-embed"  # pooling: texts / inputs


class PathClass(enum.Enum):
    GENERATE = "generate"
    POOL = "pool"
    UNCOUNTABLE = "uncountable"
    OPERATOR = "operator"
    PASSTHROUGH = "passthrough"
    UNKNOWN = "unknown"


# The APIs a route in gateway.yaml may declare for a path that is not one of vLLM's own.
ROUTE_APIS = (Api.CHAT, Api.COMPLETIONS, Api.RESPONSES, Api.MESSAGES, Api.ANY)

GENERATE: dict[str, Api] = {
    "/v1/chat/completions": Api.CHAT,
    "/v1/chat/completions/batch": Api.CHAT_BATCH,
    "/v1/completions": Api.COMPLETIONS,
    "/v1/responses": Api.RESPONSES,
    "/v1/messages": Api.MESSAGES,
    "/invocations": Api.INVOCATIONS,
    "/inference/v1/generate": Api.TOKENS,
}
POOL: dict[str, Api] = {
    "/v1/embeddings": Api.EMBED,
    "/pooling": Api.EMBED,
    "/classify": Api.EMBED,
    "/score": Api.SCORE,
    "/v1/score": Api.SCORE,
    "/rerank": Api.RERANK,
    "/v1/rerank": Api.RERANK,
    "/v2/rerank": Api.RERANK,
    "/v2/embed": Api.COHERE_EMBED,
}
# Generating endpoints whose use cannot be read from the request body.
UNCOUNTABLE: dict[str, str] = {
    "/v1/realtime": "a websocket session streams audio for as long as it stays open",
    "/v1/audio/transcriptions": "the prompt is audio, whose token count only the engine knows",
    "/v1/audio/translations": "the prompt is audio, whose token count only the engine knows",
    "/cohere/v2/chat": "the Cohere chat API is rendered by a template the gateway does not replicate",
    "/v1/systemone": "structured decisions are rendered server-side",
    "/generative_scoring": "generative scoring builds its prompts server-side",
}
OPERATOR = frozenset({
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
# vLLM paths that neither generate nor control the engine: refused unless allow-listed.
OTHER_KNOWN = frozenset({
    "/health", "/ready", "/readyz", "/ping", "/load", "/version", "/metrics", "/v1/models", "/tokenize",
    "/detokenize",
    "/tokenizer_info", "/v1/messages/count_tokens",
    "/v1/chat/completions/render", "/v1/completions/render", "/v1/messages/render",
    "/v1/responses/render", "/cohere/v2/chat/render",
    "/v1/chat/completions/derender", "/v1/completions/derender",
    "/v1/responses/{response_id}", "/v1/responses/{response_id}/cancel",
    "/docs", "/docs/oauth2-redirect", "/openapi.json", "/redoc",
})
DEFAULT_PASSTHROUGH: tuple[str, ...] = (
    "/health", "/v1/models", "/tokenize", "/detokenize", "/version",
    "/v1/chat/completions/render", "/v1/completions/render", "/v1/messages/render",
    "/v1/responses/render", "/v1/messages/count_tokens",
)

# A request path as a client may send it: printable ASCII, no percent-escapes (they decode into
# another path, e.g. /v1/chat%2Fcompletions), no empty, "." or ".." segments (an upstream or its
# framework may normalise them into a governed path the gateway did not see).
_CANONICAL = re.compile(r"(?:/[!$&'()*+,;=:@A-Za-z0-9_~.-]+)+/?|/")
_DOT_SEGMENT = re.compile(r"/\.\.?(?:/|$)")


def canonical_path(raw_path: str) -> str | None:
    """The path part of a request target when it means exactly one thing; None when it does not
    (percent-escapes, backslashes, '//', dot segments, control characters)."""
    path = raw_path.split("?", 1)[0]
    if not _CANONICAL.fullmatch(path) or _DOT_SEGMENT.search(path):
        return None
    return path


@dataclass(frozen=True, slots=True)
class Endpoint:
    """What the gateway does with a path: its class, and for governed paths the API it speaks."""

    path_class: PathClass
    api: Api | None = None
    reason: str | None = None


def classify(path: str, passthrough: frozenset[str] | tuple[str, ...] = DEFAULT_PASSTHROUGH) -> Endpoint:
    """The class of a canonical path (route paths from gateway.yaml are looked up before this)."""
    if path in GENERATE:
        return Endpoint(PathClass.GENERATE, GENERATE[path])
    if path in POOL:
        return Endpoint(PathClass.POOL, POOL[path])
    if path in UNCOUNTABLE:
        return Endpoint(PathClass.UNCOUNTABLE, reason=UNCOUNTABLE[path])
    if path in OPERATOR:
        return Endpoint(PathClass.OPERATOR)
    if path in passthrough:
        return Endpoint(PathClass.PASSTHROUGH)
    return Endpoint(PathClass.UNKNOWN)


def why_not_a_route_path(path: str) -> str | None:
    """Why a request path (say, one that came from logs) cannot be a route's literal
    `match.path` (None: it can): it must be plain, and a generation endpoint or none of vLLM's."""
    if canonical_path(path) != path or "?" in path or "*" in path:
        return "it is not a plain request path"
    kind = classify(path, ()).path_class
    if kind not in (PathClass.GENERATE, PathClass.UNKNOWN):
        return f"it is not a generation endpoint ({kind.value})"
    return None


def never_passthrough(path: str) -> str | None:
    """Why `path` may not be on a passthrough allow-list (None: it may): it generates, fills KV
    or controls the engine, so forwarding it untouched would walk past admission."""
    if path in GENERATE or path in POOL:
        return "it is governed by the gateway (an allow-list would let it past admission)"
    if path in UNCOUNTABLE:
        return f"it generates and cannot be counted: {UNCOUNTABLE[path]}"
    if path in OPERATOR:
        return "it controls the engine and must never be reachable through a public gateway"
    return None


__all__ = [
    "Api", "PathClass", "Endpoint", "classify", "canonical_path", "never_passthrough", "why_not_a_route_path", "ROUTE_APIS",
    "GENERATE", "POOL", "UNCOUNTABLE", "OPERATOR", "OTHER_KNOWN", "DEFAULT_PASSTHROUGH",
]
