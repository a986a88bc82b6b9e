"""HF config.json dict → ModelSpec, the way vLLM reads it (vllm/transformers_utils/config.py,
vllm/config/model.py): aliases per family, multimodal text configs, layer layouts."""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

from kvtune.model.fields import ConfigFields, shown
from kvtune.model.quantization import parse_quantization
from kvtune.model.spec import (
    Attention,
    LayerKind,
    LinearAttention,
    Mamba,
    Mamba1,
    Mamba2,
    Mla,
    ModelSpec,
    Moe,
    Quantization,
)
from kvtune.userfiles import brief

HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")

# vLLM's is_deepseek_mla model types (vllm/transformers_utils/model_arch_config_convertor.py).
_MLA_MODEL_TYPES = frozenset(
    {"deepseek_v2", "deepseek_v3", "deepseek_v32", "deepseek_mtp", "kimi_k2", "kimi_linear",
     "longcat_flash", "pangu_ultra_moe", "pangu_ultra_moe_mtp"}
)
_FALCON_MODEL_TYPES = frozenset({"falcon", "RefinedWeb", "RefinedWebModel"})
# vLLM's CONFIG_FIELD_ALIASES order for the KV head count.
_KV_HEAD_KEYS = ("n_head_kv", "num_kv_heads", "num_key_value_heads", "multi_query_group_num", "num_attention_groups")
_LAYER_KEYS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")
_HEAD_KEYS = ("num_attention_heads", "n_head", "n_heads", "num_heads")
_HIDDEN_KEYS = ("hidden_size", "n_embd", "d_model", "model_dim")
# vLLM derive_max_model_len: the smallest of these that is present.
_MAX_LEN_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "model_max_length",
                 "max_target_positions", "max_sequence_length", "max_seq_length", "seq_len")
_TEXT_CONFIG_KEYS = ("text_config", "language_config", "llm_config")
# transformers Gemma3TextConfig defaults, for keys a multimodal gemma-3 text_config leaves out.
_GEMMA3_TEXT_DEFAULTS: dict[str, Any] = {
    "vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "max_position_embeddings": 131072,
    "rope_theta": 1_000_000.0, "sliding_window": 4096, "sliding_window_pattern": 6, "tie_word_embeddings": True,
}
_LAYER_TYPE_NAMES = {
    "full_attention": LayerKind.FULL, "attention": LayerKind.FULL, "global": LayerKind.FULL,
    "sliding_attention": LayerKind.SLIDING, "sliding_window": LayerKind.SLIDING, "local": LayerKind.SLIDING,
    "chunked_attention": LayerKind.CHUNKED,
    "linear_attention": LayerKind.LINEAR,
    "mamba": LayerKind.MAMBA, "mamba2": LayerKind.MAMBA,
}
_DTYPE_NAMES = {
    "bfloat16": "bfloat16", "bf16": "bfloat16", "float16": "float16", "fp16": "float16", "half": "float16",
    "float32": "float32", "fp32": "float32", "float": "float32",
}
_QUANT_BITS = {"fp8": 8, "fbgemm_fp8": 8, "mxfp4": 4, "nvfp4": 4, "modelopt_fp4": 4, "bitsandbytes": None}


