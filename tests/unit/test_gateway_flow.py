"""kvtune.gateway.flow: the flow-control queue's rule (docs/guides/flow-control.md) without a clock:
deadline shed at arrival, EDF, priority, fairness under a flooding tenant, release exactly once,
bounded memory."""

from __future__ import annotations

import hashlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtune.domain.demand import Demand
from kvtune.domain.flow_control import Band, FlowControl
from kvtune.domain.output_law import OutputLaw
from kvtune.gateway.flow import FlowGate, band_of, flow_of, forecast_wait_s, tokens_left
from kvtune.gateway.gate import AdmissionGate, Turned
from kvtune.gateway.ledger import BlockLedger, Reservation
from kvtune.gateway.refusals import Reason
from kvtune.gateway.statistical import StatisticalLedger

TWO_BANDS = (Band("interactive", 2.0), Band("batch", 1000.0))
RESERVED = (Band("interactive", 1000.0, reserve_blocks=3), Band("batch", 1000.0))


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def gate(budget=10, bands=TWO_BANDS, token_time_s=0.1, clock=None, **kw) -> tuple[FlowGate[str], Clock]:
    clock = clock or Clock()
    flow = FlowControl(token_time_s=token_time_s, bands=bands, **kw)
    return FlowGate(BlockLedger(budget, clock=clock), flow, retry_after_min_s=1, retry_after_max_s=60,
                    clock=clock), clock


def demand(cap: int, law: OutputLaw | None = None) -> Demand:
    return Demand((16,), cap, law)


def test_tokens_left_and_the_walk_follow_the_spec():
    assert tokens_left(100, None, 30) == 70.0
    law = OutputLaw((10, 100), (3, 1))
    assert tokens_left(100, law, 0) == (3 * 10 + 1 * 100) / 4
    assert tokens_left(100, law, 10) == 90.0  # only the bin past 10 remains
    assert tokens_left(50, law, 0) == (3 * 10 + 1 * 50) / 4  # the cap clips the bins
    assert tokens_left(100, law, 100) == 1.0  # past every bin: it ends at once
    held = [(4, 1.0), (4, 2.0), (2, 5.0)]  # (blocks, seconds until it ends), in order
    assert forecast_wait_s(held, 0) == 0.0
    assert forecast_wait_s(held, 4) == 1.0
    assert forecast_wait_s(held, 5) == 2.0
    assert forecast_wait_s(held, 10) == 5.0
    assert forecast_wait_s(held, 11) == 5.0 + 1.0  # a whole turn of everything admitted, then 1 block
    assert forecast_wait_s([], 5) == 0.0


def test_a_request_that_cannot_make_its_deadline_is_shed_at_arrival():
    g, clock = gate()
    held = g.offer("a", 10, 0.0, demand(100), band=0)
    assert isinstance(held, Reservation)
    # a ends in 100 tokens x 0.1 s: 10 s, past the interactive band's 2 s
    assert g.forecast_s(4, 0, "anonymous", 0.0) == 10.0
    shed = g.offer("b", 4, 0.0, demand(10), band=0)
    assert shed == Turned(Reason.DEADLINE_UNREACHABLE, 10)
    assert g.waiting == 0
    # the batch band's 1000 s deadline allows the wait
    assert g.offer("c", 4, 0.0, demand(10), band=1) is None
    # 9 s later a has generated 90 tokens by the clock: 1 s left, within 2 s
    clock.now = 9.0
    assert g.forecast_s(4, 0, "anonymous", 9.0) == 1.0 + 0.0  # c waits in a lower band: not ahead
    assert g.offer("d", 4, 9.0, demand(10), band=0) is None
    granted = g.release(held)
    assert [k for k, _ in granted] == ["d", "c"]  # the interactive band first


def test_the_forecast_reads_the_output_law_and_the_progress_reported():
    g, clock = gate(bands=(Band("only", 3.0),))
    law = OutputLaw((10, 100), (3, 1))
    held = g.offer("a", 10, 0.0, demand(100, law))
    assert isinstance(held, Reservation)
    assert g.forecast_s(1, 0, "x", 0.0) == 32.5 * 0.1
    g.progress(held, 20)  # past the first bin: only the 100-token bin remains, 80 tokens left
    assert g.forecast_s(1, 0, "x", 0.0) == 80 * 0.1
    assert g.offer("b", 1, 0.0, demand(10)) == Turned(Reason.DEADLINE_UNREACHABLE, 8)


