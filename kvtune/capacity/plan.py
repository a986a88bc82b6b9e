"""The KV capacity of one model on one deployment: pool bytes → blocks → tokens → concurrent
requests, estimated from memory or taken from a measurement, with what fits in it.

    KV pool  = ceil(memory × gpu_memory_utilization) − weights per GPU − non-KV overhead
    blocks   = pool // (block_size × kv_bytes_per_token_per_gpu)
    tokens   = blocks × block_size

The estimate is only an estimate (arithmetic from gpu_memory_utilization has been seen 31% off);
a measured capacity (`MeasuredCapacity`: --kv-tokens, a vLLM startup log, /metrics) replaces it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvtune.capacity import engine_memory
from kvtune.capacity.measured import CapacitySource, MeasuredCapacity, blocks_from_tokens
from kvtune.capacity.memory import (
    MemoryBreakdown,
    estimate_overhead,
    kv_pool,
    memory_model,
    num_blocks_for,
    profile_limits,
)
from kvtune.capacity.reservation import RequestFit, RequestShape, fit_request, reserved_blocks
from kvtune.engines import vllm
from kvtune.errors import CapacityError, OptionError
from kvtune.model import LayerKind

if TYPE_CHECKING:
    from kvtune.kv import KvBytes
    from kvtune.model import ModelSpec
    from kvtune.weights import WeightsEstimate

CONTEXT_NOTE = "one request at max_model_len "  # the note's start; engine_notes rewrites it per engine


def is_context_note(note: str) -> bool:
    """Whether a capacity note is the one about a request at max_model_len not fitting (in any
    engine's words): `recommend` states that for the length it renders instead."""
    return note.startswith((CONTEXT_NOTE, *engine_memory.CONTEXT_NOTES))


@dataclass(frozen=True, slots=True)
class Capacity:
    """KV capacity of one serving instance, where it came from, and what fits in it."""

    source: CapacitySource
    num_blocks: int
    block_size: int
    kv_cache_tokens: int
    max_model_len: int
    max_concurrency_at_max_model_len: float  # vLLM's definition: num_blocks / ceil(L / block_size)
    requests: tuple[RequestFit, ...]
    kv_bytes_per_token_per_gpu: int | None = None
    kv_cache_bytes: int | None = None  # per GPU
    memory: MemoryBreakdown | None = None  # the estimate's breakdown (also kept beside a measurement)
    estimated_num_blocks: int | None = None  # what the estimate said, when a measurement replaced it
    measured: MeasuredCapacity | None = None
    notes: tuple[str, ...] = field(default=())

    @property
    def usable_blocks(self) -> int:
        """All blocks but vLLM's permanent null block."""
        return max(0, self.num_blocks - 1)


def capacity_from_blocks(
    *,
    source: CapacitySource,
    num_blocks: int,
    block_size: int,
    max_model_len: int,
    shapes: tuple[RequestShape, ...] = (),
    kv_cache_tokens: int | None = None,
    kv_bytes_per_token_per_gpu: int | None = None,
    state_bytes_per_sequence_per_gpu: int = 0,
    memory: MemoryBreakdown | None = None,
    estimated_num_blocks: int | None = None,
    measured: MeasuredCapacity | None = None,
    notes: tuple[str, ...] = (),
) -> Capacity:
    """Tokens, concurrency at max_model_len and per-shape fits from a block count."""
    if max_model_len < 1:
        raise CapacityError(f"must be at least 1, got {max_model_len}", field="max_model_len")
    notes_list = list(notes)
    blocks_per_max_len = reserved_blocks(max_model_len, 0, block_size)  # vLLM's own concurrency figure
    concurrency = num_blocks / blocks_per_max_len
    if blocks_per_max_len > num_blocks - 1:  # vLLM's startup check plans without its null block
        notes_list.append(
            f"{CONTEXT_NOTE}{max_model_len:,} needs {blocks_per_max_len:,} blocks but only "
            f"{max(0, num_blocks - 1):,} are usable beside the null block: vLLM would refuse to start; lower "
            f"--max-model-len to at most {max(0, num_blocks - 1) * block_size:,}"
        )
    state_blocks = 0
    if state_bytes_per_sequence_per_gpu and kv_bytes_per_token_per_gpu:
        block_bytes = block_size * kv_bytes_per_token_per_gpu
        state_blocks = -(-state_bytes_per_sequence_per_gpu // block_bytes)
        notes_list.append(
            f"each request also holds {state_bytes_per_sequence_per_gpu:,} B of per-sequence state "
            f"per GPU, reserved as {state_blocks} extra block(s)"
        )
    usable = max(0, num_blocks - 1)
    fits = tuple(
        fit_request(s, usable_blocks=usable, block_size=block_size, max_model_len=max_model_len,
                    state_blocks_per_sequence=state_blocks)
        for s in shapes
    )
    kv_bytes = None
    if memory is not None and source is CapacitySource.ESTIMATE:
        kv_bytes = memory.kv_cache_bytes
    elif kv_bytes_per_token_per_gpu:
        kv_bytes = num_blocks * block_size * kv_bytes_per_token_per_gpu
    return Capacity(
        source=source,
        num_blocks=num_blocks,
        block_size=block_size,
        kv_cache_tokens=num_blocks * block_size if kv_cache_tokens is None else kv_cache_tokens,
        max_model_len=max_model_len,
        max_concurrency_at_max_model_len=concurrency,
        requests=fits,
        kv_bytes_per_token_per_gpu=kv_bytes_per_token_per_gpu,
        kv_cache_bytes=kv_bytes,
        memory=memory,
        estimated_num_blocks=estimated_num_blocks,
        measured=measured,
        notes=tuple(notes_list),
    )


def estimate_capacity(
    *,
    memory: MemoryBreakdown,
    kv_bytes_per_token_per_gpu: int,
    block_size: int,
    max_model_len: int,
    shapes: tuple[RequestShape, ...] = (),
    state_bytes_per_sequence_per_gpu: int = 0,
    notes: tuple[str, ...] = (),
) -> Capacity:
    """Capacity from the memory arithmetic alone."""
    blocks = num_blocks_for(memory.kv_cache_bytes, block_size, kv_bytes_per_token_per_gpu)
    return capacity_from_blocks(
        source=CapacitySource.ESTIMATE,
        num_blocks=blocks,
        block_size=block_size,
        max_model_len=max_model_len,
        shapes=shapes,
        kv_bytes_per_token_per_gpu=kv_bytes_per_token_per_gpu,
        state_bytes_per_sequence_per_gpu=state_bytes_per_sequence_per_gpu,
        memory=memory,
        notes=notes,
    )


def measured_capacity(
    measured: MeasuredCapacity,
    *,
    block_size: int,
    max_model_len: int,
    shapes: tuple[RequestShape, ...] = (),
    kv_bytes_per_token_per_gpu: int | None = None,
    state_bytes_per_sequence_per_gpu: int = 0,
    memory: MemoryBreakdown | None = None,
    notes: tuple[str, ...] = (),
) -> Capacity:
    """Capacity from a measurement: its blocks and block size win over the given ones.

    `block_size` is used only when the measurement does not say (a log, --kv-tokens).
    """
    notes_list = list(notes)
    bs = measured.block_size or block_size
    if measured.block_size and measured.block_size != block_size:
        notes_list.append(f"block size {measured.block_size} reported by the server (not {block_size})")
    if measured.num_blocks is not None:
        blocks = measured.num_blocks
    else:
        assert measured.kv_cache_tokens is not None  # guaranteed by MeasuredCapacity
        blocks = blocks_from_tokens(measured.kv_cache_tokens, bs, measured.max_model_len)
        if measured.block_size is None:
            notes_list.append(f"blocks = tokens converted at block size {bs} "
                              "(give the block size if the server used another)")
    if measured.max_model_len and measured.max_model_len != max_model_len:
        notes_list.append(
            f"the server's startup line was for max_model_len {measured.max_model_len:,}; "
            f"concurrency here is computed for {max_model_len:,}"
        )
    return capacity_from_blocks(
        source=measured.source,
        num_blocks=blocks,
        block_size=bs,
        max_model_len=max_model_len,
        shapes=shapes,
        kv_cache_tokens=measured.kv_cache_tokens,
        kv_bytes_per_token_per_gpu=kv_bytes_per_token_per_gpu,
        state_bytes_per_sequence_per_gpu=state_bytes_per_sequence_per_gpu,
        memory=memory,
        estimated_num_blocks=(
            num_blocks_for(memory.kv_cache_bytes, bs, kv_bytes_per_token_per_gpu)
            if memory is not None and kv_bytes_per_token_per_gpu else None
        ),
        measured=measured,
        notes=tuple(notes_list),
    )



# --- one model on one deployment -------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class CapacityReport:
    """The answer to `kvtune capacity`: the capacity plus the settings and assumptions behind it."""

    model: str
    gpu: str | None
    gpu_memory_bytes: int | None
    tensor_parallel_size: int
    pipeline_parallel_size: int
    kv_cache_dtype: str
    max_num_batched_tokens: int | None
    max_num_seqs: int | None
    weights_bytes_total: int
    weights_bytes_per_gpu: int
    weights_source: str
    weights_format: str
    capacity: Capacity
    assumptions: tuple[str, ...]
    engine: str = "vllm"  # whose memory model and defaults (kvtune.engines.ENGINE_NAMES)
    engine_version: str = vllm.CURRENT_VERSION  # the release of `engine` whose memory model the estimate assumes

    def to_dict(self) -> dict[str, Any]:
        """The stable `--json` object. Byte figures are per GPU except weights_bytes_total;
        gpu_memory_utilization is the engine's fraction (SGLang mem_fraction_static,
        TensorRT-LLM free_gpu_memory_fraction)."""
        c = self.capacity
        m = c.memory
        return {
            "model": self.model,
            "engine": self.engine,
            "gpu": self.gpu,
            "gpu_memory_bytes": self.gpu_memory_bytes,
            "gpu_memory_utilization": m.gpu_memory_utilization if m else None,
            "tensor_parallel_size": self.tensor_parallel_size,
            "pipeline_parallel_size": self.pipeline_parallel_size,
            "kv_cache_dtype": self.kv_cache_dtype,
            "engine_version": self.engine_version,
            "kv_bytes_per_token_per_gpu": c.kv_bytes_per_token_per_gpu,
            "source": c.source.value,
            "measured_from": c.measured.origin if c.measured else None,
            "block_size": c.block_size,
            "num_blocks": c.num_blocks,
            "kv_cache_tokens": c.kv_cache_tokens,
            "kv_cache_bytes": c.kv_cache_bytes,
            "estimated_num_blocks": c.estimated_num_blocks,
            "max_model_len": c.max_model_len,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "max_num_seqs": self.max_num_seqs,
            "max_concurrency_at_max_model_len": round(c.max_concurrency_at_max_model_len, 4),
            "requested_memory_bytes": m.requested_memory_bytes if m else None,
            "weights_bytes": self.weights_bytes_per_gpu,
            "weights_bytes_total": self.weights_bytes_total,
            "weights_source": self.weights_source,
            "weights_format": self.weights_format,
            "overhead_bytes": m.overhead_bytes if m else None,
            "overhead": (
                {
                    "activation_bytes": m.overhead.activation_bytes,
                    "cuda_graph_bytes": m.overhead.cuda_graph_bytes,
                    "non_torch_bytes": m.overhead.non_torch_bytes,
                }
                if m else None
            ),
            "requests": [r.to_dict() for r in c.requests],
            "assumptions": list(self.assumptions),
            "notes": list(c.notes),
        }


    def capacity_file(self) -> MeasuredCapacity:
        """This capacity as a capacity file states it (kvtune.capacity.measured's format, the one
        `kvtune calibrate` writes): what `kvtune capacity --json` adds to its report, so that its
        output is a `--capacity FILE`, and the pool an offline simulation runs on. An estimate
        is a capacity of source `estimate` on a GPU; a measured one keeps what was measured."""
        c = self.capacity
        m = c.measured
        utilization = c.memory.gpu_memory_utilization if c.memory is not None else None
        return MeasuredCapacity(
            source=c.source, kv_cache_tokens=c.kv_cache_tokens, num_blocks=c.num_blocks, block_size=c.block_size,
            max_model_len=c.max_model_len, max_concurrency=m.max_concurrency if m else None,
            device=m.device if m else "GPU", model=self.model, kv_cache_dtype=self.kv_cache_dtype,
            num_gpu_blocks_override=m.num_gpu_blocks_override if m else None,
            enable_prefix_caching=m.enable_prefix_caching if m else None,
            gpu_memory_utilization=m.gpu_memory_utilization if m and m.gpu_memory_utilization is not None
            else utilization,
            kv_cache_memory_bytes=m.kv_cache_memory_bytes if m else None,
            origin=m.origin if m else None, line=m.line if m else None, timing=m.timing if m else None,
            max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens,
            tensor_parallel_size=self.tensor_parallel_size, engine=self.engine)


def _layer_notes(spec: ModelSpec, kv: KvBytes) -> list[str]:
    """Caveats where kvtune's per-token figure and vLLM's hybrid allocator part ways."""
    kinds = set(spec.layer_kinds)
    notes = []
    if LayerKind.SLIDING in kinds or LayerKind.CHUNKED in kinds:
        window = spec.attention.sliding_window or spec.attention.chunk_size
        notes.append(
            f"sliding-window/chunked layers (window {window:,}) are counted as holding every token, as with "
            "--disable-hybrid-kv-cache-manager; vLLM's default hybrid manager keeps only about window + one "
            "batch per request there, so real capacity is higher: measure it (--vllm-log or --metrics-url)"
            if window else
            "sliding-window/chunked layers are counted as holding every token; measure the real capacity"
        )
    if LayerKind.MLA in kinds:
        notes.append("MLA: vLLM's MLA attention backends may use their own block size (e.g. 64); "
                     "pass --block-size to match the server")
    if kinds & {LayerKind.MAMBA, LayerKind.LINEAR}:
        notes.append(
            "hybrid model: vLLM raises the attention block size to fit the state page and groups layers; "
            "a measured capacity is more reliable than this estimate"
        )
    return notes


@dataclass(frozen=True, slots=True)
class CapacityInputs:
    """What the capacity is planned from besides the model and its KV cost: the weights, the GPU
    resolved to its memory, the engine settings and a measurement (kvtune.planning.replan
    repeats it at other scheduler limits)."""

    weights: WeightsEstimate
    gpu_name: str | None = None
    gpu_memory_bytes: int | None = None
    gpu_memory_utilization: float | None = None
    max_model_len: int | None = None
    max_num_batched_tokens: int | None = None
    block_size: int | None = None
    shapes: tuple[RequestShape, ...] = ()
    measured: MeasuredCapacity | None = None
    enforce_eager: bool = False
    engine: str = "vllm"
    engine_version: str | None = None
    max_kv_tokens: int | None = None
    max_num_seqs: int | None = None


def plan_capacity(spec: ModelSpec, kv: KvBytes, inputs: CapacityInputs) -> CapacityReport:
    """Estimate the KV pool from memory, or take a measured one, and fit the request shapes.

    Defaults follow `vllm serve` of `engine_version` (None: the current release): its
    gpu_memory_utilization (0.92, 0.9 before kvtune.engines.vllm.FIRST_092_UTILIZATION_VERSION), block size 16
    (128 when the measurement came from a CPU server), max_model_len derived from the config,
    max_num_batched_tokens by GPU size (V1) or max(max_model_len, 2048) (V0, before 0.8).
    Another `engine` ("sglang", "trtllm") takes its own memory model and defaults
    (kvtune.capacity.engine_memory; `engine_version` is then that engine's release):
    gpu_memory_utilization is its fraction (None: its default), max_num_batched_tokens its
    chunked_prefill_size / max_num_tokens, and max_kv_tokens its --max-total-tokens /
    kv_cache_config.max_tokens clamp. `max_num_seqs` (None: the engine's default for the GPU) is
    the sequence count the profile's dummy sampler runs at (vLLM), or SGLang's
    --max-running-requests / TensorRT-LLM's max_batch_size.
    """
    measured, engine = inputs.measured, inputs.engine
    if inputs.gpu_memory_bytes is None and measured is None:
        raise OptionError(
            "give `gpu` or `gpu_memory` to estimate, or a measured capacity "
            "(`kv_tokens`, `vllm_log`, `metrics_url`, `capacity_file`)",
            field="gpu",
        )
    notes: list[str] = []
    assumptions: list[str] = []
    max_model_len, block_size = _lengths(spec, inputs, notes)
    memory, batched, seqs = _estimate(spec, kv, inputs, (max_model_len, block_size), notes, assumptions)
    tp, pp = kv.tensor_parallel_size, kv.pipeline_parallel_size
    weights = inputs.weights
    assumptions.extend(weights.assumptions)
    if tp * pp > 1:
        assumptions.append(f"weights split evenly over tp × pp = {tp * pp} GPUs")
    assumptions.append("per-shape counts use num_blocks − 1: vLLM keeps one block as a permanent null block"
                       if engine == "vllm" else "per-shape counts keep one block spare (num_blocks − 1), as for vLLM")
    notes.extend(_layer_notes(spec, kv))

    state = kv.state_bytes_per_sequence_per_gpu
    if measured is not None:
        capacity = measured_capacity(
            measured, block_size=block_size, max_model_len=max_model_len, shapes=inputs.shapes,
            kv_bytes_per_token_per_gpu=kv.kv_bytes_per_token_per_gpu,
            state_bytes_per_sequence_per_gpu=state, memory=memory, notes=tuple(notes),
        )
    else:
        assert memory is not None
        capacity = estimate_capacity(
            memory=memory, kv_bytes_per_token_per_gpu=kv.kv_bytes_per_token_per_gpu,
            block_size=block_size, max_model_len=max_model_len, shapes=inputs.shapes,
            state_bytes_per_sequence_per_gpu=state, notes=tuple(notes),
        )
    if engine != "vllm":
        capacity = dataclasses.replace(capacity, notes=engine_memory.engine_notes(
            engine, capacity.notes, capacity.max_model_len, capacity.kv_cache_tokens))
    release = memory_model(inputs.engine_version if engine == "vllm" else None)
    return CapacityReport(
        model=spec.name,
        gpu=inputs.gpu_name,
        gpu_memory_bytes=inputs.gpu_memory_bytes,
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        kv_cache_dtype=kv.kv_cache_dtype,
        max_num_batched_tokens=batched,
        max_num_seqs=seqs,
        weights_bytes_total=weights.weights_bytes,
        weights_bytes_per_gpu=weights.bytes_per_gpu(tp, pp),
        weights_source=weights.source.value,
        weights_format=weights.weight_format,
        capacity=capacity,
        assumptions=tuple(assumptions),
        engine=engine,
        engine_version=(".".join(map(str, release.version)) if engine == "vllm"
                        else engine_memory.modelled_version(engine)),
    )


def _lengths(spec: ModelSpec, inputs: CapacityInputs, notes: list[str]) -> tuple[int, int]:
    """(max_model_len, block size): the given ones, else the measurement's or the engine's defaults."""
    measured, max_model_len, block_size = inputs.measured, inputs.max_model_len, inputs.block_size
    derived_len = spec.max_position_embeddings
    if max_model_len is not None and derived_len is not None and max_model_len > derived_len:
        notes.append(f"max_model_len {max_model_len:,} is above the model's derived {derived_len:,}: vLLM refuses "
                     "it unless VLLM_ALLOW_LONG_MAX_MODEL_LEN=1")
    if max_model_len is None:
        max_model_len = (measured.max_model_len if measured else None) or derived_len
        if max_model_len is None:
            max_model_len = vllm.MAX_MODEL_LEN_WITHOUT_CONFIG
            notes.append(f"the config names no context length; max_model_len {max_model_len}, as vLLM defaults")
    if block_size is None:
        block_size = (vllm.default_block_size(measured.device if measured else None) if inputs.engine == "vllm"
                      else engine_memory.default_block_size(inputs.engine))
    return max_model_len, block_size


def _estimate(spec: ModelSpec, kv: KvBytes, inputs: CapacityInputs, lengths: tuple[int, int], notes: list[str],
              assumptions: list[str]) -> tuple[MemoryBreakdown | None, int | None, int | None]:
    """(the memory estimate, max_num_batched_tokens, max_num_seqs) on the GPU's memory (None: no
    memory given); an estimate a measurement contradicts is a note, not an error."""
    if inputs.gpu_memory_bytes is None:
        return None, None, None
    if inputs.engine != "vllm":
        try:
            memory = engine_memory.engine_memory(
                inputs.engine, spec, kv, inputs.weights, gpu_memory_bytes=inputs.gpu_memory_bytes,
                fraction=inputs.gpu_memory_utilization, max_model_len=lengths[0], block_size=lengths[1],
                max_num_batched_tokens=inputs.max_num_batched_tokens, max_kv_tokens=inputs.max_kv_tokens,
                version=inputs.engine_version, max_num_seqs=inputs.max_num_seqs)
        except CapacityError as exc:
            if inputs.measured is None:
                raise
            notes.append(f"the estimate disagrees with the measurement: {exc.message}")
            return None, None, None
        assumptions.extend(memory.overhead.assumptions)
        return memory, memory.max_num_batched_tokens, memory.max_num_seqs
    try:
        return _vllm_estimate(spec, kv, inputs, lengths[0], assumptions)
    except _Contradicted as exc:
        if inputs.measured is None:
            raise exc.error from None
        notes.append(f"the estimate disagrees with the measurement: {exc.error.message}")
        return None, exc.batched, exc.seqs


class _Contradicted(Exception):
    """vLLM's pool came out empty after its scheduler limits were known (they are still reported)."""

    def __init__(self, error: CapacityError, batched: int, seqs: int) -> None:
        super().__init__(error.message)
        self.error, self.batched, self.seqs = error, batched, seqs


def _vllm_estimate(spec: ModelSpec, kv: KvBytes, inputs: CapacityInputs, max_model_len: int,
                   assumptions: list[str]) -> tuple[MemoryBreakdown, int, int]:
    """vLLM's startup profile of `engine_version`: its scheduler limits, the profiled activations,
    CUDA graphs and the rest, and the pool the utilization leaves."""
    assert inputs.gpu_memory_bytes is not None
    release = memory_model(inputs.engine_version)  # vLLM's memory model by release
    tp, pp = kv.tensor_parallel_size, kv.pipeline_parallel_size
    utilization = inputs.gpu_memory_utilization
    if utilization is None:
        utilization = vllm.default_gpu_memory_utilization(release.version)
    batched, seqs, why = profile_limits(release, max_model_len=max_model_len,
                                        max_num_batched_tokens=inputs.max_num_batched_tokens,
                                        max_num_seqs=inputs.max_num_seqs,
                                        gpu_memory_bytes=inputs.gpu_memory_bytes, gpu_name=inputs.gpu_name)
    if inputs.max_num_batched_tokens is None or not release.v1:
        assumptions.append(why)
    mlp_width = spec.intermediate_size or 4 * spec.hidden_size
    moe = spec.moe
    if moe is not None and moe.experts_per_token is not None and moe.intermediate_size is not None:
        mlp_width = max(mlp_width, moe.experts_per_token * moe.intermediate_size)  # the active experts' MLPs
    overhead = estimate_overhead(
        hidden_size=spec.hidden_size,
        mlp_width=mlp_width,
        vocab_size=spec.vocab_size or 0,
        max_num_batched_tokens=batched,
        max_num_seqs=seqs,
        tp=tp,
        pp=pp,
        enforce_eager=inputs.enforce_eager,
        engine_version=inputs.engine_version,
    )
    assumptions.extend(overhead.assumptions)
    try:
        memory = kv_pool(
            gpu_memory_bytes=inputs.gpu_memory_bytes,
            gpu_memory_utilization=utilization,
            weights_bytes=inputs.weights.bytes_per_gpu(tp, pp),
            overhead=overhead,
        )
    except CapacityError as exc:
        raise _Contradicted(exc, batched, seqs) from None
    return memory, batched, seqs

__all__ = [
    "Capacity",
    "capacity_from_blocks",
    "is_context_note",
    "CONTEXT_NOTE",
    "estimate_capacity",
    "measured_capacity",
    "CapacityReport",
    "CapacityInputs",
    "plan_capacity",
]
