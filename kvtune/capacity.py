"""How much KV cache fits: pool bytes → blocks → tokens → concurrent requests.

Pure arithmetic over plain numbers; every figure is per GPU, the way one vLLM worker sees it.

    KV pool  = ceil(memory × gpu_memory_utilization) − weights per GPU − non-KV overhead
    blocks   = pool // (block_size × kv_bytes_per_token_per_gpu)
    tokens   = blocks × block_size

A gateway that admits a request must assume it grows to prompt + max_tokens, so it reserves
ceil((prompt + max_tokens) / block_size) blocks for the request's whole life. vLLM itself
allocates on demand and preempts when blocks run out; the reservation is what never preempts.

The estimate is only an estimate (arithmetic from gpu_memory_utilization has been seen 31% off);
a measured capacity (`MeasuredCapacity`: --kv-tokens, a vLLM startup log, /metrics) replaces it.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvtune.errors import CapacityError, InputError, KvtuneError
from kvtune.hardware import default_batch_limits
from kvtune.model import LayerKind

if TYPE_CHECKING:
    from kvtune.kv import KvBytes
    from kvtune.model import ModelSpec
    from kvtune.weights import WeightsEstimate

GiB = 1024**3

# Stated assumptions of the overhead model (per GPU).
ACTIVATION_BYTES_PER_ELEMENT = 2  # activations in 16-bit
LOGITS_BYTES_PER_ELEMENT = 4  # the sampler's dummy run holds float32 logits
CUDA_GRAPH_BYTES = GiB // 2  # vLLM logs "Graph capturing finished ..., took 0.1–1 GiB"
NON_TORCH_BYTES = GiB // 4  # cuBLAS/cuDNN workspaces allocated after vLLM's baseline snapshot
COLLECTIVE_BYTES = GiB // 2  # NCCL and custom all-reduce buffers when tp × pp > 1


class CapacitySource(enum.Enum):
    """Where a capacity came from; anything but ESTIMATE was measured on a running server."""

    ESTIMATE = "estimate"
    KV_TOKENS = "kv-tokens"
    VLLM_LOG = "vllm-log"
    METRICS = "metrics"


# --- measured capacity (also the file `kvtune calibrate` writes) ------------------------------


@dataclass(frozen=True, slots=True)
class MeasuredCapacity:
    """A KV capacity a real server reported. At least one of num_blocks / kv_cache_tokens is set."""

    source: CapacitySource
    kv_cache_tokens: int | None = None
    num_blocks: int | None = None
    block_size: int | None = None  # None: the server's block size was not reported
    max_model_len: int | None = None  # the length vLLM's "Maximum concurrency" line refers to
    max_concurrency: float | None = None  # vLLM's own figure at max_model_len
    device: str | None = None  # "GPU", "CPU", ... as the log names it
    model: str | None = None
    kv_cache_dtype: str | None = None
    num_gpu_blocks_override: int | None = None
    enable_prefix_caching: bool | None = None  # /metrics cache_config_info; None when not reported
    gpu_memory_utilization: float | None = None  # the server's setting (ignored when kv_cache_memory_bytes is set)
    kv_cache_memory_bytes: int | None = None  # the explicit KV size it was started with, if any
    origin: str | None = None  # the log path or URL it was read from
    line: int | None = None  # the log line it was read from

    def __post_init__(self) -> None:
        if self.kv_cache_tokens is None and self.num_blocks is None:
            raise KvtuneError("a measured capacity needs kv_cache_tokens or num_blocks", path=self.origin)
        for name in ("kv_cache_tokens", "num_blocks", "block_size", "max_model_len", "kv_cache_memory_bytes"):
            value = getattr(self, name)
            if value is not None and value < (1 if name in ("block_size", "max_model_len") else 0):
                raise KvtuneError(f"must be positive, got {value}", path=self.origin, field=name)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready; `from_dict(to_dict())` gives back an equal object."""
        return {
            "source": self.source.value,
            "kv_cache_tokens": self.kv_cache_tokens,
            "num_blocks": self.num_blocks,
            "block_size": self.block_size,
            "max_model_len": self.max_model_len,
            "max_concurrency": self.max_concurrency,
            "device": self.device,
            "model": self.model,
            "kv_cache_dtype": self.kv_cache_dtype,
            "num_gpu_blocks_override": self.num_gpu_blocks_override,
            "enable_prefix_caching": self.enable_prefix_caching,
            "gpu_memory_utilization": self.gpu_memory_utilization,
            "kv_cache_memory_bytes": self.kv_cache_memory_bytes,
            "origin": self.origin,
            "line": self.line,
        }

    @classmethod
    def from_dict(cls, data: Any, *, path: str | None = None) -> MeasuredCapacity:
        """Parse a capacity file's object strictly; errors name the field."""
        if not isinstance(data, dict):
            raise InputError(f"expected a JSON object, found {type(data).__name__}", path=path)
        from kvtune.userfiles import brief

        unknown = sorted(k if len(str(k)) <= 40 else brief(k, 40) for k in set(data) - set(_FIELD_TYPES) - {"source"})
        if unknown:
            raise InputError(f"unknown field(s): {', '.join(unknown[:5])}", path=path, field=unknown[0])
        raw_source = data.get("source")
        try:
            source = CapacitySource(raw_source)
        except (ValueError, TypeError):  # TypeError: an unhashable value such as a list
            known = ", ".join(s.value for s in CapacitySource)
            raise InputError(f"unknown source {brief(raw_source)} (known: {known})", path=path,
                             field="source") from None
        values: dict[str, Any] = {}
        for name, kind in _FIELD_TYPES.items():
            value = data.get(name)
            number = isinstance(value, (int, float)) and not isinstance(value, bool)
            if value is None:
                values[name] = None
            elif (kind is float and number) or (kind is int and number and isinstance(value, int)):
                low, high = _FIELD_RANGES.get(name, (0, _MAX_FIELD))
                if not low <= value <= high:  # also NaN
                    raise InputError(f"must be from {low} to {high}, found {brief(value)}", path=path, field=name)
                values[name] = kind(value)
            elif (kind is bool and isinstance(value, bool)) or (kind is str and isinstance(value, str)):
                values[name] = value
            else:
                raise InputError(f"expected {kind.__name__}, found {brief(value)}", path=path, field=name)
        try:
            return cls(source=source, **values)
        except KvtuneError as exc:
            raise InputError(exc.message, path=path, field=exc.field) from None


