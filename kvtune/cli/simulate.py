"""`kvtune simulate (LOGS | --profile FILE) --capacity FILE`: what a configuration does to the traffic."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import click

from kvtune.cli._vocabulary import SectionedCommand, quiet_option
from kvtune.cli.load_options import LoadArgs, load_options
from kvtune.cli.options import GPU_SPEC_HELP, LogArgs, grouped, log_options, traffic_source_options
from kvtune.controls import escape_controls
from kvtune.domain.deployment import Deployment, Measurement
from kvtune.errors import InputError, OptionError
from kvtune.sim.rules import ENGINE_NAMES
from kvtune.userfiles import brief

if TYPE_CHECKING:
    from kvtune.capacity.measured import MeasuredCapacity
    from kvtune.domain.route import Route

JSON_FIELDS = """\b
--json (and --out DIR's simulate.json) write one object; the fields shared with
`kvtune bench --json` mean the same and are computed by the same functions:
  load            {kind: synchronous|concurrent|poisson|gamma|replay, rate_rps, burstiness,
                   concurrency, speedup, from: option|logs|default (without --rate/--concurrency:
                   the logs' mean arrival rate; logs without timestamps: one client, said on
                   stderr), max_requests, duration_s, retry, max_retries}
  workload        {routes, seed, clamped: {reason: requests}}
  notes           the files the logs' reading left out (kvtune's own outputs, --exclude)
  requests        {sent, completed, failed: {429, 4xx, … as bench}, retries, retry_wait_s (seconds the
                   clients waited on Retry-After, in all)}
  duration_s      first send to last answer (simulated seconds)
  output_tokens_total, output_tokens_requested_total, prompt_tokens_requested_total
  latency_ms      {ttft, itl, tpot, e2e}: each {count, mean, p50, p90, p99} (nearest rank), from
                  the client's first send; itl is each request's mean gap, once per gap
  throughput      {requests_per_s, output_tokens_per_s}
  goodput         {slo, requests_met, attainment, requests_per_s} with --slo, else null
  server          {preemptions, kv_cache_usage_peak, running_peak, waiting_peak,
                   generation_tokens, num_blocks, block_size} (peaks exact, not sampled)
  simulation      {timing: {source: calibrated|silicon|roofline-estimate, estimate, coefficients
                   {c0..c4}, http_overhead_s, frontend {request_s, token_s} | null, fixed_delay_s,
                   frontend_from (uncalibrated: where the API server's figures come from),
                   host_work (uncalibrated vLLM: the engine core's host work, added or not, why),
                   measured_against | silicon | roofline + fallback_reason, label}, engine: {num_blocks, block_size,
                   max_num_seqs, max_num_batched_tokens, max_model_len, enable_prefix_caching,
                   reserve_full_sequence (admission needs the whole prompt's blocks, vLLM ≥ 0.19, or
                   its first chunk's): each {value, from: option|capacity-file|estimate|engine-default}},
                   capacity: {from: capacity-file|estimate|option, file; without a file: model, gpu,
                   tensor_parallel_size, pipeline_parallel_size, kv_cache_dtype, engine_version,
                   gpu_memory_utilization, kv_cache_tokens}, admission: {kind:
                   direct|gateway, …the gateway's budget, route, cap, queue, route_header (each
                   request's route in it, with --route-header)}, rule: vllm|sglang|
                   trtllm-gne|trtllm-maxutil (whose scheduler), retry {max_retries,
                   max_wait_s}, events, steps, wall_s, requests_not_sent, admission_waiting_peak,
                   preempted_requests}

\b
Exit codes: 0 done, 2 bad input (nothing written).
"""


@dataclass(frozen=True, slots=True)
class EngineArgs:
    """Overrides of the engine settings the capacity file implies, the roofline's inputs, and,
    without a capacity file, the deployment kvtune estimates the pool for (as `kvtune capacity`)."""

    capacity_path: str | None
    gateway_path: str | None
    max_num_seqs: int | None
    max_num_batched_tokens: int | None
    model: str | None
    gpu: str | None
    route_header: str | None
    endpoint: str
    engine_name: str = "vllm"
    tp: int | None = None
    pp: int | None = None
    engine_version: str | None = None
    kv_cache_dtype: str | None = None
    gpu_memory_utilization: float | None = None
    max_model_len: str | None = None
    kv_tokens: str | None = None
    num_gpu_blocks: int | None = None
    gpu_spec: str | None = None

    def check(self) -> None:
        """Options that mean nothing beside a capacity file, or beside each other: one line, exit 2."""
        if self.capacity_path is not None:
            for flag, value in (("--kv-tokens", self.kv_tokens), ("--num-gpu-blocks", self.num_gpu_blocks),
                                ("--gpu-memory-utilization", self.gpu_memory_utilization),
                                ("--kv-cache-dtype", self.kv_cache_dtype), ("--max-model-len", self.max_model_len),
                                ("--engine-version", self.engine_version), ("--pp", self.pp)):
                if value is not None:
                    raise OptionError("the capacity file holds the pool and the settings it was measured at: give "
                                      f"{flag} without --capacity (kvtune estimates the pool), or --capacity alone",
                                      field=flag)
            return
        if self.kv_tokens is not None and self.num_gpu_blocks is not None:
            raise OptionError("give the pool once: --kv-tokens or --num-gpu-blocks", field="--num-gpu-blocks")
        if self.model is None or (self.gpu is None and self.gpu_spec is None):
            missing = "--model" if self.model is None else "--gpu"
            raise OptionError("give --capacity FILE (`kvtune calibrate`, `kvtune capacity --json`), or --model and "
                              "--gpu (or --gpu-spec) to simulate on kvtune's capacity estimate and roofline step time",
                              field=missing)
        if self.engine_name != "vllm" and self.kv_tokens is None and self.num_gpu_blocks is None:
            raise OptionError(f"kvtune estimates vLLM's pool; for --engine {self.engine_name} give the pool "
                              "(--kv-tokens, --num-gpu-blocks) or --capacity FILE", field="--engine")

    def plan(self):  # -> kvtune.planning.Plan
        """The deployment without a capacity file, planned as `kvtune capacity` and `recommend` plan it
        (vLLM's pool: another engine's is given, --kv-tokens or --num-gpu-blocks)."""
        import kvtune
        from kvtune.cli.options import parse_count

        assert self.model is not None
        measured = Measurement(kv_tokens=parse_count(self.kv_tokens, "--kv-tokens"),
                               num_gpu_blocks=self.num_gpu_blocks)
        return kvtune.plan(Deployment(self.model, gpu=self.gpu, gpu_spec=self.gpu_spec, tp=self.tp or 1,
                                      pp=self.pp or 1, gpu_memory_utilization=self.gpu_memory_utilization,
                                      max_model_len=parse_count(self.max_model_len, "--max-model-len"),
                                      max_num_batched_tokens=self.max_num_batched_tokens,
                                      kv_cache_dtype=self.kv_cache_dtype, engine_version=self.engine_version),
                           measured=measured)


_engine_options = [
    click.option("--capacity", "capacity_path", metavar="FILE",
                 help="A capacity file from `kvtune calibrate` or `kvtune capacity --json` (blocks, block size, "
                      "max_model_len; `timing` from `calibrate --timing`).  [default: kvtune's estimate for "
                      "--model on --gpu]"),
    click.option("--gateway", "gateway_path", metavar="FILE",
                 help="gateway.yaml: run the gateway's own admission (ledger, route caps, queue, Retry-After) "
                      "in front of the engine.  [default: straight to vLLM]"),
    click.option("--max-num-seqs", type=click.IntRange(min=1), metavar="N",
                 help="Override the engine's max_num_seqs.  [default: the capacity file's, else vLLM's]"),
    click.option("--max-num-batched-tokens", type=click.IntRange(min=1), metavar="N",
                 help="Override the engine's max_num_batched_tokens.  [default: the capacity file's, else vLLM's]"),
    click.option("-m", "--model", help="Model (preset, config.json, hub id): the capacity estimate's without "
                                       "--capacity, and the silicon-data or roofline step time's when the "
                                       "capacity file has no `timing`."),
    click.option("--gpu", help="GPU from the catalog for the capacity estimate and the silicon-data or roofline step "
                               "time (and vLLM's GPU defaults)."),
    click.option("--gpu-spec", "gpu_spec", metavar="FILE", help=GPU_SPEC_HELP),
    click.option("--tp", type=click.IntRange(min=1), metavar="N",
                 help="Tensor-parallel size of the estimate and the roofline.  [default: 1]"),
    click.option("--pp", type=click.IntRange(min=1), metavar="N",
                 help="Pipeline-parallel size of the estimate.  [default: 1]"),
    click.option("--engine-version", metavar="TEXT",
                 help="The vLLM release whose memory profiler and defaults the estimate follows, as `kvtune "
                      "capacity --engine-version`."),
    click.option("--kv-cache-dtype", help="vLLM's --kv-cache-dtype for the estimate (auto, fp8, …).  [default: auto]"),
    click.option("--gpu-memory-utilization", type=click.FloatRange(min=0, max=1, min_open=True), metavar="F",
                 help="vLLM's fraction of each GPU's memory for the estimate.  [default: vLLM's]"),
    click.option("--max-model-len", metavar="N", help="Context length of the estimated engine.  [default: the "
                                                      "model's]"),
    click.option("--kv-tokens", metavar="N", help="The pool in tokens, when you know it (vLLM's 'GPU KV cache size' "
                                                  "line), instead of the estimate."),
    click.option("--num-gpu-blocks", type=click.IntRange(min=1), metavar="N",
                 help="The pool in blocks, when you know it (--num-gpu-blocks-override), instead of the estimate."),
    click.option("--endpoint", type=click.Choice(["chat", "completions"]), default="chat", show_default=True,
                 help="The path requests are sent to, as `kvtune bench --endpoint`: picks the gateway's route."),
    click.option("--route-header", metavar="NAME",
                 help="With a gateway.yaml that routes on this request header: each simulated request carries "
                      "its route (the --route-by group) in it, and gets that group's route and cap."),
    click.option("--engine", "engine_name", type=click.Choice(ENGINE_NAMES),
                 default="vllm", show_default=True,
                 help="Whose scheduler to simulate: vLLM's, SGLang's (new_token_ratio estimate, retraction) "
                      "or TensorRT-LLM's (GUARANTEED_NO_EVICT, MAX_UTILIZATION), sized by the same settings."),
]


engine_args = grouped("engine", EngineArgs, _engine_options)


@click.command(cls=SectionedCommand, epilog=JSON_FIELDS)
@quiet_option()
@click.argument("logs", nargs=-1)
@traffic_source_options
@log_options
@engine_args
@load_options
@click.option("--seed", type=int, default=0, show_default=True,
              help="Seed for lengths and arrival gaps: the same requests `kvtune bench --seed` sends.")
@click.option("--slo", metavar="SPEC", help="Latency objectives in ms for goodput, e.g. ttft=500,tpot=50,e2e=10000.")
@click.option("--json", "json_", is_flag=True, help="Print the results JSON instead of the table.")
@click.option("--out", "out_dir", type=click.Path(file_okay=False), metavar="DIR",
              help="Write simulate.json and timeline.svg (KV use, running/waiting over time) into DIR.")
def simulate(logs: tuple[str, ...], profile_path: str | None, routes: tuple[str, ...], log: LogArgs,
             engine: EngineArgs, load: LoadArgs, seed: int, slo: str | None, json_: bool, out_dir: str | None) -> None:
    """Predict throughput, latency, preemptions and 429s of traffic on a vLLM configuration.

    A simulation of vLLM V1's scheduler (checked step by step against vLLM's own) with the
    step time `kvtune calibrate --timing` measured, serving the requests `kvtune bench` would
    send for the same profile and seed, straight to the engine or through the gateway's own
    admission code (--gateway). Without a calibrated `timing`, --model and --gpu give
    aiconfigurator-core's silicon data for that GPU, else a roofline estimate, labelled as such.
    Without --capacity, the pool is kvtune's estimate for --model on --gpu (as `kvtune capacity`
    computes it) or the --kv-tokens / --num-gpu-blocks you know; without --rate or
    --concurrency, the load is the logs' mean arrival rate.

    \b
    Example:
        kvtune simulate logs.jsonl --model llama-3.1-8b --gpu H100-80GB --tp 2 --requests 500
        kvtune calibrate http://127.0.0.1:8000 --timing --save capacity.json
        kvtune simulate --profile profile.json --capacity capacity.json --rate 5 --requests 500
        kvtune simulate --profile profile.json --capacity capacity.json --gateway deploy/gateway.yaml \\
            --rate 5 --requests 500 --slo ttft=500,e2e=10000 --out sim/
    """
    from kvtune.capacity.measured import read_capacity_file
    from kvtune.domain.slo import parse_slo
    from kvtune.sim.setup import CAPACITY, engine_setup, offline_capacity, timing_setup

    slo_ = parse_slo(slo) if slo else None
    load.check(logs)
    if profile_path and logs:
        raise OptionError("give --profile or LOGS, not both", field="--profile")
    if not profile_path and not logs:
        raise OptionError("give LOGS or --profile FILE for the workload", field="LOGS")
    from kvtune.planning import resolve_gpu

    engine.check()
    gpu = resolve_gpu(engine.gpu, engine.gpu_spec)
    spec = None
    labels = None
    if engine.capacity_path is not None:
        measured = read_capacity_file(engine.capacity_path)
        capacity_info: dict[str, Any] = {"from": CAPACITY, "file": engine.capacity_path}
        if measured.timing is None and engine.model is not None and gpu is not None:
            from kvtune.model.sources import resolve_model

            spec = resolve_model(engine.model)
    else:
        plan = engine.plan()
        spec = plan.spec
        measured, labels = offline_capacity(plan)
        report = plan.report
        capacity_info = {"from": labels["num_blocks"], "file": None, "model": report.model, "gpu": report.gpu,
                         "tensor_parallel_size": report.tensor_parallel_size,
                         "pipeline_parallel_size": report.pipeline_parallel_size,
                         "kv_cache_dtype": report.kv_cache_dtype, "engine_version": report.engine_version,
                         "gpu_memory_utilization": plan.gpu_memory_utilization.value,
                         "kv_cache_tokens": report.capacity.kv_cache_tokens}
    timing = timing_setup(measured, spec=spec, gpu=gpu, tp=_tensor_parallel_size(engine, measured),
                          engine=engine.engine_name, engine_version=engine.engine_version)
    setup = engine_setup(measured, max_num_seqs=engine.max_num_seqs,
                         max_num_batched_tokens=engine.max_num_batched_tokens, gpu=gpu, recorded_from=labels,
                         engine_version=engine.engine_version)
    admission, admission_info, cap = _admission(engine, setup.settings.max_model_len, measured.model)

    from kvtune.sim.run import run_simulation

    mml = setup.settings.max_model_len
    overhead = timing.fixed_delay_s
    traffic, context = _traffic(logs, profile_path, routes, log, load, seed, mml, overhead, cap)
    from kvtune.sim.rules import engine_rule

    run = run_simulation(traffic, setup, timing, admission=admission, slo=slo_, context=context,
                         admission_info=admission_info, rule=engine_rule(engine.engine_name), capacity=capacity_info,
                         time_bounded_closed_loop=context["load"]["concurrency"] is not None
                         and load.max_requests is None)
    text = json.dumps(run.report, indent=2)
    if out_dir is not None:
        from pathlib import Path

        from kvtune.sim.plot import svg
        from kvtune.writer import write_files

        files: dict[str | os.PathLike[str], str] = {Path(out_dir) / "simulate.json": text + "\n"}
        if run.timeline is not None:
            label = {"silicon": " (silicon-data estimate)", "roofline-estimate": " (roofline estimate)"}.get(
                timing.model.source.value, "")
            files[Path(out_dir) / "timeline.svg"] = svg(run.timeline, title=f"kvtune simulate{label}")
        write_files(files)
    if json_:
        click.echo(text)
    else:
        from kvtune.cli._console import output_console
        from kvtune.cli._simulate_view import render_simulation

        render_simulation(run.report, run.timeline, output_console())


def _tensor_parallel_size(engine: EngineArgs, measured: MeasuredCapacity) -> int:
    """The roofline's tensor-parallel size: --tp, else the capacity file's (`kvtune capacity --json`
    states it), else 1; a --tp the file contradicts is refused (its pool is per GPU at its own)."""
    recorded = measured.tensor_parallel_size
    if engine.tp is not None and recorded is not None and engine.tp != recorded:
        raise OptionError(f"the capacity file's pool is per GPU at tensor-parallel size {recorded}, not {engine.tp}: "
                          f"leave --tp out, or write the file again with --tp {engine.tp}", field="--tp")
    return engine.tp or recorded or 1


def _admission(engine: EngineArgs, max_model_len: int, model: str | None) -> tuple[Any, dict[str, Any], Any]:
    """(a factory of fresh admissions, what the JSON says of it, the gateway's output cap or None)."""
    from kvtune.sim.admission import DirectAdmission, LedgerAdmission

    if engine.gateway_path is None:
        if engine.route_header is not None:
            raise OptionError("only with --gateway: the header its routes match on", field="--route-header")
        return lambda routes: DirectAdmission(), {"kind": "direct"}, None
    from kvtune.deploy.gateway_admission import gateway_admission
    from kvtune.gateway.config import load_gateway_config
    from kvtune.gateway.gate import route_cap

    config = load_gateway_config(engine.gateway_path)
    path = "/v1/chat/completions" if engine.endpoint == "chat" else "/v1/completions"
    served = config.model or model
    header = _route_header(engine, config.route_headers)
    chosen: dict[str | None, Route] = {}

    def route_of(name: str | None) -> Route:
        """The route a request of the traffic's route `name` matches: by its header, with --route-header."""
        if name not in chosen:
            found = config.route_for(path, served, None if header is None or name is None else {header: name})
            if found is None:
                raise OptionError(f"no route of {brief(engine.gateway_path)} serves {path} for model {served!r}"
                                  + ("" if name is None or header is None else f" and {header} {brief(name)}")
                                  + ": the gateway would answer 404 to every request", field="--gateway")
            chosen[name] = found
        return chosen[name]

    route = route_of(None)
    if config.max_model_len > max_model_len:
        raise OptionError(f"the gateway's max_model_len {config.max_model_len:,} exceeds the engine's "
                          f"{max_model_len:,}", field="--gateway")

    def fresh(routes: Sequence[str]) -> LedgerAdmission:
        if header is None:
            return gateway_admission(config, route)
        return gateway_admission(config, route, [route_of(r) for r in routes])

    def cap(name: str, prompt_tokens: int, max_tokens: int) -> int:
        return route_cap(route_of(name if header is not None else None).max_new_tokens, (max_tokens,))

    # one engine is simulated: the first upstream's budget (kvtune.deploy.gateway_admission)
    info = {"kind": "gateway", "config": str(engine.gateway_path), "block_budget": config.upstreams[0].block_budget,
            "block_size": config.block_size, "route": route.name, "max_new_tokens": route.max_new_tokens,
            "queue_max_waiting": config.queue_max_waiting, "queue_timeout_s": config.queue_timeout_s,
            "retry_after": {"min_s": config.retry_after_min_s, "max_s": config.retry_after_max_s},
            "route_header": header}
    if config.flow is not None:
        info["flow"] = config.flow.to_dict()
    return fresh, info, cap


def _route_header(engine: EngineArgs, headers: tuple[str, ...]) -> str | None:
    """The header each simulated request carries its route in (lower case): --route-header, which
    must be one the gateway's routes match on; a gateway that routes on one needs it named."""
    if engine.route_header is None:
        if headers:
            raise OptionError(f"{brief(engine.gateway_path)} caps routes by the {headers[0]} header: name it "
                              f"(--route-header {headers[0]}) so that each simulated request carries its "
                              f"--route-by group there", field="--route-header")
        return None
    header = engine.route_header.lower()
    if header not in headers:
        raise OptionError(f"no route of {brief(engine.gateway_path)} matches the {brief(header)} header"
                          + (f" (its routes match {', '.join(headers)})" if headers else ""), field="--route-header")
    return header


def _traffic(logs: tuple[str, ...], profile_path: str | None, routes: tuple[str, ...], log: LogArgs,
             load: LoadArgs, seed: int, max_model_len: int, overhead_s: float, cap: Any) -> tuple[Any, dict[str, Any]]:
    """(traffic(n) for the simulation, the load and workload context of the JSON)."""
    from kvtune.sim.traffic import profile_traffic, replay_traffic

    load_info: dict[str, Any]
    notes: list[str]
    if load.replay:
        from kvtune.workload.draw import replay_rows

        rows, stamps, notes = replay_rows(logs, log.ingest(), routes)
        for note in notes:
            click.echo(escape_controls(f"note: {note}"), err=True)

        def traffic(n: int | None) -> Any:
            return replay_traffic(rows, stamps, speedup=load.speedup, seed=seed, max_requests=load.max_requests,
                                  duration_s=load.duration_s, max_model_len=max_model_len, overhead_s=overhead_s,
                                  cap=cap)

        from kvtune.domain.load_shape import LoadShape

        load_info = {**LoadShape.replay([], load.speedup).to_dict(), "from": "logs"}
        route_names = sorted({r for r, _, _ in rows})
    else:
        from kvtune.cli._profile_view import render_folded, render_skipped_files
        from kvtune.profile.build import load_profile
        from kvtune.profile.logs import load_profile_or_logs
        from kvtune.profile.routes import fold_routes
        from kvtune.workload.draw import select_routes

        profile = (fold_routes(load_profile(profile_path), log.max_routes) if profile_path
                   else load_profile_or_logs(list(logs), log.ingest(), max_routes=log.max_routes,
                                              workers=log.workers, ray_address=log.ray_address))
        log.logged_model(profile)  # one model's traffic: several without --log-model is an error
        render_folded(profile, log.max_routes)
        render_skipped_files(profile)
        notes = profile.notes
        chosen = select_routes(profile, routes)
        for r in chosen:
            if r.prompt.total == 0:
                raise InputError(f"route {brief(r.route)} logs no prompt lengths; a simulation needs them",
                                 field="--route")
        from kvtune.sim.traffic import LOAD_OPTION, default_load

        if load.rate is not None or load.concurrency is not None:
            shape, load_from = load.shape(), LOAD_OPTION
        else:  # the logs' own arrival rate, never silently one request at a time
            shape, load_from, fallback = default_load(profile, routes, burstiness=load.burstiness)
            if fallback is not None:
                click.echo(f"note: {fallback}", err=True)

        def traffic(n: int | None) -> Any:
            return profile_traffic(profile, routes, shape, seed=seed, max_requests=load.max_requests,
                                   duration_s=load.duration_s, max_model_len=max_model_len, overhead_s=overhead_s,
                                   cap=cap, closed_n=n)

        load_info = {**shape.to_dict(), "from": load_from}
        route_names = [r.route for r in chosen]
    from kvtune.sim.engine import CLIENT_RETRY

    context = {
        "load": {**load_info, "max_requests": load.max_requests, "duration_s": load.duration_s, "retry": True,
                 "max_retries": CLIENT_RETRY.max_retries},
        "workload": {"routes": route_names, "seed": seed},
        "notes": notes,  # the files the logs' reading left out
    }
    return traffic, context


__all__ = ["simulate", "JSON_FIELDS"]
