"""Exact histograms: nearest-rank percentiles identical to numpy, exact merges, JSON round trips."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtune.errors import InputError
from kvtune.profile.histogram import (
    JOINT_EDGES,
    Histogram,
    JointHistogram,
    LogHistogram,
    joint_bin,
    log_bin,
    nearest_rank_index,
)

PERCENTS = [0, 0.1, 1, 5, 10, 25, 33.3, 50, 66.7, 75, 90, 95, 99, 99.5, 99.9, 99.99, 100]

samples = st.lists(st.integers(min_value=0, max_value=5000), min_size=1, max_size=400)


@given(st.integers(min_value=1, max_value=10**7), st.floats(min_value=0, max_value=1))
def test_nearest_rank_index_matches_numpy_inverted_cdf(n, q):
    # numpy on an arange picks the index itself; small n only, to keep it cheap
    n = n % 3000 + 1
    assert nearest_rank_index(n, q) == int(np.quantile(np.arange(n), q, method="inverted_cdf"))


@given(samples)
def test_percentiles_equal_numpy(xs):
    h = Histogram.of(xs)
    for p in PERCENTS:
        assert h.percentile(p) == np.percentile(xs, p, method="inverted_cdf"), p
    assert h.max == max(xs) and h.min == min(xs) and h.total == len(xs)
    assert h.mean == pytest.approx(np.mean(xs))


@given(samples, st.lists(st.integers(min_value=0, max_value=6), max_size=400), st.randoms())
def test_merge_of_random_shards_is_exact_and_order_independent(xs, cuts, rnd):
    shard_of = [(cuts[i] if i < len(cuts) else 0) for i in range(len(xs))]
    shards = [Histogram.of([x for x, s in zip(xs, shard_of, strict=True) if s == k]) for k in range(7)]
    rnd.shuffle(shards)
    merged = Histogram.empty()
    for h in shards:
        merged = merged.merge(h)
    assert merged == Histogram.of(xs)
    for p in (50, 90, 95, 99, 99.9):
        assert merged.percentile(p) == np.percentile(xs, p, method="inverted_cdf")


def test_dense_and_sparse_forms_agree():
    h = Histogram.of([0, 0, 3, 7, 7, 7])
    assert h.values.tolist() == [0, 3, 7] and h.counts.tolist() == [2, 1, 3]
    assert h.to_dense().tolist() == [2, 0, 0, 1, 0, 0, 0, 3]
    assert Histogram.from_dense(h.to_dense()) == h
    assert h.count_le(3) == 3 and h.count_le(6.5) == 3 and h.count_le(-1) == 0
    # duplicates and zero counts passed in are summed and dropped
    assert Histogram([7, 3, 7, 5], [1, 1, 2, 0]) == Histogram([3, 7], [1, 3])


def test_empty_histogram():
    h = Histogram.empty()
    assert h.total == 0 and h.quantile(0.5) is None and h.max is None and h.mean is None


def test_json_round_trip_and_errors():
    h = Histogram.of([1, 5, 5, 900])
    assert Histogram.from_dict(h.to_dict(), "x") == h
    with pytest.raises(InputError) as bad:
        Histogram.from_dict({"values": [5, 1], "counts": [1, 1]}, "routes[0].prompt_tokens")
    assert str(bad.value) == "routes[0].prompt_tokens.values: values must be strictly increasing"
    with pytest.raises(InputError, match=r"^h.counts: expected a list of non-negative integers$"):
        Histogram.from_dict({"values": [1], "counts": [-1]}, "h")
    with pytest.raises(InputError, match=r"^h: values and counts differ in length$"):
        Histogram.from_dict({"values": [1, 2], "counts": [1]}, "h")
    with pytest.raises(InputError, match=r"^h.values: expected a list"):
        Histogram.from_dict({"values": [1.5], "counts": [1]}, "h")


@settings(max_examples=50)
@given(st.lists(st.floats(min_value=0.5, max_value=1e6), min_size=1, max_size=300))
def test_log_histogram_quantiles_within_one_percent(ms):
    h = LogHistogram(Histogram.of(log_bin(np.asarray(ms))))
    for q in (0.5, 0.9, 0.99):
        exact = float(np.quantile(ms, q, method="inverted_cdf"))
        assert h.quantile(q) == pytest.approx(exact, rel=0.011, abs=0.01)


def test_joint_bins_partition_the_integers():
    assert JOINT_EDGES[:10].tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 8, 10]
    assert (np.diff(JOINT_EDGES) > 0).all()
    values = np.arange(0, 70000)
    bins = joint_bin(values)
    assert (JOINT_EDGES[bins] <= values).all()
    assert (values < JOINT_EDGES[np.minimum(bins + 1, JOINT_EDGES.size - 1)]).all()


def test_joint_histogram_merge_and_json():
    a = JointHistogram(np.array([1, 2, 1]), np.array([3, 3, 3]), np.array([1, 1, 2]))
    assert a.total == 4 and a.counts.tolist() == [3, 1]
    b = JointHistogram(np.array([2]), np.array([3]), np.array([5]))
    assert a.merge(b) == b.merge(a)
    assert a.merge(b).counts.tolist() == [3, 6]
    assert JointHistogram.from_dict(a.to_dict(), "j") == a
    with pytest.raises(InputError, match=r"^j.bins_per_octave: expected bins_per_octave = 4$"):
        JointHistogram.from_dict({"bins_per_octave": 8}, "j")