_FIELD_TYPES: dict[str, type] = {
    "kv_cache_tokens": int,
    "num_blocks": int,
    "block_size": int,
    "max_model_len": int,
    "max_concurrency": float,
    "device": str,
    "model": str,
    "kv_cache_dtype": str,
    "num_gpu_blocks_override": int,
    "enable_prefix_caching": bool,
    "gpu_memory_utilization": float,
    "kv_cache_memory_bytes": int,
    "origin": str,
    "line": int,
}
_MAX_FIELD = 2**53  # exact in a double: what JSON readers and the rendered files agree on
# (minimum, maximum) where 0..2**53 is not the range; the dataclass checks what must be positive
_FIELD_RANGES: dict[str, tuple[float, float]] = {
    "max_concurrency": (0, _MAX_FIELD),
    "gpu_memory_utilization": (0, 1),
    "line": (1, _MAX_FIELD),
}


def blocks_from_tokens(kv_cache_tokens: int, block_size: int, max_model_len: int | None = None) -> int:
    """Invert vLLM's token count back to blocks.

    vLLM (V1) logs tokens = int(num_blocks / ceil(L / block_size) × L) for max_model_len L, which is
    below num_blocks × block_size when L is not a multiple of block_size. The smallest block count
    that reproduces the logged tokens is ceil(tokens × ceil(L/bs) / L). Without L: tokens // bs.
    """
    if max_model_len is None:
        return kv_cache_tokens // block_size
    blocks_per_request = -(-max_model_len // block_size)
    num = kv_cache_tokens * blocks_per_request
    blocks = -(-num // max_model_len)
    # a single-group model logs exactly int(blocks * L / c); anything else (hybrid groups) falls back
    if (blocks * max_model_len) // blocks_per_request != kv_cache_tokens:
        return kv_cache_tokens // block_size
    return blocks


# --- the memory side -------------------------------------------------------------------------


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
            f"must be in (0, 1], got {gpu_memory_utilization}", field="--gpu-memory-utilization"
        )
    requested = math.ceil(gpu_memory_bytes * gpu_memory_utilization)
    pool = requested - weights_bytes - overhead.total_bytes
    if pool <= 0:
        what = "weights alone exceed" if weights_bytes >= requested else "weights + overhead exceed"
        raise CapacityError(
            f"{what} the usable memory per GPU: weights {weights_bytes / GiB:.2f} GiB + overhead "
            f"{overhead.total_bytes / GiB:.2f} GiB > {gpu_memory_bytes / GiB:.2f} GiB × "
            f"{gpu_memory_utilization} = {requested / GiB:.2f} GiB; use more GPUs (--tp/--pp), "
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
        raise CapacityError(f"must be at least 1, got {block_size}", field="--block-size")
    if kv_bytes_per_token_per_gpu < 1:
        raise CapacityError("the model keeps no per-token KV cache; token capacity is unbounded")
    return kv_cache_bytes // (block_size * kv_bytes_per_token_per_gpu)


# --- the request side ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RequestShape:
    """One kind of request: its prompt and the output cap (max_tokens) it is admitted with."""

    prompt_tokens: int
    max_tokens: int

    def __post_init__(self) -> None:
        if self.prompt_tokens < 1:
            raise KvtuneError(f"must be at least 1, got {self.prompt_tokens}", field="--prompt-tokens")
        if self.max_tokens < 1:
            raise KvtuneError(f"must be at least 1, got {self.max_tokens}", field="--max-tokens")


@dataclass(frozen=True, slots=True)
class RequestFit:
    """How many requests of one shape fit at once when each reserves its worst case."""

    prompt_tokens: int
    max_tokens: int
    reserved_tokens: int  # prompt + max_tokens, clamped to max_model_len as vLLM clamps max_tokens
    reserved_blocks: int
    max_concurrent: int
    note: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "max_tokens": self.max_tokens,
            "reserved_tokens": self.reserved_tokens,
            "reserved_blocks": self.reserved_blocks,
            "max_concurrent": self.max_concurrent,
            "note": self.note,
        }


def reserved_blocks(prompt_tokens, max_tokens: int, block_size: int):
    """Blocks a request can grow into: ceil((prompt + max_tokens) / block_size).

    `prompt_tokens` may be an int or a numpy array of prompt lengths (one result per prompt)."""
    return -(-(prompt_tokens + max_tokens) // block_size)


def fit_request(
    shape: RequestShape,
    *,
    usable_blocks: int,
    block_size: int,
    max_model_len: int,
    state_blocks_per_sequence: int = 0,
) -> RequestFit:
    """Reserve prompt + cap (+ per-sequence state blocks) and count how many such requests fit."""
    p, m = shape.prompt_tokens, shape.max_tokens
    if p >= max_model_len:
        return RequestFit(p, m, p, reserved_blocks(p, 0, block_size), 0,
                          f"prompt {p:,} ≥ max_model_len {max_model_len:,}: vLLM rejects it (HTTP 400)")
    note = None
    reserved_tokens = p + m
    if reserved_tokens > max_model_len:
        reserved_tokens = max_model_len
        note = f"max_tokens clamped to max_model_len − prompt = {max_model_len - p:,}, as vLLM does"
    blocks = -(-reserved_tokens // block_size) + state_blocks_per_sequence
    if blocks > usable_blocks:
        return RequestFit(p, m, reserved_tokens, blocks, 0,
                          f"does not fit: needs {blocks:,} blocks, only {usable_blocks:,} usable")
    return RequestFit(p, m, reserved_tokens, blocks, usable_blocks // blocks, note)


# --- the whole answer ------------------------------------------------------------------------


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
        raise CapacityError(f"must be at least 1, got {max_model_len}", field="--max-model-len")
    notes_list = list(notes)
    blocks_per_max_len = -(-max_model_len // block_size)
    concurrency = num_blocks / blocks_per_max_len
    if concurrency < 1:
        notes_list.append(
            f"one request at max_model_len {max_model_len:,} needs {blocks_per_max_len:,} blocks but only "
            f"{num_blocks:,} exist: vLLM would refuse to start; lower --max-model-len to at most "
            f"{num_blocks * block_size:,}"
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
            notes_list.append(f"blocks = tokens converted at block size {bs} (pass --block-size if the server used another)")
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

    def to_dict(self) -> dict[str, Any]:
        """The stable `--json` object. Byte figures are per GPU except weights_bytes_total."""
        c = self.capacity
        m = c.memory
        return {
            "model": self.model,
            "gpu": self.gpu,
            "gpu_memory_bytes": self.gpu_memory_bytes,
            "gpu_memory_utilization": m.gpu_memory_utilization if m else None,
            "tensor_parallel_size": self.tensor_parallel_size,
            "pipeline_parallel_size": self.pipeline_parallel_size,
            "kv_cache_dtype": self.kv_cache_dtype,
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


def _layer_notes(spec: ModelSpec, kv: KvBytes) -> list[str]:
    """Caveats where kvtune's per-token figure and vLLM's hybrid allocator part ways."""
    kinds = set(spec.layer_kinds)
    notes = []
    if LayerKind.SLIDING in kinds or LayerKind.CHUNKED in kinds:
        window = spec.sliding_window or spec.attention_chunk_size
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


def plan_capacity(
    spec: ModelSpec,
    kv: KvBytes,
    weights: WeightsEstimate,
    *,
    gpu_name: str | None = None,
    gpu_memory_bytes: int | None = None,
    gpu_memory_utilization: float = 0.92,
    max_model_len: int | None = None,
    max_num_batched_tokens: int | None = None,
    block_size: int | None = None,
    shapes: tuple[RequestShape, ...] = (),
    measured: MeasuredCapacity | None = None,
    enforce_eager: bool = False,
) -> CapacityReport:
    """Estimate the KV pool from memory, or take a measured one, and fit the request shapes.

    Defaults follow `vllm serve`: block size 16 (128 when the measurement came from a CPU
    server), max_model_len derived from the config, max_num_batched_tokens by GPU size.
    """
    tp, pp = kv.tensor_parallel_size, kv.pipeline_parallel_size
    notes: list[str] = []
    assumptions: list[str] = []
    if gpu_memory_bytes is None and measured is None:
        raise KvtuneError(
            "give --gpu or --gpu-memory to estimate, or a measured capacity "
            "(--kv-tokens, --vllm-log, --metrics-url)",
            field="--gpu",
        )
    derived_len = spec.max_position_embeddings
    if max_model_len is not None and derived_len is not None and max_model_len > derived_len:
        notes.append(f"max_model_len {max_model_len:,} is above the model's derived {derived_len:,}: vLLM refuses "
                     "it unless VLLM_ALLOW_LONG_MAX_MODEL_LEN=1")
    if max_model_len is None:
        max_model_len = (measured.max_model_len if measured else None) or derived_len
        if max_model_len is None:
            max_model_len = 2048
            notes.append("the config names no context length; max_model_len 2048, as vLLM defaults")
    if block_size is None:
        block_size = 128 if measured and (measured.device or "").upper().startswith("CPU") else 16

    memory = None
    batched = seqs = None
    if gpu_memory_bytes is not None:
        default_batched, seqs = default_batch_limits(gpu_memory_bytes, gpu_name)
        if max_num_batched_tokens is None:
            batched = min(seqs * max_model_len, default_batched)
            assumptions.append(f"max_num_batched_tokens {batched:,}: vllm serve's default for this GPU size")
        else:
            batched = max_num_batched_tokens
        seqs = min(seqs, batched)
        mlp_width = max(spec.intermediate_size or 4 * spec.hidden_size,
                        (spec.num_experts_per_tok or 0) * (spec.moe_intermediate_size or 0))
        overhead = estimate_overhead(
            hidden_size=spec.hidden_size,
            mlp_width=mlp_width,
            vocab_size=spec.vocab_size or 0,
            max_num_batched_tokens=batched,
            max_num_seqs=seqs,
            tp=tp,
            pp=pp,
            enforce_eager=enforce_eager,
        )
        assumptions.extend(overhead.assumptions)
        try:
            memory = kv_pool(
                gpu_memory_bytes=gpu_memory_bytes,
                gpu_memory_utilization=gpu_memory_utilization,
                weights_bytes=weights.bytes_per_gpu(tp, pp),
                overhead=overhead,
            )
        except CapacityError as exc:
            if measured is None:
                raise
            notes.append(f"the estimate disagrees with the measurement: {exc.message}")
    assumptions.extend(weights.assumptions)
    if tp * pp > 1:
        assumptions.append(f"weights split evenly over tp × pp = {tp * pp} GPUs")
    assumptions.append("per-shape counts use num_blocks − 1: vLLM keeps one block as a permanent null block")
    notes.extend(_layer_notes(spec, kv))

    state = kv.state_bytes_per_sequence_per_gpu
    if measured is not None:
        capacity = measured_capacity(
            measured, block_size=block_size, max_model_len=max_model_len, shapes=shapes,
            kv_bytes_per_token_per_gpu=kv.kv_bytes_per_token_per_gpu,
            state_bytes_per_sequence_per_gpu=state, memory=memory, notes=tuple(notes),
        )
    else:
        assert memory is not None
        capacity = estimate_capacity(
            memory=memory, kv_bytes_per_token_per_gpu=kv.kv_bytes_per_token_per_gpu,
            block_size=block_size, max_model_len=max_model_len, shapes=shapes,
            state_bytes_per_sequence_per_gpu=state, notes=tuple(notes),
        )
    return CapacityReport(
        model=spec.name,
        gpu=gpu_name,
        gpu_memory_bytes=gpu_memory_bytes,
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
    )


__all__ = [
    "CapacitySource",
    "MeasuredCapacity",
    "Overhead",
    "MemoryBreakdown",
    "RequestShape",
    "RequestFit",
    "Capacity",
    "blocks_from_tokens",
    "estimate_overhead",
    "kv_pool",
    "num_blocks_for",
    "reserved_blocks",
    "fit_request",
    "capacity_from_blocks",
    "estimate_capacity",
    "measured_capacity",
    "CapacityReport",
    "plan_capacity",
]
