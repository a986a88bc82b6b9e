"""What a simulation runs with: the engine settings and step time a capacity file implies.

The simulated engine runs with the settings the real server runs with: what `kvtune calibrate`
read from it (blocks, block size, max_model_len, and max_num_seqs / max_num_batched_tokens where
the server or its log stated them), else vLLM's defaults for its device (kvtune.engines.vllm);
options override both. Each setting says where it came from. The step time is the capacity
file's calibrated `timing` (measured on the server itself: it wins), else the silicon data
(aiconfigurator-core's kernels measured on that GPU for that engine, kvtune.capacity.silicon),
else the roofline estimate for a model and GPU, labelled as such with the reason silicon data
did not apply. Those two price the GPU's forward pass only; for vLLM the rest of the server goes
around them: its API server (kvtune.sim.frontend), the host's layer-by-layer dispatch of each step
it does not replay as one CUDA graph and, in releases that schedule between forward passes, the engine
core's host work per running sequence (both kvtune.sim.host). A calibrated step time measured all
of it and gets nothing added.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvtune.capacity.measured import CapacitySource, MeasuredCapacity, blocks_from_tokens
from kvtune.capacity.memory import memory_model
from kvtune.capacity.silicon import NoSiliconDataError, silicon_step_time
from kvtune.capacity.timing import roofline_step_time
from kvtune.domain.engine_settings import EngineSettings
from kvtune.domain.step_time import FrontEndModel, StepTimeModel
from kvtune.engines import vllm
from kvtune.errors import CapacityError, KvtuneError, OptionError
from kvtune.model.sources import PRESETS_DIR, bundled_hub_config, load_config_file
from kvtune.sim.frontend import vllm_api_server
from kvtune.sim.host import (
    FIRST_ASYNC_SCHEDULING_VERSION,
    VLLM_DISPATCH_PER_LAYER_S,
    VLLM_DISPATCH_SOURCE,
    VLLM_ENGINE_HOST,
    VLLM_ENGINE_HOST_SOURCE,
    adds_to_step,
    largest_cuda_graph,
    with_dispatch,
    with_host_work,
)

if TYPE_CHECKING:
    from kvtune.hardware import Gpu
    from kvtune.model.spec import ModelSpec
    from kvtune.planning import Plan

OPTION, CAPACITY, DEFAULT = "option", "capacity-file", "engine-default"
ESTIMATE = "estimate"  # kvtune's own capacity estimate (kvtune.capacity.plan), no capacity file


@dataclass(frozen=True, slots=True)
class EngineSetup:
    """The engine settings and, for each, where it came from (option, capacity-file, estimate,
    engine-default)."""

    settings: EngineSettings
    sources: dict[str, str]

    def to_dict(self) -> dict[str, Any]:
        s = self.settings
        values = {"num_blocks": s.num_blocks, "block_size": s.block_size, "max_num_seqs": s.max_num_seqs,
                  "max_num_batched_tokens": s.max_num_batched_tokens, "max_model_len": s.max_model_len,
                  "enable_prefix_caching": s.enable_prefix_caching,
                  "reserve_full_sequence": s.reserve_full_sequence}
        return {name: {"value": value, "from": self.sources[name]} for name, value in values.items()}


def engine_setup(measured: MeasuredCapacity, *, max_num_seqs: int | None = None,
                 max_num_batched_tokens: int | None = None, gpu: Gpu | None = None,
                 recorded_from: Mapping[str, str] | None = None, engine_version: str | None = None) -> EngineSetup:
    """The settings `measured` implies, overridden by the options given. `recorded_from` says
    where a setting `measured` holds came from when that is not a capacity file (an offline
    simulation's pool is kvtune's estimate or an option; see offline_capacity). `engine_version`
    (None: the current release) picks the release's defaults and admission rule."""
    sources: dict[str, str] = {}
    labels = recorded_from or {}

    def recorded(name: str) -> str:
        return labels.get(name, CAPACITY)

    def pick(name: str, option: int | None, recorded_value: int | None, default: int) -> int:
        for value, source in ((option, OPTION), (recorded_value, recorded(name)), (default, DEFAULT)):
            if value is not None:
                sources[name] = source
                return value
        raise AssertionError("unreachable: the default is always set")

    against = measured.timing.measured_against if measured.timing is not None else None
    block_size = pick("block_size", None, measured.block_size or (against.block_size if against else None),
                      vllm.default_block_size(measured.device))
    max_model_len = measured.max_model_len or (against.max_model_len if against else None)
    if max_model_len is None:
        raise CapacityError("the capacity file gives no max_model_len; recalibrate against the server "
                            "(`kvtune calibrate URL --save FILE`)", path=measured.origin, field="max_model_len")
    sources["max_model_len"] = recorded("max_model_len")
    num_blocks = measured.num_blocks
    if num_blocks is None and measured.kv_cache_tokens is not None:
        num_blocks = blocks_from_tokens(measured.kv_cache_tokens, block_size, max_model_len)
    if not num_blocks:
        raise CapacityError("the capacity file gives no KV blocks (num_blocks or kv_cache_tokens)",
                            path=measured.origin, field="num_blocks")
    sources["num_blocks"] = recorded("num_blocks")
    release = None if engine_version is None else memory_model(engine_version, field="--engine-version").version
    batched_default, seqs_default = vllm.default_scheduler_limits(
        measured.device, gpu.memory_bytes if gpu is not None else None, gpu.name if gpu is not None else None,
        release)
    recorded_batched = measured.max_num_batched_tokens
    if recorded_batched is None and against is not None and against.max_num_batched_tokens_from != "engine-default":
        recorded_batched = against.max_num_batched_tokens
    seqs = pick("max_num_seqs", max_num_seqs, measured.max_num_seqs, seqs_default)
    batched = pick("max_num_batched_tokens", max_num_batched_tokens, recorded_batched, batched_default)
    caching = measured.enable_prefix_caching
    sources["enable_prefix_caching"] = DEFAULT if caching is None else recorded("enable_prefix_caching")
    sources["reserve_full_sequence"] = DEFAULT  # the release's admission rule (kvtune.engines.vllm)
    try:
        settings = EngineSettings(num_blocks=num_blocks, block_size=block_size, max_num_seqs=seqs,
                                  max_num_batched_tokens=batched, max_model_len=max_model_len,
                                  enable_prefix_caching=True if caching is None else caching,
                                  reserve_full_sequence=vllm.reserves_full_sequence(release))
    except OptionError as exc:
        raise CapacityError(exc.message, path=measured.origin, field=exc.field) from None
    return EngineSetup(settings, sources)