def test_waiters_ahead_count_in_the_forecast():
    g, _ = gate(bands=(Band("only", 100.0),))
    r1 = g.offer("a", 5, 0.0, demand(10))  # ends in 1 s
    r2 = g.offer("b", 5, 0.0, demand(50))  # ends in 5 s
    assert isinstance(r1, Reservation) and isinstance(r2, Reservation)
    assert g.forecast_s(5, 0, "f", 0.0) == 1.0
    assert g.offer("w", 5, 0.0, demand(10), flow="f") is None
    assert g.forecast_s(5, 0, "f", 0.0) == 5.0  # its own flow's 5 blocks first
    assert g.forecast_s(5, 0, "g", 0.0) == 5.0  # another flow: min(5, ceil((0 + 5) x 1 / 1)) ahead


def test_edf_within_a_flow_and_strict_priority_between_bands():
    g, _ = gate(bands=(Band("hi", 1000.0), Band("lo", 1000.0)))
    first = g.offer("a", 10, 0.0, demand(1))
    assert isinstance(first, Reservation)
    for i, (band, at) in enumerate([(1, 0.0), (1, 1.0), (0, 2.0), (0, 3.0)]):
        assert g.offer(f"r{i}", 1, at, demand(1), band=band, flow="t") is None
    assert g.next_deadline() == 1000.0
    granted = g.release(first)
    assert [k for k, _ in granted] == ["r2", "r3", "r0", "r1"]


def test_a_higher_band_is_admitted_past_lower_waiters_but_not_past_its_own():
    g, _ = gate(bands=(Band("hi", 1000.0), Band("lo", 1000.0)))
    assert isinstance(g.offer("a", 8, 0.0, demand(1)), Reservation)
    assert g.offer("big", 5, 0.0, demand(1), band=1) is None
    assert isinstance(g.offer("small-hi", 2, 0.0, demand(1), band=0), Reservation)  # priority
    assert g.offer("small-lo", 0 + 1, 0.0, demand(1), band=1) is None  # nobody overtakes in its band


def test_one_flooding_tenant_cannot_take_the_whole_budget():
    g, _ = gate(bands=(Band("only", 1000.0),), token_time_s=0.001, max_waiting_per_flow=100)
    full = g.offer("hold", 10, 0.0, demand(1))
    assert isinstance(full, Reservation)
    for i in range(20):
        assert g.offer(f"A{i}", 1, 0.0, demand(1), flow="A") is None
    for i in range(5):
        assert g.offer(f"B{i}", 1, 0.0, demand(1), flow="B") is None
    granted = [k for k, _ in g.release(full)]
    assert len(granted) == 10
    assert sum(k.startswith("B") for k in granted) == 5  # an even share, though A came first
    # today's FIFO gives B nothing
    fifo: AdmissionGate[str] = AdmissionGate(BlockLedger(10, clock=lambda: 0.0), max_waiting=100, timeout_s=1000,
                                             retry_after_min_s=1, retry_after_max_s=60)
    hold = fifo.offer("hold", 10, 0.0)
    assert isinstance(hold, Reservation)
    for name in [f"A{i}" for i in range(20)] + [f"B{i}" for i in range(5)]:
        fifo.offer(name, 1, 0.0)
    assert not any(k.startswith("B") for k, _ in fifo.release(hold))


def test_weights_share_in_proportion():
    g, _ = gate(budget=12, bands=(Band("only", 1000.0),), token_time_s=0.001, max_waiting_per_flow=100,
                weights={"gold": 3.0})
    full = g.offer("hold", 12, 0.0, demand(1))
    assert isinstance(full, Reservation)
    for i in range(20):
        g.offer(f"gold{i}", 1, 0.0, demand(1), flow="gold")
        g.offer(f"tin{i}", 1, 0.0, demand(1), flow="tin")
    granted = [k for k, _ in g.release(full)]
    assert sum(k.startswith("gold") for k in granted) == 9 and len(granted) == 12


