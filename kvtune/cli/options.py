"""Options shared by several commands, each group one decorator, and the code that reads them.

`capacity_options` + `plan_from_options` serve `capacity`, `recommend` and `check`;
`log_options` + `ingest_options_from` serve `profile`, `recommend`, `check` and `bench`
(`--max-routes` goes to the profiler, not to ingest: `opts["max_routes"]`).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import click

from kvtune.engines import vllm
from kvtune.errors import KvtuneError

_COUNT = re.compile(r"(?P<num>\d+(?:\.\d+)?)(?P<suffix>[kKmMgG]?)")
#: kvtune.profile.build.MAX_ROUTES, written out so that `--help` does not import numpy (a test ties them)
MAX_ROUTES = 2000
MAX_COUNT = 2**53  # counts above this are typos; floats hold every integer up to here exactly
_SUFFIX = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "K": 2**10, "M": 2**20, "G": 2**30}


def parse_count(text: str | None, field: str) -> int | None:
    """A positive integer, also in vLLM's forms: 8k = 8,000, 8K = 8,192, 25.6k = 25,600."""
    if text is None:
        return None
    shown = repr(text) if len(repr(text)) <= 44 else repr(text)[:40] + "...'"
    m = _COUNT.fullmatch(text.strip().replace(",", "").replace("_", ""))
    if m is None:
        raise KvtuneError(f"expected a positive integer such as 8192, 8k or 8K, got {shown}", field=field)
    value = float(m["num"]) * _SUFFIX[m["suffix"]]
    if value > MAX_COUNT:
        raise KvtuneError(f"{shown} is beyond any token or block count (at most 2^53)", field=field)
    if not value.is_integer() or value < 1:
        raise KvtuneError(f"expected a positive integer, got {shown}", field=field)
    return int(value)


def compose(decorators: list[Callable]) -> Callable:
    """Many click decorators as one, applied in the order listed."""
    def wrap(f: Callable) -> Callable:
        for decorator in reversed(decorators):
            f = decorator(f)
        return f

    return wrap


capacity_options = compose([
    click.option("--gpu", help="GPU model from the catalog: A10G, L4, L40S, A100-40GB, A100-80GB, H100-80GB, "
                 "H200, B200, MI300X, RTX-3090, RTX-4090 (any case; h100, a100 … work)."),
    click.option("--gpu-memory", help="Memory per GPU instead of --gpu, with a unit: 79.2GiB, 80GB, 24576MiB."),
    click.option("--tp", type=click.IntRange(min=1), default=1, show_default=True, help="Tensor-parallel size."),
    click.option("--pp", type=click.IntRange(min=1), default=1, show_default=True, help="Pipeline-parallel size."),
    click.option("--gpu-memory-utilization", type=click.FloatRange(min=0, max=1, min_open=True),
                 default=vllm.GPU_MEMORY_UTILIZATION, show_default=True,
                 help="vLLM's fraction of each GPU's memory for this instance."),
    click.option("--max-model-len", help="Context length; default the model's derived length (or the log's)."),
    click.option("--max-num-batched-tokens", help="Token budget per step; default vllm serve's for the GPU size."),
    click.option("--block-size", type=click.IntRange(min=1), default=None,
                 help="KV block size in tokens.  [default: 16; 128 for a CPU server's log]"),
    click.option("--kv-cache-dtype", default="auto", show_default=True,
                 help="vLLM's --kv-cache-dtype: auto, bfloat16, float16, fp8, fp8_e4m3, fp8_e5m2, …"),
    click.option("--enforce-eager", is_flag=True, help="No CUDA graphs: do not reserve memory for them."),
    click.option("--kv-tokens", help="Measured KV capacity in tokens (e.g. from vLLM's startup line)."),
    click.option("--vllm-log", help="A vLLM startup log to read the measured capacity from."),
    click.option("--metrics-url", help="A running vLLM's URL (root or /metrics) to read the measured capacity from."),
    click.option("--capacity", "capacity_file", help="A capacity file written by `kvtune calibrate`."),
])


@dataclass(frozen=True, slots=True)
class Planned:
    """A model, its KV cost and its capacity on the chosen hardware, as options described them."""

    spec: Any  # kvtune.model.ModelSpec
    kv: Any  # kvtune.kv.KvBytes
    report: Any  # kvtune.capacity.CapacityReport
    gpu_name: str | None
    gpu_memory_bytes: int | None


