"""What a model is, as KV-cache and weight arithmetic need it: the layer kinds and ModelSpec."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class LayerKind(enum.Enum):
    """What one decoder layer keeps per request."""

    FULL = "full"  # full attention: K and V for every token
    SLIDING = "sliding"  # sliding-window attention (window = ModelSpec.sliding_window)
    CHUNKED = "chunked"  # chunked-local attention, Llama-4 (window = attention_chunk_size)
    MLA = "mla"  # multi-head latent attention, DeepSeek: one latent per token
    MAMBA = "mamba"  # state-space layer: fixed conv + ssm state per sequence
    LINEAR = "linear"  # linear attention (gated delta net): fixed state per sequence
    NONE = "none"  # no cache at all (Nemotron-H MLP/MoE-only layers)


ATTENTION_KINDS = frozenset({LayerKind.FULL, LayerKind.SLIDING, LayerKind.CHUNKED, LayerKind.MLA})
STATE_KINDS = frozenset({LayerKind.MAMBA, LayerKind.LINEAR})


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """One model's architecture as vLLM sizes it. Counts are totals, before any TP split."""

    name: str
    architecture: str | None
    model_type: str | None
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int  # K head size (MLA: kv_lora_rank + qk_rope_head_dim)
    head_dim_v: int  # V head size (== head_dim normally; 0 for MLA, which has no separate V)
    layer_kinds: tuple[LayerKind, ...]
    sliding_window: int | None
    attention_chunk_size: int | None
    hidden_size: int
    intermediate_size: int | None
    vocab_size: int | None
    tie_word_embeddings: bool
    # MoE (None when dense)
    num_experts: int | None = None
    num_experts_per_tok: int | None = None
    moe_intermediate_size: int | None = None  # one routed expert's FFN width
    num_shared_experts: int | None = None
    first_k_dense_layers: int | None = None
    moe_layer_freq: int | None = None
    # MLA (None when not MLA)
    kv_lora_rank: int | None = None
    q_lora_rank: int | None = None
    qk_rope_head_dim: int | None = None
    qk_nope_head_dim: int | None = None
    v_head_dim: int | None = None
    # Mamba layers (None when absent). Mamba-1: d_inner × (d_conv−1) conv + d_inner × d_state ssm;
    # Mamba-2: (d_inner + 2·groups·d_state) × (d_conv−1) conv + heads × head_dim × d_state ssm.
    mamba_version: int | None = None
    ssm_inner_size: int | None = None
    ssm_state_size: int | None = None
    ssm_conv_kernel: int | None = None
    ssm_num_heads: int | None = None
    ssm_head_dim: int | None = None
    ssm_num_groups: int | None = None
    # Linear-attention layers (gated delta net, Qwen3-Next; None when absent)
    linear_num_key_heads: int | None = None
    linear_num_value_heads: int | None = None
    linear_key_head_dim: int | None = None
    linear_value_head_dim: int | None = None
    linear_conv_kernel: int | None = None
    ssm_state_dtype: str | None = None  # dtype of the ssm/recurrent state when the config pins one (Qwen3.5: float32)
    dtype: str = "bfloat16"
    quantization: str | None = None
    quantization_bits: int | None = None
    max_position_embeddings: int | None = None
    source_dir: str | None = None
    serve_id: str | None = None  # what `vllm serve` loads: a hub id or a model directory

    @property
    def is_mla(self) -> bool:
        return LayerKind.MLA in self.layer_kinds

    @property
    def is_moe(self) -> bool:
        return self.num_experts is not None

    def count(self, kind: LayerKind) -> int:
        """How many layers are of `kind`."""
        return sum(1 for k in self.layer_kinds if k is kind)

    @property
    def num_attention_layers(self) -> int:
        return sum(1 for k in self.layer_kinds if k in ATTENTION_KINDS)
