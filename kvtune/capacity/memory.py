"""A GPU's memory as vLLM divides it: requested = memory × gpu_memory_utilization, then weights,
the non-KV overhead (activation peak, CUDA graphs, workspaces) and what is left for the KV pool.

Pure arithmetic over plain numbers, per GPU, the way one vLLM worker sees it; every part of the
overhead model carries the assumption behind it, and which release's profiler it follows.

What counts against the pool depends on the release (`memory_model(engine_version)`):

    < 0.2.5     the profile's torch peak only (non-torch memory went uncounted; vllm#2031)
    0.2.5–0.6.4 everything in use on the device after the profile run (total − free; vllm#2031)
    0.6.5–0.7   V0, per part: weights + non-torch increase + torch peak increase (vllm#10511)
    0.8–0.20    V1 (vllm-facts.md §4); CUDA graphs are captured after the pool is allocated
    ≥ 0.21      V1 with the CUDA-graph estimate subtracted (VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS)

Before 0.8 (V0) the profile run covers max_num_batched_tokens, which defaults to
max(max_model_len, 2048) because chunked prefill is off; V1 profiles its own default budget.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from kvtune.engines import vllm
from kvtune.errors import CapacityError, OptionError

GiB = 1024**3

# Stated assumptions of the overhead model (per GPU), each with its source.
ACTIVATION_BYTES_PER_ELEMENT = 2  # activations in 16-bit
# The profile's dummy sampler runs top-k = vocab − 1 and top-p (V0 `profile_run`: SamplingParams(top_p=0.99,
# top_k=vocab_size - 1), "to reflect the accurate memory usage"; V1 `_dummy_sampler_run`: top_p 0.9, top_k
# vocab − 1), so it sorts every logit: float32 logits, sorted values, int64 indices and the sort's buffers.
# Measured in vllm#13594 (H100, facebook/opt-125m, 36,864 B of KV per token): adding the sampler to V1's
# profile cost 58,928 tokens = 2.02 GiB for 1,024 dummy requests × 50,272 vocab = 42 B per logit, 8 B of
# them the int64 prompt_token_ids copy later releases no longer pass (prompt_token_ids=None); + 2 B for the
# 16-bit logits the profile held before the change (1,024: V1's default max_num_seqs on an H100 then, an
# assumption). V0 startup logs, whose peak is the sampler's, corroborate without setting it: activation peak
# 1.26 GiB for 256 × 128,256 logits (vllm#10511) and 1.42 GiB for 256 × 152,064 (vllm#13882), 38–39 B each.
SAMPLER_BYTES_PER_LOGIT = 36
CUDA_GRAPH_BYTES = GiB // 2  # vLLM logs "Graph capturing finished ..., took 0.1–1 GiB"
# cuBLAS/attention workspaces allocated after the baseline snapshot: non_torch_memory 0.16 GiB (vllm#12126,
# H100, TP 1), 0.03 GiB (vllm#13882, RTX 4060), 0.20 GiB (vllm#14447, TP 4 on 24 GiB GPUs)
NON_TORCH_BYTES = GiB // 4
# NCCL and custom all-reduce buffers when tp × pp > 1: vllm#10511 measured non_torch_memory 3.58 GiB at TP 2
# against 1.79 GiB at TP 1 (Llama-3-8B, H100): TP 2 added 1.79 GiB. NVLink GPUs; PCIe ones use less.
COLLECTIVE_BYTES = round(1.79 * GiB)
# V0's scheduler defaults (vllm-facts.md §1: without chunked prefill max_num_batched_tokens =
# max(max_model_len, default)); V0's EngineArgs defaulted max_num_seqs to 256 and the budget to 2048.
V0_MAX_NUM_SEQS = 256
V0_MAX_NUM_BATCHED_TOKENS = 2_048


@dataclass(frozen=True, slots=True)
class MemoryModel:
    """Which of a vLLM release's startup-profile parts count against the KV pool."""

    version: tuple[int, ...]
    v1: bool  # the V1 engine (0.8 on) rather than V0
    counts_non_torch: bool  # memory outside PyTorch's allocator (workspaces, NCCL) is charged
    whole_device: bool  # 0.2.5–0.6.4: all memory in use after the profile run is charged
    counts_cuda_graphs: bool  # the CUDA-graph estimate is subtracted before the pool is sized

    @property
    def label(self) -> str:
        return f"vLLM {'.'.join(map(str, self.version))} ({'V1' if self.v1 else 'V0'})"

    @property
    def profile(self) -> str:
        """The profiler this release sizes the pool with, in one phrase."""
        if self.v1:
            return "V1 profile: requested − (weights + torch peak + non-torch increase)" + (
                " − CUDA-graph estimate" if self.counts_cuda_graphs else "; CUDA graphs captured after the pool")
        if self.whole_device:
            return "V0 profile: requested − all device memory in use after the profile run (vllm#2031)"
        if not self.counts_non_torch:
            return "V0 profile: requested − torch peak (non-torch memory uncounted before vllm#2031)"
        return "V0 profile: requested − (weights + non-torch increase + torch peak increase) (vllm#10511)"


