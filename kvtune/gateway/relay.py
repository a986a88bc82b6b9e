"""Relaying: a request whose body is in hand goes to the upstream through the gateway's own client
(kvtune.gateway.upstream), and the upstream's answer comes back, chunk by chunk as it arrives.

Hop-by-hop headers (and those a Connection header names) stay behind in both directions. A
complete small answer goes back in one write; a stream goes through as it comes, and a client
that accepts nothing for send_timeout_s is cut off (its upstream call and reservation with it).
An unfinished upstream body closes its connection, which makes vLLM abort the request. The
gateway's own answers (kvtune.gateway.refusals) become OpenAI-style error responses here.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

from aiohttp import web
from multidict import CIMultiDict, CIMultiDictProxy

from kvtune.gateway.refusals import ErrorType, Reason, Rejection
from kvtune.gateway.upstream import (
    UpstreamClient,
    UpstreamConnectError,
    UpstreamError,
    UpstreamResponse,
    UpstreamTimeoutError,
)

# RFC 9110 §7.6.1 connection-specific fields, plus what the proxy recomputes (Host, length) and
# the request's Content-Encoding (a governed body is forwarded decoded).
HOP_BY_HOP = frozenset({
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "proxy-connection",
    "te", "trailer", "trailers", "transfer-encoding", "upgrade",
})
_DROP_REQUEST = HOP_BY_HOP | {"host", "content-length", "content-encoding"}
_DROP_RESPONSE = HOP_BY_HOP
_DROP_WHOLE_RESPONSE = HOP_BY_HOP | {"content-length"}  # the gateway's server sets its own
_WHOLE_BODY_MAX_BYTES = 1024 * 1024


def refusal_response(rejection: Rejection, detailed: bool = False) -> web.Response:
    """The gateway's own answer: status, OpenAI error body, Retry-After and Allow when set; the
    ledger's figures in the message only when `detailed` (admin.refusal_detail)."""
    status = rejection.status
    headers = {}
    if rejection.retry_after_s is not None:
        headers["Retry-After"] = str(rejection.retry_after_s)
    if rejection.allow is not None:
        headers["Allow"] = rejection.allow
    body = {"error": {"message": rejection.message_for(detailed), "type": ErrorType.of(status).value, "param": None,
                      "code": rejection.code}}
    response = web.json_response(body, status=status, headers=headers or None)
    if rejection.close:
        response.force_close()
    return response


class Relay:
    """Sends requests upstream and their answers back, under one send timeout."""

    def __init__(self, send_timeout_s: float) -> None:
        self.send_timeout_s = send_timeout_s

    async def send(self, request: web.Request, client: UpstreamClient, method: str, target: str, body: bytes,
                   extra_headers: dict[str, str], *, decoded: bool = True,
                   progress: Callable[[int], None] | None = None, unsent: bool = False) -> web.StreamResponse:
        """A request whose body is in hand, through the gateway's own upstream client; a body
        the gateway decoded goes without its Content-Encoding. `progress(tokens)` hears, as an
        event stream comes back, at least how many tokens it has carried (events_seen_tokens).
        With `unsent`, a connection that could not be opened (nothing was sent) raises its
        UpstreamConnectError, for the caller to send elsewhere, instead of answering 502/504."""
        headers = _forward_headers(request.headers, drop_encoding=decoded)
        try:
            up = await client.request(method, target, headers, body)
        except UpstreamError as exc:
            if unsent and isinstance(exc, UpstreamConnectError):
                raise
            if isinstance(exc, UpstreamTimeoutError):
                return refusal_response(Rejection(504, Reason.UPSTREAM_TIMEOUT,
                                                  "the upstream did not answer in time"))
            return refusal_response(Rejection(502, Reason.UPSTREAM_UNAVAILABLE,
                                              f"the upstream could not be reached: {exc}"))
        return await self._relay(request, up, extra_headers, progress)

    async def _relay(self, request: web.Request, up: UpstreamResponse, extra_headers: dict[str, str],
                     progress: Callable[[int], None] | None = None) -> web.StreamResponse:
        """Send the upstream's answer back, chunk by chunk as it arrives; a client that accepts
        nothing for send_timeout_s is cut off (its upstream call and reservation with it)."""
        finished = False
        send_timeout = self.send_timeout_s
        try:
            whole = _whole_body(request.method, up)
            headers = _response_headers(up.headers, whole)
            headers.update(extra_headers)
            if whole:
                # A complete answer of known, small length (vLLM's non-streaming JSON): read it and
                # send status, headers and body in one write instead of three.
                try:
                    body = await up.read()
                except UpstreamTimeoutError:
                    return refusal_response(Rejection(504, Reason.UPSTREAM_TIMEOUT,
                                                      "the upstream did not answer in time"))
                except UpstreamError as exc:
                    return refusal_response(Rejection(502, Reason.UPSTREAM_BROKEN,
                                                      f"the upstream's answer broke off: {exc}"))
                finished = True
                return web.Response(status=up.status, reason=up.reason, body=body, headers=headers)
            response = web.StreamResponse(status=up.status, reason=up.reason, headers=headers)
            if not up.headers.get("Content-Type", "").startswith("text/event-stream"):
                progress = None
            events = EventCounter()
            try:
                await response.prepare(request)
                async for chunk in up.iter_chunks():
                    if progress is not None:
                        progress(events_seen_tokens(events.add(chunk)))
                    async with asyncio.timeout(send_timeout):
                        await response.write(chunk)
            except UpstreamError:
                # The stream broke upstream: cut the client's connection so it sees a short body.
                if request.transport is not None:
                    request.transport.abort()
                return response
            except TimeoutError:
                if request.transport is not None:
                    request.transport.abort()
                return response
            except ConnectionResetError:
                # The client went away between two chunks: nothing to answer; the upstream call is
                # closed below (vLLM aborts it) and the reservation released as for any abort.
                return response
            finished = True
            with contextlib.suppress(ConnectionResetError):  # gone after the last chunk: all was sent
                await response.write_eof()
            return response
        finally:
            # An unfinished upstream body closes its connection, which makes vLLM abort the request.
            if finished:
                up.release()
            else:
                up.close()


