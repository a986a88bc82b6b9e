"""The pipeline behind `kvtune simulate` (kvtune.api.simulate is its door): the pool (a capacity
file, or the deployment planned as `kvtune capacity` plans it), the step time (calibrated, silicon
data or the roofline), the gateway's admission in front (gateway.yaml read and matched to the
traffic's routes), the traffic (drawn from a profile or replayed from logs), then the run. Its own
module so that kvtune.api, which `kvtune capacity` loads, loads the simulator only to simulate.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvtune.capacity.measured import MeasuredCapacity, read_capacity_file
from kvtune.deploy.gateway_admission import gateway_admission
from kvtune.domain.deployment import Deployment, Measurement
from kvtune.domain.load_shape import Load, LoadShape
from kvtune.domain.log_reading import LogReplay
from kvtune.domain.route import Route
from kvtune.domain.simulated_server import SimulatedServer
from kvtune.domain.slo import Slo
from kvtune.errors import InputError, OptionError
from kvtune.gateway.config import load_gateway_config
from kvtune.gateway.gate import route_cap
from kvtune.ingest import options_for
from kvtune.model import resolve_model
from kvtune.model.spec import ModelSpec
from kvtune.planning import plan, resolve_gpu
from kvtune.profile.routes import Profile
from kvtune.sim.admission import Admission, DirectAdmission
from kvtune.sim.engine import CLIENT_RETRY
from kvtune.sim.plot import Timeline, svg
from kvtune.sim.rules import engine_rule
from kvtune.sim.run import run_simulation
from kvtune.sim.setup import CAPACITY, engine_setup, offline_capacity, timing_setup, v0_release_note
from kvtune.sim.traffic import LOAD_OPTION, Traffic, default_load, profile_traffic, replay_traffic
from kvtune.userfiles import brief
from kvtune.workload.draw import replay_rows, select_routes

__all__ = ["Simulation", "run_simulate"]

#: A gateway's output cap for a request: (route, prompt tokens, max_tokens) -> the tokens it may produce.
RouteCap = Callable[[str, int, int], int]


@dataclass(frozen=True, slots=True)
class Simulation:
    """What `kvtune simulate` predicts: `report` is its --json object (simulate.json), `timeline`
    the KV use and running/waiting requests over time, `timing_source` where the step time came
    from (calibrated, silicon, roofline-estimate)."""

    report: dict[str, Any]
    timeline: Timeline | None
    timing_source: str

    def files(self) -> dict[str, str]:
        """simulate.json and timeline.svg, as `kvtune simulate --out DIR` writes them."""
        files = {"simulate.json": json.dumps(self.report, indent=2) + "\n"}
        if self.timeline is not None:
            label = {"silicon": " (silicon-data estimate)", "roofline-estimate": " (roofline estimate)"}.get(
                self.timing_source, "")
            files["timeline.svg"] = svg(self.timeline, title=f"kvtune simulate{label}")
        return files


def run_simulate(
    workload: Profile | Callable[[], Profile] | LogReplay,
    deployment: Deployment,
    server: SimulatedServer,
    load: Load,
    slo: Slo | None = None,
    *,
    measured: Measurement | None = None,
    routes: Sequence[str] = (),
    on_note: Callable[[str], None] | None = None,
) -> Simulation:
    """kvtune.api.simulate's work (its docstring says what each argument means)."""
    if isinstance(workload, LogReplay):
        load = dataclasses.replace(load, replay=True)
    load.check(from_logs=isinstance(workload, LogReplay))
    note = on_note or (lambda _: None)
    gpu = resolve_gpu(deployment.gpu, deployment.gpu_spec)
    spec: ModelSpec | None = None
    labels: dict[str, str] | None = None  # where an offline pool's settings came from
    capacity_info: dict[str, Any]
    if server.capacity_file is not None:
        capacity = read_capacity_file(server.capacity_file)
        capacity_info = {"from": CAPACITY, "file": server.capacity_file}
        if capacity.timing is None and deployment.model is not None and gpu is not None:
            spec = resolve_model(deployment.model)
        tp = _tensor_parallel_size(server.tensor_parallel_size, capacity)
    else:
        # kvtune estimates vLLM's pool; another engine's is the measurement's count, simulated by its rule
        planned = plan(dataclasses.replace(deployment, engine="vllm"), measured=measured or Measurement())
        spec, tp = planned.spec, deployment.tp
        capacity, labels = offline_capacity(planned)
        report = planned.report
        capacity_info = {"from": labels["num_blocks"], "file": None, "model": report.model, "gpu": report.gpu,
                         "tensor_parallel_size": report.tensor_parallel_size,
                         "pipeline_parallel_size": report.pipeline_parallel_size,
                         "kv_cache_dtype": report.kv_cache_dtype, "engine_version": report.engine_version,
                         "gpu_memory_utilization": planned.gpu_memory_utilization.value,
                         "kv_cache_tokens": report.capacity.kv_cache_tokens}
    timing = timing_setup(capacity, spec=spec, gpu=gpu, tp=tp, engine=deployment.engine,
                          engine_version=deployment.engine_version)
    setup = engine_setup(capacity, max_num_seqs=server.max_num_seqs,
                         max_num_batched_tokens=deployment.max_num_batched_tokens, gpu=gpu, recorded_from=labels,
                         engine_version=deployment.engine_version)
    if (v0 := v0_release_note(deployment.engine, deployment.engine_version, setup.settings)) is not None:
        note(v0)
    admission, admission_info, cap = _admission(server, setup.settings.max_model_len, capacity.model)
    bounds = (setup.settings.max_model_len, timing.fixed_delay_s, cap)
    if isinstance(workload, LogReplay):
        traffic, context = _replay_traffic(workload, load, bounds, note)
    else:
        traffic, context = _profile_traffic(workload() if callable(workload) else workload, routes, load, bounds, note)
    run = run_simulation(traffic, setup, timing, admission=admission, slo=slo, context=context,
                         admission_info=admission_info, rule=engine_rule(deployment.engine), capacity=capacity_info,
                         time_bounded_closed_loop=context["load"]["concurrency"] is not None
                         and load.max_requests is None)
    return Simulation(run.report, run.timeline, timing.model.source.value)


