"""`kvtune capacity --engine sglang|trtllm`: the engine's memory model, its startup log through
--engine-log, its server through --metrics-url, capacity files that carry the engine, error lines.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from fake_vllm import FakeVllm

from kvtune.cli import cli

DATA = Path(__file__).parents[1] / "data"
JSON = "application/json"
SGLANG_ROUTES = {
    "/server_info": (200, JSON, (DATA / "sglang-server-info-0.5.23.json").read_bytes()),
    "/v1/models": (200, JSON, (DATA / "sglang-v1-models-0.5.23.json").read_bytes()),
}


def run(*args: str):
    return CliRunner().invoke(cli, ["capacity", *args])


def run_json(*args: str) -> dict:
    result = run(*args, "--json")
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_sglang_estimate_json():
    d = run_json("llama-3.1-8b", "--gpu", "H100-80GB", "--engine", "sglang", "--prompt-tokens", "2000",
                 "--max-tokens", "512")
    assert (d["engine"], d["source"], d["block_size"], d["num_blocks"], d["kv_cache_tokens"],
            d["gpu_memory_utilization"], d["max_num_seqs"], d["max_num_batched_tokens"]) == (
        "sglang", "estimate", 1, 412_220, 412_220, 0.83, 2048, 8192)
    # each request reserves 2,512 one-token pages of the 412,219 kvtune counts as usable
    assert d["requests"][0]["reserved_blocks"] == 2512 and d["requests"][0]["max_concurrent"] == 164
    assert d["assumptions"][0] == "SGLang 0.5.23's memory model (mem_fraction_static covers weights + KV)"


def test_trtllm_estimate_table():
    result = run("llama-3.1-8b", "--gpu", "H100-80GB", "--engine", "trtllm")
    assert result.exit_code == 0, result.output
    assert "(estimate, TensorRT-LLM 1.2's model)" in " ".join(result.stdout.split())
    for row in (("block size", "32 tokens"), ("blocks", "14,350"), ("tokens", "459,200")):
        assert any(line.startswith(f"│ {row[0]} ") and line.rstrip(" │").endswith(row[1])
                   for line in result.stdout.splitlines()), row
    assert "× free_gpu_memory_fraction 0.9" in result.stdout


def test_trtllm_given_fraction_and_block_size():
    d = run_json("llama-3.1-8b", "--gpu", "H100-80GB", "--engine", "trtllm", "--gpu-memory-utilization", "0.5",
                 "--block-size", "64")
    assert (d["gpu_memory_utilization"], d["block_size"], d["num_blocks"]) == (0.5, 64, 3986)


def test_vllm_stays_the_default():
    d = run_json("llama-3.1-8b", "--gpu", "H100-80GB")
    assert (d["engine"], d["block_size"], d["gpu_memory_utilization"]) == ("vllm", 16, 0.92)


@pytest.mark.parametrize("engine, log, tokens, blocks, block_size", [
    ("sglang", "sglang-0.5.23-startup.log", 300_000, 300_000, 1),
    ("trtllm", "trtllm-1.2-startup.log", 459_200, 14_350, 32),
])
def test_engine_log_is_the_measured_capacity(engine, log, tokens, blocks, block_size):
    d = run_json("llama-3.1-8b", "--gpu", "H100-80GB", "--engine", engine, "--engine-log", str(DATA / log))
    assert (d["source"], d["measured_from"], d["kv_cache_tokens"], d["num_blocks"], d["block_size"]) == (
        f"{engine}-log", str(DATA / log), tokens, blocks, block_size)
    assert d["estimated_num_blocks"] == {"sglang": 412_220, "trtllm": 14_350}[engine]


def test_engine_log_without_gpu():
    d = run_json("llama-3.1-8b", "--engine", "trtllm", "--engine-log", str(DATA / "trtllm-dynamo-example.log"))
    assert (d["num_blocks"], d["block_size"], d["max_model_len"], d["gpu"]) == (3445, 64, 131_072, None)


def test_sglang_server_through_metrics_url():
    with FakeVllm(routes=SGLANG_ROUTES, routes_only=True) as fake:
        d = run_json("llama-3.1-8b", "--engine", "sglang", "--metrics-url", fake.url)
        base = fake.url
    assert (d["source"], d["measured_from"], d["kv_cache_tokens"], d["block_size"], d["gpu_memory_utilization"]) == (
        "sglang-server", base, 412_220, 1, None)


def test_capacity_file_brings_its_engine(tmp_path):
    out = tmp_path / "c.json"
    result = CliRunner().invoke(cli, ["calibrate", "--engine", "trtllm", "--engine-log",
                                      str(DATA / "trtllm-1.2-startup.log"), "--save", str(out), "--json"])
    assert result.exit_code == 0, result.output
    d = run_json("llama-3.1-8b", "--gpu", "H100-80GB", "--engine", "trtllm", "--capacity", str(out))
    assert (d["engine"], d["source"], d["num_blocks"], d["block_size"]) == ("trtllm", "trtllm-log", 14_350, 32)
    result = run("llama-3.1-8b", "--gpu", "H100-80GB", "--capacity", str(out))  # --engine left at vllm
    assert result.exit_code == 2
    assert result.stderr == (f"Error: --engine: the capacity was measured on TensorRT-LLM ({DATA / 'trtllm-1.2-startup.log'}), "
                             "not vLLM: pass --engine trtllm\n")


@pytest.mark.parametrize("args, line", [
    (["--engine", "sglang", "--engine-log", str(DATA / "sglang-startup-no-capacity.log")],
     f"Error: {DATA / 'sglang-startup-no-capacity.log'}: no KV cache capacity in this log (looked for SGLang's "
     "'max_total_num_tokens=N, …' and 'KV Cache is allocated. … #tokens: N'); pass the SGLang server's startup log"),
    (["--engine", "trtllm", "--engine-log", str(DATA / "sglang-0.5.23-startup.log")],
     f"Error: {DATA / 'sglang-0.5.23-startup.log'}: no KV cache capacity in this log (looked for TensorRT-LLM's "
     "'[MemUsageChange] Allocated X GiB for max tokens in paged KV cache (N)'); pass the trtllm-serve startup log"),
    (["--engine", "sglang", "--vllm-log", str(DATA / "vllm-cpu-0.32-startup.log")],
     "Error: --vllm-log: a vLLM startup log, but engine sglang: give it as --engine-log"),
    (["--engine", "sglang", "--engine-log", "missing.log", "--kv-tokens", "1000"],
     "Error: --engine-log: give one measured capacity, not --kv-tokens and --engine-log"),
    (["--engine", "vllm", "--gpu", "H100-80GB", "--engine-log", str(DATA / "trtllm-1.2-startup.log")],
     f"Error: {DATA / 'trtllm-1.2-startup.log'}: no KV cache capacity in this log"),
    (["--engine", "sglang", "--gpu", "H100-80GB", "--gpu-memory-utilization", "0.1"],
     "Error: SGLang leaves no KV pool: weights 14.96 GiB per GPU against 7.86 GiB (78.65 GiB free × "
     "mem_fraction_static 0.1); raise mem_fraction_static (--gpu-memory-utilization) above 0.191, or use more "
     "GPUs (--tp/--pp), a bigger GPU, or quantized weights"),
    (["--engine", "trtllm", "--gpu", "H100-80GB", "--gpu-memory-utilization", "1"],
     "Error: --gpu-memory-utilization: must be in (0, 1), got 1.0"),
    (["--engine", "tgi"], "Usage:"),
])
def test_error_lines(args, line):
    result = run("llama-3.1-8b", *args)
    assert result.exit_code == 2, result.output
    if line == "Usage:":
        assert "Invalid value for '--engine'" in result.stderr
        return
    assert result.stderr.startswith(line), result.stderr
    assert result.stderr.count("\n") == 1 and result.stdout == ""
