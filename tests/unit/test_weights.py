"""Weight bytes: parameter counts worked by hand from real configs, formats, safetensors index."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from kvtune.errors import InputError
from kvtune.model import resolve_model
from kvtune.weights import (
    INT4_GROUP128_BITS,
    WeightsSource,
    count_parameters,
    estimate_from_parameters,
    read_checkpoint_bytes,
    weights_for,
)
from tests.conftest import CONFIGS


@pytest.fixture
def llama():
    return resolve_model(str(CONFIGS / "Llama-3.1-8B.json"))


def test_llama_3_1_8b_parameters_by_hand(llama):
    c = count_parameters(llama)
    assert c.embedding == 128_256 * 4_096 == 525_336_576
    assert c.lm_head == 525_336_576  # tie_word_embeddings false
    # per layer: q 4096·32·128 = 16,777,216; k, v 4096·8·128 = 4,194,304 each; o 16,777,216 → 41,943,040
    assert c.attention == 32 * 41_943_040 == 1_342_177_280
    # gated MLP: 3 · 4096 · 14336 = 176,160,768 per layer
    assert c.dense_mlp == 32 * 176_160_768 == 5_637_144_576
    assert c.norms == 2 * 4_096 * 32 + 4_096 == 266_240
    assert c.routed_experts == c.shared_experts == c.router == c.mixer == 0
    assert c.total == 8_030_261_248  # the published "8.03B"


def test_llama_bf16_weights_are_two_bytes_per_parameter(llama):
    w = weights_for(llama)
    assert w.source is WeightsSource.PARAMETER_COUNT
    assert w.weights_bytes == 2 * 8_030_261_248 == 16_060_522_496
    assert w.bytes_per_gpu(tp=4) == 16_060_522_496 // 4  # 4,015,130,624 exactly
    assert w.bytes_per_gpu(tp=3) == math.ceil(16_060_522_496 / 3)


def test_deepseek_v3_mla_and_moe_by_hand():
    spec = resolve_model(str(CONFIGS / "DeepSeek-V3.json"))
    c = count_parameters(spec)
    # MLA per layer: q_a 7168·1536 + norm 1536 + q_b 1536·128·(128+64) = 11,010,048 + 1,536 + 37,748,736
    #   kv_a 7168·(512+64) + norm 512 = 4,129,280; kv_b 512·128·(128+128) = 16,777,216; o 128·128·7168 = 117,440,512
    per_layer_attention = 11_010_048 + 1_536 + 37_748_736 + 4_129_280 + 16_777_216 + 117_440_512
    assert per_layer_attention == 187_107_328
    assert c.attention == 61 * per_layer_attention
    # first_k_dense_replace 3: dense 3·7168·18432 = 396,361,728 on layers 0–2
    assert c.dense_mlp == 3 * 396_361_728
    # 58 MoE layers × 256 experts × 3·7168·2048 (= 44,040,192 each), + 1 shared expert, + router 7168·256
    assert c.routed_experts == 58 * 256 * 44_040_192 == 653_908_770_816
    assert c.shared_experts == 58 * 44_040_192
    assert c.router == 58 * 7_168 * 256
    assert c.embedding == c.lm_head == 129_280 * 7_168
    assert round(c.total / 1e9, 1) == 671.0  # the published 671B (the MTP layer is not loaded by default)
    # fp8: linear layers 1 B plus the fp32 scale of each 128 × 128 block (weight_scale_inv, which
    # the checkpoint stores: 4 B per 16,384 weights), embeddings/lm_head/router/norms 2 B
    w = estimate_from_parameters(spec)
    sixteen_bit = c.embedding + c.lm_head + c.router + c.norms
    assert w.weights_bytes == 2 * sixteen_bit + math.ceil((c.total - sixteen_bit) * (8 + 32 / 16_384) / 8)


def test_gpt_oss_mxfp4_only_on_the_experts():
    spec = resolve_model(str(CONFIGS / "gpt-oss-20b.json"))
    c = count_parameters(spec)
    # 24 layers × 32 experts × 3 · 2880 · 2880 = 19,110,297,600 expert parameters
    assert c.routed_experts == 19_110_297_600
    w = estimate_from_parameters(spec)
    # experts at 4.25 bits: 19,110,297,600 · 4.25 / 8 = 10,152,345,600 B; everything else bf16
    assert w.weights_bytes == 10_152_345_600 + 2 * (c.total - c.routed_experts)
    assert round(w.weights_bytes / 1e9, 1) == 13.7  # the published checkpoint is ~13.8 GB
    assert "mxfp4" in w.weight_format


def test_tied_embeddings_drop_the_lm_head(llama):
    tied = dataclasses.replace(llama, tie_word_embeddings=True)
    assert count_parameters(tied).lm_head == 0
    assert count_parameters(llama).total - count_parameters(tied).total == 525_336_576


def test_int4_awq_is_about_a_quarter_plus_scales(llama):
    awq = dataclasses.replace(llama, quantization="awq", quantization_bits=4)
    c = count_parameters(llama)
    sixteen_bit = c.embedding + c.lm_head + c.norms
    linear = c.total - sixteen_bit
    assert INT4_GROUP128_BITS == 4.15625  # 4 + (16-bit scale + 4-bit zero) / 128
    assert estimate_from_parameters(awq).weights_bytes == 2 * sixteen_bit + math.ceil(linear * 4.15625 / 8)


def test_quantized_formats_order_by_size(llama):
    bf16 = estimate_from_parameters(llama).weights_bytes
    fp8 = estimate_from_parameters(dataclasses.replace(llama, quantization="fp8", quantization_bits=8)).weights_bytes
    int4 = estimate_from_parameters(dataclasses.replace(llama, quantization="gptq", quantization_bits=4)).weights_bytes
    assert int4 < fp8 < bf16


def test_jamba_counts_mamba_mixers_and_moe_every_other_layer():
    spec = resolve_model(str(CONFIGS / "AI21-Jamba-1.5-Mini.json"))
    c = count_parameters(spec)
    assert c.mixer > 0 and c.attention > 0
    # expert_layer_period 2 → 16 of 32 layers are MoE with 16 experts of 3 · 4096 · 14336
    assert c.routed_experts == 16 * 16 * 3 * 4_096 * 14_336
    assert round(c.total / 1e9) == 52  # the published 52B


def test_safetensors_index_total_size_wins(llama, tmp_path):
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": 16_060_522_496}, "weight_map": {}})
    )
    w = weights_for(dataclasses.replace(llama, source_dir=str(tmp_path)))
    assert w.source is WeightsSource.SAFETENSORS_INDEX
    assert w.weights_bytes == 16_060_522_496
    assert w.parameter_count is None


def test_float32_checkpoint_is_served_at_half_its_size(llama, tmp_path):
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": 4_000}}))
    w = weights_for(dataclasses.replace(llama, source_dir=str(tmp_path), dtype="float32"))
    assert w.weights_bytes == 2_000
    assert any("float32" in a for a in w.assumptions)


def test_single_safetensors_file_size(llama, tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"\0" * 1234)
    assert read_checkpoint_bytes(tmp_path) == (1234, WeightsSource.SAFETENSORS_FILE)


def test_directory_without_checkpoint_counts_parameters(llama, tmp_path):
    assert read_checkpoint_bytes(tmp_path) is None
    assert weights_for(dataclasses.replace(llama, source_dir=str(tmp_path))).source is WeightsSource.PARAMETER_COUNT


@pytest.mark.parametrize("index", ['{"metadata": {"total_size": "big"}}', '{"metadata": {}}', "[1]", "{not json"])
def test_bad_safetensors_index_is_an_input_error(tmp_path, index):
    path = tmp_path / "model.safetensors.index.json"
    path.write_text(index)
    with pytest.raises(InputError) as info:
        read_checkpoint_bytes(tmp_path)
    assert str(info.value).startswith(str(path))


def test_nemotron_h_mlp_layers_are_two_matrix_and_only_on_mlp_layers():
    spec = resolve_model("nemotron-h-56b")
    assert round(count_parameters(spec).total / 1e9) == 56  # the published 56B


def test_llama4_counts_its_shared_expert_and_untied_head():
    """Llama 4 configs name neither the shared expert nor tie_word_embeddings; transformers'
    defaults are one shared expert per MoE layer and an untied lm_head (Scout: 109B with vision)."""
    from kvtune.model import resolve_model
    from kvtune.weights import count_parameters

    count = count_parameters(resolve_model("llama-4-scout"))
    assert count.shared_experts > 0
    # lm_head = vocab 202,048 × hidden 5,120
    assert count.lm_head == 202_048 * 5_120


def test_expert_without_a_width_is_priced_as_the_dense_mlp():
    from kvtune.model import parse_model_spec

    config = {"num_hidden_layers": 2, "num_attention_heads": 8, "hidden_size": 512, "ffn_hidden_size": 1024,
              "num_local_experts": 4}
    spec = parse_model_spec(config, name="x")
    assert spec.moe is not None and spec.moe.intermediate_size is None
    # 2 MoE layers × 4 experts × 3 · 512 · 1024 (the dense width, from ffn_hidden_size)
    assert count_parameters(spec).routed_experts == 2 * 4 * 3 * 512 * 1024
