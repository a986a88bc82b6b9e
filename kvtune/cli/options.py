"""Options shared by several commands, each group one decorator that hands the command one typed
object: `capacity_options` → `capacity: CapacityArgs` (capacity, recommend, check), `log_options` →
`log: LogArgs` (profile, recommend, check, bench). Each object knows the library call it feeds:
CapacityArgs turns into kvtune.api's Deployment and Measurement. The policy and objective groups
live in policy_options.py, the load group in load_options.py: no command imports another.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import click

from kvtune import api
from kvtune.domain.deployment import Deployment, Measurement
from kvtune.domain.fields import MAX_INTEGER as MAX_COUNT  # counts above it are typos
from kvtune.domain.log_reading import DEFAULT_MAX_ROUTES as MAX_ROUTES
from kvtune.domain.log_reading import LogReading
from kvtune.engines import ENGINE_NAMES, vllm
from kvtune.errors import KvtuneError, OptionError
from kvtune.hardware import GPUS
from kvtune.ingest import FORMATS, IngestOptions, OnError
from kvtune.profile.logged_model import one_logged_model

GPU_NAMES = tuple(GPUS)
_COUNT = re.compile(r"(?P<num>\d+(?:\.\d+)?)(?P<suffix>[kKmMgG]?)")
_SUFFIX = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "K": 2**10, "M": 2**20, "G": 2**30}


def parse_count(text: str | None, field: str) -> int | None:
    """A positive integer, also in vLLM's forms: 8k = 8,000, 8K = 8,192, 25.6k = 25,600."""
    if text is None:
        return None
    shown = repr(text) if len(repr(text)) <= 44 else repr(text)[:40] + "...'"
    m = _COUNT.fullmatch(text.strip().replace(",", "").replace("_", ""))
    if m is None:
        raise OptionError(f"expected a positive integer such as 8192, 8k or 8K, got {shown}", field=field)
    value = float(m["num"]) * _SUFFIX[m["suffix"]]
    if value > MAX_COUNT:
        raise OptionError(f"{shown} is beyond any token or block count (at most 2^53)", field=field)
    if not value.is_integer() or value < 1:
        raise OptionError(f"expected a positive integer, got {shown}", field=field)
    return int(value)


def compose(decorators: list[Callable]) -> Callable:
    """Many click decorators as one, applied in the order listed."""
    def wrap(f: Callable) -> Callable:
        for decorator in reversed(decorators):
            f = decorator(f)
        return f

    return wrap


def grouped(name: str, cls: type, options: list[Callable]) -> Callable:
    """Click options that reach the command as one typed object: `name=cls(**their values)`, so a
    command's signature says what it takes instead of `**opts`."""
    keys = [f.name for f in dataclasses.fields(cls)]

    def decorate(f: Callable) -> Callable:
        @functools.wraps(f)
        def command(**kwargs: Any) -> Any:
            kwargs[name] = cls(**{k: kwargs.pop(k) for k in keys})
            return f(**kwargs)

        for option in reversed(options):
            command = option(command)
        return command

    return decorate


@dataclass(frozen=True, slots=True)
class CapacityArgs:
    """The model's deployment and a measured capacity, as `capacity`, `recommend` and `check` take them."""

    gpu: str | None
    gpu_memory: str | None
    tp: int
    pp: int
    gpu_memory_utilization: float | None
    max_model_len: str | None
    max_num_batched_tokens: str | None
    block_size: int | None
    kv_cache_dtype: str | None
    enforce_eager: bool
    engine_version: str | None
    kv_tokens: str | None
    vllm_log: str | None
    metrics_url: str | None
    capacity_files: tuple[str, ...]  # --capacity, repeated: one per engine replica (`recommend` only)
    engine_log: str | None
    engine: str
    gpu_spec: str | None = None  # --gpu-spec FILE: a GPU the catalog does not hold
    num_gpu_blocks: int | None = None  # the pool in blocks, as --num-gpu-blocks-override sets it

    def measurement(self) -> Measurement:
        """Where these options say the measured capacity comes from (kvtune.api's Measurement)."""
        return Measurement(kv_tokens=parse_count(self.kv_tokens, "kv_tokens"), num_gpu_blocks=self.num_gpu_blocks,
                           vllm_log=self.vllm_log, engine_log=self.engine_log, metrics_url=self.metrics_url,
                           capacity_files=self.capacity_files)

    def deployment(self, model: str | None, replicas: int = 1) -> Deployment:
        """The deployment these options describe (kvtune.api's Deployment; model None: the logs')."""
        return Deployment(model=model, gpu=self.gpu, gpu_memory=self.gpu_memory, tp=self.tp, pp=self.pp,
                          engine=self.engine, engine_version=self.engine_version, kv_cache_dtype=self.kv_cache_dtype,
                          block_size=self.block_size, max_model_len=parse_count(self.max_model_len, "max_model_len"),
                          gpu_memory_utilization=self.gpu_memory_utilization,
                          max_num_batched_tokens=parse_count(self.max_num_batched_tokens, "max_num_batched_tokens"),
                          enforce_eager=self.enforce_eager, gpu_spec=self.gpu_spec, replicas=replicas)