def v0_release_note(engine: str, engine_version: str | None, settings: EngineSettings) -> str | None:
    """What to tell a simulation of a vLLM release that ran its V0 engine by default (before
    vllm.FIRST_V1_DEFAULT_VERSION): kvtune simulates V1's scheduler, with V1's defaults unless given."""
    if engine != "vllm" or engine_version is None:
        return None
    release = memory_model(engine_version, field="--engine-version")
    if release.version is None or release.version >= vllm.FIRST_V1_DEFAULT_VERSION:
        return None
    first_v1 = ".".join(map(str, vllm.FIRST_V1_DEFAULT_VERSION))
    return (f"vLLM {engine_version} ran its V0 engine by default (V1 from {first_v1}), whose scheduler kvtune does "
            "not simulate (V0 runs a prefill step apart from the decodes unless chunked prefill is on, which it "
            "turns on by itself only past 32K of context; max_num_seqs 256): this is V1's scheduler with "
            f"max_num_seqs {settings.max_num_seqs:,} and max_num_batched_tokens {settings.max_num_batched_tokens:,}; "
            "give --max-num-seqs and --max-num-batched-tokens as that server ran")


def offline_capacity(plan: Plan) -> tuple[MeasuredCapacity, dict[str, str]]:
    """The pool a simulation without a capacity file runs on, and where each of its settings came
    from: the plan's capacity as a capacity file states it (kvtune's estimate, or the pool that
    --kv-tokens / --num-gpu-blocks gave), without the plan's scheduler limits, which are the
    engine's defaults for the GPU unless options set them (engine_setup)."""
    # no file: errors about the settings name the option, not an origin
    record = dataclasses.replace(plan.report.capacity_file(), max_num_seqs=None, max_num_batched_tokens=None,
                                 origin=None)
    given = plan.inputs
    labels = {"num_blocks": ESTIMATE if plan.measured is None else OPTION,
              "block_size": OPTION if given is not None and given.block_size is not None else DEFAULT,
              "max_model_len": OPTION if plan.max_model_len_given is not None else DEFAULT}
    return record, labels


