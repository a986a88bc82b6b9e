"""Quantized checkpoints: `quantization_config` (and ModelOpt's hf_quant_config.json) read into a
scheme, priced for weight bytes against published checkpoint sizes, and the roofline's matmul
dtype, through `kvtune capacity` and `kvtune simulate` on real configs."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtune.capacity.measured import CapacitySource, MeasuredCapacity, write_capacity_file
from kvtune.capacity.timing import roofline_step_time
from kvtune.cli import cli
from kvtune.errors import KvtuneError
from kvtune.hardware import find_gpu
from kvtune.model import resolve_model
from kvtune.model.config import parse_model_spec
from kvtune.weights import active_parameters, count_parameters, estimate_from_parameters

DATA = Path(__file__).parents[1] / "data"
CONFIGS = DATA / "configs"
QUANTIZED = CONFIGS / "quantized"
GPU_SPECS = DATA / "gpu-specs"


def run(*args: str):
    return CliRunner().invoke(cli, list(args))


# --- weight bytes against the published checkpoints ------------------------------------------------


@pytest.mark.parametrize(("config", "total_size", "tolerance"), [
    # model.safetensors.index.json metadata.total_size of each checkpoint (tests/data/SOURCES.md)
    (QUANTIZED / "Meta-Llama-3-8B-Instruct-FP8.json", 9_081_202_432, 1e-6),  # AutoFP8 per-tensor W8A8
    # mxfp4 experts; the count leaves out biases and attention sinks (~14 MB here)
    (CONFIGS / "gpt-oss-20b.json", 13_761_264_768, 2e-3),
])
def test_weight_bytes_match_the_published_checkpoint(config, total_size, tolerance):
    estimate = estimate_from_parameters(resolve_model(str(config)))
    assert estimate.weights_bytes == pytest.approx(total_size, rel=tolerance)


def test_fp8_per_tensor_is_one_byte_per_linear_weight_and_16_bit_elsewhere():
    spec = resolve_model(str(QUANTIZED / "Meta-Llama-3-8B-Instruct-FP8.json"))
    c = count_parameters(spec)
    linear = c.attention + c.dense_mlp
    w = estimate_from_parameters(spec)
    # 16-bit: embeddings, lm_head (AutoFP8 leaves it), norms; the per-tensor fp32 scales are a few bytes
    assert w.weights_bytes - (linear + 2 * (c.embedding + c.lm_head + c.norms)) < 2_000
    assert w.weight_format == "fp8 W8A8 (fp8 GEMMs), per-tensor scales"


def test_block_fp8_stores_an_fp32_scale_per_128_by_128_block():
    spec = resolve_model(str(QUANTIZED / "Qwen3-32B-FP8.json"))
    q = spec.quantization_config
    assert (q.method, q.weight_bits, q.block, q.activations, q.scale_bits) == ("fp8", 8, (128, 128), "fp8", 32)
    c = count_parameters(spec)
    linear = c.total - c.embedding - c.lm_head - c.norms
    expected = 2 * (c.embedding + c.lm_head + c.norms) + math.ceil(linear * (8 + 32 / 128**2) / 8)
    assert estimate_from_parameters(spec).weights_bytes == expected


def test_modelopt_checkpoint_reads_hf_quant_config_beside_config_json():
    """nvidia/Llama-3.1-70B-Instruct-FP8's config.json names no quantization: its scheme is in
    hf_quant_config.json (ModelOpt FP8, lm_head excluded). Before, it was priced at 16 bits."""
    spec = resolve_model(str(QUANTIZED / "Llama-3.1-70B-Instruct-FP8"))
    q = spec.quantization_config
    assert (spec.quantization, q.weight_bits, q.group_size, q.activations) == ("modelopt", 8, 0, "fp8")
    assert q.unquantized == (("lm_head", 1.0),)
    c = count_parameters(spec)
    w = estimate_from_parameters(spec)
    assert w.weights_bytes == pytest.approx(c.total - c.embedding - c.lm_head - c.norms
                                            + 2 * (c.embedding + c.lm_head + c.norms), abs=10_000)
    assert round(w.weights_bytes / 1e9, 1) == 72.7  # 70.6B parameters: 141 GB at 16 bits


def test_modelopt_quant_algo_without_quant_method():
    """Qwen3-32B-FP8-Static-PerTensor: a ModelOpt quantization_config with no quant_method key."""
    spec = resolve_model(str(QUANTIZED / "Qwen3-32B-FP8-Static-PerTensor.json"))
    assert (spec.quantization, spec.quantization_bits, spec.quantization_config.activations) == ("modelopt", 8, "fp8")


def test_nvfp4_is_four_and_a_half_bits_with_fp4_gemms():
    spec = resolve_model(str(QUANTIZED / "Qwen3-235B-A22B-NVFP4"))
    q = spec.quantization_config
    assert (q.weight_type, q.group_size, q.scale_bits, q.activations) == ("nvfp4", 16, 8, "fp4")
    assert q.bits_per_weight(4096, 4096) == 4.5
    # the routers (mlp.gate of every layer) are excluded by name and stay 16-bit as routers do
    assert q.unquantized == (("lm_head", 1.0),)


def test_compressed_tensors_ignore_list_keeps_attention_shared_experts_and_dense_mlp():
    """Kimi-K2.5: W4A16 group-32 on the routed experts; `ignore` names self_attn, shared_experts and
    the dense layers' mlp.(gate|up|down)_proj by regex."""
    spec = resolve_model(str(QUANTIZED / "Kimi-K2.5.json"))
    q = spec.quantization_config
    assert (q.method, q.weight_bits, q.group_size, q.activations, q.zero_point_bits) == (
        "compressed-tensors", 4, 32, None, 0)
    assert dict(q.unquantized) == {"attention": 1.0, "shared_experts": 1.0, "dense_mlp": 1.0, "lm_head": 1.0}
    c = count_parameters(spec)
    w = estimate_from_parameters(spec)
    routed_bytes = math.ceil(c.routed_experts * (4 + 16 / 32) / 8)
    assert w.weights_bytes == 2 * (c.total - c.routed_experts) + routed_bytes


