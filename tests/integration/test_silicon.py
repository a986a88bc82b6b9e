"""The silicon step-time source (kvtune.capacity.silicon): aiconfigurator-core's measured kernels,
sampled and fitted once per model, GPU, engine, TP and KV dtype, through `kvtune simulate`."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from click.testing import CliRunner
from conftest import CONFIGS, REPO

from kvtune.capacity.measured import CapacitySource, MeasuredCapacity, write_capacity_file
from kvtune.capacity.silicon import silicon_step_time
from kvtune.cli import cli
from kvtune.hardware import find_gpu
from kvtune.model.sources import load_config_file

pytest.importorskip("aiconfigurator_core")  # a platform without its wheel runs the roofline tests only


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> str:
    """One cache for the module: each (model, GPU, …) is sampled once, as for a user."""
    return str(tmp_path_factory.mktemp("kvtune-cache"))


@pytest.fixture(autouse=True)
def _cache(monkeypatch, cache_dir):
    monkeypatch.setenv("KVTUNE_CACHE_DIR", cache_dir)


def capacity(tmp_path, **extra) -> str:
    m = MeasuredCapacity(source=CapacitySource.METRICS, num_blocks=20_000, block_size=16, kv_cache_tokens=320_000,
                         max_model_len=40_960, device="GPU", model="Qwen/Qwen3-8B", **extra)
    path = tmp_path / "cap.json"
    write_capacity_file(path, m)
    return str(path)


def simulate_json(*args: str) -> dict:
    r = CliRunner().invoke(cli, ["simulate", str(REPO / "sample_logs" / "openai_chat_pairs.jsonl"), "--rate", "2",
                                 "--requests", "30", "--json", *args], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


def test_a_covered_gpu_simulates_on_silicon_data_and_names_it(tmp_path):
    timing = simulate_json("--capacity", capacity(tmp_path), "--model", "qwen3-8b", "--gpu", "h100")["simulation"][
        "timing"]
    assert timing["source"] == "silicon" and timing["estimate"] is True
    s = timing["silicon"]
    assert (s["gpu"], s["system"], s["engine"], s["tensor_parallel_size"]) == ("H100-80GB", "h100_sxm", "vllm", 1)
    assert s["data_version"] and s["package"].startswith("aiconfigurator-core ")
    assert s["samples"] == 68 and s["fit_error"]["median"] <= 0.08 and s["fit_error"]["max"] <= 0.3
    assert "h100_sxm" in timing["label"] and s["data_version"] in timing["label"]
    assert timing["coefficients"]["c4"] > 0  # decode reads its KV: the term the roofline fix split out


def test_the_fitted_form_follows_aiconfigurator_off_its_grid():
    """Shapes the fit never saw, against aiconfigurator's own latencies: decode steps within 10 %,
    prefill chunks within 10 % (25 % before the fit bent at the matmuls' knee: 300–512-token chunks
    were +15–22 %, 3,000–6,000-token ones −10 %; measured with the knee at 512: −9 % to +2 %), and
    the 8,192-token chunks of a saturated server within 5 % (they were 11–17 % under)."""
    from aiconfigurator_core.sdk.engine import EngineHandle

    config = load_config_file(CONFIGS / "Llama-3.1-8B.json")
    model, _ = silicon_step_time({"config.json": config}, find_gpu("h100"))
    path = os.environ["KVTUNE_CACHE_DIR"] + "/llama"
    os.makedirs(path, exist_ok=True)
    with open(path + "/config.json", "w") as f:
        json.dump(config, f)
    handle = EngineHandle.compile(path, "h100_sxm", "vllm")
    for batch, ctx in ((3, 700), (48, 2000), (200, 600), (24, 9000)):
        measured = handle.decode_step_latency(batch, ctx, 2) / 1e3
        assert model.step_seconds([(1, ctx)] * batch) == pytest.approx(measured, rel=0.10), (batch, ctx)
    for tokens, prefix in ((3000, 0), (512, 5000), (6000, 12000), (300, 0), (1500, 3000)):
        measured = handle.predict_prefill_latency(1, tokens + prefix, prefix) / 1e3
        assert model.step_seconds([(tokens, prefix)]) == pytest.approx(measured, rel=0.10), (tokens, prefix)
    for prefix in (0, 20000):
        measured = handle.predict_prefill_latency(1, 8192 + prefix, prefix) / 1e3
        assert model.step_seconds([(8192, prefix)]) == pytest.approx(measured, rel=0.05), prefix
    assert model.knee_tokens in (128, 256, 512, 1024, 2048) and model.past_knee_s > 0
    # the figures (Llama-3.1-8B on h100_sxm, vLLM): decode ≈ 6.2 / 10.3 / 19.3 ms at batch 1 / 64 / 256
    assert model.step_seconds([(1, 1000)]) == pytest.approx(6.2e-3, rel=0.1)
    assert model.step_seconds([(2048, 0)]) == pytest.approx(43.5e-3, rel=0.15)


def test_calibrated_timing_wins_over_silicon_data(tmp_path):
    from test_cli_simulate import capacity_file

    cap = capacity_file(tmp_path, num_blocks=2000, block_size=16, max_model_len=8192, device="GPU")
    timing = simulate_json("--capacity", cap, "--model", "qwen3-8b", "--gpu", "h100")["simulation"]["timing"]
    assert timing["source"] == "calibrated" and "silicon" not in timing


def test_a_model_it_cannot_price_falls_back_to_the_roofline_with_the_reason(tmp_path):
    timing = simulate_json("--capacity", capacity(tmp_path), "--model", str(CONFIGS / "AI21-Jamba-1.5-Mini.json"),
                           "--gpu", "h100")["simulation"]["timing"]
    assert timing["source"] == "roofline-estimate"
    assert timing["fallback_reason"].startswith("aiconfigurator-core cannot price this model on h100_sxm/vllm")


def _run(code: str, cache_dir: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "KVTUNE_CACHE_DIR": cache_dir, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)


SIMULATE = """
import json, sys
{prelude}
from click.testing import CliRunner
from kvtune.cli import cli
from kvtune.hardware import find_gpu
r = CliRunner().invoke(cli, ["simulate", {logs!r}, "--capacity", {cap!r}, "--model", "qwen3-8b", "--gpu", "h100",
                             "--rate", "2", "--requests", "10", "--json"])
