"""Step times from silicon: NVIDIA's aiconfigurator-core, measured kernels per GPU and engine version.

aiconfigurator-core (PyPI, Apache-2.0) holds GEMM, attention, communication and MoE timings
measured on each GPU it covers (h100_sxm, h200_sxm, b200_sxm, a100_sxm, l40s, rtx_pro_6000_server …)
for vLLM, SGLang and TensorRT-LLM, and composes them into one forward pass. kvtune samples its
step latency once over a grid of batch shapes — decode batches of 1…512 at 128…16k context,
prefill chunks of 16…8,192 tokens after 0…24k cached — and fits the step form of
kvtune.domain.step_time to it (non-negative least squares on relative error), so that the simulator keeps
its closed-form decode runs: the straight line c0..c4 and a bend at the matmuls' knee (`past_knee_s`
per token past `knee_tokens`, the knee of KNEES whose fit has the least mean relative error). On Qwen3-14B / h100_sxm /
vLLM the bend takes the fit's median error over the grid from 4.5 % to 2.0 %, its worst from 26 %
to 11 %, and an 8,192-token chunk from 11–17 % under aiconfigurator's latency to within 3.5 %;
`fit_error` reports it for every fit.

The fit is cached on disk (~/.cache/kvtune/silicon, or $KVTUNE_CACHE_DIR/silicon), keyed by the
model config's bytes, GPU system, engine, data version, TP, KV dtype and the package's version:
a repeated simulate reads one small JSON file and never imports aiconfigurator. The package is
imported only here, only when a simulation needs a step time; where it is missing, or does not
cover the model, GPU or engine, `NoSiliconDataError` says why and the caller falls back to the
roofline with that reason. aiconfigurator would fetch a config from the hub for a model it does
not bundle: kvtune hands it the local config (a copy in the cache directory), never a hub id.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from kvtune.capacity.timing import nnls
from kvtune.domain.step_time import COEFFICIENTS, StepTimeModel, TimingSource, step_features

if TYPE_CHECKING:
    from kvtune.hardware import Gpu

PACKAGE = "aiconfigurator-core"
GRID_VERSION = 2  # bump when the grid or the fit changes: cached fits of another grid are ignored

ENGINES = ("vllm", "sglang", "trtllm")

# the grid: decode batches at several contexts, prefill chunks after several cached prefixes
DECODE_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
DECODE_CONTEXTS = (128, 1024, 4096, 16384)
PREFILL_TOKENS = (16, 64, 256, 1024, 2048, 4096, 8192)
PREFILL_PREFIXES = (0, 2048, 8192, 24576)
KNEES = (128, 256, 512, 1024, 2048)  # tokens per step where the matmuls may turn compute-bound: the fit picks one


class NoSiliconDataError(Exception):
    """aiconfigurator-core is not installed, or does not cover this model, GPU or engine."""


@dataclass(frozen=True, slots=True)
class SiliconInputs:
    """What a silicon step time was sampled from, and how well the step form follows it."""

    gpu: str
    system: str  # aiconfigurator's name for the GPU system
    engine: str
    engine_version: str | None  # the version asked for (None: not given)
    data_version: str  # the engine version aiconfigurator measured
    tensor_parallel_size: int
    kv_cache_dtype: str
    package_version: str
    samples: int
    fit_error: dict[str, float]  # relative error of the fitted form over the grid: median, p90, max

    @property
    def label(self) -> str:
        """One line for people: whose data, which GPU, which engine version."""
        asked = "" if self.engine_version in (None, self.data_version) else f", asked for {self.engine_version}"
        return (f"silicon data ({PACKAGE} {self.package_version}): {self.system}, {self.engine} "
                f"{self.data_version} measurements{asked}, TP {self.tensor_parallel_size}")

    def to_dict(self) -> dict[str, Any]:
        return {"source": TimingSource.SILICON.value, "package": f"{PACKAGE} {self.package_version}",
                "gpu": self.gpu, "system": self.system, "engine": self.engine,
                "engine_version": self.engine_version, "data_version": self.data_version,
                "tensor_parallel_size": self.tensor_parallel_size, "kv_cache_dtype": self.kv_cache_dtype,
                "samples": self.samples, "fit_error": self.fit_error}


MODEL_FILES = ("config.json", "hf_quant_config.json")  # what aiconfigurator reads from a model directory


def silicon_step_time(files: Mapping[str, dict[str, Any]], gpu: Gpu, *, tp: int = 1, engine: str = "vllm",
                      engine_version: str | None = None, kv_cache_dtype: str = "auto"
                      ) -> tuple[StepTimeModel, SiliconInputs]:
    """The step form fitted to aiconfigurator's latencies for a model directory's parsed files
    (MODEL_FILES: config.json, and a ModelOpt checkpoint's hf_quant_config.json, which decides its
    GEMMs' dtype) on `tp` GPUs `gpu` (its catalog entry names aiconfigurator's system);
    NoSiliconDataError with the reason where it has no data."""
    engine = engine.split("-")[0]  # simulate's trtllm-gne / trtllm-maxutil are TensorRT-LLM's two policies
    gpu_name, system = gpu.name, gpu.silicon_system
    if system is None:
        raise NoSiliconDataError(f"{PACKAGE} has no measurements for {gpu_name}")
    if engine not in ENGINES:
        raise NoSiliconDataError(f"{PACKAGE} has no measurements for engine {engine}")
    package_version = _package_version()
    kv = "fp8" if kv_cache_dtype.startswith("fp8") else "auto"
    unknown = set(files) - set(MODEL_FILES)
    if "config.json" not in files or unknown:
        raise ValueError(f"model files must be config.json and optionally hf_quant_config.json, got {sorted(files)}")
    config_bytes = json.dumps({name: files[name] for name in sorted(files)}, sort_keys=True).encode()
    key = hashlib.sha256(json.dumps(
        [GRID_VERSION, package_version, hashlib.sha256(config_bytes).hexdigest(), system, engine,
         engine_version, tp, kv]).encode()).hexdigest()[:32]
    cached = _read_cache(key)
    if cached is not None:
        return cached
    model, inputs = _sample_and_fit(config_bytes, gpu_name, system, engine, engine_version, tp, kv, package_version)
    _write_cache(key, model, inputs)
    return model, inputs


def _package_version() -> str:
    """The installed aiconfigurator-core's version; NoSiliconDataError where it cannot be imported."""
    from importlib.metadata import PackageNotFoundError, version
    from importlib.util import find_spec

    try:
        if find_spec("aiconfigurator_core") is None:
            raise PackageNotFoundError(PACKAGE)
        return version(PACKAGE)
    except (PackageNotFoundError, ValueError, ImportError):
        raise NoSiliconDataError(f"{PACKAGE} is not installed (pip install {PACKAGE}; wheels for Linux "
                                 "x86_64 and macOS arm64)") from None


