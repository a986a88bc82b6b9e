"""The admission gateway: an aiohttp reverse proxy that enforces the reservation policy.

Every request path is classified first (kvtune.gateway.endpoints): a generation endpoint is
governed, a pooling endpoint reserves its input, a path on the passthrough allow-list is
forwarded untouched, and everything else is refused. A governed request is read by its
endpoint's own field rules (kvtune.gateway.apis), matched to a route, its output cap clamped to
the route's cap (and set when absent; a min_tokens above it comes down to it, which vLLM
requires), its prompt counted, and sequences x ceil((prompt + cap) / block_size) KV blocks are
reserved for its whole life. Only the governed members of the body change on the way up; every
other byte arrives as the client sent it. A full budget answers 429 with Retry-After from the
observed release rate; a request that can never fit answers 400/413 at once. Responses stream
chunk by chunk. The reservation is released in `finally`, before any await, so every ending
(completion, client disconnect, upstream error, cancellation, shutdown) releases it once.

Clients are bounded (kvtune.gateway.connections and the limits in gateway.yaml): a deadline for
each request head and between body reads and writes, caps on head and body size, on open
connections; CONNECT and Upgrade are refused.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import time
import zlib
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestPayloadError
from multidict import CIMultiDict

from kvtune.capacity.reservation import request_reserved_blocks
from kvtune.gateway.apis import CapField, Request, read_request
from kvtune.gateway.body import Body, BodyError, members, parse_body, splice
from kvtune.gateway.counting import (
    LocalTokenizerCounter, PromptCountError, PromptCountInvalidError, PromptRejectedError, make_counter,
)
from kvtune.gateway.endpoints import Endpoint, PathClass, canonical_path, classify
from kvtune.gateway.ledger import BlockLedger, Reservation
from kvtune.gateway.metrics import GatewayMetrics
from kvtune.gateway.upstream import UpstreamClient, UpstreamError, UpstreamTimeoutError
from kvtune.gateway.config import GatewayConfig, GatewayRoute

log = logging.getLogger("kvtune.gateway")

# RFC 9110 §7.6.1 connection-specific fields, plus what the proxy recomputes (Host, length) and
# the request's Content-Encoding (a governed body is forwarded decoded).
HOP_BY_HOP = frozenset({
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "proxy-connection",
    "te", "trailer", "trailers", "transfer-encoding", "upgrade",
})
_DROP_REQUEST = HOP_BY_HOP | {"host", "content-length", "content-encoding"}
_DROP_RESPONSE = HOP_BY_HOP
_DROP_WHOLE_RESPONSE = HOP_BY_HOP | {"content-length"}  # the gateway's server sets its own
# Request encodings the gateway decodes (zlib); others are refused on governed paths (415).
_DECODED_ENCODINGS = frozenset({"", "identity", "gzip", "deflate"})
_LOOPBACK = frozenset({"127.0.0.1", "::1", "::ffff:127.0.0.1"})
# Idle upstream connections are dropped after this, under the 5 s after which vLLM's server
# (uvicorn, --timeout-keep-alive) closes them: a longer pool hands out connections the upstream
# is closing, and the request fails with a reset (seen as 502s when a burst of /tokenize calls
# left a pool of connections idle behind a slow queue).
UPSTREAM_KEEPALIVE_S = 4.0


class Rejection(Exception):
    """An answer the gateway gives itself instead of the upstream's (4xx/5xx, OpenAI error body).
    `close` also ends the connection (a body left unread, a client too slow to finish)."""

    def __init__(self, status: int, code: str, message: str, *, retry_after_s: int | None = None,
                 close: bool = False, allow: str | None = None) -> None:
        super().__init__(message)
        self.status, self.code, self.message, self.retry_after_s = status, code, message, retry_after_s
        self.close, self.allow = close, allow

    def response(self) -> web.Response:
        kind = "rate_limit_error" if self.status == 429 else (
            "invalid_request_error" if 400 <= self.status < 500 else "server_error")
        headers = {}
        if self.retry_after_s is not None:
            headers["Retry-After"] = str(self.retry_after_s)
        if self.allow is not None:
            headers["Allow"] = self.allow
        body = {"error": {"message": self.message, "type": kind, "param": None, "code": self.code}}
        response = web.json_response(body, status=self.status, headers=headers or None)
        if self.close:
            response.force_close()
        return response


class Admission:
    """The ledger plus an optional bounded FIFO of requests waiting for blocks. Waiters are woken
    synchronously from `wake()`, right after a release, and handed a reservation already made."""

    def __init__(self, ledger: BlockLedger, *, max_waiting: int, timeout_s: float) -> None:
        self.ledger = ledger
        self.max_waiting = max_waiting
        self.timeout_s = timeout_s
        self._waiters: deque[tuple[int, asyncio.Future]] = deque()

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    def try_now(self, blocks: int) -> Reservation | None:
        if self._waiters:  # FIFO: nobody overtakes a request already waiting
            return None
        return self.ledger.try_reserve(blocks)

    def can_wait(self) -> bool:
        return len(self._waiters) < self.max_waiting

    async def wait(self, blocks: int) -> Reservation | None:
        """A reservation once `blocks` fit and every earlier waiter is served; None on timeout."""
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        entry = (blocks, fut)
        self._waiters.append(entry)
        granted: Reservation | None = None
        try:
            async with asyncio.timeout(self.timeout_s):
                granted = await fut
        except TimeoutError:
            pass
        finally:
            if granted is None:
                if fut.done() and not fut.cancelled():
                    fut.result().release()  # granted as we left: give it straight back
                else:
                    fut.cancel()
                try:
                    self._waiters.remove(entry)
                except ValueError:
                    pass
                self.wake()  # the head may have changed
        return granted

    def wake(self) -> None:
        while self._waiters:
            blocks, fut = self._waiters[0]
            if fut.done():
                self._waiters.popleft()
                continue
            reservation = self.ledger.try_reserve(blocks)
            if reservation is None:
                return
            self._waiters.popleft()
            fut.set_result(reservation)


@dataclass
class _Upstreams:
    clients: dict[str, UpstreamClient]  # by upstream URL: every request and every count
    counters: dict[str, Any]


@dataclass(frozen=True, slots=True)
class _Governed:
    """A request the gateway admits: where it goes, what it reserves, the body it forwards."""

    route: GatewayRoute | None
    upstream: str
    target: str
    blocks: int
    cap: int | None
    body: bytes


class Gateway:
    """Per-app state: config, ledger, admission, metrics; the upstream clients arrive on startup."""

    def __init__(self, config: GatewayConfig, *, counter: Any = None) -> None:
        self.config = config
        self.ledger = BlockLedger(config.block_budget)
        self.admission = Admission(self.ledger, max_waiting=config.queue_max_waiting,
                                   timeout_s=config.queue_timeout_s)
        self.metrics = GatewayMetrics(self.ledger, lambda: self.admission.waiting)
        self.rejected = 0
        # A local tokenizer loads now, so a bad tokenizer fails at start.
        self._fixed_counter = counter
        self._local: LocalTokenizerCounter | None = None
        if counter is None and config.prompt_tokens.method == "tokenizer":
            self._local = LocalTokenizerCounter.load(config.prompt_tokens.tokenizer)
        self._up: _Upstreams | None = None
        self._route_paths = config.route_paths()
        self._passthrough = frozenset(config.passthrough)
        self._admin_token: bytes | None = None
        if config.admin.token_env is not None:
            token = os.environ.get(config.admin.token_env, "")
            if not token:
                from kvtune.errors import InputError

                raise InputError(f"the environment variable {config.admin.token_env} holds no token",
                                 field="admin.token_env")
            self._admin_token = f"Bearer {token}".encode()

    # ---------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        cfg = self.config
        clients: dict[str, UpstreamClient] = {}
        counters: dict[str, Any] = {}
        for upstream in {cfg.upstream, *(r.upstream for r in cfg.routes if r.upstream)}:
            clients[upstream] = UpstreamClient(
                upstream, connect_timeout_s=cfg.upstream_connect_timeout_s,
                read_timeout_s=cfg.upstream_read_timeout_s, keepalive_s=UPSTREAM_KEEPALIVE_S)
            counters[upstream] = self._fixed_counter or make_counter(
                cfg.prompt_tokens, client=clients[upstream], local=self._local)
        self._up = _Upstreams(clients, counters)

    async def close(self) -> None:
        if self._up is not None:
            for client in self._up.clients.values():
                await client.close()
            self._up = None

    # ---------------------------------------------------------------- who may read what

    def allowed(self, request: web.Request, access: str) -> bool:
        """Whether `request` may read an admin endpoint with this access setting."""
        if access == "public":
            return True
        if access == "loopback":
            return request.remote in _LOOPBACK
        given = request.headers.get("Authorization", "").encode("utf-8", "surrogateescape")
        return self._admin_token is not None and hmac.compare_digest(given, self._admin_token)

    # ---------------------------------------------------------------- handlers

    async def handle(self, request: web.Request) -> web.StreamResponse:
        try:
            path, endpoint, route = self._classify(request)
            if endpoint.path_class is PathClass.PASSTHROUGH:
                raw = await self._read_body(request, decode=False)
                return await self._send(request, self.config.upstream, request.method,
                                        _with_query(path, request.raw_path), raw, {}, decoded=False)
            admitted = await self._admit(request, path, endpoint, route)
        except Rejection as rejection:
            return self._reject(None, rejection)
        except _Refused as refused:
            return self._reject(refused.route, refused.rejection)
        # Admitted: from here every path out of this function gives the blocks back once.
        reservation = admitted[1]
        governed = admitted[0]
        try:
            name = governed.route.name if governed.route else ""
            self.metrics.count_admitted(name, governed.blocks)
            extra = {"X-Kvtune-Reserved-Blocks": str(governed.blocks)}
            if governed.cap is not None:
                extra["X-Kvtune-Max-Tokens"] = str(governed.cap)
            return await self._send(request, governed.upstream, "POST", governed.target, governed.body, extra)
        finally:
            reservation.release()
            self.admission.wake()

    def _classify(self, request: web.Request) -> tuple[str, Endpoint, GatewayRoute | None]:
        """The request's path and class, or a Rejection for what is refused before any body."""
        if request.method in ("CONNECT", "TRACE"):
            raise Rejection(405, "method_not_allowed", f"{request.method} is not served", close=True)
        if _head_bytes(request) > self.config.limits.max_header_bytes:
            raise Rejection(431, "header_too_large", f"request heads are limited to "
                            f"{self.config.limits.max_header_bytes} bytes", close=True)
        if "Upgrade" in request.headers:
            raise Rejection(400, "upgrade_refused", "the gateway does not switch protocols", close=True)
        path = canonical_path(request.raw_path)
        if path is None:
            raise Rejection(400, "invalid_path", "the request path must be plain (no percent-escapes, "
                            "'//', '.' or '..' segments)")
        route = self._route_paths.get(path)
        if route is not None:
            endpoint = Endpoint(PathClass.GENERATE, route.api)
        else:
            endpoint = classify(path, self._passthrough)
        kind = endpoint.path_class
        if kind in (PathClass.GENERATE, PathClass.POOL):
            if request.method != "POST":
                raise Rejection(405, "method_not_allowed", f"{path} takes POST", allow="POST")
            encoding = request.headers.get("Content-Encoding", "").strip().lower()
            if encoding not in _DECODED_ENCODINGS:
                raise Rejection(415, "unsupported_encoding", "request bodies may be gzip or deflate encoded",
                                close=True)
        elif kind is PathClass.UNCOUNTABLE:
            raise Rejection(501, "uncountable_endpoint", f"{path} is not served through this gateway: "
                            f"{endpoint.reason}")
        elif kind is not PathClass.PASSTHROUGH:
            raise Rejection(404, "not_found", f"{path} is not served through this gateway")
        return path, endpoint, route

    async def _read_body(self, request: web.Request, *, decode: bool = True) -> bytes:
        """The whole request body within the size cap and the between-reads timeout; a gzip or
        deflate body is decoded (`decode`), the cap applying to what it decodes to."""
        limits = self.config.limits
        cap = limits.max_body_bytes
        if request.content_length is not None and request.content_length > cap:
            raise Rejection(413, "body_too_large", f"request bodies are limited to {cap} bytes", close=True)
        encoding = request.headers.get("Content-Encoding", "").strip().lower()
        decoder = _Decoder(encoding, cap) if decode and encoding in ("gzip", "deflate") else None
        chunks: list[bytes] = []
        size = received = 0
        content = request.content
        while True:
            try:
                async with asyncio.timeout(limits.body_timeout_s):
                    chunk = await content.readany()
                received += len(chunk)  # what came over the wire is bounded too, decoded or not
                if received > cap:
                    raise Rejection(413, "body_too_large", f"request bodies are limited to {cap} bytes", close=True)
            except TimeoutError:
                raise Rejection(408, "body_timeout", f"no request body bytes for {limits.body_timeout_s:g} s",
                                close=True) from None
            except (web.HTTPException, RequestPayloadError, HttpProcessingError, ValueError, OSError) as exc:
                raise Rejection(400, "invalid_body", f"the request body could not be read ({type(exc).__name__})",
                                close=True) from None
            if decoder is not None:
                chunk = decoder.feed(chunk) if chunk else decoder.finish()
                if not chunk and not decoder.done:
                    continue
            if not chunk:
                return b"".join(chunks)
            size += len(chunk)
            if size > cap:
                raise Rejection(413, "body_too_large", f"request bodies are limited to {cap} bytes", close=True)
            chunks.append(chunk)

    async def _admit(self, request: web.Request, path: str, endpoint: Endpoint,
                     route: GatewayRoute | None) -> tuple[_Governed, Reservation]:
        """Read, count and reserve a governed request; _Refused for every answer but admission."""
        raw = await self._read_body(request)
        try:
            body = parse_body(raw)
        except BodyError as exc:
            raise Rejection(400, exc.code, str(exc)) from None
        doc = body.doc
        model = doc.get("model") if isinstance(doc.get("model"), str) else None
        if endpoint.path_class is PathClass.GENERATE and route is None:
            route = self.config.route_for(path, model)
            if route is None:
                raise Rejection(404, "no_route", f"no route of this gateway serves {path} for this model")
        try:
            try:
                asked = read_request(endpoint.api, doc, pair_tokens=self.config.prompt_tokens.pair_tokens)
            except BodyError as exc:
                raise Rejection(400, exc.code, str(exc)) from None
            cap = self._cap(route, asked) if asked.generates else None
            upstream = (route.upstream if route else None) or self.config.upstream
            self._never_fits(asked, cap, self._lower_bounds(asked))
            counts = await self._count(upstream, asked, model)
            blocks = self._blocks(asked, cap, counts.tokens, counts.exact)
            forwarded = _rewrite(body, asked, cap) if cap is not None else raw
            target = _with_query((route.upstream_path if route else None) or path, request.raw_path)
            governed = _Governed(route, upstream, target, blocks, cap, forwarded)
            reservation = self.admission.try_now(blocks)
            if reservation is None:
                reservation = await self._wait_or_reject(blocks)
        except Rejection as rejection:
            raise _Refused(route, rejection) from None
        return governed, reservation

    def _cap(self, route: GatewayRoute, asked: Request) -> int:
        """The route's cap, or the client's own when it asked for less in any field the engine
        may read: every present cap field is then written with this one value."""
        cap = route.max_new_tokens
        for reading in asked.readings:
            if reading.requested_cap is not None:
                cap = min(cap, reading.requested_cap)
        return cap

    @staticmethod
    def _lower_bounds(asked: Request) -> list[int]:
        """Tokens each prompt holds at least, known without counting (token ids; 0 for text)."""
        return [p.token_count or 0 for p in asked.prompts]

    def _blocks(self, asked: Request, cap: int | None, tokens: tuple[int, ...] | list[int], exact: bool) -> int:
        """The reservation: the largest of the readings, each the sum over its sequences of
        ceil((prompt + cap) / block_size), times its copies; 400 for a prompt past the context,
        413 for what exceeds the whole budget."""
        cfg = self.config
        largest = 0
        for reading in asked.readings:
            prompts = [sum(tokens[i] for i in seq.parts) + seq.extra_tokens for seq in reading.sequences]
            for prompt in prompts:
                if exact and prompt + (1 if reading.generates else 0) > cfg.max_model_len:
                    raise Rejection(400, "context_length_exceeded",
                                    f"the prompt has {prompt} tokens; this deployment's context is "
                                    f"{cfg.max_model_len} tokens")
            grow = (cap or 0) if reading.generates else 0
            largest = max(largest, request_reserved_blocks((min(p, cfg.max_model_len) for p in prompts), grow,
                                                           cfg.block_size, reading.copies))
        if largest > cfg.block_budget:
            raise Rejection(413, "kv_reservation_exceeds_budget",
                            f"this request needs {largest} KV blocks but the whole budget is "
                            f"{cfg.block_budget}: it can never be admitted")
        return max(largest, 1)

    def _never_fits(self, asked: Request, cap: int | None, lower: list[int]) -> None:
        """413 before any count when even the cheapest reading of the request exceeds the budget
        (a batch of thousands of prompts is refused without a thousand /tokenize calls)."""
        cfg = self.config
        smallest = None
        for reading in asked.readings:
            grow = (cap or 0) if reading.generates else 0
            total = request_reserved_blocks((sum(lower[i] for i in seq.parts) + seq.extra_tokens
                                             for seq in reading.sequences), grow, cfg.block_size, reading.copies)
            smallest = total if smallest is None else min(smallest, total)
        if smallest is not None and smallest > cfg.block_budget:
            raise Rejection(413, "kv_reservation_exceeds_budget",
                            f"this request needs at least {smallest} KV blocks but the whole budget is "
                            f"{cfg.block_budget}: it can never be admitted")

    async def _count(self, upstream: str, asked: Request, model: str | None) -> Any:
        counter = self._up.counters[upstream]
        try:
            return await counter.count(asked.prompts, model)
        except PromptRejectedError as exc:
            code = "context_length_exceeded" if "context length" in str(exc) else "invalid_prompt"
            raise Rejection(400, code, str(exc)) from None
        except PromptCountInvalidError as exc:
            raise Rejection(502, "prompt_count_invalid", f"the gateway could not count the prompt: {exc}") from None
        except PromptCountError as exc:
            raise Rejection(503, "prompt_count_unavailable",
                            f"the gateway could not count the prompt: {exc}",
                            retry_after_s=self.config.retry_after_min_s) from None

    async def _wait_or_reject(self, blocks: int) -> Reservation:
        cfg, ledger = self.config, self.ledger
        reason = "kv_budget_exhausted"
        if cfg.queue_max_waiting > 0:
            if self.admission.can_wait():
                started = time.monotonic()
                reservation = await self.admission.wait(blocks)
                if reservation is not None:
                    self.metrics.queue_wait.observe(time.monotonic() - started)
                    return reservation
                reason = "queue_timeout"
            else:
                reason = "queue_full"
        retry = ledger.retry_after_s(blocks, min_s=cfg.retry_after_min_s, max_s=cfg.retry_after_max_s)
        self.metrics.retry_after.observe(retry)
        raise Rejection(429, reason,
                        f"KV budget full: {blocks} blocks needed, {ledger.reserved_blocks} of "
                        f"{ledger.budget_blocks} reserved; retry later", retry_after_s=retry)

    def _reject(self, route: GatewayRoute | None, rejection: Rejection) -> web.Response:
        self.rejected += 1
        self.metrics.count_rejected(route.name if route else "", rejection.code)
        if rejection.status in (502, 503, 504) or rejection.code in ("body_timeout", "body_too_large"):
            log.warning("refused %s: %s", rejection.code, rejection.message[:200])
        return rejection.response()

    async def _send(self, request: web.Request, upstream: str, method: str, target: str, body: bytes,
                    extra_headers: dict[str, str], *, decoded: bool = True) -> web.StreamResponse:
        """A request whose body is in hand, through the gateway's own upstream client; a body
        the gateway decoded goes without its Content-Encoding."""
        headers = _forward_headers(request.headers, drop_encoding=decoded)
        try:
            up = await self._up.clients[upstream].request(method, target, headers, body)
        except UpstreamTimeoutError:
            return Rejection(504, "upstream_timeout", "the upstream did not answer in time").response()
        except UpstreamError as exc:
            return Rejection(502, "upstream_unavailable", f"the upstream could not be reached: {exc}").response()
        return await self._relay(request, up, extra_headers)

    async def _relay(self, request: web.Request, up: Any, extra_headers: dict[str, str]) -> web.StreamResponse:
        """Send the upstream's answer back, chunk by chunk as it arrives; a client that accepts
        nothing for send_timeout_s is cut off (its upstream call and reservation with it)."""
        finished = False
        send_timeout = self.config.limits.send_timeout_s
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
                    return Rejection(504, "upstream_timeout", "the upstream did not answer in time").response()
                except UpstreamError as exc:
                    return Rejection(502, "upstream_broken", f"the upstream's answer broke off: {exc}").response()
                finished = True
                return web.Response(status=up.status, reason=up.reason, body=body, headers=headers)
            response = web.StreamResponse(status=up.status, reason=up.reason, headers=headers)
            await response.prepare(request)
            try:
                async for chunk in up.iter_chunks():
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
            finished = True
            await response.write_eof()
            return response
        finally:
            # An unfinished upstream body closes its connection, which makes vLLM abort the request.
            if finished:
                up.release()
            else:
                up.close()


