"""The static slice arithmetic of --nginx-replicas (kvtune.deploy.slices)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvtune.deploy.slices import MAX_NGINX_REPLICAS, blocks_for_context, check_slice, slice_blocks
from kvtune.errors import OptionError


@given(st.integers(0, 10**12), st.integers(1, MAX_NGINX_REPLICAS))
def test_slices_never_add_up_to_more_than_the_budget_and_waste_less_than_one_each(budget, m):
    share = slice_blocks(budget, m)
    assert share * m <= budget < (share + 1) * m


@given(st.integers(1, 10**9), st.integers(1, 64), st.integers(1, 10**6), st.integers(1, MAX_NGINX_REPLICAS))
def test_a_slice_is_accepted_exactly_when_it_holds_one_whole_context_request(budget, block_size, context, m):
    need = -(-context // block_size)
    assert blocks_for_context(context, block_size) == need and (need - 1) * block_size < context <= need * block_size
    if budget // m >= need:
        assert check_slice(budget, m, max_model_len=context, block_size=block_size) == budget // m
    else:
        with pytest.raises(OptionError) as caught:
            check_slice(budget, m, max_model_len=context, block_size=block_size)
        assert caught.value.field == "--nginx-replicas"
        most = max(1, budget // need)
        assert f"use at most {most} nginx replicas" in str(caught.value)


@pytest.mark.parametrize("m", [0, MAX_NGINX_REPLICAS + 1])
def test_nginx_replicas_out_of_range_is_refused(m):
    with pytest.raises(OptionError, match=f"must be from 1 to {MAX_NGINX_REPLICAS}, got {m}"):
        slice_blocks(100, m)
