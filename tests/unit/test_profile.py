"""Profiles: exact percentiles on the real traces, Kaplan–Meier, tail class, arrivals, save/merge."""

from __future__ import annotations

import json
import random
from fractions import Fraction

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest
from conftest import TRACES
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtune.domain.tail_class import TailClass
from kvtune.errors import InputError
from kvtune.profile.build import ProfileBuilder, is_saved_profile, load_profile, save_profile
from kvtune.profile.histogram import Histogram
from kvtune.profile.routes import (
    PERCENTILES,
    CensoredHistogram,
    Profile,
    Quantile,
    classify_tail,
    merge_profiles,
    summarize_plain,
)

# (file in tests/data/traces, prompt column, output column): every Azure row, excerpts of the rest
TRACE_FILES = [
    ("AzureLLMInferenceTrace_code.csv", "ContextTokens", "GeneratedTokens"),
    ("AzureLLMInferenceTrace_conv.csv", "ContextTokens", "GeneratedTokens"),
    ("mooncake_conversation_trace.excerpt.jsonl", "input_length", "output_length"),
    ("mooncake_synthetic_trace.excerpt.jsonl", "input_length", "output_length"),
    ("vidur_arxiv_summarization_stats_llama2_tokenizer_filtered_v2.excerpt.csv", "num_prefill_tokens",
     "num_decode_tokens"),
]
PERCENTS = [p for _, p in PERCENTILES]


def read_trace(name: str) -> pd.DataFrame:
    path = TRACES / name
    return pd.read_json(path, lines=True) if name.endswith(".jsonl") else pd.read_csv(path)


def batch(prompt, output, route="*", censored=None, **extra) -> pa.RecordBatch:
    n = len(output)
    columns = {
        "route": pa.array([route] * n if isinstance(route, str) else list(route)),
        "prompt_tokens": pa.array(np.asarray(prompt, dtype=np.int64)),
        "output_tokens": pa.array(np.asarray(output, dtype=np.int64)),
        "censored": pa.array(np.zeros(n, bool) if censored is None else np.asarray(censored, bool)),
    }
    columns.update({k: pa.array(v) for k, v in extra.items()})
    return pa.record_batch(columns)


def build(*batches: pa.RecordBatch) -> Profile:
    builder = ProfileBuilder()
    for b in batches:
        builder.add_batch(b)
    return builder.result()


def assert_matches_numpy(route, prompt, output):
    total = np.asarray(prompt) + np.asarray(output)
    for p in PERCENTS:
        assert route.output.percentile(p) == Quantile(int(np.percentile(output, p, method="inverted_cdf"))), p
        assert route.prompt.percentile(p) == np.percentile(prompt, p, method="inverted_cdf"), p
        assert route.total.percentile(p).value_tokens == np.percentile(total, p, method="inverted_cdf"), p
    summary = route.output.summary()
    assert summary["max"] == Quantile(int(np.max(output)))
    assert summary.mean_tokens == pytest.approx(np.mean(output))


@pytest.mark.parametrize("name,prompt_col,output_col", TRACE_FILES)
def test_real_trace_percentiles_equal_numpy_whole_and_sharded(name, prompt_col, output_col):
    df = read_trace(name)
    prompt, output = df[prompt_col].to_numpy(), df[output_col].to_numpy()
    whole = build(batch(prompt, output))
    (route,) = whole.routes
    assert route.requests == len(df)
    assert_matches_numpy(route, prompt, output)

    # random shards, each profiled alone, saved as JSON, reloaded and merged in a random order
    rng = np.random.default_rng(len(df))
    shard = rng.integers(0, 4, len(df))
    parts = [build(batch(prompt[shard == k], output[shard == k])) for k in range(4)]
    parts = [Profile.from_dict(json.loads(json.dumps(p.to_dict()))) for p in parts]
    random.Random(7).shuffle(parts)
    merged = merge_profiles(parts)
    assert merged == whole
    assert_matches_numpy(merged.routes[0], prompt, output)


