"""The statistical policy's bound (kvtune.gateway.overflow, StatisticalLedger): never below the
true probability that the held sequences' KV peaks over the budget, exact where it convolves,
epsilon 0 identical to the guaranteed ledger, incremental state equal to a recount."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtune.domain.demand import Demand
from kvtune.domain.output_law import OutputLaw
from kvtune.errors import InputError
from kvtune.gateway.config import parse_gateway_config
from kvtune.gateway.ledger import BlockLedger
from kvtune.gateway.overflow import (
    chernoff_tail,
    exact_is_cheap,
    interval_edges,
    last_mark,
    next_mark,
    row_distribution,
    sequence_rows,
)
from kvtune.gateway.statistical import StatisticalLedger


def true_overflow(seqs: list[tuple[int, int, OutputLaw, int]], block_size: int, capacity: int) -> float:
    """P(max over steps of the held blocks > capacity), by enumerating every combination of lengths:
    sequence i (prompt p, cap c, law, streamed s) runs while t < L - s holding
    ceil((p + s + t + 1) / block_size) blocks at step t, all in lockstep."""
    laws = [law.conditioned(cap, streamed) for _, cap, law, streamed in seqs]
    total = 0.0
    for combo in itertools.product(*[range(len(lengths)) for lengths, _ in laws]):
        prob = 1.0
        ends = []
        for (lengths, probs), j in zip(laws, combo, strict=True):
            prob *= probs[j]
            ends.append(int(lengths[j]))
        horizon = max([length - s for length, (_, _, _, s) in zip(ends, seqs, strict=True)] + [0])
        peak = 0
        for t in range(horizon):
            used = sum(-(-(p + s + t + 1) // block_size) for (p, _, _, s), length in zip(seqs, ends, strict=True)
                       if t < length - s)
            peak = max(peak, used)
        if peak > capacity:
            total += prob
    return total


laws = st.lists(st.tuples(st.integers(1, 24), st.integers(0, 5)), min_size=1, max_size=4).filter(
    lambda bins: sum(c for _, c in bins) > 0).map(
    lambda bins: OutputLaw(tuple(sorted({length for length, _ in bins})),
                           tuple(sum(c for length2, c in bins if length2 == length)
                                 for length in sorted({length for length, _ in bins}))))

sequences = st.lists(st.tuples(st.integers(0, 20), st.integers(1, 24), laws, st.integers(0, 8)),
                     min_size=1, max_size=4)


def _ledger(capacity: int, block_size: int, epsilon: float = 0.5, max_model_len: int = 64) -> StatisticalLedger:
    return StatisticalLedger(capacity, epsilon=epsilon, block_size=block_size, max_model_len=max_model_len,
                             clock=lambda: 0.0)


def _held(ledger: StatisticalLedger, seqs) -> list:
    rows = []
    for prompt, cap, law, streamed in seqs:
        s = min(streamed, cap)
        rows.append(sequence_rows(prompt, cap, law, s, block_size=ledger.block_size, edges=ledger.edges))
    return rows


@settings(max_examples=300, deadline=None)
@given(sequences, st.integers(1, 4), st.integers(1, 12))
def test_the_bound_is_never_below_the_true_peak_overflow(seqs, block_size, capacity):
    seqs = [(p, c, law, min(s, c)) for p, c, law, s in seqs]
    truth = true_overflow(seqs, block_size, capacity)
    ledger = _ledger(capacity, block_size)
    rows = _held(ledger, seqs)
    bound = ledger.overflow_probability(rows)  # exact: tiny pools convolve
    assert bound >= truth - 1e-12
    # the Chernoff bound of each row is never below that row's exact tail
    total = sum(r.log_mgf for r in rows)
    chernoff = chernoff_tail(total, capacity)
    for r in range(ledger.rows):
        exact = row_distribution(rows, r, capacity)[capacity + 1]
        assert chernoff[r] >= exact - 1e-12
    assert min(1.0, chernoff[-1], chernoff[:-1].sum()) >= truth - 1e-12


def test_a_worst_case_that_fits_is_probability_zero_and_one_that_cannot_is_one():
    law = OutputLaw((4, 8), (1, 1))
    ledger = _ledger(10, 4)
    rows = _held(ledger, [(4, 8, law, 0), (4, 8, law, 0)])  # each at most 3 blocks: 6 <= 10
    assert ledger.overflow_probability(rows) == 0.0
    big = _held(ledger, [(40, 8, law, 0)])  # 11 blocks from its prompt alone
    assert ledger.overflow_probability(big) == 1.0


def test_early_finishers_count_peak_not_final():
    """Two sequences that end after 4 or 60 tokens: their final blocks often add up past the pool,
    but the short one has gone by then, so the peak bound is far below the final-blocks bound."""
    law = OutputLaw((4, 60), (9, 1))
    ledger = _ledger(10, 16, max_model_len=128)
    rows = _held(ledger, [(48, 60, law, 0), (48, 60, law, 0)])
    final_only = 1 - 0.9 * 0.9  # one long one: 7 + 4 final blocks > 10
    peak = ledger.overflow_probability(rows)
    assert peak < final_only / 5
    truth = true_overflow([(48, 60, law, 0), (48, 60, law, 0)], 16, 10)
    assert truth == pytest.approx(0.01)  # only two long ones ever hold more than 10 at once
    assert peak >= truth


@pytest.mark.parametrize("seed", range(5))
def test_epsilon_zero_decides_exactly_as_the_guaranteed_ledger(seed):
    rng = np.random.default_rng(seed)
    law = OutputLaw((5, 50, 300), (5, 3, 1))
    guaranteed = BlockLedger(200, clock=lambda: 0.0)
    statistical = _ledger(200, 16, epsilon=0.0, max_model_len=4096)
    held: list = []
    for _ in range(400):
        if held and rng.random() < 0.45:
            a, b = held.pop(int(rng.integers(len(held))))
            assert a.release() and b.release()
            continue
        prompt, cap = int(rng.integers(1, 900)), int(rng.integers(1, 400))
        blocks = -(-(prompt + cap) // 16)
        a = guaranteed.try_reserve(blocks)
        b = statistical.try_reserve(blocks, Demand((prompt,), cap, law))
        assert (a is None) == (b is None)
        assert statistical.never_fits(blocks, Demand((prompt,), cap, law)) == guaranteed.never_fits(blocks)
        if a is not None and b is not None:
            held.append((a, b))
        assert guaranteed.reserved_blocks == statistical.reserved_blocks


def test_a_positive_epsilon_admits_more_than_guaranteed_and_never_above_it():
    rng = np.random.default_rng(1)
    samples = rng.geometric(1 / 80, 4000)
    values, counts = np.unique(samples, return_counts=True)
    law = OutputLaw.from_samples(values, counts, cap=500)
    for capacity, epsilon in ((60, 0.01), (3000, 0.01), (3000, 0.1)):
        ledger = _ledger(capacity, 16, epsilon=epsilon, max_model_len=2048)
        admitted = 0
        while ledger.try_reserve(-(-(100 + 500) // 16), Demand((100,), 500, law)) is not None:
            admitted += 1
            assert ledger.last_admitted_probability <= epsilon
            assert ledger.snapshot().overflow_probability is not None
            assert ledger.snapshot().overflow_probability <= epsilon
        assert admitted > capacity // 38, (capacity, admitted)


def test_the_incremental_state_equals_a_recount():
    rng = np.random.default_rng(3)
    law = OutputLaw((3, 20, 90, 200), (4, 3, 2, 1))
    ledger = _ledger(120, 16, epsilon=0.3, max_model_len=1024)
    held = []
    for step in range(300):
        if held and rng.random() < 0.4:
            held.pop(int(rng.integers(len(held)))).release()
        else:
            prompt = int(rng.integers(1, 200))
            r = ledger.try_reserve(-(-(prompt + 200) // 16), Demand((prompt,), 200, law))
            if r is not None:
                held.append(r)
        if held and step % 7 == 0:
            held[0].progress(int(rng.integers(0, 200)))
        rows = [s for _, seqs in ledger._held.values() for s in seqs]
        recount = sum((s.log_mgf for s in rows), np.zeros_like(ledger._log_mgf))
        assert np.allclose(ledger._log_mgf, recount, rtol=1e-9, atol=1e-9)
        assert ledger._worst == sum(s.worst for s in rows)
        exact = np.vstack([row_distribution(rows, r, 120) for r in range(ledger.rows)])
        assert np.allclose(ledger._exact_rows(), exact, atol=1e-12)
    for r in held:
        r.release()
    assert ledger.reserved_blocks == 0 and ledger.inflight_requests == 0 and ledger.overflow_probability() == 0.0


def test_release_is_once_and_progress_after_release_does_nothing():
    law = OutputLaw((10, 100), (1, 1))
    ledger = _ledger(20, 16, epsilon=0.2, max_model_len=256)
    r = ledger.try_reserve(7, Demand((10,), 100, law))
    assert r is not None
    assert r.release() is True and r.release() is False
    r.progress(64)
    assert ledger.reserved_blocks == 0 and not ledger._held


def test_streamed_tokens_condition_the_law():
    """After 32 tokens of a route whose answers are mostly 8 tokens long, only the long bin is left:
    the request now counts as a long one, and the ledger is fuller for it."""
    law = OutputLaw((8, 400), (99, 1))
    ledger = _ledger(60, 16, epsilon=0.5, max_model_len=1024)
    r = ledger.try_reserve(-(-(16 + 400) // 16), Demand((16,), 400, law))
    assert r is not None
    probe = _held(ledger, [(16, 400, law, 0)] * 2)
    before = ledger.overflow_probability(probe)
    r.progress(10)  # below the first mark: nothing changes
    assert ledger.overflow_probability(probe) == before
    r.progress(40)
    after = ledger.overflow_probability(probe)
    assert after > before
    lengths, probs = law.conditioned(400, 32)
    assert lengths.tolist() == [400] and probs.tolist() == [1.0]


def test_marks_double_from_sixteen():
    assert [next_mark(t) for t in (0, 15, 16, 31, 32, 1000)] == [16, 16, 32, 32, 64, 1024]
    assert [last_mark(t) for t in (0, 15, 16, 31, 32, 1000)] == [0, 0, 16, 16, 32, 512]
    assert interval_edges(10) == ((0, 1), (1, 2), (2, 4), (4, 8), (8, 16))


def test_a_law_from_samples_keeps_every_count_and_ends_at_the_cap():
    rng = np.random.default_rng(0)
    samples = rng.integers(1, 3000, 10_000)
    values, counts = np.unique(samples, return_counts=True)
    law = OutputLaw.from_samples(values, counts, cap=1000)
    assert law.lengths[-1] == 1000 and len(law.lengths) <= 32
    assert sum(law.counts) == 10_000
    # mass above the cap sits at the cap
    assert law.counts[-1] >= int((samples >= 1000).sum())
    # each bin's upper edge is at least every sample it holds
    edges = np.asarray(law.lengths)
    at = np.searchsorted(edges, np.minimum(samples, 1000))
    assert (edges[at] >= np.minimum(samples, 1000)).all()


def test_the_chernoff_path_is_cheap_for_a_large_pool():
    law = OutputLaw.from_samples(np.arange(1, 2000), np.ones(1999, dtype=np.int64), cap=1999)
    ledger = _ledger(25_000, 16, epsilon=0.01, max_model_len=32_768)
    for _ in range(200):
        assert ledger.try_reserve(-(-(500 + 1999) // 16), Demand((500,), 1999, law)) is not None
    assert ledger._exact is None  # (25,002 x 17 x support) is far past EXACT_WORK
    assert not exact_is_cheap(ledger._units, 25_000, ledger.rows)
    assert 0.0 < ledger.overflow_probability() <= 0.01


_BASE = ("version: 1\nupstream: http://127.0.0.1:8000\nblock_size: 16\nblock_budget: 100\nmax_model_len: 2048\n"
         "admission: {policy: statistical, epsilon: 0.05}\nroutes:\n  - name: chat\n    match: {path: /v1/chat/completions}\n"
         "    max_new_tokens: 256\n")


def test_gateway_yaml_reads_a_routes_output_histogram():
    config = parse_gateway_config(yaml.safe_load(
        _BASE + "    output_histogram: {lengths: [10, 100, 256], counts: [5, 4, 1]}\n"))
    assert config.routes[0].output_law == OutputLaw((10, 100, 256), (5, 4, 1))


@pytest.mark.parametrize(("histogram", "field"), [
    ("[1, 2]", "routes[0].output_histogram"),
    ("{lengths: [10, 5], counts: [1, 1]}", "routes[0].output_histogram.lengths"),
    ("{lengths: [0, 5], counts: [1, 1]}", "routes[0].output_histogram.lengths"),
    ("{lengths: [10], counts: [1, 1]}", "routes[0].output_histogram.counts"),
    ("{lengths: [10], counts: [0]}", "routes[0].output_histogram.counts"),
    ("{lengths: [10], counts: [-1]}", "routes[0].output_histogram.counts[0]"),
    ("{lengths: [10.5], counts: [1]}", "routes[0].output_histogram.lengths[0]"),
    ("{lengths: [true], counts: [1]}", "routes[0].output_histogram.lengths[0]"),
    ("{lengths: [10], counts: [1], x: 1}", "routes[0].output_histogram.x"),
    ("{lengths: [], counts: []}", "routes[0].output_histogram.lengths"),
    ("{lengths: [" + ", ".join(str(i) for i in range(1, 66)) + "], counts: [" + ", ".join("1" for _ in range(65))
     + "]}", "routes[0].output_histogram.lengths"),
])
def test_a_bad_output_histogram_is_one_error_naming_the_field(histogram, field):
    with pytest.raises(InputError) as err:
        parse_gateway_config(yaml.safe_load(_BASE + f"    output_histogram: {histogram}\n"))
    assert field in str(err.value)
    assert "\n" not in str(err.value)


def test_probabilities_stay_finite_for_huge_blocks():
    law = OutputLaw((1, 2**20), (1, 1))
    rows = sequence_rows(2**20, 2**20, law, 0, block_size=1, edges=interval_edges(2**21))
    assert np.isfinite(rows.log_mgf).all()
    assert math.isfinite(float(chernoff_tail(rows.log_mgf, 10)[-1]))


def test_a_sequences_rows_are_computed_once_and_cannot_be_written():
    """A queued request is re-tried at every release with the same arguments: its rows come from
    the cache, and a caller cannot change the shared arrays under every other holder."""
    law = OutputLaw((4, 64), (19, 1))
    edges = interval_edges(2048)
    a = sequence_rows(96, 64, law, 0, block_size=16, edges=edges)
    assert sequence_rows(96, 64, law, 0, block_size=16, edges=list(edges)) is a
    assert sequence_rows(96, 64, law, 4, block_size=16, edges=edges) is not a  # progress: other rows
    for array in (a.values, a.probs, a.log_mgf):
        with pytest.raises(ValueError, match="read-only"):
            array[0] = 0