def parse_model_spec(
    config: dict[str, Any], *, name: str, source_dir: str | None = None, path: str | None = None,
    serve_id: str | None = None,
) -> ModelSpec:
    """Turn a config.json dict into a ModelSpec, or raise ModelConfigError naming file and field."""
    top = ConfigFields(config, path=path)
    text, prefix = _text_config(config)
    model_type = top.str_("model_type")
    f = ConfigFields(text, path=path, prefix=prefix)
    text_type = f.str_("model_type") or model_type
    if text_type == "gemma3_text":
        f = ConfigFields({**_GEMMA3_TEXT_DEFAULTS, **text}, path=path, prefix=prefix)

    num_layers = f.require_int(*_LAYER_KEYS, what="layer count")
    num_heads = f.require_int(*_HEAD_KEYS, what="attention head count")
    hidden = f.require_int(*_HIDDEN_KEYS, what="hidden size")
    architectures = top.list_("architectures")
    architecture = architectures[0] if architectures and isinstance(architectures[0], str) else None

    is_mla = text_type in _MLA_MODEL_TYPES and f.has("kv_lora_rank")
    if is_mla:  # vLLM caches the latent as one KV head of kv_lora_rank + qk_rope_head_dim, with no V
        num_kv_heads, head_dim_v = 1, 0
        head_dim = (f.require_int("kv_lora_rank", what="MLA kv_lora_rank")
                    + f.require_int("qk_rope_head_dim", what="MLA qk_rope_head_dim"))
    else:
        num_kv_heads = _num_kv_heads(f, model_type, num_heads)
        head_dim = _head_dim(f, hidden, num_heads)
        head_dim_v = head_dim

    sliding_window = f.int_("sliding_window", minimum=1)
    if f.data.get("use_sliding_window") is False:  # Qwen2/Qwen3 carry a window they do not use
        sliding_window = None
    chunk = f.int_("attention_chunk_size", minimum=1)
    kinds = _layer_kinds(f, text_type, num_layers, is_mla, sliding_window, chunk)
    if LayerKind.SLIDING not in kinds:
        sliding_window = None
    elif sliding_window is None:
        raise f.error("sliding_window", "layers are marked sliding but no window is given")
    if LayerKind.CHUNKED not in kinds:
        chunk = None

    # Reads stay in this order so that a config with two faults always reports the same one.
    mamba, linear = _state_parts(f, hidden, kinds)
    quant, bits, scheme = _quantization(top, f, num_layers)
    intermediate = f.int_("intermediate_size", "n_inner", "ffn_hidden_size", minimum=1)
    vocab = f.int_("vocab_size", minimum=1) or top.int_("vocab_size", minimum=1)
    tied = f.bool_("tie_word_embeddings",
                   top.bool_("tie_word_embeddings", (text_type or model_type) in _TIED_BY_DEFAULT))
    moe = _moe(f, text_type)
    mla = _mla(f) if is_mla else None
    return ModelSpec(
        name=name,
        architecture=architecture,
        model_type=text_type,
        num_layers=num_layers,
        layer_kinds=kinds,
        attention=Attention(num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                            head_dim_v=head_dim_v, sliding_window=sliding_window, chunk_size=chunk),
        hidden_size=hidden,
        intermediate_size=intermediate,
        vocab_size=vocab,
        tie_word_embeddings=tied,
        mla=mla,
        mamba=mamba,
        linear=linear,
        moe=moe,
        dtype=_dtype(f, top),
        quantization=quant,
        quantization_bits=bits,
        quantization_config=scheme,
        max_position_embeddings=_max_model_len(f, text_type),
        source_dir=source_dir,
        serve_id=serve_id or source_dir or _hub_id_of(config),
    )


def _hub_id_of(config: dict[str, Any]) -> str | None:
    """A preset names its hub id as the first word of `_source`."""
    source = config.get("_source")
    if isinstance(source, str) and HUB_ID.fullmatch(source.split()[0] if source.split() else ""):
        return source.split()[0]
    return None