def given_pool(measured: MeasuredCapacity | None) -> bool:
    """Whether a plan's measured capacity is only a pool size an option gave (--kv-tokens,
    --num-gpu-blocks): the rest of the engine is then the plan's, as without one."""
    return measured is not None and measured.source is CapacitySource.KV_TOKENS


@dataclass(frozen=True, slots=True)
class TimingSetup:
    """The step-time model, what stands between the clients and the engine, and what it was
    computed from (the calibration's server, or the roofline's inputs). `http_overhead_s` is
    what a lone request spends outside the engine's steps; with a `frontend` (the API server's
    work, shared among the requests in it: kvtune.sim.frontend) that part is simulated on the
    server and the rest (network, hand-offs between processes: latency, not work) stays a
    fixed delay; a capacity file calibrated before kvtune measured the front end has only
    `http_overhead_s`, all of it a fixed delay before the engine sees each request."""

    model: StepTimeModel
    http_overhead_s: float
    detail: dict[str, Any]
    frontend: FrontEndModel | None = None

    @property
    def fixed_delay_s(self) -> float:
        """The delay added to every request outside the simulated queues."""
        if self.frontend is None:
            return self.http_overhead_s
        return max(0.0, self.http_overhead_s - self.frontend.request_s - self.frontend.token_s)

    def to_dict(self) -> dict[str, Any]:
        return {"source": self.model.source.value, "estimate": self.model.estimate,
                "coefficients": self.model.to_dict(), "http_overhead_s": self.http_overhead_s,
                "frontend": None if self.frontend is None else self.frontend.to_dict(),
                "fixed_delay_s": self.fixed_delay_s, **self.detail}


def timing_setup(measured: MeasuredCapacity, *, spec: ModelSpec | None = None, gpu: Gpu | None = None,
                 tp: int = 1, engine: str | None = None, engine_version: str | None = None,
                 silicon: bool = True) -> TimingSetup:
    """The capacity file's calibrated timing; without one, silicon data for `spec` on `gpu` where
    aiconfigurator-core covers them (`silicon=False`: never), else the roofline."""
    if measured.timing is not None:
        t = measured.timing
        return TimingSetup(t.model, t.http_overhead_s, {"measured_against": t.measured_against.to_dict()},
                           t.frontend)
    if spec is None or gpu is None:
        raise OptionError("the capacity file has no `timing`: run `kvtune calibrate URL --timing --save FILE`, "
                          "or give --model and --gpu for a silicon or roofline estimate", field="--capacity")
    kv_cache_dtype = measured.kv_cache_dtype or "auto"
    reason = "silicon data not asked for"
    if silicon:
        files = model_files(spec)
        if files is None:
            reason = f"no local config.json for {spec.name} to hand aiconfigurator-core"
        else:
            try:
                model, silicon_inputs = silicon_step_time(
                    files, gpu, tp=tp, engine=engine or measured.engine, engine_version=engine_version,
                    kv_cache_dtype=kv_cache_dtype)
            except NoSiliconDataError as exc:
                reason = str(exc)
            else:
                return _with_api_server(model, {"silicon": silicon_inputs.to_dict(), "label": silicon_inputs.label},
                                        engine or measured.engine, engine_version, spec.num_layers, gpu.name)

    model, inputs = roofline_step_time(spec, gpu, tp=tp, kv_cache_dtype=kv_cache_dtype)
    return _with_api_server(model, {"roofline": inputs.to_dict(), "fallback_reason": reason,
                                    "label": f"roofline estimate for {gpu.name} ({reason})"}, engine or measured.engine,
                            engine_version, spec.num_layers, gpu.name)


