"""The plan: a model, its KV cost and its capacity on one deployment, with the basis the capacity
rests on. Everything `recommend` and `capacity` need that is not traffic.

A measured capacity (a vLLM startup log, a running server's /metrics, a capacity file from
`kvtune calibrate`, a token count) wins over the memory estimate, and so does the setting it
was measured at: a deploy file rendered from a plan must never contradict the capacity it was
computed from. So the plan resolves `kv_cache_dtype`, `gpu_memory_utilization` and the block
size from the measurement when it reports them, and refuses a caller's value that contradicts
them (`PlanError` names the setting, the caller's value and the measured one).
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
from dataclasses import dataclass
from typing import Generic, TypeVar

from kvtune.capacity.engine_logs import fetch_engine_capacity, read_engine_log
from kvtune.capacity.engine_memory import default_fraction
from kvtune.capacity.measured import (
    CapacitySource,
    MeasuredCapacity,
    fetch_capacity,
    read_capacity_file,
    read_vllm_log,
)
from kvtune.capacity.memory import memory_model
from kvtune.capacity.plan import Capacity, CapacityInputs, CapacityReport, plan_capacity
from kvtune.capacity.reservation import RequestShape
from kvtune.domain.deployment import Deployment, Measurement
from kvtune.engines import ENGINE_NAMES, ENGINE_TITLES, vllm
from kvtune.errors import CapacityError, OptionError
from kvtune.gpu_spec import read_gpu_spec
from kvtune.hardware import Gpu, find_gpu, parse_memory_size
from kvtune.kv import KvBytes, kv_bytes
from kvtune.model import ModelSpec, resolve_model
from kvtune.weights import weights_for

T = TypeVar("T", float, str)

# vLLM's defaults where neither the caller nor a measurement says (reference/vllm-facts.md);
# the utilization is the current release's (an older `engine_version` takes its own:
# kvtune.engines.vllm.default_gpu_memory_utilization).
DEFAULT_GPU_MEMORY_UTILIZATION = vllm.GPU_MEMORY_UTILIZATION
DEFAULT_KV_CACHE_DTYPE = "auto"


class PlanError(CapacityError):
    """Settings that contradict the measured capacity they would be deployed with."""


@dataclass(frozen=True, slots=True)
class Basis(Generic[T]):
    """One engine setting the capacity depends on, and where its value came from."""

    value: T
    source: str  # "measured", "given" or "default"
    origin: str | None = None  # the log, URL or file a measured value was read from

    @property
    def measured(self) -> bool:
        return self.source == "measured"


@dataclass(frozen=True, slots=True)
class Plan:
    """A model on a deployment: spec, KV cost, capacity, and the settings behind the capacity."""

    model: str  # as the caller named it (preset, path or hub id)
    spec: ModelSpec
    kv: KvBytes
    report: CapacityReport
    gpu: str | None
    gpu_memory_bytes: int | None
    gpu_memory_utilization: Basis[float]
    kv_cache_dtype: Basis[str]
    kv_cache_memory_bytes: int | None = None  # the server's --kv-cache-memory-bytes, when measured
    engine: str = "vllm"  # whose memory model and defaults the plan follows; gpu_memory_utilization is its fraction
    inputs: CapacityInputs | None = None  # what the capacity was planned from (None: a plan built by hand)
    max_model_len_given: int | None = None  # the caller's max_model_len (None: the model's context is the default)
    # the longest context every engine replica holds, when one launch file runs several (None: this plan's pool)
    replica_context_tokens: int | None = None
    gpu_model: Gpu | None = None  # the catalog entry or --gpu-spec GPU named by `gpu` (None: memory given)
    deployment: Deployment | None = None  # what was planned (None: a plan built by hand)

    @property
    def capacity(self) -> Capacity:
        return self.report.capacity

    @property
    def measured(self) -> MeasuredCapacity | None:
        return self.report.capacity.measured


def plan(deployment: Deployment, *, measured: MeasuredCapacity | Measurement | None = None,
         shapes: tuple[RequestShape, ...] = ()) -> Plan:
    """Resolve the model and the hardware, take a measured capacity's basis, plan the capacity.

    The deployment's `gpu` names a catalog GPU (`H100-80GB`), its `gpu_spec` a --gpu-spec file
    (kvtune.gpu_spec), or its `gpu_memory` gives memory instead (`80GB` or bytes); `measured` is
    a capacity already read, or the `Measurement` to read it from (kvtune.domain.deployment).
    Settings left None take the measurement's value, else the engine's default. `engine_version` is the
    release ('0.6.3', '0.19.0'; None: the current one) whose defaults and memory profiler the
    estimate follows: vLLM's by release; SGLang's (0.5.23) and TensorRT-LLM's (1.2) memory models
    name another release in their assumptions. With `engine` "sglang" or "trtllm" the capacity
    follows that engine's memory model and defaults (kvtune.capacity.engine_memory),
    gpu_memory_utilization is its fraction (mem_fraction_static, free_gpu_memory_fraction),
    max_kv_tokens its --max-total-tokens / kv_cache_config.max_tokens, and the measurement
    must be that engine's. `shapes` are request shapes whose fit the capacity reports.

    >>> p = kvtune.plan(kvtune.Deployment("llama-3.1-8b", gpu="H100-80GB"))
    >>> p.capacity.block_size, p.gpu_memory_utilization.value
    (16, 0.92)
    """
    d = deployment
    if d.model is None:
        raise OptionError("name the model to plan (a preset, config.json, model directory or hub id)", field="model")
    if isinstance(measured, Measurement):
        measured = read_measurement(measured, d.engine)
    found = resolve_gpu(d.gpu, d.gpu_spec, d.gpu_memory)
    if found is not None and d.gpu_memory is not None:
        raise CapacityError("give a GPU model or a memory size, not both", field="gpu_memory")
    gpu_name = memory_bytes = None
    if found is not None:
        gpu_name, memory_bytes = found.name, found.memory_bytes
    elif d.gpu_memory is not None:
        memory_bytes = (d.gpu_memory if isinstance(d.gpu_memory, int)
                        else parse_memory_size(d.gpu_memory, field="gpu_memory"))

    engine, tp, pp = d.engine, d.tp, d.pp
    if engine not in ENGINE_NAMES:
        raise OptionError(f"unknown engine {engine!r} (known: {', '.join(ENGINE_NAMES)})", field="engine")
    if measured is not None and measured.engine != engine:
        raise PlanError(f"the capacity was measured on {ENGINE_TITLES[measured.engine]} ({_where(measured)}), "
                        f"not {ENGINE_TITLES.get(engine, engine)}: pass `engine` {measured.engine}", field="engine")
    utilization = (_basis("gpu_memory_utilization", d.gpu_memory_utilization,
                          measured.gpu_memory_utilization if measured else None,
                          vllm.default_gpu_memory_utilization(memory_model(d.engine_version).version), measured)
                   if engine == "vllm" else None)
    dtype = _basis("kv_cache_dtype", d.kv_cache_dtype, measured.kv_cache_dtype if measured else None,
                   DEFAULT_KV_CACHE_DTYPE, measured)
    if measured is not None and measured.block_size is not None and d.block_size is not None \
            and d.block_size != measured.block_size:
        raise PlanError(f"the capacity was measured at block size {measured.block_size} ({_where(measured)}); "
                        f"block size {d.block_size} would not have its {measured.num_blocks or '?'} blocks",
                        field="block_size")

    spec = resolve_model(d.model)
    if utilization is None:  # the engine's default fraction depends on the GPU and the model
        utilization = _basis("gpu_memory_utilization", d.gpu_memory_utilization,
                             measured.gpu_memory_utilization if measured else None,
                             default_fraction(engine, memory_bytes, tp=tp, pp=pp, spec=spec,
                                              chunked_prefill_size=d.max_num_batched_tokens), measured)
    kv = kv_bytes(spec, kv_cache_dtype=dtype.value, tp=tp, pp=pp)
    inputs = CapacityInputs(
        weights=weights_for(spec), gpu_name=gpu_name, gpu_memory_bytes=memory_bytes,
        # an engine's own default is derived again there, where its assumptions say how
        gpu_memory_utilization=None if engine != "vllm" and utilization.source == "default" else utilization.value,
        max_model_len=d.max_model_len, max_num_batched_tokens=d.max_num_batched_tokens, block_size=d.block_size,
        shapes=shapes, measured=measured, enforce_eager=d.enforce_eager, engine=engine,
        engine_version=d.engine_version, max_kv_tokens=d.max_kv_tokens,
    )
    return Plan(d.model, spec, kv, plan_capacity(spec, kv, inputs), gpu_name, memory_bytes, utilization, dtype,
                measured.kv_cache_memory_bytes if measured else None, engine, inputs, d.max_model_len,
                gpu_model=found, deployment=d)


def replan(p: Plan, *, max_num_seqs: int, max_num_batched_tokens: int) -> Plan:
    """The same plan with the engine's scheduler limits set: vLLM's startup profile runs its dummy
    sampler over max_num_seqs sequences and its forward over max_num_batched_tokens tokens, so
    the pool it leaves depends on both (kvtune.capacity.memory.estimate_overhead)."""
    if p.inputs is None:
        raise ValueError("a plan built by hand cannot be replanned")
    inputs = dataclasses.replace(p.inputs, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens)
    return dataclasses.replace(p, report=plan_capacity(p.spec, p.kv, inputs), inputs=inputs)


def resolve_gpu(gpu: str | None, gpu_spec: str | None, gpu_memory: str | int | None = None) -> Gpu | None:
    """The GPU `gpu` names in the catalog or a `gpu_spec` file describes (one of them; None: neither)."""
    if gpu_spec is None:
        return None if gpu is None else find_gpu(gpu)
    if gpu is not None or gpu_memory is not None:
        raise OptionError("give `gpu_spec` FILE or " + ("`gpu`" if gpu is not None else "`gpu_memory`") +
                          ", not both: the file names the GPU and its memory", field="gpu_spec")
    return read_gpu_spec(gpu_spec)


def read_measurement(measurement: Measurement, engine: str = "vllm") -> MeasuredCapacity | None:
    """The one measured capacity `measurement` points at, read (None: none); several capacity
    files (one per engine replica) are for kvtune.api.recommend's replicas, not one plan."""
    if len(measurement.capacity_files) > 1:
        raise OptionError("give one capacity file here; several (one per engine replica) only "
                          "`kvtune recommend` takes", field="capacity_files")
    return measured_capacity(kv_tokens=measurement.kv_tokens, vllm_log=measurement.vllm_log,
                             metrics_url=measurement.metrics_url,
                             capacity_file=next(iter(measurement.capacity_files), None),
                             engine_log=measurement.engine_log, engine=engine,
                             num_gpu_blocks=measurement.num_gpu_blocks)


