"""Which request paths the gateway governs, and how: the paths of vLLM's OpenAI-compatible
server (kvtune.engines.vllm) sorted into classes, with the paths SGLang serves beyond them
(kvtune.engines.sglang), so a gateway in front of either engine refuses what it cannot govern.

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

from kvtune.domain.route import Api
from kvtune.engines import sglang, vllm


class PathClass(enum.Enum):
    GENERATE = "generate"
    POOL = "pool"
    UNCOUNTABLE = "uncountable"
    OPERATOR = "operator"
    PASSTHROUGH = "passthrough"
    UNKNOWN = "unknown"


# The APIs a route in gateway.yaml may declare for a path that is not one of vLLM's own.
ROUTE_APIS = (Api.CHAT, Api.COMPLETIONS, Api.RESPONSES, Api.MESSAGES, Api.ANY)

# vLLM's own paths by class (kvtune.engines.vllm), read by the APIs they speak.
GENERATE: dict[str, Api] = {path: Api(api) for path, api in vllm.GENERATE_PATHS.items()}
POOL: dict[str, Api] = {path: Api(api) for path, api in {**vllm.POOL_PATHS, **sglang.POOL_PATHS}.items()}
UNCOUNTABLE: dict[str, str] = {**vllm.UNCOUNTABLE_PATHS, **sglang.NATIVE_GENERATE_PATHS}  # path -> why
OPERATOR = vllm.OPERATOR_PATHS | sglang.OPERATOR_PATHS
OPERATOR_PREFIXES = sglang.OPERATOR_PREFIXES  # templated control routes
OTHER_KNOWN = vllm.OTHER_PATHS  # neither generate nor control the engine: refused unless allow-listed
# The harmless ones a gateway forwards when gateway.yaml names no passthrough list.
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
    if path in OPERATOR or path.startswith(OPERATOR_PREFIXES):
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
    if path in OPERATOR or path.startswith(OPERATOR_PREFIXES):
        return "it controls the engine and must never be reachable through a public gateway"
    return None


__all__ = [
    "Api", "PathClass", "Endpoint", "classify", "canonical_path", "never_passthrough", "why_not_a_route_path",
    "ROUTE_APIS",
    "GENERATE", "POOL", "UNCOUNTABLE", "OPERATOR", "OPERATOR_PREFIXES", "OTHER_KNOWN", "DEFAULT_PASSTHROUGH",
]
