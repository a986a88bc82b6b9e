"""Aggregates, SLO parsing, goodput and the verdict against a recommendation."""

from __future__ import annotations

import numpy as np
import pytest
from recs import make_rec

from kvtune.bench.report import summarize, verdict
from kvtune.domain.slo import parse_slo
from kvtune.errors import OptionError
from kvtune.workload.requests import Outcome, RequestResult
from kvtune.workload.stats import latency_stats


def result(i=0, route="/r", *, outcome=Outcome.OK, prompt=100, asked=50, got=50, ttft=100.0, e2e=1100.0,
           finish="length", itl=(10.0,)) -> RequestResult:
    r = RequestResult(i, route, prompt, asked, 0.0, outcome=outcome, status=200, attempts=1)
    if outcome is Outcome.OK:
        r.output_tokens, r.prompt_tokens, r.ttft_ms, r.e2e_ms = got, prompt, ttft, e2e
        r.finish_reason, r.itl_ms = finish, list(itl)
    return r


def test_parse_slo():
    s = parse_slo("ttft=500, tpot=50ms,e2e_ms=10000")
    assert (s.ttft_ms, s.tpot_ms, s.e2e_ms) == (500, 50, 10000)
    assert parse_slo("tpot=20").ttft_ms is None


@pytest.mark.parametrize("text,message", [
    ("ttft", "slo: expected KEY=MS pairs with keys ttft, tpot, e2e, got 'ttft'"),
    ("itl=5", "slo: expected KEY=MS pairs with keys ttft, tpot, e2e, got 'itl=5'"),
    ("ttft=fast", "slo: ttft: expected milliseconds, got 'fast'"),
    ("ttft=-1", "slo: ttft: expected a positive number of milliseconds, got '-1'"),
    ("ttft=1,ttft=2", "slo: ttft given twice"),
])
def test_parse_slo_errors(text, message):
    """The library names its own parameter; the CLI names the flag (test_cli_bench)."""
    with pytest.raises(OptionError) as exc:
        parse_slo(text)
    assert str(exc.value) == message


def test_latency_stats_match_numpy_nearest_rank():
    x = np.random.default_rng(0).lognormal(3, 1, 1001)
    s = latency_stats(x.tolist())
    for key, p in (("p50", 50), ("p90", 90), ("p99", 99)):
        assert s[key] == round(float(np.percentile(x, p, method="inverted_cdf")), 3)
    assert s["count"] == 1001 and s["mean"] == round(float(x.mean()), 3)
    assert latency_stats([])["p99"] is None


def test_summary_counts_outcomes_tokens_and_goodput():
    results = [
        result(0, got=50, ttft=100, e2e=1100),  # tpot (1100-100)/49 ≈ 20.4
        result(1, got=40, ttft=900, e2e=1900),  # short by 10, misses ttft
        result(2, outcome=Outcome.HTTP_429),
        result(3, outcome=Outcome.TIMEOUT),
        result(4, got=50, ttft=100, e2e=5100),  # tpot ≈ 102, misses tpot
    ]
    s = summarize(results, duration_s=2.0, slo=parse_slo("ttft=500,tpot=50"))
    assert s["requests"]["sent"] == 5 and s["requests"]["completed"] == 3
    assert s["requests"]["failed"]["429"] == 1 and s["requests"]["failed"]["timeout"] == 1
    assert s["output_tokens_total"] == 140 and s["output_tokens_requested_total"] == 150
    assert s["output_length"] == {"completed_without_usage": 0, "mismatched": 1, "shortfall_tokens": 10,
                                  "excess_tokens": 0}
    assert s["throughput"] == {"requests_per_s": 1.5, "output_tokens_per_s": 70.0}
    assert s["goodput"]["requests_met"] == 1 and s["goodput"]["attainment"] == 0.2
    assert s["goodput"]["requests_per_s"] == 0.5
    assert s["latency_ms"]["tpot"]["count"] == 3
    assert s["routes"]["/r"]["truncated"] == 1 and s["routes"]["/r"]["truncation_share"] == pytest.approx(1 / 3, abs=1e-6)


EXPECT = make_rec(budget=89, num_blocks=100, block_size=16, admitted=9, routes=[("/r", 60, 0.0)])


def server(**kw):
    base = {"preemptions": 0, "kv_cache_usage_peak": 0.5, "running_peak": 5, "waiting_peak": 0,
            "num_blocks": 100, "block_size": 16}
    return base | kw


def judge(results, srv, expect=EXPECT, slo=None, attainment=None):
    s = summarize(results, duration_s=1.0, server=srv, slo=slo)
    return verdict(expect, s, results, slo_attainment=attainment)


def test_verdict_passes_when_the_server_keeps_the_promise():
    v = judge([result(i) for i in range(20)], server())
    assert v["passed"] is True
    # reservation = ceil((100 + min(50, 60)) / 16) = 10 blocks → 89 // 10 = 8 at once
    assert v["admitted_concurrency"]["expected"] == 8
    assert v["kv_cache_usage"]["expected"] == 0.9  # (89 + 1 null block) / 100


@pytest.mark.parametrize("srv,failing", [
    (server(preemptions=3), "preemptions"),
    (server(kv_cache_usage_peak=0.95), "kv_cache_usage"),
    (server(running_peak=9), "admitted_concurrency"),
])
def test_verdict_fails_the_broken_promise(srv, failing):
    v = judge([result(i) for i in range(20)], srv)
    assert v["passed"] is False
    assert [k for k, c in v.items() if k != "passed" and not c["passed"]] == [failing]


def test_truncation_share_within_a_binomial_tolerance():
    expect = make_rec(budget=89, num_blocks=100, block_size=16, admitted=9, routes=[("/r", 60, 0.1)])
    ok = [result(i, got=40 if i < 10 else 50) for i in range(100)]  # 10% cut short
    assert judge(ok, server(), expect)["truncation_share"]["passed"] is True
    bad = [result(i, got=40 if i < 40 else 50) for i in range(100)]  # 40% cut short
    v = judge(bad, server(), expect)
    assert v["truncation_share"]["passed"] is False and v["passed"] is False
    assert v["truncation_share"]["routes"][0]["observed"] == 0.4


def test_without_metrics_server_checks_cannot_pass():
    v = judge([result(i) for i in range(5)], None)
    assert v["passed"] is False
    assert v["preemptions"]["evaluated"] is False and v["truncation_share"]["passed"] is True


def test_slo_attainment_check_without_expect():
    results = [result(i, ttft=100 if i else 900) for i in range(10)]
    v = judge(results, server(), expect=None, slo=parse_slo("ttft=500"), attainment=0.9)
    assert v == {"passed": True, "slo": {"passed": True, "evaluated": True, "observed": 0.9, "expected": 0.9,
                                         "detail": "share of requests (errors included) that met every SLO"}}
    assert judge(results, server(), expect=None, slo=parse_slo("ttft=500"), attainment=0.95)["passed"] is False
    assert judge(results, server(), expect=None) is None


def test_an_answer_cut_short_of_what_it_asked_for_misses_the_slo():
    # in time, but a gateway's cap stopped it at 30 of the 50 tokens its client asked for
    results = [result(0, asked=50, got=50), result(1, asked=50, got=30), result(2, asked=50, got=50, finish="stop")]
    s = summarize(results, duration_s=1.0, slo=parse_slo("ttft=500"))
    assert s["requests"]["completed"] == 3 and s["goodput"]["requests_met"] == 2
