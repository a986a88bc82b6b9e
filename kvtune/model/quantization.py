"""A checkpoint's `quantization_config` → Quantization: what each stored weight costs and which
dtype its matmul runs in, the way vLLM loads each format.

Formats (vLLM's quantization methods of the same name):
  fp8                 HF/DeepSeek/Qwen FP8 and AutoFP8: e4m3 weights; a 128×128 fp32 block scale
                      (`weight_block_size`, stored as weight_scale_inv) or one fp32 scale per
                      tensor; activations quantized to fp8 (dynamic or static): W8A8
  fbgemm_fp8          fp8 weights, an fp32 scale per output row, dynamic fp8 activations
  modelopt            NVIDIA ModelOpt (`quant_algo` FP8: per-tensor W8A8; NVFP4: fp4 weights, an
                      fp8 scale per 16 and W4A4; INT4_AWQ / W4A8_AWQ: int4 groups of 128),
                      in config.json or in the checkpoint's hf_quant_config.json
  compressed-tensors  llm-compressor: the Linear group's `weights` (num_bits, type, strategy
                      tensor/channel/group/block, group_size, symmetric) and `input_activations`
                      (absent: weight-only); scales in the model's 16-bit dtype; asymmetric
                      zero points packed at num_bits; `ignore` kept unquantized
  awq                 int4 qweight, fp16 scales and packed int4 zeros per group (default 128); W4A16
  gptq                intN qweight, fp16 scales and packed zeros per group (-1: per channel), an
                      int32 g_idx per input column; W4A16
  mxfp4               gpt-oss: the MoE experts only, 4-bit values with an e8m0 scale per 32; W4A16
                      (vLLM dequantizes into 16-bit matmuls on Hopper)
Embeddings, norms and routers stay at the model's dtype; lm_head too unless the format says it is
quantized; `modules_to_not_convert` / `ignore` / `exclude_modules` name more, by part (a module
named for some layers only counts for that share of the layers). A format this module does not
know returns None, and the caller prices the config's method and bits as before.
"""

from __future__ import annotations

import re
from typing import Any

from kvtune.model.fields import ConfigFields, shown
from kvtune.model.spec import QUANTIZABLE_PARTS, Quantization

_SCALE_16 = 16  # fp16 / bf16 scales
_SCALE_32 = 32  # fp32 scales
_E8M0 = 8  # MXFP4's shared exponent, NVFP4's fp8 scale
_LAYER = re.compile(r"layers\.(\d+)\.")
_ROUTER = re.compile(r"\.gate(?![_a-z])|router")
_TEXT_EXCLUDED_BY_NAME = ("vision", "visual", "multi_modal", "mm_projector", "audio", "embed", "norm")


def parse_quantization(top: ConfigFields, q: dict[str, Any], *, num_layers: int) -> Quantization | None:
    """The scheme `q` (a quantization_config object, read at `top`'s path) describes, or None."""
    f = ConfigFields(q, path=top.path, prefix="quantization_config.")
    method = f.str_("quant_method")
    producer = q.get("producer")
    if method is None and (isinstance(producer, dict) and producer.get("name") == "modelopt" or f.has("quant_algo")):
        method = "modelopt"
    if method is None:
        return None
    method = method.lower()
    reader = _READERS.get(method)
    return None if reader is None else reader(f, method, num_layers)


def parse_modelopt_file(data: dict[str, Any], *, path: str, num_layers: int) -> Quantization | None:
    """A ModelOpt checkpoint's hf_quant_config.json (`{"quantization": {"quant_algo": …}}`)."""
    quant = data.get("quantization")
    if not isinstance(quant, dict):
        raise ConfigFields(data, path=path).error("quantization", f"expected an object, got {shown(quant)}")
    return _modelopt(ConfigFields(quant, path=path, prefix="quantization."), "modelopt", num_layers)


# --- per format -------------------------------------------------------------------------------


def _fp8(f: ConfigFields, method: str, num_layers: int) -> Quantization:
    block = f.list_("weight_block_size")
    shape = None
    if block is not None:
        if len(block) != 2 or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block):
            raise f.error("weight_block_size", f"expected two positive integers, got {shown(block)}")
        shape = (block[0], block[1])
    if method == "fbgemm_fp8":  # one fp32 scale per output row
        return Quantization(method, 8, "float", None, _SCALE_32, activations="fp8",
                            unquantized=_unquantized(f, num_layers, "modules_to_not_convert"))
    return Quantization(method, 8, "float", 0 if shape is None else None, _SCALE_32, block=shape, activations="fp8",
                        unquantized=_unquantized(f, num_layers, "modules_to_not_convert", "ignored_layers"))


