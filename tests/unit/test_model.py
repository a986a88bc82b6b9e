"""HF config parsing: the keys vLLM reads, per family, and one clear error for each bad config."""

from __future__ import annotations

import dataclasses
import json
from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtune.errors import InputError, KvtuneError, ModelConfigError, UnknownNameError
from kvtune.kv import kv_bytes
from kvtune.model import (
    Attention,
    LayerKind,
    LinearAttention,
    Mamba1,
    Mamba2,
    Mla,
    Moe,
    load_config_file,
    parse_model_spec,
    resolve_model,
)
from tests.conftest import CONFIGS

# Synthetic configs in the shape of real families (values as in their public config.json).
GPT2 = {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_layer": 12, "n_head": 12, "n_embd": 768,
        "n_positions": 1024, "vocab_size": 50257}
FALCON_7B = {"model_type": "falcon", "hidden_size": 4544, "n_head": 71, "n_layer": 32, "multi_query": True,
             "new_decoder_architecture": False, "torch_dtype": "bfloat16"}
FALCON_40B = {"model_type": "falcon", "hidden_size": 8192, "num_attention_heads": 128, "num_hidden_layers": 60,
              "num_kv_heads": 8, "new_decoder_architecture": True, "multi_query": True}
DEEPSEEK_V2_LITE = {"model_type": "deepseek_v2", "num_hidden_layers": 27, "num_attention_heads": 16,
                    "num_key_value_heads": 16, "hidden_size": 2048, "kv_lora_rank": 512, "q_lora_rank": None,
                    "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128, "n_routed_experts": 64,
                    "num_experts_per_tok": 6, "moe_intermediate_size": 1408, "n_shared_experts": 2,
                    "first_k_dense_replace": 1, "torch_dtype": "bfloat16"}
NEMOTRON_H = {"model_type": "nemotron_h", "num_hidden_layers": 8, "hybrid_override_pattern": "M-M*-ME*",
              "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096, "attention_head_dim": 128,
              "mamba_num_heads": 128, "mamba_head_dim": 64, "n_groups": 8, "ssm_state_size": 128, "conv_kernel": 4,
              "time_step_limit": [0.0, float("inf")]}


def kinds(spec):
    return dict(Counter(k.value for k in spec.layer_kinds))


def test_gpt2_aliases():
    spec = parse_model_spec(GPT2, name="gpt2")
    assert spec.num_layers == 12
    assert spec.attention == Attention(num_heads=12, num_kv_heads=12, head_dim=64, head_dim_v=64)
    assert (spec.mla, spec.mamba, spec.linear, spec.moe) == (None, None, None, None)  # dense: no other part
    assert spec.max_position_embeddings == 1024 and spec.architecture == "GPT2LMHeadModel"
    # 12 layers × 12 heads × (64+64) × 2 B = 36864
    assert kv_bytes(spec).kv_bytes_per_token == 36864


def test_falcon_7b_multi_query_is_one_kv_head():
    spec = parse_model_spec(FALCON_7B, name="falcon-7b")
    assert (spec.attention.num_kv_heads, spec.attention.head_dim) == (1, 64)  # 4544 / 71
    # 32 × 1 × 128 × 2 = 8192
    assert kv_bytes(spec).attention == "mqa" and kv_bytes(spec).kv_bytes_per_token == 8192


def test_falcon_40b_new_decoder_architecture_uses_num_kv_heads():
    spec = parse_model_spec(FALCON_40B, name="falcon-40b")
    assert spec.attention.num_kv_heads == 8  # multi_query is ignored with new_decoder_architecture
    # 60 × 8 × (64+64) × 2 = 122880
    assert kv_bytes(spec).kv_bytes_per_token == 122880


@pytest.mark.parametrize("key", ["n_head_kv", "num_kv_heads", "num_key_value_heads", "multi_query_group_num",
                                 "num_attention_groups"])
def test_kv_head_aliases(key):
    spec = parse_model_spec({"num_hidden_layers": 2, "num_attention_heads": 8, "hidden_size": 512, key: 2}, name="x")
    assert spec.attention.num_kv_heads == 2


