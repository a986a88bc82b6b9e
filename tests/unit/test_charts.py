"""The what-if plot's geometry (kvtune.deploy.charts.what_if_scatter) on any rows: every mark
inside the plot area at its value on the axes drawn, ticks spanning the values, and the chosen and
direct rows' labels inside the picture (tests/integration/test_report_html_layout.py checks the laid-out page)."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from kvtune.deploy.charts import LABEL_CHAR_PX, what_if_scatter

values = st.one_of(st.none(), st.floats(min_value=0, max_value=1e7, allow_nan=False))
rows = st.lists(st.tuples(values, st.floats(min_value=0, max_value=1e6, allow_nan=False),
                          st.sampled_from(["ok", "reference", "infeasible"])), min_size=1, max_size=45)


def points(drawn: list) -> list[dict]:
    out = []
    for i, (x, y, kind) in enumerate(drawn, 1):
        tag = "chosen (#1)" if i == 1 else "direct to vLLM (#2)" if i == 2 else None
        out.append({"index": str(i), "x": x, "y": y, "kind": "chosen" if i == 1 else kind, "tag": tag,
                    "label": f"row {i}", "reason": "", "title": f"row {i}"})
    return out


@settings(max_examples=200, deadline=None)
@given(rows)
def test_every_mark_is_inside_the_plot_at_its_value(drawn):
    plot = what_if_scatter(points(drawn), x_label="TTFT p99 (ms)", y_label="output tokens/s")
    left, top, w, h = plot["left"], plot["top"], plot["plot_w"], plot["plot_h"]
    plotted = [p for p in points(drawn) if p["x"] is not None]
    assert len(plot["marks"]) == len(plotted)
    assert [u["index"] for u in plot["unplotted"]] == [p["index"] for p in points(drawn) if p["x"] is None]
    xt, yt = plot["x_ticks"], plot["y_ticks"]
    for m in plot["marks"]:
        assert left - 1e-6 <= m["cx"] <= left + w + 1e-6 and top - 1e-6 <= m["cy"] <= top + h + 1e-6
        fx = (lambda v: math.log10(v)) if plot["log_x"] else (lambda v: v)
        share = (fx(m["x"]) - fx(xt[0]["value"])) / (fx(xt[-1]["value"]) - fx(xt[0]["value"]))
        assert math.isclose(m["cx"], xt[0]["px"] + share * (xt[-1]["px"] - xt[0]["px"]), abs_tol=0.02)
        assert math.isclose(m["cy"], yt[0]["px"] + m["y"] / yt[-1]["value"] * (yt[-1]["px"] - yt[0]["px"]),
                            abs_tol=0.02)
    if drawn[0][0] is not None:  # the chosen row is drawn last, on top of any mark it meets
        assert plot["marks"][-1]["kind"] == "chosen"


@settings(max_examples=200, deadline=None)
@given(rows)
def test_the_labels_stay_inside_the_picture_beside_their_marks(drawn):
    plot = what_if_scatter(points(drawn), x_label="TTFT p99 (ms)", y_label="output tokens/s")
    tagged = {m["tag"]: m for m in plot["marks"] if m.get("tag")}
    assert sorted(lab["text"] for lab in plot["labels"]) == sorted(tagged)
    for lab in plot["labels"]:
        x0, y0, x1, y1 = lab["box"]
        assert 0 <= x0 and x1 <= plot["width"] and 0 <= y0 and y1 <= plot["height"], lab
        assert math.isclose(x1 - x0, len(lab["text"]) * LABEL_CHAR_PX)
        mark = tagged[lab["text"]]
        nearest_x = min(max(mark["cx"], x0), x1)
        nearest_y = min(max(mark["cy"], y0), y1)
        assert math.hypot(nearest_x - mark["cx"], nearest_y - mark["cy"]) <= mark["r"] + 20