def plan_from_options(model: str, opts: dict[str, Any], shapes: tuple = (),
                      max_model_len_override: int | None = None) -> Planned:
    """Resolve the model and hardware, take a measured capacity when one is given, plan capacity."""
    from kvtune.capacity.measured import CapacitySource, MeasuredCapacity
    from kvtune.capacity.plan import plan_capacity
    from kvtune.hardware import find_gpu, parse_memory_size
    from kvtune.kv import kv_bytes
    from kvtune.model import resolve_model
    from kvtune.weights import weights_for

    gpu, gpu_memory = opts.get("gpu"), opts.get("gpu_memory")
    if gpu and gpu_memory:
        raise KvtuneError("give --gpu or --gpu-memory, not both", field="--gpu-memory")
    sources = [(name, opts.get(key)) for name, key in (
        ("--kv-tokens", "kv_tokens"), ("--vllm-log", "vllm_log"),
        ("--metrics-url", "metrics_url"), ("--capacity", "capacity_file"))]
    given = [name for name, value in sources if value is not None]
    if len(given) > 1:
        raise KvtuneError(f"give one measured capacity, not {' and '.join(given)}", field=given[1])

    gpu_name = memory_bytes = None
    if gpu:
        found = find_gpu(gpu)
        gpu_name, memory_bytes = found.name, found.memory_bytes
    elif gpu_memory:
        memory_bytes = parse_memory_size(gpu_memory, field="--gpu-memory")

    measured = None
    if opts.get("kv_tokens") is not None:
        measured = MeasuredCapacity(source=CapacitySource.KV_TOKENS, origin="--kv-tokens",
                                    kv_cache_tokens=parse_count(opts["kv_tokens"], "--kv-tokens"))
    elif opts.get("vllm_log") is not None:
        from kvtune.capacity.measured import read_vllm_log

        measured = read_vllm_log(opts["vllm_log"])
    elif opts.get("metrics_url") is not None:
        import asyncio

        from kvtune.capacity.measured import fetch_capacity

        measured = asyncio.run(fetch_capacity(opts["metrics_url"], field="--metrics-url"))
    elif opts.get("capacity_file") is not None:
        from kvtune.capacity.measured import read_capacity_file

        measured = read_capacity_file(opts["capacity_file"])

    spec = resolve_model(model)
    kv = kv_bytes(spec, kv_cache_dtype=opts.get("kv_cache_dtype", "auto"), tp=opts.get("tp", 1),
                  pp=opts.get("pp", 1))
    max_len = max_model_len_override or parse_count(opts.get("max_model_len"), "--max-model-len")
    report = plan_capacity(
        spec, kv, weights_for(spec),
        gpu_name=gpu_name,
        gpu_memory_bytes=memory_bytes,
        gpu_memory_utilization=opts.get("gpu_memory_utilization", vllm.GPU_MEMORY_UTILIZATION),
        max_model_len=max_len,
        max_num_batched_tokens=parse_count(opts.get("max_num_batched_tokens"), "--max-num-batched-tokens"),
        block_size=opts.get("block_size"),
        shapes=shapes,
        measured=measured,
        enforce_eager=opts.get("enforce_eager", False),
    )
    return Planned(spec, kv, report, gpu_name, memory_bytes)


def _format_help() -> str:
    from kvtune.ingest import FORMATS

    return "Force a log format instead of detecting it: " + ", ".join(FORMATS) + "."


log_options = compose([
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


def ingest_options_from(opts: dict[str, Any]):
    """An IngestOptions from the values of `log_options`; the process is about to read logs, so
    malloc is tuned for it (kvtune.allocator)."""
    from kvtune.allocator import tune_for_streaming
    from kvtune.ingest import IngestOptions

    tune_for_streaming()

    return IngestOptions(
        format=opts.get("format_"),
        fields=parse_fields(opts.get("fields") or ()),
        route_by=opts.get("route_by"),
        tokenizer=opts.get("tokenizer"),
        on_error=opts.get("on_error", "skip"),
        strict=opts.get("strict", False),
        assume_cap=opts.get("assume_cap"),
    )