GPU_HELP = ("GPU model from the catalog: " + ", ".join(GPU_NAMES) + " (any case; h100, a100 … work). "
            "Another GPU: --gpu-spec FILE.")
GPU_SPEC_HELP = ("A YAML/JSON file describing a GPU the catalog does not hold: name, memory (with a unit), "
                 "bandwidth_gb_s, dense_tflops {bf16, fp8, int8, int4, fp4}; instead of --gpu.")

capacity_options = grouped("capacity", CapacityArgs, [
    click.option("--gpu", help=GPU_HELP),
    click.option("--gpu-spec", "gpu_spec", metavar="FILE", help=GPU_SPEC_HELP),
    click.option("--gpu-memory", help="Memory per GPU instead of --gpu, with a unit: 79.2GiB, 80GB, 24576MiB."),
    click.option("--tp", type=click.IntRange(min=1), default=1, show_default=True, help="Tensor-parallel size."),
    click.option("--pp", type=click.IntRange(min=1), default=1, show_default=True, help="Pipeline-parallel size."),
    click.option("--gpu-memory-utilization", type=click.FloatRange(min=0, max=1, min_open=True), default=None,
                 help="vLLM's fraction of each GPU's memory for this instance (with --engine sglang its "
                      "--mem-fraction-static, trtllm its kv_cache_free_gpu_memory_fraction).  [default: what the "
                      f"measured capacity was taken at, else {vllm.GPU_MEMORY_UTILIZATION}, or the engine's]"),
    click.option("--max-model-len", help="Context length; default the model's derived length (or the log's)."),
    click.option("--max-num-batched-tokens", help="Token budget per step (SGLang --chunked-prefill-size, TensorRT-LLM "
                 "--max_num_tokens); default the engine's for the GPU size."),
    click.option("--block-size", type=click.IntRange(min=1), default=None,
                 help="KV block size in tokens.  [default: the measured capacity's; 16; 128 for a CPU server's log; "
                      "SGLang 1; TensorRT-LLM 32]"),
    click.option("--kv-cache-dtype", default=None,
                 help="vLLM's --kv-cache-dtype: auto, bfloat16, float16, fp8, fp8_e4m3, fp8_e5m2, …  "
                      "[default: what the measured capacity was taken at, else auto]"),
    click.option("--enforce-eager", is_flag=True, help="No CUDA graphs: do not reserve memory for them."),
    click.option("--engine-version", metavar="TEXT",
                 help="The vLLM release whose defaults and memory profiler the estimate follows (before 0.8: "
                      "V0, which profiles at max_model_len and swaps); with --engine sglang|trtllm their release, "
                      "named in the assumptions (kvtune models SGLang 0.5.23, TensorRT-LLM 1.2).  "
                      f"[default: {vllm.CURRENT_VERSION}]"),
    click.option("--kv-tokens", help="Measured KV capacity in tokens (e.g. from vLLM's startup line)."),
    click.option("--vllm-log", help="A vLLM startup log to read the measured capacity from."),
    click.option("--metrics-url", help="A running vLLM's URL (root or /metrics) to read the measured capacity from."),
    click.option("--capacity", "capacity_files", multiple=True, metavar="FILE",
                 help="A capacity file written by `kvtune calibrate`. `recommend` takes one per engine replica, "
                      "in upstream order (each upstream's budget from its own)."),
    click.option("--engine-log", "engine_log", metavar="FILE",
                 help="The engine's startup log to read the measured capacity from (vLLM's as --vllm-log, SGLang's "
                      "max_total_num_tokens line, TensorRT-LLM's 'Allocated … for max tokens in paged KV cache (N)')."),
    click.option("--engine", type=click.Choice(ENGINE_NAMES), default="vllm", show_default=True,
                 help="The serving engine: its memory model, defaults and launch files."),
    click.option("--num-gpu-blocks", type=click.IntRange(min=1), metavar="N",
                 help="Known KV capacity in blocks of --block-size (as vLLM's --num-gpu-blocks-override sets it)."),
])


def _format_help() -> str:
    return "Force a log format instead of detecting it: " + ", ".join(FORMATS) + "."