def test_trace_maximum_as_cap_gives_lower_bounds_only_above_it():
    """Mooncake conversation: 30 of its 12,031 outputs sit at exactly 2000, its maximum (a cap);
    2 of the excerpt's 306.

    Censoring only at the maximum leaves Kaplan–Meier equal to the empirical CDF below it, so
    p50…p99 stay numpy's; F never reaches 0.999 (2/306 = 0.65% of the mass is censored), so
    p99.9 becomes the largest observed value, flagged as a lower bound.
    """
    df = read_trace("mooncake_conversation_trace.excerpt.jsonl")
    output = df["output_length"].to_numpy()
    cut = output == 2000
    assert (cut.sum(), len(output), output.max()) == (2, 306, 2000)
    out = CensoredHistogram.of(output, cut)
    for key, p in PERCENTILES[:-1]:
        assert out.percentile(p) == Quantile(int(np.percentile(output, p, method="inverted_cdf"))), key
    assert out.percentile(99.9) == Quantile(2000, lower_bound=True)
    assert out.max == Quantile(2000, lower_bound=True)
    assert out.truncation_share(1999) == pytest.approx(2 / 306)


@settings(max_examples=200)
@given(st.lists(st.integers(min_value=0, max_value=300), min_size=1, max_size=300))
def test_uncensored_km_equals_nearest_rank_exactly(xs):
    out = CensoredHistogram.of(xs, [False] * len(xs))
    for p in PERCENTS + [12.5, 37.5, 99.99]:
        assert out.percentile(p) == Quantile(int(np.percentile(xs, p, method="inverted_cdf")))
    n = len(xs)
    for t in (-1, 0, 5, 150, 299, 300, 10**6):
        assert out.survival(t) == sum(x > t for x in xs) / n


def test_kaplan_meier_hand_worked_example():
    """Lengths 3, 5, 5+, 7, 9, 9+, 12+ (+ = cut at its cap, true length ≥ value).

    t   at risk  events  S(t)                     F(t)
    3   7        1       6/7           = 0.857   0.143
    5   6        1       6/7·5/6 = 5/7 = 0.714   0.286   (5+ still at risk at 5: events first)
    7   4        1       5/7·3/4 = 15/28 = 0.536 0.464
    9   3        1       15/28·2/3 = 5/14 = 0.357 9/14 = 0.6429
    12  1        0       5/14                    0.6429   (12+ is a censoring, S does not drop)
    p50 = 9 (first F ≥ 0.5); p90 is never reached → 12, a lower bound. Naively (ignoring
    censoring) p50 would be 7 and p90 12: censoring moves the median up.
    """
    out = CensoredHistogram.of([3, 5, 5, 7, 9, 9, 12], [0, 1, 0, 0, 1, 0, 1])
    assert out.censored_count == 3 and out.censored_share == pytest.approx(3 / 7)
    assert out.survival(2) == 1.0
    assert out.survival(3) == pytest.approx(6 / 7)
    assert out.survival(5) == pytest.approx(5 / 7)
    assert out.survival(8) == pytest.approx(15 / 28)
    assert out.truncation_share(9) == pytest.approx(5 / 14)
    assert out.truncation_share(100) == pytest.approx(5 / 14)
    assert out.quantile(0.1) == Quantile(3)
    assert out.quantile(0.2) == Quantile(5)
    assert out.quantile(0.5) == Quantile(9)
    assert out.quantile(0.642) == Quantile(9)  # F(9) = 9/14 = 0.6428…
    assert out.quantile(0.643) == Quantile(12, lower_bound=True)
    assert out.quantile(0.9) == Quantile(12, lower_bound=True)
    assert out.max == Quantile(12, lower_bound=True)
    summary = out.summary()
    assert summary["p50"] == Quantile(9) and summary["p99"] == Quantile(12, lower_bound=True)
    assert summary.mean_lower_bound
    assert np.percentile([3, 5, 5, 7, 9, 9, 12], 50, method="inverted_cdf") == 7


