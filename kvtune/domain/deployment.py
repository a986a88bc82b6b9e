"""A deployment: the model on its GPUs and the engine settings its KV capacity depends on, as one
value the planner, the api and the CLI pass whole (instead of a dozen loose keywords each), and
`Measurement`: where a measured capacity of that deployment is read from.

Settings left None take the measurement's value, else the engine's default (kvtune.planning).
`to_dict`/`from_dict` write and read it strictly: an unknown key or a mistyped value is an
InputError naming the field.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvtune.errors import InputError
from kvtune.userfiles import brief

__all__ = ["Deployment", "Measurement"]

ENGINES = ("vllm", "sglang", "trtllm")  # kvtune.engines.ENGINE_NAMES (a test ties them)


@dataclass(frozen=True, slots=True)
class Deployment:
    """One engine replica's deployment. `model` is a preset, config.json, model directory or hub
    id (None: the model the logs name); `gpu` a catalog GPU, or `gpu_spec` a --gpu-spec file, or
    `gpu_memory` the memory per GPU ("80GB" or bytes); `replicas` engine replicas of it behind
    one gateway. `gpu_memory_utilization` is the engine's fraction (SGLang mem_fraction_static,
    TensorRT-LLM free_gpu_memory_fraction), `max_kv_tokens` their --max-total-tokens /
    kv_cache_config.max_tokens."""

    model: str | None = None
    gpu: str | None = None
    gpu_memory: str | int | None = None
    tp: int = 1
    pp: int = 1
    engine: str = "vllm"
    engine_version: str | None = None
    kv_cache_dtype: str | None = None
    block_size: int | None = None
    max_model_len: int | None = None
    gpu_memory_utilization: float | None = None
    max_num_batched_tokens: int | None = None
    enforce_eager: bool = False
    max_kv_tokens: int | None = None
    gpu_spec: str | None = None
    replicas: int = 1

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: object, *, path: str | None = None) -> Deployment:
        """The deployment `to_dict` wrote (or a hand-written subset of it), read strictly."""
        values = _strict(cls, data, path)
        if values.get("engine", "vllm") not in ENGINES:
            raise InputError(f"unknown engine {brief(values['engine'])} (known: {', '.join(ENGINES)})",
                             path=path, field="engine")
        for name in ("tp", "pp", "replicas", "block_size", "max_model_len", "max_num_batched_tokens",
                     "max_kv_tokens"):
            if values.get(name) is not None and values[name] < 1:
                raise InputError(f"must be at least 1, got {values[name]}", path=path, field=name)
        utilization = values.get("gpu_memory_utilization")
        if utilization is not None and not 0 < utilization <= 1:
            raise InputError(f"must be a fraction in (0, 1], got {utilization}", path=path,
                             field="gpu_memory_utilization")
        return cls(**values)


@dataclass(frozen=True, slots=True)
class Measurement:
    """Where the deployment's measured KV capacity comes from (at most one of them; none: the
    memory estimate): a token or block count, an engine's startup log, a running server's
    /metrics, or capacity files from `kvtune calibrate`, one per engine replica."""

    kv_tokens: int | None = None
    num_gpu_blocks: int | None = None
    vllm_log: str | None = None
    engine_log: str | None = None
    metrics_url: str | None = None
    capacity_files: tuple[str, ...] = ()

    @property
    def given(self) -> bool:
        return any(v not in (None, ()) for v in dataclasses.astuple(self))

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "capacity_files": list(self.capacity_files)}

    @classmethod
    def from_dict(cls, data: object, *, path: str | None = None) -> Measurement:
        values = _strict(cls, data, path)
        values["capacity_files"] = tuple(values.get("capacity_files", ()))
        return cls(**values)


_TYPES: dict[str, tuple[type, ...]] = {
    "str | None": (str, type(None)), "int | None": (int, type(None)), "float | None": (float, int, type(None)),
    "str | int | None": (str, int, type(None)), "int": (int,), "str": (str,), "bool": (bool,),
    "tuple[str, ...]": (list, tuple),
}


def _strict(cls: type, data: object, path: str | None) -> dict[str, Any]:
    """`data`'s fields checked against `cls`'s: an object, no unknown key, each value its type."""
    if not isinstance(data, Mapping):
        raise InputError(f"expected an object, got {type(data).__name__}", path=path, field=cls.__name__.lower())
    fields = {f.name: str(f.type) for f in dataclasses.fields(cls)}
    values: dict[str, Any] = {}
    for key, value in data.items():
        if key not in fields:
            raise InputError(f"unknown field (known: {', '.join(fields)})", path=path, field=str(key))
        wanted = _TYPES[fields[key]]
        ok = isinstance(value, wanted) and not (isinstance(value, bool) and bool not in wanted)
        if ok and fields[key] == "tuple[str, ...]":
            ok = all(isinstance(v, str) for v in value)
        if not ok:
            raise InputError(f"expected {fields[key]}, got {brief(value)}", path=path, field=key)
        values[key] = value
    return values
