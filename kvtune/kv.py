"""KV-cache bytes per token, and state bytes per sequence, for a ModelSpec under TP and PP.

Pure arithmetic in vLLM V1's terms (vllm/v1/kv_cache_interface.py): one attention layer stores
kv_heads × (head_size + head_size_v) × dtype bytes per token; MLA stores one latent of
kv_lora_rank + qk_rope_head_dim per token, no V, replicated on every TP rank. Mamba and
linear-attention layers hold a fixed state per sequence instead, reported separately.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtune.errors import CapacityError, UnknownNameError
from kvtune.model import ATTENTION_KINDS, Attention, LayerKind, LinearAttention, Mamba, Mamba1, ModelSpec

# vLLM CacheDType names → bytes per element (STR_DTYPE_TO_TORCH_DTYPE; the fp8, int8 and
# per-token-head variants are stored as one-byte integers). None: the model's own dtype.
_KV_DTYPE_BYTES: dict[str, int | None] = {
    "auto": None,
    "bfloat16": 2,
    "float16": 2,
    "half": 2,
    "fp8": 1,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
    "fp8_inc": 1,
    "int8_per_token_head": 1,
    "fp8_per_token_head": 1,
    "int4_per_token_head": 1,
    "nvfp4": 1,  # packed: head_size/2 bytes of values + head_size/16 bytes of scales per head
    "fp8_ds_mla": 1,  # MLA only: a fixed 656-byte state per token per layer
    "nvfp4_ds_mla": 1,  # MLA only: a fixed 352-byte state per token per layer
}
# Names vLLM accepts whose byte layout kvtune does not model yet.
_KV_DTYPES_UNMODELLED = frozenset({
    "turboquant_k8v4", "turboquant_4bit_nc", "turboquant_k3v4_nc", "turboquant_3bit_nc", "octave_k3v4",
    "octave_k3v3", "octave_k3v3_compact", "ultraquant_4bit", "nvfp4_4over6",
})
_MLA_OPAQUE_BYTES = {"fp8_ds_mla": 656, "nvfp4_ds_mla": 352}
_MODEL_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


@dataclass(frozen=True, slots=True)
class LayerKv:
    """The layers of one kind and what they store per token, all ranks together."""

    kind: LayerKind
    count: int
    window: int | None  # tokens a sliding/chunked layer attends to; None for full attention
    kv_bytes_per_token: int


@dataclass(frozen=True, slots=True)
class KvBytes:
    """What one token (and one sequence's fixed state) costs in cache, in total and per GPU."""

    model: str
    kv_cache_dtype: str
    bytes_per_element: int
    attention: str  # mha | gqa | mqa | mla | hybrid
    num_layers: int
    num_kv_heads: int
    head_dim: int
    kv_bytes_per_token: int
    tensor_parallel_size: int
    pipeline_parallel_size: int
    kv_bytes_per_token_per_gpu: int
    layers: tuple[LayerKv, ...]
    state_bytes_per_sequence: int
    state_bytes_per_sequence_per_gpu: int
    num_kv_heads_per_gpu: int = 0
    stage_layers: tuple[int, ...] = ()  # decoder layers per PP stage, vLLM's get_pp_indices split

    @property
    def kv_kib_per_token(self) -> float:
        return self.kv_bytes_per_token / 1024

    def to_dict(self) -> dict:
        """The stable `--json` shape: integers in bytes, layer kinds by name."""
        return {
            "model": self.model,
            "kv_cache_dtype": self.kv_cache_dtype,
            "bytes_per_element": self.bytes_per_element,
            "num_layers": self.num_layers,
            "attention": self.attention,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "tensor_parallel_size": self.tensor_parallel_size,
            "pipeline_parallel_size": self.pipeline_parallel_size,
            "num_kv_heads_per_gpu": self.num_kv_heads_per_gpu,
            "kv_bytes_per_token_per_gpu": self.kv_bytes_per_token_per_gpu,
            "layers": [
                {"kind": layer.kind.value, "count": layer.count, "window": layer.window,
                 "kv_bytes_per_token": layer.kv_bytes_per_token}
                for layer in self.layers
            ],
            "stage_layers": list(self.stage_layers),
            "state_bytes_per_sequence": self.state_bytes_per_sequence,
            "state_bytes_per_sequence_per_gpu": self.state_bytes_per_sequence_per_gpu,
        }


def kv_cache_dtype_names() -> list[str]:
    """The --kv-cache-dtype values kvtune can size."""
    return list(_KV_DTYPE_BYTES)


def bytes_per_element(kv_cache_dtype: str, model_dtype: str) -> int:
    """Bytes one cached element takes; `auto` follows the model, float32 served as 16-bit like vLLM."""
    name = kv_cache_dtype.lower()
    if name in _KV_DTYPES_UNMODELLED:
        raise UnknownNameError(
            f"kv-cache dtype {kv_cache_dtype!r} is a vLLM name whose byte layout kvtune does not model; "
            f"use one of: {', '.join(_KV_DTYPE_BYTES)}",
            field="kv_cache_dtype",
        )
    if name not in _KV_DTYPE_BYTES:
        import difflib  # only for a name that is not known

        close = difflib.get_close_matches(name, list(_KV_DTYPE_BYTES), n=2, cutoff=0.6)
        hint = f" (did you mean {' or '.join(close)}?)" if close else ""
        raise UnknownNameError(
            f"unknown kv-cache dtype {kv_cache_dtype!r}{hint}; valid: {', '.join(_KV_DTYPE_BYTES)}",
            field="kv_cache_dtype",
        )
    fixed = _KV_DTYPE_BYTES[name]
    if fixed is not None:
        return fixed
    return min(2, _MODEL_DTYPE_BYTES[model_dtype])  # vLLM downcasts float32 to bfloat16


def pp_stage_sizes(num_layers: int, pp: int) -> tuple[int, ...]:
    """Layers per pipeline stage as vLLM's get_pp_indices splits them: even, the remainder
    going one each to the stages before the last, counting backwards."""
    if pp < 1 or pp > num_layers:
        raise CapacityError(f"pipeline-parallel size {pp} must be between 1 and the model's {num_layers} layers")
    sizes = [num_layers // pp] * pp
    for i in range(2, num_layers % pp + 2):
        sizes[-i] += 1
    return tuple(sizes)


def check_tensor_parallel(spec: ModelSpec, tp: int) -> None:
    """Reject the TP sizes vLLM rejects at startup, naming the numbers."""
    if tp < 1:
        raise CapacityError(f"tensor-parallel size must be at least 1, got {tp}")
    heads = spec.attention.num_heads
    if heads % tp:
        raise CapacityError(
            f"{spec.name}: {heads} attention heads are not divisible by "
            f"tensor-parallel size {tp}; vLLM refuses this split"
        )
    kv = spec.attention.num_kv_heads
    if not spec.is_mla and spec.num_attention_layers:
        if kv >= tp and kv % tp:
            raise CapacityError(f"{spec.name}: {kv} KV heads are not divisible by tensor-parallel size {tp}; "
                                "vLLM refuses this split")
        if kv < tp and tp % kv:
            raise CapacityError(f"{spec.name}: tensor-parallel size {tp} is not a multiple of its {kv} KV heads, "
                                "so they cannot be replicated evenly; vLLM refuses this split")
    for what, n in _state_split_sizes(spec):
        if n % tp:
            raise CapacityError(f"{spec.name}: {n} {what} are not divisible by tensor-parallel size {tp}")


def _state_split_sizes(spec: ModelSpec) -> list[tuple[str, int]]:
    """What TP splits in the Mamba and linear-attention layers."""
    sizes = []
    mamba = spec.mamba
    if isinstance(mamba, Mamba1):
        sizes.append(("Mamba inner size", mamba.inner_size))
    elif mamba is not None:
        sizes.append(("Mamba heads", mamba.num_heads))
    if spec.linear is not None:
        sizes += [("linear-attention value heads", spec.linear.num_value_heads),
                  ("linear-attention key heads", spec.linear.num_key_heads)]
    return sizes


def kv_bytes(spec: ModelSpec, *, kv_cache_dtype: str = "auto", tp: int = 1, pp: int = 1) -> KvBytes:
    """Bytes of KV cache per token (total and on the fullest GPU) and of state per sequence."""
    element_bytes = bytes_per_element(kv_cache_dtype, spec.dtype)
    name = kv_cache_dtype.lower()
    if name in _MLA_OPAQUE_BYTES and not spec.is_mla:
        raise UnknownNameError(f"kv-cache dtype {name!r} is only for MLA models (DeepSeek); {spec.name} is not one",
                               field="kv_cache_dtype")
    check_tensor_parallel(spec, tp)
    stages = pp_stage_sizes(spec.num_layers, pp)

    attention = spec.attention
    heads_per_gpu = 1 if spec.is_mla else max(1, attention.num_kv_heads // tp)
    layer_total = {kind: _attention_layer_bytes(attention, name, element_bytes, attention.num_kv_heads)
                   for kind in ATTENTION_KINDS}
    layer_per_gpu = {kind: _attention_layer_bytes(attention, name, element_bytes, heads_per_gpu)
                     for kind in ATTENTION_KINDS}
    state_total = _state_layer_bytes(spec, 1)
    state_per_gpu = _state_layer_bytes(spec, tp)

    layers = []
    for kind in LayerKind:
        count = spec.count(kind)
        if not count or kind is LayerKind.NONE:
            continue
        window = attention.sliding_window if kind is LayerKind.SLIDING else (
            attention.chunk_size if kind is LayerKind.CHUNKED else None)
        layers.append(LayerKv(kind, count, window, count * layer_total.get(kind, 0)))

    kv_per_gpu = state_seq_per_gpu = 0
    start = 0
    for size in stages:
        stage = spec.layer_kinds[start:start + size]
        start += size
        kv_per_gpu = max(kv_per_gpu, sum(layer_per_gpu.get(k, 0) for k in stage))
        state_seq_per_gpu = max(state_seq_per_gpu, sum(state_per_gpu.get(k, 0) for k in stage))

    return KvBytes(
        model=spec.name,
        kv_cache_dtype=name,
        bytes_per_element=element_bytes,
        attention=_attention_label(spec),
        num_layers=spec.num_layers,
        num_kv_heads=attention.num_kv_heads,
        head_dim=attention.head_dim,
        kv_bytes_per_token=sum(layer.kv_bytes_per_token for layer in layers),
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        kv_bytes_per_token_per_gpu=kv_per_gpu,
        layers=tuple(layers),
        state_bytes_per_sequence=sum(state_total.get(k, 0) for k in spec.layer_kinds),
        state_bytes_per_sequence_per_gpu=state_seq_per_gpu,
        num_kv_heads_per_gpu=heads_per_gpu,
        stage_layers=stages,
    )


def _attention_layer_bytes(attention: Attention, kv_dtype: str, element_bytes: int, kv_heads: int) -> int:
    """One attention layer, one token, `kv_heads` heads (K + V, or MLA's single latent)."""
    if kv_dtype in _MLA_OPAQUE_BYTES:  # kv_bytes allows these for MLA only
        return _MLA_OPAQUE_BYTES[kv_dtype]
    if kv_dtype == "nvfp4":
        per_head = sum(d // 2 + d // 16 for d in (attention.head_dim, attention.head_dim_v) if d)
        return kv_heads * per_head
    return kv_heads * (attention.head_dim + attention.head_dim_v) * element_bytes


def _state_layer_bytes(spec: ModelSpec, tp: int) -> dict[LayerKind, int]:
    """Per-sequence state of one Mamba / linear-attention layer on one of `tp` ranks
    (vLLM MambaStateShapeCalculator): conv state at the model dtype, ssm state at its own."""
    conv_bytes = min(2, _MODEL_DTYPE_BYTES[spec.dtype])
    out: dict[LayerKind, int] = {}
    if spec.mamba is not None:
        out[LayerKind.MAMBA] = _mamba_state_bytes(spec.mamba, tp, conv_bytes)
    if spec.linear is not None:
        out[LayerKind.LINEAR] = _linear_state_bytes(spec.linear, tp, conv_bytes)
    return out


def _mamba_state_bytes(mamba: Mamba, tp: int, conv_bytes: int) -> int:
    ssm_bytes = _MODEL_DTYPE_BYTES[mamba.state_dtype] if mamba.state_dtype else conv_bytes
    if isinstance(mamba, Mamba1):
        inner = mamba.inner_size // tp
        return inner * (mamba.conv_kernel - 1) * conv_bytes + inner * mamba.state_size * ssm_bytes
    groups = mamba.num_groups
    if groups % tp:  # vLLM replicates groups so that each rank holds the ones its heads need
        groups += tp - groups
    conv_dim = mamba.inner_size + 2 * groups * mamba.state_size
    return ((mamba.conv_kernel - 1) * (conv_dim // tp) * conv_bytes
            + (mamba.num_heads // tp) * mamba.head_dim * mamba.state_size * ssm_bytes)


def _linear_state_bytes(linear: LinearAttention, tp: int, conv_bytes: int) -> int:
    ssm_bytes = _MODEL_DTYPE_BYTES[linear.state_dtype] if linear.state_dtype else conv_bytes
    conv_dim = linear.key_head_dim * linear.num_key_heads * 2 + linear.value_head_dim * linear.num_value_heads
    return ((linear.conv_kernel - 1) * (conv_dim // tp) * conv_bytes
            + (linear.num_value_heads // tp) * linear.key_head_dim * linear.value_head_dim * ssm_bytes)


def _attention_label(spec: ModelSpec) -> str:
    if any(k in (LayerKind.MAMBA, LayerKind.LINEAR) for k in spec.layer_kinds):
        return "hybrid"
    if spec.is_mla:
        return "mla"
    if spec.attention.num_kv_heads == spec.attention.num_heads:
        return "mha"
    return "mqa" if spec.attention.num_kv_heads == 1 else "gqa"


__all__ = ["LayerKv", "KvBytes", "kv_bytes", "bytes_per_element", "kv_cache_dtype_names", "pp_stage_sizes",
           "check_tensor_parallel"]
