"""report.html in a real browser (issue #25, item 12): laid out by headless Chromium, no table
cell overflows, no name is broken mid-word, the rendered launch command is shown, and a
3-replica deployment is titled as one ("3 replicas × L40S × 1")."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from chromium import layout, require_chromium
from click.testing import CliRunner
from objective_logs import CPU_CAPACITY, MODEL, objective_log

from kvtune.cli import cli

REPO = Path(__file__).resolve().parents[2]


def recommend_out(out: Path, *args: str) -> Path:
    result = CliRunner().invoke(cli, ["recommend", *args, "--out", str(out)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return out / "report.html"


@pytest.fixture(scope="module")
def replicas_report(tmp_path_factory) -> Path:
    require_chromium()
    return recommend_out(tmp_path_factory.mktemp("l40s") / "deploy", str(REPO / "sample_logs"), "--model",
                         "llama-3.1-8b", "--gpu", "L40S", "--replicas", "3")


@pytest.mark.parametrize("width", [1280, 760])
def test_no_cell_overflows_and_no_word_is_broken(replicas_report, width):
    page = layout(replicas_report, width)
    assert page["cells"] > 20
    assert page["overflowed"] == []
    assert page["broken"] == []


def test_the_title_counts_the_replicas(replicas_report):
    page = layout(replicas_report, 1280)
    assert page["h1"] == "kvtune recommendation: llama-3.1-8b on 3 replicas × L40S × 1"
    assert page["title"] == "kvtune: llama-3.1-8b on 3 replicas × L40S × 1"


def test_the_rendered_command_is_shown(replicas_report):
    page = layout(replicas_report, 1280)
    script = (replicas_report.parent / "vllm-serve.sh").read_text()
    command = script[script.index("exec vllm serve"):].strip()
    assert page["commands"] == [command]
    assert f"```\n{command}\n```" in (replicas_report.parent / "report.md").read_text()
    assert "--max-num-seqs" in command and "--gpu-memory-utilization" in command


def test_the_what_if_table_fits_its_cells(tmp_path):
    require_chromium()
    log = objective_log(tmp_path / "log.jsonl")
    report = recommend_out(tmp_path / "deploy", log, "--model", MODEL, "--capacity", CPU_CAPACITY, "--objective",
                           "throughput", "--concurrency", "32", "--requests", "100", "--max-preemption-rate", "0.01")
    page = layout(report, 1280)
    assert "whatif" in report.read_text() and page["cells"] > 100
    assert page["overflowed"] == [] and page["broken"] == []
    assert page["h1"] == "kvtune recommendation: llama-3.1-8b on the given GPU memory × 1"


# Measures the what-if plot in the laid-out page (issue #27 item 3): each mark's centre and
# radius, each tick's position and value, the plot area, the labels' boxes, the greyed rows'
# list and where it sits, all in CSS pixels as Chromium drew them.
PLOT_PROBE = r"""
<script>
(() => {
  const box = el => { const r = el.getBoundingClientRect(); return {x: r.left, y: r.top, w: r.width, h: r.height}; };
  const svg = document.querySelector("svg.whatif-plot");
  const out = {svg: svg ? box(svg) : null, area: null, marks: [], labels: [], x_ticks: [], y_ticks: [],
               x_title: "", greyed: [], greyed_box: null, rows: []};
  if (svg) {
    out.area = box(svg.querySelector("rect.plot-area"));
    out.x_title = svg.querySelector("text.axis-title").textContent;
    for (const c of svg.querySelectorAll("circle.mark")) {
      const b = box(c);
      out.marks.push({index: c.dataset.index, kind: c.getAttribute("class").replace("mark ", ""),
                      x: parseFloat(c.dataset.x), y: parseFloat(c.dataset.y), cx: b.x + b.w / 2, cy: b.y + b.h / 2,
                      r: b.w / 2, fill: getComputedStyle(c).fill, title: c.querySelector("title").textContent});
    }
    for (const t of svg.querySelectorAll("text.mark-label")) out.labels.push({text: t.textContent, ...box(t)});
    for (const [name, cls] of [["x_ticks", "x-tick"], ["y_ticks", "y-tick"]]) {
      for (const t of svg.querySelectorAll("text." + cls)) {
        const b = box(t);
        out[name].push({value: parseFloat(t.dataset.value), cx: b.x + b.w / 2, cy: b.y + b.h / 2});
      }
    }
  }
  const greyed = document.querySelector("ul.greyed");
  if (greyed) {
    out.greyed_box = box(greyed);
    out.greyed = [...greyed.querySelectorAll("li")].map(li => li.textContent);
  }
  for (const tr of document.querySelectorAll("table.whatif tbody tr")) {
    out.rows.push([...tr.querySelectorAll("td")].map(td => td.textContent));
  }
  const pre = document.createElement("pre");
  pre.id = "kvtune-layout";
  pre.textContent = JSON.stringify(out);
  document.body.appendChild(pre);
})();
</script>
"""


@pytest.fixture(scope="module")
def what_if_report(tmp_path_factory) -> Path:
    require_chromium()
    tmp = tmp_path_factory.mktemp("whatif")
    log = objective_log(tmp / "log.jsonl")
    return recommend_out(tmp / "deploy", log, "--model", MODEL, "--capacity", CPU_CAPACITY, "--objective",
                         "throughput", "--concurrency", "32", "--requests", "100", "--max-preemption-rate", "0.01")


@pytest.fixture(scope="module")
def goodput_report(tmp_path_factory) -> Path:
    require_chromium()
    tmp = tmp_path_factory.mktemp("goodput")
    log = objective_log(tmp / "log.jsonl")
    return recommend_out(tmp / "deploy", log, "--model", MODEL, "--capacity", CPU_CAPACITY, "--objective",
                         "goodput", "--slo", "ttft=1500,e2e=20000", "--concurrency", "32", "--requests", "100")


@pytest.fixture(scope="module")
def plot_layout(request):
    """PLOT_PROBE's measures of a report fixture at a width, each laid out once per module."""
    cache: dict = {}

    def measure(report: str, width: int) -> tuple[Path, dict]:
        if (report, width) not in cache:
            page = request.getfixturevalue(report)
            cache[report, width] = page, layout(page, width, PLOT_PROBE)
        return cache[report, width]
    return measure