def _modelopt(f: ConfigFields, method: str, num_layers: int) -> Quantization | None:
    algo = (f.str_("quant_algo") or "").upper()
    unquantized = _unquantized(f, num_layers, "exclude_modules", "ignore", "modules_to_not_convert")
    group = f.int_("group_size", minimum=1)
    if algo == "FP8":
        return Quantization(method, 8, "float", 0, _SCALE_32, activations="fp8", unquantized=unquantized)
    if algo == "NVFP4":
        return Quantization(method, 4, "nvfp4", group or 16, _E8M0, activations="fp4", unquantized=unquantized)
    if algo in ("INT4_AWQ", "W4A16_AWQ"):
        return Quantization(method, 4, "int", group or 128, _SCALE_16, unquantized=unquantized)
    if algo == "W4A8_AWQ":
        return Quantization(method, 4, "int", group or 128, _SCALE_16, activations="fp8", unquantized=unquantized)
    if algo in ("INT8_SQ", "W8A8_SQ_PER_CHANNEL"):
        return Quantization(method, 8, "int", None, _SCALE_32, activations="int8", unquantized=unquantized)
    return None


def _compressed_tensors(f: ConfigFields, method: str, num_layers: int) -> Quantization | None:
    groups = f.data.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        return None
    chosen = None
    for name, group in groups.items():
        if not isinstance(group, dict):
            raise f.error(f"config_groups.{name}", f"expected an object, got {shown(group)}")
        targets = group.get("targets")
        if chosen is None or (isinstance(targets, list) and "Linear" in targets):
            chosen = (str(name), group)
    assert chosen is not None
    name, group = chosen
    g = ConfigFields(group, path=f.path, prefix=f"{f.prefix}config_groups.{name}.")
    w_data = group.get("weights")
    if not isinstance(w_data, dict):
        raise g.error("weights", f"expected an object, got {shown(w_data)}")
    w = ConfigFields(w_data, path=f.path, prefix=f"{g.prefix}weights.")
    bits = w.require_int("num_bits", what="weight bits")
    _bits(w, "num_bits")
    kind = w.str_("type") or "int"
    strategy = (w.str_("strategy") or "tensor").lower()
    fmt = (f.str_("format") or group.get("format") or "")
    nvfp4 = "nvfp4" in str(fmt) or (kind == "float" and bits == 4)
    group_size: int | None
    block = None
    if strategy in ("group", "tensor_group"):
        group_size = w.int_("group_size", minimum=1) or (16 if nvfp4 else 128)
    elif strategy == "channel":
        group_size = None
    elif strategy == "block":
        structure = w.list_("block_structure") or [128, 128]
        if len(structure) != 2 or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0
                                          for b in structure):
            raise w.error("block_structure", f"expected two positive integers, got {shown(structure)}")
        group_size, block = None, (structure[0], structure[1])
    else:  # tensor
        group_size = 0
    symmetric = w.bool_("symmetric", True)
    acts = group.get("input_activations")
    activations = None
    if isinstance(acts, dict):
        a = ConfigFields(acts, path=f.path, prefix=f"{g.prefix}input_activations.")
        a_bits = a.int_("num_bits", minimum=1)
        a_type = a.str_("type") or "int"
        if a_bits == 8:
            activations = "fp8" if a_type == "float" else "int8"
        elif a_bits == 4 and a_type == "float":
            activations = "fp4"
    unquantized = _unquantized(f, num_layers, "ignore")
    targets = group.get("targets")
    if isinstance(targets, list) and targets and "Linear" not in targets:
        covered = {part for t in targets if isinstance(t, str) for part in _parts_of(t)}
        unquantized = tuple(sorted({**dict(unquantized), **{p: 1.0 for p in QUANTIZABLE_PARTS if p not in covered}}
                                   .items()))
    return Quantization(method, bits, "nvfp4" if nvfp4 else kind, group_size, _E8M0 if nvfp4 else _SCALE_16,
                        zero_point_bits=0 if symmetric else bits, block=block, activations=activations,
                        unquantized=unquantized)


def _awq(f: ConfigFields, method: str, num_layers: int) -> Quantization:
    bits = _bits(f, "bits", "w_bit") or 4
    group = f.int_("group_size", "q_group_size", minimum=1) or 128
    zero = f.bool_("zero_point", True)
    return Quantization(method, bits, "int", group, _SCALE_16, zero_point_bits=bits if zero else 0,
                        unquantized=_unquantized(f, num_layers, "modules_to_not_convert"))