def _tensor_parallel_size(given: int | None, capacity: MeasuredCapacity) -> int:
    """The roofline's tensor-parallel size beside a capacity file: the one given, else the file's
    (`kvtune capacity --json` states it), else 1; one the file contradicts is refused (its pool is
    per GPU at its own)."""
    recorded = capacity.tensor_parallel_size
    if given is not None and recorded is not None and given != recorded:
        raise OptionError(f"the capacity file's pool is per GPU at tensor-parallel size {recorded}, not {given}: "
                          f"leave --tp out, or write the file again with --tp {given}", field="tp")
    return given or recorded or 1


def _admission(server: SimulatedServer, max_model_len: int, model: str | None
               ) -> tuple[Callable[[Sequence[str]], Admission | None], dict[str, Any], RouteCap | None]:
    """(a factory of fresh admissions, what the JSON says of it, the gateway's output cap or None)."""
    if server.gateway is None:
        if server.route_header is not None:
            raise OptionError("only with --gateway: the header its routes match on", field="route_header")
        return lambda routes: DirectAdmission(), {"kind": "direct"}, None
    config = load_gateway_config(server.gateway)
    path = "/v1/chat/completions" if server.endpoint == "chat" else "/v1/completions"
    served = config.model or model
    header = _route_header(server, config.route_headers)
    chosen: dict[str | None, Route] = {}

    def route_of(name: str | None) -> Route:
        """The route a request of the traffic's route `name` matches: by its header, with a route_header."""
        if name not in chosen:
            found = config.route_for(path, served, None if header is None or name is None else {header: name})
            if found is None:
                raise OptionError(f"no route of {brief(server.gateway)} serves {path} for model {served!r}"
                                  + ("" if name is None or header is None else f" and {header} {brief(name)}")
                                  + ": the gateway would answer 404 to every request", field="--gateway")
            chosen[name] = found
        return chosen[name]

    route = route_of(None)
    if config.max_model_len > max_model_len:
        raise OptionError(f"the gateway's max_model_len {config.max_model_len:,} exceeds the engine's "
                          f"{max_model_len:,}", field="--gateway")

    def fresh(routes: Sequence[str]) -> Admission:
        if header is None:
            return gateway_admission(config, route)
        return gateway_admission(config, route, [route_of(r) for r in routes])

    def cap(name: str, prompt_tokens: int, max_tokens: int) -> int:
        return route_cap(route_of(name if header is not None else None).max_new_tokens, (max_tokens,))

    # one engine is simulated: the first upstream's budget (kvtune.deploy.gateway_admission)
    info = {"kind": "gateway", "config": str(server.gateway), "block_budget": config.upstreams[0].block_budget,
            "block_size": config.block_size, "route": route.name, "max_new_tokens": route.max_new_tokens,
            "queue_max_waiting": config.queue_max_waiting, "queue_timeout_s": config.queue_timeout_s,
            "retry_after": {"min_s": config.retry_after_min_s, "max_s": config.retry_after_max_s},
            "route_header": header}
    if config.flow is not None:
        info["flow"] = config.flow.to_dict()
    return fresh, info, cap