def test_kv_head_alias_order_follows_vllm():
    config = {"num_hidden_layers": 2, "num_attention_heads": 8, "hidden_size": 512, "n_head_kv": 1,
              "num_key_value_heads": 4}
    assert parse_model_spec(config, name="x").attention.num_kv_heads == 1


def test_head_dim_zero_falls_back_to_hidden_over_heads():
    config = {"num_hidden_layers": 2, "num_attention_heads": 8, "hidden_size": 512, "head_dim": 0}
    assert parse_model_spec(config, name="x").attention.head_dim == 64


def test_deepseek_v2_lite_mla_and_moe_fields():
    spec = parse_model_spec(DEEPSEEK_V2_LITE, name="dsv2-lite")
    # the cache sees one KV head of kv_lora_rank + qk_rope_head_dim = 576 and no V
    assert spec.is_mla and spec.attention == Attention(num_heads=16, num_kv_heads=1, head_dim=576, head_dim_v=0)
    assert spec.mla == Mla(kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
                           q_lora_rank=None)
    # moe_layer_freq is not given: every layer after the first_k_dense_replace dense ones
    assert spec.is_moe and spec.moe == Moe(num_experts=64, num_shared_experts=2, first_k_dense_layers=1,
                                           layer_freq=1, experts_per_token=6, intermediate_size=1408)
    # 27 × 576 × 2 = 31104
    assert kv_bytes(spec).kv_bytes_per_token == 31104


def test_nemotron_h_pattern_counts_only_attention_layers():
    spec = parse_model_spec(NEMOTRON_H, name="nemo")
    assert spec.layer_kinds == (LayerKind.MAMBA, LayerKind.NONE, LayerKind.MAMBA, LayerKind.FULL, LayerKind.NONE,
                                LayerKind.MAMBA, LayerKind.NONE, LayerKind.FULL)
    assert spec.mamba == Mamba2(num_heads=128, head_dim=64, state_size=128, conv_kernel=4, num_groups=8)
    assert spec.mamba.inner_size == 128 * 64 and spec.linear is None
    result = kv_bytes(spec)
    # 2 attention layers × 8 × (128+128) × 2 = 8192
    assert result.kv_bytes_per_token == 8192 and result.attention == "hybrid"
    # Mamba-2 layer: conv (4−1) × (128·64 + 2·8·128) = 3 × 10240 = 30720; ssm 128 × 64 × 128 = 1048576;
    # (30720 + 1048576) × 2 B = 2158592; 3 layers → 6475776
    assert result.state_bytes_per_sequence == 6475776
    # tp=4: conv 3 × 10240/4 = 7680; ssm 32 × 64 × 128 = 262144; (7680 + 262144) × 2 = 539648 × 3 = 1618944
    assert kv_bytes(spec, tp=4).state_bytes_per_sequence_per_gpu == 1618944


def test_nemotron_h_pattern_length_must_match():
    with pytest.raises(ModelConfigError, match="hybrid_override_pattern: has 3 characters for 8 layers"):
        parse_model_spec({**NEMOTRON_H, "hybrid_override_pattern": "M*-"}, name="nemo")


def test_llama4_chunked_local_layers_default_interval():
    scout = resolve_model("llama-4-scout")
    # no no_rope_layers key: every 4th layer is NoPE/global → 12 full, 36 chunked (window 8192)
    assert kinds(scout) == {"chunked": 36, "full": 12} and scout.attention.chunk_size == 8192
    assert scout.attention.sliding_window is None
    assert scout.layer_kinds[3] is LayerKind.FULL and scout.layer_kinds[0] is LayerKind.CHUNKED


def test_llama4_explicit_no_rope_layers():
    config = {"text_config": {"model_type": "llama4_text", "num_hidden_layers": 4, "num_attention_heads": 8,
                              "num_key_value_heads": 2, "hidden_size": 512, "attention_chunk_size": 16,
                              "no_rope_layers": [1, 0, 0, 1]}}
    spec = parse_model_spec(config, name="l4")
    assert spec.layer_kinds == (LayerKind.CHUNKED, LayerKind.FULL, LayerKind.FULL, LayerKind.CHUNKED)


