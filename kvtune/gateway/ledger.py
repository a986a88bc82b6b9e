"""The block ledger: how many KV blocks admitted requests hold, and how fast they give them back.

Reservations are held against `limit_blocks`: the budget itself (guaranteed), or floor(k x
budget) for an overcommit factor k (kvtune.domain.admission_policy); the worst-case sum never exceeds it.
kvtune.gateway.statistical's ledger admits instead while the probability that the held sequences'
KV outgrows the budget stays within epsilon.

Pure and synchronous: reserve and release never await, so a release placed first in a `finally`
block runs even when the task is being cancelled, and no other task can interleave between the
check and the add. The clock is injected so Retry-After is testable without sleeping.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from kvtune.domain.demand import Demand

# Releases are averaged over about this many seconds (same constant as the rendered nginx.conf).
RATE_WINDOW_S = 30.0


class Reservation:
    """Blocks held by one admitted request; `release()` gives them back once, later calls do nothing."""

    __slots__ = ("blocks", "_ledger", "_released", "_next_mark")

    def __init__(self, ledger: BlockLedger, blocks: int, next_mark: int | None = None) -> None:
        self.blocks = blocks
        self._ledger = ledger
        self._released = False
        self._next_mark = next_mark  # streamed tokens at which the ledger wants to hear again

    @property
    def released(self) -> bool:
        return self._released

    @property
    def ledger(self) -> BlockLedger:
        """The ledger the blocks are held on (with several upstreams: which one's)."""
        return self._ledger

    def release(self) -> bool:
        """Return the blocks to the ledger; True the first time, False on any later call."""
        if self._released:
            return False
        self._released = True
        self._ledger._give_back(self)
        return True

    def progress(self, streamed_tokens: int) -> None:
        """The request has streamed this many tokens (per sequence): a ledger that conditions on
        progress (statistical) updates what it expects this request to reach. Cheap to call per
        chunk: it does something only at the marks 16, 32, 64, ..."""
        mark = self._next_mark
        if mark is not None and streamed_tokens >= mark and not self._released:
            self._next_mark = self._ledger._progress(self, streamed_tokens)


@dataclass(frozen=True, slots=True)
class LedgerSnapshot:
    budget_blocks: int
    reserved_blocks: int
    inflight_requests: int
    release_rate_blocks_per_s: float
    limit_blocks: int
    overflow_probability: float | None = None  # statistical: P(the held KV outgrows the budget)


def kept_blocks(keep_blocks: int, limit_blocks: int, blocks: int) -> int:
    """k: the blocks a reservation of `blocks` leaves free for higher bands on a ledger of limit L,
    min(K_b, max(0, L - blocks)), so that a request too large to fit beside the reserve is still
    admitted into an empty ledger (docs/guides/flow-control.md, The reserve)."""
    return min(keep_blocks, max(0, limit_blocks - blocks))


class Ledger(Protocol):
    """What the admission gate (kvtune.gateway.gate) reserves through: one BlockLedger, or the
    pool of every upstream's (kvtune.gateway.pool)."""

    @property
    def reserved_blocks(self) -> int: ...
    @property
    def limit_blocks(self) -> int: ...
    def try_reserve(self, blocks: int, demand: Demand | None = None, keep_blocks: int = 0) -> Reservation | None: ...
    def never_fits(self, blocks: int, demand: Demand | None = None) -> bool: ...
    def retry_after_s(self, blocks: int, *, min_s: int, max_s: int) -> int: ...


class BlockLedger:
    """A budget of KV blocks; reservations are all-or-nothing and never push the worst-case sum
    over `limit_blocks` (the budget unless an overcommit factor raised it)."""

    def __init__(self, budget_blocks: int, *, clock: Callable[[], float] = time.monotonic,
                 rate_window_s: float = RATE_WINDOW_S, limit_blocks: int | None = None) -> None:
        if budget_blocks < 1:
            raise ValueError(f"budget_blocks must be at least 1, got {budget_blocks}")
        if limit_blocks is not None and limit_blocks < budget_blocks:
            raise ValueError(f"limit_blocks must be at least the budget {budget_blocks}, got {limit_blocks}")
        self.budget_blocks = budget_blocks
        self.limit_blocks = budget_blocks if limit_blocks is None else limit_blocks
        self._clock = clock
        self._window_s = rate_window_s
        self._reserved = 0
        self._inflight = 0
        # Exponentially decayed sum of released blocks and when it was last updated.
        self._released_sum = 0.0
        self._released_at: float | None = None

    @property
    def reserved_blocks(self) -> int:
        return self._reserved

    @property
    def inflight_requests(self) -> int:
        return self._inflight

    @property
    def free_blocks(self) -> int:
        return self.limit_blocks - self._reserved

    def fits(self, blocks: int) -> bool:
        return self._reserved + blocks <= self.limit_blocks

    def never_fits(self, blocks: int, demand: Demand | None = None) -> bool:
        """No ledger state could ever admit it (413): more blocks than the limit."""
        return blocks > self.limit_blocks

    def try_reserve(self, blocks: int, demand: Demand | None = None, keep_blocks: int = 0) -> Reservation | None:
        """Hold `blocks` if they fit in what is free now, leaving `keep_blocks` free beside them
        (flow control's reserve for higher bands, clamped by kept_blocks), else None (nothing is
        held). `demand` (what the request's sequences may reach) matters only to the statistical
        ledger."""
        if blocks < 1:
            raise ValueError(f"a reservation needs at least 1 block, got {blocks}")
        if not self.fits(blocks + kept_blocks(keep_blocks, self.limit_blocks, blocks)):
            return None
        self._reserved += blocks
        self._inflight += 1
        return Reservation(self, blocks)

    def _progress(self, reservation: Reservation, streamed_tokens: int) -> int | None:
        return None

    def _give_back(self, reservation: Reservation) -> None:
        blocks = reservation.blocks
        if blocks > self._reserved or self._inflight < 1:  # only reachable through a bug
            raise RuntimeError(f"ledger underflow: releasing {blocks} of {self._reserved} blocks")
        self._reserved -= blocks
        self._inflight -= 1
        now = self._clock()
        self._released_sum = self._decayed_sum(now) + blocks
        self._released_at = now

    def _decayed_sum(self, now: float) -> float:
        if self._released_at is None:
            return 0.0
        return self._released_sum * math.exp(-max(0.0, now - self._released_at) / self._window_s)

    def release_rate(self) -> float | None:
        """Blocks released per second, exponentially weighted over the window; None before any."""
        if self._released_at is None:
            return None
        return self._decayed_sum(self._clock()) / self._window_s

    def retry_after_s(self, blocks: int, *, min_s: int, max_s: int) -> int:
        """Seconds until `blocks` more are expected to be free at the observed release rate,
        clamped to [min_s, max_s]. No release seen yet: min_s (nothing to go on, ask soon)."""
        need = self._retry_need(blocks)
        rate = self.release_rate()
        if rate is None:
            secs = min_s
        elif rate <= 0:
            secs = max_s
        else:
            secs = math.ceil(need / rate)
        return max(min_s, min(max_s, secs))

    def _retry_need(self, blocks: int) -> int:
        """Blocks that must be released before `blocks` more fit under the limit."""
        return max(1, self._reserved + blocks - self.limit_blocks)

    def snapshot(self) -> LedgerSnapshot:
        return LedgerSnapshot(self.budget_blocks, self._reserved, self._inflight,
                              self.release_rate() or 0.0, self.limit_blocks)


__all__ = ["BlockLedger", "Ledger", "Reservation", "LedgerSnapshot", "RATE_WINDOW_S", "kept_blocks"]
