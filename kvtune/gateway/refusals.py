"""What the gateway answers itself instead of the upstream: a status, a reason and a message.

Pure data, no aiohttp: intake, the body and API readers, admission and the relay raise these,
and the relay turns one into an OpenAI-style error response (kvtune.gateway.relay.
refusal_response). The reasons are a closed set: each one's value is the JSON answer's
`error.code`, the `reason` label of `kvtune_gateway_rejected` on /metrics and the word in the
log line; the rendered nginx.conf answers with the same ones (tests/integration/test_enforcer_parity.py).

    Rejection          an answer the gateway gives itself (4xx/5xx)
    Refused            a Rejection of a request already matched to a route (the metrics' label)
    RefusalLog         refusals counted per reason and route, one log line each per second
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvtune.domain.route import Route


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
    DEADLINE_UNREACHABLE = "deadline_unreachable"  # flow control: the forecast wait passes the band's deadline
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
                 close: bool = False, allow: str | None = None, blocks: tuple[int, int] | None = None,
                 public: str | None = None) -> None:
        super().__init__(message)
        self.status, self.reason, self.message, self.retry_after_s = status, reason, message, retry_after_s
        # the message without the ledger's figures, for clients not allowed to read the ledger
        # (gateway.yaml admin.refusal_detail); None: the message holds none
        self.public = public
        self.close, self.allow = close, allow
        self.blocks = blocks  # (needed, free) when KV blocks decided it, for the log line

    def message_for(self, detailed: bool) -> str:
        """The message a client sees: the ledger's figures only when it may read the ledger."""
        return self.message if detailed or self.public is None else self.public

    @property
    def code(self) -> str:
        """The reason as the answer, the metrics and the log spell it."""
        return self.reason.value


class Refused(Exception):
    """A Rejection of a request already matched to a route (for the metrics' route label)."""

    def __init__(self, route: Route | None, rejection: Rejection) -> None:
        super().__init__(rejection.message)
        self.route, self.rejection = route, rejection


#: What 429 and 413 say to a client that may not read the ledger (gateway.yaml
#: admin.refusal_detail): the reason, never the blocks or the budget.
BUDGET_FULL = "KV budget full; retry later"
NEVER_FITS = "this request needs more KV blocks than this deployment can ever hold: it can never be admitted"

#: Seconds over which refusals of one reason and route are counted into one log line.
REFUSAL_LOG_S = 1.0


@dataclass(slots=True)
class _Tally:
    count: int
    last: Rejection


class RefusalLog:
    """Refusals counted per (reason, route) over a window of REFUSAL_LOG_S: at full rate the log
    gets one line per reason and route per window, with the count and the last one's blocks
    needed and free (or its message), never a line per request. Pure: the caller passes the clock
    and logs the lines `record` and `flush` return (on the next refusal after the window, from a
    timer, and at shutdown)."""

    __slots__ = ("_started", "_tallies", "window_s")

    def __init__(self, window_s: float = REFUSAL_LOG_S) -> None:
        self.window_s = window_s
        self._started: float | None = None
        self._tallies: dict[tuple[str, str], _Tally] = {}

    def record(self, route: str, rejection: Rejection, now: float) -> list[str]:
        """Count one refusal; the lines of the window it closes, if it arrives after that one."""
        lines = self.flush(now) if self.due(now) else []
        if self._started is None:
            self._started = now
        tally = self._tallies.get((rejection.code, route))
        if tally is None:
            self._tallies[(rejection.code, route)] = _Tally(1, rejection)
        else:
            tally.count += 1
            tally.last = rejection
        return lines

    def due(self, now: float) -> bool:
        """Whether a window is open and has lasted its REFUSAL_LOG_S."""
        return self._started is not None and now - self._started >= self.window_s

    def flush(self, now: float) -> list[str]:
        """One line per reason and route counted since the window opened; the window closes."""
        if self._started is None:
            return []
        elapsed = max(now - self._started, 0.0)
        lines = [_line(count=t.count, elapsed_s=elapsed, code=code, route=route, last=t.last)
                 for (code, route), t in self._tallies.items()]
        self._started, self._tallies = None, {}
        return lines


def _line(*, count: int, elapsed_s: float, code: str, route: str, last: Rejection) -> str:
    what = (f"needed {last.blocks[0]:,} blocks, {last.blocks[1]:,} free (last)" if last.blocks is not None
            else f"last: {last.message[:200]}")
    return f"refused {count:,} in {elapsed_s:.1f} s: {code} route={route or '-'} status={last.status} {what}"


__all__ = ["BUDGET_FULL", "NEVER_FITS", "Reason", "ErrorType", "Rejection", "Refused", "RefusalLog", "REFUSAL_LOG_S"]