def test_qwen_sliding_window_unused_when_use_sliding_window_false():
    spec = resolve_model(str(CONFIGS / "Qwen2-7B-Instruct.json"))
    assert spec.attention.sliding_window is None and kinds(spec) == {"full": 28}


def test_gemma3_text_config_takes_transformers_defaults():
    spec = resolve_model(str(CONFIGS / "gemma-3-27b-it.json"))
    assert spec.max_position_embeddings == 131072  # Gemma3TextConfig default; RoPE factor not re-applied
    assert kinds(spec) == {"sliding": 52, "full": 10} and spec.attention.sliding_window == 1024
    assert spec.layer_kinds[5] is LayerKind.FULL and spec.layer_kinds[4] is LayerKind.SLIDING
    assert spec.dtype == "bfloat16" and spec.architecture == "Gemma3ForConditionalGeneration"


@pytest.mark.parametrize(
    "filename,max_len",
    [("Llama-3.1-8B.json", 131072),  # llama3 rope type is not rescaled
     ("DeepSeek-V3.json", 163840),  # yarn: original 4096 × factor 40
     ("gpt-oss-20b.json", 131072),  # yarn: 4096 × 32
     ("Phi-3-mini-4k-instruct.json", 4096), ("AI21-Jamba-1.5-Mini.json", 262144)],
)
def test_derived_max_model_len(filename, max_len):
    assert resolve_model(str(CONFIGS / filename)).max_position_embeddings == max_len


def test_jamba_mamba1_and_moe_parts():
    spec = resolve_model(str(CONFIGS / "AI21-Jamba-1.5-Mini.json"))
    # mamba_expand 2 × hidden 4096; expert_layer_period 2 → MoE on every other layer
    assert spec.mamba == Mamba1(inner_size=8192, state_size=16, conv_kernel=4)
    assert spec.moe == Moe(num_experts=16, num_shared_experts=0, first_k_dense_layers=0, layer_freq=2,
                           experts_per_token=2, intermediate_size=14336)
    assert (spec.mla, spec.linear) == (None, None)


def test_qwen3_5_linear_attention_part_pins_its_state_dtype():
    spec = resolve_model("qwen3.5-27b")
    assert spec.linear == LinearAttention(num_key_heads=16, num_value_heads=48, key_head_dim=128,
                                          value_head_dim=128, conv_kernel=4, state_dtype="float32")
    assert spec.mamba is None and spec.dtype == "bfloat16"


def test_mamba_ssm_dtype_pins_the_mamba_state():
    spec = parse_model_spec({**NEMOTRON_H, "mamba_ssm_dtype": "torch.float32"}, name="nemo")
    assert spec.mamba is not None and spec.mamba.state_dtype == "float32"
    with pytest.raises(ModelConfigError, match='mamba_ssm_dtype: unknown dtype "int3"'):
        parse_model_spec({**NEMOTRON_H, "mamba_ssm_dtype": "int3"}, name="nemo")


def test_moe_keys_a_config_leaves_out():
    config = {"num_hidden_layers": 2, "num_attention_heads": 8, "hidden_size": 512, "num_local_experts": 4}
    # no shared experts, no dense prefix, every layer MoE; top-k and expert width unknown
    assert parse_model_spec(config, name="x").moe == Moe(
        num_experts=4, num_shared_experts=0, first_k_dense_layers=0, layer_freq=1, experts_per_token=None,
        intermediate_size=None)
    assert parse_model_spec({**config, "num_local_experts": 0}, name="x").moe is None


def test_a_part_comes_with_its_layers():
    llama = resolve_model("llama-3.1-8b")
    jamba = resolve_model("jamba-1.5-mini")
    mla = Mla(kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, q_lora_rank=None)
    with pytest.raises(ValueError, match="mla layers and the mla part come together"):
        dataclasses.replace(llama, mla=mla)
    with pytest.raises(ValueError, match="mamba layers and the mamba part come together"):
        dataclasses.replace(jamba, mamba=None)
    with pytest.raises(ValueError, match="31 layer kinds for 32 layers"):
        dataclasses.replace(llama, layer_kinds=llama.layer_kinds[1:])


