"""report.html in a real browser (issue #25, item 12): laid out by headless Chromium, no table
cell overflows, no name is broken mid-word, the rendered launch command is shown, and a
3-replica deployment is titled as one ("3 replicas × L40S × 1")."""

from __future__ import annotations

from pathlib import Path

import pytest
from chromium import layout, require_chromium
from click.testing import CliRunner
from objective_logs import CPU_CAPACITY, MODEL, objective_log

from kvtune.cli import cli

REPO = Path(__file__).resolve().parents[1]


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
