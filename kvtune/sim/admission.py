"""What stands between clients and the engine: nothing, or kvtune's gateway ledger.

The simulator calls an `Admission` when a request arrives (or retries), when one finishes, and
at its deadlines; the admission answers admit, queue, retry later (429 + Retry-After) or refuse.
`LedgerAdmission` runs the live gateway's own `BlockLedger` and reservation rule in simulated
time (the ledger's clock is injected), so the policy simulated is the policy deployed.
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

from kvtune.capacity.reservation import request_reserved_blocks
from kvtune.gateway.ledger import BlockLedger, Reservation


class VerdictKind(enum.Enum):
    ADMIT = "admit"  # goes to the engine now
    QUEUE = "queue"  # held by the admission; `finish`/`poll` release it later
    RETRY = "retry"  # 429 with Retry-After: the client waits and sends it again
    REFUSE = "refuse"  # can never be admitted (413): the client gives up


@dataclass(frozen=True, slots=True)
class Verdict:
    kind: VerdictKind
    retry_after_s: float = 0.0


ADMIT = Verdict(VerdictKind.ADMIT)


@dataclass(slots=True)
class Wakeup:
    """What changed in the admission's queue: requests now admitted, requests now answered 429."""

    admitted: list[int] = field(default_factory=list)
    rejected: list[tuple[int, float]] = field(default_factory=list)  # (request, Retry-After seconds)


class Admission(Protocol):
    """The admission hook the simulator calls, all in simulated seconds."""

    def arrive(self, request: int, prompt_tokens: int, max_tokens: int | None, now_s: float) -> Verdict: ...

    def finish(self, request: int, now_s: float) -> Wakeup | None: ...

    def poll(self, now_s: float) -> Wakeup | None: ...

    def next_deadline_s(self) -> float | None: ...


class DirectAdmission:
    """Straight to vLLM: everything is admitted, nothing is held."""

    def arrive(self, request: int, prompt_tokens: int, max_tokens: int | None, now_s: float) -> Verdict:
        return ADMIT

    def finish(self, request: int, now_s: float) -> Wakeup | None:
        return None

    def poll(self, now_s: float) -> Wakeup | None:
        return None

    def next_deadline_s(self) -> float | None:
        return None


class LedgerAdmission:
    """The gateway's rule: reserve ceil((prompt + max_tokens) / block_size) blocks from a budget
    for the request's whole life, 429 + Retry-After (from the ledger's release rate) when full,
    or wait in a bounded FIFO for up to `queue_timeout_s` when `queue_max_waiting` > 0.

    The FIFO mirrors `kvtune.gateway.proxy.Admission` (which is asyncio futures): nobody overtakes
    a waiter, waiters are served right after a release while they fit, a timed-out waiter leaves
    (and the next may then fit) before its 429 is computed."""

    def __init__(self, budget_blocks: int, *, block_size: int, max_model_len: int, retry_after_min_s: int = 1,
                 retry_after_max_s: int = 60, queue_max_waiting: int = 0, queue_timeout_s: float = 30.0) -> None:
        self._now_s = 0.0
        self.ledger = BlockLedger(budget_blocks, clock=lambda: self._now_s)
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.retry_after_min_s = retry_after_min_s
        self.retry_after_max_s = retry_after_max_s
        self.queue_max_waiting = queue_max_waiting
        self.queue_timeout_s = queue_timeout_s
        self._held: dict[int, Reservation] = {}
        self._queue: deque[tuple[int, int, float]] = deque()  # (request, blocks, deadline_s)
        self.queue_peak = 0

    def blocks(self, prompt_tokens: int, max_tokens: int | None) -> int:
        """The reservation, as the gateway computes it; unset max_tokens is max_model_len − prompt."""
        grow = max_tokens if max_tokens is not None else max(self.max_model_len - prompt_tokens, 0)
        return max(request_reserved_blocks([min(prompt_tokens, self.max_model_len)], grow, self.block_size), 1)

    def arrive(self, request: int, prompt_tokens: int, max_tokens: int | None, now_s: float) -> Verdict:
        self._now_s = now_s
        blocks = self.blocks(prompt_tokens, max_tokens)
        if blocks > self.ledger.budget_blocks:
            return Verdict(VerdictKind.REFUSE)
        if not self._queue:
            reservation = self.ledger.try_reserve(blocks)
            if reservation is not None:
                self._held[request] = reservation
                return ADMIT
        if len(self._queue) < self.queue_max_waiting:
            self._queue.append((request, blocks, now_s + self.queue_timeout_s))
            self.queue_peak = max(self.queue_peak, len(self._queue))
            return Verdict(VerdictKind.QUEUE)
        return Verdict(VerdictKind.RETRY, self._retry_after(blocks))

    def _retry_after(self, blocks: int) -> float:
        return float(self.ledger.retry_after_s(blocks, min_s=self.retry_after_min_s, max_s=self.retry_after_max_s))

    def finish(self, request: int, now_s: float) -> Wakeup | None:
        self._now_s = now_s
        self._held.pop(request).release()
        return self._wake(Wakeup()) if self._queue else None

    def _wake(self, wakeup: Wakeup) -> Wakeup:
        while self._queue:
            request, blocks, _ = self._queue[0]
            reservation = self.ledger.try_reserve(blocks)
            if reservation is None:
                break
            self._queue.popleft()
            self._held[request] = reservation
            wakeup.admitted.append(request)
        return wakeup

    def poll(self, now_s: float) -> Wakeup | None:
        self._now_s = now_s
        if not self._queue or self._queue[0][2] > now_s:
            return None
        wakeup = Wakeup()
        while self._queue and self._queue[0][2] <= now_s:  # same timeout for all: deadlines in FIFO order
            request, blocks, _ = self._queue.popleft()
            self._wake(wakeup)
            wakeup.rejected.append((request, self._retry_after(blocks)))
        return wakeup

    def next_deadline_s(self) -> float | None:
        return self._queue[0][2] if self._queue else None

    @property
    def reserved_blocks(self) -> int:
        return self.ledger.reserved_blocks


__all__ = ["Admission", "DirectAdmission", "LedgerAdmission", "Verdict", "VerdictKind", "Wakeup", "ADMIT"]