def test_dtype_and_quantization():
    oss = resolve_model(str(CONFIGS / "gpt-oss-20b.json"))
    assert (oss.dtype, oss.quantization, oss.quantization_bits) == ("bfloat16", "mxfp4", 4)
    ds = resolve_model(str(CONFIGS / "DeepSeek-V3.json"))
    assert (ds.quantization, ds.quantization_bits) == ("fp8", 8)
    assert resolve_model(str(CONFIGS / "Llama-2-7b-hf.json")).dtype == "float16"


def test_infinity_literal_parses(tmp_path):
    path = tmp_path / "config.json"
    text = json.dumps(NEMOTRON_H)
    assert "Infinity" in text
    path.write_text(text)
    spec = resolve_model(str(tmp_path))
    assert spec.attention.num_kv_heads == 8 and spec.source_dir == str(tmp_path)


def test_infinity_as_a_head_count_is_an_error(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text('{"num_hidden_layers": 2, "num_attention_heads": Infinity, "hidden_size": 64}')
    with pytest.raises(ModelConfigError) as info:
        resolve_model(str(path))
    assert str(info.value) == f"{path}: num_attention_heads: expected an integer, found inf"


@pytest.mark.parametrize(
    "config,message",
    [
        ({"num_attention_heads": 8, "hidden_size": 512},
         "num_hidden_layers: missing layer count (looked for num_hidden_layers, n_layer, num_layers, n_layers)"),
        ({"num_hidden_layers": 2, "hidden_size": 512},
         "num_attention_heads: missing attention head count (looked for num_attention_heads, n_head, n_heads, num_heads)"),
        ({"num_hidden_layers": 2, "num_attention_heads": 0, "hidden_size": 512},
         "num_attention_heads: must be at least 1, found 0"),
        ({"num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 0, "hidden_size": 512},
         "num_key_value_heads: must be at least 1, found 0"),
        ({"num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 16, "hidden_size": 512},
         "num_key_value_heads: 16 KV heads is more than the 8 attention heads"),
        ({"num_hidden_layers": "32", "num_attention_heads": 8, "hidden_size": 512},
         'num_hidden_layers: expected an integer, found "32"'),
        ({"num_hidden_layers": 2, "num_attention_heads": 7, "hidden_size": 512},
         "hidden_size: 512 is not divisible by 7 attention heads and no head_dim is given"),
        ({"num_hidden_layers": 2, "num_attention_heads": 8, "hidden_size": 512, "layer_types": ["full_attention"]},
         "layer_types: has 1 entries for 2 layers"),
        ({"num_hidden_layers": 1, "num_attention_heads": 8, "hidden_size": 512, "layer_types": ["banana"]},
         "layer_types[0]: unknown layer type \"banana\""),
        ({"num_hidden_layers": 1, "num_attention_heads": 8, "hidden_size": 512, "torch_dtype": "int3"},
         "torch_dtype: unknown dtype \"int3\""),
        ({"text_config": {"num_hidden_layers": 2, "hidden_size": 512}},
         "text_config.num_attention_heads: missing attention head count"),
    ],
)
def test_bad_configs_name_file_and_field(tmp_path, config, message):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    with pytest.raises(ModelConfigError) as info:
        resolve_model(str(path))
    assert str(info.value).startswith(f"{path}: {message}")
    assert "\n" not in str(info.value)


def test_missing_file():
    with pytest.raises(InputError, match=r"^/nonexistent/config.json: no such file or directory$"):
        resolve_model("/nonexistent/config.json")


def test_directory_without_config(tmp_path):
    with pytest.raises(InputError, match="model directory has no config.json"):
        resolve_model(str(tmp_path))


def test_invalid_json_names_line(tmp_path):
    path = tmp_path / "config.json"
    path.write_text('{\n  "num_hidden_layers": 2,\n  oops\n}')
    with pytest.raises(InputError) as info:
        load_config_file(path)
    assert str(info.value) == f"{path}:3: invalid JSON: Expecting property name enclosed in double quotes (column 3)"


def test_json_that_is_not_an_object(tmp_path):
    path = tmp_path / "config.json"
    path.write_text("[1, 2]")
    with pytest.raises(InputError, match="expected a JSON object, found list"):
        load_config_file(path)


def test_unknown_name_suggests_presets():
    with pytest.raises(UnknownNameError) as info:
        resolve_model("llama-3.1-8")
    assert "did you mean llama-3.1-8b" in str(info.value)


def test_hub_id_offline_without_cache_is_a_clear_error():
    with pytest.raises(KvtuneError) as info:
        resolve_model("meta-llama/Llama-3.1-8B")
    assert str(info.value) == (
        "cannot get config.json for hub model 'meta-llama/Llama-3.1-8B': offline (HF_HUB_OFFLINE=1) and not in "
        "the local Hugging Face cache; the bundled preset 'llama-3.1-8b' has this model's config")


def test_hub_id_read_from_local_cache_when_offline(tmp_path, monkeypatch):
    import huggingface_hub.constants as hf_constants

    cache = tmp_path / "hub"
    commit = "0123456789abcdef0123456789abcdef01234567"
    snapshot = cache / "models--acme--tiny-llama" / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(json.dumps(
        {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 128}))
    (cache / "models--acme--tiny-llama" / "refs").mkdir()
    (cache / "models--acme--tiny-llama" / "refs" / "main").write_text(commit)
    # huggingface_hub reads its environment once, at import: point its constants at this cache.
    monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", True)
    spec = resolve_model("acme/tiny-llama")
    assert (spec.name, spec.attention.num_kv_heads, spec.attention.head_dim) == ("acme/tiny-llama", 2, 32)
    assert spec.source_dir == str(snapshot)


@settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(
    st.sampled_from(["num_hidden_layers", "n_layer", "num_attention_heads", "n_head", "num_key_value_heads",
                     "hidden_size", "head_dim", "sliding_window", "layer_types", "torch_dtype", "text_config",
                     "multi_query", "kv_lora_rank", "model_type", "rope_scaling", "max_position_embeddings"]),
    st.one_of(st.none(), st.booleans(), st.integers(-3, 5000), st.floats(allow_nan=True), st.text(max_size=5),
              st.lists(st.sampled_from(["full_attention", "sliding_attention", "x"]), max_size=6),
              st.dictionaries(st.sampled_from(["num_hidden_layers", "num_attention_heads", "hidden_size",
                                               "factor", "rope_type"]), st.integers(-1, 64), max_size=3)),
))
def test_fuzzed_configs_give_a_spec_or_a_kvtune_error(config):
    try:
        spec = parse_model_spec(config, name="fuzz")
    except KvtuneError:
        return
    assert spec.num_layers >= 1 and spec.attention.num_kv_heads >= 1 and len(spec.layer_kinds) == spec.num_layers


def test_hub_id_offline_reads_the_copy_aiconfigurator_ships(monkeypatch, tmp_path):
    """Offline and not in the Hugging Face cache, a hub model whose config.json aiconfigurator-core
    ships (as owner--name_config.json, a ModelOpt hf_quant_config.json beside it) is read from there."""
    pytest.importorskip("aiconfigurator_core")
    import huggingface_hub.constants as hf_constants

    monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", True)
    modelopt = resolve_model("nvidia/Llama-3.1-70B-Instruct-FP8")
    assert (modelopt.name, modelopt.num_layers, modelopt.quantization, modelopt.quantization_bits) == (
        "nvidia/Llama-3.1-70B-Instruct-FP8", 80, "modelopt", 8)
    from kvtune.sim.setup import model_files  # what the silicon step time is sampled from: the same files

    assert set(model_files(modelopt) or {}) == {"config.json", "hf_quant_config.json"}
    fp8 = resolve_model("qwen/qwen3-32b-fp8")  # the hub's ids are not case-sensitive
    assert (fp8.num_layers, fp8.quantization, fp8.quantization_bits) == (64, "fp8", 8)
    with pytest.raises(KvtuneError, match="not in the local Hugging Face cache"):
        resolve_model("nobody/no-such-model")
