"""From per-request results and server metrics to the numbers a benchmark reports, and a verdict.

Pure: lists and dicts in, a JSON-ready dict out. Percentiles are nearest-rank (numpy
`inverted_cdf`), as everywhere in kvtune. Errors count as goodput misses.

Verdict checks against a recommendation.json (`kvtune recommend --out`):
  preemptions            server preemptions during the run == 0 (the reservation policy's promise)
  kv_cache_usage         peak kv_cache_usage_perc ≤ (block_budget + 1) / num_blocks: the budget plus
                         vLLM's permanent null block (≈ safety_fraction)
  admitted_concurrency   peak running ≤ block_budget // the smallest reservation among the requests
                         sent, ceil((prompt + min(max_tokens, route cap)) / block_size): the most
                         requests a gateway holding the budget could have admitted at once
  truncation_share       per route, share of completed responses cut short (finish_reason length
                         with fewer tokens than the drawn output length) within
                         0.01 + 3·sqrt(p'(1−p')/n) of the predicted share p, p' = max(p, 1/n)
  slo                    with --slo: the share of requests meeting every objective ≥ the attainment
                         asked for (errors are misses)
A check that cannot be evaluated (no /metrics, no completed requests on a route) fails: a gate
that cannot see must not pass.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

from kvtune.capacity.reservation import reserved_blocks
from kvtune.domain.recommendation import Recommendation
from kvtune.domain.slo import Slo
from kvtune.workload.requests import FAILURE_KINDS, RequestResult
from kvtune.workload.stats import goodput, latency_stats, throughput

__all__ = ["slo_met", "summarize", "verdict"]

def slo_met(slo: Slo, r: RequestResult) -> bool:
    """OK, whole (not cut by a length limit short of what it asked for) and within every
    objective of `slo`."""
    return slo.meets(r.ok and not _truncated(r), r.ttft_ms, r.tpot_ms, r.e2e_ms)


def _truncated(r: RequestResult) -> bool:
    """Cut short: stopped on a length limit before the output length this request asked for."""
    return (r.finish_reason == "length" and r.output_tokens is not None
            and r.output_tokens < r.output_tokens_requested)


def summarize(
    results: Sequence[RequestResult],
    *,
    duration_s: float,
    slo: Slo | None = None,
    server: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Every client-side aggregate of a run (the results JSON minus run settings and verdict)."""
    outcomes = Counter(r.outcome.value for r in results)
    done = [r for r in results if r.ok]
    usage = [r.output_tokens for r in done if r.output_tokens is not None]
    out_total = int(sum(usage))
    # (counted by the server, asked for) where the two differ
    mismatch = [(r.output_tokens, r.output_tokens_requested) for r in done
                if r.output_tokens is not None and r.output_tokens != r.output_tokens_requested]
    prompt_checked = [r for r in done if r.prompt_tokens is not None]
    prompt_mismatch = [r for r in prompt_checked if r.prompt_tokens != r.prompt_tokens_requested]
    itl = [x for r in done for x in r.itl_ms]

    routes: dict[str, dict[str, Any]] = {}
    for name in sorted({r.route for r in results}):
        mine = [r for r in results if r.route == name]
        ok = [r for r in mine if r.ok]
        cut = sum(_truncated(r) for r in ok)
        routes[name] = {
            "sent": len(mine),
            "completed": len(ok),
            "truncated": cut,
            "truncation_share": round(cut / len(ok), 6) if ok else None,
            "finish_reasons": dict(sorted(Counter(r.finish_reason or "none" for r in ok).items())),
        }

    summary: dict[str, Any] = {
        "requests": {
            "sent": len(results),
            "completed": len(done),
            "failed": {kind: outcomes.get(kind, 0) for kind in FAILURE_KINDS},
            "retries": sum(max(0, r.attempts - 1) for r in results),
            "retry_wait_s": round(sum(r.retry_wait_s for r in results), 3),
        },
        "duration_s": round(duration_s, 3),
        "output_tokens_total": out_total,
        "output_tokens_requested_total": int(sum(r.output_tokens_requested for r in done)),
        "output_length": {
            "completed_without_usage": len(done) - len(usage),
            "mismatched": len(mismatch),
            "shortfall_tokens": int(sum(asked - got for got, asked in mismatch if got < asked)),
            "excess_tokens": int(sum(got - asked for got, asked in mismatch if got > asked)),
        },
        "prompt_tokens_total": int(sum(r.prompt_tokens or 0 for r in prompt_checked)),
        "prompt_tokens_requested_total": int(sum(r.prompt_tokens_requested for r in done)),
        "prompt_length": {"checked": len(prompt_checked), "mismatched": len(prompt_mismatch)},
        "latency_ms": {
            "ttft": latency_stats([r.ttft_ms for r in done if r.ttft_ms is not None]),
            "itl": latency_stats(itl),
            "tpot": latency_stats([t for r in done if (t := r.tpot_ms) is not None]),
            "e2e": latency_stats([r.e2e_ms for r in done if r.e2e_ms is not None]),
        },
        "throughput": throughput(len(done), out_total, duration_s),
        "finish_reasons": dict(sorted(Counter(r.finish_reason or "none" for r in done).items())),
        "routes": routes,
        "goodput": None,
        "server": None if server is None else dict(server),
    }
    if slo is not None:
        summary["goodput"] = goodput(slo, sum(slo_met(slo, r) for r in results), len(results), duration_s)
    return summary


