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