def test_fp8_modules_to_not_convert_by_layer_counts_their_share():
    """Qwen3-30B-A3B-FP8 lists each layer's router and norms: none of them is a matmul part."""
    q = resolve_model(str(QUANTIZED / "Qwen3-30B-A3B-FP8.json")).quantization_config
    assert q.unquantized == (("lm_head", 1.0),)
    spec = parse_model_spec({**json.loads((QUANTIZED / "Qwen3-30B-A3B-FP8.json").read_text()),
                             "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128],
                                                     "modules_to_not_convert": ["model.layers.0.self_attn",
                                                                                "model.layers.1.self_attn"]}},
                            name="x")
    assert dict(spec.quantization_config.unquantized)["attention"] == pytest.approx(2 / 48)


@pytest.mark.parametrize(("config", "bits"), [
    # AutoAWQ's config as the transformers docs quote TheBloke/zephyr-7B-alpha-AWQ's (Mistral-7B)
    ({"quant_method": "awq", "zero_point": True, "group_size": 128, "bits": 4, "version": "gemm"}, 4 + 20 / 128),
    # AutoGPTQ: qzeros stored even when symmetric, and an int32 g_idx per input column
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True}, 4 + 20 / 128 + 32 / 4096),
    ({"quant_method": "gptq", "bits": 8, "group_size": -1, "sym": True}, 8 + 24 / 4096 + 32 / 4096),
])
def test_awq_and_gptq_layouts(config, bits):
    base = json.loads((CONFIGS / "Mistral-7B-v0.1.json").read_text())
    spec = parse_model_spec({**base, "quantization_config": config}, name="m")
    q = spec.quantization_config
    assert q.activations is None  # weight-only: 16-bit GEMMs
    assert q.bits_per_weight(4096, 4096) == pytest.approx(bits)


