"""A GPU's memory as SGLang and TensorRT-LLM divide it: each engine's own rule for the KV pool,
beside vLLM's in kvtune.capacity.memory, returning the same kind of result (a `MemoryBreakdown`
whose kv_cache_bytes is the pool) so that blocks, tokens and request fits follow unchanged.

    SGLang 0.5.23      pool = free before loading × mem_fraction_static − weights
                       (the fraction covers weights + KV; activations and CUDA graphs live in the
                       rest), tokens floored to the page size, then min(--max-total-tokens)
    TensorRT-LLM 1.2   pool = free_gpu_memory_fraction × (total − weights − activation peak of a
                       max_num_tokens forward − memory outside torch), then min(max_tokens),
                       blocks = tokens // tokens_per_block
    (PyTorch backend)

Sources: SGLang's wheel (python/sglang/srt/...: arg_groups/memory_hook.py
`handle_gpu_memory_settings`, mem_cache/kv_cache_configurator.py:2990-3060
`_profile_available_bytes`, 3090-3116 `_apply_token_constraints`, 3119-3130
`resolve_max_num_reqs`, model_executor/pool_configurator.py:637-647
`DefaultPoolConfigurator.calculate_pool_sizes`); TensorRT-LLM's stored copies named in
kvtune.engines.trtllm (`KvCacheCreator.configure_kv_cache_capacity` / `_cal_max_memory` in
tensorrt_llm/_torch/pyexecutor/_util.py, `KVCacheManager.calculate_max_num_blocks` in
resource_manager.py). Pure arithmetic; every constant the engines do not state is an assumption
with its reason.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvtune.capacity.memory import GiB, MemoryBreakdown, Overhead
from kvtune.engines import ENGINE_TITLES, sglang, trtllm
from kvtune.errors import CapacityError, OptionError
from kvtune.hardware import MiB

if TYPE_CHECKING:
    from kvtune.kv import KvBytes
    from kvtune.model import ModelSpec
    from kvtune.weights import WeightsEstimate



# Memory in use before the weights load, per GPU: the CUDA context plus what the driver keeps out
# of the total nvidia-smi reports. Not stated by either engine; SGLang logs it as "Init torch
# distributed ends. mem usage=…" (about 2 GB per rank at TP 8 on an H200 in sglang PR #11716).
CUDA_BASELINE_BYTES = GiB
COLLECTIVE_BASELINE_BYTES = GiB  # NCCL communicators and buffers when tp × pp > 1
# TensorRT-LLM counts what lies outside torch at its peak (NCCL, CUDA graphs, the context):
TRTLLM_CUDA_GRAPH_BYTES = GiB // 2  # the estimation run captures its CUDA graphs (released after)
ACTIVATION_BYTES_PER_ELEMENT = 2
LOGITS_BYTES_PER_ELEMENT = 4


@dataclass(frozen=True, slots=True)
class EngineMemory(MemoryBreakdown):
    """One GPU's memory as SGLang or TensorRT-LLM divides it.

    gpu_memory_utilization holds the engine's own fraction (mem_fraction_static,
    free_gpu_memory_fraction); requested_memory_bytes is what that fraction yields (SGLang: the
    static memory for weights + KV; TensorRT-LLM: the KV budget before any max_tokens clamp).
    """

    engine: str = "sglang"
    version: str = ""
    fraction_of_bytes: int = 0  # what the fraction multiplies
    block_size: int = 1  # SGLang's page size, TensorRT-LLM's tokens_per_block
    max_num_batched_tokens: int = 0  # SGLang's chunked_prefill_size, TensorRT-LLM's max_num_tokens
    max_num_seqs: int | None = None  # SGLang's max_running_requests, TensorRT-LLM's max_batch_size
    rows: tuple[tuple[str, int, str], ...] = ()  # (part, bytes, how) in the order the engine applies them

    @property
    def title(self) -> str:
        return f"{ENGINE_TITLES[self.engine]} {self.version}"


def _check_fraction(fraction: float, name: str, *, one: bool = False) -> None:
    if not (0 < fraction <= 1 if one else 0 < fraction < 1):
        raise CapacityError(f"must be in (0, 1{']' if one else ')'}, got {fraction}", field=name)


def _other_release(title: str, modelled: str, version: str | None) -> str:
    """An assumption's tail when the caller's release is not the one the model was read from."""
    if version is None or version == modelled or version.startswith(modelled + "."):
        return ""
    return f", applied to {title} {version}: not read for that release"


def _baseline(tp: int, pp: int) -> tuple[int, str]:
    collectives = COLLECTIVE_BASELINE_BYTES if tp * pp > 1 else 0
    text = (f"{CUDA_BASELINE_BYTES / GiB:.2f} GiB in use before the weights load (CUDA context, driver)"
            + (f" + {collectives / GiB:.2f} GiB NCCL (tp × pp > 1)" if collectives else "") + ": assumed")
    return CUDA_BASELINE_BYTES + collectives, text


def _no_room(engine: str, weights: int, budget: int, how: str, *, raise_to: float | None = None) -> CapacityError:
    fix = "use more GPUs (`tp`/`pp`), a bigger GPU, or quantized weights"
    if raise_to is not None and raise_to < 1:
        fix = f"raise mem_fraction_static (`gpu_memory_utilization`) above {raise_to:.3f}, or {fix}"
    return CapacityError(
        f"{ENGINE_TITLES[engine]} leaves no KV pool: weights {weights / GiB:.2f} GiB per GPU against "
        f"{budget / GiB:.2f} GiB ({how}); {fix}"
    )


def sglang_memory(
    *,
    gpu_memory_bytes: int,
    weights_bytes: int,
    kv_bytes_per_token_per_gpu: int,
    context_len: int,
    tp: int = 1,
    pp: int = 1,
    mem_fraction_static: float | None = None,
    chunked_prefill_size: int | None = None,
    page_size: int = sglang.PAGE_SIZE,
    max_total_tokens: int | None = None,
    max_running_requests: int | None = None,
    mla: bool = False,
    version: str | None = None,
) -> EngineMemory:
    """SGLang's KV pool on one GPU (`KVCacheConfigurator._profile_available_bytes`).

    rest = free after loading − free before loading × (1 − f): with free after loading = free
    before − weights, the pool is free before × f − weights. Tokens = pool // cell size, floored
    to the page, then min(--max-total-tokens).
    """
    if kv_bytes_per_token_per_gpu < 1:
        raise CapacityError("the model keeps no per-token KV cache; token capacity is unbounded")
    if page_size < 1:
        raise OptionError(f"must be at least 1, got {page_size}", field="page_size")
    tier_chunk, _ = sglang.memory_tier(gpu_memory_bytes, tp)
    chunk = tier_chunk if chunked_prefill_size is None else chunked_prefill_size
    assumptions = [f"SGLang {sglang.CURRENT_VERSION}'s memory model (mem_fraction_static covers weights + KV)"
                   + _other_release("SGLang", sglang.CURRENT_VERSION, version)]
    if mem_fraction_static is None:
        mem_fraction_static = sglang.default_mem_fraction_static(
            gpu_memory_bytes, tp=tp, pp=pp, chunked_prefill_size=chunk, mla=mla,
            max_running_requests=max_running_requests)
        assumptions.append(
            f"mem_fraction_static {mem_fraction_static}: SGLang's default for {gpu_memory_bytes / MiB:,.0f} MiB, "
            f"round((GPU MiB − reserved) / GPU MiB, 3), reserved = 512 + 1.5 × chunked_prefill_size {chunk:,} "
            "+ tp × pp × 128 + the CUDA-graph reserve, at least 10 GiB above 60 GiB")
    _check_fraction(mem_fraction_static, "mem_fraction_static", one=True)
    baseline, baseline_text = _baseline(tp, pp)
    free_before = gpu_memory_bytes - baseline
    static = math.floor(free_before * mem_fraction_static)
    pool = static - weights_bytes
    if pool <= 0:  # SGLang's own error says "Raise --mem-fraction-static above …" (kv_cache_configurator.py:3043-3058)
        raise _no_room("sglang", weights_bytes, static,
                       f"{free_before / GiB:.2f} GiB free × mem_fraction_static {mem_fraction_static}",
                       raise_to=math.ceil(weights_bytes / free_before * 1000) / 1000 if free_before > 0 else None)
    rows = [
        ("GPU memory", gpu_memory_bytes, "device total (nvidia-smi)"),
        ("− in use before loading", baseline, "CUDA context, driver (assumed)"),
        (f"× mem_fraction_static {mem_fraction_static}", static, "static memory: weights + KV pool"),
        ("− weights", weights_bytes, "per GPU"),
    ]
    assumptions.append(baseline_text)
    kv_bytes = pool
    cap_tokens = None if max_total_tokens is None else max_total_tokens // page_size * page_size
    profiled_tokens = pool // kv_bytes_per_token_per_gpu // page_size * page_size
    if cap_tokens is not None and cap_tokens < profiled_tokens:
        kv_bytes = cap_tokens * kv_bytes_per_token_per_gpu
        rows.append((f"min(--max-total-tokens {max_total_tokens:,})", kv_bytes, "SGLang takes the smaller"))
        assumptions.append(f"--max-total-tokens {max_total_tokens:,} is below the profiled {profiled_tokens:,}")
    tokens = kv_bytes // kv_bytes_per_token_per_gpu // page_size * page_size
    if tokens < 1:
        raise _no_room("sglang", weights_bytes, static, "not one token of KV fits")
    seqs = sglang.default_max_running_requests(tokens, context_len, max_running_requests)
    assumptions.append(
        f"max_running_requests {seqs:,}: "
        + (f"--max-running-requests {max_running_requests:,}, at most tokens // 2" if max_running_requests
           else f"SGLang's default min(clamp({tokens:,} / context {context_len:,} × 512, 2048, 4096), tokens // 2)"))
    assumptions.append(f"chunked_prefill_size {chunk:,}"
                       + ("" if chunked_prefill_size else ": SGLang's default for this GPU size"))
    assumptions.append(f"page size {page_size}" + (": SGLang's default" if page_size == sglang.PAGE_SIZE else ""))
    assumptions.append("not modelled: multimodal/ViT headroom, DP attention, DeepEP, MLA's graph reserve "
                       "beyond 1.5 GiB, weight-loading residue, AMD aiter's × 0.85 for contexts above 8,192")
    return EngineMemory(
        gpu_memory_bytes=gpu_memory_bytes,
        gpu_memory_utilization=mem_fraction_static,
        requested_memory_bytes=static,
        weights_bytes=weights_bytes,
        overhead=Overhead(activation_bytes=0, cuda_graph_bytes=0, non_torch_bytes=baseline,
                          assumptions=tuple(assumptions)),
        kv_cache_bytes=kv_bytes,
        engine="sglang",
        version=sglang.CURRENT_VERSION,
        fraction_of_bytes=free_before,
        block_size=page_size,
        max_num_batched_tokens=chunk,
        max_num_seqs=seqs,
        rows=tuple(rows),
    )


def trtllm_activation_bytes(*, hidden_size: int, mlp_width: int, vocab_size: int, max_num_tokens: int,
                            max_seq_len: int, tp: int = 1) -> tuple[int, str]:
    """The torch peak above the weights in TensorRT-LLM's estimation run: dummy context requests
    of min(max_seq_len, max_num_tokens) tokens filling max_num_tokens (`_create_dummy_context_requests`),
    each producing one token's float32 logits."""
    per_token = ACTIVATION_BYTES_PER_ELEMENT * (4 * hidden_size + 3 * math.ceil(mlp_width / tp))
    requests = -(-max_num_tokens // max(1, min(max_seq_len, max_num_tokens)))
    logits = requests * vocab_size * LOGITS_BYTES_PER_ELEMENT
    text = (f"activation peak = max_num_tokens {max_num_tokens:,} × {per_token:,} B (2 B × (4 × hidden "
            f"{hidden_size:,} + 3 × MLP width {mlp_width:,} / tp {tp})) + {requests:,} dummy request(s) × "
            f"vocab {vocab_size:,} × 4 B logits")
    return max_num_tokens * per_token + logits, text


def trtllm_memory(
    *,
    gpu_memory_bytes: int,
    weights_bytes: int,
    kv_bytes_per_token_per_gpu: int,
    hidden_size: int,
    mlp_width: int,
    vocab_size: int,
    max_seq_len: int,
    tp: int = 1,
    pp: int = 1,
    free_gpu_memory_fraction: float | None = None,
    max_num_tokens: int | None = None,
    tokens_per_block: int = trtllm.TOKENS_PER_BLOCK,
    max_tokens: int | None = None,
    max_gpu_total_bytes: int | None = None,
    max_batch_size: int | None = None,
    version: str | None = None,
) -> EngineMemory:
    """TensorRT-LLM's KV pool on one GPU (PyTorch backend, `KvCacheCreator._cal_max_memory`).

    available = (total − peak + the estimation's KV bytes) × fraction, where the peak holds the
    weights, the activations of a max_num_tokens forward, the estimation's KV and what lies
    outside torch; kv_cache_config.max_tokens and max_gpu_total_bytes each take the min.
    """
    if kv_bytes_per_token_per_gpu < 1:
        raise CapacityError("the model keeps no per-token KV cache; token capacity is unbounded")
    if tokens_per_block < 1:
        raise OptionError(f"must be at least 1, got {tokens_per_block}", field="tokens_per_block")
    fraction = (trtllm.KV_CACHE_FREE_GPU_MEMORY_FRACTION if free_gpu_memory_fraction is None
                else free_gpu_memory_fraction)
    _check_fraction(fraction, "free_gpu_memory_fraction")
    num_tokens = trtllm.MAX_NUM_TOKENS if max_num_tokens is None else max_num_tokens
    activation, activation_text = trtllm_activation_bytes(
        hidden_size=hidden_size, mlp_width=mlp_width, vocab_size=vocab_size, max_num_tokens=num_tokens,
        max_seq_len=max_seq_len, tp=tp)
    baseline, baseline_text = _baseline(tp, pp)
    outside = baseline + TRTLLM_CUDA_GRAPH_BYTES
    free_after_peak = gpu_memory_bytes - weights_bytes - activation - outside
    if free_after_peak <= 0:
        raise _no_room("trtllm", weights_bytes, gpu_memory_bytes - activation - outside,
                       "device total less the activation peak and memory outside torch")
    budget = math.floor(free_after_peak * fraction)
    rows = [
        ("GPU memory", gpu_memory_bytes, "device total (nvidia-smi)"),
        ("− weights", weights_bytes, "per GPU"),
        ("− activation peak", activation, f"estimation run over max_num_tokens {num_tokens:,}"),
        ("− outside torch", outside, "CUDA context, driver, CUDA graphs, NCCL (assumed)"),
        (f"× free_gpu_memory_fraction {fraction}", budget, "of what is free at the profiled peak"),
    ]
    assumptions = [
        f"TensorRT-LLM {trtllm.CURRENT_VERSION}'s memory model (PyTorch backend): "
        "free_gpu_memory_fraction × (total − weights − activation peak − memory outside torch)"
        + _other_release("TensorRT-LLM", trtllm.CURRENT_VERSION, version),
        f"free_gpu_memory_fraction {fraction}"
        + ("" if free_gpu_memory_fraction is not None else ": trtllm-serve's default"),
        activation_text,
        baseline_text + f"; CUDA graphs {TRTLLM_CUDA_GRAPH_BYTES / GiB:.2f} GiB: assumed",
    ]
    kv_bytes = budget
    if max_tokens is not None and max_tokens * kv_bytes_per_token_per_gpu < kv_bytes:
        kv_bytes = max_tokens * kv_bytes_per_token_per_gpu
        rows.append((f"min(kv_cache_config.max_tokens {max_tokens:,})", kv_bytes, "TensorRT-LLM takes the smaller"))
    if max_gpu_total_bytes is not None and 0 < max_gpu_total_bytes < kv_bytes:
        kv_bytes = max_gpu_total_bytes
        rows.append(("min(kv_cache_config.max_gpu_total_bytes)", kv_bytes, "TensorRT-LLM takes the smaller"))
    if kv_bytes // kv_bytes_per_token_per_gpu // tokens_per_block < 1:
        raise _no_room("trtllm", weights_bytes, budget, "not one block of KV fits")
    seqs = trtllm.MAX_BATCH_SIZE if max_batch_size is None else max_batch_size
    assumptions.append(f"tokens_per_block {tokens_per_block}; blocks = tokens // tokens_per_block"
                       + (" (kv_cache_config's default)" if tokens_per_block == trtllm.TOKENS_PER_BLOCK else ""))
    assumptions.append("not modelled: the C++ (TensorRT engine) backend, KV cache manager V2, variable "
                       "sliding windows, draft-model KV, host (secondary) blocks")
    return EngineMemory(
        gpu_memory_bytes=gpu_memory_bytes,
        gpu_memory_utilization=fraction,
        requested_memory_bytes=budget,
        weights_bytes=weights_bytes,
        overhead=Overhead(activation_bytes=activation, cuda_graph_bytes=TRTLLM_CUDA_GRAPH_BYTES,
                          non_torch_bytes=baseline, assumptions=tuple(assumptions)),
        kv_cache_bytes=kv_bytes,
        engine="trtllm",
        version=trtllm.CURRENT_VERSION,
        fraction_of_bytes=free_after_peak,
        block_size=tokens_per_block,
        max_num_batched_tokens=num_tokens,
        max_num_seqs=seqs,
        rows=tuple(rows),
    )


def modelled_version(engine: str) -> str:
    """The release whose memory model kvtune applies for `engine` (SGLang 0.5.23, TensorRT-LLM 1.2)."""
    versions = {"sglang": sglang.CURRENT_VERSION, "trtllm": trtllm.CURRENT_VERSION}
    if engine not in versions:
        raise OptionError(f"no memory model for engine {engine!r} here (known: sglang, trtllm)", field="engine")
    return versions[engine]


def default_block_size(engine: str) -> int:
    """Tokens per KV block (page) an engine uses when not told: SGLang 1, TensorRT-LLM 32."""
    sizes = {"sglang": sglang.PAGE_SIZE, "trtllm": trtllm.TOKENS_PER_BLOCK}
    if engine not in sizes:
        raise OptionError(f"no memory model for engine {engine!r} here (known: sglang, trtllm)", field="engine")
    return sizes[engine]


def default_fraction(engine: str, gpu_memory_bytes: int | None, *, tp: int = 1, pp: int = 1,
                     spec: ModelSpec | None = None, chunked_prefill_size: int | None = None) -> float:
    """The engine's memory fraction when none is given: SGLang's derived mem_fraction_static,
    TensorRT-LLM's free_gpu_memory_fraction 0.9."""
    if engine == "sglang":
        return sglang.default_mem_fraction_static(gpu_memory_bytes, tp=tp, pp=pp,
                                                  chunked_prefill_size=chunked_prefill_size,
                                                  mla=bool(spec and spec.is_mla))
    if engine == "trtllm":
        return trtllm.KV_CACHE_FREE_GPU_MEMORY_FRACTION
    raise OptionError(f"no memory model for engine {engine!r} here (known: sglang, trtllm)", field="engine")


CONTEXT_NOTES = ("SGLang caps each request at ", "TensorRT-LLM lowers max_seq_len ")  # engine_notes' words


def engine_notes(engine: str, notes: tuple[str, ...], max_model_len: int, kv_cache_tokens: int) -> tuple[str, ...]:
    """Capacity notes in the engine's terms: where vLLM would refuse to start because one request at
    max_model_len does not fit, SGLang caps a request at the pool (tp_worker.py: max_req_len =
    min(context_len − 1, tokens − 1)) and TensorRT-LLM lowers max_seq_len to it ("Adjusted
    max_seq_len to N")."""
    said = {
        "sglang": f"SGLang caps each request at {kv_cache_tokens - 1:,} tokens (the pool − 1), below max_model_len "
                  f"{max_model_len:,}",
        "trtllm": f"TensorRT-LLM lowers max_seq_len to the pool's {kv_cache_tokens:,} tokens, below {max_model_len:,}",
    }[engine]
    return tuple(said if "vLLM would refuse to start" in note else note for note in notes)


def _mlp_width(spec: ModelSpec) -> int:
    width = spec.intermediate_size or 4 * spec.hidden_size
    moe = spec.moe
    if moe is not None and moe.experts_per_token is not None and moe.intermediate_size is not None:
        width = max(width, moe.experts_per_token * moe.intermediate_size)  # the active experts' MLPs
    return width


def engine_memory(engine: str, spec: ModelSpec, kv: KvBytes, weights: WeightsEstimate, *, gpu_memory_bytes: int,
                  fraction: float | None, max_model_len: int, block_size: int,
                  max_num_batched_tokens: int | None = None, max_kv_tokens: int | None = None,
                  version: str | None = None, max_num_seqs: int | None = None) -> EngineMemory:
    """The KV pool `engine` sizes for this model on one GPU of `gpu_memory_bytes`.

    `fraction` is the engine's own (None: its default); `max_num_batched_tokens` is SGLang's
    chunked_prefill_size or TensorRT-LLM's max_num_tokens; `max_kv_tokens` is SGLang's
    --max-total-tokens or TensorRT-LLM's kv_cache_config.max_tokens; `max_num_seqs` SGLang's
    --max-running-requests or TensorRT-LLM's max_batch_size; `version`, the engine's
    release, is named in the assumptions when it is not the one the model was read from.
    """
    tp, pp = kv.tensor_parallel_size, kv.pipeline_parallel_size
    weights_bytes = weights.bytes_per_gpu(tp, pp)
    if fraction is not None:  # in the caller's name for it (kvtune.plan's gpu_memory_utilization)
        _check_fraction(fraction, "gpu_memory_utilization", one=engine == "sglang")
    if engine == "sglang":
        return sglang_memory(
            gpu_memory_bytes=gpu_memory_bytes, weights_bytes=weights_bytes,
            kv_bytes_per_token_per_gpu=kv.kv_bytes_per_token_per_gpu, context_len=max_model_len, tp=tp, pp=pp,
            mem_fraction_static=fraction, chunked_prefill_size=max_num_batched_tokens, page_size=block_size,
            max_total_tokens=max_kv_tokens, max_running_requests=max_num_seqs, mla=spec.is_mla, version=version)
    if engine == "trtllm":
        return trtllm_memory(
            gpu_memory_bytes=gpu_memory_bytes, weights_bytes=weights_bytes,
            kv_bytes_per_token_per_gpu=kv.kv_bytes_per_token_per_gpu, hidden_size=spec.hidden_size,
            mlp_width=_mlp_width(spec), vocab_size=spec.vocab_size or 0, max_seq_len=max_model_len, tp=tp, pp=pp,
            free_gpu_memory_fraction=fraction, max_num_tokens=max_num_batched_tokens,
            tokens_per_block=block_size, max_tokens=max_kv_tokens, max_batch_size=max_num_seqs, version=version)
    raise OptionError(f"no memory model for engine {engine!r} here (known: sglang, trtllm)", field="engine")


__all__ = [
    "CUDA_BASELINE_BYTES", "COLLECTIVE_BASELINE_BYTES", "TRTLLM_CUDA_GRAPH_BYTES", "EngineMemory",
    "sglang_memory", "trtllm_memory", "trtllm_activation_bytes", "default_block_size", "default_fraction",
    "engine_memory", "engine_notes", "modelled_version",
]
