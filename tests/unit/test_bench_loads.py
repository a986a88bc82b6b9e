"""Load shapes: arrival statistics, closed-loop bounds, and the request/duration limits."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from kvtune.bench.loads import drive
from kvtune.domain.load_shape import LoadKind, LoadShape
from kvtune.workload.arrivals import arrival_offsets


def offsets(shape: LoadShape, n: int, seed: int = 0) -> np.ndarray:
    it = arrival_offsets(shape, np.random.default_rng(seed))
    return np.array([next(it) for _ in range(n)])


def test_poisson_mean_rate_and_exponential_gaps():
    t = offsets(LoadShape.rate(100.0), 50_000)
    gaps = np.diff(t)
    assert t[0] == 0 and (gaps > 0).all()
    assert gaps.mean() == pytest.approx(0.01, rel=0.02)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, abs=0.03)  # exponential: CV = 1


@pytest.mark.parametrize("burstiness", [0.25, 4.0])
def test_gamma_keeps_the_rate_and_changes_the_spread(burstiness):
    gaps = np.diff(offsets(LoadShape.rate(50.0, burstiness), 50_000))
    assert gaps.mean() == pytest.approx(0.02, rel=0.03)
    assert (gaps.std() / gaps.mean()) ** 2 == pytest.approx(1 / burstiness, rel=0.06)  # gamma: CV² = 1/k


def test_shape_names():
    assert LoadShape.rate(1.0).kind is LoadKind.POISSON
    assert LoadShape.rate(1.0, 2.0).kind is LoadKind.GAMMA
    assert LoadShape.closed(1).kind is LoadKind.SYNCHRONOUS
    assert LoadShape.closed(8).kind is LoadKind.CONCURRENT
    with pytest.raises(ValueError):
        LoadShape.closed(0)


def test_replay_offsets_sorted_from_zero_and_sped_up():
    shape = LoadShape.replay([105.0, 100.0, 101.0], speedup=2.0)
    assert shape.offsets_s == (0.0, 0.5, 2.5)
    assert list(arrival_offsets(shape, np.random.default_rng())) == [0.0, 0.5, 2.5]


def test_closed_loop_never_exceeds_concurrency_and_sends_exactly_n():
    in_flight = peak = 0
    seen = []

    async def launch(i):
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        seen.append(i)
        await asyncio.sleep(0.001 * (i % 5))
        in_flight -= 1

    n = asyncio.run(drive(LoadShape.closed(7), launch, max_requests=200, duration_s=None,
                          rng=np.random.default_rng(0)))
    assert n == 200 and sorted(seen) == list(range(200))
    assert peak == 7


def test_open_loop_sends_on_schedule():
    stamps = []

    async def launch(i):
        stamps.append(time.perf_counter())

    t0 = time.perf_counter()
    n = asyncio.run(drive(LoadShape.rate(400.0), launch, max_requests=400, duration_s=None,
                          rng=np.random.default_rng(1)))
    assert n == 400
    expected = offsets(LoadShape.rate(400.0), 400, seed=1)
    lag = np.array(stamps) - t0 - expected
    assert np.median(np.abs(lag)) < 0.01  # each send within a few ms of its slot
    assert stamps[-1] - t0 == pytest.approx(expected[-1], abs=0.1)


def test_duration_bounds_both_loops():
    async def slow(i):
        await asyncio.sleep(0.05)

    t = time.perf_counter()
    n_open = asyncio.run(drive(LoadShape.rate(100.0), slow, max_requests=None, duration_s=0.3,
                               rng=np.random.default_rng(2)))
    assert time.perf_counter() - t < 1.0 and 10 < n_open < 60
    n_closed = asyncio.run(drive(LoadShape.closed(2), slow, max_requests=None, duration_s=0.3,
                                 rng=np.random.default_rng(2)))
    assert 8 <= n_closed <= 16  # 2 workers × 0.3 s / 0.05 s, plus the ones started at the edge


def test_a_load_must_be_bounded():
    async def launch(i):
        pass

    with pytest.raises(ValueError):
        asyncio.run(drive(LoadShape.rate(1.0), launch, max_requests=None, duration_s=None,
                          rng=np.random.default_rng()))
