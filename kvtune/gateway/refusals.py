"""What the gateway answers itself instead of the upstream: a status, a reason code and a message.

Pure data, no aiohttp: intake, admission and the relay raise these, and the relay turns one into
an OpenAI-style error response (kvtune.gateway.relay.refusal_response). The code is the JSON
answer's `error.code`, the `reason` label of `kvtune_gateway_rejected` on /metrics and the word
in the log line; the rendered nginx.conf answers with the same ones (tests/test_enforcer_parity.py).

    Rejection          an answer the gateway gives itself (4xx/5xx)
    Refused            a Rejection of a request already matched to a route (the metrics' label)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvtune.gateway.config import GatewayRoute


class Rejection(Exception):
    """An answer the gateway gives itself instead of the upstream's (4xx/5xx, OpenAI error body).
    `close` also ends the connection (a body left unread, a client too slow to finish)."""

    def __init__(self, status: int, code: str, message: str, *, retry_after_s: int | None = None,
                 close: bool = False, allow: str | None = None) -> None:
        super().__init__(message)
        self.status, self.code, self.message, self.retry_after_s = status, code, message, retry_after_s
        self.close, self.allow = close, allow


class Refused(Exception):
    """A Rejection of a request already matched to a route (for the metrics' route label)."""

    def __init__(self, route: GatewayRoute | None, rejection: Rejection) -> None:
        super().__init__(rejection.message)
        self.route, self.rejection = route, rejection


__all__ = ["Rejection", "Refused"]
