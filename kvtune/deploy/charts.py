"""The report's charts as plain data: histogram bars and the capacity breakdown, sized for the
SVG and the Markdown table the templates draw from them."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvtune.policy.recommendation import Recommendation


def coarsen_histogram(edges: list, counts: list, max_bins: int) -> tuple[list, list]:
    """Merge runs of adjacent bins so at most `max_bins` remain (a context-wide histogram of
    16-token bins has hundreds); trailing empty bins are dropped first."""
    if len(edges) != len(counts) + 1:
        return list(edges), list(counts)
    last = max((i for i, c in enumerate(counts) if c), default=-1)
    edges, counts = list(edges[: last + 2]), list(counts[: last + 1])
    group = max(1, math.ceil(len(counts) / max_bins))
    if group == 1:
        return edges, counts
    new_edges = edges[::group]
    if new_edges[-1] != edges[-1]:
        new_edges.append(edges[-1])
    new_counts = [sum(counts[i:i + group]) for i in range(0, len(counts), group)]
    return new_edges, new_counts


def histogram_bars(edges: list, counts: list, cap: int | None, *, width: int = 560,
                   height: int = 140, max_bins: int = 80) -> dict:
    """Geometry of one inline SVG bar chart of output lengths with the cap marked as a line."""
    edges, counts = coarsen_histogram(edges, counts, max_bins)
    if not counts or len(edges) != len(counts) + 1:
        return {"width": width, "height": height, "bars": [], "cap_x": None, "max_edge": 0}
    lo, hi = float(edges[0]), float(edges[-1])
    span = max(hi - lo, 1.0)
    peak = max(max(counts), 1)
    plot_h = height - 20
    bars = []
    for i, count in enumerate(counts):
        x0 = (float(edges[i]) - lo) / span * width
        x1 = (float(edges[i + 1]) - lo) / span * width
        h = count / peak * plot_h
        bars.append({"x": round(x0, 2), "w": round(max(x1 - x0 - 0.5, 0.5), 2),
                     "y": round(plot_h - h, 2), "h": round(h, 2), "count": count,
                     "lo": edges[i], "hi": edges[i + 1], "above_cap": cap is not None and edges[i] >= cap})
    cap_x = None
    if cap is not None:
        cap_x = round(min(max((cap - lo) / span, 0.0), 1.0) * width, 2)
    return {"width": width, "height": height, "plot_h": plot_h, "bars": bars, "cap_x": cap_x,
            "min_edge": edges[0], "max_edge": edges[-1]}


def capacity_segments(rec: Recommendation) -> list[dict]:
    """Weights, overhead, KV and what is left, as shares of the GPUs' total memory."""
    cap, hw = rec.capacity, rec.hardware
    total = hw.gpu_memory_bytes * hw.gpus if hw.gpu_memory_bytes else None
    parts = [("weights", cap.weights_bytes), ("overhead", cap.overhead_bytes), ("KV cache", cap.kv_cache_bytes)]
    known = sum(int(v) for _, v in parts if v)
    denominator = max(total or 0, known, 1)
    segments: list[dict] = [{"name": n, "bytes": int(v), "share": int(v) / denominator} for n, v in parts if v]
    if total and total > known:
        segments.append({"name": "unused", "bytes": total - known, "share": (total - known) / denominator})
    x = 0.0
    for seg in segments:
        seg["x"] = round(x * 100, 3)
        seg["w"] = round(seg["share"] * 100, 3)
        x += seg["share"]
    return segments
