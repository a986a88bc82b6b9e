"""One request as a sender states it (RequestSpec) and what became of it (RequestResult,
Outcome): the live benchmark (kvtune.bench) sends and times them, the simulator (kvtune.sim)
reports its own requests in the same terms, so both read them from here.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Outcome", "FAILURE_KINDS", "RequestSpec", "RequestResult"]


class Outcome(enum.Enum):
    """How a request ended. Everything but OK is a failure and a goodput miss."""

    OK = "ok"
    HTTP_429 = "429"
    HTTP_503 = "503"
    HTTP_4XX = "4xx"
    HTTP_5XX = "5xx"
    TIMEOUT = "timeout"
    DISCONNECT = "disconnect"  # connection dropped or stream ended before [DONE]
    CONNECT = "connect"  # could not open a connection
    STREAM_ERROR = "stream_error"  # an error event inside a 200 stream
    CANCELLED = "cancelled"  # the run was interrupted while this request was in flight


FAILURE_KINDS = tuple(o.value for o in Outcome if o is not Outcome.OK)


@dataclass(frozen=True, slots=True)
class RequestSpec:
    """One request to send: its route, intended prompt and output lengths, and prompt text."""

    index: int
    route: str
    prompt_tokens: int
    output_tokens: int  # sent as max_tokens
    prompt: str


@dataclass(slots=True)
class RequestResult:
    """What happened to one request; times in ms from its first send, never the prompt text."""

    index: int
    route: str
    prompt_tokens_requested: int
    output_tokens_requested: int
    start_s: float  # perf_counter at first send
    outcome: Outcome = Outcome.CANCELLED
    status: int | None = None
    attempts: int = 0
    retry_wait_s: float = 0.0
    error: str | None = None
    ttft_ms: float | None = None
    e2e_ms: float | None = None
    itl_ms: list[float] = field(default_factory=list)
    output_tokens: int | None = None  # server usage.completion_tokens
    prompt_tokens: int | None = None  # server usage.prompt_tokens
    text_chunks: int = 0
    finish_reason: str | None = None

    @property
    def ok(self) -> bool:
        return self.outcome is Outcome.OK

    @property
    def tpot_ms(self) -> float | None:
        """(e2e − TTFT) / (tokens − 1): undefined for one token or without usage."""
        n = self.output_tokens
        if n is None or n < 2 or self.ttft_ms is None or self.e2e_ms is None:
            return None
        return (self.e2e_ms - self.ttft_ms) / (n - 1)

    def to_dict(self, t0_s: float) -> dict[str, Any]:
        """The requests-log line: no prompt or response text."""
        return {
            "index": self.index,
            "route": self.route,
            "start_ms": round((self.start_s - t0_s) * 1000, 3),
            "outcome": self.outcome.value,
            "status": self.status,
            "attempts": self.attempts,
            "retry_wait_s": round(self.retry_wait_s, 3),
            "prompt_tokens_requested": self.prompt_tokens_requested,
            "prompt_tokens": self.prompt_tokens,
            "output_tokens_requested": self.output_tokens_requested,
            "output_tokens": self.output_tokens,
            "finish_reason": self.finish_reason,
            "ttft_ms": _round(self.ttft_ms),
            "tpot_ms": _round(self.tpot_ms),
            "e2e_ms": _round(self.e2e_ms),
            "itl_ms": [round(x, 3) for x in self.itl_ms],
            "error": self.error,
        }


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 3)
