"""How many bytes of weights a model puts on each GPU: the first thing the KV pool loses.

The checkpoint's own size wins when a local model directory has one (the safetensors index's
`metadata.total_size`, or a single model.safetensors). Otherwise the parameters are counted from
the config (embeddings, attention or MLA projections, dense MLPs, routed and shared experts,
Mamba / linear-attention mixers, lm_head unless tied) and priced at the checkpoint's format
(kvtune.model.quantization reads `quantization_config`): quantized parts at their stored bits with
their scales, zero points and indices (fp8 1 byte + fp32 block or tensor scales, AWQ int4 4.16
bits with group-128 fp16 scales and zeros, mxfp4 4.25 bits on the experts only, NVFP4 4.5 bits),
the parts the format keeps (embeddings, lm_head, routers, excluded modules) at 16 bits. Biases are
ignored. Every such choice is listed in `WeightsEstimate.assumptions`.
"""

from __future__ import annotations

import enum
import math
import os
from dataclasses import dataclass
from pathlib import Path

from kvtune import userfiles
from kvtune.errors import InputError
from kvtune.model import ATTENTION_KINDS, Attention, LayerKind, LinearAttention, Mamba, Mamba1, Mla, ModelSpec, Moe
from kvtune.model.spec import QUANTIZABLE_PARTS, Quantization

# Bits per weight, scales included, for formats that quantize the linear layers.
INT4_GROUP128_BITS = 4 + (16 + 4) / 128  # 4-bit weight + a 16-bit scale and a 4-bit zero per 128
NVFP4_BITS = 4 + 8 / 16  # 4-bit weight + an fp8 scale per 16
MXFP4_BITS = 4 + 8 / 32  # 4-bit weight + an 8-bit shared exponent per 32

_DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "float32": 2, "float8_e4m3fn": 1, "float8_e5m2": 1}
# Two-matrix MLPs (up, down); Nemotron-H's is a squared-ReLU MLP. Everything else is gated (3 matrices).
_NON_GATED_MLP = {"gpt2", "gpt_bigcode", "gpt_neox", "gptj", "falcon", "opt", "bloom", "phi", "starcoder2", "mpt",
                  "nemotron_h"}


class WeightsSource(enum.Enum):
    """Where a weights figure came from."""

    SAFETENSORS_INDEX = "safetensors-index"  # metadata.total_size of model.safetensors.index.json
    SAFETENSORS_FILE = "safetensors-file"  # size of a single model.safetensors
    PARAMETER_COUNT = "parameter-count"  # counted from the config, priced per format


@dataclass(frozen=True, slots=True)
class ParameterCount:
    """Parameters by part, whole model (before any TP/PP split)."""

    embedding: int
    lm_head: int
    attention: int  # q/k/v/o or the MLA projections, all attention layers
    mixer: int  # Mamba and linear-attention layers' projections
    dense_mlp: int
    routed_experts: int
    shared_experts: int
    router: int
    norms: int

    @property
    def total(self) -> int:
        return (
            self.embedding + self.lm_head + self.attention + self.mixer + self.dense_mlp
            + self.routed_experts + self.shared_experts + self.router + self.norms
        )  # fmt: skip


@dataclass(frozen=True, slots=True)
class WeightsEstimate:
    """Weight bytes held in GPU memory for the whole model, with how they were found."""

    weights_bytes: int
    source: WeightsSource
    weight_format: str
    parameter_count: int | None
    assumptions: tuple[str, ...]

    def bytes_per_gpu(self, tp: int = 1, pp: int = 1) -> int:
        """Largest per-GPU share, assuming an even split over tp × pp ranks."""
        return math.ceil(self.weights_bytes / (tp * pp))


# --- counting --------------------------------------------------------------------------------


def _attention_params(attention: Attention, h: int) -> int:
    q = h * attention.num_heads * attention.head_dim
    k = h * attention.num_kv_heads * attention.head_dim
    v = h * attention.num_kv_heads * attention.head_dim_v
    o = attention.num_heads * attention.head_dim_v * h
    return q + k + v + o