@dataclass(frozen=True, slots=True)
class LogArgs:
    """How to read logs, as `profile`, `recommend`, `check` and `bench` take it."""

    format_: str | None
    fields: tuple[str, ...]
    route_by: str | None
    tokenizer: str | None
    on_error: str
    strict: bool
    assume_cap: int | None
    max_routes: int
    since: str | None = None  # checked by _instant when parsed; the window is built in `ingest`
    until: str | None = None
    workers: int | None = 1  # processes for the map step; None: every core when the input pays for it
    ray_address: str | None = None  # run the map step as Ray tasks ("" a local cluster)
    exclude: tuple[str, ...] = ()  # --exclude GLOB, repeated: files not to read
    log_model: str | None = None  # only the rows naming this logged model (kvtune.profile.logged_model)

    def ingest(self) -> IngestOptions:
        """The ingest options (`kvtune profile`'s); the process is about to read logs, so malloc is tuned for it."""
        from kvtune.allocator import tune_for_streaming  # ctypes: only to read logs
        from kvtune.ingest.window import Window  # numpy: only to read logs

        try:
            window = Window.parse(self.since, self.until)
        except ValueError as exc:  # LogArgs built without click
            raise click.BadParameter(str(exc)) from None
        except KvtuneError as exc:  # since not before until
            raise click.BadParameter(exc.message, param_hint=f"'{exc.field}'") from None
        tune_for_streaming()
        return IngestOptions(format=self.format_, fields=parse_fields(self.fields), route_by=self.route_by,
                             tokenizer=self.tokenizer, on_error=OnError(self.on_error), strict=self.strict,
                             assume_cap=self.assume_cap, window=window, exclude=self.exclude,
                             log_model=self.log_model)

    def reading(self) -> LogReading:
        """How to read the logs, as kvtune.api takes it (--since/--until checked here: click's
        one line); the process is about to read logs, so malloc is tuned for it."""
        from kvtune.allocator import tune_for_streaming  # ctypes: only to read logs
        from kvtune.ingest.window import Window  # numpy: only to read logs

        try:
            Window.parse(self.since, self.until)
        except KvtuneError as exc:  # since not before until
            raise click.BadParameter(exc.message, param_hint=f"'{exc.field}'") from None
        tune_for_streaming()
        return LogReading(format=self.format_, fields=parse_fields(self.fields), route_by=self.route_by,
                          tokenizer=self.tokenizer, on_error=self.on_error, strict=self.strict,
                          assume_cap=self.assume_cap, max_routes=self.max_routes, exclude=self.exclude,
                          since=self.since, until=self.until, log_model=self.log_model)

    def traffic_profile(self, logs: tuple[str, ...], profile_path: str | None):  # -> kvtune.profile.routes.Profile
        """The profile `bench` and `simulate` draw requests from: a saved one (--profile), else LOGS
        read; of one logged model; a fold beyond --max-routes and the files left out said on stderr."""
        from kvtune.cli._profile_view import render_folded, render_skipped_files  # numpy: only to read traffic

        reading = self.reading()  # --since/--until checked, as for logs
        profile = (api.load_profile(profile_path, max_routes=self.max_routes) if profile_path
                   else api.profile_logs(logs, reading, workers=self.workers, ray_address=self.ray_address))
        self.logged_model(profile)  # one model's traffic: several without --log-model is an error
        render_folded(profile, self.max_routes)
        render_skipped_files(profile)
        return profile

    def profile(self, paths: tuple[str, ...]):  # -> kvtune.profile.routes.Profile
        """Logs (or one saved profile) profiled, of one logged model (`logged_model`); a fold beyond
        --max-routes is said on stderr."""
        from kvtune.cli._profile_view import render_folded, render_skipped_files  # numpy: only to read logs

        self.window_for_logs([p for p in paths if api.is_saved_profile(p)])
        profile = api.profile_logs(paths, self.reading(), workers=self.workers, ray_address=self.ray_address)
        self.logged_model(profile)
        render_folded(profile, self.max_routes)
        render_skipped_files(profile)
        return profile

    def logged_model(self, profile) -> str | None:  # profile: kvtune.profile.routes.Profile
        """The one model the profile's rows name (None: none names one); several without
        --log-model, or a --log-model no row names, are one error line."""
        return one_logged_model(profile.models, profile.log_model, self.log_model)

    def window_for_logs(self, saved: list[str]) -> None:
        """--since/--until filter log rows: a saved profile has none left to filter, so it is refused."""
        if saved and (self.since is not None or self.until is not None):
            raise OptionError("--since/--until filter log rows; a saved profile holds only histograms (profile the "
                              "logs with the window instead)", path=saved[0],
                              field="--since" if self.since is not None else "--until")


#: Where bench and simulate draw their traffic from, besides LOGS: the same words for both.
traffic_source_options = compose([
    click.option("--profile", "profile_path", metavar="FILE",
                 help="A profile saved by `kvtune profile --save` instead of LOGS."),
    click.option("--route", "routes", multiple=True, metavar="NAME",
                 help="Only these routes (repeatable).  [default: all, by share]"),
])


