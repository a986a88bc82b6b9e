"""The admission policy itself: reserve now, wait in a FIFO, or refuse with Retry-After.

Synchronous and clock-free: every decision is a function of the ledger, the queue and the `now`
it is given, so one implementation serves two clocks. The live gateway (kvtune.gateway.admission)
wraps it in asyncio futures and real time; the simulator (kvtune.sim.admission) drives it in
simulated time. The rules:
  * nobody overtakes a waiter: a request is reserved at once only when the queue is empty;
  * a full budget queues the request when gateway.yaml allows a queue and it has room
    (queue.max_waiting), else answers 429 (kv_budget_exhausted, or queue_full);
  * every release wakes waiters in order, while the head fits;
  * a waiter that times out (queue.timeout_s) leaves first, the next may then fit, and only
    then is its 429 (queue_timeout) computed;
  * Retry-After is the ledger's estimate from its release rate, clamped to [min_s, max_s].
The reservation's size is `sequence_blocks` (kvtune.capacity.reservation's rule), its output
cap `route_cap`; a reservation larger than what the ledger holds reservations against (the budget,
or floor(k x budget) under an overcommit factor: kvtune.domain.admission_policy) can never be admitted (413).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from kvtune.capacity.reservation import request_reserved_blocks
from kvtune.domain.admission_policy import AdmissionPolicy, PolicyKind
from kvtune.domain.demand import Demand
from kvtune.gateway.ledger import RATE_WINDOW_S, BlockLedger, Ledger, Reservation
from kvtune.gateway.refusals import Reason
from kvtune.gateway.statistical import StatisticalLedger

K = TypeVar("K", bound=Hashable)

_NONE: tuple = ()


def route_cap(route_max_new_tokens: int, requested: Iterable[int | None]) -> int:
    """The route's cap, or the client's own when it asked for less in any cap field."""
    cap = route_max_new_tokens
    for asked in requested:
        if asked is not None and asked < cap:
            cap = asked
    return cap


def sequence_blocks(prompts: Iterable[int], grow: int, *, block_size: int, max_model_len: int,
                    copies: int = 1) -> int:
    """A reading's reservation: Σ over its sequences of ceil((prompt + grow) / block_size), times
    its copies, each prompt counted at most up to max_model_len."""
    return request_reserved_blocks((min(p, max_model_len) for p in prompts), grow, block_size, copies)


def ledger_for(policy: AdmissionPolicy, budget_blocks: int, *, block_size: int, max_model_len: int,
               clock: Callable[[], float] = time.monotonic, rate_window_s: float = RATE_WINDOW_S) -> BlockLedger:
    """The ledger a policy runs on, for the gateway and the simulator alike."""
    if policy.kind is PolicyKind.STATISTICAL:
        return StatisticalLedger(budget_blocks, epsilon=policy.epsilon, block_size=block_size,
                                 max_model_len=max_model_len, clock=clock, rate_window_s=rate_window_s)
    return BlockLedger(budget_blocks, clock=clock, rate_window_s=rate_window_s,
                       limit_blocks=policy.limit_blocks(budget_blocks))


@dataclass(frozen=True, slots=True)
class Turned:
    """A 429: why, and the Retry-After the client is told (seconds)."""

    reason: Reason
    retry_after_s: int


class AdmissionGate(Generic[K]):
    """The ledger plus the FIFO of requests waiting for blocks, each known by its key."""

    __slots__ = ("ledger", "max_waiting", "timeout_s", "retry_after_min_s", "retry_after_max_s", "_waiters",
                 "_gone", "waiting_peak")

    def __init__(self, ledger: Ledger, *, max_waiting: int, timeout_s: float, retry_after_min_s: int,
                 retry_after_max_s: int, gone: Callable[[K], bool] | None = None) -> None:
        """`gone(key)` says a waiter has already left without `leave` yet (asyncio: its task was
        cancelled and has not run its `finally`); such a head is dropped, not served."""
        self.ledger = ledger
        self._gone = gone
        self.max_waiting = max_waiting
        self.timeout_s = timeout_s
        self.retry_after_min_s = retry_after_min_s
        self.retry_after_max_s = retry_after_max_s
        self._waiters: deque[tuple[K, int, Demand | None, float]] = deque()  # (key, blocks, demand, deadline)
        self.waiting_peak = 0

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    def never_fits(self, blocks: int, demand: Demand | None = None) -> bool:
        """No release will ever make room (413): more than the ledger's limit (the budget, or k x
        it), or for statistical an overflow probability above epsilon even alone."""
        return self.ledger.never_fits(blocks, demand)

    def offer(self, key: K, blocks: int, now: float, demand: Demand | None = None) -> Reservation | Turned | None:
        """A reservation now; None when the request now waits under `key`; or a 429."""
        if not self._waiters:  # FIFO: nobody overtakes a request already waiting
            reservation = self.ledger.try_reserve(blocks, demand)
            if reservation is not None:
                return reservation
        if self.max_waiting <= 0:
            return self.turn(blocks, Reason.KV_BUDGET_EXHAUSTED)
        if len(self._waiters) >= self.max_waiting:
            return self.turn(blocks, Reason.QUEUE_FULL)
        self._waiters.append((key, blocks, demand, now + self.timeout_s))
        if len(self._waiters) > self.waiting_peak:
            self.waiting_peak = len(self._waiters)
        return None

    def turn(self, blocks: int, reason: Reason) -> Turned:
        """The 429 for a request of `blocks`, with Retry-After from the ledger's release rate."""
        return Turned(reason, self.ledger.retry_after_s(blocks, min_s=self.retry_after_min_s,
                                                        max_s=self.retry_after_max_s))

    def release(self, reservation: Reservation) -> Sequence[tuple[K, Reservation]]:
        """Give the blocks back (once) and serve whoever waits: the (key, reservation) granted."""
        reservation.release()
        return self.wake() if self._waiters else _NONE

    def wake(self) -> Sequence[tuple[K, Reservation]]:
        """Serve waiters in order while the head fits."""
        granted: list[tuple[K, Reservation]] = []
        waiters = self._waiters
        gone = self._gone
        while waiters:
            key, blocks, demand, _ = waiters[0]
            if gone is not None and gone(key):
                waiters.popleft()
                continue
            reservation = self.ledger.try_reserve(blocks, demand)
            if reservation is None:
                break
            waiters.popleft()
            granted.append((key, reservation))
        return granted

    def leave(self, key: K) -> Sequence[tuple[K, Reservation]]:
        """`key` stops waiting (timed out, cancelled); the head may have changed, so wake."""
        for i, entry in enumerate(self._waiters):
            if entry[0] == key:
                del self._waiters[i]
                break
        return self.wake()

    def next_deadline(self) -> float | None:
        """When the head of the queue times out (one timeout for all: deadlines are in FIFO order)."""
        return self._waiters[0][3] if self._waiters else None

    def expire(self, now: float) -> tuple[list[tuple[K, Reservation]], list[tuple[K, Turned]]]:
        """Every waiter whose deadline has come leaves, in order; what that grants, and their 429s."""
        granted: list[tuple[K, Reservation]] = []
        turned: list[tuple[K, Turned]] = []
        waiters = self._waiters
        while waiters and waiters[0][3] <= now:
            key, blocks, _, _ = waiters.popleft()
            granted.extend(self.wake())
            turned.append((key, self.turn(blocks, Reason.QUEUE_TIMEOUT)))
        return granted, turned


__all__ = ["AdmissionGate", "Turned", "ledger_for", "route_cap", "sequence_blocks"]