def km_reference(lengths: list[int], cut: list[bool]) -> list[tuple[int, Fraction]]:
    """Straightforward Kaplan–Meier in exact rationals: [(t, F(t))] at each distinct length."""
    observations = sorted(zip(lengths, cut, strict=True))  # at a tie, False (event) sorts before True
    at_risk, survival, curve, i = len(observations), Fraction(1), [], 0
    while i < len(observations):
        t, events, cuts = observations[i][0], 0, 0
        while i < len(observations) and observations[i][0] == t:
            events += not observations[i][1]
            cuts += observations[i][1]
            i += 1
        survival *= Fraction(at_risk - events, at_risk)
        curve.append((t, 1 - survival))
        at_risk -= events + cuts
    return curve


@settings(max_examples=300)
@given(
    st.lists(st.tuples(st.integers(min_value=0, max_value=40), st.booleans()), min_size=1, max_size=120),
    st.lists(st.floats(min_value=0, max_value=1), min_size=1, max_size=5),
)
def test_kaplan_meier_against_exact_reference(observations, qs):
    lengths = [t for t, _ in observations]
    cut = [c for _, c in observations]
    out = CensoredHistogram.of(lengths, cut)
    curve = km_reference(lengths, cut)
    for q in qs + [0.5, 0.9, 0.95, 0.99, 0.999]:
        target = Fraction(repr(q))  # q as the decimal a user means, not its binary neighbour
        hit = [t for t, f in curve if f >= target]
        expected = Quantile(hit[0]) if hit else Quantile(max(lengths), lower_bound=True)
        if any(cut):
            assert out.quantile(q) == expected, q
        else:  # uncensored: numpy's float arithmetic decides ties, and the code follows numpy
            assert out.quantile(q).value_tokens == np.quantile(lengths, q, method="inverted_cdf")
    for t, f in curve:
        assert out.survival(t) == pytest.approx(float(1 - f), abs=1e-12)
        assert out.survival(t + 0.5) == pytest.approx(float(1 - f), abs=1e-12)
    assert out.max == Quantile(max(lengths), lower_bound=any(c and t == max(lengths) for t, c in observations))


def test_lower_bound_cases():
    all_cut = CensoredHistogram.of([100, 200, 200], [1, 1, 1])
    assert all_cut.quantile(0.5) == Quantile(200, lower_bound=True)
    assert all_cut.survival(150) == 1.0
    # an uncensored maximum is exact, even with censoring below it
    top_exact = CensoredHistogram.of([10, 20, 30], [0, 1, 0])
    assert top_exact.max == Quantile(30)
    assert top_exact.quantile(1.0) == Quantile(30)
    assert top_exact.quantile(0.4) == Quantile(30)  # F(10) = 1/3, then S drops to 0 at 30
    # a tie between an event and a censoring at the maximum: the max is a lower bound
    tie = CensoredHistogram.of([5, 9, 9], [0, 0, 1])
    assert tie.max == Quantile(9, lower_bound=True)
    assert tie.quantile(0.6) == Quantile(9)
    assert tie.quantile(0.7) == Quantile(9, lower_bound=True)  # F(9) = 1 − 2/3·1/2 = 2/3


def test_merge_of_censored_shards_equals_whole():
    rng = np.random.default_rng(3)
    lengths = rng.integers(1, 500, 5000)
    cut = rng.random(5000) < 0.1
    whole = CensoredHistogram.of(lengths, cut)
    a = CensoredHistogram.of(lengths[:1234], cut[:1234])
    b = CensoredHistogram.of(lengths[1234:], cut[1234:])
    assert a.merge(b) == whole == b.merge(a)
    assert a.merge(b).summary() == whole.summary()