class _Refused(Exception):
    """A Rejection of a request already matched to a route (for the metrics' route label)."""

    def __init__(self, route: GatewayRoute | None, rejection: Rejection) -> None:
        super().__init__(rejection.message)
        self.route, self.rejection = route, rejection


class _Decoder:
    """A gzip or deflate request body decoded as it arrives, never past `cap` + 1 bytes of
    output however small the input (a decompression bomb stops at the cap, not in memory).
    gzip may hold several members one after another (RFC 1952); anything after the last one,
    or a stream that stops early, is not a body."""

    def __init__(self, encoding: str, cap: int) -> None:
        self._encoding, self._cap, self._out = encoding, cap, 0
        self._z: Any = None
        self.done = False

    def feed(self, data: bytes) -> bytes:
        pieces = []
        while data:
            if self._z is None or (self._z.eof and self._encoding == "gzip"):
                # deflate should be zlib-wrapped (RFC 9110), but raw deflate is common: sniff it
                wbits = 31 if self._encoding == "gzip" else 15 if data[0] & 0x0F == 8 else -15
                self._z = zlib.decompressobj(wbits)
            elif self._z.eof:
                raise Rejection(400, "invalid_body", f"bytes after the end of the {self._encoding} stream", close=True)
            try:
                out = self._z.decompress(data, self._cap + 1 - self._out)
            except zlib.error:
                raise Rejection(400, "invalid_body", f"the request body is not valid {self._encoding}",
                                close=True) from None
            self._out += len(out)
            pieces.append(out)
            if self._z.unconsumed_tail:  # more output than the cap allows
                raise Rejection(413, "body_too_large", f"request bodies are limited to {self._cap} bytes", close=True)
            data = self._z.unused_data
        return b"".join(pieces)

    def finish(self) -> bytes:
        self.done = True
        if self._z is None or not self._z.eof:
            raise Rejection(400, "invalid_body", f"the {self._encoding} body ends early", close=True)
        return b""


