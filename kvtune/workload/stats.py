"""Latency percentiles, throughput and goodput of a run, measured (kvtune.bench) or simulated
(kvtune.sim): one definition, nearest-rank as everywhere in kvtune, so a simulated p99 and a
measured one mean the same thing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from kvtune.domain.slo import Slo
from kvtune.profile.histogram import nearest_rank_index

__all__ = ["PERCENTILES", "latency_stats", "throughput", "goodput"]

PERCENTILES = (("p50", 50), ("p90", 90), ("p99", 99))


def latency_stats(values: Sequence[float] | np.ndarray, counts: np.ndarray | None = None
                  ) -> dict[str, float | int | None]:
    """count, mean and nearest-rank p50/p90/p99 in ms (3 decimals); None when empty.

    `counts[i]` repeats values[i] that many times without building the repeated array (a
    simulated request's mean inter-token gap stands for each of its gaps)."""
    if counts is None:
        a = np.sort(np.asarray(values, dtype=np.float64))
        if not a.size:
            return {"count": 0, "mean": None, **{k: None for k, _ in PERCENTILES}}
        out: dict[str, float | int | None] = {"count": int(a.size), "mean": round(float(a.mean()), 3)}
        for key, p in PERCENTILES:  # the one nearest-rank definition (kvtune.profile.histogram)
            out[key] = round(float(a[nearest_rank_index(a.size, float(np.float64(p) / 100))]), 3)
        return out
    v = np.asarray(values, dtype=np.float64)
    c = np.asarray(counts, dtype=np.int64)
    keep = c > 0
    v, c = v[keep], c[keep]
    total = int(c.sum())
    if not total:
        return {"count": 0, "mean": None, **{k: None for k, _ in PERCENTILES}}
    order = np.argsort(v, kind="stable")
    v, cum = v[order], np.cumsum(c[order])
    out = {"count": total, "mean": round(float((v * c[order]).sum() / total), 3)}
    for key, p in PERCENTILES:  # the repeated array's element at the nearest rank
        rank = nearest_rank_index(total, float(np.float64(p) / 100))
        out[key] = round(float(v[int(np.searchsorted(cum, rank, side="right"))]), 3)
    return out


def throughput(completed: int, output_tokens: int, duration_s: float) -> dict[str, float]:
    """Completed requests and output tokens per second of the run."""
    duration = max(duration_s, 1e-9)
    return {"requests_per_s": round(completed / duration, 3), "output_tokens_per_s": round(output_tokens / duration, 3)}


def goodput(slo: Slo, met: int, total: int, duration_s: float) -> dict[str, Any]:
    """How many requests met every objective, of all sent (errors are misses)."""
    return {"slo": slo.to_dict(), "requests_met": met, "attainment": round(met / total, 6) if total else None,
            "requests_per_s": round(met / max(duration_s, 1e-9), 3)}