def test_bad_quantization_config_fields_name_the_field(tmp_path):
    base = json.loads((CONFIGS / "Llama-3.1-8B.json").read_text())
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**base, "quantization_config": {"quant_method": "fp8", "weight_block_size": [128]}}))
    result = run("capacity", str(path), "--gpu", "h100")
    assert result.exit_code == 2
    assert result.stderr.strip().splitlines() == [
        f"Error: {path}: quantization_config.weight_block_size: expected two positive integers, got [128]"]
    with pytest.raises(KvtuneError):
        parse_model_spec({**base, "quantization_config": {"quant_method": "compressed-tensors", "config_groups": {
            "group_0": {"targets": ["Linear"], "weights": {"num_bits": "four"}}}}}, name="m")


def test_capacity_prices_a_modelopt_fp8_checkpoint_at_its_stored_bytes():
    """Before: priced at 16 bits (141 GB), so it did not fit one H200 at all."""
    result = run("capacity", str(QUANTIZED / "Llama-3.1-70B-Instruct-FP8"), "--gpu", "h200", "--json")
    assert result.exit_code == 0, result.output
    d = json.loads(result.stdout)
    assert round(d["weights_bytes"] / 1e9, 1) == 72.7
    assert d["weights_format"] == "modelopt fp8 W8A8 (fp8 GEMMs), per-tensor scales"
    assert d["num_blocks"] > 0


# --- matmul speed ------------------------------------------------------------------------------


def _capacity(tmp_path) -> str:
    m = MeasuredCapacity(source=CapacitySource.METRICS, num_blocks=4000, block_size=16, kv_cache_tokens=64_000,
                         max_model_len=8192, device="GPU", model="llama")
    path = tmp_path / "cap.json"
    write_capacity_file(path, m)
    return str(path)


def _roofline(tmp_path, model: Path, *gpu: str) -> dict:
    result = run("simulate", "sample_logs/", "--capacity", _capacity(tmp_path), "--model", str(model), *gpu,
                 "--rate", "2", "--requests", "20", "--json")
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)["simulation"]["timing"]


def test_fp8_w8a8_runs_its_gemms_at_the_fp8_peak_on_hopper(tmp_path):
    # the H800: the H100's peaks and bandwidth, and no silicon data, so simulate prices it on the roofline
    fp8 = _roofline(tmp_path, QUANTIZED / "Meta-Llama-3-8B-Instruct-FP8.json", "--gpu", "h800")
    bf16 = _roofline(tmp_path, CONFIGS / "Llama-3.1-8B.json", "--gpu", "h800")
    assert (fp8["roofline"]["matmul_dtype"], bf16["roofline"]["matmul_dtype"]) == ("fp8", "bf16")
    assert fp8["roofline"]["matmul_dense_flops"] == 1979e12
    spec = resolve_model(str(QUANTIZED / "Meta-Llama-3-8B-Instruct-FP8.json"))
    active, quantized = active_parameters(spec)
    assert quantized == 6_979_321_856  # every linear layer but lm_head
    assert fp8["coefficients"]["c1"] == pytest.approx(2 * (active - quantized) / 989e12 + 2 * quantized / 1979e12)
    # reads half the linear bytes: c0 falls from 16.06 GB to 9.08 GB over 3.35 TB/s
    assert fp8["coefficients"]["c0"] == pytest.approx(9_081_202_304 / 3.35e12)
    assert bf16["coefficients"]["c1"] > 1.7 * fp8["coefficients"]["c1"]


