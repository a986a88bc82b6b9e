"""kvtune's Python API: the pipeline `kvtune recommend` runs, one call per stage.

    logs ──profile_logs──▶ Profile ───────┐
    Deployment (model, GPUs, engine) ──────┴─recommend──▶ Recommendation ──render──▶ files ──write_files
      └──plan──▶ Plan (its KV capacity: what `kvtune capacity` shows)
                                                      │
    deployed files ───────────────────────────────check──▶ CheckResult (what `kvtune check` gates on)

    Profile or LogReplay + Deployment + SimulatedServer + Load ──simulate──▶ Simulation (`kvtune simulate`)
    Profile or LogReplay + BenchTarget + Load + Expectations ──benchmark──▶ results (`kvtune bench`)
    a running engine or its startup log ──calibrate──▶ MeasuredCapacity (`kvtune calibrate`)
    Deployment ──capacity_fit──▶ CapacityFit (`kvtune capacity`); ──kv_bytes──▶ KvBytes (`kvtune kv`)
    gateway.yaml ──gateway_config──▶ GatewayConfig (what `kvtune gateway` serves)

Each stage takes and returns typed objects; `load_profile` and `load_recommendation` read the
saved ones back strictly. Errors are `kvtune.errors.KvtuneError` subclasses naming the file and
the field. The deployment, policy and objective are values of the floor (kvtune.domain), passed
whole. This package is the CLI's only door: each command turns its options into those values,
makes one call here, and renders what comes back.

Each stage lives in its own module (profiling, recommendation_file, capacity, kv_cache, recommending,
checking, simulating, benchmarking, calibrating, gateway), which loads on first use of one of
its names (PEP 562), so a command pays only for its own stage: `kvtune kv` loads no numpy,
`kvtune capacity` no simulator, and `--help` no stage at all.

>>> import kvtune
>>> profile = kvtune.profile_logs(["sample_logs/"])
>>> deployment = kvtune.Deployment("llama-3.1-8b", gpu="H100-80GB")
>>> rec = kvtune.recommend(profile, deployment)
>>> files = kvtune.render(rec)
>>> sorted(files)[:3]
['gateway.yaml', 'nginx.conf', 'recommendation.json']
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what __getattr__ hands out, for type checkers and readers: where each name lives
    from kvtune.api.benchmarking import benchmark
    from kvtune.api.calibrating import calibrate
    from kvtune.api.capacity import CapacityFit, Plan, capacity_fit, measured_capacity, plan
    from kvtune.api.checking import check
    from kvtune.api.gateway import gateway_config
    from kvtune.api.kv_cache import kv_bytes
    from kvtune.api.profiling import is_saved_profile, load_profile, merge_profiles, profile_logs, save_profile
    from kvtune.api.recommendation_file import load_recommendation
    from kvtune.api.recommending import RenderCheckError, recommend, render, write_files
    from kvtune.api.simulating import simulate
    from kvtune.bench.run import BenchRecorder
    from kvtune.deploy.k8s import K8sOptions
    from kvtune.deploy.render import RenderOptions
    from kvtune.domain.bench_target import BenchTarget, Expectations
    from kvtune.domain.choices import Objective, Policy
    from kvtune.domain.deployment import Deployment, Measurement
    from kvtune.domain.load_shape import Load
    from kvtune.domain.log_reading import LogReading, LogReplay
    from kvtune.domain.simulated_server import SimulatedServer
    from kvtune.domain.slo import Slo
    from kvtune.gateway.config import HealthProbe
    from kvtune.policy.search import InfeasibleObjectiveError

#: The module each name comes from: a stage's module here, or the floor's for the values passed in.
_HOMES: dict[str, tuple[str, ...]] = {
    "kvtune.api.profiling": ("profile_logs", "load_profile", "is_saved_profile", "merge_profiles", "save_profile"),
    "kvtune.api.recommendation_file": ("load_recommendation",),
    "kvtune.api.capacity": ("plan", "measured_capacity", "Plan", "capacity_fit", "CapacityFit"),
    "kvtune.api.kv_cache": ("kv_bytes",),
    "kvtune.api.recommending": ("recommend", "render", "write_files", "RenderCheckError"),
    "kvtune.api.checking": ("check",),
    "kvtune.api.simulating": ("simulate",),
    "kvtune.api.benchmarking": ("benchmark",),
    "kvtune.api.calibrating": ("calibrate",),
    "kvtune.api.gateway": ("gateway_config",),
    "kvtune.domain.deployment": ("Deployment", "Measurement"),
    "kvtune.domain.choices": ("Policy", "Objective"),
    "kvtune.domain.slo": ("Slo",),
    "kvtune.domain.log_reading": ("LogReading", "LogReplay"),
    "kvtune.domain.simulated_server": ("SimulatedServer",),
    "kvtune.domain.load_shape": ("Load",),
    "kvtune.domain.bench_target": ("BenchTarget", "Expectations"),
    # what render takes besides the recommendation, and the search's refusal (its what-if table)
    "kvtune.deploy.render": ("RenderOptions",),
    "kvtune.deploy.k8s": ("K8sOptions",),
    "kvtune.gateway.config": ("HealthProbe",),
    "kvtune.policy.search": ("InfeasibleObjectiveError",),
    "kvtune.bench.run": ("BenchRecorder",),  # what benchmark records each result with
}
_HOME = {name: module for module, names in _HOMES.items() for name in names}

__all__ = [
    "profile_logs", "load_profile", "plan", "measured_capacity", "recommend", "render", "write_files",
    "check", "load_recommendation", "RenderCheckError", "Plan", "Deployment", "Measurement", "Policy", "Objective",
    "Slo", "LogReading", "simulate", "SimulatedServer", "Load", "LogReplay", "benchmark", "BenchTarget",
    "Expectations", "kv_bytes", "capacity_fit", "CapacityFit", "calibrate", "gateway_config",
    "is_saved_profile", "merge_profiles", "save_profile", "RenderOptions", "K8sOptions", "HealthProbe",
    "InfeasibleObjectiveError", "BenchRecorder",
]


def __getattr__(name: str) -> Any:
    """A name's module, imported on first use (PEP 562) and the name kept here for the next."""
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module 'kvtune.api' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
