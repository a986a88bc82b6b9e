"""`kvtune kv`: JSON shape, the table, and one `Error:` line with exit code 2 for each bad input."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from kvtune.cli import cli
from tests.conftest import CONFIGS

FIELDS = {"model", "kv_cache_dtype", "bytes_per_element", "num_layers", "attention", "num_kv_heads", "head_dim",
          "kv_bytes_per_token", "tensor_parallel_size", "pipeline_parallel_size", "kv_bytes_per_token_per_gpu",
          "layers", "state_bytes_per_sequence"}


def run(*args):
    return CliRunner().invoke(cli, ["kv", *args])


def test_json_is_one_object_with_the_documented_fields():
    result = run("llama-3.1-8b", "--tp", "16", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert FIELDS <= data.keys()
    assert data["kv_bytes_per_token"] == 131072  # 32 × 8 × 256 × 2
    assert data["kv_bytes_per_token_per_gpu"] == 16384  # one replicated head per GPU
    assert data["layers"] == [{"kind": "full", "count": 32, "window": None, "kv_bytes_per_token": 131072}]
    assert data["attention"] == "gqa" and data["state_bytes_per_sequence"] == 0


def test_json_for_a_config_path_with_fp8_and_pp():
    result = run(str(CONFIGS / "gemma-2-9b-it.json"), "--kv-cache-dtype", "fp8", "--pp", "2", "--json")
    data = json.loads(result.stdout)
    # 42 × 8 × 512 × 1 = 172032; pp 2 → 21 layers × 8 × 512 = 86016
    assert (data["bytes_per_element"], data["kv_bytes_per_token"], data["kv_bytes_per_token_per_gpu"]) == (
        1, 172032, 86016)
    assert {(layer["kind"], layer["window"]) for layer in data["layers"]} == {("full", None), ("sliding", 4096)}


def test_table_shows_layers_bytes_and_kib():
    result = run("jamba-1.5-mini")
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert "16,384" in out and "16.00" in out  # bytes/token and KiB/token
    assert "mamba" in out and "8,716,288 bytes" in out  # per-sequence state


def test_help_has_one_line_and_an_example():
    result = CliRunner().invoke(cli, ["kv", "--help"])
    assert "KV-cache bytes per token for MODEL" in result.output
    assert "kvtune kv llama-3.1-70b --tp 4 --kv-cache-dtype fp8" in result.output


@pytest.mark.parametrize(
    "args,line",
    [
        (["/nonexistent/config.json"], "Error: /nonexistent/config.json: no such file or directory"),
        (["llama-3.1-8b", "--tp", "3"],
         "Error: llama-3.1-8b: 32 attention heads are not divisible by tensor-parallel size 3; vLLM refuses this split"),
        (["qwen2-7b", "--tp", "7"],
         "Error: qwen2-7b: tensor-parallel size 7 is not a multiple of its 4 KV heads, so they cannot be replicated "
         "evenly; vLLM refuses this split"),
        (["llama-3.1-8b", "--pp", "40"],
         "Error: pipeline-parallel size 40 must be between 1 and the model's 32 layers"),
        (["llama-3.1-8b", "--kv-cache-dtype", "fp4"],
         "Error: --kv-cache-dtype: unknown kv-cache dtype 'fp4' (did you mean nvfp4 or fp8?); valid: auto, bfloat16, float16, "
         "half, fp8, fp8_e4m3, fp8_e5m2, fp8_inc, int8_per_token_head, fp8_per_token_head, int4_per_token_head, "
         "nvfp4, fp8_ds_mla, nvfp4_ds_mla"),
        (["lama-3.1-70b"],
         "Error: unknown model 'lama-3.1-70b': not a file, a directory, a preset or a hub id (owner/name); "
         "did you mean llama-3.1-70b, llama-3.1-405b, llama-3.1-8b?"),
        (["nobody/no-such-model"],
         "Error: cannot get config.json for hub model 'nobody/no-such-model': offline (HF_HUB_OFFLINE=1) and not in "
         "the local Hugging Face cache; pass a config.json path, a model directory or a preset name"),
    ],
)
def test_user_errors_are_one_line_exit_2(args, line):
    result = run(*args)
    assert result.exit_code == 2
    assert result.stderr == line + "\n"
    assert result.stdout == "" and "Traceback" not in result.output


def test_bad_config_file_errors(tmp_path):
    bad = tmp_path / "config.json"
    bad.write_text('{"num_hidden_layers": 4, "num_attention_heads": 0, "hidden_size": 64}')
    result = run(str(bad))
    assert (result.exit_code, result.stderr) == (2, f"Error: {bad}: num_attention_heads: must be at least 1, found 0\n")
    bad.write_text("{not json")
    result = run(str(tmp_path))
    assert result.exit_code == 2
    assert result.stderr == (
        f"Error: {bad}:1: invalid JSON: Expecting property name enclosed in double quotes (column 2)\n")


def test_tp_zero_is_a_usage_error():
    result = run("llama-3.1-8b", "--tp", "0")
    assert result.exit_code == 2 and "Invalid value for '--tp'" in result.stderr