def _head_bytes(request: web.Request) -> int:
    """The size of the request head as it came: request line and every field line."""
    size = len(request.method) + len(request.raw_path) + 13  # " ", " HTTP/1.1\r\n"
    for name, value in request.raw_headers:
        size += len(name) + len(value) + 4
    return size


def _with_query(path: str, raw_path: str) -> str:
    """`path` with the query string of the original request target, untouched."""
    _, sep, query = raw_path.partition("?")
    return f"{path}?{query}" if sep else path


def _rewrite(body: Body, asked: Request, cap: int) -> bytes:
    """The body with every cap field the request's readings read set to `cap` (the first one
    added where none is present) and a min_tokens above the cap lowered to it; nothing else."""
    fields: dict[CapField, None] = {}
    adds: dict[CapField, None] = {}
    floors: dict[CapField, None] = {}
    for reading in asked.readings:
        if not reading.generates:
            continue
        present = [f for f in reading.caps if _has(body.doc, f)]
        fields.update(dict.fromkeys(present))
        if not present and reading.add_cap is not None:
            adds[reading.add_cap] = None
        if reading.min_tokens is not None:
            floors[reading.min_tokens] = None
    value = str(cap).encode()
    edits: dict[int, tuple[int, bytes]] = {}
    inserts: list[tuple[int, bytes]] = []
    spans = {None: (body.open_at, list(body.top))}
    for f in [*fields, *adds, *floors]:
        if f.parent not in spans:
            parent = body.member(f.parent)
            spans[f.parent] = (parent.start, members(body.raw, parent.start))
    for f in fields:
        m = _member(spans, f)
        edits[m.start] = (m.end, value)
    for f in floors:
        floor = _value(body.doc, f)
        if isinstance(floor, (int, float)) and not isinstance(floor, bool) and floor > cap:
            m = _member(spans, f)
            edits[m.start] = (m.end, value)
    for f in adds:
        if f in fields:
            continue
        open_at, existing = spans[f.parent]
        sep = b"," if existing else b""
        inserts.append((open_at + 1, b'"' + f.key.encode() + b'":' + value + sep))
    out = body.raw
    if inserts or edits:
        out = _apply(body.raw, edits, inserts)
    return out