print(json.dumps({{"timing": json.loads(r.stdout)["simulation"]["timing"],
                  "imported": "aiconfigurator_core" in sys.modules}}))
"""


def test_without_the_package_the_roofline_says_it_is_not_installed(tmp_path):
    code = SIMULATE.format(prelude="sys.modules['aiconfigurator_core'] = None  # as where no wheel exists",
                           logs=str(REPO / "sample_logs" / "openai_chat_pairs.jsonl"), cap=capacity(tmp_path))
    out = _run(code, str(tmp_path / "empty-cache"))
    assert out.returncode == 0, out.stderr
    timing = json.loads(out.stdout)["timing"]
    assert timing["source"] == "roofline-estimate"
    assert timing["fallback_reason"].startswith("aiconfigurator-core is not installed")


def test_a_cached_fit_never_imports_aiconfigurator(tmp_path):
    code = SIMULATE.format(prelude="", logs=str(REPO / "sample_logs" / "openai_chat_pairs.jsonl"),
                           cap=capacity(tmp_path))
    cache = str(tmp_path / "cache")
    first, second = _run(code, cache), _run(code, cache)
    assert first.returncode == 0 and second.returncode == 0, first.stderr + second.stderr
    a, b = json.loads(first.stdout), json.loads(second.stdout)
    assert a["imported"] is True and b["imported"] is False
    assert a["timing"] == b["timing"] and b["timing"]["source"] == "silicon"
    assert "Loading" not in first.stderr  # aiconfigurator's warnings about other models' data stay quiet


def test_kv_never_imports_the_silicon_source():
    out = subprocess.run([sys.executable, "-X", "importtime", "-m", "kvtune", "kv", "llama-3.1-8b"],
                         capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "aiconfigurator" not in out.stderr and "kvtune.capacity.silicon" not in out.stderr


def test_an_engine_version_it_did_not_measure_uses_its_current_data_and_says_so():
    config = load_config_file(CONFIGS / "Qwen3-8B.json")
    _, inputs = silicon_step_time({"config.json": config}, find_gpu("h100"), engine_version="0.11.0")
    assert inputs.engine_version == "0.11.0" and inputs.data_version != "0.11.0"
    assert inputs.label.endswith(f"vllm {inputs.data_version} measurements, asked for 0.11.0, TP 1")


def test_tensorrt_llm_policies_simulate_on_tensorrt_llm_data(tmp_path):
    timing = simulate_json("--capacity", capacity(tmp_path), "--model", "qwen3-8b", "--gpu", "h100",
                           "--engine", "trtllm-gne")["simulation"]["timing"]
    assert timing["source"] == "silicon" and timing["silicon"]["engine"] == "trtllm"


def test_a_modelopt_checkpoint_is_priced_with_its_hf_quant_config(tmp_path):
    """nvidia/Llama-3.1-70B-Instruct-FP8 names its FP8 GEMMs only in hf_quant_config.json: handed
    both files, aiconfigurator prices FP8 GEMMs (a decode step on 2 × H100 ≈ 16.5 ms, where the
    config alone prices bf16 ≈ 27.5 ms)."""
    quantized = CONFIGS / "quantized" / "Llama-3.1-70B-Instruct-FP8"
    whole, _ = silicon_step_time({"config.json": load_config_file(quantized / "config.json"),
                                  "hf_quant_config.json": load_config_file(quantized / "hf_quant_config.json")},
                                 find_gpu("h100"), tp=2)
    alone, _ = silicon_step_time({"config.json": load_config_file(quantized / "config.json")}, find_gpu("h100"), tp=2)
    assert whole.step_seconds([(1, 1000)]) < 0.75 * alone.step_seconds([(1, 1000)])
    # and simulate hands it both files when --model is the checkpoint's directory (one GPU: no --tp yet)
    timing = simulate_json("--capacity", capacity(tmp_path), "--model", str(quantized), "--gpu", "h100")[
        "simulation"]["timing"]
    one_gpu, _ = silicon_step_time({"config.json": load_config_file(quantized / "config.json"),
                                    "hf_quant_config.json": load_config_file(quantized / "hf_quant_config.json")},
                                   find_gpu("h100"))
    coefficients = dict(timing["coefficients"])
    assert coefficients.pop("mixed_step_s") == pytest.approx(80 * 0.8e-3)  # vLLM's dispatch of its 80 layers
    assert coefficients.pop("largest_graph_tokens") == 512  # an H100's largest CUDA graph
    assert timing["source"] == "silicon" and coefficients == one_gpu.to_dict()
