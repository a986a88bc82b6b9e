"""The flow-control queue (gateway.yaml `flow:`): priority bands, weighted fair flows, earliest
deadline first, and a forecast that sheds at arrival the request that cannot make its deadline.

docs/guides/flow-control.md is the specification; nginx + Lua implements the same rule. Like
kvtune.gateway.gate's FIFO it is synchronous and clock-free (the clock is injected): the live
gateway (kvtune.gateway.admission) wraps it in asyncio futures, the simulator
(kvtune.sim.admission) drives it in simulated seconds. No numpy: every step is a few integer sums
and one division, so the Lua side computes the same figures.
"""

from __future__ import annotations

import bisect
import hashlib
import heapq
import itertools
import math
from collections import OrderedDict
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from kvtune.domain.demand import Demand
from kvtune.domain.flow_control import WAIT_BUCKETS_S, FlowControl
from kvtune.domain.output_law import OutputLaw
from kvtune.gateway.gate import Turned
from kvtune.gateway.ledger import Ledger, Reservation, kept_blocks
from kvtune.gateway.refusals import Reason

K = TypeVar("K", bound=Hashable)

ANONYMOUS = "anonymous"
OTHER = "other"
MAX_FLOW_ID = 128
_HWS = " \t"


def band_of(flow: FlowControl, header_value: str | None, route_band: str | None) -> int:
    """The band a request waits in: the header's when it names one exactly, else the route's,
    else the default (an unknown header value is not an error)."""
    if header_value is not None:
        index = flow.band_index(header_value.strip(_HWS))
        if index is not None:
            return index
    index = flow.band_index(route_band)
    return flow.default_band_index if index is None else index


def flow_of(header_value: str | None, authorization: str | None) -> str:
    """The flow a request belongs to: the flow header's value, else `key-` and 16 hex digits of
    SHA-1 of the bearer token (never the token), else `anonymous`."""
    if header_value is not None:
        value = header_value.strip(_HWS)
        if 1 <= len(value) <= MAX_FLOW_ID and all(" " <= ch <= "~" for ch in value):
            return value
    if authorization is not None:
        scheme, _, token = authorization.strip(_HWS).partition(" ")
        token = token.strip(_HWS)
        if scheme.lower() == "bearer" and token:
            return "key-" + hashlib.sha1(token.encode("utf-8", "surrogateescape")).hexdigest()[:16]
    return ANONYMOUS


@dataclass(slots=True)
class FlowCounts:
    """What one flow (or a band's `other`) has seen."""

    admitted: int = 0
    shed_deadline: int = 0
    shed_full: int = 0
    timed_out: int = 0
    wait_buckets: list[int] | None = None  # cumulative-free counts per WAIT_BUCKETS_S bucket, then +Inf
    wait_sum_s: float = 0.0

    @property
    def shed(self) -> int:
        return self.shed_deadline + self.shed_full

    @property
    def traffic(self) -> int:
        return self.admitted + self.shed + self.timed_out

    def observe_wait(self, wait_s: float) -> None:
        if self.wait_buckets is None:
            self.wait_buckets = [0] * (len(WAIT_BUCKETS_S) + 1)
        self.wait_buckets[bisect.bisect_left(WAIT_BUCKETS_S, wait_s)] += 1
        self.wait_sum_s += wait_s

    def add(self, other: FlowCounts) -> None:
        self.admitted += other.admitted
        self.shed_deadline += other.shed_deadline
        self.shed_full += other.shed_full
        self.timed_out += other.timed_out
        if other.wait_buckets is not None:
            if self.wait_buckets is None:
                self.wait_buckets = [0] * (len(WAIT_BUCKETS_S) + 1)
            for i, n in enumerate(other.wait_buckets):
                self.wait_buckets[i] += n
        self.wait_sum_s += other.wait_sum_s


class _Waiter(Generic[K]):
    __slots__ = ("key", "blocks", "demand", "deadline", "seq", "arrived", "flow")

    def __init__(self, key: K, blocks: int, demand: Demand | None, deadline: float, seq: int,
                 arrived: float, flow: _Flow) -> None:
        self.key, self.blocks, self.demand, self.deadline = key, blocks, demand, deadline
        self.seq, self.arrived, self.flow = seq, arrived, flow

    def order(self) -> tuple[float, int]:
        return (self.deadline, self.seq)


