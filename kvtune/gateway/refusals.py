"""What the gateway answers itself instead of the upstream: a status, a reason and a message.

Pure data, no aiohttp: intake, the body and API readers, admission and the relay raise these,
and the relay turns one into an OpenAI-style error response (kvtune.gateway.relay.
refusal_response). The reasons are a closed set: each one's value is the JSON answer's
`error.code`, the `reason` label of `kvtune_gateway_rejected` on /metrics and the word in the
log line; the rendered nginx.conf answers with the same ones (tests/test_enforcer_parity.py).

    Rejection          an answer the gateway gives itself (4xx/5xx)
    Refused            a Rejection of a request already matched to a route (the metrics' label)
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvtune.gateway.config import GatewayRoute


class Reason(enum.Enum):
    """Why a request was not forwarded: the answer's `error.code` and the metrics' `reason`."""

    # the request line and head, before any body (kvtune.gateway.intake)
    METHOD_NOT_ALLOWED = "method_not_allowed"
    HEADER_TOO_LARGE = "header_too_large"
    UPGRADE_REFUSED = "upgrade_refused"
    INVALID_PATH = "invalid_path"
    UNSUPPORTED_ENCODING = "unsupported_encoding"
    UNCOUNTABLE_ENDPOINT = "uncountable_endpoint"
    NOT_FOUND = "not_found"
    DUPLICATE_ROUTE_HEADER = "duplicate_route_header"  # a header routes match on, sent twice
    # reading the body (kvtune.gateway.intake, body)
    BODY_TOO_LARGE = "body_too_large"
    BODY_TIMEOUT = "body_timeout"
    INVALID_BODY = "invalid_body"
    INVALID_JSON = "invalid_json"
    DUPLICATE_KEY = "duplicate_key"
    INVALID_UNICODE = "invalid_unicode"
    # reading the request by its API's rules (kvtune.gateway.apis), matching a route
    INVALID_REQUEST = "invalid_request"
    UNCOUNTABLE_REQUEST = "uncountable_request"
    INVALID_MAX_TOKENS = "invalid_max_tokens"
    INVALID_N = "invalid_n"
    INVALID_BEST_OF = "invalid_best_of"
    NO_ROUTE = "no_route"
    # counting and reserving (kvtune.gateway.admission)
    CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
    INVALID_PROMPT = "invalid_prompt"
    PROMPT_COUNT_INVALID = "prompt_count_invalid"
    PROMPT_COUNT_UNAVAILABLE = "prompt_count_unavailable"
    KV_RESERVATION_EXCEEDS_BUDGET = "kv_reservation_exceeds_budget"
    KV_BUDGET_EXHAUSTED = "kv_budget_exhausted"
    QUEUE_FULL = "queue_full"
    QUEUE_TIMEOUT = "queue_timeout"
    LEDGER_UNAVAILABLE = "ledger_unavailable"  # the gateways' shared ledger (Redis) does not answer
    # the upstream (kvtune.gateway.relay)
    UPSTREAM_TIMEOUT = "upstream_timeout"
    UPSTREAM_UNAVAILABLE = "upstream_unavailable"
    UPSTREAM_BROKEN = "upstream_broken"


class ErrorType(enum.Enum):
    """The OpenAI error `type` of an answer, from its status."""

    RATE_LIMIT = "rate_limit_error"
    INVALID_REQUEST = "invalid_request_error"
    SERVER = "server_error"

    @classmethod
    def of(cls, status: int) -> ErrorType:
        if status == 429:
            return cls.RATE_LIMIT
        return cls.INVALID_REQUEST if 400 <= status < 500 else cls.SERVER


class Rejection(Exception):
    """An answer the gateway gives itself instead of the upstream's (4xx/5xx, OpenAI error body).
    `close` also ends the connection (a body left unread, a client too slow to finish)."""

    def __init__(self, status: int, reason: Reason, message: str, *, retry_after_s: int | None = None,
                 close: bool = False, allow: str | None = None) -> None:
        super().__init__(message)
        self.status, self.reason, self.message, self.retry_after_s = status, reason, message, retry_after_s
        self.close, self.allow = close, allow

    @property
    def code(self) -> str:
        """The reason as the answer, the metrics and the log spell it."""
        return self.reason.value


class Refused(Exception):
    """A Rejection of a request already matched to a route (for the metrics' route label)."""

    def __init__(self, route: GatewayRoute | None, rejection: Rejection) -> None:
        super().__init__(rejection.message)
        self.route, self.rejection = route, rejection


__all__ = ["Reason", "ErrorType", "Rejection", "Refused"]