# ---------------------------------------------------------------------------------------------
# Verdict


def _check(name: str, passed: bool | None, observed: Any, expected: Any, detail: str) -> dict[str, Any]:
    return {"name": name, "passed": bool(passed) if passed is not None else False,
            "evaluated": passed is not None, "observed": observed, "expected": expected, "detail": detail}


def verdict(expect: Recommendation | None, summary: Mapping[str, Any], results: Sequence[RequestResult],
            *, slo_attainment: float | None = None) -> dict[str, Any] | None:
    """The checks that apply: the SLO attainment when SLOs were given, the recommendation's when one was."""
    checks: list[dict[str, Any]] = []
    goodput = summary.get("goodput")
    if goodput is not None and slo_attainment is not None:
        got = goodput["attainment"]
        checks.append(_check("slo", None if got is None else got >= slo_attainment, got, slo_attainment,
                             "share of requests (errors included) that met every SLO"))
    if expect is not None:
        checks.extend(_expect_checks(expect, summary, results))
    if not checks:
        return None
    return {"passed": all(c["passed"] for c in checks), **{c.pop("name"): c for c in checks}}


def _expect_checks(expect: Recommendation, summary: Mapping[str, Any],
                   results: Sequence[RequestResult]) -> list[dict[str, Any]]:
    server = summary.get("server")
    checks: list[dict[str, Any]] = []
    budget = expect.budget_blocks

    # preemptions
    pre = None if server is None else server.get("preemptions")
    checks.append(_check(
        "preemptions", None if pre is None else pre == 0, pre, 0,
        "no /metrics: preemptions unknown" if pre is None else
        f"{pre} preemption(s) during the run; the reservation policy promises none"))

    # kv cache usage
    num_blocks = (server or {}).get("num_blocks") or expect.capacity.num_blocks
    peak_kv = None if server is None else server.get("kv_cache_usage_peak")
    if peak_kv is None or not num_blocks:
        checks.append(_check("kv_cache_usage", None, peak_kv, None, "no /metrics: KV use unknown"))
    else:
        limit = (budget + 1) / num_blocks
        checks.append(_check(
            "kv_cache_usage", peak_kv <= limit + 1e-9, round(peak_kv, 6), round(limit, 6),
            f"peak KV use {peak_kv:.1%} vs the budget {budget} blocks + 1 null block of {num_blocks}"))

    # admitted concurrency
    block_size = (server or {}).get("block_size") or expect.capacity.block_size
    running = None if server is None else server.get("running_peak")
    caps = {r.route: r.cap for r in expect.routes}
    sent = [r for r in results if r.attempts > 0]
    if running is None or not block_size or not sent:
        checks.append(_check("admitted_concurrency", None, running, None,
                             "no /metrics or no requests: peak running unknown"))
    else:
        fallback = max(caps.values()) if caps else None

        def reservation(r: RequestResult) -> int:
            cap = caps.get(r.route, caps[next(iter(caps))] if len(caps) == 1 else fallback)
            out = r.output_tokens_requested if cap is None else min(r.output_tokens_requested, cap)
            return reserved_blocks(r.prompt_tokens_requested, out, block_size)

        smallest = min(reservation(r) for r in sent)
        bound = budget // max(1, smallest)
        checks.append(_check(
            "admitted_concurrency", running <= bound, running, bound,
            f"peak {running} running vs {budget} budget blocks ÷ {smallest}-block smallest reservation "
            f"(recommendation's typical admitted: {expect.concurrency.admitted})"))

    # truncation share per route
    predicted = {r.route: r.truncation_share for r in expect.routes}
    single = next(iter(predicted.values())) if len(predicted) == 1 else None
    per_route = []
    for name, obs in (summary.get("routes") or {}).items():
        p = predicted.get(name, single)
        n = obs["completed"]
        share = obs["truncation_share"]
        if p is None or not n:
            per_route.append({"route": name, "passed": None, "observed": share, "expected": p, "tolerance": None})
            continue
        q = max(float(p), 1.0 / n)
        tol = 0.01 + 3 * math.sqrt(q * (1 - min(q, 1.0)) / n)
        per_route.append({"route": name, "passed": abs(share - p) <= tol, "observed": share,
                          "expected": p, "tolerance": round(tol, 6), "completed": n})
    evaluated = [r for r in per_route if r["passed"] is not None]
    checks.append({
        "name": "truncation_share",
        "passed": bool(per_route) and all(r["passed"] for r in per_route),
        "evaluated": bool(evaluated) and len(evaluated) == len(per_route),
        "routes": per_route,
        "detail": "responses cut short (finish_reason length below the drawn output length) vs the "
                  "recommendation's predicted truncation share per route",
    })
    return checks