def test_tail_class_on_real_traces_and_a_light_tail():
    code = read_trace("AzureLLMInferenceTrace_code.csv")["GeneratedTokens"].to_numpy()
    conv = read_trace("AzureLLMInferenceTrace_conv.csv")["GeneratedTokens"].to_numpy()
    code_tail = classify_tail(summarize_plain(Histogram.of(code)))
    assert code_tail.class_ is TailClass.HEAVY and code_tail.p99_over_p50 == pytest.approx(252 / 13)
    conv_tail = classify_tail(summarize_plain(Histogram.of(conv)))
    # p99/p50 = 601/129 = 4.66 is lighter than an exponential; p99.9/p99 = 954/601 = 1.59 is not
    assert conv_tail.class_ is TailClass.HEAVY
    assert conv_tail.p99_over_p50 == pytest.approx(601 / 129)
    assert conv_tail.p999_over_p99 == pytest.approx(954 / 601)
    light = np.round(np.random.default_rng(1).lognormal(5, 0.4, 50_000)).astype(int)  # 2.54, 1.43
    light_tail = classify_tail(summarize_plain(Histogram.of(light)))
    assert light_tail.class_ is TailClass.LIGHT and "p99/p50 > 6.64" in light_tail.rule
    # under 1000 requests p99.9 is only the sample max and is not used
    few = classify_tail(summarize_plain(Histogram.of([100] * 990 + [1000] * 9)))
    assert few.p999_over_p99 is None and few.class_ is TailClass.LIGHT
    # an exponential sits on the boundary; twice its p99 spread is heavy
    assert classify_tail(summarize_plain(Histogram.of([10] * 60 + [70] * 40))).class_ is TailClass.HEAVY


def test_builder_routes_nulls_and_side_columns():
    b = pa.record_batch(
        {
            "route": pa.array(["/chat", "/code", None, "/chat", "/chat"]).dictionary_encode(),
            "model": pa.array(["m1", "m2", "m1", None, "m1"]),
            "prompt_tokens": pa.array([10, 20, None, 40, 50], pa.int64()),
            "output_tokens": pa.array([1, 2, 3, 4, 5], pa.int64()),
            "max_tokens": pa.array([100, None, 100, 256, -1], pa.int64()),
            "finish_reason": pa.array(["stop", "length", "stop", None, "length"]),
            "censored": pa.array([False, True, False, False, True]),
            "timestamp_s": pa.array([0.5, 1.0, None, 61.2, 1.9]),
            "latency_ms": pa.array([120.0, None, None, 80.0, 1000.0]),
            "ttft_ms": pa.array([None] * 5, pa.float64()),
        }
    )
    profile = build(b)
    assert [r.route for r in profile.routes] == ["*", "/chat", "/code"]
    chat = profile.route("/chat")
    assert chat.requests == 3 and chat.output.censored_count == 1
    assert chat.prompt == Histogram.of([10, 40, 50])
    assert chat.total == CensoredHistogram.of([11, 44, 55], [0, 0, 1])
    assert chat.max_tokens == Histogram.of([100, 256])
    assert chat.finish_reasons == {"length": 1, "stop": 1}
    assert chat.models == {"m1": 2}
    assert chat.arrival.requests == 3 and chat.arrival.first_s == 0.5 and chat.arrival.last_s == 61.2
    assert chat.arrival.peak_window_requests == 2  # 0.5 and 1.9 in [0, 60); 61.2 alone
    assert chat.latency_ms.total == 3 and chat.ttft_ms is None
    assert chat.latency_ms.quantile(0.5) == pytest.approx(120, rel=0.01)
    star = profile.route("*")
    assert star.prompt.total == 0 and star.total.total == 0 and star.arrival is None
    assert profile.route("/code").output == CensoredHistogram.of([2], [True])


def test_builder_paths_agree_many_routes_long_prompts_and_huge_values():
    """Many routes × long prompts take np.add.at, few take one bincount; both are exact."""
    rng = np.random.default_rng(5)
    n = 20_000
    routes = rng.integers(0, 40, n)
    prompt = rng.integers(0, 200_000, n)
    prompt[:3] = [10**9, 10**9, 5 * 10**12]  # beyond the dense limit: sparse overflow, still exact
    output = rng.integers(0, 3000, n)
    cut = rng.random(n) < 0.05
    names = np.array([f"/r{i}" for i in range(40)])[routes]
    chunks = [batch(prompt[s], output[s], names[s], cut[s]) for s in np.array_split(np.arange(n), 7)]
    profile = build(*chunks)
    for r in profile.routes:
        mine = names == r.route
        assert r.prompt == Histogram.of(prompt[mine])
        assert r.output == CensoredHistogram.of(output[mine], cut[mine])
        assert r.total == CensoredHistogram.of(prompt[mine] + output[mine], cut[mine])
    assert profile.requests == n


