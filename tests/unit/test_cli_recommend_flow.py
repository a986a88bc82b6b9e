"""`recommend --flow-control` (issue #29): gateway.yaml gets the flow-control queue
(docs/guides/flow-control.md) instead of the FIFO one, its bands' deadlines from --slo and its
per-token time from the predicted TPOT of the rendered batch; the file loads back in the gateway."""

from __future__ import annotations

import json
from pathlib import Path

import yaml
from click.testing import CliRunner

from kvtune.cli import cli
from kvtune.gateway.config import load_gateway_config
from kvtune.policy import rules

REPO = Path(__file__).resolve().parents[2]
ARGS = [str(REPO / "sample_logs"), "--model", "llama-3.1-8b", "--gpu", "H100-80GB"]


def run(*args: str):
    return CliRunner().invoke(cli, ["recommend", *ARGS, *args], catch_exceptions=False)


def test_flow_control_renders_bands_from_the_slo_and_the_predicted_tpot(tmp_path):
    result = run("--slo", "ttft=2000,tpot=50,e2e=30000", "--flow-control", "--out", str(tmp_path), "--json")
    assert result.exit_code == 0, result.output
    settings = json.loads((tmp_path / "recommendation.json").read_text())["settings"]
    config = load_gateway_config(tmp_path / "gateway.yaml")
    flow = config.flow
    assert flow is not None and "queue" not in yaml.safe_load((tmp_path / "gateway.yaml").read_text())
    assert [(b.name, b.deadline_s) for b in flow.bands] == [("interactive", 2.0), ("batch", 30.0)]
    assert 0 < flow.token_time_s <= 0.05  # the rendered batch meets tpot=50
    assert flow.token_time_s == settings["gateway_flow_token_time_s"]["value"]
    assert flow.max_waiting == settings["gateway_flow_max_waiting"]["value"] >= 1
    assert flow.max_waiting_per_flow == -(-flow.max_waiting // 2)


def test_without_flow_control_the_fifo_queue_is_rendered(tmp_path):
    assert run("--slo", "ttft=2000", "--out", str(tmp_path)).exit_code == 0
    assert load_gateway_config(tmp_path / "gateway.yaml").flow is None
    assert "gateway_flow_max_waiting" not in json.loads((tmp_path / "recommendation.json").read_text())["settings"]


def test_flow_control_needs_a_ttft_objective(tmp_path):
    result = run("--flow-control", "--out", str(tmp_path))
    assert result.exit_code == 2 and "--flow-control" in result.stderr and "ttft" in result.stderr
    assert not (tmp_path / "gateway.yaml").exists()


def _two_band_logs(path: Path) -> Path:
    """sample_logs' Azure-style trace as kvtune JSONL, 3 requests in 10 on the route `interactive`,
    the rest on `batch` (the names recommend reads the bands from)."""
    import csv

    with open(REPO / "sample_logs" / "azure_style_trace.csv") as f, open(path, "w") as out:
        for i, row in enumerate(csv.DictReader(f)):
            out.write(json.dumps({"route": "interactive" if i % 10 < 3 else "batch", "model": "m",
                                  "prompt_tokens": int(row["ContextTokens"]),
                                  "output_tokens": int(row["GeneratedTokens"])}) + "\n")
    return path


def test_the_interactive_reserve_is_sized_from_its_traffic_and_routes_take_their_bands(tmp_path):
    logs = _two_band_logs(tmp_path / "two-band.jsonl")
    out = tmp_path / "out"
    result = CliRunner().invoke(cli, ["recommend", str(logs), "--model", "llama-3.1-8b", "--gpu", "H100-80GB",
                                      "--route-by", "route", "--route-header", "x-kvtune-route", "--slo",
                                      "ttft=2000,e2e=20000", "--flow-control", "--out", str(out)],
                                catch_exceptions=False)
    assert result.exit_code == 0, result.output
    rec = json.loads((out / "recommendation.json").read_text())
    reserve = rec["settings"]["gateway_flow_interactive_reserve_blocks"]
    assert reserve["rule"] == "flow-reserve-little" and "Little's law" in reserve["reason"]
    config = load_gateway_config(out / "gateway.yaml")
    assert config.flow is not None
    assert [b.reserve_blocks for b in config.flow.bands] == [reserve["value"], 0]
    budget = rec["budget_blocks"] if "budget_blocks" in rec else config.block_budget
    assert 0 < reserve["value"] < budget
    bands = {r.name: r.band for r in config.routes}
    assert (bands["interactive"], bands["batch"]) == ("interactive", "batch")
    assert all(band is None for name, band in bands.items() if name not in ("interactive", "batch"))
    assert "flow-reserve-little" in (out / "gateway.yaml").read_text()  # the reason, as a comment
    assert f"reserve_blocks = {reserve['value']} }}," in (out / "nginx.conf").read_text()


def test_without_a_batch_route_no_reserve_is_sized(tmp_path):
    result = run("--slo", "ttft=2000", "--flow-control", "--out", str(tmp_path))
    assert result.exit_code == 0, result.output
    reserve = json.loads((tmp_path / "recommendation.json").read_text())["settings"][
        "gateway_flow_interactive_reserve_blocks"]
    assert reserve["value"] == 0 and "no route named batch" in reserve["reason"]
    config = load_gateway_config(tmp_path / "gateway.yaml")
    assert config.flow is not None and config.flow.reserve_blocks == 0


def test_the_reserve_rule_is_littles_law_at_a_poisson_p99():
    assert rules.poisson_quantile(6.0, 0.99) == 12  # P(X <= 11) = 0.980, P(X <= 12) = 0.991
    assert rules.poisson_quantile(0.0, 0.99) == 0
    big = rules.poisson_quantile(10_000.0, 0.99)  # no underflow of e^-10000: about mean + 2.33 sd
    assert 10_220 <= big <= 10_245
    # 30 % of 20 requests/s, each holding 10 blocks for 1 s: 6 in service on average, 12 at p99
    d = rules.flow_reserve_blocks(0.3, 20.0, 1.0, 10.0, budget_blocks=1000, largest_batch_blocks=100)
    assert d.value == 120
    capped = rules.flow_reserve_blocks(0.3, 20.0, 1.0, 10.0, budget_blocks=200, largest_batch_blocks=100)
    assert capped.value == 100 and "capped" in capped.reason


def test_a_compute_bound_workloads_flow_control_rows_say_flow_control_cannot_help(tmp_path):
    """The Azure code trace (long prompts, short answers) at 36 requests/s on one H100: vLLM's own
    queue grows while KV has room, so the flow-control rows of the what-if table say the TTFT target
    is missed for compute, which no KV gate shortens (each by its own figures); no FIFO row does."""
    trace = REPO / "tests" / "data" / "traces" / "AzureLLMInferenceTrace_code.csv"
    result = CliRunner().invoke(cli, ["recommend", str(trace), "--model", "llama-3.1-8b", "--gpu", "H100-80GB",
                                      "--objective", "goodput", "--slo", "ttft=2000,e2e=20000", "--flow-control",
                                      "--rate", "36", "--requests", "200", "--json"], catch_exceptions=False)
    assert result.exit_code in (0, 1), result.output
    rows = json.loads(result.stdout)["recommendation"]["what_if"]
    noted = [r for r in rows if "compute-bound: vLLM queued up to" in r["why"]]
    assert len(noted) >= 3 and all(r["policy"].get("flow_control") for r in noted)
    for r in noted:
        p = r["predicted"]
        assert p["kv_peak_blocks"] < r["budget_blocks"] and 2 * p["waiting_peak"] >= p["running_peak"]
        assert p["ttft_ms"]["p99"] > 2000 and "no KV gate" in r["why"]
