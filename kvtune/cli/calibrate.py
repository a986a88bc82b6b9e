"""`kvtune calibrate URL`: the KV capacity a running vLLM really has, saved for `recommend --capacity`."""

from __future__ import annotations

import asyncio
import json

import click

from kvtune import api
from kvtune.cli._vocabulary import SectionedCommand, quiet_option, renamed
from kvtune.engines import ENGINE_NAMES, ENGINE_TITLES
from kvtune.errors import OptionError

DEFAULT_TIMING_BUDGET_S = 300.0  # kvtune.bench.timing.DEFAULT_BUDGET_S (a test ties them)


@click.command(cls=SectionedCommand)
@quiet_option()
@renamed("--out", "--save", "out", type=click.Path(), metavar="FILE")
@click.argument("url", required=False)
@click.option("--save", "out", type=click.Path(), metavar="FILE",
              help="Write the capacity file here (atomically), for `kvtune recommend --capacity FILE`.")
@click.option("--json", "json_", is_flag=True, help="Print the capacity as one JSON object instead of a table.")
@click.option("--engine", type=click.Choice(ENGINE_NAMES), default="vllm", show_default=True,
              help="The server's engine: vLLM (/v1/models + /metrics), SGLang (/server_info, /v1/models, /metrics) "
                   "or TensorRT-LLM (no endpoint states its capacity at startup: give --engine-log).")
@click.option("--engine-log", "engine_log", type=click.Path(),
              help="The server's startup log: calibrate from it alone, or cross-check URL against it.")
@click.option("--vllm-log", "vllm_log", type=click.Path(),
              help="A vLLM server's startup log (the same as --engine-log with --engine vllm).")
@click.option("--timeout", "timeout_s", type=click.FloatRange(min=0, min_open=True), default=10.0,
              show_default=True, help="Seconds to wait for each of the server's answers.")
@click.option("--timing", is_flag=True,
              help="Also measure the engine's step time (overhead, prefill, load and decode sweeps against URL) "
                   "and fit T_step = c0 + c1·Σn + c2·Σn·(ctx + n/2) + c3·batch into the file's `timing` object, "
                   "with the API server's serial work per request and per streamed token (`frontend`).")
@click.option("--timing-budget-s", "timing_budget_s", type=click.FloatRange(min=5), default=DEFAULT_TIMING_BUDGET_S,
              show_default=True, help="Seconds the --timing sweeps may take in all.")
@click.option("--max-num-batched-tokens", "max_num_batched_tokens", type=click.IntRange(min=1),
              help="The server's --max-num-batched-tokens, for --timing's prefill chunks; default: read from "
                   "--vllm-log or the server, else vLLM's default (2048 on CPU and GPUs under 70 GiB).")
def calibrate(url: str | None, out: str | None, json_: bool, engine: str, engine_log: str | None,
              vllm_log: str | None, timeout_s: float, timing: bool, timing_budget_s: float,
              max_num_batched_tokens: int | None) -> None:
    """Read the real KV capacity of a running vLLM (/v1/models, /metrics), SGLang or startup log.

    URL is the server's root or its /metrics. The result (blocks, block size, tokens,
    max_model_len, cache dtype, prefix caching) replaces kvtune's memory estimate when
    passed to `kvtune recommend --capacity FILE`. With --timing it also sends bounded
    sweeps of requests and writes the fitted step-time model (`timing`: coefficients c0..c3
    in seconds with units, HTTP overhead, frontend {request_s, token_s, units}: the API
    server's serial work, sweep ranges, the fit's error per sweep, the server settings it
    was measured against, kvtune_version) that `kvtune simulate` uses. --engine sglang reads
    /server_info instead; --engine trtllm reads a startup log (--engine-log).

    \b
    Example:
        kvtune calibrate http://127.0.0.1:8000 --save capacity.json
        kvtune calibrate http://127.0.0.1:30000 --engine sglang --save capacity.json
        kvtune calibrate --engine trtllm --engine-log trtllm-serve.log --save capacity.json
        kvtune recommend logs.jsonl --model meta-llama/Llama-3.1-8B --capacity capacity.json
        kvtune calibrate http://127.0.0.1:8000 --timing --timing-budget-s 120 --save capacity.json
    """
    if vllm_log is not None:
        if engine_log is not None:
            raise OptionError("give the startup log once, as --engine-log", field="--vllm-log")
        if engine != "vllm":
            raise OptionError(f"is for a vLLM log; give the {engine} log as --engine-log", field="--vllm-log")
    startup_log = vllm_log or engine_log
    progress = None
    if engine == "vllm" and timing and url is not None and not json_:
        from rich.console import Console

        from kvtune.cli._timing_view import RichTimingProgress  # rich: only for the live view

        progress = RichTimingProgress(Console(stderr=True, highlight=False))
    measured = asyncio.run(api.calibrate(
        url, engine, engine_log=startup_log, timeout_s=timeout_s, timing=timing,
        timing_budget_s=None if timing_budget_s == DEFAULT_TIMING_BUDGET_S else timing_budget_s,
        max_num_batched_tokens=max_num_batched_tokens, progress=progress))
    if out is not None:
        from kvtune.capacity.measured import write_capacity_file  # numpy: only once calibrate runs

        write_capacity_file(out, measured)
    if json_:
        click.echo(json.dumps(measured.to_dict()))
    else:
        _print_table(measured, out=out, cross_checked=url is not None and startup_log is not None)


def _fmt(value) -> str:
    if value is None:
        return "—"
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def _print_table(m, *, out: str | None, cross_checked: bool) -> None:
    """A small rich table for people; rich is imported only here so `--json` stays fast."""
    from rich.markup import escape
    from rich.table import Table

    from kvtune.cli._console import output_console  # rich: only for the table

    table = Table(title=f"KV capacity of {escape(m.model or 'the server')}", title_justify="left")
    table.add_column("field")
    table.add_column("value", justify="right")
    rows = [
        ("engine", ENGINE_TITLES[m.engine]),
        ("source", m.source.value),
        ("read from", m.origin),
        ("model", m.model),
        ("max_model_len", m.max_model_len),
        ("block_size", m.block_size),
        ("num_blocks", m.num_blocks),
        ("kv_cache_tokens", m.kv_cache_tokens),
        ("max concurrency at max_model_len", None if m.max_concurrency is None else f"{m.max_concurrency:g}x"),
        ("kv_cache_dtype", m.kv_cache_dtype),
        ("prefix caching", m.enable_prefix_caching),
        ("kv_cache_memory_bytes", m.kv_cache_memory_bytes),
        ({"sglang": "mem_fraction_static"}.get(m.engine, "gpu_memory_utilization"), m.gpu_memory_utilization),
        ("num_gpu_blocks_override", m.num_gpu_blocks_override),
    ]
    for name, value in rows:
        table.add_row(name, escape(_fmt(value)))
    console = output_console(highlight=False)
    console.print(table)
    if m.timing is not None:
        from kvtune.cli._timing_view import print_timing  # rich: only for the table

        print_timing(m.timing, console)
    if cross_checked:
        console.print("The startup log agrees with the server.", soft_wrap=True)
    if out is not None:
        console.print(f"Wrote {out}; use it with: kvtune recommend LOGS --model MODEL --capacity {out}",
                      soft_wrap=True, markup=False)
    else:
        console.print("Pass --save FILE to keep it for: kvtune recommend LOGS --model MODEL --capacity FILE",
                      soft_wrap=True)