def _basis(name: str, given: T | None, reported: T | None, default: T, measured: MeasuredCapacity | None) -> Basis[T]:
    """The value a setting has on the deployment the capacity describes."""
    if reported is not None:
        if given is not None and not _same(given, reported):
            raise PlanError(f"the capacity was measured at {name} {reported} ({_where(measured)}), not {given}: "
                            f"leave {name} unset, or measure the capacity again at {given}", field=name)
        return Basis(reported, "measured", measured.origin if measured else None)
    if given is not None:
        return Basis(given, "given")
    return Basis(default, "default")


def _same(a: object, b: object) -> bool:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return math.isclose(a, b, rel_tol=1e-9)
    return a == b


def _where(measured: MeasuredCapacity | None) -> str:
    if measured is None:
        return "a measurement"
    return measured.origin or measured.source.value


def measured_capacity(*, kv_tokens: int | None = None, vllm_log: str | None = None,
                      metrics_url: str | None = None, capacity_file: str | None = None,
                      engine_log: str | None = None, engine: str = "vllm",
                      num_gpu_blocks: int | None = None) -> MeasuredCapacity | None:
    """The one measured capacity the caller gave (None: none); two of them is an error.
    `metrics_url` reads a running server as `kvtune calibrate` does (call it outside an event
    loop; async code awaits kvtune.capacity.measured.fetch_capacity itself); `engine_log` and
    `metrics_url` are read as `engine`'s (kvtune.capacity.engine_logs)."""
    given = [name for name, value in (("kv_tokens", kv_tokens), ("num_gpu_blocks", num_gpu_blocks),
                                      ("vllm_log", vllm_log), ("engine_log", engine_log),
                                      ("metrics_url", metrics_url), ("capacity_file", capacity_file))
             if value is not None]
    if len(given) > 1:
        raise OptionError(f"give one measured capacity, not {' and '.join(given)}", field=given[1])
    if vllm_log is not None and engine != "vllm":
        raise OptionError(f"a vLLM startup log, but engine {engine}: give it as engine_log", field="vllm_log")
    if kv_tokens is not None:
        return MeasuredCapacity(source=CapacitySource.KV_TOKENS, origin="kv_tokens", kv_cache_tokens=kv_tokens,
                                engine=engine)
    if num_gpu_blocks is not None:  # a known pool in blocks: the block size is the plan's
        return MeasuredCapacity(source=CapacitySource.KV_TOKENS, origin="num_gpu_blocks", num_blocks=num_gpu_blocks,
                                engine=engine)
    if engine_log is not None:
        return read_engine_log(engine, engine_log)
    if metrics_url is not None and engine != "vllm":
        return asyncio.run(fetch_engine_capacity(engine, metrics_url, field="metrics_url"))
    if vllm_log is not None:
        return read_vllm_log(vllm_log)
    if metrics_url is not None:
        return asyncio.run(fetch_capacity(metrics_url, field="metrics_url"))
    if capacity_file is not None:
        return read_capacity_file(capacity_file)
    return None


__all__ = ["Plan", "Basis", "CapacityInputs", "PlanError", "plan", "replan", "measured_capacity", "read_measurement",
           "resolve_gpu", "Deployment", "Measurement",
           "DEFAULT_GPU_MEMORY_UTILIZATION", "DEFAULT_KV_CACHE_DTYPE"]