def test_arrival_peak_matches_brute_force():
    rng = np.random.default_rng(2)
    ts = np.sort(rng.exponential(0.5, 3000).cumsum())
    profile = build(batch(np.zeros(3000), np.ones(3000), timestamp_s=ts))
    arrival = profile.routes[0].arrival
    seconds = np.floor(ts).astype(int)
    brute = max(((seconds >= s) & (seconds < s + 60)).sum() for s in range(seconds.max() + 1))
    assert arrival.peak_window_requests == brute
    assert arrival.mean_rate_rps == pytest.approx(3000 / (ts[-1] - ts[0]))
    assert arrival.peak_1s_requests == np.bincount(seconds).max()


def test_save_load_merge_round_trip(tmp_path):
    rng = np.random.default_rng(4)
    a = build(batch(rng.integers(1, 9000, 500), rng.integers(1, 900, 500), "/chat",
                    rng.random(500) < 0.1, timestamp_s=rng.uniform(0, 100, 500)))
    b = build(batch(rng.integers(1, 9000, 300), rng.integers(1, 900, 300), "/code",
                    latency_ms=rng.uniform(10, 5000, 300), finish_reason=["stop"] * 300))
    c = build(batch(rng.integers(1, 9000, 200), rng.integers(1, 900, 200), "/chat",
                    timestamp_s=rng.uniform(50, 300, 200), max_tokens=rng.integers(1, 4096, 200)))
    paths = []
    for name, p in (("a", a), ("b", b), ("c", c)):
        paths.append(tmp_path / f"{name}.json")
        save_profile(p, paths[-1])
        assert is_saved_profile(paths[-1])
        assert load_profile(paths[-1]) == p
    merged = merge_profiles(load_profile(p) for p in paths)
    assert merged == merge_profiles([c, a, b])  # order-independent
    chat = merged.route("/chat")
    assert chat.requests == 700
    assert chat.arrival.first_s == min(a.routes[0].arrival.first_s, c.routes[0].arrival.first_s)
    assert chat.output == a.route("/chat").output.merge(c.route("/chat").output)
    assert merged.combined().requests == 1000


def test_bad_profile_files_name_file_and_field(tmp_path):
    good = build(batch([1, 2], [3, 4], "/chat")).to_dict()
    cases = {
        "version.json": ({**good, "schema_version": 99}, "schema_version: unsupported version 99; this kvtune reads version 1"),
        "kind.json": ({"routes": []}, "kind: not a kvtune profile (expected kind = 'kvtune-profile')"),
        "hist.json": (
            {**good, "routes": [{**good["routes"][0], "prompt_tokens": {"values": [2, 1], "counts": [1, 1]}}]},
            "routes[0].prompt_tokens.values: values must be strictly increasing",
        ),
        "route.json": ({**good, "routes": [{**good["routes"][0], "route": 5}]}, "routes[0].route: expected a string"),
    }
    for name, (data, message) in cases.items():
        path = tmp_path / name
        path.write_text(json.dumps(data))
        with pytest.raises(InputError) as err:
            load_profile(path)
        assert str(err.value) == f"{path}: {message}"
    broken = tmp_path / "broken.json"
    broken.write_text('{"kind": "kvtune-profile",\n  oops')
    with pytest.raises(InputError, match=r"broken.json:2: invalid JSON"):
        load_profile(broken)