def _gptq(f: ConfigFields, method: str, num_layers: int) -> Quantization:
    bits = _bits(f, "bits") or 4
    raw_group = f.data.get("group_size", 128)
    if raw_group == -1:
        group: int | None = None
    else:
        group = f.int_("group_size", minimum=1) or 128
    lm_head_quantized = f.bool_("lm_head", False)
    unquantized = _unquantized(f, num_layers, "modules_to_not_convert")
    if lm_head_quantized:
        unquantized = tuple((p, s) for p, s in unquantized if p != "lm_head")
    # AutoGPTQ stores qzeros (packed at `bits`) even when symmetric, and g_idx for every layer
    return Quantization(method, bits, "int", group, _SCALE_16, zero_point_bits=bits, index_bits=32,
                        unquantized=unquantized)


def _mxfp4(f: ConfigFields, method: str, num_layers: int) -> Quantization:
    # vLLM's Mxfp4Config quantizes the fused MoE experts only; everything else loads at 16 bits
    only_experts = tuple((p, 1.0) for p in QUANTIZABLE_PARTS if p != "routed_experts")
    return Quantization(method, 4, "mxfp4", 32, _E8M0, unquantized=only_experts)


_READERS = {
    "fp8": _fp8, "fbgemm_fp8": _fp8, "modelopt": _modelopt, "modelopt_fp4": _modelopt,
    "compressed-tensors": _compressed_tensors, "awq": _awq, "awq_marlin": _awq, "gptq": _gptq,
    "gptq_marlin": _gptq, "mxfp4": _mxfp4,
}


def _bits(f: ConfigFields, *keys: str) -> int | None:
    """A quantized weight's width: 1 to 8 bits (vLLM's formats store 2, 3, 4 or 8)."""
    bits = f.int_(*keys, minimum=1)
    if bits is not None and bits > 8:
        raise f.error(f.first(*keys) or keys[0], f"a quantized weight has 1 to 8 bits, got {bits}")
    return bits


# --- modules kept unquantized -------------------------------------------------------------------


def _parts_of(name: str) -> tuple[str, ...]:
    """The parts a module name (or compressed-tensors `re:` pattern) names; () for none of them."""
    n = name.removeprefix("re:").lower()
    if any(word in n for word in _TEXT_EXCLUDED_BY_NAME):
        return ()
    if "lm_head" in n:
        return ("lm_head",)
    if "shared_expert" in n:
        return ("shared_experts",)
    if "experts" in n:
        return ("routed_experts",)
    if _ROUTER.search(n):
        return ()  # the router: unquantized anyway
    if "linear_attn" in n or "mamba" in n or "mixer" in n:
        return ("mixer",)
    if "attn" in n or "attention" in n:
        return ("attention",)
    if re.search(r"mlp\W*(gate|up|down)", n):  # `mlp.down_proj`, `re:.*mlp\.(gate|up)_proj`: the dense MLP
        return ("dense_mlp",)
    if "mlp" in n or "ffn" in n or "feed_forward" in n:
        return ("dense_mlp", "routed_experts", "shared_experts")
    if n.endswith(("proj", "proj$")):
        return ("attention",) if re.search(r"[qkvo]_proj", n) else ("dense_mlp",)
    if n in ("linear", "re:.*"):
        return QUANTIZABLE_PARTS
    return ()


def _unquantized(f: ConfigFields, num_layers: int, *keys: str) -> tuple[tuple[str, float], ...]:
    """part → share of its layers the config's exclusion lists keep at 16 bits (lm_head: always,
    unless the format quantizes it)."""
    whole: set[str] = {"lm_head"}
    per_layer: dict[str, set[int]] = {}
    for key in keys:
        names = f.list_(key)
        if names is None:
            continue
        for i, name in enumerate(names):
            if not isinstance(name, str):
                raise f.error(f"{key}[{i}]", f"expected a module name, got {shown(name)}")
            layer = _LAYER.search(name)
            parts = _parts_of(name)
            if not parts and layer is not None and name.endswith(layer.group(0)):  # a whole layer ("layers.0.")
                parts = tuple(p for p in QUANTIZABLE_PARTS if p != "lm_head")
            for part in parts:
                if layer is None:
                    whole.add(part)
                else:
                    per_layer.setdefault(part, set()).add(int(layer.group(1)))
    shares = dict.fromkeys(whole, 1.0)
    for part, layers in per_layer.items():
        if part not in shares:
            shares[part] = min(1.0, len(layers) / max(num_layers, 1))
    return tuple(sorted(shares.items()))


__all__ = ["parse_quantization", "parse_modelopt_file"]