def _apply(raw: bytes, edits: dict[int, tuple[int, bytes]], inserts: list[tuple[int, bytes]]) -> bytes:
    merged = dict(edits)
    for position, text in inserts:
        start, (end, new) = position, merged.get(position, (position, b""))
        merged[start] = (end, text + new)
    return splice(raw, merged)


def _has(doc: dict, f: CapField) -> bool:
    holder = doc if f.parent is None else doc.get(f.parent)
    return isinstance(holder, dict) and f.key in holder


def _value(doc: dict, f: CapField) -> Any:
    holder = doc if f.parent is None else doc.get(f.parent)
    return holder.get(f.key) if isinstance(holder, dict) else None


def _member(spans: dict, f: CapField):
    _, found = spans[f.parent]
    return next(m for m in reversed(found) if m.key == f.key)


_WHOLE_BODY_MAX_BYTES = 1024 * 1024


def _whole_body(method: str, up: Any) -> bool:
    """True for an answer sent with a Content-Length of at most 1 MiB that is not an event
    stream: it can go back as one response without delaying a single byte a client could use.
    Streams (chunked, SSE) and anything large go through chunk by chunk."""
    if method == "HEAD" or up.status < 200 or up.status in (204, 304):
        return False
    length = up.content_length
    if length is None or length > _WHOLE_BODY_MAX_BYTES:
        return False
    return not up.headers.get("Content-Type", "").startswith("text/event-stream")


