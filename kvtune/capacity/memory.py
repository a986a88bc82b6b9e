"""A GPU's memory as vLLM divides it: requested = memory × gpu_memory_utilization, then weights,
the non-KV overhead (activation peak, CUDA graphs, workspaces) and what is left for the KV pool.

Pure arithmetic over plain numbers, per GPU, the way one vLLM worker sees it; every part of the
overhead model carries the assumption behind it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvtune.errors import CapacityError

GiB = 1024**3

# Stated assumptions of the overhead model (per GPU).
ACTIVATION_BYTES_PER_ELEMENT = 2  # activations in 16-bit
LOGITS_BYTES_PER_ELEMENT = 4  # the sampler's dummy run holds float32 logits
CUDA_GRAPH_BYTES = GiB // 2  # vLLM logs "Graph capturing finished ..., took 0.1–1 GiB"
NON_TORCH_BYTES = GiB // 4  # cuBLAS/cuDNN workspaces allocated after vLLM's baseline snapshot
COLLECTIVE_BYTES = GiB // 2  # NCCL and custom all-reduce buffers when tp × pp > 1


@dataclass(frozen=True, slots=True)
class Overhead:
    """Per-GPU memory that is neither weights nor KV, each part with the assumption behind it."""

    activation_bytes: int
    cuda_graph_bytes: int
    non_torch_bytes: int
    assumptions: tuple[str, ...]

    @property
    def total_bytes(self) -> int:
        return self.activation_bytes + self.cuda_graph_bytes + self.non_torch_bytes


def estimate_overhead(
    *,
    hidden_size: int,
    mlp_width: int,
    vocab_size: int,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    tp: int = 1,
    pp: int = 1,
    enforce_eager: bool = False,
) -> Overhead:
    """vLLM's profile run peak, CUDA graphs and non-torch memory, modelled from the shapes.

    Activation peak: the dummy forward over max_num_batched_tokens tokens holds about
    4 × hidden (residual, normed input, qkv, attention out) + 3 × mlp_width / tp (gate, up, act)
    16-bit values per token, then the sampler's dummy run holds max_num_seqs × vocab float32 logits.
    """
    per_token = ACTIVATION_BYTES_PER_ELEMENT * (4 * hidden_size + 3 * math.ceil(mlp_width / tp))
    forward = max_num_batched_tokens * per_token
    logits = max_num_seqs * vocab_size * LOGITS_BYTES_PER_ELEMENT
    graphs = 0 if enforce_eager else CUDA_GRAPH_BYTES
    collectives = COLLECTIVE_BYTES if tp * pp > 1 else 0
    assumptions = (
        f"activation peak = {max_num_batched_tokens:,} batched tokens × {per_token:,} B "
        f"(2 B × (4 × hidden {hidden_size:,} + 3 × MLP width {mlp_width:,} / tp {tp})) "
        f"+ {max_num_seqs:,} seqs × vocab {vocab_size:,} × 4 B logits",
        "CUDA graphs: 0 (--enforce-eager)" if enforce_eager
        else f"CUDA graphs: {CUDA_GRAPH_BYTES / GiB:.2f} GiB (vLLM logs 0.1–1 GiB; 0 with --enforce-eager)",
        f"non-torch memory: {NON_TORCH_BYTES / GiB:.2f} GiB of workspaces"
        + (f" + {COLLECTIVE_BYTES / GiB:.2f} GiB NCCL/all-reduce buffers (tp × pp > 1)" if collectives else ""),
    )
    return Overhead(
        activation_bytes=forward + logits,
        cuda_graph_bytes=graphs,
        non_torch_bytes=NON_TORCH_BYTES + collectives,
        assumptions=assumptions,
    )


@dataclass(frozen=True, slots=True)
class MemoryBreakdown:
    """One GPU's memory as vLLM divides it."""

    gpu_memory_bytes: int
    gpu_memory_utilization: float
    requested_memory_bytes: int  # ceil(gpu_memory_bytes × gpu_memory_utilization)
    weights_bytes: int  # per GPU
    overhead: Overhead
    kv_cache_bytes: int  # what is left for the KV pool

    @property
    def overhead_bytes(self) -> int:
        return self.overhead.total_bytes


def kv_pool(
    *, gpu_memory_bytes: int, gpu_memory_utilization: float, weights_bytes: int, overhead: Overhead
) -> MemoryBreakdown:
    """The KV pool left on one GPU; a CapacityError with the numbers when nothing is left."""
    if not 0 < gpu_memory_utilization <= 1:
        raise CapacityError(
            f"must be in (0, 1], got {gpu_memory_utilization}", field="gpu_memory_utilization"
        )
    requested = math.ceil(gpu_memory_bytes * gpu_memory_utilization)
    pool = requested - weights_bytes - overhead.total_bytes
    if pool <= 0:
        what = "weights alone exceed" if weights_bytes >= requested else "weights + overhead exceed"
        raise CapacityError(
            f"{what} the usable memory per GPU: weights {weights_bytes / GiB:.2f} GiB + overhead "
            f"{overhead.total_bytes / GiB:.2f} GiB > {gpu_memory_bytes / GiB:.2f} GiB × "
            f"{gpu_memory_utilization} = {requested / GiB:.2f} GiB; use more GPUs (`tp`/`pp`), "
            "a bigger GPU, or quantized weights"
        )
    return MemoryBreakdown(
        gpu_memory_bytes=gpu_memory_bytes,
        gpu_memory_utilization=gpu_memory_utilization,
        requested_memory_bytes=requested,
        weights_bytes=weights_bytes,
        overhead=overhead,
        kv_cache_bytes=pool,
    )


def num_blocks_for(kv_cache_bytes: int, block_size: int, kv_bytes_per_token_per_gpu: int) -> int:
    """Whole blocks in the pool: pool // (block_size × bytes per token per GPU)."""
    if block_size < 1:
        raise CapacityError(f"must be at least 1, got {block_size}", field="block_size")
    if kv_bytes_per_token_per_gpu < 1:
        raise CapacityError("the model keeps no per-token KV cache; token capacity is unbounded")
    return kv_cache_bytes // (block_size * kv_bytes_per_token_per_gpu)



__all__ = ["GiB", "Overhead", "estimate_overhead", "MemoryBreakdown", "kv_pool", "num_blocks_for"]
