"""The admission gateway: an aiohttp reverse proxy that enforces the reservation policy.

One request flows one way through three stages, each in its own module:
  intake     (kvtune.gateway.intake)     classify the path, refuse what is refused before any
                                         body, read the body within its bounds
  admission  (kvtune.gateway.admission)  read it by its API's rules, match a route, clamp the
                                         cap, count the prompt, reserve the KV blocks
  relay      (kvtune.gateway.relay)      forward it upstream and stream the answer back
This module wires them into an aiohttp application with the admin endpoints
(kvtune.gateway.admin), the upstream clients and the prompt counters, and serves it. The
reservation is released in `finally`, before any await, so every ending (completion, client
disconnect, upstream error, cancellation, shutdown) releases it once.

Clients are bounded (kvtune.gateway.connections and the limits in gateway.yaml): a deadline for
each request head and between body reads and writes, caps on head and body size, on open
connections; CONNECT and Upgrade are refused.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from kvtune.gateway.admin import Admin
from kvtune.gateway.admission import Admission
from kvtune.gateway.config import CountingMethod, GatewayConfig, GatewayRoute
from kvtune.gateway.counting import LocalTokenizerCounter, PromptCounter, make_counter
from kvtune.gateway.endpoints import PathClass
from kvtune.gateway.gate import ledger_for
from kvtune.gateway.intake import Intake
from kvtune.gateway.metrics import GatewayMetrics
from kvtune.gateway.refusals import Reason, Refused, Rejection
from kvtune.gateway.relay import Relay, refusal_response
from kvtune.gateway.upstream import UpstreamClient

log = logging.getLogger("kvtune.gateway")

# Idle upstream connections are dropped after this, under the 5 s after which vLLM's server
# (uvicorn, --timeout-keep-alive) closes them: a longer pool hands out connections the upstream
# is closing, and the request fails with a reset (seen as 502s when a burst of /tokenize calls
# left a pool of connections idle behind a slow queue).
UPSTREAM_KEEPALIVE_S = 4.0
# Besides 502/503/504, the refusals that get a log line: clients too slow or too large.
_LOGGED = frozenset({Reason.BODY_TIMEOUT, Reason.BODY_TOO_LARGE})


@dataclass
class _Upstreams:
    clients: dict[str, UpstreamClient]  # by upstream URL: every request and every count
    counters: dict[str, PromptCounter]


class Gateway:
    """Per-app state: config, ledger, the three stages, metrics; the upstream clients arrive on
    startup."""

    def __init__(self, config: GatewayConfig, *, counter: PromptCounter | None = None) -> None:
        self.config = config
        self.ledger = ledger_for(config.admission, config.block_budget, block_size=config.block_size,
                                 max_model_len=config.max_model_len)
        self.metrics = GatewayMetrics(self.ledger, lambda: self.admission.waiting)
        self.intake = Intake(config)
        self.admission = Admission(config, self.ledger, self.metrics)
        self.relay = Relay(config.limits.send_timeout_s)
        self.rejected = 0
        # A local tokenizer loads now, so a bad tokenizer fails at start.
        self._fixed_counter = counter
        self._local: LocalTokenizerCounter | None = None
        tokenizer = config.prompt_tokens.tokenizer
        if counter is None and config.prompt_tokens.method is CountingMethod.TOKENIZER and tokenizer is not None:
            self._local = LocalTokenizerCounter.load(tokenizer)
        self.admin = Admin(config, self.ledger, self.metrics, rejected=lambda: self.rejected,
                           waiting=lambda: self.admission.waiting)
        self._up: _Upstreams | None = None

    # ---------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        cfg = self.config
        clients: dict[str, UpstreamClient] = {}
        counters: dict[str, PromptCounter] = {}
        for upstream in {cfg.upstream, *(r.upstream for r in cfg.routes if r.upstream)}:
            clients[upstream] = UpstreamClient(
                upstream, connect_timeout_s=cfg.upstream_connect_timeout_s,
                read_timeout_s=cfg.upstream_read_timeout_s, keepalive_s=UPSTREAM_KEEPALIVE_S)
            counters[upstream] = self._fixed_counter or make_counter(
                cfg.prompt_tokens, client=clients[upstream], local=self._local)
        self._up = _Upstreams(clients, counters)
        self.admission.counters = counters

    async def close(self) -> None:
        if self._up is not None:
            for client in self._up.clients.values():
                await client.close()
            self._up = None
            self.admission.counters = {}

    def _client(self, upstream: str) -> UpstreamClient:
        if self._up is None:
            raise RuntimeError("the gateway is not started")
        return self._up.clients[upstream]

    # ---------------------------------------------------------------- the handler

    async def handle(self, request: web.Request) -> web.StreamResponse:
        """intake -> admission -> relay for every path the admin endpoints do not serve."""
        try:
            incoming = self.intake.classify(request)
            if incoming.endpoint.path_class is PathClass.PASSTHROUGH:
                raw = await self.intake.read_body(request, decode=False)
                return await self.relay.send(request, self._client(self.config.upstream), request.method,
                                             incoming.target(incoming.path), raw, {}, decoded=False)
            raw = await self.intake.read_body(request)
            admitted = await self.admission.admit(incoming, raw)
        except Rejection as rejection:
            return self._reject(None, rejection)
        except Refused as refused:
            return self._reject(refused.route, refused.rejection)
        # Admitted: from here every path out of this function gives the blocks back once.
        try:
            self.metrics.count_admitted(admitted.route.name if admitted.route else "", admitted.blocks)
            extra = {"X-Kvtune-Reserved-Blocks": str(admitted.blocks)}
            if admitted.cap is not None:
                extra["X-Kvtune-Max-Tokens"] = str(admitted.cap)
            return await self.relay.send(request, self._client(admitted.upstream), "POST", admitted.target,
                                         admitted.body, extra, progress=admitted.reservation.progress)
        finally:
            self.admission.release(admitted)

    def _reject(self, route: GatewayRoute | None, rejection: Rejection) -> web.Response:
        self.rejected += 1
        self.metrics.count_rejected(route.name if route else "", rejection.reason)
        if rejection.status in (502, 503, 504) or rejection.reason in _LOGGED:
            log.warning("refused %s: %s", rejection.code, rejection.message[:200])
        return refusal_response(rejection)


# ---------------------------------------------------------------- the app

GATEWAY = web.AppKey("kvtune_gateway", Gateway)


async def _lifecycle(app: web.Application) -> AsyncIterator[None]:
    gateway = app[GATEWAY]
    await gateway.start()
    try:
        yield
    finally:
        await gateway.close()


def make_app(config: GatewayConfig, *, counter: PromptCounter | None = None) -> web.Application:
    """The gateway as an aiohttp Application; run it with `handler_cancellation=True` (serve does)
    so a client that goes away cancels its upstream call and releases its blocks at once."""
    app = web.Application(client_max_size=config.limits.max_body_bytes + 1)
    gateway = Gateway(config, counter=counter)
    app[GATEWAY] = gateway
    app.cleanup_ctx.append(_lifecycle)
    gateway.admin.add_routes(app.router)
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


__all__ = ["make_app", "serve", "loop_factory", "Gateway", "GATEWAY"]