def _instant(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """--since/--until: an ISO date or datetime, checked when the command line is parsed."""
    if value is None:
        return None
    from kvtune.ingest.window import parse_instant  # numpy: only when --since/--until is given

    try:
        parse_instant(value, "--" + str(param.name))
    except ValueError as exc:
        raise click.BadParameter(str(exc).replace(f" for --{param.name}", "")) from None
    return value


def _workers(ctx: click.Context, param: click.Parameter, value: str) -> int | None:
    """--workers: a count of at least 1, or auto (None)."""
    if value == "auto":
        return None
    try:
        count = int(value)
    except ValueError:
        raise click.BadParameter(f"expected a number or auto, got {value!r}") from None
    if count < 1:
        raise click.BadParameter(f"at least 1, got {count}")
    return count


def _ray_address(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    if value is None:
        return None
    from kvtune.profile.on_ray import check_address  # logging, numpy: only with --ray

    try:
        return check_address(value)
    except KvtuneError as exc:
        raise click.BadParameter(exc.message) from None


log_options = grouped("log", LogArgs, [
    click.option("--format", "format_", metavar="NAME", help=_format_help()),
    click.option("--field", "fields", multiple=True, metavar="TARGET=PATH",
                 help="Map a column from a source field, e.g. output_tokens=usage.completion_tokens. Repeatable."),
    click.option("--route-by", metavar="path|model|FIELD",
                 help="What names a route: the request path (default), the model, or a field."),
    click.option("--tokenizer", metavar="T",
                 help="tokenizer.json, model dir or hub id, to count tokens in logs that carry only text."),
    click.option("--on-error", type=click.Choice(["skip", "fail"]), default="skip", show_default=True,
                 help="Bad rows: count them under `skipped`, or stop at the first."),
    click.option("--strict", is_flag=True, help="Any skipped row is an error."),
    click.option("--assume-cap", type=click.IntRange(min=1), metavar="N",
                 help="Treat outputs ≥ N as cut at a cap (traces without finish reasons)."),
    click.option("--max-routes", type=click.IntRange(min=1), default=MAX_ROUTES, show_default=True, metavar="N",
                 help="Keep the N busiest routes and fold the rest into `*`, with a note saying how many: "
                      "thousands of routes mean ids in the route key (try --route-by), and bound memory."),
    click.option("--since", metavar="WHEN", callback=_instant,
                 help="Only requests at or after WHEN (ISO date or datetime, UTC unless it has an offset: "
                      "2026-11-30, 2026-11-30T12:00+02:00). Partitions dated wholly outside are not read."),
    click.option("--until", metavar="WHEN", callback=_instant,
                 help="Only requests before WHEN (exclusive; same forms as --since). A row without a "
                      "timestamp is a bad row while either is given."),
    click.option("--log-model", metavar="NAME",
                 help="Only the rows of this logged model (its id as the logs name it, any case). Logs that name "
                      "several models need it: one deployment serves one model. Rows naming no model are left out."),
    click.option("--workers", default="auto", show_default=True, metavar="N|auto", callback=_workers,
                 help="Processes that read and count the logs (a file or a run of Parquet row groups each), "
                      "merged exactly: the same output as one. auto: one per 2 cores once the input is 256 MiB."),
    click.option("--ray", "ray_address", is_flag=False, flag_value="", default=None, metavar="[ADDRESS]",
                 callback=_ray_address,
                 help="Read and count the logs as tasks on a Ray cluster (auto, HOST:PORT, ray://HOST:PORT; "
                      "none: a local one), merged exactly. Workers read the inputs themselves: give URLs. "
                      "pip install 'kvtune[ray]'."),
    click.option("--exclude", "exclude", multiple=True, metavar="GLOB",
                 help="Do not read the files matching GLOB (repeatable): matched against each file's path "
                      "relative to the directory or URL given (e.g. 'deploy/*', 'dt=2026-11-*/*.json'; * also "
                      "crosses /) and against its base name (e.g. '*.csv'). Files kvtune wrote "
                      "(recommendation.json, a saved profile, calibrate and bench outputs) are skipped anyway, by "
                      "their content, with a note."),
])


def parse_fields(pairs: tuple[str, ...]) -> dict[str, str]:
    """--field target=path pairs into a mapping; a malformed pair is a usage error."""
    fields: dict[str, str] = {}
    for pair in pairs:
        target, sep, path = pair.partition("=")
        if not sep or not target.strip() or not path.strip():
            raise click.BadParameter(f"expected target=path, got {pair!r}", param_hint="'--field'")
        fields[target.strip()] = path.strip()
    return fields