def test_a_timed_out_waiter_is_429_and_a_release_is_counted_once():
    g, clock = gate(bands=(Band("only", 5.0),), token_time_s=0.01)
    a = g.offer("a", 10, 0.0, demand(100))  # ends in 1 s by the forecast, but holds on
    assert isinstance(a, Reservation)
    assert g.offer("b", 4, 0.0, demand(1)) is None
    assert g.next_deadline() == 5.0
    assert g.expire(4.9) == ([], [])
    clock.now = 5.0
    granted, turned = g.expire(5.0)
    assert granted == [] and [(k, t.reason) for k, t in turned] == [("b", Reason.QUEUE_TIMEOUT)]
    assert g.waiting == 0
    assert g.release(a) == () and g.release(a) == ()
    assert g.ledger.reserved_blocks == 0 and g.held_count == 0
    report = g.report()["bands"][0]
    assert report["timed_out"] == 1 and report["admitted"] == 1 and report["waiting"] == 0


def test_a_cancelled_waiter_leaves_and_the_next_is_served():
    gone: set[str] = set()
    clock = Clock()
    flow = FlowControl(token_time_s=0.001, bands=(Band("only", 100.0),))
    g: FlowGate[str] = FlowGate(BlockLedger(10, clock=clock), flow, retry_after_min_s=1, retry_after_max_s=60,
                                clock=clock, gone=gone.__contains__)
    a = g.offer("a", 10, 0.0, demand(1))
    assert isinstance(a, Reservation)
    g.offer("b", 6, 0.0, demand(1), flow="x")
    g.offer("c", 6, 0.0, demand(1), flow="y")
    gone.add("b")  # cancelled, its finally not yet run: dropped, not served
    assert [k for k, _ in g.release(a)] == ["c"]
    assert g.waiting == 0 and g.leave("b") == []


def test_queue_bounds_and_flow_states_are_bounded():
    g, _ = gate(bands=(Band("only", 1000.0),), token_time_s=0.001, max_waiting=3, max_waiting_per_flow=2,
                max_flows=2)
    hold = g.offer("hold", 10, 0.0, demand(1), flow="h")
    assert isinstance(hold, Reservation)
    assert g.offer("a1", 1, 0.0, demand(1), flow="a") is None
    assert g.offer("a2", 1, 0.0, demand(1), flow="a") is None
    assert g.offer("a3", 1, 0.0, demand(1), flow="a") == Turned(Reason.QUEUE_FULL, 1)  # per flow
    # h is idle: evicted for b; then no idle flow is left for c
    assert g.offer("b1", 1, 0.0, demand(1), flow="b") is None
    assert g.offer("c1", 1, 0.0, demand(1), flow="c").reason is Reason.QUEUE_FULL
    assert g.offer("b2", 1, 0.0, demand(1), flow="b").reason is Reason.QUEUE_FULL  # 3 wait in all
    report = g.report()
    assert report["flows"] == 2 and report["waiting"] == 3
    assert report["bands"][0]["other"]["admitted"] == 1  # h's admission, folded in when evicted


def test_flow_and_band_of_a_request():
    flow = FlowControl(token_time_s=0.1, bands=TWO_BANDS, default_band="batch")
    assert band_of(flow, " interactive ", None) == 0
    assert band_of(flow, "urgent", "interactive") == 0  # unknown value: the route's band
    assert band_of(flow, None, None) == 1  # the default band
    assert flow_of(" tenant-a ", "Bearer sk-1") == "tenant-a"
    hashed = flow_of(None, "bearer  sk-secret ")
    assert hashed == "key-" + hashlib.sha1(b"sk-secret").hexdigest()[:16] and "secret" not in hashed
    assert flow_of("x" * 129, None) == "anonymous" and flow_of("", "Basic abc") == "anonymous"


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["offer", "release", "tick", "leave"]), st.integers(1, 6),
                          st.integers(0, 1), st.sampled_from(["a", "b", "c"])), max_size=60))