def _on_axis(value: float, ticks: list[dict], key: str, log: bool) -> float:
    """Where `value` falls in pixels on an axis drawn through its first and last tick."""
    first, last = ticks[0], ticks[-1]
    f = (lambda v: math.log10(v)) if log else (lambda v: v)
    share = (f(value) - f(first["value"])) / (f(last["value"]) - f(first["value"]))
    return first[key] + share * (last[key] - first[key])


def _overlaps(a: dict, b: dict) -> bool:
    return a["x"] < b["x"] + b["w"] and b["x"] < a["x"] + a["w"] and a["y"] < b["y"] + b["h"] and b["y"] < a["y"] + a["h"]


@pytest.mark.parametrize(("report", "width"), [("what_if_report", 1280), ("what_if_report", 760),
                                               ("goodput_report", 1280)])
def test_the_what_if_plot_draws_every_row_where_its_numbers_say(plot_layout, report, width):
    """Output tok/s against TTFT p99, or against goodput when that is the objective."""
    what_if_report, page = plot_layout(report, width)
    assert page["console"] == []
    rec = json.loads((what_if_report.parent / "recommendation.json").read_text())
    rows = rec["what_if"]
    goodput = rec["objective"]["kind"] == "goodput"
    assert page["svg"] is not None and len(page["marks"]) == len(rows) > 20
    by_index = {int(m["index"]): m for m in page["marks"]}
    assert sorted(by_index) == list(range(1, len(rows) + 1))
    log_x = "log scale" in page["x_title"]
    assert page["x_title"].startswith("goodput (requests/s within --slo)" if goodput else "TTFT p99 (ms)")
    area = page["area"]
    for i, row in enumerate(rows, 1):
        mark = by_index[i]
        ttft = row["predicted"]["goodput_rps" if goodput else "ttft_ms"]
        ttft = ttft if goodput else ttft["p99"]
        tokens = row["predicted"]["output_tokens_per_s"]
        assert mark["x"] == pytest.approx(ttft) and mark["y"] == pytest.approx(tokens)
        # in the laid-out page, the mark's centre is where the axes' ticks put its numbers
        assert mark["cx"] == pytest.approx(_on_axis(ttft, page["x_ticks"], "cx", log_x), abs=1.5), (i, row)
        assert mark["cy"] == pytest.approx(_on_axis(tokens, page["y_ticks"], "cy", False), abs=1.5), (i, row)
        assert area["x"] - 1 <= mark["cx"] <= area["x"] + area["w"] + 1
        assert area["y"] - 1 <= mark["cy"] <= area["y"] + area["h"] + 1
        expected = "chosen" if row["chosen"] else "infeasible" if not row["feasible"] else None
        if expected is not None:
            assert mark["kind"] == expected, (i, row)
        else:
            assert mark["kind"] in ("ok", "reference", "direct")
        if not row["feasible"]:
            assert mark["fill"] == "rgb(201, 206, 212)"  # greyed
    chosen = next(i for i, r in enumerate(rows, 1) if r["chosen"])
    assert by_index[chosen]["fill"] == "rgb(10, 125, 56)"
    assert "▶ chosen" in page["rows"][chosen - 1][-1]


