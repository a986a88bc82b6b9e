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

Several upstreams (gateway.yaml `upstreams:`) share one pool (kvtune.gateway.pool): each request
is reserved on one and forwarded there; a connect that fails, or the periodic GET health.path,
takes an upstream out, a 200 brings it back; a run of health.consecutive_failures answers that
are 5xx (or connections that failed) ejects it for a while, whatever /health says (passive
health: kvtune.gateway.pool's `record`), and a timer brings it back. A request whose connection could not be opened was
not sent at all, so it gives its blocks back there and is admitted again for another upstream;
one that was sent is never sent again (the engine may have started it).

Clients are bounded (kvtune.gateway.connections and the limits in gateway.yaml): a deadline for
each request head and between body reads and writes, caps on head and body size, on open
connections; CONNECT and Upgrade are refused.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import suppress
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from kvtune.domain.route import Route
from kvtune.gateway.admin import Admin
from kvtune.gateway.admission import Admission
from kvtune.gateway.config import CountingMethod, GatewayConfig
from kvtune.gateway.connections import listen
from kvtune.gateway.counting import LocalTokenizerCounter, PromptCounter, make_counter
from kvtune.gateway.endpoints import PathClass
from kvtune.gateway.flow import FlowGate
from kvtune.gateway.intake import Incoming, Intake
from kvtune.gateway.metrics import GatewayMetrics
from kvtune.gateway.pool import LedgerFactory, Replica, UpstreamPool, local_ledger
from kvtune.gateway.refusals import RefusalLog, Refused, Rejection
from kvtune.gateway.relay import Relay, refusal_response
from kvtune.gateway.shared import SharedLedger
from kvtune.gateway.upstream import UpstreamClient, UpstreamConnectError, UpstreamError

log = logging.getLogger("kvtune.gateway")

# Idle upstream connections are dropped after this, under the 5 s after which vLLM's server
# (uvicorn, --timeout-keep-alive) closes them: a longer pool hands out connections the upstream
# is closing, and the request fails with a reset (seen as 502s when a burst of /tokenize calls
# left a pool of connections idle behind a slow queue).
UPSTREAM_KEEPALIVE_S = 4.0

# The outcome passive health records for a connection that could not be opened (a 5xx of its own).
CONNECT_FAILED = 599


@dataclass
class _Upstreams:
    clients: dict[str, UpstreamClient]  # by upstream URL: every request and every count
    counters: dict[str, PromptCounter]


class Gateway:
    """Per-app state: config, the upstreams and their ledgers (kvtune.gateway.pool), the three
    stages, metrics; the upstream clients arrive on startup, with the health probe when there
    are several upstreams. `make_ledger` builds each upstream's ledger (in memory by default)."""

    def __init__(self, config: GatewayConfig, *, counter: PromptCounter | None = None,
                 make_ledger: LedgerFactory = local_ledger) -> None:
        self.config = config
        self.pool = UpstreamPool(config, make_ledger)
        self.ledger = self.pool  # the totals; each upstream's own ledger is in pool.replicas
        self.metrics = GatewayMetrics(self.pool, lambda: self.admission.waiting)
        self.intake = Intake(config)
        self.admission = Admission(config, self.pool, self.metrics)
        self.relay = Relay(config.limits.send_timeout_s)
        self.rejected = 0
        self.refusals = RefusalLog()  # every refusal, one log line per reason and route per second
        self._refusal_timer: asyncio.Task | None = None
        # ledger.backend: redis: every local grant confirmed in the store all replicas share
        self.shared = SharedLedger(config, self.pool) if config.ledger.shared else None
        self.admission.shared = self.shared
        self.metrics.add_ledger_gauges(self.shared)
        flow_gate = self.admission.queue.gate if isinstance(self.admission.queue.gate, FlowGate) else None
        if flow_gate is not None:
            self.metrics.add_flow(flow_gate)
        # A local tokenizer loads now, so a bad tokenizer fails at start.
        self._fixed_counter = counter
        self._local: LocalTokenizerCounter | None = None
        tokenizer = config.prompt_tokens.tokenizer
        if counter is None and config.prompt_tokens.method is CountingMethod.TOKENIZER and tokenizer is not None:
            self._local = LocalTokenizerCounter.load(tokenizer)
        self.admin = Admin(config, self.pool, self.metrics, rejected=lambda: self.rejected,
                           waiting=lambda: self.admission.waiting, shared=self.shared, flow=flow_gate)
        self._up: _Upstreams | None = None
        self._watch: asyncio.Task | None = None
        self._readmits: dict[int, asyncio.TimerHandle] = {}  # passive health: by replica, its ejection's end

    # ---------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        cfg = self.config
        clients: dict[str, UpstreamClient] = {}
        counters: dict[str, PromptCounter] = {}
        for upstream in {*(u.url for u in cfg.upstreams), *(r.upstream for r in cfg.routes if r.upstream)}:
            clients[upstream] = UpstreamClient(
                upstream, connect_timeout_s=cfg.upstream_connect_timeout_s,
                read_timeout_s=cfg.upstream_read_timeout_s, keepalive_s=UPSTREAM_KEEPALIVE_S)
            counters[upstream] = self._fixed_counter or make_counter(
                cfg.prompt_tokens, client=clients[upstream], local=self._local)
        self._up = _Upstreams(clients, counters)
        self.admission.counters = counters
        if self.shared is not None:
            await self.shared.start()
        if self.pool.checked:
            self._watch = asyncio.create_task(self._watch_health())
        self._refusal_timer = asyncio.create_task(self._flush_refusals())

    async def _flush_refusals(self) -> None:
        """Log the refusals of a window that has lasted its second and seen no refusal since."""
        while True:
            await asyncio.sleep(self.refusals.window_s / 4)
            now = time.monotonic()
            if self.refusals.due(now):
                self._log_refusals(self.refusals.flush(now))

    @staticmethod
    def _log_refusals(lines: list[str]) -> None:
        for line in lines:
            log.warning("%s", line)

    async def close(self) -> None:
        if self._refusal_timer is not None:
            self._refusal_timer.cancel()
            with suppress(asyncio.CancelledError):
                await self._refusal_timer
            self._refusal_timer = None
        self._log_refusals(self.refusals.flush(time.monotonic()))
        for timer in self._readmits.values():
            timer.cancel()
        self._readmits.clear()
        if self._watch is not None:
            self._watch.cancel()
            with suppress(asyncio.CancelledError):
                await self._watch
            self._watch = None
        if self._up is not None:
            for client in self._up.clients.values():
                await client.close()
            self._up = None
            self.admission.counters = {}
        if self.shared is not None:
            await self.shared.close()  # after the drain: gives back whatever is still held

    def _client(self, upstream: str) -> UpstreamClient:
        if self._up is None:
            raise RuntimeError("the gateway is not started")
        return self._up.clients[upstream]

    # ---------------------------------------------------------------- health

    async def _watch_health(self) -> None:
        """Every health.interval_s, GET health.path on every upstream at once: a 200 brings one
        back, anything else (or nothing within health.timeout_s) takes it out."""
        probe = self.config.health
        while True:
            await asyncio.sleep(probe.interval_s)
            async with asyncio.TaskGroup() as group:
                for replica in self.pool.replicas:
                    group.create_task(self._probe(replica))

    async def _probe(self, replica: Replica) -> None:
        probe = self.config.health
        why = None
        try:
            async with asyncio.timeout(probe.timeout_s):
                up = await self._client(replica.url).request("GET", probe.path, (), b"")
                await up.read_and_release()
            if up.status != 200:
                why = f"GET {probe.path} answered {up.status}"
        except TimeoutError:
            why = f"GET {probe.path} gave no answer within {probe.timeout_s:g} s"
        except UpstreamError as exc:
            why = f"GET {probe.path} failed: {exc}"
        if why is None:
            if self.pool.mark_up(replica):
                log.warning("upstream %s is back", replica.url)
        else:
            self._take_out(replica, why)

    def _take_out(self, replica: Replica, why: str) -> None:
        if self.pool.mark_down(replica, why):
            log.warning("upstream %s taken out: %s", replica.url, why[:200])

    def _outcome(self, replica: Replica, status: int) -> None:
        """Passive health: one answer from `replica` (599: its connection failed); a run of
        failures ejects it, and a timer readmits it once the ejection is over."""
        failed = status >= 500
        ejection_s = self.pool.record(replica, failed)
        if ejection_s is None:
            return
        log.warning("upstream %s ejected for %g s: %d consecutive failures (the last answered %d)",
                    replica.url, ejection_s, self.config.health.consecutive_failures, status)
        self._readmits[replica.index] = asyncio.get_running_loop().call_later(ejection_s, self._readmit, replica)

    def _readmit(self, replica: Replica) -> None:
        self._readmits.pop(replica.index, None)
        if self.pool.readmit(replica):
            log.warning("upstream %s readmitted after its ejection", replica.url)

    def _retry_elsewhere(self, replica: Replica, attempt: int) -> bool:
        """Whether a request whose connection to `replica` cannot be opened goes to another
        upstream: a healthy one is left and not every upstream has been tried."""
        return attempt + 1 < len(self.pool.replicas) and self.pool.others_healthy(replica)

    # ---------------------------------------------------------------- the handler

    async def handle(self, request: web.Request) -> web.StreamResponse:
        """intake -> admission -> relay for every path the admin endpoints do not serve."""
        try:
            incoming = self.intake.classify(request)
            if incoming.endpoint.path_class is PathClass.PASSTHROUGH:
                raw = await self.intake.read_body(request, decode=False)
                return await self._untouched(request, incoming, raw)
            raw = await self.intake.read_body(request)
            admitted = await self.admission.admit(incoming, raw)
        except Rejection as rejection:
            return self._reject(request, None, rejection)
        except Refused as refused:
            return self._reject(request, refused.route, refused.rejection)
        # Admitted: from here every path out of this function gives the blocks back once, on the
        # upstream they are held on. An upstream that refuses the connection got nothing of the
        # request: its blocks go back, it is taken out, and the request is admitted again (queue
        # or 429 as a new one) on another upstream. One that took the request and then failed is
        # never sent it twice: the engine may have run it.
        reservation = admitted.reservation
        route = admitted.route.name if admitted.route else ""
        try:
            self.metrics.count_admitted(route, admitted.blocks)
            extra = {"X-Kvtune-Reserved-Blocks": str(admitted.blocks)} if self.admin.shows_detail(request) else {}
            if admitted.cap is not None:
                extra["X-Kvtune-Max-Tokens"] = str(admitted.cap)
            for attempt in range(len(self.pool.replicas)):
                replica = self.pool.replica_of(reservation)
                unsent = admitted.upstream is None and self._retry_elsewhere(replica, attempt)
                try:
                    self.metrics.count_sent(replica.url)
                    response = await self.relay.send(request, self._client(admitted.upstream or replica.url),
                                                     "POST", admitted.target, admitted.body, extra,
                                                     progress=self.admission.progress_of(reservation), unsent=unsent)
                except UpstreamConnectError as exc:
                    self._take_out(replica, str(exc))  # first: the blocks released go to the others
                    self._outcome(replica, CONNECT_FAILED)
                    self.admission.release(reservation)
                    self.metrics.count_retried(replica.url)
                else:
                    if admitted.upstream is None:  # a route's own upstream is not in the pool
                        self._outcome(replica, response.status)
                    return response
                try:
                    reservation = await self.admission.reserve(admitted.blocks, admitted.demand, band=admitted.band,
                                                                flow=admitted.flow)
                except Rejection as rejection:
                    return self._reject(request, admitted.route, rejection)
            raise RuntimeError("unreachable: the last attempt answers whatever happens")
        finally:
            self.admission.release(reservation)

    async def _untouched(self, request: web.Request, incoming: Incoming, raw: bytes) -> web.StreamResponse:
        """A pass-through request, to the healthy upstreams in turn (another one when the
        connection cannot be opened)."""
        for attempt in range(len(self.pool.replicas)):
            replica = self.pool.replica(self.pool.next_url())
            try:
                return await self.relay.send(request, self._client(replica.url), request.method,
                                             incoming.target(incoming.path), raw, {}, decoded=False,
                                             unsent=self._retry_elsewhere(replica, attempt))
            except UpstreamConnectError as exc:
                self._take_out(replica, str(exc))
        raise RuntimeError("unreachable: the last attempt answers whatever happens")

    def _reject(self, request: web.Request, route: Route | None, rejection: Rejection) -> web.Response:
        self.rejected += 1
        name = route.name if route else ""
        self.metrics.count_rejected(name, rejection.reason)
        self._log_refusals(self.refusals.record(name, rejection, time.monotonic()))
        return refusal_response(rejection, self.admin.shows_detail(request))


# ---------------------------------------------------------------- the app

GATEWAY = web.AppKey("kvtune_gateway", Gateway)


async def _lifecycle(app: web.Application) -> AsyncIterator[None]:
    gateway = app[GATEWAY]
    await gateway.start()
    try:
        yield
    finally:
        await gateway.close()


def make_app(config: GatewayConfig, *, counter: PromptCounter | None = None,
             make_ledger: LedgerFactory = local_ledger) -> web.Application:
    """The gateway as an aiohttp Application; run it with `handler_cancellation=True` (serve does)
    so a client that goes away cancels its upstream call and releases its blocks at once.
    `make_ledger` builds each upstream's ledger (kvtune.gateway.pool: in memory by default)."""
    app = web.Application(client_max_size=config.limits.max_body_bytes + 1)
    gateway = Gateway(config, counter=counter, make_ledger=make_ledger)
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
