"""The block ledger: all-or-nothing reservations under the budget, release exactly once, and a
Retry-After that follows the observed release rate."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtune.gateway.ledger import RATE_WINDOW_S, BlockLedger


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_reserve_until_full_then_refuse():
    ledger = BlockLedger(10)
    a = ledger.try_reserve(6)
    b = ledger.try_reserve(4)
    assert a and b and ledger.reserved_blocks == 10 and ledger.inflight_requests == 2
    assert ledger.try_reserve(1) is None
    assert ledger.reserved_blocks == 10 and ledger.inflight_requests == 2  # a refusal holds nothing
    assert a.release() is True
    assert ledger.try_reserve(7) is None and ledger.try_reserve(6) is not None


def test_double_release_is_a_no_op():
    ledger = BlockLedger(10)
    r = ledger.try_reserve(3)
    assert r.release() is True
    assert r.release() is False and r.released
    assert ledger.reserved_blocks == 0 and ledger.inflight_requests == 0


@pytest.mark.parametrize("bad", [0, -1])
def test_zero_or_negative_amounts_are_refused(bad):
    with pytest.raises(ValueError):
        BlockLedger(bad)
    with pytest.raises(ValueError):
        BlockLedger(5).try_reserve(bad)


ops = st.lists(st.tuples(st.sampled_from(["reserve", "release", "rerelease"]), st.integers(1, 40),
                         st.integers(0, 10**6)), max_size=200)


@settings(max_examples=300, deadline=None)
@given(budget=st.integers(1, 100), script=ops)
def test_random_interleavings_stay_under_budget_and_end_at_zero(budget, script):
    ledger = BlockLedger(budget)
    held, released = [], []
    for op, blocks, pick in script:
        if op == "reserve":
            before = ledger.reserved_blocks
            r = ledger.try_reserve(blocks)
            if before + blocks <= budget:
                assert r is not None and r.blocks == blocks
                held.append(r)
            else:
                assert r is None and ledger.reserved_blocks == before
        elif op == "release" and held:
            r = held.pop(pick % len(held))
            assert r.release()
            released.append(r)
        elif op == "rerelease" and released:
            before = ledger.reserved_blocks
            assert not released[pick % len(released)].release()
            assert ledger.reserved_blocks == before
        assert 0 <= ledger.reserved_blocks <= budget
        assert ledger.reserved_blocks == sum(r.blocks for r in held)
        assert ledger.inflight_requests == len(held)
    for r in held:
        r.release()
    assert ledger.reserved_blocks == 0 and ledger.inflight_requests == 0


def test_retry_after_follows_the_release_rate():
    clock = Clock()
    ledger = BlockLedger(100, clock=clock)
    # nothing released yet: nothing to go on, the minimum
    full = ledger.try_reserve(100)
    assert ledger.retry_after_s(10, min_s=1, max_s=60) == 1
    full.release()
    # 100 blocks released just now: rate = 100 / 30 blocks/s
    assert ledger.release_rate() == pytest.approx(100 / RATE_WINDOW_S)
    full = ledger.try_reserve(100)
    assert ledger.retry_after_s(10, min_s=1, max_s=60) == math.ceil(10 / (100 / 30))  # 3
    assert ledger.retry_after_s(50, min_s=1, max_s=60) == 15
    assert ledger.retry_after_s(100, min_s=1, max_s=20) == 20  # clamped to max
    # the estimate decays as time passes without releases: waits grow
    clock.now += 30
    assert ledger.release_rate() == pytest.approx(100 / 30 / math.e)
    assert ledger.retry_after_s(10, min_s=1, max_s=60) == math.ceil(10 / (100 / 30 / math.e))
    # a large release raises the rate again: waits shrink
    full.release()
    full = ledger.try_reserve(100)
    assert ledger.retry_after_s(10, min_s=1, max_s=60) == math.ceil(10 / ((100 / math.e + 100) / 30))


def test_retry_after_counts_only_the_shortfall():
    clock = Clock()
    ledger = BlockLedger(100, clock=clock)
    ledger.try_reserve(60).release()  # rate 2 blocks/s
    ledger.try_reserve(90)
    # 10 free; a 30-block request needs 20 more to be released → 10 s
    assert ledger.retry_after_s(30, min_s=1, max_s=60) == 10


def test_statistical_retry_after_waits_for_the_requests_own_blocks_at_most():
    """The statistical ledger's reserved_blocks (every held worst case) exceeds the budget by
    design: Retry-After counts at most the refused request's own blocks, not that excess."""
    from kvtune.domain.demand import Demand
    from kvtune.domain.output_law import OutputLaw
    from kvtune.gateway.statistical import StatisticalLedger

    clock = Clock()
    ledger = StatisticalLedger(20, epsilon=0.05, block_size=16, max_model_len=512, clock=clock)
    short = Demand((16,), 300, OutputLaw((10, 300), (99, 1)))  # usually 2 blocks, at worst 20
    ledger.try_reserve(20, short).release()  # rate 20 / 30 blocks/s
    held = [ledger.try_reserve(20, short) for _ in range(3)]
    assert all(held) and ledger.reserved_blocks == 60 > ledger.budget_blocks
    assert ledger.retry_after_s(4, min_s=1, max_s=60) == math.ceil(4 / (20 / 30))  # 6 s, not 44 / rate = 66
    guaranteed = BlockLedger(20, clock=clock)
    guaranteed.try_reserve(20).release()
    guaranteed.try_reserve(18)
    assert guaranteed.retry_after_s(4, min_s=1, max_s=60) == math.ceil(2 / (20 / 30))  # the shortfall, as before