@pytest.mark.parametrize("width", [1280, 760])
def test_the_chosen_and_direct_rows_are_labelled_clear_of_the_marks(plot_layout, width):
    what_if_report, page = plot_layout("what_if_report", width)
    rows = json.loads((what_if_report.parent / "recommendation.json").read_text())["what_if"]
    chosen = next(i for i, r in enumerate(rows, 1) if r["chosen"])
    direct = next(i for i, r in enumerate(rows, 1) if r["policy"]["kind"] == "direct")
    labels = {lab["text"]: lab for lab in page["labels"]}
    assert sorted(labels) == sorted([f"chosen (#{chosen})", f"direct to vLLM (#{direct})"])
    svg = page["svg"]
    for text, lab in labels.items():
        assert svg["x"] <= lab["x"] and lab["x"] + lab["w"] <= svg["x"] + svg["w"] + 1, text
        assert svg["y"] <= lab["y"] and lab["y"] + lab["h"] <= svg["y"] + svg["h"], text
        own = chosen if text.startswith("chosen") else direct
        covered = [m["index"] for m in page["marks"] if int(m["index"]) != own
                   and _overlaps(lab, {"x": m["cx"] - m["r"], "y": m["cy"] - m["r"], "w": 2 * m["r"], "h": 2 * m["r"]})]
        assert covered == [], (text, covered)
        mark = next(m for m in page["marks"] if int(m["index"]) == own)
        gap = max(lab["x"] - (mark["cx"] + mark["r"]), (mark["cx"] - mark["r"]) - (lab["x"] + lab["w"]),
                  lab["y"] - (mark["cy"] + mark["r"]), (mark["cy"] - mark["r"]) - (lab["y"] + lab["h"]))
        assert -1 <= gap <= 16, (text, gap)  # beside its own mark, not across the plot
    first, second = labels.values()
    assert not _overlaps(first, second)


def test_the_greyed_rows_are_listed_with_their_reasons_below_the_plot(plot_layout):
    what_if_report, page = plot_layout("what_if_report", 1280)
    rows = json.loads((what_if_report.parent / "recommendation.json").read_text())["what_if"]
    table = {int(cells[0]): cells for cells in page["rows"]}
    infeasible = [i for i, r in enumerate(rows, 1) if not r["feasible"]]
    assert infeasible and len(page["greyed"]) == len(infeasible)
    for item, i in zip(page["greyed"], infeasible, strict=True):
        verdict = table[i][-1]  # the table's verdict cell, "✗ " and the constraints broken
        assert verdict.startswith("✗ ")
        assert item.startswith(f"#{i} ") and item.endswith(f": {verdict[2:]}"), (item, verdict)
    assert page["greyed_box"]["y"] >= page["svg"]["y"] + page["svg"]["h"]  # the reasons sit below, not on, the marks