def _mla_params(mla: Mla, heads: int, h: int) -> int:
    rope, nope, v_dim, rank = mla.qk_rope_head_dim, mla.qk_nope_head_dim, mla.v_head_dim, mla.kv_lora_rank
    if mla.q_lora_rank is not None:  # q_a (+ its norm) then q_b
        q = h * mla.q_lora_rank + mla.q_lora_rank + mla.q_lora_rank * heads * (nope + rope)
    else:
        q = h * heads * (nope + rope)
    kv_a = h * (rank + rope) + rank  # the latent and the shared rope key, + latent norm
    kv_b = rank * heads * (nope + v_dim)
    o = heads * v_dim * h
    return q + kv_a + kv_b + o


def _mamba_params(mamba: Mamba, h: int) -> int:
    d_inner, d_state, kernel = mamba.inner_size, mamba.state_size, mamba.conv_kernel
    if isinstance(mamba, Mamba1):
        dt_rank = math.ceil(h / 16)
        in_proj = h * 2 * d_inner
        x_proj = d_inner * (dt_rank + 2 * d_state)
        dt_proj = dt_rank * d_inner + d_inner
        return in_proj + d_inner * kernel + x_proj + dt_proj + d_inner * d_state + d_inner + d_inner * h
    groups, heads = mamba.num_groups, mamba.num_heads
    conv_dim = d_inner + 2 * groups * d_state
    in_proj = h * (2 * d_inner + 2 * groups * d_state + heads)
    return in_proj + conv_dim * kernel + d_inner * h + 3 * heads + d_inner


def _gated_delta_net_params(linear: LinearAttention, h: int) -> int:
    nk, nv = linear.num_key_heads, linear.num_value_heads
    dk, dv = linear.key_head_dim, linear.value_head_dim
    qkvz = h * (2 * nk * dk + 2 * nv * dv)
    ba = h * 2 * nv
    conv = (2 * nk * dk + nv * dv) * linear.conv_kernel
    return qkvz + ba + conv + nv * dv * h


def _mixer_params(spec: ModelSpec) -> dict[LayerKind, int]:
    """Parameters of one layer's attention or state mixer, by layer kind."""
    h = spec.hidden_size
    out = dict.fromkeys(ATTENTION_KINDS, _attention_params(spec.attention, h))
    if spec.mla is not None:
        out[LayerKind.MLA] = _mla_params(spec.mla, spec.attention.num_heads, h)
    if spec.mamba is not None:
        out[LayerKind.MAMBA] = _mamba_params(spec.mamba, h)
    if spec.linear is not None:
        out[LayerKind.LINEAR] = _gated_delta_net_params(spec.linear, h)
    return out


def _is_moe_layer(moe: Moe, index: int) -> bool:
    """DeepSeek's rule: dense for the first k layers, then MoE every `layer_freq`-th layer."""
    return index >= moe.first_k_dense_layers and index % moe.layer_freq == 0


def count_parameters(spec: ModelSpec) -> ParameterCount:
    """Parameters from the architecture alone; biases and rotary buffers are left out."""
    h = spec.hidden_size
    vocab = spec.vocab_size or 0
    gated = (spec.model_type or "") not in _NON_GATED_MLP
    mlp_mats = 3 if gated else 2
    dense_width = spec.intermediate_size or 4 * h
    # Nemotron-H: each layer is one of attention, mamba or MLP; elsewhere every layer has an MLP.
    mlp_only_on_plain_layers = (spec.model_type or "") == "nemotron_h"
    mixers = _mixer_params(spec)
    moe = spec.moe

    attention = mixer = dense = routed = shared = router = 0
    for i, kind in enumerate(spec.layer_kinds):
        if kind in ATTENTION_KINDS:
            attention += mixers[kind]
        else:
            mixer += mixers.get(kind, 0)
        if mlp_only_on_plain_layers and kind is not LayerKind.NONE:
            continue
        if moe is not None and _is_moe_layer(moe, i):
            # an expert whose width the config leaves out is priced as wide as the dense MLP
            expert = mlp_mats * h * (dense_width if moe.intermediate_size is None else moe.intermediate_size)
            routed += moe.num_experts * expert
            shared += moe.num_shared_experts * expert
            router += h * moe.num_experts
        else:
            dense += mlp_mats * h * dense_width
    return ParameterCount(
        embedding=vocab * h,
        lm_head=0 if spec.tie_word_embeddings else vocab * h,
        attention=attention,
        mixer=mixer,
        dense_mlp=dense,
        routed_experts=routed,
        shared_experts=shared,
        router=router,
        norms=2 * h * spec.num_layers + h,
    )