_VERSION = re.compile(r"[vV]?(\d+(?:\.\d+)*)(?:[.+-]?[A-Za-z][\w.+-]*)?")


def memory_model(engine_version: str | None = None, *, field: str = "engine_version") -> MemoryModel:
    """The memory model of vLLM `engine_version` ('0.6.3', 'v0.10.1.post1'; None: the current release)."""
    text = vllm.CURRENT_VERSION if engine_version is None else engine_version
    match = _VERSION.fullmatch(text.strip())
    if match is None:
        raise OptionError(f"not a vLLM version: {text!r} (a release number such as {vllm.CURRENT_VERSION})",
                          field=field)
    version = tuple(int(part) for part in match.group(1).split("."))
    return MemoryModel(
        version=version,
        v1=version >= vllm.FIRST_V1_DEFAULT_VERSION,
        counts_non_torch=version >= (0, 2, 5),
        whole_device=(0, 2, 5) <= version < (0, 6, 5),
        counts_cuda_graphs=version >= vllm.FIRST_CUDA_GRAPH_ESTIMATE_VERSION,
    )


def profile_limits(model: MemoryModel, *, max_model_len: int, max_num_batched_tokens: int | None,
                   max_num_seqs: int | None, gpu_memory_bytes: int, gpu_name: str | None) -> tuple[int, int, str]:
    """(tokens, sequences) the profile run covers, and the assumption saying why.

    V0 (before 0.8) runs without chunked prefill unless the budget is below max_model_len (which
    V0 accepts only with chunked prefill on), so its default budget is max(max_model_len, 2048);
    V1 uses `vllm serve`'s default for the GPU size, capped at max_num_seqs × max_model_len.
    """
    if model.v1:
        default_batched, default_seqs = vllm.default_batch_limits(gpu_memory_bytes, gpu_name, model.version)
        seqs = max_num_seqs or default_seqs
        if max_num_batched_tokens is None:
            batched = min(seqs * max_model_len, default_batched)
            why = f"max_num_batched_tokens {batched:,}: vllm serve's default for this GPU size ({model.label})"
        else:
            batched = max_num_batched_tokens
            why = f"max_num_batched_tokens {batched:,} as given ({model.label})"
    else:
        seqs = max_num_seqs or V0_MAX_NUM_SEQS
        if max_num_batched_tokens is None:
            batched = max(max_model_len, V0_MAX_NUM_BATCHED_TOKENS)
            why = (f"max_num_batched_tokens {batched:,} = max(max_model_len, {V0_MAX_NUM_BATCHED_TOKENS:,}): "
                   f"{model.label} profiles without chunked prefill (give --max-num-batched-tokens if the server "
                   "ran with it)")
        else:
            batched = max_num_batched_tokens
            why = (f"max_num_batched_tokens {batched:,} as given ({model.label}; below max_model_len it needs "
                   "chunked prefill)")
    return batched, min(seqs, batched), why


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
    engine_version: str | None = None,
) -> Overhead:
    """vLLM's profile-run peak, CUDA graphs and non-torch memory, as `engine_version` charges them.

    Activation peak: the larger of the two runs the profile makes one after the other. The dummy
    forward over max_num_batched_tokens tokens holds about 4 × hidden (residual, normed input,
    qkv, attention out) + 3 × mlp_width / tp (gate, up, act) 16-bit values per token; the dummy
    sampler then sorts max_num_seqs × vocab logits (SAMPLER_BYTES_PER_LOGIT) while the forward's
    output hidden states are still held.
    """
    model = memory_model(engine_version)
    per_token = ACTIVATION_BYTES_PER_ELEMENT * (4 * hidden_size + 3 * math.ceil(mlp_width / tp))
    forward = max_num_batched_tokens * per_token
    sampler = (max_num_seqs * vocab_size * SAMPLER_BYTES_PER_LOGIT
               + max_num_batched_tokens * hidden_size * ACTIVATION_BYTES_PER_ELEMENT)
    if enforce_eager:
        graphs, graphs_why = 0, f"CUDA graphs ({model.label}): 0 (--enforce-eager)"
    elif model.counts_cuda_graphs:
        graphs = CUDA_GRAPH_BYTES
        graphs_why = (f"CUDA graphs ({model.label}): {CUDA_GRAPH_BYTES / GiB:.2f} GiB, subtracted by the profiler "
                      "from 0.21 on "
                      "(vLLM logs 0.1–1 GiB; 0 with --enforce-eager)")
    else:
        graphs = 0
        graphs_why = (f"CUDA graphs: not charged to the pool; {model.label} captures them after allocating it, "
                      "out of the 1 − gpu_memory_utilization headroom")
    collectives = COLLECTIVE_BYTES if tp * pp > 1 and model.counts_non_torch else 0
    if model.counts_non_torch:
        non_torch = NON_TORCH_BYTES + collectives
        non_torch_why = (f"non-torch memory ({model.label}): {NON_TORCH_BYTES / GiB:.2f} GiB of workspaces "
                         "(vLLM logs 0.03–0.20 GiB)"
                         + (f" + {COLLECTIVE_BYTES / GiB:.2f} GiB NCCL/all-reduce buffers (tp × pp > 1, as "
                            "vllm#10511 measured on H100)" if collectives else ""))
        if model.whole_device:
            non_torch_why += ("; the CUDA context and allocator fragmentation this profiler also charged are not "
                              "modelled" + ("; its authors could not size its TP > 1 non-torch memory (vllm#2031): "
                                            "measure the capacity" if tp * pp > 1 else ""))
    else:
        non_torch = 0
        non_torch_why = f"non-torch memory: not charged ({model.label} counted the torch peak only, vllm#2031)"
    assumptions = (
        f"memory model: {model.label}: {model.profile}",
        f"activation peak ({model.label}) = max(forward: {max_num_batched_tokens:,} batched tokens × {per_token:,} B "
        f"(2 B × (4 × hidden {hidden_size:,} + 3 × MLP width {mlp_width:,} / tp {tp})) = {forward / GiB:.2f} GiB, "
        f"dummy sampler: {max_num_seqs:,} seqs × vocab {vocab_size:,} × {SAMPLER_BYTES_PER_LOGIT} B sorting "
        f"top-k/top-p (vllm#13594) = {sampler / GiB:.2f} GiB)",
        graphs_why,
        non_torch_why,
    )
    return Overhead(
        activation_bytes=max(forward, sampler),
        cuda_graph_bytes=graphs,
        non_torch_bytes=non_torch,
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



__all__ = ["GiB", "MemoryModel", "memory_model", "profile_limits", "Overhead", "estimate_overhead",
           "MemoryBreakdown", "kv_pool", "num_blocks_for"]
