"""`kvtune check` on the command line: exit 0 fine, 1 risky, 2 usage error; --json shape."""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner

from kvtune.cli import cli

DATA = Path(__file__).parents[1] / "data"
REPO = Path(__file__).resolve().parents[2]
REC = str(DATA / "recommendation.json")
GATEWAY = {"version": 1, "upstream": "http://127.0.0.1:8000", "block_size": 16, "block_budget": 26999,
           "max_model_len": 14512, "routes": [
               {"name": "chat", "match": {"path": "/v1/chat/completions"}, "max_new_tokens": 451},
               {"name": "completions", "match": {"path": "/v1/completions"}, "max_new_tokens": 700},
               {"name": "default", "max_new_tokens": 700}]}


def run(*args: str):
    return CliRunner().invoke(cli, ["check", *args], catch_exceptions=False)


def test_fine_gateway_exits_0(tmp_path):
    path = tmp_path / "gateway.yaml"
    path.write_text(json.dumps(GATEWAY))
    result = run(REC, "--model", "llama-3.1-8b", "--deployed", str(path))
    assert result.exit_code == 0, result.output
    assert result.output.splitlines()[-1] == f"passed: 0 risk, 0 warning(s) in {path}"


def test_risky_vllm_command_exits_1_with_json(tmp_path):
    path = tmp_path / "serve.sh"
    path.write_text("#!/bin/sh\nexec vllm serve meta-llama/Llama-3.1-8B --max-model-len 8192\n")
    result = run(REC, "--model", "llama-3.1-8b", "--deployed", str(path), "--json")
    assert result.exit_code == 1, result.output
    data = json.loads(result.output)
    assert data["passed"] is False
    assert data["deployed"][str(path)]["max_model_len"] == 8192
    risks = {f["code"] for f in data["findings"] if f["severity"] == "risk"}
    assert risks == {"no-output-cap", "preemption-risk", "max-model-len-rejects"}


def test_engine_and_gateway_together_pass(tmp_path):
    serve = tmp_path / "serve.sh"
    serve.write_text("vllm serve meta-llama/Llama-3.1-8B --max-model-len 14512 --max-num-seqs 304 "
                     "--max-num-batched-tokens 8192 --gpu-memory-utilization 0.9 "
                     "--override-generation-config '{\"max_new_tokens\": 700}'\n")
    gateway = tmp_path / "gateway.yaml"
    gateway.write_text(json.dumps(GATEWAY))
    alone = run(REC, "--model", "llama-3.1-8b", "--deployed", str(serve))
    assert alone.exit_code == 1 and "RISK preemption-risk" in alone.output
    both = run(REC, "--model", "llama-3.1-8b", "--deployed", str(serve), "--deployed", str(gateway))
    assert both.exit_code == 0, both.output


def test_usage_errors_exit_2_with_one_line(tmp_path):
    missing = tmp_path / "nope.sh"
    result = CliRunner().invoke(cli, ["check", REC, "--model", "llama-3.1-8b", "--deployed", str(missing)])
    assert result.exit_code == 2
    assert result.output.strip() == f"Error: {missing}: no such file"

    bad = tmp_path / "bad.yaml"
    bad.write_text(json.dumps({**GATEWAY, "block_budget": 0}))
    result = CliRunner().invoke(cli, ["check", REC, "--model", "llama-3.1-8b", "--deployed", str(bad)])
    assert result.exit_code == 2
    assert result.output.strip() == f"Error: {bad}: block_budget: must be at least 1, got 0"

    result = CliRunner().invoke(cli, ["check", REC, "--model", "qwen3-8b", "--deployed", str(bad)])
    assert result.exit_code == 2

    result = CliRunner().invoke(cli, ["check", REC, "--model", "llama-3.1-8b"])
    assert result.exit_code == 2 and "Missing option '--deployed'" in result.output


def test_recommend_then_check_on_sample_logs(tmp_path):
    """The whole loop: recommend from the sample logs, then check what it wrote."""
    out = tmp_path / "deploy"
    logs = str(REPO / "sample_logs")
    common = ["--model", "llama-3.1-8b", "--gpu", "H100-80GB"]
    made = CliRunner().invoke(cli, ["recommend", logs, *common, "--out", str(out)], catch_exceptions=False)
    assert made.exit_code == 0, made.output
    result = run(logs, *common, "--deployed", str(out / "vllm-serve.sh"), "--deployed", str(out / "nginx.conf"),
                 "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["passed"] and not [f for f in data["findings"] if f["severity"] != "info"]
    assert data["deployed"][str(out / "nginx.conf")]["kind"] == "nginx"
    # edit the deployed cap of one route down to 1 token: now it truncates almost everything
    conf = (out / "nginx.conf").read_text()
    first = conf.index("max_new_tokens = ", conf.index("-- kvtune:config begin"))
    end = conf.index(",", first)  # the number only: the route's output law follows it
    (out / "nginx.conf").write_text(conf[:first] + "max_new_tokens = 1" + conf[end:])
    result = run(logs, *common, "--deployed", str(out / "nginx.conf"))
    assert result.exit_code == 1 and "RISK cap-truncates" in result.output


def test_a_yaml_1_1_sexagesimal_block_size_is_refused_not_read_as_60(tmp_path):
    """PyYAML reads `block_size: 1:0` as 60 (YAML 1.1 base 60; YAML 1.2 reads a string) and `010`
    as 8: check judged a gateway its author never wrote. Such numbers are refused, with the line."""
    for written in ("1:0", "010", "1_6"):
        path = tmp_path / "gateway.yaml"
        path.write_text(json.dumps(GATEWAY).replace('"block_size": 16', f'"block_size": {written}'))
        result = CliRunner().invoke(cli, ["check", REC, "--model", "llama-3.1-8b", "--deployed", str(path)])
        assert result.exit_code == 2, result.output
        assert result.output.startswith(f"Error: {path}: ") and result.output.count("\n") == 1, result.output
        assert f"line 1: unsupported YAML: the number '{written}' is not plain decimal" in result.output