# --- pricing ---------------------------------------------------------------------------------


def legacy_quantization(method: str | None, bits: int | None) -> Quantization | None:
    """A scheme for a config that names only a method and bits (or a spec built by hand): the
    format's usual layout. None when the method says nothing about the width."""
    if not method:
        return None
    m = method.lower()
    if m == "mxfp4":
        return Quantization(m, 4, "mxfp4", 32, 8,
                            unquantized=tuple((p, 1.0) for p in QUANTIZABLE_PARTS if p != "routed_experts"))
    if "nvfp4" in m or m == "modelopt_fp4":
        return Quantization(m, 4, "nvfp4", 16, 8, activations="fp4")
    if bits is not None and bits <= 4 or m in {"awq", "gptq", "awq_marlin", "gptq_marlin", "marlin"}:
        b = bits or 4
        return Quantization(m, b, "int", 128, 16, zero_point_bits=4)  # group-128 fp16 scales, 4-bit zeros
    if bits == 8 or "fp8" in m or "int8" in m or "w8a8" in m:
        return Quantization(m, 8, "float" if "fp8" in m else "int", 0, 32,
                            activations="fp8" if "fp8" in m else "int8" if "w8a8" in m else None)
    if bits is not None and bits < 16:  # 16 bits and more is no quantization at all
        return Quantization(m, bits, "int", 0, 32)
    return None


def quantization_of(spec: ModelSpec) -> Quantization | None:
    """The checkpoint's scheme (kvtune.model.quantization), else the one its method and bits imply."""
    return spec.quantization_config or legacy_quantization(spec.quantization, spec.quantization_bits)


def _part_sizes(count: ParameterCount) -> dict[str, int]:
    return {part: getattr(count, part) for part in QUANTIZABLE_PARTS}


def quantized_parameters(spec: ModelSpec, count: ParameterCount | None = None) -> dict[str, int]:
    """Parameters stored quantized, by part (empty for a 16-bit checkpoint)."""
    scheme = quantization_of(spec)
    if scheme is None:
        return {}
    count = count or count_parameters(spec)
    return {part: round(n * (1 - scheme.unquantized_share(part))) for part, n in _part_sizes(count).items() if n}


def active_parameters(spec: ModelSpec) -> tuple[int, int]:
    """(parameters a token computes with, of which quantized): a MoE's routed experts count at
    top-k / experts (1 of them where the config names no top-k)."""
    count = count_parameters(spec)
    quantized = quantized_parameters(spec, count)
    share = 1.0
    moe = spec.moe
    if moe is not None and moe.num_experts and count.routed_experts:
        k = moe.experts_per_token if moe.experts_per_token is not None else 1
        share = min(k, moe.num_experts) / moe.num_experts
    routed_inactive = count.routed_experts - round(count.routed_experts * share)
    q_routed = quantized.get("routed_experts", 0)
    q_inactive = q_routed - round(q_routed * share)
    return count.total - routed_inactive, sum(quantized.values()) - q_inactive