#: Events of a completion stream that carry no generated token: the first (the role, in chat),
#: the last (finish_reason, or usage) and `[DONE]`.
EVENTS_WITHOUT_TOKENS = 3


class EventCounter:
    """Complete events (b"\\n\\n") of a stream read in chunks, counted as over the whole stream,
    so a blank line split across two chunks counts once, wherever the chunks happen to break
    (the rendered nginx.conf counts the same in its body filter)."""

    __slots__ = ("events", "_newline")

    def __init__(self) -> None:
        self.events = 0
        self._newline = False  # the stream so far ends with a newline no pair has taken

    def add(self, chunk: bytes) -> int:
        """Count `chunk` in; the events seen so far."""
        if not chunk:
            return self.events
        start = 1 if self._newline and chunk[:1] == b"\n" else 0
        self.events += start + chunk.count(b"\n\n", start)
        trailing = len(chunk) - len(chunk.rstrip(b"\n"))
        self._newline = (len(chunk) - max(len(chunk) - trailing, start)) % 2 == 1
        return self.events


def events_seen_tokens(events: int) -> int:
    """Tokens an OpenAI-style event stream has carried at least, after `events` complete events.

    vLLM sends one event per engine step, each with at least one token of every sequence that
    advanced; an event ends with a blank line (JSON holds no raw newline, so b"\\n\\n" is always a
    boundary). Counting events undercounts tokens (an event may hold several), which only makes the
    statistical ledger's condition weaker, never wrong."""
    return max(0, events - EVENTS_WITHOUT_TOKENS)


def _whole_body(method: str, up: UpstreamResponse) -> bool:
    """True for an answer sent with a Content-Length of at most 1 MiB that is not an event
    stream: it can go back as one response without delaying a single byte a client could use.
    Streams (chunked, SSE) and anything large go through chunk by chunk."""
    if method == "HEAD" or up.status < 200 or up.status in (204, 304):
        return False
    length = up.content_length
    if length is None or length > _WHOLE_BODY_MAX_BYTES:
        return False
    return not up.headers.get("Content-Type", "").startswith("text/event-stream")


def _connection_tokens(headers: CIMultiDictProxy[str] | CIMultiDict[str]) -> list[str]:
    return [t.strip() for v in headers.getall("Connection", []) for t in v.split(",") if t.strip()]


def _forward_headers(headers: CIMultiDictProxy[str], *, drop_encoding: bool = True) -> list[tuple[str, str]]:
    drop = _DROP_REQUEST if drop_encoding else _DROP_REQUEST - {"content-encoding"}
    if "Connection" in headers:
        drop = drop.union(t.lower() for t in _connection_tokens(headers))
    return [(k, v) for k, v in headers.items() if k.lower() not in drop]


def _response_headers(headers: CIMultiDict[str], whole: bool) -> CIMultiDict[str]:
    """The upstream's answer headers less hop-by-hop ones and those its Connection names; less
    Content-Length too for a whole body, which the gateway's server sets itself."""
    drop = _DROP_WHOLE_RESPONSE if whole else _DROP_RESPONSE
    if "Connection" in headers:
        drop = drop.union(t.lower() for t in _connection_tokens(headers))
    return CIMultiDict([(k, v) for k, v in headers.items() if k.lower() not in drop])


__all__ = ["Relay", "EventCounter", "events_seen_tokens", "refusal_response", "HOP_BY_HOP"]