def _cache_dir() -> Path:
    root = os.environ.get("KVTUNE_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "kvtune")
    return Path(root) / "silicon"


def _read_cache(key: str) -> tuple[StepTimeModel, SiliconInputs] | None:
    try:
        data = json.loads((_cache_dir() / f"{key}.json").read_text())
        coefficients = data["coefficients"]
        c0, c1, c2, c3, c4 = (float(coefficients[c]) for c in COEFFICIENTS)
        model = StepTimeModel(c0, c1, c2, c3, c4, source=TimingSource.SILICON,
                              past_knee_s=float(coefficients.get("past_knee_s", 0.0)),
                              knee_tokens=int(coefficients.get("knee_tokens", 0)))
        return model, SiliconInputs(**data["inputs"])
    except (OSError, ValueError, KeyError, TypeError):
        return None  # no cache, or one from another kvtune: sample again


def _write_cache(key: str, model: StepTimeModel, inputs: SiliconInputs) -> None:
    data = {"coefficients": model.to_dict(),
            "inputs": {name: getattr(inputs, name) for name in SiliconInputs.__slots__}}
    directory = _cache_dir()
    try:
        directory.mkdir(parents=True, exist_ok=True)
        tmp = directory / f".{key}.{os.getpid()}.tmp"
        tmp.write_text(json.dumps(data))
        os.replace(tmp, directory / f"{key}.json")
    except OSError:
        pass  # a read-only home only costs the next run the sampling again


def _sample_and_fit(config_bytes: bytes, gpu_name: str, system: str, engine: str, engine_version: str | None,
                    tp: int, kv: str, package_version: str) -> tuple[StepTimeModel, SiliconInputs]:
    aic_logger = logging.getLogger("aiconfigurator_core")
    level = aic_logger.level
    aic_logger.setLevel(logging.CRITICAL)  # its warnings reach stderr; a failure's reason is in fallback_reason
    try:
        handle, data_version = _engine(config_bytes, system, engine, engine_version, tp, kv)
        rows, seconds = _sample(handle)
    except NoSiliconDataError:
        raise
    except Exception as exc:  # its errors are its own types; any of them means: no data for this case
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise NoSiliconDataError(f"{PACKAGE} cannot price this model on {system}/{engine}: {reason[:200]}") from None
    finally:
        aic_logger.setLevel(level)
    knee, x, error = min((_fit(rows, seconds, knee) for knee in KNEES), key=lambda fit: float(fit[2].mean()))
    fit_error = {"median": round(float(np.median(error)), 4), "p90": round(float(np.percentile(error, 90)), 4),
                 "max": round(float(error.max()), 4)}
    c0, c1, c2, c3, c4, past_knee = (float(v) for v in x)  # COEFFICIENTS' order, then the bend
    model = StepTimeModel(c0, c1, c2, c3, c4, source=TimingSource.SILICON, past_knee_s=past_knee,
                          knee_tokens=knee if past_knee else 0)
    return model, SiliconInputs(gpu_name, system, engine, engine_version, data_version, tp, kv, package_version,
                                len(seconds), fit_error)


def _fit(rows: np.ndarray, seconds: np.ndarray, knee: int) -> tuple[int, np.ndarray, np.ndarray]:
    """The step form with its bend at `knee` tokens, fitted by non-negative least squares on relative
    error (a 6 ms decode step counts as much as a 400 ms chunk): (knee, coefficients, |error| per row)."""
    features = np.c_[rows, np.maximum(0.0, rows[:, 1] - knee)]  # rows[:, 1] = Σn, the tokens computed
    weights = 1 / seconds
    a = features * weights[:, None]
    scale = np.maximum(np.abs(a).max(axis=0), 1e-300)
    x = nnls(a / scale, seconds * weights) / scale
    return knee, x, np.abs(features @ x / seconds - 1)


def _engine(config_bytes: bytes, system: str, engine: str, engine_version: str | None, tp: int,
            kv: str) -> tuple[Any, str]:
    """aiconfigurator's compiled engine for the config, and the data version it reads."""
    from aiconfigurator_core.sdk import perf_database
    from aiconfigurator_core.sdk.engine import EngineHandle

    slots = perf_database.get_version_slots(system, engine) or {}
    listed = {v for v in slots.values() if v}
    if not listed:
        raise NoSiliconDataError(f"{PACKAGE} has no {engine} measurements on {system}")
    wanted = engine_version if engine_version in listed else "current"
    data_version = str(perf_database.resolve_query_version(system, engine, wanted))
    model_dir = _cache_dir() / "configs" / hashlib.sha256(config_bytes).hexdigest()[:32]
    model_dir.mkdir(parents=True, exist_ok=True)
    for name, data in json.loads(config_bytes).items():
        if not (model_dir / name).exists():
            tmp = model_dir / f".{name}.{os.getpid()}.tmp"
            tmp.write_text(json.dumps(data))
            os.replace(tmp, model_dir / name)
    kwargs: dict[str, Any] = {"tp_size": tp, "backend_version": data_version}
    if kv == "fp8":
        kwargs["kvcache_quant_mode"] = "fp8"
    return EngineHandle.compile(str(model_dir), system, engine, **kwargs), data_version


def _sample(handle: Any) -> tuple[np.ndarray, np.ndarray]:
    """Step features and aiconfigurator's latency (s) over the grid."""
    rows, seconds = [], []
    for batch in DECODE_BATCHES:
        for ctx in DECODE_CONTEXTS:  # decode_step_latency(b, isl, osl=2): b requests decoding after isl
            rows.append(step_features([(1, ctx)] * batch))
            seconds.append(handle.decode_step_latency(batch, ctx, 2) / 1e3)
    for tokens in PREFILL_TOKENS:
        for prefix in PREFILL_PREFIXES:  # predict_prefill_latency(1, isl, prefix): isl − prefix new tokens
            rows.append(step_features([(tokens, prefix)]))
            seconds.append(handle.predict_prefill_latency(1, tokens + prefix, prefix) / 1e3)
    y = np.array(seconds)
    if not np.all(np.isfinite(y)) or np.any(y <= 0):
        raise NoSiliconDataError(f"{PACKAGE} returned a non-positive step latency")
    return np.array(rows), y


__all__ = ["NoSiliconDataError", "SiliconInputs", "silicon_step_time", "ENGINES", "PACKAGE", "MODEL_FILES"]