def _connection_tokens(headers: Any) -> list[str]:
    return [t.strip() for v in headers.getall("Connection", []) for t in v.split(",") if t.strip()]


def _forward_headers(headers: Any, *, drop_encoding: bool = True) -> list[tuple[str, str]]:
    drop = _DROP_REQUEST if drop_encoding else _DROP_REQUEST - {"content-encoding"}
    if "Connection" in headers:
        drop = drop.union(t.lower() for t in _connection_tokens(headers))
    return [(k, v) for k, v in headers.items() if k.lower() not in drop]


def _response_headers(headers: Any, whole: bool) -> CIMultiDict:
    """The upstream's answer headers less hop-by-hop ones and those its Connection names; less
    Content-Length too for a whole body, which the gateway's server sets itself."""
    drop = _DROP_WHOLE_RESPONSE if whole else _DROP_RESPONSE
    if "Connection" in headers:
        drop = drop.union(t.lower() for t in _connection_tokens(headers))
    return CIMultiDict([(k, v) for k, v in headers.items() if k.lower() not in drop])


# ---------------------------------------------------------------- the app

GATEWAY = web.AppKey("kvtune_gateway", Gateway)


async def _lifecycle(app: web.Application) -> AsyncIterator[None]:
    gateway = app[GATEWAY]
    await gateway.start()
    try:
        yield
    finally:
        await gateway.close()


