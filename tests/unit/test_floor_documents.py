"""Issue 28: the recommendation and what-if documents live on the floor (kvtune.domain) as plain
data with their strict (de)serialisation; reading one back with what only kvtune's feature
packages know (the traffic profile, the feasibility verdict) is kvtune.policy.recommendation's."""

from __future__ import annotations

import json

import numpy as np
import pytest
from recs import rec_dict

from kvtune.domain.censored_lengths import CensoredLengths
from kvtune.domain.fields import Fields
from kvtune.domain.recommendation import Recommendation
from kvtune.errors import InputError
from kvtune.policy import feasibility
from kvtune.policy.recommendation import read_recommendation
from kvtune.profile.routes import CensoredHistogram


def no_traffic(f: Fields) -> None:
    raise AssertionError("no objective: the traffic reader is not called")


def test_the_floor_reads_a_recommendation_with_the_traffic_reader_it_is_given():
    """The floor's parser takes the traffic profile's reader (a recommendation with an objective
    calls it); one without an objective reads to the same bytes without it."""
    data = rec_dict()
    floor = Recommendation.from_dict(data, read_traffic=no_traffic, path="r.json")
    assert floor.to_json() == read_recommendation(data, path="r.json").to_json()
    assert json.loads(floor.to_json()) == data


def test_the_policy_decides_the_verdict_again_when_it_reads_one():
    """The floor keeps the verdict as written; read_recommendation derives its reasons again, so
    a hand-edited `reasons` reads as the same function judges the numbers."""
    data = rec_dict()
    v = feasibility.verdict("vllm", pool_blocks=20, block_size=16, max_model_len=131072, budget_blocks=182,
                            smallest_reservation_blocks=8, longest_request_tokens=32885, fix="fits with --tp 4")
    data["feasibility"] = {**v.to_dict(), "reasons": []}
    floor = Recommendation.from_dict(data, read_traffic=no_traffic, path="r.json")
    assert floor.feasibility is not None and floor.feasibility.fits  # as written
    read = read_recommendation(data, path="r.json")
    assert read.feasibility == v and not read.feasibility.fits


@pytest.mark.parametrize("edit", [
    lambda d: d.update(uncensored=[1]),
    lambda d: d["uncensored"].update(values=[3, 2], counts=[1, 1]),
    lambda d: d["uncensored"].update(values=[1, 2, 3]),
    lambda d: d["censored"].update(values=[-1], counts=[1]),
    lambda d: d["censored"].update(values=[2**60], counts=[1]),
    lambda d: d["uncensored"].update(counts=[2**53, 1]),
    lambda d: d["uncensored"].update(counts=[True]),
    lambda d: d.pop("censored"),
])
def test_a_routes_output_lengths_read_as_the_profiles_histogram_reads_them(edit):
    """recommendation.json's per-route output lengths are plain data on the floor; the floor's reader
    refuses exactly what kvtune.profile's histogram reader refuses, in the same words."""
    lengths = {"uncensored": {"values": [1, 5], "counts": [3, 2]}, "censored": {"values": [5], "counts": [1]}}
    edit(lengths)
    with pytest.raises(InputError) as floor:
        CensoredLengths.from_dict(lengths, "routes[0].output_lengths")
    with pytest.raises(InputError) as profile:
        CensoredHistogram.from_dict(lengths, "routes[0].output_lengths")
    assert str(floor.value) == str(profile.value)


def test_output_lengths_convert_both_ways_and_estimate_alike():
    h = CensoredHistogram.of([1, 1, 5, 9, 9, 12], [False, False, False, True, False, True])
    lengths = h.lengths()
    assert CensoredHistogram.from_lengths(lengths) == h and lengths.total == h.total == 6
    assert CensoredLengths.from_dict(lengths.to_dict(), "x") == lengths
    for cap in (0, 1, 5, 9, 12, 13):
        assert CensoredHistogram.from_lengths(lengths).truncation_share(cap) == h.truncation_share(cap)
    assert np.array_equal(CensoredHistogram.from_lengths(lengths).uncensored.values, h.uncensored.values)
