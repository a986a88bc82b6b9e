"""`kvtune simulate (LOGS | --profile FILE) --capacity FILE`: what a configuration does to the traffic."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import click

from kvtune import api
from kvtune.cli._vocabulary import SectionedCommand, quiet_option
from kvtune.cli.load_options import LoadArgs, load_options
from kvtune.cli.options import GPU_SPEC_HELP, LogArgs, grouped, log_options, parse_count, traffic_source_options
from kvtune.controls import escape_controls
from kvtune.domain.deployment import Deployment, Measurement
from kvtune.domain.log_reading import LogReplay
from kvtune.domain.simulated_server import SIMULATED_ENGINES, SimulatedServer
from kvtune.domain.slo import parse_slo
from kvtune.errors import OptionError
from kvtune.writer import write_files

if TYPE_CHECKING:
    from kvtune.profile.routes import Profile

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
                   {c0..c4; past_knee_s, knee_tokens, mixed_step_s, largest_graph_tokens when
                   not 0}, http_overhead_s, frontend {request_s, token_s} | null, fixed_delay_s,
                   frontend_from (uncalibrated: where the API server's figures come from),
                   host_work (uncalibrated vLLM: the engine core's host work, added or not,
                   why), dispatch (uncalibrated vLLM: {per_layer_s,
                   layers, mixed_step_s, largest_cuda_graph_tokens, from}: the host's
                   layer-by-layer dispatch of each step not replayed as one CUDA graph; null for
                   other engines),
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

    def deployment(self) -> Deployment:
        """The deployment these options describe (beside a capacity file, only its model, GPU and
        engine: `check` refused the rest)."""
        return Deployment(self.model, gpu=self.gpu, gpu_spec=self.gpu_spec, tp=self.tp or 1, pp=self.pp or 1,
                          engine=self.engine_name, engine_version=self.engine_version,
                          kv_cache_dtype=self.kv_cache_dtype, gpu_memory_utilization=self.gpu_memory_utilization,
                          max_model_len=parse_count(self.max_model_len, "--max-model-len"),
                          max_num_batched_tokens=self.max_num_batched_tokens)

    def measurement(self) -> Measurement:
        """The pool these options give in tokens or blocks (none: the estimate or the capacity file)."""
        return Measurement(kv_tokens=parse_count(self.kv_tokens, "--kv-tokens"), num_gpu_blocks=self.num_gpu_blocks)

    def server(self) -> SimulatedServer:
        """The capacity file, gateway, limits and request path these options name."""
        return SimulatedServer(capacity_file=self.capacity_path, gateway=self.gateway_path,
                               max_num_seqs=self.max_num_seqs, endpoint=self.endpoint, route_header=self.route_header,
                               tensor_parallel_size=self.tp if self.capacity_path is not None else None)


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
    click.option("--engine", "engine_name", type=click.Choice(SIMULATED_ENGINES),
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
    slo_ = parse_slo(slo) if slo else None
    load.check(logs)
    if profile_path and logs:
        raise OptionError("give --profile or LOGS, not both", field="--profile")
    if not profile_path and not logs:
        raise OptionError("give LOGS or --profile FILE for the workload", field="LOGS")
    engine.check()

    def read_profile() -> Profile:  # once the engine is set up: its errors come first
        return log.traffic_profile(logs, profile_path)

    workload = LogReplay(logs, log.reading(), routes) if load.replay else read_profile
    result = api.simulate(workload, engine.deployment(), engine.server(), load.as_load(seed), slo_,
                          measured=engine.measurement(), routes=routes, on_note=_note)
    text = json.dumps(result.report, indent=2)
    if out_dir is not None:
        write_files({Path(out_dir) / name: body for name, body in result.files().items()})
    if json_:
        click.echo(text)
    else:
        from kvtune.cli._console import output_console  # rich: only for the table
        from kvtune.cli._simulate_view import render_simulation  # rich: only for the table

        render_simulation(result.report, result.timeline, output_console())


def _note(line: str) -> None:
    click.echo(escape_controls(f"note: {line}"), err=True)


__all__ = ["simulate", "JSON_FIELDS"]