async def _healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def _metrics(request: web.Request) -> web.Response:
    """The gateway's Prometheus metrics (budget, reserved and in-flight blocks, admissions and
    refusals by route and reason); who may read them is admin.metrics."""
    gw = request.app[GATEWAY]
    if not gw.allowed(request, gw.config.admin.metrics):
        raise web.HTTPForbidden()
    payload, content_type = gw.metrics.exposition()
    return web.Response(body=payload, headers={"Content-Type": content_type})


async def _ledger(request: web.Request) -> web.Response:
    """The same JSON as the rendered nginx.conf's /kvtune/ledger; who may read it is admin.ledger."""
    gw = request.app[GATEWAY]
    if not gw.allowed(request, gw.config.admin.ledger):
        raise web.HTTPForbidden()
    snap = gw.ledger.snapshot()
    return web.json_response({
        "reserved": snap.reserved_blocks, "budget": snap.budget_blocks, "inflight": snap.inflight_requests,
        "rejected": gw.rejected, "waiting": gw.admission.waiting,
        "release_rate_blocks_per_s": snap.release_rate_blocks_per_s,
        "routes": [r.name for r in gw.config.routes],
    })


def make_app(config: GatewayConfig, *, counter: Any = None) -> web.Application:
    """The gateway as an aiohttp Application; run it with `handler_cancellation=True` (serve does)
    so a client that goes away cancels its upstream call and releases its blocks at once."""
    app = web.Application(client_max_size=config.limits.max_body_bytes + 1)
    gateway = Gateway(config, counter=counter)
    app[GATEWAY] = gateway
    app.cleanup_ctx.append(_lifecycle)
    app.router.add_get("/healthz", _healthz)
    app.router.add_get("/metrics", _metrics)
    app.router.add_get("/kvtune/ledger", _ledger)
    app.router.add_route("*", "/{tail:.*}", gateway.handle)
    return app


def loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's event loop when it is installed (it cuts the proxy's per-request CPU, mostly in
    socket writes), else None: asyncio's own. For asyncio.Runner(loop_factory=...)."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


async def serve(config: GatewayConfig, *, stop: asyncio.Event,
                on_ready: Callable[[str], Awaitable[None] | None] | None = None,
                app: web.Application | None = None) -> Gateway:
    """Serve until `stop` is set, then drain: stop accepting, give in-flight streams up to
    drain_timeout_s to finish, cancel the rest (their reservations release in `finally`).
    `app` is make_app(config) unless given (tests keep a handle on its Gateway)."""
    from kvtune.gateway.connections import listen

    app = app if app is not None else make_app(config)
    runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=config.drain_timeout_s,
                           access_log=None)
    await runner.setup()
    listener = None
    try:
        listener, _ = await listen(runner, config.host, config.port, config.limits)
        if on_ready is not None:
            addresses = ", ".join(_address(sock.getsockname()) for sock in listener.sockets)
            result = on_ready(addresses)
            if asyncio.iscoroutine(result):
                await result
        await stop.wait()
    finally:
        if listener is not None:
            listener.close()  # stop accepting; open connections drain in cleanup
        await runner.cleanup()
    return app[GATEWAY]


def _address(name: Any) -> str:
    host, port = name[0], name[1]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


__all__ = ["make_app", "serve", "loop_factory", "Gateway", "Admission", "Rejection", "GATEWAY"]