@pytest.mark.parametrize("edit, field, words", [
    (lambda r: r["output_tokens"]["uncensored"]["values"].__setitem__(-1, 2**70),
     "routes[0].output_tokens.uncensored.values", "is above 9007199254740992"),
    (lambda r: r["prompt_tokens"]["counts"].__setitem__(0, 2**63),
     "routes[0].prompt_tokens.counts", "is above 9007199254740992"),
    (lambda r: r["prompt_tokens"].update(counts=[2**52] * len(r["prompt_tokens"]["counts"])),
     "routes[0].prompt_tokens.counts", "add up to more than"),
    (lambda r: r["latency_ms"]["values"].__setitem__(-1, 10**6), "routes[0].latency_ms.values", "is above"),
    (lambda r: r["arrival"].update(first_s=1e308), "routes[0].arrival.first_s", "seconds within"),
    (lambda r: r["finish_reasons"].update(stop=2**64), "routes[0].finish_reasons", "integer counts"),
])
def test_saved_profile_numbers_stay_in_range(tmp_path, edit, field, words):
    rng = np.random.default_rng(5)
    data = build(batch(rng.integers(1, 900, 50), rng.integers(1, 90, 50), "/chat",
                       timestamp_s=rng.uniform(0, 100, 50), latency_ms=rng.uniform(10, 500, 50),
                       finish_reason=["stop"] * 50)).to_dict()
    edit(data["routes"][0])
    path = tmp_path / "p.json"
    path.write_text(json.dumps(data))
    with pytest.raises(InputError) as info:
        load_profile(path)
    assert str(info.value).startswith(f"{path}: {field}: "), str(info.value)
    assert words in str(info.value)


# -- per-route state: sparse until busy, dense within a budget, folded beyond max_routes ---------


def _reference_profile(rows: dict[str, np.ndarray]) -> Profile:
    """The profile of raw rows computed the plain way: one exact histogram per route and kind."""
    from collections import Counter

    from kvtune.profile.histogram import JointHistogram, LogHistogram, joint_bin, log_bin
    from kvtune.profile.routes import Arrival, RouteProfile

    routes = []
    for name in sorted(set(rows["route"].tolist())):
        m = rows["route"] == name
        out, cut, prompt = rows["output"][m], rows["cut"][m], rows["prompt"][m]
        has_prompt = prompt >= 0
        asked = rows["max_tokens"][m]
        stamps, latency = rows["timestamp"][m], rows["latency"][m]
        timed = np.isfinite(stamps)
        routes.append(RouteProfile(
            route=name,
            output=CensoredHistogram.of(out, cut),
            total=CensoredHistogram.of((prompt + out)[has_prompt], cut[has_prompt]),
            prompt=Histogram.of(prompt[has_prompt]),
            max_tokens=Histogram.of(asked[asked >= 0]),
            joint=JointHistogram(joint_bin(prompt[has_prompt]), joint_bin(out[has_prompt]), np.ones(has_prompt.sum(), np.int64)),
            finish_reasons=dict(sorted(Counter(rows["finish"][m].tolist()).items())),
            models=dict(sorted(Counter(rows["model"][m].tolist()).items())),
            arrival=Arrival(Histogram.of(np.floor(stamps[timed]).astype(np.int64)), float(stamps[timed].min()),
                            float(stamps[timed].max())) if timed.any() else None,
            latency_ms=LogHistogram(Histogram.of(log_bin(latency[np.isfinite(latency)]))) if np.isfinite(latency).any() else None,
        ))
    return Profile(routes=tuple(routes))


@st.composite
def _traffic(draw):
    """Rows over a skewed set of routes (a few busy, many with a row or two), values small and
    huge, as batches cut at random points."""
    n = draw(st.integers(1, 600))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    busy = draw(st.integers(1, 4))
    pool = np.array([f"/busy{i}" for i in range(busy)] + [f"/r{i}" for i in range(draw(st.integers(0, 300)))] + ["*"])
    weights = np.where(np.char.startswith(pool, "/busy"), 40.0, 1.0)
    route = rng.choice(pool, n, p=weights / weights.sum())
    big = draw(st.sampled_from([0, 1 << 22, 10**12]))
    rows = {
        "route": route,
        "output": np.where(rng.random(n) < 0.02, big, rng.integers(0, 3000, n)).astype(np.int64),
        "cut": rng.random(n) < 0.1,
        "prompt": np.where(rng.random(n) < 0.1, -1, rng.integers(0, draw(st.sampled_from([50, 9000, 300_000])), n)),
        "max_tokens": np.where(rng.random(n) < 0.3, -1, rng.integers(0, 5000, n)),
        "finish": rng.choice(["stop", "length", "tool_calls"], n),
        "model": rng.choice([f"m{i}" for i in range(draw(st.integers(1, 30)))], n),
        "timestamp": np.where(rng.random(n) < 0.2, np.nan, 1.7e9 + rng.random(n) * 3000),
        "latency": np.where(rng.random(n) < 0.5, np.nan, rng.random(n) * 5000),
    }
    cuts = sorted(draw(st.lists(st.integers(0, n), max_size=4)))
    return rows, [0, *cuts, n]


