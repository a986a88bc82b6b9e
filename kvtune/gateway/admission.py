"""Admission: a governed request's body read by its API's rules, matched to a route, its output
cap clamped to the route's, its prompt counted, and its KV blocks reserved in the ledger.

sequences x ceil((prompt + cap) / block_size) blocks (kvtune.capacity.reservation) are reserved
for the request's whole life. A request that can never fit answers 400/413 at once, before any
count when even its cheapest reading exceeds the budget. A full budget waits in a bounded FIFO
when gateway.yaml allows one, else answers 429 with Retry-After from the observed release rate.
No aiohttp here: what comes in is an Incoming (kvtune.gateway.intake) and its body's bytes, what
goes out an Admitted for the relay, or a Refused.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvtune.capacity.reservation import request_reserved_blocks
from kvtune.gateway.apis import Request, read_request
from kvtune.gateway.body import BodyError, parse_body
from kvtune.gateway.config import GatewayConfig, GatewayRoute
from kvtune.gateway.counting import (
    PromptCount,
    PromptCounter,
    PromptCountError,
    PromptCountInvalidError,
    PromptRejectedError,
)
from kvtune.gateway.endpoints import PathClass
from kvtune.gateway.ledger import BlockLedger, Reservation
from kvtune.gateway.metrics import GatewayMetrics
from kvtune.gateway.refusals import Reason, Refused, Rejection
from kvtune.gateway.rewrite import rewrite

if TYPE_CHECKING:  # intake is the server side (aiohttp); admission only reads what it produced
    from kvtune.gateway.intake import Incoming


class WaitQueue:
    """The ledger plus an optional bounded FIFO of requests waiting for blocks. Waiters are woken
    synchronously from `wake()`, right after a release, and handed a reservation already made."""

    def __init__(self, ledger: BlockLedger, *, max_waiting: int, timeout_s: float) -> None:
        self.ledger = ledger
        self.max_waiting = max_waiting
        self.timeout_s = timeout_s
        self._waiters: deque[tuple[int, asyncio.Future[Reservation]]] = deque()

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
        fut: asyncio.Future[Reservation] = asyncio.get_running_loop().create_future()
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


@dataclass(frozen=True, slots=True)
class Admitted:
    """A request the gateway admits: where it goes, what it holds, the body it forwards. Its
    reservation must be given back once, through Admission.release."""

    route: GatewayRoute | None
    upstream: str
    target: str
    blocks: int
    cap: int | None
    body: bytes
    reservation: Reservation


class Admission:
    """Counting -> cap -> reservation -> ledger for one gateway.yaml. The prompt counters, one per
    upstream, arrive with the upstream clients (`counters`, set when the gateway starts)."""

    def __init__(self, config: GatewayConfig, ledger: BlockLedger, metrics: GatewayMetrics) -> None:
        self.config = config
        self.ledger = ledger
        self.metrics = metrics
        self.queue = WaitQueue(ledger, max_waiting=config.queue_max_waiting, timeout_s=config.queue_timeout_s)
        self.counters: Mapping[str, PromptCounter] = {}

    @property
    def waiting(self) -> int:
        return self.queue.waiting

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
            route = self.config.route_for(incoming.path, model)
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
            upstream = (route.upstream if route else None) or self.config.upstream
            self._never_fits(asked, cap, self._lower_bounds(asked))
            counts = await self._count(upstream, asked, model)
            blocks = self._blocks(asked, cap, counts.tokens, counts.exact)
            forwarded = rewrite(body, asked, cap) if cap is not None else raw
            target = incoming.target((route.upstream_path if route else None) or incoming.path)
            reservation = self.queue.try_now(blocks)
            if reservation is None:
                reservation = await self._wait_or_reject(blocks)
        except Rejection as rejection:
            raise Refused(route, rejection) from None
        return Admitted(route, upstream, target, blocks, cap, forwarded, reservation)

    def release(self, admitted: Admitted) -> None:
        """Give the blocks back (once) and hand them to whoever waits; never awaits."""
        admitted.reservation.release()
        self.queue.wake()

    @staticmethod
    def _cap(route: GatewayRoute, asked: Request) -> int:
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

    def _blocks(self, asked: Request, cap: int | None, tokens: tuple[int, ...], exact: bool) -> int:
        """The reservation: the largest of the readings, each the sum over its sequences of
        ceil((prompt + cap) / block_size), times its copies; 400 for a prompt past the context,
        413 for what exceeds the whole budget."""
        cfg = self.config
        largest = 0
        for reading in asked.readings:
            prompts = [sum(tokens[i] for i in seq.parts) + seq.extra_tokens for seq in reading.sequences]
            for prompt in prompts:
                if exact and prompt + (1 if reading.generates else 0) > cfg.max_model_len:
                    raise Rejection(400, Reason.CONTEXT_LENGTH_EXCEEDED,
                                    f"the prompt has {prompt} tokens; this deployment's context is "
                                    f"{cfg.max_model_len} tokens")
            grow = (cap or 0) if reading.generates else 0
            largest = max(largest, request_reserved_blocks((min(p, cfg.max_model_len) for p in prompts), grow,
                                                           cfg.block_size, reading.copies))
        if largest > cfg.block_budget:
            raise Rejection(413, Reason.KV_RESERVATION_EXCEEDS_BUDGET,
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
            sizes: Iterable[int] = (sum(lower[i] for i in seq.parts) + seq.extra_tokens for seq in reading.sequences)
            total = request_reserved_blocks(sizes, grow, cfg.block_size, reading.copies)
            smallest = total if smallest is None else min(smallest, total)
        if smallest is not None and smallest > cfg.block_budget:
            raise Rejection(413, Reason.KV_RESERVATION_EXCEEDS_BUDGET,
                            f"this request needs at least {smallest} KV blocks but the whole budget is "
                            f"{cfg.block_budget}: it can never be admitted")

    async def _count(self, upstream: str, asked: Request, model: str | None) -> PromptCount:
        counter = self.counters[upstream]
        try:
            return await counter.count(asked.prompts, model)
        except PromptRejectedError as exc:
            reason = Reason.CONTEXT_LENGTH_EXCEEDED if "context length" in str(exc) else Reason.INVALID_PROMPT
            raise Rejection(400, reason, str(exc)) from None
        except PromptCountInvalidError as exc:
            raise Rejection(502, Reason.PROMPT_COUNT_INVALID,
                            f"the gateway could not count the prompt: {exc}") from None
        except PromptCountError as exc:
            raise Rejection(503, Reason.PROMPT_COUNT_UNAVAILABLE,
                            f"the gateway could not count the prompt: {exc}",
                            retry_after_s=self.config.retry_after_min_s) from None

    async def _wait_or_reject(self, blocks: int) -> Reservation:
        cfg, ledger, queue = self.config, self.ledger, self.queue
        reason = Reason.KV_BUDGET_EXHAUSTED
        if cfg.queue_max_waiting > 0:
            if queue.can_wait():
                started = time.monotonic()
                reservation = await queue.wait(blocks)
                if reservation is not None:
                    self.metrics.queue_wait.observe(time.monotonic() - started)
                    return reservation
                reason = Reason.QUEUE_TIMEOUT
            else:
                reason = Reason.QUEUE_FULL
        retry = ledger.retry_after_s(blocks, min_s=cfg.retry_after_min_s, max_s=cfg.retry_after_max_s)
        self.metrics.retry_after.observe(retry)
        raise Rejection(429, reason,
                        f"KV budget full: {blocks} blocks needed, {ledger.reserved_blocks} of "
                        f"{ledger.budget_blocks} reserved; retry later", retry_after_s=retry)


__all__ = ["Admission", "Admitted", "WaitQueue"]
