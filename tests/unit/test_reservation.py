"""The reservation rule, the one home every enforcer and estimate uses (kvtune.capacity.reservation):
a request reserves ceil((prompt + cap) / block_size) blocks per sequence, for its whole life."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvtune.capacity.reservation import RequestShape, fit_request, request_reserved_blocks, reserved_blocks


@pytest.mark.parametrize("prompts, cap, seq, size, expected", [
    ([100], 600, 1, 16, 44),        # ceil(700 / 16)
    ([100], 600, 2, 16, 88),
    ([16], 16, 1, 16, 2),           # exactly two blocks
    ([1], 1, 1, 128, 1),
    ([10, 30], 6, 3, 16, 3 * (1 + 3)),  # each prompt rounds up separately
])
def test_reservation_blocks(prompts, cap, seq, size, expected):
    assert request_reserved_blocks(prompts, cap, size, copies=seq) == expected


@given(st.lists(st.integers(0, 10_000), min_size=1, max_size=4), st.integers(1, 4096),
       st.integers(1, 8), st.sampled_from([1, 16, 32, 128]))
def test_reservation_covers_every_token_with_less_than_a_block_spare(prompts, cap, seq, size):
    blocks = request_reserved_blocks(prompts, cap, size, copies=seq)
    tokens = seq * sum(p + cap for p in prompts)
    assert blocks * size >= tokens
    assert blocks * size < tokens + seq * len(prompts) * size


@given(st.integers(0, 10**6), st.integers(0, 10**5), st.sampled_from([1, 16, 32, 128]))
def test_one_rule_for_ints_and_arrays(prompt, cap, size):
    one = reserved_blocks(prompt, cap, size)
    assert (one - 1) * size < prompt + cap <= one * size or prompt + cap == 0
    assert int(reserved_blocks(np.array([prompt]), cap, size)[0]) == one


@given(st.integers(1, 20_000), st.integers(1, 20_000), st.sampled_from([16, 128]), st.integers(1, 100_000))
def test_fit_request_reserves_what_the_rule_says(prompt, cap, size, blocks):
    max_model_len = 16_384
    fit = fit_request(RequestShape(prompt, cap), usable_blocks=blocks, block_size=size, max_model_len=max_model_len)
    if prompt >= max_model_len:
        assert fit.max_concurrent == 0
        return
    assert fit.reserved_blocks == reserved_blocks(min(prompt + cap, max_model_len), 0, size)
    assert fit.max_concurrent == (blocks // fit.reserved_blocks if fit.reserved_blocks <= blocks else 0)
