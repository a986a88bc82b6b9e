"""Each recommendation rule against hand-worked numbers."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvtune.domain.tail_class import TailClass
from kvtune.policy import rules


def test_weighted_distribution_is_nearest_rank():
    values = np.array([10, 20, 30, 40])
    counts = np.array([50, 40, 9, 1])  # 100 requests
    d = rules.weighted_distribution(values, counts)
    # rank 50 → 10 (cumulative 50), rank 90 → 20 (cumulative 90), rank 99 → 30 (cumulative 99)
    assert (d.p50, d.p90, d.p99, d.max) == (10, 20, 30, 40)
    assert d.mean == pytest.approx((10 * 50 + 20 * 40 + 30 * 9 + 40) / 100)


@given(st.lists(st.integers(0, 5000), min_size=1, max_size=300))
def test_weighted_distribution_matches_numpy_inverted_cdf(samples):
    values, counts = np.unique(samples, return_counts=True)
    d = rules.weighted_distribution(values, counts)
    for q, got in ((50, d.p50), (90, d.p90), (99, d.p99), (100, d.max)):
        assert got == int(np.percentile(samples, q, method="inverted_cdf"))


def test_reservation_blocks_hand_worked():
    # 200 prompt + 4000 cap = 4200 tokens → ceil(4200 / 16) = 262.5 → 263 blocks
    assert rules.reserved_blocks(200, 4000, 16) == 263
    # 3000 + 200 = 3200 → exactly 200 blocks: the long-cap request costs more
    assert rules.reserved_blocks(3000, 200, 16) == 200
    assert list(rules.reserved_blocks(np.array([0, 1, 16]), 16, 16)) == [1, 2, 2]


@given(st.integers(0, 10**6), st.integers(0, 10**6), st.integers(1, 512))
def test_reservation_holds_every_token(prompt, cap, block_size):
    blocks = rules.reserved_blocks(prompt, cap, block_size)
    assert blocks * block_size >= prompt + cap > (blocks - 1) * block_size or prompt + cap == 0


def test_block_budget_leaves_the_null_block_out():
    # (32 − 1) × 0.9 = 27.9 → 27
    d = rules.block_budget(32, 0.9)
    assert d.value == 27 and "null block" in d.reason


def test_safety_fraction_default_and_user():
    assert rules.safety_fraction(None, measured=True).value == 0.9
    assert rules.safety_fraction(0.85, measured=False).value == 0.85
    from kvtune.errors import OptionError
    from kvtune.policy.recommend import RecommendOptions

    for bad in (1.5, 0.0, -0.1, float("nan")):
        with pytest.raises(OptionError):
            RecommendOptions(safety_fraction=bad)  # the options are checked once, where they come in


def test_caps_by_tail_class():
    light = rules.cap_by_tail(TailClass.LIGHT, 451, False, context_cap=8000)
    assert (light.value, light.rule) == (451, "cap-p95-light-tail")
    heavy = rules.cap_by_tail(TailClass.HEAVY, 251, True, context_cap=8000)
    assert heavy.value == 251 and "lower bound" in heavy.reason
    clipped = rules.cap_by_tail(TailClass.HEAVY, 9000, False, context_cap=8000)
    assert clipped.value == 8000 and "clipped" in clipped.reason


def test_cap_by_truncation_picks_smallest_cap_under_target():
    candidates = np.array([100, 200, 300, 400])
    shares = np.array([0.30, 0.06, 0.01, 0.0])
    assert rules.cap_by_truncation(candidates, shares, 0.05, 8000).value == 300
    assert rules.cap_by_truncation(candidates, shares, 0.30, 8000).value == 100
    # nothing reaches 0 % except the last: 400
    assert rules.cap_by_truncation(candidates, shares, 0.0, 8000).value == 400


def test_worst_case_reservation_is_the_context():
    # unset max_tokens on an 8192-token context, block 16 → 512 blocks
    assert rules.worst_case_reservation_blocks(8192, 16) == 512
    assert rules.worst_case_reservation_blocks(8193, 16) == 513


def test_admitted_concurrency():
    assert rules.admitted_concurrency(1000, 12.5) == 80
    assert rules.admitted_concurrency(1000, 0) == 0


@pytest.mark.parametrize(
    "text, expected",
    [("0.6", (0, 6)), ("v0.10.1.post1", (0, 10, 1)), ("0.33.0rc1", (0, 33, 0)), ("0.9.2+cpu", (0, 9, 2))],
)
def test_parse_vllm_version(text, expected):
    assert rules.parse_vllm_version(text) == expected


def test_parse_vllm_version_rejects_garbage():
    with pytest.raises(ValueError):
        rules.parse_vllm_version("latest")


def test_preemption_is_version_aware():
    v1 = rules.preemption_mode((0, 33), 10_000)
    assert v1.value == "recompute" and v1.rule == "preemption-v1-recompute-only"
    assert rules.preemption_mode((0, 6), 4000).value == "swap"
    assert rules.preemption_mode((0, 6), 3999).value == "recompute"


def test_swap_space_only_for_swap():
    assert rules.swap_space_gib(50 * 2**30, "recompute") is None
    # a tenth of 50 GiB = 5 GiB, above the 4 GiB default
    assert rules.swap_space_gib(50 * 2**30, "swap").value == 5
    assert rules.swap_space_gib(10 * 2**30, "swap").value == 4


def test_max_model_len_is_the_context_unless_the_pool_cannot_hold_it_or_it_is_given():
    # issue 25 item 11: the longest logged request (14,651) no longer shrinks it: V1 allocates on demand
    d = rules.max_model_len(context_tokens=131072, longest_request_tokens=14651, held_tokens=400_000, block_size=16)
    assert (d.value, d.rule) == (131072, "max-model-len-model-context")
    # a pool of 5,000 usable blocks holds 80,000 tokens: the largest multiple of the block size it holds
    d = rules.max_model_len(context_tokens=131072, longest_request_tokens=14651, held_tokens=80_000 + 7, block_size=16)
    assert (d.value, d.rule) == (80_000, "max-model-len-pool-holds")
    # not even the longest logged request fits: the context, which the feasibility verdict refuses
    d = rules.max_model_len(context_tokens=131072, longest_request_tokens=14651, held_tokens=14_000, block_size=16)
    assert (d.value, d.rule) == (131072, "max-model-len-model-context")
    d = rules.max_model_len(context_tokens=131072, longest_request_tokens=14651, held_tokens=400_000, block_size=16,
                            given=16384)
    assert (d.value, d.rule) == (16384, "max-model-len-given")
    # a capacity measured on a server started at 32,768: that server's length, when it holds the logs
    d = rules.max_model_len(context_tokens=131072, longest_request_tokens=14651, held_tokens=400_000, block_size=16,
                            measured=32768, measured_origin="capacity.json")
    assert (d.value, d.rule) == (32768, "max-model-len-measured") and "(capacity.json)" in d.reason
    d = rules.max_model_len(context_tokens=131072, longest_request_tokens=14651, held_tokens=400_000, block_size=16,
                            measured=8192)  # too short for the logs: the context
    assert (d.value, d.rule) == (131072, "max-model-len-model-context")


def test_max_num_seqs_covers_what_the_budget_admits():
    # 27 blocks ÷ 2-block p1 reservation = 13 → rounded up to 16
    assert rules.max_num_seqs(27, 2).value == 16


@given(st.lists(st.integers(0, 5000), min_size=1, max_size=300), st.floats(0, 1))
def test_weighted_quantile_matches_numpy(samples, q):
    values, counts = np.unique(samples, return_counts=True)
    assert rules.weighted_quantile(values, counts, q) == int(np.quantile(samples, q, method="inverted_cdf"))


def test_max_num_batched_tokens():
    # p95 prompt 3000 → 4096; default 8192 wins on an H100
    assert rules.max_num_batched_tokens(3000, 8192, 256, 8192).value == 8192
    # p95 prompt 12000 → 16384 > default 2048
    assert rules.max_num_batched_tokens(12000, 2048, 256, 32768).value == 16384
    # never above max_model_len × max_num_seqs: 256 × 8 = 2048
    assert rules.max_num_batched_tokens(12000, 2048, 8, 256).value == 2048


def test_longest_request():
    assert rules.longest_request([100, 2000], [500, 50]) == 2050
