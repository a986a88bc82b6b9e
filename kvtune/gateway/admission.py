"""Admission: a governed request's body read by its API's rules, matched to a route, its output
cap clamped to the route's, its prompt counted, and its KV blocks reserved in the ledger.

sequences x ceil((prompt + cap) / block_size) blocks (kvtune.capacity.reservation) are reserved
for the request's whole life, held against the limit gateway.yaml's `admission` policy sets
(kvtune.domain.admission_policy). A request that can never fit answers 400/413 at once, before any
count when even its cheapest reading exceeds the budget. Whether it is reserved now, waits in the
bounded FIFO or answers 429 with Retry-After is decided by the synchronous gate
(kvtune.gateway.gate), the same code the simulator runs; here it only meets asyncio and the clock.
With gateway.yaml `ledger.backend: redis`, each grant of the gate is then confirmed in the ledger
every gateway replica shares (kvtune.gateway.shared), and a release gives both back.
No aiohttp here: what comes in is an Incoming (kvtune.gateway.intake) and its body's bytes, what
goes out an Admitted for the relay, or a Refused.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NoReturn

from kvtune.capacity.reservation import request_reserved_blocks
from kvtune.domain.demand import Demand
from kvtune.domain.flow_control import FlowControl
from kvtune.domain.output_law import OutputLaw
from kvtune.domain.route import Route
from kvtune.gateway.apis import Reading, Request, read_request
from kvtune.gateway.body import BodyError, parse_body
from kvtune.gateway.config import GatewayConfig, StickyBy
from kvtune.gateway.counting import (
    PromptCount,
    PromptCounter,
    PromptCountError,
    PromptCountInvalidError,
    PromptRejectedError,
)
from kvtune.gateway.endpoints import PathClass
from kvtune.gateway.flow import ANONYMOUS, FlowGate, band_of
from kvtune.gateway.gate import AdmissionGate, Turned, route_cap, sequence_blocks
from kvtune.gateway.ledger import Ledger, Reservation
from kvtune.gateway.metrics import GatewayMetrics
from kvtune.gateway.pool import UpstreamPool
from kvtune.gateway.refusals import BUDGET_FULL, NEVER_FITS, Reason, Refused, Rejection
from kvtune.gateway.rewrite import rewrite
from kvtune.gateway.upstream import UpstreamConnectError

if TYPE_CHECKING:  # intake is the server side (aiohttp); admission only reads what it produced
    from kvtune.gateway.intake import Incoming
    from kvtune.gateway.pool import Replica
    from kvtune.gateway.shared import SharedLedger

#: With a shared ledger, how often a request Redis refused tries again while it may wait
#: (another gateway replica's release does not wake this one's queue).
SHARED_POLL_S = 0.05


class WaitQueue:
    """The admission gate in real time: today's FIFO (kvtune.gateway.gate), or with gateway.yaml
    `flow:` the flow-control queue (kvtune.gateway.flow). A waiter is an asyncio future that a
    release resolves synchronously, already holding its reservation; its timeout is asyncio's."""

    def __init__(self, ledger: Ledger, *, max_waiting: int, timeout_s: float, retry_after_min_s: int = 1,
                 retry_after_max_s: int = 60, flow: FlowControl | None = None) -> None:
        self.ledger = ledger
        self.gate: AdmissionGate[int] | FlowGate[int]
        self.flow = flow
        if flow is None:
            self.gate = AdmissionGate(ledger, max_waiting=max_waiting, timeout_s=timeout_s,
                                      retry_after_min_s=retry_after_min_s, retry_after_max_s=retry_after_max_s,
                                      gone=self._gone)
        else:
            self.gate = FlowGate(ledger, flow, retry_after_min_s=retry_after_min_s,
                                 retry_after_max_s=retry_after_max_s, clock=time.monotonic, gone=self._gone)
        self._futures: dict[int, asyncio.Future[Reservation]] = {}
        self._keys = itertools.count()

    @property
    def waiting(self) -> int:
        return self.gate.waiting

    def offer(self, blocks: int, demand: Demand | None = None, *, band: int = 0,
              flow: str = ANONYMOUS) -> tuple[int, Reservation | Turned | None]:
        """The gate's answer now, and the key to `wait` under when it is None (queued)."""
        key = next(self._keys)
        gate = self.gate
        if isinstance(gate, FlowGate):
            return key, gate.offer(key, blocks, time.monotonic(), demand, band=band, flow=flow)
        return key, gate.offer(key, blocks, 0.0, demand)

    async def wait(self, key: int, blocks: int) -> Reservation | Turned:
        """The reservation once the gate serves it; a 429 (queue_timeout) at its deadline."""
        gate = self.gate
        if isinstance(gate, FlowGate):
            deadline = gate.deadline_of(key)
            timeout_s = 0.0 if deadline is None else max(0.0, deadline - time.monotonic())
        else:
            timeout_s = gate.timeout_s
        fut: asyncio.Future[Reservation] = asyncio.get_running_loop().create_future()
        self._futures[key] = fut
        granted: Reservation | None = None
        turned: Turned | None = None
        timed_out = False
        try:
            async with asyncio.timeout(timeout_s):
                granted = await fut
        except TimeoutError:
            timed_out = True
        finally:
            if granted is None:
                self._futures.pop(key, None)
                if fut.done() and not fut.cancelled():
                    self._grant(gate.release(fut.result()))  # granted as we left: give it straight back
                else:
                    fut.cancel()
                    if timed_out and isinstance(gate, FlowGate):
                        more, turned = gate.time_out(key, time.monotonic())
                        self._grant(more)
                    else:
                        self._grant(gate.leave(key))
        if granted is not None:
            return granted
        return turned if turned is not None else gate.turn(blocks, Reason.QUEUE_TIMEOUT)

    def release(self, reservation: Reservation) -> None:
        """Give the blocks back and resolve the waiters that now fit; never awaits."""
        granted = self.gate.release(reservation)
        if granted:
            self._grant(granted)

    def wake(self) -> None:
        """Room appeared without a release (an upstream came back): serve the waiters that fit."""
        self._grant(self.gate.wake())

    def _gone(self, key: int) -> bool:
        fut = self._futures.get(key)
        return fut is None or fut.done()

    def _grant(self, granted: Sequence[tuple[int, Reservation]]) -> None:
        for key, reservation in granted:
            self._futures.pop(key).set_result(reservation)


