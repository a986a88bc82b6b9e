"""`kvtune recommend --objective` on the command line: the what-if table in every output, the
infeasible case (exit 1, nothing written), one-line usage errors (exit 2), and `check` on what it
wrote."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from objective_logs import CPU_CAPACITY, MODEL, objective_log

from kvtune.cli import cli


@pytest.fixture(scope="module")
def log(tmp_path_factory) -> str:
    return objective_log(tmp_path_factory.mktemp("logs") / "log.jsonl")


def recommend(log: str, *args: str):
    # a wide terminal, so that the table's cells are not folded
    return CliRunner(env={"COLUMNS": "200"}).invoke(cli, ["recommend", log, "--model", MODEL, "--capacity", CPU_CAPACITY,
                                                          "--requests", "300", *args], catch_exceptions=False)


def test_the_table_in_the_terminal(log):
    result = recommend(log, "--objective", "throughput", "--concurrency", "32", "--max-preemption-rate", "0.01")
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert "What if (simulated)" in out and "▶ chosen" in out
    assert "direct (vLLM defaults)" in out and "whole context" in out
    assert "✗ preemption rate" in out  # direct to vLLM preempts 32 clients on 31 blocks
    assert "objective: the most output tokens/s within preemption rate ≤ 1.0%, answers truncated by the caps ≤ " in out
    assert "%, at 32 concurrent clients" in out
    assert "× direct to vLLM's" in out  # the headline compares with direct ...
    assert "concurrent requests for the logged route mix" not in out  # ... instead of the worst-case ratio


def test_compare_engines_shows_a_row_per_engine(log):
    result = CliRunner(env={"COLUMNS": "250"}).invoke(cli, [
        "recommend", log, "--model", MODEL, "--capacity", CPU_CAPACITY, "--requests", "100", "--objective",
        "throughput", "--concurrency", "16", "--compare-engines"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    for label in ("SGLang as rendered (ratio pinned at 1 by the env kvtune renders)", "SGLang (defaults)",
                  "TensorRT-LLM GUARANTEED_NO_EVICT", "TensorRT-LLM MAX_UTILIZATION"):
        assert label in result.stdout, label


def test_the_table_in_json_report_and_recommendation(log, tmp_path):
    out = tmp_path / "deploy"
    result = recommend(log, "--objective", "throughput", "--concurrency", "32", "--max-preemption-rate", "0.01",
                       "--out", str(out), "--json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    rows = doc["recommendation"]["what_if"]
    kinds = [r["policy"]["kind"] for r in rows]
    assert kinds[0] == "direct" and kinds[-1] == "worst-case"
    assert list(dict.fromkeys(kinds[1:-1])) == ["guaranteed", "statistical", "overcommit"]
    assert doc["recommendation"]["objective"]["seeds"] == 3
    [chosen] = [r for r in rows if r["chosen"]]
    assert chosen["feasible"] and not chosen["reference"] and chosen["why"].startswith("chosen: ")
    assert doc["recommendation"]["objective"]["kind"] == "throughput"
    assert doc["recommendation"]["objective"]["load"] == {"rate_rps": None, "concurrency": 32, "from": "option"}
    assert json.loads((out / "recommendation.json").read_text())["what_if"] == rows
    md = (out / "report.md").read_text()
    assert "## What if (simulated)" in md and "**▶ chosen**" in md and "✗ preemption rate" in md
    assert md.count("\n| ") >= len(rows)
    html = (out / "report.html").read_text()
    assert '<table class="whatif">' in html and '<tr class="chosen">' in html
    assert html.count("<tr") >= len(rows)
    assert "concurrent requests gained" not in html
    # check reads the objective back from recommendation.json and simulates the files
    checked = CliRunner().invoke(cli, ["check", str(out / "recommendation.json"), "--model", MODEL, "--deployed",
                                       str(out / "vllm-serve.sh"), "--deployed", str(out / "gateway.yaml")])
    assert checked.exit_code == 0, checked.output
    assert "objective-met" in checked.stdout
    alone = CliRunner().invoke(cli, ["check", str(out / "recommendation.json"), "--model", MODEL, "--deployed",
                                     str(out / "vllm-serve.sh")])
    assert alone.exit_code == 1 and "RISK objective-missed: simulated preemption rate" in alone.stdout


def test_goodput_shows_its_column(log):
    result = recommend(log, "--objective", "goodput", "--slo", "ttft=500", "--concurrency", "16")
    assert result.exit_code == 0, result.output
    assert "goodput" in result.stdout and "the most goodput (req/s within the SLO)" in result.stdout


def test_no_feasible_configuration_exits_1_and_writes_nothing(log, tmp_path):
    out = tmp_path / "deploy"
    result = recommend(log, "--objective", "throughput", "--concurrency", "128", "--max-429-share", "0",
                       "--max-preemption-rate", "0", "--out", str(out))
    assert result.exit_code == 1
    assert "What if (simulated)" in result.stdout and "✗ 429 share" in result.stdout
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: no configuration meets the objective: of ")
    assert not out.exists()
    as_json = recommend(log, "--objective", "throughput", "--concurrency", "128", "--max-429-share", "0",
                        "--max-preemption-rate", "0", "--json")
    assert as_json.exit_code == 1
    doc = json.loads(as_json.stdout)
    assert doc["recommendation"] is None and not any(r["chosen"] for r in doc["what_if"])
    assert "traffic" not in doc["objective"]


def test_a_seed_gives_the_same_output(log):
    # the last --requests wins: 100 a run (what a seed fixes does not depend on how many)
    args = ("--objective", "throughput", "--concurrency", "24", "--seed", "5", "--requests", "100", "--json")
    first, second = recommend(log, *args), recommend(log, *args)
    assert first.exit_code == 0 and first.stdout == second.stdout


def test_without_an_objective_nothing_is_simulated(log):
    result = recommend(log, "--json")
    assert result.exit_code == 0, result.output
    rec = json.loads(result.stdout)["recommendation"]
    assert "what_if" not in rec and "objective" not in rec


@pytest.mark.parametrize(("args", "line"), [
    # offline (issue 27 item 3): no capacity file is kvtune's estimate, which needs a GPU
    (("--objective", "throughput", "--no-capacity"), "Error: --gpu: give --gpu or --gpu-memory to estimate, or a "
     "measured capacity (--kv-tokens, --vllm-log, --metrics-url, `capacity_file`)"),
    (("--slo", "e2e=500"), "Error: --slo: without --objective, bounds max_num_seqs by tpot and ttft (the step-time "
     "model's); e2e needs --objective goodput, which simulates it"),
    (("--max-preemption-rate", "0.1"), "Error: --max-preemption-rate: only applies with --objective throughput|goodput"),
    (("--compare-engines",), "Error: --compare-engines: only applies with --objective throughput|goodput"),
    (("--objective", "goodput", "--rate", "5"), "Error: --slo: the goodput objective needs latency objectives, e.g. "
     "--slo ttft=500,e2e=10000"),
    (("--objective", "throughput", "--rate", "5", "--concurrency", "4"),
     "Error: --concurrency: give a rate or a concurrency, not both"),
    (("--objective", "throughput", "--max-preemption-rate", "1.5"),
     "Error: --max-preemption-rate: must be a share between 0 and 1, got 1.5"),
    (("--objective", "throughput", "--max-429-share", "nan"), "Error: --max-429-share: must be a share between 0 and 1, got nan"),
    (("--objective", "throughput", "--rate", "-2"), "Error: --rate: must be a positive number of requests per second, got -2"),
    (("--objective", "throughput", "--concurrency", "0"), "Error: --concurrency: must be at least 1, got 0"),
    (("--objective", "throughput", "--requests", "0"), "Error: --requests: must be from 1 to 100,000, got 0"),
    (("--objective", "throughput", "--slo", "ttft=fast"), "Error: --slo: ttft: expected milliseconds, got 'fast'"),
])
def test_bad_inputs_are_one_line_exit_2(log, args, line):
    argv = ["recommend", log, "--model", MODEL]
    if "--no-capacity" not in args:
        argv += ["--capacity", CPU_CAPACITY]
    result = CliRunner().invoke(cli, [*argv, *(a for a in args if a != "--no-capacity")])
    assert result.exit_code == 2, result.output
    assert result.stderr.strip().splitlines() == [line]


def test_logs_without_timestamps_need_a_load(tmp_path):
    untimed = objective_log(tmp_path / "untimed.jsonl", timestamps=False)
    result = CliRunner().invoke(cli, ["recommend", untimed, "--model", MODEL, "--capacity", CPU_CAPACITY,
                                      "--objective", "throughput"])
    assert result.exit_code == 2
    assert result.stderr.strip().splitlines() == [
        "Error: --rate: the logs carry no timestamps to take an arrival rate from: give --rate RPS or --concurrency N"]


def test_flow_control_rows_beside_each_fifo_row(log, tmp_path):
    """recommend --objective --flow-control (issue 29): every gateway row of the grid is simulated
    twice, with today's FIFO queue and with the flow-control queue it renders, side by side."""
    result = recommend(log, "--objective", "goodput", "--slo", "ttft=2000,e2e=20000", "--flow-control", "--rate",
                       "6", "--out", str(tmp_path / "deploy"), "--json")
    assert result.exit_code in (0, 1), result.output
    rows = json.loads(result.stdout)["recommendation"]["what_if"]
    fifo = [r for r in rows if r["policy"]["kind"] in ("guaranteed", "statistical", "overcommit")
            and not r["policy"].get("flow_control")]
    flow = [r for r in rows if r["policy"].get("flow_control")]
    assert fifo and len(flow) == len(fifo)
    assert all(r["predicted"]["goodput_rps"] is not None for r in flow)
    assert {r["policy"]["kind"] for r in flow} == {r["policy"]["kind"] for r in fifo}
