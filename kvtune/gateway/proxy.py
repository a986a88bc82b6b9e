"""The admission gateway: an aiohttp reverse proxy that enforces the reservation policy.

A generation request (POST to chat, completions, responses, or a path in the route table) is
matched to a route, its output cap is clamped to the route's cap (and set when absent; a
min_tokens above it comes down to it, which vLLM requires), its prompt
is counted, and sequences x ceil((prompt + cap) / block_size) KV blocks are reserved for its whole
life. A full budget answers 429 with Retry-After from the observed release rate; a request that
can never fit answers 400/413 at once. Everything else is passed through untouched. Responses
stream chunk by chunk. The reservation is released in `finally`, before any await, so every
ending (completion, client disconnect, upstream error, cancellation, shutdown) releases it once.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web
from multidict import CIMultiDict
from yarl import URL

from kvtune.gateway import _json
from kvtune.gateway.counting import (
    PromptCountError, PromptRejectedError, make_counter,
)
from kvtune.gateway.ledger import BlockLedger, Reservation, reservation_blocks
from kvtune.gateway.metrics import GatewayMetrics
from kvtune.gateway.upstream import UpstreamClient, UpstreamError, UpstreamTimeoutError
from kvtune.gateway_config import GatewayConfig, GatewayRoute

GENERATION_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/responses"})
CAP_FIELDS = ("max_tokens", "max_completion_tokens", "max_output_tokens")
SEQUENCE_FIELDS = ("n", "best_of")
# RFC 9110 §7.6.1 connection-specific fields, plus what the proxy recomputes (Host, length).
HOP_BY_HOP = frozenset({
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "proxy-connection",
    "te", "trailer", "trailers", "transfer-encoding", "upgrade",
})
_DROP_REQUEST = HOP_BY_HOP | {"host", "content-length"}
_DROP_RESPONSE = HOP_BY_HOP
_DROP_WHOLE_RESPONSE = HOP_BY_HOP | {"content-length"}  # the gateway's server sets its own
_LOOPBACK = frozenset({"127.0.0.1", "::1"})
_MAX_COUNT = 2**31
# Idle upstream connections are dropped after this, under the 5 s after which vLLM's server
# (uvicorn, --timeout-keep-alive) closes them: a longer pool hands out connections the upstream
# is closing, and the request fails with a reset (seen as 502s when a burst of /tokenize calls
# left a pool of connections idle behind a slow queue).
UPSTREAM_KEEPALIVE_S = 4.0


class Rejection(Exception):
    """An answer the gateway gives itself instead of the upstream's (4xx/5xx, OpenAI error body)."""

    def __init__(self, status: int, code: str, message: str, *, retry_after_s: int | None = None) -> None:
        super().__init__(message)
        self.status, self.code, self.message, self.retry_after_s = status, code, message, retry_after_s

    def response(self) -> web.Response:
        kind = {429: "rate_limit_error", 413: "invalid_request_error", 400: "invalid_request_error"}.get(
            self.status, "server_error")
        headers = {"Retry-After": str(self.retry_after_s)} if self.retry_after_s is not None else None
        body = {"error": {"message": self.message, "type": kind, "param": None, "code": self.code}}
        return web.json_response(body, status=self.status, headers=headers)


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
    session: aiohttp.ClientSession  # pass-through traffic (streamed bodies, anything not governed)
    clients: dict[str, UpstreamClient]  # governed requests and /tokenize, by upstream URL
    counters: dict[str, Any]