class _Flow:
    __slots__ = ("band", "name", "weight", "finish", "start", "waiters", "waiting_blocks", "counts")

    def __init__(self, band: int, name: str, weight: float) -> None:
        self.band, self.name, self.weight = band, name, weight
        self.finish = 0.0
        self.start = 0.0
        self.waiters: list[_Waiter[Any]] = []  # earliest deadline first
        self.waiting_blocks = 0
        self.counts = FlowCounts()


class _Band:
    __slots__ = ("name", "deadline_s", "vtime", "waiting", "other")

    def __init__(self, name: str, deadline_s: float) -> None:
        self.name, self.deadline_s = name, deadline_s
        self.vtime = 0.0
        self.waiting: dict[str, _Flow] = {}  # flows with a waiter
        self.other = FlowCounts()  # evicted flows' counts


class _Held:
    """An admitted reservation as the forecast sees it."""

    __slots__ = ("blocks", "admitted_at", "cap", "ends", "streamed", "seq")

    def __init__(self, blocks: int, admitted_at: float, cap: int, ends: _Ends | None, seq: int) -> None:
        self.blocks, self.admitted_at, self.cap, self.ends, self.seq = blocks, admitted_at, cap, ends, seq
        self.streamed = 0


class _Ends:
    """A law under a cap, ready for `tokens_left`: m_j = min(l_j, cap) and the suffix sums of
    c_j and c_j x m_j."""

    __slots__ = ("m", "suffix_c", "suffix_cm")

    def __init__(self, law: OutputLaw, cap: int) -> None:
        self.m = [min(length, cap) for length in law.lengths]
        counts = law.counts
        n = len(self.m)
        self.suffix_c = [0] * (n + 1)
        self.suffix_cm = [0] * (n + 1)
        for j in range(n - 1, -1, -1):
            self.suffix_c[j] = self.suffix_c[j + 1] + counts[j]
            self.suffix_cm[j] = self.suffix_cm[j + 1] + counts[j] * self.m[j]

    def tokens_left(self, generated: int) -> float:
        j = bisect.bisect_right(self.m, generated)  # the bins with m_j > generated
        total = self.suffix_c[j]
        if total <= 0:
            return 1.0
        return (self.suffix_cm[j] - generated * total) / total


def tokens_left(cap: int, law: OutputLaw | None, generated: int) -> float:
    """R: the expected output tokens a request still generates (the spec's step 3), at least 1."""
    if law is None:
        return float(max(cap - generated, 1))
    return max(_Ends(law, cap).tokens_left(generated), 1.0)


def forecast_wait_s(held: Sequence[tuple[int, float]], need: int) -> float:
    """The walk (the spec's step 4): `held` is each admitted reservation's (blocks, seconds until
    it ends) in the order they end; the seconds until `need` blocks have been given back, whole
    turns of everything admitted counted first. 0 when nothing is admitted or nothing is needed."""
    total = sum(blocks for blocks, _ in held)
    if need <= 0 or total <= 0:
        return 0.0
    turns = (need - 1) // total
    rest = need - turns * total
    t_last = held[-1][1]
    running = 0
    for blocks, t in held:
        running += blocks
        if running >= rest:
            return turns * t_last + t
    return turns * t_last + t_last  # unreachable: rest <= total