def _route_header(server: SimulatedServer, headers: tuple[str, ...]) -> str | None:
    """The header each simulated request carries its route in (lower case): the server's
    route_header, which must be one the gateway's routes match on; a gateway that routes on one
    needs it named."""
    if server.route_header is None:
        if headers:
            raise OptionError(f"{brief(server.gateway)} caps routes by the {headers[0]} header: name it "
                              f"(--route-header {headers[0]}) so that each simulated request carries its "
                              f"--route-by group there", field="route_header")
        return None
    header = server.route_header.lower()
    if header not in headers:
        raise OptionError(f"no route of {brief(server.gateway)} matches the {brief(header)} header"
                          + (f" (its routes match {', '.join(headers)})" if headers else ""), field="route_header")
    return header


def _replay_traffic(replay: LogReplay, load: Load, bounds: tuple[int, float, RouteCap | None],
                    note: Callable[[str], None]) -> tuple[Callable[[int | None], Traffic], dict[str, Any]]:
    """(traffic(n) for the simulation, the load and workload context of the JSON) of a replay."""
    max_model_len, overhead_s, cap = bounds
    rows, stamps, notes = replay_rows(replay.logs, options_for(replay.reading), replay.routes)
    for line in notes:
        note(line)

    def traffic(n: int | None) -> Traffic:
        return replay_traffic(rows, stamps, speedup=load.speedup, seed=load.seed, max_requests=load.max_requests,
                              duration_s=load.duration_s, max_model_len=max_model_len, overhead_s=overhead_s,
                              cap=cap)

    load_info = {**LoadShape.replay([], load.speedup).to_dict(), "from": "logs"}
    return traffic, _context(load, load_info, sorted({r for r, _, _ in rows}), notes)


def _profile_traffic(profile: Profile, routes: Sequence[str], load: Load,
                     bounds: tuple[int, float, RouteCap | None], note: Callable[[str], None]
                     ) -> tuple[Callable[[int | None], Traffic], dict[str, Any]]:
    """(traffic(n) for the simulation, the load and workload context of the JSON) drawn from a profile."""
    max_model_len, overhead_s, cap = bounds
    chosen = select_routes(profile, routes)
    for r in chosen:
        if r.prompt.total == 0:
            raise InputError(f"route {brief(r.route)} logs no prompt lengths; a simulation needs them",
                             field="--route")
    if load.given:
        shape, load_from = load.shape(), LOAD_OPTION
    else:  # the logs' own arrival rate, never silently one request at a time
        shape, load_from, fallback = default_load(profile, routes, burstiness=load.burstiness)
        if fallback is not None:
            note(fallback)

    def traffic(n: int | None) -> Traffic:
        return profile_traffic(profile, routes, shape, seed=load.seed, max_requests=load.max_requests,
                               duration_s=load.duration_s, max_model_len=max_model_len, overhead_s=overhead_s,
                               cap=cap, closed_n=n)

    return traffic, _context(load, {**shape.to_dict(), "from": load_from}, [r.route for r in chosen], profile.notes)


def _context(load: Load, load_info: dict[str, Any], routes: list[str], notes: list[str]) -> dict[str, Any]:
    return {
        "load": {**load_info, "max_requests": load.max_requests, "duration_s": load.duration_s, "retry": True,
                 "max_retries": CLIENT_RETRY.max_retries},
        "workload": {"routes": routes, "seed": load.seed},
        "notes": notes,  # the files the logs' reading left out
    }
