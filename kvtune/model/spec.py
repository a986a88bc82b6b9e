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


#: The parts of a model whose matmul weights a checkpoint may quantize (kvtune.weights.ParameterCount's
#: names); embeddings, norms and routers always stay at the model's dtype.
QUANTIZABLE_PARTS = ("attention", "mixer", "dense_mlp", "routed_experts", "shared_experts", "lm_head")


@dataclass(frozen=True, slots=True)
class Quantization:
    """How a checkpoint stores its linear layers and which dtype their matmuls run in.

    Read from config.json's `quantization_config` (or a ModelOpt hf_quant_config.json) by
    kvtune.model.quantization; priced by kvtune.weights and the roofline (kvtune.capacity.timing).
    """

    method: str  # quant_method as the config names it (ModelOpt's: modelopt)
    weight_bits: int  # bits of each stored weight
    weight_type: str  # int | float | mxfp4 | nvfp4
    #: weights sharing one scale along the input dimension; None: one scale per output row
    #: (per channel); 0: one per tensor
    group_size: int | None
    scale_bits: int  # bits of each stored scale (16: fp16/bf16, 32: fp32, 8: e8m0 or fp8)
    zero_point_bits: int = 0  # bits of each stored zero point (0: symmetric, none stored)
    block: tuple[int, int] | None = None  # a 2-D block scale (rows, columns), e.g. DeepSeek's 128 × 128
    #: GEMM input dtype when activations are quantized too (fp8, int8, fp4); None: weight-only,
    #: the matmul runs at 16 bits on dequantized weights
    activations: str | None = None
    index_bits: int = 0  # per input column per matrix: GPTQ's act-order g_idx (int32)
    #: part -> share of its layers stored unquantized (1.0: the whole part, e.g. lm_head)
    unquantized: tuple[tuple[str, float], ...] = (("lm_head", 1.0),)

    def unquantized_share(self, part: str) -> float:
        return dict(self.unquantized).get(part, 0.0)

    def bits_per_weight(self, in_features: int, out_features: int) -> float:
        """Stored bits per weight of one quantized matrix, its scales, zeros and indices included."""
        if self.block is not None:
            per_scale = self.block[0] * self.block[1]
        elif self.group_size is None:
            per_scale = in_features
        elif self.group_size == 0:
            per_scale = in_features * out_features
        else:
            per_scale = min(self.group_size, in_features)
        return (self.weight_bits + (self.scale_bits + self.zero_point_bits) / per_scale
                + self.index_bits / out_features)

    @property
    def weight_only(self) -> bool:
        return self.activations is None

    def describe(self) -> str:
        if self.group_size is None and self.block is None:
            scales = "per-channel scales"
        elif self.block is not None:
            scales = f"{self.block[0]}x{self.block[1]} block scales"
        elif self.group_size == 0:
            scales = "per-tensor scales"
        else:
            scales = f"group-{self.group_size} scales" + (" and zeros" if self.zero_point_bits else "")
        kind = {"int": f"int{self.weight_bits}", "float": f"fp{self.weight_bits}"}.get(self.weight_type,
                                                                                     self.weight_type)
        if self.activations is None:
            act = f"W{self.weight_bits}A16"
        else:
            act = f"W{self.weight_bits}A{4 if self.activations == 'fp4' else 8} ({self.activations} GEMMs)"
        method = "" if self.method == kind else f"{self.method} "
        return f"{method}{kind} {act}, {scales}"


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
    quantization_config: Quantization | None = None  # the full scheme, when the config says enough
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