class FlowGate(Generic[K]):
    """The ledger, the priority bands and their fair flows of waiters, each request known by its
    key; the admitted reservations' ends, for the forecast. The same interface as
    kvtune.gateway.gate.AdmissionGate, a band and a flow added to `offer`."""

    def __init__(self, ledger: Ledger, flow: FlowControl, *, retry_after_min_s: int, retry_after_max_s: int,
                 clock: Callable[[], float], gone: Callable[[K], bool] | None = None) -> None:
        self.ledger = ledger
        self.config = flow
        self.retry_after_min_s = retry_after_min_s
        self.retry_after_max_s = retry_after_max_s
        self._clock = clock
        self._gone = gone
        self._bands = [_Band(b.name, b.deadline_s) for b in flow.bands]
        self._kept = [flow.kept_blocks(i) for i in range(len(flow.bands))]  # K_b (The reserve)
        self._flows: OrderedDict[tuple[int, str], _Flow] = OrderedDict()  # LRU: least recent first
        self._by_key: dict[K, _Waiter[K]] = {}
        self._deadlines: list[tuple[float, int, K]] = []  # a heap; entries of waiters gone are skipped
        self._held: dict[int, _Held] = {}  # id(reservation) -> its forecast entry
        self._ends: dict[tuple[OutputLaw, int], _Ends] = {}
        self._seq = itertools.count()
        self.waiting_peak = 0

    # -- the gate's interface

    @property
    def waiting(self) -> int:
        return len(self._by_key)

    def never_fits(self, blocks: int, demand: Demand | None = None) -> bool:
        return self.ledger.never_fits(blocks, demand)

    def deadline_s(self, band: int) -> float:
        return self._bands[band].deadline_s

    def kept_blocks(self, band: int) -> int:
        """K_b: the blocks a request of this band leaves free for the bands above it."""
        return self._kept[band]

    def offer(self, key: K, blocks: int, now: float, demand: Demand | None = None, *, band: int = 0,
              flow: str = ANONYMOUS) -> Reservation | Turned | None:
        """A reservation now; None when the request now waits under `key`; or a 429."""
        if not any(b.waiting for b in self._bands[:band + 1]):
            reservation = self.ledger.try_reserve(blocks, demand, self._kept[band])
            if reservation is not None:
                self._admitted(reservation, demand, now)
                state = self._flow(band, flow, create=True)
                counts = state.counts if state is not None else self._bands[band].other
                counts.admitted += 1
                counts.observe_wait(0.0)
                return reservation
        state = self._flow(band, flow, create=True)
        if state is None or self.waiting >= self.config.max_waiting \
                or len(state.waiters) >= self.config.max_waiting_per_flow:
            counts = state.counts if state is not None else self._bands[band].other
            counts.shed_full += 1
            return self._turn(Reason.QUEUE_FULL, blocks, band, flow, now)
        wait_s = self.forecast_s(blocks, band, flow, now)
        if wait_s > self._bands[band].deadline_s:
            state.counts.shed_deadline += 1
            return Turned(Reason.DEADLINE_UNREACHABLE, self._retry_after(wait_s))
        self._enqueue(state, key, blocks, demand, now)
        return None

    def track(self, reservation: Reservation, demand: Demand | None, band: int, flow: str) -> None:
        """A reservation made beside the gate (a sticky upstream's, while nobody waits): the
        forecast knows it, and it counts as admitted at once."""
        self._admitted(reservation, demand, self._clock())
        state = self._flow(band, flow, create=True)
        counts = state.counts if state is not None else self._bands[band].other
        counts.admitted += 1
        counts.observe_wait(0.0)

    def release(self, reservation: Reservation) -> Sequence[tuple[K, Reservation]]:
        """Give the blocks back (once) and serve whoever waits: the (key, reservation) granted."""
        if reservation.release():
            self._held.pop(id(reservation), None)
        return self.wake() if self._by_key else ()

    def progress(self, reservation: Reservation, streamed_tokens: int) -> None:
        """An admitted request has reported this many streamed tokens (s_i of the forecast)."""
        held = self._held.get(id(reservation))
        if held is not None and streamed_tokens > held.streamed:
            held.streamed = streamed_tokens

    def wake(self) -> Sequence[tuple[K, Reservation]]:
        """Serve waiters by the order rule while the chosen one fits (nobody overtakes it)."""
        granted: list[tuple[K, Reservation]] = []
        if not self._by_key:
            return granted
        now = self._clock()
        gone = self._gone
        while True:
            waiter = self._next()
            if waiter is None:
                break
            if gone is not None and gone(waiter.key):  # cancelled, its finally not yet run
                self._remove(waiter)
                continue
            state = waiter.flow
            reservation = self.ledger.try_reserve(waiter.blocks, waiter.demand, self._kept[state.band])
            if reservation is None:
                break
            band = self._bands[state.band]
            self._remove(waiter)
            band.vtime = state.start
            state.finish = state.start + waiter.blocks / state.weight
            if state.waiters:
                state.start = state.finish
            self._admitted(reservation, waiter.demand, now)
            state.counts.admitted += 1
            state.counts.observe_wait(max(0.0, now - waiter.arrived))
            granted.append((waiter.key, reservation))
        return granted

    def leave(self, key: K) -> Sequence[tuple[K, Reservation]]:
        """`key` stops waiting (cancelled); the chosen head may have changed, so wake."""
        waiter = self._by_key.get(key)
        if waiter is not None:
            self._remove(waiter)
        return self.wake()

    def time_out(self, key: K, now: float) -> tuple[Sequence[tuple[K, Reservation]], Turned | None]:
        """`key`'s deadline has come: it leaves with its 429 (None if it was no longer waiting)."""
        waiter = self._by_key.get(key)
        if waiter is None:
            return self.wake(), None
        self._remove(waiter)
        granted = self.wake()
        waiter.flow.counts.timed_out += 1
        return granted, self._turn(Reason.QUEUE_TIMEOUT, waiter.blocks, waiter.flow.band, waiter.flow.name, now)

    def next_deadline(self) -> float | None:
        heap = self._deadlines
        while heap and heap[0][2] not in self._by_key:
            heapq.heappop(heap)
        return heap[0][0] if heap else None

    def deadline_of(self, key: K) -> float | None:
        waiter = self._by_key.get(key)
        return None if waiter is None else waiter.deadline

    def expire(self, now: float) -> tuple[list[tuple[K, Reservation]], list[tuple[K, Turned]]]:
        """Every waiter whose deadline has come leaves; what that grants, and their 429s."""
        granted: list[tuple[K, Reservation]] = []
        turned: list[tuple[K, Turned]] = []
        while True:
            deadline = self.next_deadline()
            if deadline is None or deadline > now:
                break
            key = heapq.heappop(self._deadlines)[2]
            more, turn = self.time_out(key, now)
            granted.extend(more)
            if turn is not None:
                turned.append((key, turn))
        return granted, turned

    def turn(self, blocks: int, reason: Reason, band: int = 0, flow: str = ANONYMOUS) -> Turned:
        """A 429 given outside the queue (shared ledger): Retry-After from the forecast."""
        return self._turn(reason, blocks, band, flow, self._clock())

    # -- the forecast

    def forecast_s(self, blocks: int, band: int, flow: str, now: float) -> float:
        """Seconds until a request of `blocks` in `band` and `flow`, arriving now, would be
        admitted (docs/guides/flow-control.md, The forecast)."""
        ahead = 0
        for b in self._bands[:band]:
            for state in b.waiting.values():
                ahead += state.waiting_blocks
        own = self._bands[band].waiting.get(flow)
        own_blocks = own.waiting_blocks if own is not None else 0
        own_weight = self.config.weight(flow)
        ahead += own_blocks
        for name, state in self._bands[band].waiting.items():
            if name != flow:
                ahead += min(state.waiting_blocks, math.ceil((own_blocks + blocks) * state.weight / own_weight))
        limit = self.ledger.limit_blocks
        free = max(0, limit - self.ledger.reserved_blocks)
        need = ahead + blocks + kept_blocks(self._kept[band], limit, blocks) - free
        if need <= 0 or not self._held:
            return 0.0
        tau = self.config.token_time_s
        ends: list[tuple[float, int, int]] = []
        for held in self._held.values():
            generated = min(held.cap, max(held.streamed, math.floor((now - held.admitted_at) / tau)))
            if held.ends is None:
                left = float(held.cap - generated) if held.cap > 0 else 1.0
            else:
                left = held.ends.tokens_left(generated)
            ends.append((max(left, 1.0) * tau, held.seq, held.blocks))
        ends.sort()
        return forecast_wait_s([(b, t) for t, _, b in ends], need)

    # -- inside

    def _retry_after(self, wait_s: float) -> int:
        return max(self.retry_after_min_s, min(self.retry_after_max_s, math.ceil(wait_s)))

    def _turn(self, reason: Reason, blocks: int, band: int, flow: str, now: float) -> Turned:
        return Turned(reason, self._retry_after(self.forecast_s(blocks, band, flow, now)))

    def _admitted(self, reservation: Reservation, demand: Demand | None, now: float) -> None:
        if demand is None:
            held = _Held(reservation.blocks, now, 0, None, next(self._seq))
        else:
            ends = None
            if demand.law is not None:
                cache_key = (demand.law, demand.cap)
                ends = self._ends.get(cache_key)
                if ends is None:
                    if len(self._ends) >= 256:
                        self._ends.clear()
                    ends = self._ends[cache_key] = _Ends(demand.law, demand.cap)
            held = _Held(reservation.blocks, now, demand.cap, ends, next(self._seq))
        self._held[id(reservation)] = held

    def _flow(self, band: int, name: str, *, create: bool) -> _Flow | None:
        """The flow's state (most recently used now); a new one when `create`, evicting the
        least recently used idle flow at max_flows; None when there is no room for it."""
        flows = self._flows
        key = (band, name)
        state = flows.get(key)
        if state is not None:
            flows.move_to_end(key)
            return state
        if not create:
            return None
        if len(flows) >= self.config.max_flows:
            for old_key, old in flows.items():
                if not old.waiters:
                    del flows[old_key]
                    self._bands[old.band].other.add(old.counts)
                    break
            else:
                return None
        state = flows[key] = _Flow(band, name, self.config.weight(name))
        return state

    def _enqueue(self, state: _Flow, key: K, blocks: int, demand: Demand | None, now: float) -> None:
        band = self._bands[state.band]
        waiter = _Waiter(key, blocks, demand, now + band.deadline_s, next(self._seq), now, state)
        if not state.waiters:
            state.start = max(band.vtime, state.finish)
            band.waiting[state.name] = state
        bisect.insort(state.waiters, waiter, key=_Waiter.order)
        state.waiting_blocks += blocks
        self._by_key[key] = waiter
        heapq.heappush(self._deadlines, (waiter.deadline, waiter.seq, key))
        if len(self._by_key) > self.waiting_peak:
            self.waiting_peak = len(self._by_key)

    def _remove(self, waiter: _Waiter[K]) -> None:
        state = waiter.flow
        state.waiters.remove(waiter)
        state.waiting_blocks -= waiter.blocks
        del self._by_key[waiter.key]
        if not state.waiters:
            del self._bands[state.band].waiting[state.name]

    def _next(self) -> _Waiter[K] | None:
        for band in self._bands:
            if band.waiting:
                best = min(band.waiting.values(), key=lambda f: (f.start, f.waiters[0].seq))
                return best.waiters[0]
        return None

    # -- what it reports

    def report(self) -> dict:
        """/kvtune/ledger's `flow` member (docs/guides/flow-control.md, Observability)."""
        bands = []
        for i, band in enumerate(self._bands):
            top, other = self.top_flows(i)
            other_waiting = sum(len(f.waiters) for f in band.waiting.values() if f not in top)
            total = FlowCounts()
            total.add(other)
            for f in top:
                total.add(f.counts)
            bands.append({"name": band.name, "deadline_s": band.deadline_s,
                          "reserve_blocks": self.config.bands[i].reserve_blocks, "kept_blocks": self._kept[i],
                          "waiting": sum(len(f.waiters) for f in band.waiting.values()),
                          **_counts_json(total),
                          "flows": [{"flow": f.name, "waiting": len(f.waiters), **_counts_json(f.counts)}
                                    for f in top],
                          "other": {"waiting": other_waiting, **_counts_json(other)}})
        return {"token_time_s": self.config.token_time_s, "waiting": self.waiting, "flows": len(self._flows),
                "bands": bands}

    def top_flows(self, band: int) -> tuple[list[_Flow], FlowCounts]:
        """The band's metrics_flows flows with the most traffic, and the rest's counts summed
        (evicted flows' included)."""
        flows = [f for (b, _), f in self._flows.items() if b == band]
        flows.sort(key=lambda f: (-f.counts.traffic, f.name))
        n = self.config.metrics_flows
        other = FlowCounts()
        other.add(self._bands[band].other)
        for f in flows[n:]:
            other.add(f.counts)
        return flows[:n], other

    def waiting_by_flow(self, band: int) -> Mapping[str, int]:
        return {name: len(f.waiters) for name, f in self._bands[band].waiting.items()}

    @property
    def band_names(self) -> tuple[str, ...]:
        return tuple(b.name for b in self._bands)

    @property
    def held_count(self) -> int:
        """Admitted reservations the forecast knows (one per request admitted and not released)."""
        return len(self._held)


def _counts_json(counts: FlowCounts) -> dict:
    return {"admitted": counts.admitted, "shed": counts.shed, "timed_out": counts.timed_out}


__all__ = ["ANONYMOUS", "OTHER", "FlowCounts", "FlowGate", "band_of", "flow_of", "forecast_wait_s", "tokens_left"]
