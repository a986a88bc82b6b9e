"""KV bytes per token against hand-derived vLLM arithmetic, for every real config in tests/data/configs."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvtune.errors import CapacityError, KvtuneError, UnknownNameError
from kvtune.kv import bytes_per_element, kv_bytes, pp_stage_sizes
from kvtune.model import LayerKind, parse_model_spec, resolve_model
from tests.conftest import CONFIGS


def spec_of(filename: str):
    return resolve_model(str(CONFIGS / filename))


# filename, TP=1 bytes/token, attention, replication TP, per-GPU bytes/token at that TP (arithmetic beside each)
SHARED = [
    # 32 layers × 32 kv heads × (128+128) × 2 B (float16) = 524288; MHA: heads % tp forces tp ≤ 32,
    # so no replication is possible; tp=32 → 1 head/GPU: 32 × 1 × 256 × 2 = 16384
    ("Llama-2-7b-hf.json", 524288, "mha", 32, 16384),
    # 32 × 8 × (128+128) × 2 = 131072; tp=16 > 8 kv heads → 1 (replicated) head/GPU: 32 × 1 × 256 × 2 = 16384
    ("Llama-3.1-8B.json", 131072, "gqa", 16, 16384),
    # 32 × 8 × 256 × 2 = 131072 (all sliding, window 4096); tp=16 → 32 × 1 × 256 × 2 = 16384
    ("Mistral-7B-v0.1.json", 131072, "gqa", 16, 16384),
    # 32 × 32 × (96+96) × 2 = 393216 (head 3072/32 = 96); MHA: tp=32 → 32 × 1 × 192 × 2 = 12288
    ("Phi-3-mini-4k-instruct.json", 393216, "mha", 32, 12288),
    # 28 × 4 × (128+128) × 2 = 57344 (3584/28 = 128); tp=28 > 4, 28 % 4 == 0 → 28 × 1 × 256 × 2 = 14336
    ("Qwen2-7B-Instruct.json", 57344, "gqa", 28, 14336),
    # 36 × 8 × (128+128) × 2 = 147456; tp=16 → 36 × 1 × 256 × 2 = 18432
    ("Qwen3-8B.json", 147456, "gqa", 16, 18432),
    # 2 × 40 layers × 8 KV heads × 128 × 2 B; 40 query heads split at most 8 ways here: one KV head a GPU
    ("Qwen3-14B.json", 163840, "gqa", 8, 20480),
    # head_dim 256 ≠ 3584/16: 42 × 8 × (256+256) × 2 = 344064; tp=16 → 42 × 1 × 512 × 2 = 43008
    ("gemma-2-9b-it.json", 344064, "gqa", 16, 43008),
    # text_config: 62 × 16 × (128+128) × 2 = 507904; tp=32 > 16 → 62 × 1 × 256 × 2 = 31744
    ("gemma-3-27b-it.json", 507904, "gqa", 32, 31744),
    # head_dim 64 ≠ 2880/64: 24 × 8 × (64+64) × 2 = 49152 (no torch_dtype → bf16); tp=16 → 24 × 1 × 128 × 2 = 6144
    ("gpt-oss-20b.json", 49152, "gqa", 16, 6144),
    # MLA: 61 × (512+64) × 2 = 70272, no ×2 for V; replicated: tp=8 → 70272 on every GPU
    ("DeepSeek-V3.json", 70272, "mla", 8, 70272),
    # only 4 attention layers (i % 8 == 4): 4 × 8 × 256 × 2 = 16384; tp=16 → 4 × 1 × 256 × 2 = 2048
    ("AI21-Jamba-1.5-Mini.json", 16384, "hybrid", 16, 2048),
]


def test_every_shared_config_has_a_case():
    assert sorted(p.name for p in CONFIGS.glob("*.json")) == sorted(row[0] for row in SHARED)


@pytest.mark.parametrize("filename,total,attention,tp,per_gpu", SHARED)
def test_shared_config_bytes_per_token(filename, total, attention, tp, per_gpu):
    spec = spec_of(filename)
    one = kv_bytes(spec)
    assert one.kv_bytes_per_token == total
    assert one.kv_bytes_per_token_per_gpu == total
    assert one.attention == attention
    split = kv_bytes(spec, tp=tp)
    assert split.kv_bytes_per_token == total  # unique data does not change with TP
    assert split.kv_bytes_per_token_per_gpu == per_gpu
    assert split.kv_bytes_per_token_per_gpu * tp >= total


def test_llama_3_1_8b_replicates_heads_beyond_eight_ranks():
    result = kv_bytes(spec_of("Llama-3.1-8B.json"), tp=16)
    assert result.num_kv_heads_per_gpu == 1
    # 16 GPUs × 16384 = 262144 = twice the unique 131072: each head is held by two ranks
    assert result.kv_bytes_per_token_per_gpu * 16 == 2 * 131072


def test_deepseek_mla_is_replicated_not_split():
    spec = spec_of("DeepSeek-V3.json")
    assert (spec.attention.num_kv_heads, spec.attention.head_dim, spec.attention.head_dim_v) == (1, 576, 0)
    for tp in (1, 2, 4, 8, 16, 32, 64, 128):
        assert kv_bytes(spec, tp=tp).kv_bytes_per_token_per_gpu == 70272
    # fp8: 61 × 576 × 1 = 35136; fp8_ds_mla: a fixed 656 B per token per layer: 61 × 656 = 40016
    assert kv_bytes(spec, kv_cache_dtype="fp8").kv_bytes_per_token == 35136
    assert kv_bytes(spec, kv_cache_dtype="fp8_ds_mla").kv_bytes_per_token == 40016
    assert kv_bytes(spec, kv_cache_dtype="nvfp4_ds_mla").kv_bytes_per_token == 61 * 352


def test_layer_breakdown_gemma2_alternates_and_gemma3_five_to_one():
    g2 = kv_bytes(spec_of("gemma-2-9b-it.json"))
    # 21 sliding (even) + 21 full layers, each 8 × 512 × 2 = 8192 B/token → 172032 each
    assert [(x.kind, x.count, x.window, x.kv_bytes_per_token) for x in g2.layers] == [
        (LayerKind.FULL, 21, None, 172032), (LayerKind.SLIDING, 21, 4096, 172032)]
    g3 = kv_bytes(spec_of("gemma-3-27b-it.json"))
    # 62 layers, every 6th global: 10 full, 52 sliding (window 1024); 16 × 256 × 2 = 8192 B/layer
    assert [(x.kind, x.count, x.window, x.kv_bytes_per_token) for x in g3.layers] == [
        (LayerKind.FULL, 10, None, 81920), (LayerKind.SLIDING, 52, 1024, 425984)]


def test_gpt_oss_layer_types():
    result = kv_bytes(spec_of("gpt-oss-20b.json"))
    # 12 + 12 layers × 8 × 128 × 2 = 24576 each
    assert [(x.kind, x.count, x.window, x.kv_bytes_per_token) for x in result.layers] == [
        (LayerKind.FULL, 12, None, 24576), (LayerKind.SLIDING, 12, 128, 24576)]


def test_jamba_mamba_state_per_sequence():
    result = kv_bytes(spec_of("AI21-Jamba-1.5-Mini.json"))
    # Mamba-1 layer: d_inner = 2 × 4096 = 8192; conv 8192 × (4−1) + ssm 8192 × 16 = 155648 elements × 2 B
    # = 311296 B; 28 Mamba layers → 8716288 B per sequence
    assert result.state_bytes_per_sequence == 8716288
    assert [(x.kind, x.count, x.kv_bytes_per_token) for x in result.layers] == [
        (LayerKind.FULL, 4, 16384), (LayerKind.MAMBA, 28, 0)]
    # tp=16: d_inner 512 per rank: (512 × 3 + 512 × 16) × 2 = 19456 B × 28 = 544768
    assert kv_bytes(spec_of("AI21-Jamba-1.5-Mini.json"), tp=16).state_bytes_per_sequence_per_gpu == 544768


def test_pipeline_split_follows_vllm_get_pp_indices():
    # remainder goes to the stages before the last, counting backwards (vllm/distributed/utils.py)
    assert pp_stage_sizes(61, 2) == (31, 30)
    assert pp_stage_sizes(61, 4) == (15, 15, 16, 15)
    assert pp_stage_sizes(32, 3) == (11, 11, 10)
    assert pp_stage_sizes(22, 4) == (5, 6, 6, 5)
    llama = spec_of("Llama-3.1-8B.json")
    # pp=3: largest stage 11 layers × 8 × 256 × 2 = 45056
    assert kv_bytes(llama, pp=3).kv_bytes_per_token_per_gpu == 45056
    # tp=2, pp=3: 11 × 4 × 256 × 2 = 22528
    assert kv_bytes(llama, tp=2, pp=3).kv_bytes_per_token_per_gpu == 22528


def test_pipeline_stage_with_more_sliding_layers_is_not_special():
    # gpt-oss-20b pp=5: [5, 5, 5, 5, 4] layers; 5 × 8 × 128 × 2 = 10240 on the fullest GPU
    result = kv_bytes(spec_of("gpt-oss-20b.json"), pp=5)
    assert result.stage_layers == (5, 5, 5, 5, 4)
    assert result.kv_bytes_per_token_per_gpu == 10240


@pytest.mark.parametrize(
    "filename,tp,message",
    [
        ("Qwen2-7B-Instruct.json", 7, "tensor-parallel size 7 is not a multiple of its 4 KV heads"),
        ("Llama-3.1-8B.json", 3, "32 attention heads are not divisible by tensor-parallel size 3"),
        ("gemma-2-9b-it.json", 32, "16 attention heads are not divisible by tensor-parallel size 32"),
        ("DeepSeek-V3.json", 3, "128 attention heads are not divisible by tensor-parallel size 3"),
    ],
)
def test_tp_splits_vllm_rejects(filename, tp, message):
    with pytest.raises(CapacityError, match=message):
        kv_bytes(spec_of(filename), tp=tp)


def test_kv_heads_not_divisible_by_tp():
    spec = parse_model_spec(
        {"num_hidden_layers": 2, "num_attention_heads": 12, "num_key_value_heads": 6, "hidden_size": 768}, name="x")
    with pytest.raises(CapacityError, match="6 KV heads are not divisible by tensor-parallel size 4") as info:
        kv_bytes(spec, tp=4)
    assert "\n" not in str(info.value)
    with pytest.raises(CapacityError, match="12 attention heads are not divisible by tensor-parallel size 8"):
        kv_bytes(spec, tp=8)


def test_pp_larger_than_layers_and_zero_tp():
    spec = spec_of("Llama-3.1-8B.json")
    with pytest.raises(CapacityError, match="pipeline-parallel size 33 must be between 1 and the model's 32 layers"):
        kv_bytes(spec, pp=33)
    with pytest.raises(CapacityError, match="tensor-parallel size must be at least 1"):
        kv_bytes(spec, tp=0)


@pytest.mark.parametrize(
    "name,model_dtype,expected",
    [("auto", "bfloat16", 2), ("auto", "float16", 2), ("auto", "float32", 2), ("bfloat16", "float32", 2),
     ("float16", "bfloat16", 2), ("half", "bfloat16", 2), ("fp8", "bfloat16", 1), ("fp8_e4m3", "float16", 1),
     ("fp8_e5m2", "bfloat16", 1), ("fp8_inc", "bfloat16", 1), ("int8_per_token_head", "bfloat16", 1),
     ("FP8", "bfloat16", 1)],
)
def test_bytes_per_element(name, model_dtype, expected):
    assert bytes_per_element(name, model_dtype) == expected


def test_unknown_kv_cache_dtype_lists_valid_names():
    with pytest.raises(UnknownNameError) as info:
        bytes_per_element("fp9", "bfloat16")
    text = str(info.value)
    assert text.startswith("kv_cache_dtype: unknown kv-cache dtype 'fp9' (did you mean fp8")
    assert "auto, bfloat16, float16" in text and "\n" not in text


def test_vllm_dtype_without_a_byte_model_is_refused_clearly():
    with pytest.raises(UnknownNameError, match="turboquant_k8v4' is a vLLM name whose byte layout"):
        bytes_per_element("turboquant_k8v4", "bfloat16")


def test_mla_only_dtype_on_a_non_mla_model():
    with pytest.raises(UnknownNameError, match="only for MLA models"):
        kv_bytes(spec_of("Llama-3.1-8B.json"), kv_cache_dtype="fp8_ds_mla")


def test_nvfp4_packs_values_and_scales():
    # per head: K 128/2 + 128/16 = 72 B, V the same → 144 B; 32 layers × 8 heads × 144 = 36864
    assert kv_bytes(spec_of("Llama-3.1-8B.json"), kv_cache_dtype="nvfp4").kv_bytes_per_token == 36864


def test_float32_model_is_cached_as_16_bit():
    spec = dataclasses.replace(spec_of("Llama-3.1-8B.json"), dtype="float32")
    assert kv_bytes(spec).kv_bytes_per_token == 131072


# --- properties ---------------------------------------------------------------------------------

_DENSE = st.fixed_dictionaries({
    "num_hidden_layers": st.integers(1, 200),
    "num_attention_heads": st.sampled_from([1, 2, 4, 8, 16, 32, 64, 128]),
    "head_dim": st.sampled_from([32, 64, 80, 96, 128, 256]),
    "kv_div": st.sampled_from([1, 2, 4, 8, 16, 32, 64, 128]),
})


def _dense_spec(params, layers=None):
    heads = params["num_attention_heads"]
    kv = max(1, heads // params["kv_div"])
    return parse_model_spec(
        {"num_hidden_layers": layers or params["num_hidden_layers"], "num_attention_heads": heads,
         "num_key_value_heads": kv, "head_dim": params["head_dim"], "hidden_size": 4096},
        name="synthetic",
    )


@given(_DENSE, st.integers(1, 8))
def test_bytes_linear_in_layers(params, factor):
    one = kv_bytes(_dense_spec(params, params["num_hidden_layers"])).kv_bytes_per_token
    many = kv_bytes(_dense_spec(params, params["num_hidden_layers"] * factor)).kv_bytes_per_token
    assert many == factor * one


@given(_DENSE)
def test_bytes_linear_in_dtype_bytes(params):
    spec = _dense_spec(params)
    assert kv_bytes(spec, kv_cache_dtype="bfloat16").kv_bytes_per_token == 2 * kv_bytes(
        spec, kv_cache_dtype="fp8").kv_bytes_per_token


@given(_DENSE, st.sampled_from([1, 2, 4, 8, 16, 32, 64, 128]), st.integers(1, 8))
def test_per_gpu_times_gpus_covers_total(params, tp, pp):
    spec = _dense_spec(params)
    if params["num_attention_heads"] % tp or pp > spec.num_layers:
        return
    result = kv_bytes(spec, tp=tp, pp=pp)
    assert result.kv_bytes_per_token_per_gpu * tp * pp >= result.kv_bytes_per_token
    if pp == 1:
        assert result.kv_bytes_per_token_per_gpu * tp >= result.kv_bytes_per_token


@given(st.integers(1, 500), st.integers(1, 64))
def test_pp_stages_partition_the_layers(num_layers, pp):
    if pp > num_layers:
        with pytest.raises(KvtuneError):
            pp_stage_sizes(num_layers, pp)
        return
    sizes = pp_stage_sizes(num_layers, pp)
    assert len(sizes) == pp and sum(sizes) == num_layers
    assert max(sizes) - min(sizes) <= 1
    assert sizes[-1] == num_layers // pp  # the last stage never takes an extra layer
