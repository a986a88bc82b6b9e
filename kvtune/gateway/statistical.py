"""The statistical policy's ledger: admits while a bound on P(the held sequences' KV outgrows the
budget) stays within epsilon (kvtune.gateway.overflow states the bound and computes it).

It is a BlockLedger (reservations, release exactly once, the release rate behind Retry-After)
that also keeps, for every held sequence, what it may still reach: its rows of block counts and
log-moments, whose sum gives the Chernoff bound at once and whose convolution, while cheap, gives
the exact probability.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import numpy as np

from kvtune.domain.demand import Demand
from kvtune.domain.output_law import OutputLaw
from kvtune.gateway.ledger import RATE_WINDOW_S, BlockLedger, LedgerSnapshot, Reservation, kept_blocks
from kvtune.gateway.overflow import (
    THETAS,
    SequenceRows,
    chernoff_tail,
    combine,
    convolve_clipped,
    exact_is_cheap,
    exact_units,
    interval_edges,
    last_mark,
    next_mark,
    rows_distribution,
    sequence_rows,
)

#: Removals after which the running sums of log-moments are added up afresh (float drift).
RESUM_EVERY = 1024


class StatisticalLedger(BlockLedger):
    """Admits while P(the held sequences' KV outgrows the budget) <= epsilon, bounded as
    kvtune.gateway.overflow states; epsilon 0 is the guaranteed ledger exactly.

    `reserved_blocks` still counts every request's worst case (what guaranteed would hold): it may
    exceed the budget, which is the point. Each held sequence keeps its rows; the ledger keeps their
    log-moment sum (the Chernoff bound) and, while convolving is cheap, each row's exact distribution."""

    def __init__(self, budget_blocks: int, *, epsilon: float, block_size: int, max_model_len: int,
                 clock: Callable[[], float] = time.monotonic, rate_window_s: float = RATE_WINDOW_S) -> None:
        super().__init__(budget_blocks, clock=clock, rate_window_s=rate_window_s)
        if not 0.0 <= epsilon < 1.0:
            raise ValueError(f"epsilon must be in [0, 1), got {epsilon!r}")
        self.epsilon = epsilon
        self.block_size = block_size
        self.edges = interval_edges(max_model_len)
        self.rows = len(self.edges) + 1
        self._held: dict[int, tuple[Demand, list[SequenceRows]]] = {}
        self._worst = 0  # sum of the held sequences' worst cases
        self._units = 0  # sum of their exact_units: what convolving them all costs
        self._log_mgf = np.zeros((self.rows, len(THETAS)))
        self._exact: np.ndarray | None = np.zeros((self.rows, budget_blocks + 2))
        self._exact[:, 0] = 1.0
        self._removals = 0
        self.last_admitted_probability = 0.0
        # told after a progress update re-held a reservation's rows (the shared ledger sends them on)
        self.on_progress: Callable[[Reservation], None] | None = None
        # admit on the Chernoff bound alone, never convolving (the exact law is then computed only
        # when read, for /metrics): the shared ledger sets it, as Redis then bounds a superset of
        # these rows by Chernoff (never below this one's): what the convolution would admit
        # beyond it, Redis refuses anyway
        self.chernoff_only = False

    # -- what a request may reach

    def _rows_of(self, blocks: int, demand: Demand | None, streamed: int = 0) -> list[SequenceRows]:
        if demand is None:  # nothing known: it holds its reservation for as long as can be
            return [_fixed_rows(blocks, self.rows)]
        law = demand.law or OutputLaw.worst_case(demand.cap)
        return [sequence_rows(p, demand.cap, law, streamed, block_size=self.block_size, edges=self.edges)
                for p in demand.prompts]

    # -- the probability

    def overflow_probability(self, extra: Sequence[SequenceRows] = ()) -> float:
        """P(peak KV of the held sequences, plus `extra`, outgrows the budget), bounded above."""
        capacity = self.budget_blocks
        if self._worst + sum(s.worst for s in extra) <= capacity:
            return 0.0
        units = self._units + sum(exact_units(s.worst, capacity) for s in extra)
        if exact_is_cheap(units, capacity, self.rows):
            dists = self._exact_rows()
            tails = np.empty(self.rows)
            for r in range(self.rows):
                dist = dists[r]
                for s in extra:
                    dist = convolve_clipped(dist, s.values[r], s.probs, capacity)
                tails[r] = min(1.0, max(0.0, float(dist[capacity + 1])))
            return combine(tails)
        total = self._log_mgf
        for s in extra:
            total = total + s.log_mgf
        return combine(chernoff_tail(total, capacity))

    def _exact_rows(self) -> np.ndarray:
        if self._exact is None:
            held = [s for _, rows in self._held.values() for s in rows]
            self._exact = rows_distribution(held, self.rows, self.budget_blocks)
        return self._exact

    def chernoff_bound(self, extra: Sequence[SequenceRows] = ()) -> float:
        """The Chernoff side of overflow_probability, never below it: cheap (a sum of rows), so
        an admission it already allows needs no convolution."""
        capacity = self.budget_blocks
        if self._worst + sum(s.worst for s in extra) <= capacity:
            return 0.0
        total = self._log_mgf
        for s in extra:
            total = total + s.log_mgf
        return combine(chernoff_tail(total, capacity))

    # -- the ledger

    def never_fits(self, blocks: int, demand: Demand | None = None) -> bool:
        """Its own overflow probability, alone in an empty ledger, exceeds epsilon (at 0: more
        blocks than the budget)."""
        if self.epsilon == 0.0 or blocks <= self.budget_blocks:
            return blocks > self.budget_blocks
        alone = self._rows_of(blocks, demand)
        if sum(s.worst for s in alone) <= self.budget_blocks:
            return False
        empty = StatisticalLedger(self.budget_blocks, epsilon=self.epsilon, block_size=self.block_size,
                                  max_model_len=self.edges[-1][1], clock=self._clock)
        return empty.overflow_probability(alone) > self.epsilon

    def try_reserve(self, blocks: int, demand: Demand | None = None, keep_blocks: int = 0) -> Reservation | None:
        """Hold it while the bound stays within epsilon; `keep_blocks` (flow control's reserve for
        higher bands) enters the bound as a reservation of that many blocks without a demand, beside
        it and never held: P(peak KV > budget - k) <= epsilon."""
        if blocks < 1:
            raise ValueError(f"a reservation needs at least 1 block, got {blocks}")
        rows = self._rows_of(blocks, demand)
        keep = kept_blocks(keep_blocks, self.budget_blocks, blocks)
        if self.epsilon == 0.0:
            if self._reserved + blocks + keep > self.budget_blocks:
                return None
            probability = 0.0
        else:
            extra = rows + [_fixed_rows(keep, self.rows)] if keep else rows
            # the bound is never below the exact probability: within epsilon, the exact one is too
            probability = self.chernoff_bound(extra)
            if probability > self.epsilon:
                if self.chernoff_only:
                    return None
                probability = self.overflow_probability(extra)
                if probability > self.epsilon:
                    return None
        self._reserved += blocks
        self._inflight += 1
        conditioned = demand is not None and len(demand.prompts) == 1
        reservation = Reservation(self, blocks, next_mark(0) if conditioned else None)
        self._hold(id(reservation), demand, rows)
        self.last_admitted_probability = probability
        return reservation

    def _hold(self, key: int, demand: Demand | None, rows: list[SequenceRows]) -> None:
        self._held[key] = (demand or Demand((), 0), rows)
        capacity = self.budget_blocks
        for s in rows:
            self._worst += s.worst
            self._units += exact_units(s.worst, capacity)
            self._log_mgf += s.log_mgf
            if self._exact is not None:
                if exact_is_cheap(self._units, capacity, self.rows) and not self.chernoff_only:
                    self._exact = np.vstack([convolve_clipped(self._exact[r], s.values[r], s.probs, capacity)
                                             for r in range(self.rows)])
                else:
                    self._exact = None

    def _unhold(self, key: int) -> Demand:
        demand, rows = self._held.pop(key)
        for s in rows:
            self._worst -= s.worst
            self._units -= exact_units(s.worst, self.budget_blocks)
            self._log_mgf -= s.log_mgf
        self._exact = None
        self._removals += 1
        if self._removals % RESUM_EVERY == 0 or not self._held:
            self._log_mgf = np.zeros_like(self._log_mgf)
            for _, held in self._held.values():
                for s in held:
                    self._log_mgf += s.log_mgf
        return demand

    def held_rows(self, reservation: Reservation) -> tuple[int, np.ndarray] | None:
        """A held reservation's worst case and log-moment rows, its sequences' summed (what the
        shared ledger stores for it); None if it is not held here."""
        held = self._held.get(id(reservation))
        if held is None:
            return None
        rows = held[1]
        total = np.zeros((self.rows, len(THETAS)))
        for s in rows:
            total = total + s.log_mgf
        return sum(s.worst for s in rows), total

    def _progress(self, reservation: Reservation, streamed_tokens: int) -> int | None:
        key = id(reservation)
        if key not in self._held:
            return None
        demand = self._unhold(key)
        mark = last_mark(streamed_tokens)
        self._hold(key, demand, self._rows_of(reservation.blocks, demand, min(mark, demand.cap)))
        if self.on_progress is not None:
            self.on_progress(reservation)
        return next_mark(streamed_tokens)

    def _give_back(self, reservation: Reservation) -> None:
        super()._give_back(reservation)
        self._unhold(id(reservation))

    def _retry_need(self, blocks: int) -> int:
        """At most the request's own blocks: reserved_blocks counts every held worst case and
        exceeds the budget by design, so the excess over it (the guaranteed rule) would tell a
        client to wait for releases admission does not need (40 s on a nearly idle pool)."""
        return min(blocks, super()._retry_need(blocks))

    def snapshot(self) -> LedgerSnapshot:
        return LedgerSnapshot(self.budget_blocks, self._reserved, self._inflight, self.release_rate() or 0.0,
                              self.limit_blocks, self.overflow_probability())


def _fixed_rows(blocks: int, rows: int) -> SequenceRows:
    """A request whose blocks are all it will hold, for as long as anything runs (no law known)."""
    values = np.full((rows, 1), blocks, dtype=np.int64)
    log_mgf = np.asarray(THETAS)[None, :] * blocks * np.ones((rows, 1))
    return SequenceRows(values, np.ones(1), log_mgf, blocks)


__all__ = ["StatisticalLedger"]