def _text_config(config: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """The text model's config: multimodal configs nest it (vLLM get_hf_text_config)."""
    for key in _TEXT_CONFIG_KEYS:
        sub = config.get(key)
        if isinstance(sub, dict):
            return sub, f"{key}."
    return config, ""


def _num_kv_heads(f: ConfigFields, model_type: str | None, num_heads: int) -> int:
    """vLLM ModelConfig.get_total_num_kv_heads, including the Falcon and MQA special cases."""
    new_falcon = model_type in _FALCON_MODEL_TYPES and f.bool_("new_decoder_architecture", False)
    if not new_falcon and f.data.get("multi_query") is True:
        return 1
    if model_type in ("mpt", "dbrx") and isinstance(f.data.get("attn_config"), dict):
        sub = ConfigFields(f.data["attn_config"], path=f.path, prefix=f"{f.prefix}attn_config.")
        return sub.int_("kv_n_heads", minimum=1) or num_heads
    kv = f.int_(*_KV_HEAD_KEYS, minimum=1)
    if kv is None:
        return num_heads
    if kv > num_heads:
        raise f.error(f.first(*_KV_HEAD_KEYS) or "num_key_value_heads",
                      f"{kv} KV heads is more than the {num_heads} attention heads")
    return kv


def _head_dim(f: ConfigFields, hidden: int, num_heads: int) -> int:
    """vLLM get_head_size order: head_dim (> 0), hidden_size_per_head, hidden_size // heads."""
    explicit = f.int_("head_dim", "attention_head_dim", minimum=0)
    if explicit:
        return explicit
    per_head = f.int_("hidden_size_per_head", minimum=1)
    if per_head:
        return per_head
    if hidden % num_heads:
        raise f.error("hidden_size",
                      f"{hidden} is not divisible by {num_heads} attention heads and no head_dim is given")
    return hidden // num_heads


def _layer_kinds(
    f: ConfigFields, model_type: str | None, num_layers: int, is_mla: bool, window: int | None, chunk: int | None
) -> tuple[LayerKind, ...]:
    """One LayerKind per decoder layer, from whichever layout key this family uses."""
    if is_mla:
        return (LayerKind.MLA,) * num_layers
    pattern = f.str_("hybrid_override_pattern")  # Nemotron-H: M mamba, * attention, - MLP, E MoE
    if pattern is not None:
        if len(pattern) != num_layers:
            raise f.error("hybrid_override_pattern", f"has {len(pattern)} characters for {num_layers} layers")
        table = {"M": LayerKind.MAMBA, "*": LayerKind.FULL, "-": LayerKind.NONE, "E": LayerKind.NONE}
        bad = sorted(set(pattern) - set(table))
        if bad:
            raise f.error("hybrid_override_pattern", f"unknown layer symbol {brief(bad[0])} (known: M * - E)")
        return tuple(table[c] for c in pattern)
    types = f.list_("layer_types")
    if types is not None:
        if len(types) < num_layers:
            raise f.error("layer_types", f"has {len(types)} entries for {num_layers} layers")
        kinds = []
        for i, t in enumerate(types[:num_layers]):
            kind = _LAYER_TYPE_NAMES.get(t) if isinstance(t, str) else None
            if kind is None:
                raise f.error(f"layer_types[{i}]", f"unknown layer type {shown(t)} "
                              f"(known: {', '.join(sorted(_LAYER_TYPE_NAMES))})")
            kinds.append(kind)
        return tuple(kinds)
    if f.has("attn_layer_period"):  # Jamba: attention where i % period == offset, Mamba elsewhere
        period = f.require_int("attn_layer_period", what="attention layer period")
        offset = f.int_("attn_layer_offset", minimum=0) or 0
        return tuple(LayerKind.FULL if i % period == offset else LayerKind.MAMBA for i in range(num_layers))
    if chunk is not None:  # Llama-4: RoPE layers use chunked-local attention, NoPE layers are global
        no_rope = f.list_("no_rope_layers")
        if no_rope:
            if len(no_rope) < num_layers:
                raise f.error("no_rope_layers", f"has {len(no_rope)} entries for {num_layers} layers")
            return tuple(LayerKind.CHUNKED if flag else LayerKind.FULL for flag in no_rope[:num_layers])
        interval = f.int_("no_rope_layer_interval", minimum=1) or 4
        return tuple(LayerKind.FULL if (i + 1) % interval == 0 else LayerKind.CHUNKED for i in range(num_layers))
    if window is None:
        return (LayerKind.FULL,) * num_layers
    if model_type in ("gemma2",):  # even layers slide (transformers Gemma2: not layer_idx % 2)
        return tuple(LayerKind.SLIDING if i % 2 == 0 else LayerKind.FULL for i in range(num_layers))
    sw_pattern = f.int_("sliding_window_pattern", minimum=1)
    if sw_pattern is not None:  # Gemma-3, Cohere2: every pattern-th layer is global
        return tuple(LayerKind.FULL if (i + 1) % sw_pattern == 0 else LayerKind.SLIDING for i in range(num_layers))
    return (LayerKind.SLIDING,) * num_layers  # Mistral, Phi-3: the window applies to every layer


def _state_parts(
    f: ConfigFields, hidden: int, kinds: tuple[LayerKind, ...]
) -> tuple[Mamba | None, LinearAttention | None]:
    """The Mamba and linear-attention parts, for the layers that have them. One key pins the state
    dtype of both, and it is read after their sizes."""
    mamba = _mamba(f, hidden) if LayerKind.MAMBA in kinds else None
    linear = _linear_attention(f) if LayerKind.LINEAR in kinds else None
    state_dtype = _state_dtype(f) if mamba or linear else None
    if mamba is not None and state_dtype is not None:
        mamba = dataclasses.replace(mamba, state_dtype=state_dtype)
    if linear is not None and state_dtype is not None:
        linear = dataclasses.replace(linear, state_dtype=state_dtype)
    return mamba, linear


def _mamba(f: ConfigFields, hidden: int) -> Mamba:
    n_heads = f.int_("mamba_num_heads", "mamba_n_heads", minimum=1)
    if n_heads is not None:  # Mamba-2 (Nemotron-H, Falcon-H1, Granite-4)
        return Mamba2(
            num_heads=n_heads,
            head_dim=f.require_int("mamba_head_dim", "mamba_d_head", what="Mamba-2 head dimension"),
            state_size=f.require_int("ssm_state_size", "mamba_d_state", what="SSM state size"),
            conv_kernel=f.require_int("conv_kernel", "mamba_d_conv", what="SSM conv kernel"),
            num_groups=f.int_("n_groups", "mamba_n_groups", minimum=1) or 1,
        )
    expand = f.int_("mamba_expand", "expand", minimum=1) or 2  # Mamba-1 (Jamba)
    return Mamba1(
        inner_size=f.int_("mamba_d_inner", minimum=1) or expand * hidden,
        state_size=f.require_int("mamba_d_state", "state_size", "ssm_state_size", what="SSM state size"),
        conv_kernel=f.require_int("mamba_d_conv", "conv_kernel", what="SSM conv kernel"),
    )


def _linear_attention(f: ConfigFields) -> LinearAttention:
    """Gated delta net (Qwen3-Next, Qwen3.5)."""
    return LinearAttention(
        num_key_heads=f.require_int("linear_num_key_heads", what="linear-attention key heads"),
        num_value_heads=f.require_int("linear_num_value_heads", what="linear-attention value heads"),
        key_head_dim=f.require_int("linear_key_head_dim", what="linear-attention key head dim"),
        value_head_dim=f.require_int("linear_value_head_dim", what="linear-attention value head dim"),
        conv_kernel=f.require_int("linear_conv_kernel_dim", what="linear-attention conv kernel"),
    )


def _state_dtype(f: ConfigFields) -> str | None:
    key = f.first("mamba_ssm_dtype")
    if key is None:
        return None
    raw = f.data[key]
    if not (isinstance(raw, str) and raw.removeprefix("torch.") in _DTYPE_NAMES):
        raise f.error(key, f"unknown dtype {shown(raw)}")
    return _DTYPE_NAMES[raw.removeprefix("torch.")]


def _mla(f: ConfigFields) -> Mla:
    """MLA's projection sizes (the cache needs only the latent, read first)."""
    kv_lora_rank = f.require_int("kv_lora_rank", what="MLA kv_lora_rank")
    q_lora_rank = f.int_("q_lora_rank", minimum=1)
    qk_rope = f.require_int("qk_rope_head_dim", what="MLA qk_rope_head_dim")
    qk_nope = f.int_("qk_nope_head_dim", minimum=1) or 0
    return Mla(kv_lora_rank=kv_lora_rank, qk_rope_head_dim=qk_rope, qk_nope_head_dim=qk_nope,
               v_head_dim=f.int_("v_head_dim", minimum=1) or qk_nope, q_lora_rank=q_lora_rank)


# Model types whose transformers config ties embeddings when config.json omits the key; the
# others (Llama, Llama 4, Mistral, Qwen, DeepSeek, …) default to an untied lm_head.
_TIED_BY_DEFAULT = frozenset({"gemma", "gemma2", "gemma3", "gemma3_text", "gpt2", "falcon"})

# Llama 4's MoE layers always add one shared expert; its config has no key for it.
_ALWAYS_ONE_SHARED_EXPERT = frozenset({"llama4", "llama4_text"})


def _moe(f: ConfigFields, model_type: str | None) -> Moe | None:
    experts = f.int_("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts", minimum=0)
    if not experts:
        return None
    shared = f.int_("n_shared_experts", "num_shared_experts", minimum=0)
    if shared is None and model_type in _ALWAYS_ONE_SHARED_EXPERT:
        shared = 1
    return Moe(  # keywords in the order the config is read
        num_experts=experts,
        num_shared_experts=shared or 0,
        experts_per_token=f.int_("num_experts_per_tok", "experts_per_token", "moe_top_k", minimum=1),
        intermediate_size=f.int_("moe_intermediate_size", "intermediate_size", minimum=1),
        first_k_dense_layers=f.int_("first_k_dense_replace", minimum=0) or 0,
        layer_freq=f.int_("moe_layer_freq", "decoder_sparse_step", "interleave_moe_layer_step",
                          "expert_layer_period", minimum=1) or 1,
    )


def _dtype(f: ConfigFields, top: ConfigFields) -> str:
    """torch_dtype/dtype of the text model, else of the whole config, else bfloat16."""
    for fields in (f, top):
        key = fields.first("torch_dtype", "dtype")
        if key is None:
            continue
        raw = fields.data[key]
        if isinstance(raw, str) and raw.removeprefix("torch.") in _DTYPE_NAMES:
            return _DTYPE_NAMES[raw.removeprefix("torch.")]
        raise fields.error(key, f"unknown dtype {shown(raw)} (known: {', '.join(sorted(_DTYPE_NAMES))})")
    return "bfloat16"


def _quantization(top: ConfigFields, f: ConfigFields, num_layers: int
                  ) -> tuple[str | None, int | None, Quantization | None]:
    """The method and weight bits the config names, and the whole scheme where kvtune knows the
    format (kvtune.model.quantization)."""
    for fields in (top, f):
        q = fields.data.get("quantization_config")
        if isinstance(q, dict):
            break
    else:
        return None, None, None
    scheme = parse_quantization(fields, q, num_layers=num_layers)
    qf = ConfigFields(q, path=top.path, prefix="quantization_config.")
    method = qf.str_("quant_method") or (scheme.method if scheme else None)
    bits = qf.int_("bits", "w_bit", "weight_bits", "num_bits", minimum=1)
    if bits is None and method == "compressed-tensors":
        groups = q.get("config_groups")
        for group in (groups.values() if isinstance(groups, dict) else ()):
            weights = group.get("weights") if isinstance(group, dict) else None
            if isinstance(weights, dict) and isinstance(weights.get("num_bits"), int):
                bits = weights["num_bits"]
                break
    if bits is None and scheme is not None:
        bits = scheme.weight_bits
    if bits is None and method is not None:
        bits = _QUANT_BITS.get(method)
    return method, bits, scheme


def _max_model_len(f: ConfigFields, model_type: str | None) -> int | None:
    """vLLM's derived max_model_len: smallest length key, model_max_length wins, RoPE factor applied."""
    lengths = {}
    for key in _MAX_LEN_KEYS:
        value = f.data.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0:
            lengths[key] = value
    if not lengths:
        return None
    derived: float = lengths.get("model_max_length") or min(lengths.values())
    rope = f.data.get("rope_scaling") or f.data.get("rope_parameters")
    if isinstance(rope, dict) and "gemma3" not in (model_type or ""):
        rope_type = rope.get("rope_type", rope.get("type"))
        if rope_type not in ("su", "longrope", "llama3", None, "default"):
            factor = rope.get("factor", 1.0)
            if rope_type == "yarn" and isinstance(rope.get("original_max_position_embeddings"), (int, float)):
                derived = rope["original_max_position_embeddings"]
            if isinstance(factor, (int, float)) and math.isfinite(factor):
                derived *= factor
    return int(derived)
