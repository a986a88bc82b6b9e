"""A simulation's results in `kvtune bench --json`'s fields, computed by bench's own functions.

Where a field means the same thing it has the same name and the same computation
(kvtune.workload.stats: latency_stats' nearest rank, throughput, goodput, Slo): requests,
duration_s, output_tokens_total, latency_ms {ttft, itl, tpot, e2e}, throughput, goodput, server.
A simulated request streams no tokens one by one, so its inter-token gaps are its mean gap
((e2e − TTFT) / (tokens − 1)) repeated for each gap: `itl` is tpot weighted by gaps. What only a
simulation knows goes under `simulation`. Goodput counts an answer cut by a cap its client did
not ask for (fewer tokens than requested_output) as not met, as bench's Slo.met does.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvtune.domain.slo import Slo
from kvtune.sim.requests import Outcome
from kvtune.sim.results import OUTCOMES, SimResult
from kvtune.sim.traffic import Traffic
from kvtune.version import __version__
from kvtune.workload.requests import FAILURE_KINDS
from kvtune.workload.stats import goodput, latency_stats, throughput

_OK, _429, _REJECTED, _NOT_SENT = (OUTCOMES.index(o) for o in (Outcome.OK, Outcome.HTTP_429, Outcome.REJECTED,
                                                                Outcome.NOT_SENT))


def _latencies_ms(result: SimResult, traffic: Traffic) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per request: answered (ok), TTFT, TPOT (NaN below two tokens) and e2e in ms, counted from
    the moment its client sent it (bench's clock)."""
    r = result.requests
    ok = r.outcome == _OK
    send_s = r.arrival_s - traffic.overhead_s
    ttft = (r.first_token_s - send_s) * 1000
    e2e = (r.finish_s - send_s) * 1000
    tokens = r.output_tokens
    multi = ok & (tokens >= 2)
    tpot = np.full(len(r), np.nan)
    tpot[multi] = (e2e[multi] - ttft[multi]) / (tokens[multi] - 1)
    return ok, ttft, tpot, e2e


def summarize_sim(result: SimResult, traffic: Traffic, *, slo: Slo | None) -> dict[str, Any]:
    """requests … server, as bench's `summarize` reports them."""
    r = result.requests
    sent = r.outcome != _NOT_SENT
    ok, ttft, tpot, e2e = _latencies_ms(result, traffic)
    tokens = r.output_tokens
    multi = ok & (tokens >= 2)
    out_total = int(tokens[ok].sum())
    failed = dict.fromkeys(FAILURE_KINDS, 0)
    failed["429"] = int((r.outcome == _429).sum())
    failed["4xx"] = int((r.outcome == _REJECTED).sum())
    completed = int(ok.sum())
    duration_s = result.duration_s
    summary: dict[str, Any] = {
        "requests": {"sent": int(sent.sum()), "completed": completed, "failed": failed,
                     "retries": int(r.retries[sent].sum()),
                     "retry_wait_s": round(float(r.retry_wait_s[sent].sum()), 3)},
        "duration_s": round(duration_s, 3),
        "output_tokens_total": out_total,
        "output_tokens_requested_total": int(traffic.requested_output[ok].sum()),
        "prompt_tokens_requested_total": int(traffic.workload.prompt_tokens[ok].sum()),
        "latency_ms": {
            "ttft": latency_stats(ttft[ok]),
            "itl": latency_stats(tpot[multi], counts=tokens[multi] - 1),
            "tpot": latency_stats(tpot[multi]),
            "e2e": latency_stats(e2e[ok]),
        },
        "throughput": throughput(completed, out_total, duration_s),
        "goodput": None,
        "server": {
            "preemptions": result.preemptions,
            "kv_cache_usage_peak": round(result.kv_usage_peak, 6),
            "running_peak": result.running_peak,
            "waiting_peak": result.waiting_peak,
            "generation_tokens": out_total,
            "num_blocks": result.usable_blocks + 1,
            "block_size": None,  # filled by the caller, who knows the engine settings
        },
    }
    if slo is not None:
        summary["goodput"] = goodput(slo, int(slo_met(result, traffic, slo).sum()), int(sent.sum()), duration_s)
    return summary


def slo_met(result: SimResult, traffic: Traffic, slo: Slo) -> np.ndarray:
    """Per request: did it meet `slo` (goodput's count)? An answer the gateway's cap cut short of
    what its client asked for is no answer met."""
    r = result.requests
    ok, ttft, tpot, e2e = _latencies_ms(result, traffic)
    whole = ok & (r.output_tokens >= traffic.requested_output)
    return np.fromiter((o and slo.meets(True, None if np.isnan(a) else float(a), None if np.isnan(b) else float(b),
                                        None if np.isnan(c) else float(c))
                        for o, a, b, c in zip(whole.tolist(), ttft.tolist(), tpot.tolist(), e2e.tolist(), strict=True)),
                       dtype=bool, count=len(r))


def sim_report(result: SimResult, traffic: Traffic, *, slo: Slo | None, context: dict[str, Any],
               simulation: dict[str, Any], block_size: int) -> dict[str, Any]:
    """The whole JSON object: version, run context (load, workload), the summary, `simulation`."""
    summary = summarize_sim(result, traffic, slo=slo)
    summary["server"]["block_size"] = block_size
    r = result.requests
    workload = {**context.get("workload", {}), "clamped": dict(traffic.clamped)}
    return {
        "kvtune_version": __version__,
        **context,
        "workload": workload,
        **summary,
        "simulation": {
            **simulation,
            "events": result.events,
            "steps": result.num_steps,
            "wall_s": round(result.wall_s, 3),
            "requests_not_sent": int((r.outcome == _NOT_SENT).sum()),
            "admission_waiting_peak": result.admission_waiting_peak,
            "preempted_requests": int((r.preemptions > 0).sum()),
            **({"by_route": by_route(result, traffic, slo)} if len(traffic.routes) > 1 else {}),
        },
    }


def by_route(result: SimResult, traffic: Traffic, slo: Slo | None = None) -> dict[str, Any]:
    """Each route's requests: completed, 429s, retried, TTFT (as latency_ms.ttft, and of the
    requests admitted at their first try), and with an SLO how many met it (its goodput's count).
    With flow control's bands on routes, each band's TTFT and goodput."""
    r = result.requests
    met = None if slo is None else slo_met(result, traffic, slo)
    ok = r.outcome == _OK
    ttft = (r.first_token_s - (r.arrival_s - traffic.overhead_s)) * 1000
    names = np.asarray(traffic.route, dtype=object)
    out = {}
    for name in traffic.routes:
        mine = names == name
        first_try = mine & ok & (r.retries == 0)
        out[name] = {"sent": int((mine & (r.outcome != _NOT_SENT)).sum()), "completed": int((mine & ok).sum()),
                     "http_429": int((mine & (r.outcome == _429)).sum()),
                     "retried": int((mine & (r.retries > 0)).sum()),
                     "ttft_ms": latency_stats(ttft[mine & ok]),
                     "ttft_ms_first_try": latency_stats(ttft[first_try]),
                     **({} if met is None else {"slo_met": int((mine & met).sum())})}
    return out


__all__ = ["by_route", "slo_met", "summarize_sim", "sim_report"]