def _with_api_server(model: StepTimeModel, detail: dict[str, Any], engine: str | None,
                     engine_version: str | None, num_layers: int, gpu_name: str) -> TimingSetup:
    """An uncalibrated step time with the whole server around it: for vLLM, its measured API server
    (kvtune.sim.frontend.vllm_api_server: the release's own, named in `frontend_from`), its host's layer-by-layer
    dispatch of every step it does not replay as one CUDA graph (kvtune.sim.host, `dispatch`) and, in
    releases that schedule between forward passes, the engine core's host work per step
    (`host_work`); other engines' servers were not measured, so none (`frontend_from` says so)."""
    if engine not in (None, "vllm"):
        return TimingSetup(model, 0.0, {**detail, "frontend_from": f"none: {engine}'s API server not measured",
                                        "host_work": None, "dispatch": None})
    release = memory_model(engine_version, field="--engine-version")
    version = None if engine_version is None else release.version
    model = with_dispatch(model, num_layers, largest_cuda_graph(gpu_name, version))
    detail = {**detail, "dispatch": {"per_layer_s": VLLM_DISPATCH_PER_LAYER_S, "layers": num_layers,
                                     "mixed_step_s": model.mixed_step_s,
                                     "largest_cuda_graph_tokens": model.largest_graph_tokens,
                                     "from": VLLM_DISPATCH_SOURCE}}
    if adds_to_step(version):
        model = with_host_work(model, VLLM_ENGINE_HOST)
        host = {**VLLM_ENGINE_HOST.to_dict(), "added": True, "from": VLLM_ENGINE_HOST_SOURCE,
                "why": f"{release.label} schedules between forward passes (async scheduling is the default "
                       f"from {'.'.join(map(str, FIRST_ASYNC_SCHEDULING_VERSION))})"}
    else:
        host = {**VLLM_ENGINE_HOST.to_dict(), "added": False, "from": VLLM_ENGINE_HOST_SOURCE,
                "why": f"{release.label} schedules the next step while the GPU runs this one (async scheduling)"}
    server = vllm_api_server(version)
    return TimingSetup(model, server.lone_s, {**detail, "frontend_from": server.source, "host_work": host},
                       server.model)


def plan_timing(plan: Plan) -> TimingSetup:
    """The step time `simulate`, `recommend --objective` and recommend's latency bound all price a
    plan with: its capacity file's calibrated timing, else silicon data or the roofline for its model
    on its GPU (timing_setup), on the pool offline_capacity states when no capacity file is given.
    OptionError when the plan names no catalog GPU and has no calibrated timing."""
    measured = plan.measured
    if measured is not None and measured.timing is not None:
        return timing_setup(measured)
    if plan.gpu_model is None:
        raise OptionError("a step time without a calibrated capacity file needs a catalog GPU: give --gpu (or "
                          "--gpu-spec FILE), or --capacity FILE from `kvtune calibrate --timing`", field="gpu")
    if measured is None or given_pool(measured):
        measured, _ = offline_capacity(plan)
    # the plan's engine and release, as `simulate --engine --engine-version` hands them over
    return timing_setup(measured, spec=plan.spec, gpu=plan.gpu_model, tp=plan.kv.tensor_parallel_size,
                        engine=plan.engine, engine_version=plan.inputs.engine_version if plan.inputs else None)


def model_files(spec: ModelSpec) -> dict[str, dict[str, Any]] | None:
    """The config.json `spec` was read from (a model directory, a config file, a preset, the copy
    aiconfigurator-core ships of a hub model's) and, beside it, a ModelOpt hf_quant_config.json;
    None when there is no local file."""
    found = bundled_hub_config(spec.name) if spec.source_dir is None else None
    if found is None:
        candidates = [Path(spec.name), PRESETS_DIR / f"{spec.name.lower()}.json"]
        if spec.source_dir is not None:
            candidates.insert(0, Path(spec.source_dir) / "config.json")
        config = next((path for path in candidates if path.suffix == ".json" and path.is_file()), None)
        if config is None:
            return None
        beside = config.parent / "hf_quant_config.json"
        found = config, beside if spec.source_dir is not None and beside.is_file() else None
    config, quant = found
    try:
        return {"config.json": load_config_file(config),
                **({} if quant is None else {"hf_quant_config.json": load_config_file(quant)})}
    except KvtuneError:
        return None


__all__ = ["EngineSetup", "TimingSetup", "engine_setup", "timing_setup", "plan_timing", "offline_capacity",
           "v0_release_note", "given_pool", "OPTION", "CAPACITY", "DEFAULT", "ESTIMATE"]