def test_under_any_interleaving_the_ledger_drains_to_zero(ops):
    g, clock = gate(budget=12, bands=(Band("hi", 0.5), Band("lo", 3.0)), token_time_s=0.05, max_waiting=6,
                    max_waiting_per_flow=3, max_flows=4)
    held: list[Reservation] = []
    waiting: set[int] = set()
    for n, (op, blocks, band, flow) in enumerate(ops):
        if op == "offer":
            got = g.offer(n, blocks, clock.now, demand(blocks * 4), band=band, flow=flow)
            if got is None:
                waiting.add(n)
            elif isinstance(got, Reservation):
                held.append(got)
        elif op == "release" and held:
            for key, r in g.release(held.pop(blocks % len(held))):
                waiting.discard(key)
                held.append(r)
        elif op == "tick":
            clock.now += 0.25 * blocks
            granted, turned = g.expire(clock.now)
            for key, r in granted:
                waiting.discard(key)
                held.append(r)
            for key, t in turned:
                assert t.reason is Reason.QUEUE_TIMEOUT and 1 <= t.retry_after_s <= 60
                waiting.discard(key)
        elif op == "leave" and waiting:
            key = sorted(waiting)[blocks % len(waiting)]
            waiting.discard(key)
            for k, r in g.leave(key):
                waiting.discard(k)
                held.append(r)
        assert g.ledger.reserved_blocks == sum(r.blocks for r in held) <= 12
        assert g.waiting == len(waiting) <= 6 and g.held_count == len(held)
    while held:
        for key, r in g.release(held.pop()):
            waiting.discard(key)
            held.append(r)
    clock.now += 100
    g.expire(clock.now)
    assert g.ledger.reserved_blocks == 0 and g.held_count == 0 and g.waiting == 0


def test_a_batch_request_is_refused_the_reserve_while_an_interactive_one_is_admitted_into_it():
    """Trunk reservation (docs/guides/flow-control.md, The reserve): interactive keeps 3 of 10
    blocks from batch; the top band takes the last block."""
    g, clock = gate(budget=10, bands=RESERVED)
    first = g.offer("b1", 5, 0.0, band=1)
    assert isinstance(first, Reservation)
    assert g.offer("b2", 3, 0.0, band=1) is None  # 5 + 3 leaves 2 free, under the reserve: it waits
    top = g.offer("i1", 5, 0.0, band=0)
    assert isinstance(top, Reservation) and g.ledger.reserved_blocks == 10  # into the reserve, to the last block
    assert g.release(top) == []  # 5 free again, but b2 would leave 2: it still waits
    assert g.release(top) == []  # released once
    granted = g.release(first)
    assert [key for key, _ in granted] == ["b2"] and g.ledger.reserved_blocks == 3
    assert g.offer("b3", 4, 0.0, band=1) is not None  # 3 + 4 leaves 3: admitted at once
    band = g.report()["bands"]
    assert [(b["reserve_blocks"], b["kept_blocks"]) for b in band] == [(3, 0), (0, 3)]


def test_the_reserve_never_holds_back_the_top_band_and_a_large_request_still_fits_an_empty_ledger():
    g, clock = gate(budget=10, bands=RESERVED)
    big = g.offer("b", 9, 0.0, band=1)  # 9 beside 3 never fits: it keeps min(3, 10 - 9) = 1
    assert isinstance(big, Reservation)
    assert isinstance(g.offer("i", 1, 0.0, band=0), Reservation)  # the top band: everything
    assert g.offer("b2", 9, 0.0, band=1) is None


def test_the_forecast_counts_the_blocks_a_lower_band_leaves_free():
    g, clock = gate(budget=10, bands=RESERVED, token_time_s=0.1)
    assert isinstance(g.offer("hold", 8, 0.0, demand(20), band=0), Reservation)  # ends in 20 x 0.1 = 2 s
    assert g.forecast_s(2, 0, "x", 0.0) == 0.0  # interactive: 2 free, no wait
    assert g.forecast_s(2, 1, "x", 0.0) == 2.0  # batch: 2 + 3 kept - 2 free = 3 to free