@dataclass(frozen=True, slots=True)
class Admitted:
    """A request the gateway admits: what it holds (and on which upstream: the pool's
    replica_of), the body it forwards. Its reservation must be given back once, through
    Admission.release. `upstream` is a route's own upstream (one upstream only), else None."""

    route: Route | None
    upstream: str | None
    target: str
    blocks: int
    cap: int | None
    body: bytes
    reservation: Reservation
    demand: Demand | None = None
    band: int = 0  # flow control: the band and flow it waited in (a second reservation uses them again)
    flow: str = ANONYMOUS


def forced_law(law: OutputLaw | None, reading: Reading, cap: int) -> OutputLaw | None:
    """The route's law as far as the request leaves its length to it: none (its cap) when a field
    may keep it from ending (ignore_eos, logit_bias, ...), conditioned on length >= min_tokens."""
    if law is None or reading.forces_cap is not None:
        return None
    if reading.forced_tokens > 0:
        return law.at_least(min(reading.forced_tokens, cap))
    return law


class Admission:
    """Counting -> cap -> reservation -> the upstreams' ledgers for one gateway.yaml. The prompt
    counters, one per upstream, arrive with the upstream clients (`counters`, set when the
    gateway starts)."""

    def __init__(self, config: GatewayConfig, pool: UpstreamPool, metrics: GatewayMetrics) -> None:
        self.config = config
        self.pool = pool
        self.metrics = metrics
        self.queue = WaitQueue(pool, max_waiting=config.queue_max_waiting, timeout_s=config.queue_timeout_s,
                               retry_after_min_s=config.retry_after_min_s, retry_after_max_s=config.retry_after_max_s,
                               flow=config.flow)
        pool.on_capacity = self.queue.wake
        self.counters: Mapping[str, PromptCounter] = {}
        self.shared: SharedLedger | None = None  # set by the gateway under ledger.backend: redis
        self._polling = 0  # requests the shared ledger refused, waiting to try again

    @property
    def waiting(self) -> int:
        return self.queue.waiting + self._polling

    async def admit(self, incoming: Incoming, raw: bytes) -> Admitted:
        """Read, count and reserve a governed request; Rejection before a route is known, Refused
        after, for every answer but admission."""
        try:
            body = parse_body(raw)
        except BodyError as exc:
            raise Rejection(400, exc.reason, str(exc)) from None
        doc = body.doc
        model = doc.get("model") if isinstance(doc.get("model"), str) else None
        route = incoming.route
        endpoint = incoming.endpoint
        if endpoint.path_class is PathClass.GENERATE and route is None:
            route = self.config.route_for(incoming.path, model, incoming.route_headers)
            if route is None:
                raise Rejection(404, Reason.NO_ROUTE, f"no route of this gateway serves {incoming.path} for this model")
        try:
            api = endpoint.api
            if api is None:  # classify gives every governed path its API
                raise RuntimeError(f"{incoming.path} is governed but has no API")
            try:
                asked = read_request(api, doc, pair_tokens=self.config.prompt_tokens.pair_tokens)
            except BodyError as exc:
                raise Rejection(400, exc.reason, str(exc)) from None
            cap = None
            if asked.generates:
                if route is None:  # every generation path has a route by now, or answered no_route
                    raise RuntimeError(f"{incoming.path} generates but has no route")
                cap = self._cap(route, asked)
            upstream = route.upstream if route else None
            self._never_fits(asked, cap, self._lower_bounds(asked))
            counts = await self._count(upstream, asked, model)
            blocks, demand = self._blocks(asked, cap, counts.tokens, counts.exact, route)
            forwarded = rewrite(body, asked, cap) if cap is not None else raw
            target = incoming.target((route.upstream_path if route else None) or incoming.path)
            band, flow = self._band_and_flow(incoming, route)
            reservation = await self.reserve(blocks, demand, self._sticky_key(incoming, doc), band=band, flow=flow)
        except Rejection as rejection:
            raise Refused(route, rejection) from None
        return Admitted(route, upstream, target, blocks, cap, forwarded, reservation, demand, band, flow)

    def _band_and_flow(self, incoming: Incoming, route: Route | None) -> tuple[int, str]:
        """The flow-control band and flow of a request (docs/guides/flow-control.md)."""
        flow = self.config.flow
        if flow is None:
            return 0, ANONYMOUS
        return band_of(flow, incoming.priority, route.band if route is not None else None), incoming.flow

    def progress_of(self, reservation: Reservation) -> Callable[[int], None]:
        """What the relay tells as the request streams: its reservation (the statistical ledger
        conditions on it) and, under flow control, the forecast's table of admitted requests."""
        gate = self.queue.gate
        if not isinstance(gate, FlowGate):
            return reservation.progress

        def progress(tokens: int) -> None:
            reservation.progress(tokens)
            gate.progress(reservation, tokens)
        return progress

    def release(self, reservation: Reservation) -> None:
        """Give an admitted request's blocks back (once, later calls do nothing) and hand them to
        whoever waits; never awaits. With a shared ledger, its reservation there too."""
        self.queue.release(reservation)
        if self.shared is not None:
            self.shared.release(reservation)

    @staticmethod
    def _cap(route: Route, asked: Request) -> int:
        """The route's cap, or the client's own when it asked for less in any field the engine
        may read: every present cap field is then written with this one value."""
        return route_cap(route.max_new_tokens, (reading.requested_cap for reading in asked.readings))

    @staticmethod
    def _lower_bounds(asked: Request) -> list[int]:
        """Tokens each prompt holds at least, known without counting (token ids; 0 for text)."""
        return [p.token_count or 0 for p in asked.prompts]

    def _blocks(self, asked: Request, cap: int | None, tokens: tuple[int, ...], exact: bool,
                route: Route | None) -> tuple[int, Demand | None]:
        """The reservation: the largest of the readings, each the sum over its sequences of
        ceil((prompt + cap) / block_size), times its copies; 400 for a prompt past the context,
        413 for what can never be admitted. With it, what the largest reading's sequences may
        reach (the statistical ledger's demand: their prompts, the cap, the route's output law)."""
        cfg = self.config
        largest = 0
        demand: Demand | None = None
        chosen = False
        for reading in asked.readings:
            prompts = [sum(tokens[i] for i in seq.parts) + seq.extra_tokens for seq in reading.sequences]
            for prompt in prompts:
                if exact and prompt + (1 if reading.generates else 0) > cfg.max_model_len:
                    raise Rejection(400, Reason.CONTEXT_LENGTH_EXCEEDED,
                                    f"the prompt has {prompt} tokens; this deployment's context is "
                                    f"{cfg.max_model_len} tokens")
            grow = (cap or 0) if reading.generates else 0
            blocks = sequence_blocks(prompts, grow, block_size=cfg.block_size, max_model_len=cfg.max_model_len,
                                     copies=reading.copies)
            if blocks > largest or not chosen:
                largest, chosen = blocks, True
                # a reading that generates nothing (pooling) holds its prompt for its whole life: no demand
                demand = None if grow == 0 else Demand(
                    tuple(min(p, cfg.max_model_len) for p in prompts) * reading.copies, grow,
                    forced_law(route.output_law if route is not None else None, reading, grow))
        if self.queue.gate.never_fits(largest, demand):
            raise Rejection(413, Reason.KV_RESERVATION_EXCEEDS_BUDGET,
                            f"this request needs {largest} KV blocks but {self._limit_text()}: "
                            "it can never be admitted", blocks=(largest, self.pool.free_blocks),
                            public=NEVER_FITS)
        return max(largest, 1), demand

    def _never_fits(self, asked: Request, cap: int | None, lower: list[int]) -> None:
        """413 before any count when even the cheapest reading of the request exceeds the budget
        (a batch of thousands of prompts is refused without a thousand /tokenize calls)."""
        cfg = self.config
        smallest = None
        for reading in asked.readings:
            grow = (cap or 0) if reading.generates else 0
            sizes: Iterable[int] = (sum(lower[i] for i in seq.parts) + seq.extra_tokens for seq in reading.sequences)
            total = request_reserved_blocks(sizes, grow, cfg.block_size, reading.copies)
            smallest = total if smallest is None else min(smallest, total)
        if smallest is not None and self.queue.gate.never_fits(smallest):
            raise Rejection(413, Reason.KV_RESERVATION_EXCEEDS_BUDGET,
                            f"this request needs at least {smallest} KV blocks but {self._limit_text()}: "
                            "it can never be admitted", blocks=(smallest, self.pool.free_blocks),
                            public=NEVER_FITS)

    def _limit_text(self) -> str:
        """What a 413 says it was measured against (the same words as the rendered nginx.conf;
        with several upstreams, the largest one's)."""
        cfg = self.config
        largest = self.pool.largest
        budget, limit = largest.budget_blocks, largest.limit_blocks
        whose = "the budget" if len(self.pool.replicas) == 1 else "the largest upstream's budget"
        if limit == budget:
            return f"the whole budget is {budget}" if len(self.pool.replicas) == 1 else f"{whose} is {budget}"
        return f"the overcommit limit is {limit} ({cfg.admission.factor:g} x {whose} {budget})"

    async def _count(self, upstream: str | None, asked: Request, model: str | None) -> PromptCount:
        """The prompt counted on the route's own upstream, else on the healthy upstreams in turn;
        one that cannot be connected to (nothing was sent) is taken out and the next one asked."""
        for _ in self.pool.replicas:
            url = upstream or self.pool.next_url()
            try:
                return await self.counters[url].count(asked.prompts, model)
            except PromptCountError as exc:
                if (upstream is None and isinstance(exc.__cause__, UpstreamConnectError)
                        and self.pool.mark_down(self.pool.replica(url), str(exc.__cause__))
                        and self.pool.others_healthy(self.pool.replica(url))):
                    continue
                self._count_failed(exc)
        raise RuntimeError("unreachable: the last count raised")

    def _count_failed(self, exc: PromptCountError) -> NoReturn:
        """A failed count as the client's answer: 400 refused by the engine, 502 a count that is
        none, 503 (retryable) for anything else."""
        if isinstance(exc, PromptRejectedError):
            reason = Reason.CONTEXT_LENGTH_EXCEEDED if "context length" in str(exc) else Reason.INVALID_PROMPT
            raise Rejection(400, reason, str(exc)) from None
        if isinstance(exc, PromptCountInvalidError):
            raise Rejection(502, Reason.PROMPT_COUNT_INVALID,
                            f"the gateway could not count the prompt: {exc}") from None
        raise Rejection(503, Reason.PROMPT_COUNT_UNAVAILABLE,
                        f"the gateway could not count the prompt: {exc}",
                        retry_after_s=self.config.retry_after_min_s) from None

    def _sticky_key(self, incoming: Incoming, doc: dict) -> str | None:
        """What keeps this request with others on one upstream (gateway.yaml `sticky`), or None."""
        sticky = self.config.sticky
        if sticky is None or len(self.pool.replicas) == 1:
            return None
        if sticky.by is StickyBy.HEADER:
            return incoming.sticky_header
        user = doc.get("user")
        return user if isinstance(user, str) and user else None

    async def reserve(self, blocks: int, demand: Demand | None, sticky: str | None = None, *, band: int = 0,
                      flow: str = ANONYMOUS) -> Reservation:
        """The gate's decision; a 429 (kv_budget_exhausted, queue_full, queue_timeout) raised.
        Also a request's second reservation, when its first upstream refused the connection.
        With a sticky key, its upstream first (when nobody waits: FIFO still holds), then by
        free budget. With a shared ledger, every local grant is confirmed there (`_reserve_shared`)."""
        if self.shared is None:
            return await self._reserve_local(blocks, demand, sticky, band, flow)
        return await self._reserve_shared(blocks, demand, sticky)

    async def _reserve_shared(self, blocks: int, demand: Demand | None, sticky: str | None) -> Reservation:
        """A local grant, confirmed in the shared ledger on its upstream, else on the next upstream
        with room (when nobody waits here). Refused everywhere: a 429, or, when the queue is on,
        another try every SHARED_POLL_S until queue.timeout_s (a release by another gateway
        replica wakes nobody here); while it polls it counts as waiting (queue.max_waiting)."""
        cfg = self.config
        deadline = time.monotonic() + cfg.queue_timeout_s
        while True:
            reservation = await self._reserve_local(blocks, demand, sticky)
            confirmed = await self._confirm(reservation, blocks, demand)
            if confirmed is not None:
                return confirmed
            left = deadline - time.monotonic()
            if cfg.queue_max_waiting <= 0 or left <= 0 or self.waiting >= cfg.queue_max_waiting:
                reason = (Reason.KV_BUDGET_EXHAUSTED if cfg.queue_max_waiting <= 0 else
                          Reason.QUEUE_TIMEOUT if left <= 0 else Reason.QUEUE_FULL)
                turned = self.queue.gate.turn(blocks, reason)
                self.metrics.retry_after.observe(turned.retry_after_s)
                raise Rejection(429, reason, f"KV budget full: {blocks} blocks needed, the gateways' shared "
                                "ledger holds too many on every upstream; retry later",
                                retry_after_s=turned.retry_after_s, blocks=(blocks, self.pool.free_blocks),
                                public=BUDGET_FULL)
            self._polling += 1
            try:
                await asyncio.sleep(min(SHARED_POLL_S, left))
            finally:
                self._polling -= 1

    async def _confirm(self, reservation: Reservation, blocks: int, demand: Demand | None) -> Reservation | None:
        """Hold the local grant in the shared ledger; refused, give it back and try the other
        routable upstreams in order of free budget (only when nobody waits: FIFO). None: refused
        everywhere, nothing held."""
        shared = self.shared
        if shared is None:
            raise RuntimeError("no shared ledger")
        first = self.pool.replica_of(reservation)
        candidates: list[Replica] = [first]
        if not self.queue.waiting:
            candidates += sorted((r for r in self.pool.routable() if r is not first),
                                 key=lambda r: (-r.score, r.ledger.inflight_requests, r.index))
        held: Reservation | None = reservation
        for replica in candidates:
            if held is None:
                held = replica.ledger.try_reserve(blocks, demand)
                if held is None:
                    continue
            try:
                granted = await shared.hold(replica, held)
            except BaseException:  # 503 under reject, or cancelled: nothing is admitted
                self.queue.release(held)
                raise
            if granted:
                return held
            self.queue.release(held)
            held = None
        return None

    async def _reserve_local(self, blocks: int, demand: Demand | None, sticky: str | None, band: int = 0,
                             flow: str = ANONYMOUS) -> Reservation:
        queue = self.queue
        if sticky is not None and not queue.waiting:
            keep = queue.gate.kept_blocks(band) if isinstance(queue.gate, FlowGate) else 0
            reservation = self.pool.affine(sticky).ledger.try_reserve(blocks, demand, keep)
            if reservation is not None:
                if isinstance(queue.gate, FlowGate):
                    queue.gate.track(reservation, demand, band, flow)
                return reservation
        key, got = queue.offer(blocks, demand, band=band, flow=flow)
        if got is None:  # queued
            started = time.monotonic()
            got = await queue.wait(key, blocks)
            if isinstance(got, Reservation):
                self.metrics.queue_wait.observe(time.monotonic() - started)
        if isinstance(got, Reservation):
            return got
        ledger = self.pool
        self.metrics.retry_after.observe(got.retry_after_s)
        raise Rejection(429, got.reason,
                        f"KV budget full: {blocks} blocks needed, {ledger.reserved_blocks} of "
                        f"{ledger.limit_blocks} reserved; retry later", retry_after_s=got.retry_after_s,
                        blocks=(blocks, ledger.free_blocks), public=BUDGET_FULL)


__all__ = ["Admission", "Admitted", "WaitQueue"]
