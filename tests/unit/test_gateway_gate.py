"""kvtune.gateway.gate: the admission policy the gateway and the simulator share, without a clock."""

from __future__ import annotations

from kvtune.gateway.gate import AdmissionGate, Turned, route_cap, sequence_blocks
from kvtune.gateway.ledger import BlockLedger, Reservation
from kvtune.gateway.refusals import Reason


def gate(budget=10, max_waiting=2, timeout_s=5.0, gone=None) -> AdmissionGate[str]:
    return AdmissionGate(BlockLedger(budget, clock=lambda: 0.0), max_waiting=max_waiting, timeout_s=timeout_s,
                         retry_after_min_s=1, retry_after_max_s=60, gone=gone)


def test_fifo_nobody_overtakes_a_waiter():
    g = gate()
    first = g.offer("a", 8, 0.0)
    assert isinstance(first, Reservation)
    assert g.offer("b", 5, 0.0) is None  # waits
    assert g.offer("c", 1, 0.0) is None  # would fit, but b waits first
    assert isinstance(g.offer("d", 1, 0.0), Turned)  # the queue holds 2
    granted = g.release(first)
    assert [k for k, _ in granted] == ["b", "c"]
    assert g.waiting == 0 and g.waiting_peak == 2


def test_without_a_queue_a_full_budget_is_429():
    g = gate(max_waiting=0)
    assert isinstance(g.offer("a", 10, 0.0), Reservation)
    turned = g.offer("b", 1, 0.0)
    assert turned == Turned(Reason.KV_BUDGET_EXHAUSTED, 1)


def test_queue_full_and_timeout_reasons():
    g = gate(max_waiting=1)
    g.offer("a", 10, 0.0)
    assert g.offer("b", 4, 1.0) is None
    full = g.offer("c", 4, 1.0)
    assert isinstance(full, Turned) and full.reason is Reason.QUEUE_FULL
    assert g.next_deadline() == 6.0
    assert g.expire(5.9) == ([], [])
    granted, turned = g.expire(6.0)
    assert granted == [] and [(k, t.reason) for k, t in turned] == [("b", Reason.QUEUE_TIMEOUT)]


def test_a_timed_out_head_lets_the_next_in():
    g = gate(budget=10, max_waiting=3)
    a = g.offer("a", 6, 0.0)
    assert isinstance(a, Reservation)
    g.offer("big", 8, 0.0)
    g.offer("small", 4, 1.0)
    granted = g.leave("big")
    assert [k for k, _ in granted] == ["small"]


def test_gone_waiters_are_dropped_not_served():
    left = {"b"}
    g = gate(gone=lambda k: k in left)
    a = g.offer("a", 10, 0.0)
    assert isinstance(a, Reservation)
    g.offer("b", 5, 0.0)
    g.offer("c", 5, 0.0)
    assert [k for k, _ in g.release(a)] == ["c"]
    assert g.ledger.reserved_blocks == 5


def test_caps_and_blocks():
    assert route_cap(500, [None, 800]) == 500
    assert route_cap(500, [200, None]) == 200
    assert sequence_blocks([100], 28, block_size=16, max_model_len=2048) == 8
    assert sequence_blocks([5000], 0, block_size=16, max_model_len=2048) == 128  # counted up to the context
    assert sequence_blocks([10, 20], 6, block_size=16, max_model_len=2048, copies=2) == 2 * (1 + 2)


def test_overcommit_admits_up_to_k_times_the_budget_and_413s_only_beyond_it():
    g = AdmissionGate(BlockLedger(10, clock=lambda: 0.0, limit_blocks=20), max_waiting=0, timeout_s=5.0,
                      retry_after_min_s=1, retry_after_max_s=60)
    held = [g.offer(k, 6, 0.0) for k in "abc"]
    assert all(isinstance(r, Reservation) for r in held) and g.ledger.reserved_blocks == 18
    assert g.offer("d", 3, 0.0) == Turned(Reason.KV_BUDGET_EXHAUSTED, 1)  # 21 > 2 x 10
    assert isinstance(g.offer("e", 2, 0.0), Reservation)  # exactly 20
    assert not g.never_fits(20) and g.never_fits(21)  # 413 is measured against k x the budget
    for r in held:
        g.release(r)
    assert g.ledger.reserved_blocks == 2 and g.ledger.free_blocks == 18