class Gateway:
    """Per-app state: config, ledger, admission, metrics; the upstream session arrives on startup."""

    def __init__(self, config: GatewayConfig, *, counter: Any = None) -> None:
        self.config = config
        self.ledger = BlockLedger(config.block_budget)
        self.admission = Admission(self.ledger, max_waiting=config.queue_max_waiting,
                                   timeout_s=config.queue_timeout_s)
        self.metrics = GatewayMetrics(self.ledger, lambda: self.admission.waiting)
        self.rejected = 0
        # A local counter (tokenizer, estimate) loads now, so a bad tokenizer fails at start.
        self._fixed_counter = counter
        if counter is None and config.prompt_tokens.method != "upstream-tokenize":
            self._fixed_counter = make_counter(config.prompt_tokens)
        self._up: _Upstreams | None = None
        self.route_paths = tuple(r.match.path for r in config.routes if r.match.path is not None)

    # ---------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        cfg = self.config
        connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300, keepalive_timeout=UPSTREAM_KEEPALIVE_S)
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=cfg.upstream_connect_timeout_s,
                                        sock_read=cfg.upstream_read_timeout_s)
        # No cookie jar: a proxy must not keep one client's Set-Cookie and replay it for the
        # next (and the jar's per-request filtering is pure overhead).
        session = aiohttp.ClientSession(
            connector=connector, timeout=timeout, auto_decompress=False, cookie_jar=aiohttp.DummyCookieJar(),
            skip_auto_headers=("User-Agent", "Accept-Encoding", "Content-Type"),
        )
        clients: dict[str, UpstreamClient] = {}
        counters: dict[str, Any] = {}
        for upstream in {cfg.upstream, *(r.upstream for r in cfg.routes if r.upstream)}:
            clients[upstream] = UpstreamClient(
                upstream, connect_timeout_s=cfg.upstream_connect_timeout_s,
                read_timeout_s=cfg.upstream_read_timeout_s, keepalive_s=UPSTREAM_KEEPALIVE_S)
            counters[upstream] = self._fixed_counter or make_counter(cfg.prompt_tokens, client=clients[upstream])
        self._up = _Upstreams(session, clients, counters)

    async def close(self) -> None:
        if self._up is not None:
            for client in self._up.clients.values():
                await client.close()
            await self._up.session.close()
            self._up = None

    # ---------------------------------------------------------------- handlers

    async def handle(self, request: web.Request) -> web.StreamResponse:
        path = request.path
        if request.method == "POST" and (path in GENERATION_PATHS or self._route_path(path)):
            return await self._governed(request)
        return await self._forward(request, self.config.upstream)

    def _route_path(self, path: str) -> bool:
        return any(path.startswith(p[:-1]) if p.endswith("*") else path == p for p in self.route_paths)

    async def _governed(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        try:
            doc = _json.loads(raw)
        except (ValueError, UnicodeDecodeError):
            doc = None
        if not isinstance(doc, dict):
            return self._reject(None, Rejection(400, "invalid_json", "request body must be a JSON object"))
        model = doc.get("model") if isinstance(doc.get("model"), str) else None
        route = self.config.route_for(request.path, model)
        if route is None:
            return await self._send(request, self.config.upstream, raw, {})
        try:
            cap, sequences = self._clamp(route, doc)
            blocks = await self._blocks(route, doc, cap, sequences)
            reservation = self.admission.try_now(blocks)
            if reservation is None:
                reservation = await self._wait_or_reject(blocks)
        except Rejection as rejection:
            return self._reject(route, rejection)
        # Admitted: from here every path out of this function gives the blocks back once.
        try:
            self.metrics.count_admitted(route.name, blocks)
            present = [k for k in CAP_FIELDS if k in doc]
            for key in present or ["max_output_tokens" if request.path == "/v1/responses" else "max_tokens"]:
                doc[key] = cap
            # vLLM refuses min_tokens > max_tokens: a floor above the cap comes down with it
            floor = doc.get("min_tokens")
            if isinstance(floor, (int, float)) and not isinstance(floor, bool) and floor > cap:
                doc["min_tokens"] = cap
            body = _json.dumps_bytes(doc)
            extra = {"X-Kvtune-Reserved-Blocks": str(blocks), "X-Kvtune-Max-Tokens": str(cap)}
            return await self._send(request, route.upstream or self.config.upstream, body, extra)
        finally:
            reservation.release()
            self.admission.wake()

    def _clamp(self, route: GatewayRoute, doc: dict) -> tuple[int, int]:
        """The effective cap (route cap, or lower if the client asked for less) and sequences."""
        cap = route.max_new_tokens
        for key in CAP_FIELDS:
            value = doc.get(key)
            if value is not None:
                cap = min(cap, _count(key, value))
        sequences = 1
        for key in SEQUENCE_FIELDS:
            value = doc.get(key)
            if value is not None:
                sequences = max(sequences, _count(key, value))
        return cap, sequences

    async def _blocks(self, route: GatewayRoute, doc: dict, cap: int, sequences: int) -> int:
        cfg = self.config
        counter = self._up.counters[route.upstream or cfg.upstream]
        try:
            counted = await counter.count(doc)
        except PromptRejectedError as exc:
            code = "context_length_exceeded" if "context length" in str(exc) else "invalid_prompt"
            raise Rejection(400, code, str(exc)) from None
        except PromptCountError as exc:
            raise Rejection(503, "prompt_count_unavailable",
                            f"the gateway could not count the prompt: {exc}",
                            retry_after_s=cfg.retry_after_min_s) from None
        prompts = list(counted.tokens)
        if counted.exact:
            for p in prompts:
                if p >= cfg.max_model_len:
                    raise Rejection(400, "context_length_exceeded",
                                    f"the prompt has {p} tokens; this deployment's context is "
                                    f"{cfg.max_model_len} tokens")
        prompts = [min(p, cfg.max_model_len) for p in prompts]
        blocks = reservation_blocks(prompts, cap, sequences, cfg.block_size)
        if blocks > cfg.block_budget:
            raise Rejection(413, "kv_reservation_exceeds_budget",
                            f"this request needs {blocks} KV blocks but the whole budget is "
                            f"{cfg.block_budget}: it can never be admitted")
        return blocks

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
        return rejection.response()

    async def _send(self, request: web.Request, upstream: str, body: bytes,
                    extra_headers: dict[str, str]) -> web.StreamResponse:
        """A request whose body is in hand, through the gateway's own upstream client."""
        try:
            up = await self._up.clients[upstream].request(
                request.method, request.raw_path, _forward_headers(request.headers), body)
        except UpstreamTimeoutError:
            return Rejection(504, "upstream_timeout", "the upstream did not answer in time").response()
        except UpstreamError as exc:
            return Rejection(502, "upstream_unavailable", f"the upstream could not be reached: {exc}").response()
        return await self._relay(request, up, up.iter_chunks, extra_headers)

    async def _forward(self, request: web.Request, upstream: str) -> web.StreamResponse:
        """Anything not governed, body streamed as it arrives, through aiohttp's client."""
        headers = _forward_headers(request.headers)
        data = request.content if request.body_exists else None
        url = URL(upstream.rstrip("/") + request.raw_path, encoded=True)
        try:
            up = await self._up.session.request(request.method, url, headers=headers, data=data,
                                                allow_redirects=False)
        except (aiohttp.ServerTimeoutError, TimeoutError):
            return Rejection(504, "upstream_timeout", "the upstream did not answer in time").response()
        except aiohttp.ClientError as exc:
            return Rejection(502, "upstream_unavailable",
                             f"the upstream could not be reached: {type(exc).__name__}").response()
        return await self._relay(request, up, up.content.iter_any, {})

    async def _relay(self, request: web.Request, up: Any, chunks: Callable[[], AsyncIterator[bytes]],
                     extra_headers: dict[str, str]) -> web.StreamResponse:
        """Send the upstream's answer back, chunk by chunk as it arrives."""
        finished = False
        try:
            whole = _whole_body(request.method, up)
            headers = _response_headers(up.headers, whole)
            headers.update(extra_headers)
            if whole:
                # A complete answer of known, small length (vLLM's non-streaming JSON): read it and
                # send status, headers and body in one write instead of three.
                body = await up.read()
                finished = True
                return web.Response(status=up.status, reason=up.reason, body=body, headers=headers)
            response = web.StreamResponse(status=up.status, reason=up.reason, headers=headers)
            await response.prepare(request)
            async for chunk in chunks():
                await response.write(chunk)
            finished = True
            await response.write_eof()
            return response
        finally:
            # An unfinished upstream body closes its connection, which makes vLLM abort the request.
            if finished:
                up.release()
            else:
                up.close()


def _count(key: str, value: Any) -> int:
    """A positive integer field (max_tokens, n, ...) or a 400."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value) \
            or not 1 <= value < _MAX_COUNT:
        raise Rejection(400, f"invalid_{key}" if key in SEQUENCE_FIELDS else "invalid_max_tokens",
                        f"{key} must be a positive integer")
    return int(value)


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


def _forward_headers(headers: Any) -> list[tuple[str, str]]:
    drop = _DROP_REQUEST
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
    payload, content_type = request.app[GATEWAY].metrics.exposition()
    return web.Response(body=payload, headers={"Content-Type": content_type})


async def _ledger(request: web.Request) -> web.Response:
    """The same JSON as the rendered nginx.conf's /kvtune/ledger, loopback only."""
    if request.remote not in _LOOPBACK:
        raise web.HTTPForbidden()
    gw = request.app[GATEWAY]
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
    app = web.Application(client_max_size=64 * 1024 * 1024)
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
    app = app if app is not None else make_app(config)
    runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=config.drain_timeout_s,
                           access_log=None)
    await runner.setup()
    try:
        site = web.TCPSite(runner, config.host, config.port, backlog=1024)
        await site.start()
        if on_ready is not None:
            addresses = ", ".join(f"http://{a[0]}:{a[1]}" if isinstance(a, tuple) else str(a)
                                  for a in runner.addresses)
            result = on_ready(addresses)
            if asyncio.iscoroutine(result):
                await result
        await stop.wait()
    finally:
        await runner.cleanup()
    return app[GATEWAY]


__all__ = ["make_app", "serve", "loop_factory", "Gateway", "Admission", "Rejection", "GATEWAY", "GENERATION_PATHS"]