def estimate_from_parameters(spec: ModelSpec) -> WeightsEstimate:
    """Price the parameter count at the model's weight format: quantized parts at their stored bits
    (scales, zero points and indices included), the rest at 16 bits."""
    count = count_parameters(spec)
    dtype_bytes = _DTYPE_BYTES.get(spec.dtype, 2)
    scheme = quantization_of(spec)
    assumptions = [
        f"parameters counted from the config: {count.total:,} (biases and norms' bias terms ignored)",
    ]
    if spec.dtype == "float32":
        assumptions.append("float32 checkpoint served as 16-bit, as vLLM's dtype=auto does")
    if (spec.model_type or "") in _NON_GATED_MLP:
        assumptions.append("MLP with 2 matrices (not gated)")
    else:
        assumptions.append("gated MLP with 3 matrices (gate, up, down)")
    if spec.moe is not None:
        assumptions.append(
            f"MoE layers: from layer {spec.moe.first_k_dense_layers}, every {spec.moe.layer_freq} "
            f"layer(s); {spec.moe.num_experts} routed + {spec.moe.num_shared_experts} shared experts each"
        )
    if spec.mamba is not None or spec.linear is not None:
        assumptions.append("Mamba / linear-attention mixer parameters from the state sizes in the config")
    if scheme is None:
        fmt = spec.dtype if not spec.quantization else f"{spec.quantization} (unknown width, priced as {spec.dtype})"
        return WeightsEstimate(weights_bytes=count.total * dtype_bytes, source=WeightsSource.PARAMETER_COUNT,
                               weight_format=fmt, parameter_count=count.total, assumptions=tuple(assumptions))
    quantized = quantized_parameters(spec, count)
    h = spec.hidden_size
    bits_per_weight = scheme.bits_per_weight(h, h)  # matrices taken as hidden × hidden for the scales' share
    quantized_total = sum(quantized.values())
    weights = (count.total - quantized_total) * 2 + math.ceil(quantized_total * bits_per_weight / 8)
    kept = [f"{part} ({share:.0%} of its layers)" if share < 1 else part
            for part, share in scheme.unquantized if _part_sizes(count).get(part)]
    assumptions.append(f"quantized: {scheme.describe()}, {bits_per_weight:.4g} bits per weight stored "
                       "(scales, zero points and indices included)")
    assumptions.append("16-bit: embeddings, norms, router" + (", " + ", ".join(kept) if kept else ""))
    return WeightsEstimate(
        weights_bytes=weights,
        source=WeightsSource.PARAMETER_COUNT,
        weight_format=scheme.describe(),
        parameter_count=count.total,
        assumptions=tuple(assumptions),
    )


def estimate_weights(spec: ModelSpec, *, checkpoint_bytes: int | None = None,
                     checkpoint_source: WeightsSource | None = None) -> WeightsEstimate:
    """The checkpoint size when known (halved for float32 checkpoints served as 16-bit), else a count."""
    if checkpoint_bytes is None:
        return estimate_from_parameters(spec)
    assumptions = [f"checkpoint size from {(checkpoint_source or WeightsSource.SAFETENSORS_INDEX).value}"]
    weights = checkpoint_bytes
    if spec.dtype == "float32" and not spec.quantization:
        weights = checkpoint_bytes // 2
        assumptions.append("float32 checkpoint served as 16-bit: half its size, as vLLM's dtype=auto does")
    return WeightsEstimate(
        weights_bytes=weights,
        source=checkpoint_source or WeightsSource.SAFETENSORS_INDEX,
        weight_format=spec.quantization or spec.dtype,
        parameter_count=None,
        assumptions=tuple(assumptions),
    )


# --- the edge: reading a local checkpoint -----------------------------------------------------


def read_checkpoint_bytes(model_dir: str | os.PathLike[str]) -> tuple[int, WeightsSource] | None:
    """Tensor bytes of a local safetensors checkpoint, or None when the directory has none."""
    directory = Path(model_dir)
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        data = userfiles.load_json(index, max_bytes=userfiles.MODEL_FILE_MAX_BYTES, strict=False)
        metadata = data.get("metadata") if isinstance(data, dict) else None
        total = metadata.get("total_size") if isinstance(metadata, dict) else None
        if isinstance(total, float) and total.is_integer():
            total = int(total)
        if not isinstance(total, int) or isinstance(total, bool) or total <= 0:
            raise InputError("expected a positive integer", path=str(index), field="metadata.total_size")
        return total, WeightsSource.SAFETENSORS_INDEX
    single = directory / "model.safetensors"
    if single.is_file():
        return single.stat().st_size, WeightsSource.SAFETENSORS_FILE
    return None


def weights_for(spec: ModelSpec) -> WeightsEstimate:
    """Weights of `spec`: from its local checkpoint when there is one, else counted."""
    found = read_checkpoint_bytes(spec.source_dir) if spec.source_dir else None
    if found is None:
        return estimate_from_parameters(spec)
    return estimate_weights(spec, checkpoint_bytes=found[0], checkpoint_source=found[1])


__all__ = [
    "WeightsSource",
    "ParameterCount",
    "WeightsEstimate",
    "count_parameters",
    "estimate_from_parameters",
    "legacy_quantization",
    "quantization_of",
    "quantized_parameters",
    "active_parameters",
    "estimate_weights",
    "read_checkpoint_bytes",
    "weights_for",
]
