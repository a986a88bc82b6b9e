"""The KV pool a deployed engine command will really hold: its flags fed through the same memory
model `recommend` estimates with (kvtune.capacity.plan.plan_capacity), so `kvtune check` holds
a gateway's budget to the pool the engine as launched leaves, not to the one recommended.

Pure: a parsed engine file (kvtune.deploy.deployed.Deployed), the model's spec and weights and the
GPU go in, a CapacityReport comes out. A flag the file does not set takes the engine's default for
the release (`engine_version`), as `vllm serve`, SGLang or trtllm-serve would.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from kvtune.capacity.memory import num_blocks_for
from kvtune.capacity.plan import CapacityInputs, CapacityReport, capacity_from_blocks, plan_capacity
from kvtune.deploy.deployed import Deployed, DeployedKind
from kvtune.kv import kv_bytes

if TYPE_CHECKING:
    from kvtune.model import ModelSpec
    from kvtune.weights import WeightsEstimate

# each engine's KV dtype spelling -> kvtune's (vLLM's) name for the same layout
_KV_DTYPE_NAMES = {"fp8_e4m3": "fp8_e4m3", "fp8_e5m2": "fp8_e5m2", "fp8": "fp8", "nvfp4": "nvfp4"}

# the engine fields whose value changes the pool, in the order findings name them (Deployed's names)
POOL_FIELDS = ("gpu_memory_utilization", "kv_cache_memory_bytes", "num_gpu_blocks_override", "kv_cache_tokens",
               "kv_cache_dtype", "block_size", "tensor_parallel_size", "pipeline_parallel_size", "max_num_seqs",
               "max_num_batched_tokens", "max_model_len", "enforce_eager")


def enforce_eager(engine: Deployed) -> bool:
    """vLLM's --enforce-eager: no CUDA graphs, so none are charged to the pool."""
    return engine.kind is DeployedKind.VLLM and engine.flags.get("enforce-eager") not in (None, False, "false", "False")


def deployed_capacity(engine: Deployed, spec: ModelSpec, weights: WeightsEstimate, *, gpu: str | None,
                      gpu_memory_bytes: int, engine_version: str | None = None) -> CapacityReport:
    """The capacity `engine`'s flags leave on one `gpu` of `gpu_memory_bytes`: utilization (SGLang
    --mem-fraction-static, TensorRT-LLM free_gpu_memory_fraction), KV dtype, block size,
    max_num_seqs, max_num_batched_tokens, tp/pp, max_model_len, --enforce-eager, and the explicit
    pool sizes (vLLM --kv-cache-memory-bytes and --num-gpu-blocks-override, SGLang
    --max-total-tokens, TensorRT-LLM max_tokens). A CapacityError when they leave no pool."""
    name = engine.kind.value
    dtype = engine.kv_cache_dtype or "auto"
    if engine.kind is not DeployedKind.VLLM:
        dtype = _KV_DTYPE_NAMES.get(dtype, "auto" if dtype in ("auto", "bfloat16", "float16") else dtype)
    kv = kv_bytes(spec, kv_cache_dtype=dtype, tp=engine.tensor_parallel_size or 1,
                  pp=engine.pipeline_parallel_size or 1)
    report = plan_capacity(spec, kv, CapacityInputs(
        weights=weights, gpu_name=gpu, gpu_memory_bytes=gpu_memory_bytes,
        gpu_memory_utilization=engine.gpu_memory_utilization, max_model_len=engine.max_model_len,
        max_num_batched_tokens=engine.max_num_batched_tokens, block_size=engine.block_size, shapes=(),
        measured=None, enforce_eager=enforce_eager(engine), engine=name,
        engine_version=engine_version if name == "vllm" else None, max_kv_tokens=engine.kv_cache_tokens,
        max_num_seqs=engine.max_num_seqs))
    if engine.kind is not DeployedKind.VLLM:
        return report
    c = report.capacity
    blocks = None
    if engine.num_gpu_blocks_override is not None:
        blocks, why = engine.num_gpu_blocks_override, "--num-gpu-blocks-override sets the block count"
    elif engine.kv_cache_memory_bytes is not None:
        blocks = num_blocks_for(engine.kv_cache_memory_bytes, c.block_size, kv.kv_bytes_per_token_per_gpu)
        why = "--kv-cache-memory-bytes sizes the pool (vLLM then ignores --gpu-memory-utilization)"
    if blocks is None:
        return report
    capacity = capacity_from_blocks(source=c.source, num_blocks=blocks, block_size=c.block_size,
                                    max_model_len=c.max_model_len,
                                    kv_bytes_per_token_per_gpu=c.kv_bytes_per_token_per_gpu, notes=(*c.notes, why))
    return dataclasses.replace(report, capacity=capacity)


__all__ = ["POOL_FIELDS", "deployed_capacity", "enforce_eager"]