def test_fp8_on_ampere_keeps_16_bit_gemms_and_weight_only_int4_too(tmp_path):
    a100 = _roofline(tmp_path, QUANTIZED / "Meta-Llama-3-8B-Instruct-FP8.json", "--gpu", "a100")
    assert a100["roofline"]["matmul_dtype"] == "bf16"  # no FP8 tensor cores: vLLM's weight-only Marlin path
    base = json.loads((CONFIGS / "Llama-3.1-8B.json").read_text())
    awq = parse_model_spec({**base, "quantization_config": {"quant_method": "awq", "bits": 4, "group_size": 128,
                                                            "zero_point": True}}, name="awq")
    bf16 = resolve_model(str(CONFIGS / "Llama-3.1-8B.json"))
    h100 = find_gpu("h100")
    m_awq, inputs = roofline_step_time(awq, h100)
    m_bf16, _ = roofline_step_time(bf16, h100)
    assert inputs.matmul_dtype == "bf16" and m_awq.c1 == pytest.approx(m_bf16.c1)
    assert m_awq.c0 < 0.4 * m_bf16.c0  # but it reads about a quarter of the linear bytes


def test_a_gpu_spec_file_gives_the_roofline_its_fp8_peak(tmp_path):
    timing = _roofline(tmp_path, QUANTIZED / "Meta-Llama-3-8B-Instruct-FP8.json",
                       "--gpu-spec", str(GPU_SPECS / "h100-nvl.yaml"))
    assert (timing["roofline"]["gpu"], timing["roofline"]["matmul_dtype"]) == ("H100-NVL", "fp8")
    assert timing["roofline"]["matmul_dense_flops"] == 1670.5e12


# --- the reader, fuzzed -------------------------------------------------------------------------

_BASE = json.loads((CONFIGS / "Llama-3.1-8B.json").read_text())
_scalar = st.one_of(st.none(), st.booleans(), st.integers(-3, 300), st.floats(allow_nan=True, allow_infinity=True),
                    st.sampled_from(["fp8", "int", "float", "group", "channel", "block", "tensor", "Linear", "lm_head",
                                     "re:.*self_attn.*", "model.layers.3.mlp", "layers.0.", "FP8", "NVFP4"]))
_value = st.recursive(_scalar, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
    st.sampled_from(["num_bits", "type", "strategy", "group_size", "symmetric", "targets", "weights",
                     "input_activations", "block_structure", "group_0"]), inner, max_size=4), max_leaves=8)
_quant = st.fixed_dictionaries(
    {"quant_method": st.sampled_from(["fp8", "fbgemm_fp8", "modelopt", "compressed-tensors", "awq", "gptq", "mxfp4",
                                      "bitsandbytes", "unknown"])},
    optional={"weight_block_size": _value, "activation_scheme": _value, "bits": _value, "group_size": _value,
              "zero_point": _value, "lm_head": _value, "quant_algo": _value, "modules_to_not_convert": _value,
              "ignore": _value, "exclude_modules": _value, "config_groups": _value, "format": _value})


@settings(max_examples=400, suppress_health_check=[HealthCheck.too_slow])
@given(_quant)
def test_any_quantization_config_is_a_priced_spec_or_one_config_error(q):
    """Fuzzed quantization_config objects: a spec whose weights price to a positive size no larger
    than at 16 bits (plus scales), or a KvtuneError naming a field, never another exception."""
    try:
        spec = parse_model_spec({**_BASE, "quantization_config": q}, name="fuzz", path="config.json")
    except KvtuneError as exc:
        assert exc.path == "config.json" and (exc.field or "").startswith("quantization_config")
        return
    estimate = estimate_from_parameters(spec)
    assert 0 < estimate.weights_bytes <= 2.2 * count_parameters(spec).total
    active, quantized = active_parameters(spec)
    assert 0 <= quantized <= active


@pytest.mark.parametrize(("gpu", "dtype"), [("b200", "fp4"), ("gb200", "fp4"), ("h100", "bf16"), ("mi300x", "bf16")])
def test_nvfp4_gemms_run_at_the_fp4_peak_only_on_blackwell(gpu, dtype):
    spec = resolve_model(str(QUANTIZED / "Qwen3-235B-A22B-NVFP4"))
    _, inputs = roofline_step_time(spec, find_gpu(gpu), tp=4)
    assert inputs.matmul_dtype == dtype
    assert inputs.quantized_active_parameters == active_parameters(spec)[1] > 0