def test_the_ledgers_keep_blocks_free_beside_a_reservation():
    ledger = BlockLedger(10)
    assert ledger.try_reserve(3) is not None
    assert ledger.try_reserve(4, keep_blocks=5) is None  # 3 + 4 + 5 > 10
    assert ledger.try_reserve(2, keep_blocks=5) is not None  # 3 + 2 + 5 = 10
    assert BlockLedger(10).try_reserve(6, keep_blocks=5) is not None  # k = min(5, 10 - 6) = 4
    assert BlockLedger(10).try_reserve(10, keep_blocks=5) is not None  # min(5, 10 - 10) = 0
    overcommit = BlockLedger(10, limit_blocks=15)  # the limit, not the budget
    assert overcommit.try_reserve(10, keep_blocks=5) is not None
    assert overcommit.try_reserve(1, keep_blocks=5) is None


def test_the_statistical_ledger_keeps_the_reserve_as_a_budget_that_much_smaller():
    """P(peak KV + k > budget) is P(peak KV > budget - k): with 30 blocks kept, a ledger of 100
    admits what one of 70 admits, at any epsilon."""
    law = OutputLaw((16, 64, 512), (70, 20, 10))
    want = Demand((100,), 512, law)
    blocks = -(-(100 + 512) // 16)
    for epsilon in (0.0, 0.01, 0.2):
        kept = StatisticalLedger(100, epsilon=epsilon, block_size=16, max_model_len=1024)
        smaller = StatisticalLedger(70, epsilon=epsilon, block_size=16, max_model_len=1024)
        n = 0
        while kept.try_reserve(blocks, want, keep_blocks=30) is not None:
            assert smaller.try_reserve(blocks, want) is not None
            n += 1
        assert smaller.try_reserve(blocks, want) is None and n >= 1
        assert kept.try_reserve(blocks, want) is not None  # the top band: no reserve kept


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["offer", "release", "tick", "leave"]), st.integers(1, 6),
                          st.integers(0, 1), st.sampled_from(["a", "b"])), max_size=60))
def test_the_lower_band_never_holds_the_reserve_and_the_ledger_drains(ops):
    g, clock = gate(budget=12, bands=(Band("hi", 0.5, reserve_blocks=3), Band("lo", 3.0)), token_time_s=0.05,
                    max_waiting=6, max_waiting_per_flow=3)
    held: dict[int, Reservation] = {}
    band_of_key: dict[int, int] = {}
    waiting: set[int] = set()

    def granted(pairs):
        for key, r in pairs:
            waiting.discard(key)
            held[key] = r

    for n, (op, blocks, band, flow) in enumerate(ops):
        if op == "offer":
            band_of_key[n] = band
            got = g.offer(n, blocks, clock.now, demand(blocks * 4), band=band, flow=flow)
            if got is None:
                waiting.add(n)
            elif isinstance(got, Reservation):
                held[n] = got
        elif op == "release" and held:
            key = sorted(held)[blocks % len(held)]
            granted(g.release(held.pop(key)))
        elif op == "tick":
            clock.now += 0.25 * blocks
            more, turned = g.expire(clock.now)
            granted(more)
            waiting.difference_update(key for key, _ in turned)
        elif op == "leave" and waiting:
            key = sorted(waiting)[blocks % len(waiting)]
            waiting.discard(key)
            granted(g.leave(key))
        # every request is at most 6 blocks, so the lower band keeps all 3: it holds at most 9
        assert sum(r.blocks for k, r in held.items() if band_of_key[k] == 1) <= 12 - 3
        assert g.ledger.reserved_blocks == sum(r.blocks for r in held.values()) <= 12
    while held:
        granted(g.release(held.pop(next(iter(held)))))
    clock.now += 100
    g.expire(clock.now)
    assert g.ledger.reserved_blocks == 0 and g.held_count == 0 and g.waiting == 0


def test_the_last_band_cannot_hold_a_reserve():
    with pytest.raises(ValueError, match="last band"):
        FlowControl(token_time_s=0.1, bands=(Band("a", 1.0), Band("b", 1.0, reserve_blocks=1)))
