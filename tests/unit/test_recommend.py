"""The policy on real traces (Azure LLM inference 2023), checked against numbers computed
independently with numpy from the same CSV files."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest
from conftest import TRACES

from kvtune.capacity.measured import CapacitySource, MeasuredCapacity
from kvtune.domain.deployment import Deployment
from kvtune.domain.route import RouteMatch
from kvtune.domain.tail_class import TailClass
from kvtune.planning import plan, replan
from kvtune.policy.recommend import RecommendOptions, recommend
from kvtune.profile.build import ProfileBuilder


def _azure(name: str) -> pd.DataFrame:
    return pd.read_csv(TRACES / f"AzureLLMInferenceTrace_{name}.csv")


def _profile(frames: dict[str, pd.DataFrame], censored_at: int | None = None):
    builder = ProfileBuilder()
    for route, df in frames.items():
        out = df["GeneratedTokens"].to_numpy(np.int64)
        builder.add_batch(pa.RecordBatch.from_pydict({
            "route": [route] * len(df),
            "prompt_tokens": df["ContextTokens"].to_numpy(np.int64),
            "output_tokens": out,
            "censored": (out >= censored_at) if censored_at else np.zeros(len(df), bool),
        }))
    return builder.result()


def _h100_llama(measured: MeasuredCapacity | None = None):
    """Llama-3.1-8B on one H100, as `kvtune.plan` plans it, and the default policy options."""
    p = plan(Deployment("llama-3.1-8b", gpu="H100-80GB"), measured=measured)
    return p, p.capacity, RecommendOptions()


def _expected_route(df: pd.DataFrame, q: float, block_size: int, budget: int):
    out = df["GeneratedTokens"].to_numpy()
    prompt = df["ContextTokens"].to_numpy()
    cap = int(np.percentile(out, q * 100, method="inverted_cdf"))
    reservations = -(-(prompt + cap) // block_size)
    return cap, reservations, budget // reservations.mean()


def test_azure_conv_and_code_on_h100():
    conv, code = _azure("conv"), _azure("code")
    plan_, capacity, options = _h100_llama()
    rec = recommend(_profile({"/conv": conv, "/code": code}), plan_, options)
    bs = capacity.block_size
    # the pool is the one estimated at the scheduler limits it renders (issue #25 item 3), not at
    # vLLM's default max_num_seqs the plan was first estimated at
    seqs, batched = rec.settings["max_num_seqs"].value, rec.settings["max_num_batched_tokens"].value
    capacity = replan(plan_, max_num_seqs=seqs, max_num_batched_tokens=batched).capacity
    assert rec.capacity.num_blocks == capacity.num_blocks
    budget = math.floor((capacity.num_blocks - 1) * 0.9)
    assert rec.block_budget.value == budget

    by_route = {r.route: r for r in rec.routes}
    # Both Azure routes are heavy-tailed (p99/p50: code 252/13, conv 601/129 with p99.9 954/601 > 1.5),
    # so each is capped at its own p99.
    for route, df in (("/conv", conv), ("/code", code)):
        r = by_route[route]
        cap, reservations, admitted = _expected_route(df, 0.99, bs, budget)
        assert r.tail is TailClass.HEAVY
        assert r.max_new_tokens.value == cap
        assert r.max_new_tokens.rule == "cap-p99-heavy-tail"
        # share of logged requests longer than the cap
        assert r.truncation_share == pytest.approx((df["GeneratedTokens"] > cap).mean())
        assert r.reservation_blocks.max == reservations.max()
        assert r.reservation_blocks.mean == pytest.approx(reservations.mean())
        assert r.concurrency.admitted == int(admitted)
    assert by_route["/conv"].max_new_tokens.value == 601
    assert by_route["/code"].max_new_tokens.value == 252  # nearest rank (linear interpolation: 251.46)

    # max_model_len: the model's context (issue 25 item 11: it used to be the longest prompt + its route
    # cap, 14,656, which buys vLLM V1 no KV capacity); the pool holds one request of it
    assert rec.settings["max_model_len"].value == 131072
    assert rec.settings["max_model_len"].rule == "max-model-len-model-context"
    worst_blocks = 131072 // 16
    assert rec.concurrency.worst_case_reservation_blocks == worst_blocks
    assert rec.concurrency.worst_case == budget // worst_blocks
    # the mix: reservations weighted by each route's share of requests
    all_res = np.concatenate([
        -(-(conv["ContextTokens"].to_numpy() + 601) // 16), -(-(code["ContextTokens"].to_numpy() + 252) // 16)])
    assert rec.concurrency.mean_reservation_blocks == pytest.approx(all_res.mean())
    assert rec.concurrency.admitted == int(budget // all_res.mean())
    assert rec.gain > 5  # the headline: caps from traffic admit several times more than worst case

    assert rec.settings["preemption_mode"].value == "recompute"
    assert rec.settings["swap_space"] is None
    assert rec.settings["max_new_tokens_backstop"].value == 601
    seqs = rec.settings["max_num_seqs"].value
    # at least what the budget admits when it fills with the shortest 1 % of requests
    p1 = int(np.percentile(all_res, 1, method="inverted_cdf"))
    assert seqs >= budget // p1 and seqs % 8 == 0
    if rec.settings["max_num_seqs"].rule != "max-num-seqs-profiled":
        assert seqs - budget // p1 < 8
    # else: the count the pool was estimated at, above what that smaller pool admits (issue #25 item 3)
    assert rec.settings["max_num_batched_tokens"].value >= seqs


def test_max_truncation_picks_the_smallest_cap_under_target():
    conv = _azure("conv")
    plan_, capacity, options = _h100_llama()
    options = RecommendOptions(**{**{f: getattr(options, f) for f in options.__slots__}, "max_truncation": 0.02})
    rec = recommend(_profile({"/conv": conv}), plan_, options)
    out = conv["GeneratedTokens"].to_numpy()
    cap = rec.routes[0].max_new_tokens.value
    assert (out > cap).mean() <= 0.02
    smaller = np.unique(out)[np.unique(out) < cap]
    assert ((out > smaller.max()).mean() > 0.02) if smaller.size else True
    assert rec.routes[0].max_new_tokens.rule == "cap-max-truncation"


def test_censored_outputs_make_the_cap_a_lower_bound():
    # Azure conv outputs stop at 1000: treating ≥ 1000 as cut at a cap makes the top censored
    conv = _azure("conv")
    plan_, capacity, options = _h100_llama()
    rec = recommend(_profile({"/conv": conv}, censored_at=1000), plan_, options)
    route = rec.routes[0]
    assert route.output_tokens.lower_bound["max"] is True
    assert route.max_new_tokens.value <= 1000


def test_v0_vllm_swaps_long_sequences():
    code = _azure("code")  # p99 prompt 7436 + cap 252 ≥ 4000 tokens
    plan_, capacity, options = _h100_llama()
    options = RecommendOptions(**{**{f: getattr(options, f) for f in options.__slots__}, "vllm_version": "0.6.3"})
    rec = recommend(_profile({"/code": code}), plan_, options)
    assert rec.settings["preemption_mode"].value == "swap"
    assert rec.settings["swap_space"].value >= 4
    assert rec.engine.v1 is False


def test_measured_capacity_drives_the_budget():
    measured = MeasuredCapacity(source=CapacitySource.KV_TOKENS, kv_cache_tokens=160_000, origin="--kv-tokens")
    plan_, capacity, options = _h100_llama(measured)
    rec = recommend(_profile({"/conv": _azure("conv")}), plan_, options)
    # 160,000 tokens / 16 = 10,000 blocks; (10,000 − 1) × 0.9 = 8999.1 → 8999
    assert rec.block_budget.value == 8999
    assert "measured" in rec.safety_fraction.reason
    assert not any("estimate" in n for n in rec.notes)


def test_to_dict_has_the_documented_fields():
    plan_, capacity, options = _h100_llama()
    data = recommend(_profile({"/conv": _azure("conv")}), plan_, options).to_dict()
    for key in ("schema_version", "model", "served_model", "engine", "upstream", "hardware", "kv", "capacity",
                "safety_fraction", "block_budget", "routes", "concurrency", "settings", "notes"):
        assert key in data
    route = data["routes"][0]
    for key in ("route", "match", "requests", "share", "tail", "max_new_tokens", "truncation_share",
                "output_tokens", "prompt_tokens", "requested_max_tokens", "reservation_blocks", "concurrency",
                "output_histogram"):
        assert key in route
    hist = route["output_histogram"]
    assert len(hist["counts"]) == len(hist["edges"]) - 1 and sum(hist["counts"]) == route["requests"]
    for decision in data["settings"].values():
        assert decision is None or set(decision) == {"value", "rule", "reason"}


def test_catch_all_routes_come_after_specific_ones():
    conv, code = _azure("conv"), _azure("code")
    plan_, capacity, options = _h100_llama()
    rec = recommend(_profile({"*": conv, "/v1/code": code}), plan_, options)
    assert [r.route for r in rec.routes] == ["/v1/code", "*"]
    assert rec.routes[0].match == RouteMatch(path="/v1/code")
    assert rec.routes[1].match == RouteMatch()


def test_routes_from_a_field_are_matched_on_their_header_or_refused():
    """Routes keyed by a log field (say metadata.team) are enforced by the header that carries the
    field at request time (route_header); without one no gateway could tell the groups apart, so
    per-group caps are refused rather than shown and not enforced."""
    import yaml

    from kvtune.deploy.render import render_files
    from kvtune.errors import OptionError
    from kvtune.gateway.config import parse_gateway_config

    conv, code = _azure("conv"), _azure("code")
    plan_, capacity, options = _h100_llama()
    fields = {f: getattr(options, f) for f in options.__slots__}
    profile = _profile({"team-a": conv, "team-b": code})
    with pytest.raises(OptionError, match="give 2 groups a cap each, but no gateway sees that field"):
        recommend(profile, plan_, RecommendOptions(**{**fields, "route_by": "metadata.team"}))
    rec = recommend(profile, plan_, RecommendOptions(**{**fields, "route_by": "metadata.team",
                                                        "route_header": "X-Team"}))
    assert [r.match for r in rec.routes] == [RouteMatch(header="x-team", value="team-a"),
                                             RouteMatch(header="x-team", value="team-b")]
    assert not any("cannot match" in n for n in rec.notes)
    gateway = parse_gateway_config(yaml.safe_load(render_files(rec, targets=["gateway.yaml"])["gateway.yaml"]))
    assert [r.name for r in gateway.routes] == ["team-a", "team-b", "default"]
    for route in rec.routes:
        assert gateway.route_for("/v1/chat/completions", None, {"x-team": route.route}).max_new_tokens == route.cap
    assert gateway.routes[-1].max_new_tokens == max(int(r.max_new_tokens.value) for r in rec.routes)
