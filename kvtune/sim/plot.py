"""KV use and running/waiting requests over simulated time: a terminal sparkline and an SVG.

Pure: a StepSeries in, text out (the CLI prints or writes it). Time is cut into equal buckets;
each bucket shows the peak of what the steps starting in it saw, so a short spike stays visible.
"""

from __future__ import annotations

from dataclasses import dataclass
from html import escape

import numpy as np

from kvtune.sim.results import StepSeries

BARS = "▁▂▃▄▅▆▇█"


@dataclass(frozen=True, slots=True)
class Timeline:
    """Peaks per time bucket: KV use (0..1), running and waiting requests."""

    end_s: float
    kv_use: np.ndarray
    running: np.ndarray
    waiting: np.ndarray


def timeline(steps: StepSeries, *, usable_blocks: int, end_s: float, buckets: int = 60) -> Timeline:
    """Bucket peaks over [0, end_s]; an empty bucket (idle engine) shows 0."""
    end = max(end_s, 1e-9)
    which = np.minimum((steps.start_s / end * buckets).astype(np.int64), buckets - 1)

    def peak(values: np.ndarray) -> np.ndarray:
        out = np.zeros(buckets)
        np.maximum.at(out, which, values.astype(np.float64))
        return out

    return Timeline(end, peak(steps.blocks_used) / max(usable_blocks, 1), peak(steps.running), peak(steps.waiting))


def sparkline(values: np.ndarray, top: float) -> str:
    """One character per value, scaled to `top`."""
    scale = max(top, 1e-12)
    idx = np.clip(np.ceil(values / scale * len(BARS)).astype(np.int64) - 1, 0, len(BARS) - 1)
    return "".join(" " if v <= 0 else BARS[i] for v, i in zip(values.tolist(), idx.tolist(), strict=True))


def terminal_lines(t: Timeline) -> list[str]:
    """Three labelled sparklines and the time axis."""
    top = max(float(t.running.max(initial=0)), float(t.waiting.max(initial=0)), 1.0)
    return [
        f"KV use   {sparkline(t.kv_use, 1.0)} peak {t.kv_use.max(initial=0):.0%}",
        f"running  {sparkline(t.running, top)} peak {int(t.running.max(initial=0))}",
        f"waiting  {sparkline(t.waiting, top)} peak {int(t.waiting.max(initial=0))}",
        f"         0 s{'':>{max(len(t.kv_use) - 8, 1)}}{t.end_s:.1f} s",
    ]


def svg(t: Timeline, *, title: str, width: int = 720, height: int = 360) -> str:
    """Two panels sharing the time axis: KV use (%), then running and waiting requests."""
    pad_l, pad_r, pad_t, gap = 56, 16, 28, 36
    panel_h = (height - pad_t - gap - 28) / 2
    inner_w = width - pad_l - pad_r
    n = len(t.kv_use)
    xs = [pad_l + inner_w * (i + 0.5) / n for i in range(n)]

    def line(values: np.ndarray, top: float, y0: float, color: str) -> str:
        pts = " ".join(f"{x:.1f},{y0 + panel_h - panel_h * v / max(top, 1e-12):.1f}"
                       for x, v in zip(xs, values.tolist(), strict=True))
        return f'<polyline fill="none" stroke="{color}" stroke-width="1.5" points="{pts}"/>'

    def frame(y0: float, label: str, top_label: str) -> str:
        return (f'<rect x="{pad_l}" y="{y0:.1f}" width="{inner_w}" height="{panel_h:.1f}" fill="none" '
                f'stroke="#999"/><text x="{pad_l - 6}" y="{y0 + 10:.1f}" text-anchor="end">{escape(top_label)}</text>'
                f'<text x="{pad_l - 6}" y="{y0 + panel_h:.1f}" text-anchor="end">0</text>'
                f'<text x="{pad_l + 6}" y="{y0 + 14:.1f}">{escape(label)}</text>')

    top = max(float(t.running.max(initial=0)), float(t.waiting.max(initial=0)), 1.0)
    y1, y2 = pad_t, pad_t + panel_h + gap
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" '
        'font-size="11">',
        f'<text x="{pad_l}" y="16" font-size="13">{escape(title)}</text>',
        frame(y1, "KV cache use", "100%"), line(t.kv_use, 1.0, y1, "#c0392b"),
        frame(y2, "running (blue), waiting (orange)", f"{top:g}"),
        line(t.running, top, y2, "#2c6fbb"), line(t.waiting, top, y2, "#e67e22"),
        f'<text x="{pad_l}" y="{height - 8}">0 s</text>',
        f'<text x="{width - pad_r}" y="{height - 8}" text-anchor="end">{t.end_s:.1f} s (simulated)</text>',
        "</svg>",
    ]
    return "\n".join(parts) + "\n"


__all__ = ["Timeline", "timeline", "sparkline", "terminal_lines", "svg"]
