"""What a model is, as KV-cache and weight arithmetic need it: the layer kinds and ModelSpec.

Every model has attention heads; the other parts (MLA, Mamba, linear attention, experts) are
present exactly when the model has such layers, and hold only sizes the config gave or the
parser settled, so arithmetic on a part never meets None.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TypeAlias


class LayerKind(enum.Enum):
    """What one decoder layer keeps per request."""

    FULL = "full"  # full attention: K and V for every token
    SLIDING = "sliding"  # sliding-window attention (window = Attention.sliding_window)
    CHUNKED = "chunked"  # chunked-local attention, Llama-4 (window = Attention.chunk_size)
    MLA = "mla"  # multi-head latent attention, DeepSeek: one latent per token
    MAMBA = "mamba"  # state-space layer: fixed conv + ssm state per sequence
    LINEAR = "linear"  # linear attention (gated delta net): fixed state per sequence
    NONE = "none"  # no cache at all (Nemotron-H MLP/MoE-only layers)


ATTENTION_KINDS = frozenset({LayerKind.FULL, LayerKind.SLIDING, LayerKind.CHUNKED, LayerKind.MLA})
STATE_KINDS = frozenset({LayerKind.MAMBA, LayerKind.LINEAR})


@dataclass(frozen=True, slots=True)
class Attention:
    """The attention heads, and what one attention layer caches per token as vLLM counts it:
    num_kv_heads × (head_dim + head_dim_v). MLA caches one latent: 1 head, no separate V."""

    num_heads: int  # query heads
    num_kv_heads: int
    head_dim: int  # K head size (MLA: kv_lora_rank + qk_rope_head_dim)
    head_dim_v: int  # V head size (== head_dim normally; 0 for MLA)
    sliding_window: int | None = None  # tokens a SLIDING layer attends to; None when no layer slides
    chunk_size: int | None = None  # tokens a CHUNKED layer attends to (attention_chunk_size), when given


@dataclass(frozen=True, slots=True)
class Mla:
    """DeepSeek's multi-head latent attention projections: K and V come from one low-rank latent."""

    kv_lora_rank: int
    qk_rope_head_dim: int
    qk_nope_head_dim: int  # 0 when the config gives none
    v_head_dim: int  # the config's, else qk_nope_head_dim
    q_lora_rank: int | None  # None: q is projected from the hidden state directly, not through a latent


@dataclass(frozen=True, slots=True)
class Mamba1:
    """Mamba-1 layers (Jamba): conv state inner × (conv_kernel − 1), ssm state inner × state_size."""

    inner_size: int
    state_size: int
    conv_kernel: int
    state_dtype: str | None = None  # the ssm state's dtype when the config pins one; None: the model's


@dataclass(frozen=True, slots=True)
class Mamba2:
    """Mamba-2 layers (Nemotron-H, Falcon-H1, Granite-4): conv state (inner + 2·groups·state_size) ×
    (conv_kernel − 1), ssm state num_heads × head_dim × state_size."""

    num_heads: int
    head_dim: int
    state_size: int
    conv_kernel: int
    num_groups: int
    state_dtype: str | None = None  # the ssm state's dtype when the config pins one; None: the model's

    @property
    def inner_size(self) -> int:
        return self.num_heads * self.head_dim


Mamba: TypeAlias = Mamba1 | Mamba2


@dataclass(frozen=True, slots=True)
class LinearAttention:
    """Gated delta net layers (Qwen3-Next, Qwen3.5): conv state over 2·keys + values channels,
    recurrent state key_head_dim × value_head_dim per value head."""

    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int
    state_dtype: str | None = None  # the recurrent state's dtype when the config pins one; None: the model's


@dataclass(frozen=True, slots=True)
class Moe:
    """Routed experts: how many, how wide, and which layers have them (DeepSeek's rule: dense for
    the first first_k_dense_layers, then every layer_freq-th layer)."""

    num_experts: int
    num_shared_experts: int
    first_k_dense_layers: int
    layer_freq: int
    # What a config may leave out; each reader says what it assumes then.
    experts_per_token: int | None
    intermediate_size: int | None  # one routed expert's FFN width


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """One model's architecture as vLLM sizes it. Counts are totals, before any TP split."""

    name: str
    architecture: str | None
    model_type: str | None
    num_layers: int
    layer_kinds: tuple[LayerKind, ...]
    attention: Attention
    hidden_size: int
    intermediate_size: int | None
    vocab_size: int | None
    tie_word_embeddings: bool
    mla: Mla | None = None  # present when the layers are MLA
    mamba: Mamba | None = None  # present when some layers are Mamba
    linear: LinearAttention | None = None  # present when some layers are linear attention
    moe: Moe | None = None  # present when the model has routed experts
    dtype: str = "bfloat16"
    quantization: str | None = None
    quantization_bits: int | None = None
    max_position_embeddings: int | None = None
    source_dir: str | None = None
    serve_id: str | None = None  # what `vllm serve` loads: a hub id or a model directory

    def __post_init__(self) -> None:
        """A part comes with its layers, so code that finds the layers can rely on the part."""
        if len(self.layer_kinds) != self.num_layers:
            raise ValueError(f"{self.name}: {len(self.layer_kinds)} layer kinds for {self.num_layers} layers")
        for kind, part in ((LayerKind.MLA, self.mla), (LayerKind.MAMBA, self.mamba), (LayerKind.LINEAR, self.linear)):
            if (kind in self.layer_kinds) != (part is not None):
                raise ValueError(f"{self.name}: {kind.value} layers and the {kind.value} part come together")

    @property
    def is_mla(self) -> bool:
        return self.mla is not None

    @property
    def is_moe(self) -> bool:
        return self.moe is not None

    def count(self, kind: LayerKind) -> int:
        """How many layers are of `kind`."""
        return sum(1 for k in self.layer_kinds if k is kind)

    @property
    def num_attention_layers(self) -> int:
        return sum(1 for k in self.layer_kinds if k in ATTENTION_KINDS)