def _batches(rows, cuts):
    for lo, hi in zip(cuts, cuts[1:], strict=False):
        if hi > lo:
            part = {k: v[lo:hi] for k, v in rows.items()}
            yield pa.record_batch({
                "route": pa.array(part["route"]).dictionary_encode(),
                "output_tokens": pa.array(part["output"]),
                "censored": pa.array(part["cut"]),
                "prompt_tokens": pa.array(np.where(part["prompt"] < 0, 0, part["prompt"]), mask=part["prompt"] < 0),
                "max_tokens": pa.array(part["max_tokens"]),
                "finish_reason": pa.array(part["finish"]),
                "model": pa.array(part["model"]),
                "timestamp_s": pa.array(part["timestamp"], from_pandas=True),
                "latency_ms": pa.array(part["latency"], from_pandas=True),
            })


@settings(max_examples=150, deadline=None)
@given(traffic=_traffic(), dense_rows=st.sampled_from([1, 3, 40, 4096]),
       budget=st.sampled_from([8 * 64, 8 * 5000, 128 << 20]), max_routes=st.sampled_from([None, 1, 3, 50]))
def test_builder_is_exact_whatever_counts_dense_or_sparse_and_folds(traffic, dense_rows, budget, max_routes):
    """Dense rows, sparse keys, values past the width the budget allows, the overflow, and the
    fold into `*`: the profile equals the plain per-route histograms of the same rows, folded
    the same way (the kept routes exactly as profiled alone)."""
    import kvtune.profile.build as profiler
    from kvtune.profile.routes import fold_routes

    rows, cuts = traffic
    saved = profiler.DENSE_ROWS, profiler.DENSE_TABLE_BYTES
    profiler.DENSE_ROWS, profiler.DENSE_TABLE_BYTES = dense_rows, budget
    try:
        builder = ProfileBuilder(max_routes=max_routes)
        for b in _batches(rows, cuts):
            builder.add_batch(b)
        got = builder.result()
    finally:
        profiler.DENSE_ROWS, profiler.DENSE_TABLE_BYTES = saved
    expected = fold_routes(_reference_profile(rows), max_routes)
    assert got == expected
    assert got.requests == len(rows["route"])
    if max_routes is not None:
        assert len([r for r in got.routes if r.route != "*"]) <= max_routes


def test_fold_keeps_the_busiest_routes_exactly_and_says_how_many_were_folded():
    rows = {"route": np.array(["/a"] * 5 + ["/b"] * 3 + ["/c"] * 2 + ["/d", "*"])}
    n = rows["route"].size
    out = np.arange(1, n + 1)
    builder = ProfileBuilder(max_routes=2)
    builder.add_batch(batch(np.zeros(n, np.int64), out, rows["route"]))
    profile = builder.result()
    assert [r.route for r in profile.routes] == ["*", "/a", "/b"]
    assert (profile.folded_routes, profile.folded_requests) == (2, 3)  # /c and /d; "*" was already there
    assert profile.route("/a").output == CensoredHistogram.of(out[:5], [False] * 5)
    assert profile.route("*").output == CensoredHistogram.of(out[8:], [False] * 4)
    assert Profile.from_dict(json.loads(json.dumps(profile.to_dict()))) == profile
    assert profile.summary_dict()["folded"] == {"routes": 2, "requests": 3, "into": "*"}
