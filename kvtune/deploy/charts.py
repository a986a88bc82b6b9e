"""The report's charts as plain data: histogram bars and the capacity breakdown, sized for the
SVG and the Markdown table the templates draw from them."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvtune.domain.recommendation import Recommendation


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


# --- the what-if scatter ----------------------------------------------------------------------

SCATTER_WIDTH, SCATTER_HEIGHT = 720, 340
SCATTER_MARGIN = {"left": 64, "right": 24, "top": 16, "bottom": 44}
LABEL_FONT_PX = 12
LABEL_CHAR_PX = 7.0  # a generous average advance at LABEL_FONT_PX in a sans-serif face
MARK_RADIUS = {"chosen": 7.0, "direct": 6.0}
LOG_SCALE_RATIO = 30  # x values spanning more than this factor are drawn on a log axis


def what_if_scatter(points: list[dict], *, x_label: str, y_label: str) -> dict:
    """Geometry of the what-if plot: one mark per row at (x, y), each `point` a dict with index,
    x, y (None: not plotted), kind (chosen, direct, ok, reference, infeasible), label and reason;
    axes with ticks; the chosen and direct rows labelled where the label covers no other mark."""
    plotted = [p for p in points if p["x"] is not None and p["y"] is not None]
    left, top = SCATTER_MARGIN["left"], SCATTER_MARGIN["top"]
    plot_w = SCATTER_WIDTH - left - SCATTER_MARGIN["right"]
    plot_h = SCATTER_HEIGHT - top - SCATTER_MARGIN["bottom"]
    xs = [float(p["x"]) for p in plotted] or [1.0]
    ys = [float(p["y"]) for p in plotted] or [1.0]
    log_x = min(xs) >= 1e-6 and max(xs) / min(xs) > LOG_SCALE_RATIO
    if log_x:
        lo_exp, hi_exp = math.floor(math.log10(min(xs))), math.ceil(math.log10(max(xs)))
        hi_exp = max(hi_exp, lo_exp + 1)
        x_ticks = [10.0 ** e for e in range(lo_exp, hi_exp + 1)]
        x_lo, x_hi = x_ticks[0], x_ticks[-1]

        def x_px(v: float) -> float:
            return left + (math.log10(v) - math.log10(x_lo)) / (math.log10(x_hi) - math.log10(x_lo)) * plot_w
    else:
        x_ticks = _nice_ticks(max(xs))
        x_lo, x_hi = 0.0, x_ticks[-1]

        def x_px(v: float) -> float:
            return left + (v - x_lo) / (x_hi - x_lo) * plot_w
    y_ticks = _nice_ticks(max(ys))
    y_hi = y_ticks[-1]

    def y_px(v: float) -> float:
        return top + plot_h - v / y_hi * plot_h

    order = {"infeasible": 0, "reference": 1, "ok": 2, "direct": 3, "chosen": 4}  # chosen drawn last, on top
    marks = []
    for p in sorted(plotted, key=lambda p: order.get(p["kind"], 2)):
        marks.append({**p, "cx": round(x_px(float(p["x"])), 2), "cy": round(y_px(float(p["y"])), 2),
                      "r": MARK_RADIUS.get(p["kind"], 5.0)})
    bounds = (left, top, left + plot_w, top + plot_h)
    labels: list[dict] = []
    for mark in sorted((m for m in marks if m.get("tag")), key=lambda m: m["kind"] != "chosen"):
        labels.append(_place_label(mark, marks, labels, bounds))
    return {
        "width": SCATTER_WIDTH, "height": SCATTER_HEIGHT, "left": left, "top": top, "plot_w": plot_w,
        "plot_h": plot_h, "log_x": log_x, "x_label": x_label, "y_label": y_label,
        "x_ticks": [{"value": v, "px": round(x_px(v), 2), "text": _tick_text(v)} for v in x_ticks],
        "y_ticks": [{"value": v, "px": round(y_px(v), 2), "text": _tick_text(v)} for v in y_ticks],
        "marks": marks, "labels": labels, "unplotted": [p for p in points if p not in plotted],
    }


def _nice_ticks(top: float, count: int = 5) -> list[float]:
    """0 and the round steps (1, 2 or 5 × 10^k) up to the first at or above `top`."""
    if not top >= 1e-9:  # nothing (or next to nothing) to scale: a unit axis
        return [0.0, 1.0]
    raw = top / count
    base = 10.0 ** math.floor(math.log10(raw))
    step = next(m * base for m in (1, 2, 5, 10) if m * base >= raw)
    n = math.ceil(top / step - 1e-9)
    return [float(f"{i * step:.12g}") for i in range(max(n, 1) + 1)]  # 0.1 × 3 prints as 0.3


def _tick_text(v: float) -> str:
    if v >= 1000:
        return f"{v:,.0f}"
    return f"{v:g}"


def _place_label(mark: dict, marks: list[dict], placed: list[dict], bounds: tuple[float, float, float, float]
                 ) -> dict:
    """The first of right, left, above, below of `mark` (then its corners) where the label's box
    stays inside the plot and covers no other mark and no label already placed; else the one
    covering fewest."""
    text = mark["tag"]
    w, h = len(text) * LABEL_CHAR_PX, LABEL_FONT_PX + 2
    cx, cy, r = mark["cx"], mark["cy"], mark["r"]
    gap = r + 4
    diagonal = gap * 0.7
    candidates = [  # (anchor, text x, baseline y, box left, box top)
        ("start", cx + gap, cy + h / 2 - 3, cx + gap, cy - h / 2),
        ("end", cx - gap, cy + h / 2 - 3, cx - gap - w, cy - h / 2),
        ("middle", cx, cy - gap - 3, cx - w / 2, cy - gap - h),
        ("middle", cx, cy + gap + h - 3, cx - w / 2, cy + gap),
        ("start", cx + diagonal, cy - diagonal - 3, cx + diagonal, cy - diagonal - h),  # the corners, for a
        ("end", cx - diagonal, cy - diagonal - 3, cx - diagonal - w, cy - diagonal - h),  # mark in one
        ("start", cx + diagonal, cy + diagonal + h - 3, cx + diagonal, cy + diagonal),
        ("end", cx - diagonal, cy + diagonal + h - 3, cx - diagonal - w, cy + diagonal),
    ]
    best, best_cost = None, math.inf
    for anchor, tx, ty, bx, by in candidates:
        box = (bx, by, bx + w, by + h)
        cost = 0
        if box[0] < bounds[0] or box[1] < bounds[1] - 8 or box[2] > bounds[2] + 16 or box[3] > bounds[3]:
            cost += 100
        cost += sum(_box_hits_circle(box, m["cx"], m["cy"], m["r"] + 1) for m in marks if m is not mark)
        cost += 10 * sum(_boxes_overlap(box, lab["box"]) for lab in placed)
        if cost < best_cost:
            best, best_cost = {"text": text, "x": round(tx, 2), "y": round(ty, 2), "anchor": anchor,
                               "box": tuple(round(v, 2) for v in box), "kind": mark["kind"]}, cost
        if cost == 0:
            break
    assert best is not None
    return best


def _box_hits_circle(box: tuple, cx: float, cy: float, r: float) -> bool:
    nx, ny = min(max(cx, box[0]), box[2]), min(max(cy, box[1]), box[3])
    return (nx - cx) ** 2 + (ny - cy) ** 2 < r * r


def _boxes_overlap(a: tuple, b: tuple) -> bool:
    return a[0] < b[2] and b[0] < a[2] and a[1] < b[3] and b[1] < a[3]
