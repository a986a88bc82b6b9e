"""`kvtune capacity MODEL`: how many tokens, blocks and requests fit on given GPUs."""

from __future__ import annotations

import json

import click

from kvtune import api
from kvtune.capacity.engine_memory import EngineMemory
from kvtune.capacity.reservation import RequestShape
from kvtune.cli._vocabulary import SectionedCommand, model_argument, quiet_option
from kvtune.cli.options import CapacityArgs, capacity_options
from kvtune.errors import OptionError


def _shapes(prompt_tokens: tuple[int, ...], max_tokens: tuple[int, ...]):
    """Pair the i-th --prompt-tokens with the i-th --max-tokens; a single value pairs with all."""
    if not prompt_tokens and not max_tokens:
        return ()
    if not prompt_tokens or not max_tokens:
        missing = "--prompt-tokens" if not prompt_tokens else "--max-tokens"
        raise OptionError("a request shape needs both --prompt-tokens and --max-tokens", field=missing)
    if len(prompt_tokens) == 1:
        prompt_tokens = prompt_tokens * len(max_tokens)
    if len(max_tokens) == 1:
        max_tokens = max_tokens * len(prompt_tokens)
    if len(prompt_tokens) != len(max_tokens):
        raise OptionError(
            f"{len(prompt_tokens)} --prompt-tokens but {len(max_tokens)} --max-tokens; give them in pairs "
            "(or one value to pair with all of the other)",
            field="--max-tokens",
        )
    return tuple(RequestShape(p, m) for p, m in zip(prompt_tokens, max_tokens, strict=True))


@click.command(cls=SectionedCommand)
@quiet_option()
@model_argument("config.json, model directory, preset name or hub id")
@capacity_options
@click.option("--prompt-tokens", "prompt_tokens", type=click.IntRange(min=1), multiple=True,
              help="Prompt length of a request shape; repeat, paired in order with --max-tokens.")
@click.option("--max-tokens", "max_tokens", type=click.IntRange(min=1), multiple=True,
              help="Output cap of a request shape; repeat, paired in order with --prompt-tokens.")
@click.option("--json", "json_", is_flag=True,
              help="Print one JSON object instead of tables: a capacity file, as `kvtune calibrate` writes one "
                   "(for --capacity FILE), with the report around it.")
def capacity(model: str, capacity: CapacityArgs, prompt_tokens: tuple[int, ...], max_tokens: tuple[int, ...],
             json_: bool) -> None:
    """How many tokens, blocks and requests of given shapes fit for MODEL on given GPUs.

    Each request shape reserves ceil((prompt + max_tokens) / block size) blocks, as an
    admitting gateway must. A measured capacity (--kv-tokens, --vllm-log, --engine-log,
    --metrics-url, --capacity) replaces the memory estimate; the output names the source used.
    --engine sglang|trtllm estimates with that engine's memory model instead of vLLM's.
    Exit 1 when one request at max_model_len (the engine would refuse to start, or serve a
    shorter context) or one of the asked shapes does not fit; --json says so in `fits` and `why`.

    \b
    Example:
        kvtune capacity llama-3.1-8b --gpu H100-80GB \\
          --prompt-tokens 2000 --max-tokens 512 --prompt-tokens 200 --max-tokens 4000
        kvtune capacity llama-3.1-8b --gpu H100-80GB --engine sglang
        kvtune capacity llama-3.1-8b --engine trtllm --engine-log trtllm-serve.log
    """
    shapes = _shapes(prompt_tokens, max_tokens)
    fit = api.capacity_fit(capacity.deployment(model), capacity.measurement(), shapes)
    verdict = fit.verdict
    if json_:  # the report around the capacity file's fields: a `--capacity FILE` for simulate and recommend
        click.echo(json.dumps(fit.to_dict()))
    else:
        _print_report(fit.report)
        if not verdict.fits:
            click.echo(f"Does not fit: {verdict.why}", err=True)
    if not verdict.fits:
        click.get_current_context().exit(1)


def _gib(n: int | None) -> str:
    return "—" if n is None else f"{n / 2**30:,.2f} GiB"


def _print_report(report) -> None:
    """Rich tables for people; rich is imported only here so `--json` stays fast."""
    from rich.table import Table

    from kvtune.cli._console import output_console  # rich: only for the tables

    c = report.capacity
    console = output_console()
    where = report.gpu or (_gib(report.gpu_memory_bytes) if report.gpu_memory_bytes else "measured server")
    par = f"TP {report.tensor_parallel_size} × PP {report.pipeline_parallel_size}"
    source = c.source.value + (f" ({c.measured.origin})" if c.measured and c.measured.origin else "")

    if isinstance(c.memory, EngineMemory):
        m = c.memory
        mem = Table(title=f"{report.model} on {where}, {par}: memory per GPU (estimate, {m.title}'s model)",
                    title_justify="left")
        mem.add_column("part")
        mem.add_column("GiB", justify="right")
        mem.add_column("how")
        for part, size, how in m.rows:
            mem.add_row(part, _gib(size), how)
        mem.add_row("= KV pool", _gib(m.kv_cache_bytes), "", style="bold")
        console.print(mem)
    elif c.memory is not None:
        m = c.memory
        mem = Table(title=f"{report.model} on {where}, {par}: memory per GPU (estimate) as vLLM "
                    f"{report.engine_version} profiles it", title_justify="left")
        mem.add_column("part")
        mem.add_column("GiB", justify="right")
        mem.add_column("how")
        mem.add_row("GPU memory", _gib(m.gpu_memory_bytes), "device total")
        mem.add_row(f"× utilization {m.gpu_memory_utilization}", _gib(m.requested_memory_bytes),
                    "what vLLM may use")
        mem.add_row("− weights", _gib(m.weights_bytes),
                    f"{report.weights_format}, {report.weights_source}")
        mem.add_row("− activation peak", _gib(m.overhead.activation_bytes),
                    f"profile run at max_num_batched_tokens {report.max_num_batched_tokens:,}")
        mem.add_row("− CUDA graphs", _gib(m.overhead.cuda_graph_bytes), "assumed")
        mem.add_row("− non-torch", _gib(m.overhead.non_torch_bytes), "assumed")
        mem.add_row("= KV pool", _gib(m.kv_cache_bytes), "", style="bold")
        console.print(mem)

    kv = Table(title=f"KV capacity per instance — source: {source}", title_justify="left")
    kv.add_column("quantity")
    kv.add_column("value", justify="right")
    if c.kv_bytes_per_token_per_gpu:
        kv.add_row("KV bytes / token / GPU", f"{c.kv_bytes_per_token_per_gpu:,} ({report.kv_cache_dtype})")
    kv.add_row("block size", f"{c.block_size} tokens")
    kv.add_row("blocks", f"{c.num_blocks:,}")
    if c.estimated_num_blocks is not None:
        diff = (c.estimated_num_blocks - c.num_blocks) / c.num_blocks if c.num_blocks else 0.0
        kv.add_row("blocks (memory estimate)", f"{c.estimated_num_blocks:,} ({diff:+.0%})")
    kv.add_row("tokens", f"{c.kv_cache_tokens:,}")
    if c.kv_cache_bytes is not None:
        kv.add_row("KV pool per GPU", _gib(c.kv_cache_bytes))
    kv.add_row(f"max concurrency at max_model_len {c.max_model_len:,}",
               f"{c.max_concurrency_at_max_model_len:,.2f}x")
    console.print(kv)

    if c.requests:
        req = Table(title=f"Requests reserved at prompt + max_tokens ({c.usable_blocks:,} usable blocks)",
                    title_justify="left")
        for name in ("prompt", "max_tokens", "reserved tokens", "reserved blocks", "max concurrent"):
            req.add_column(name, justify="right")
        req.add_column("note")
        for r in c.requests:
            req.add_row(f"{r.prompt_tokens:,}", f"{r.max_tokens:,}", f"{r.reserved_tokens:,}",
                        f"{r.reserved_blocks:,}", f"{r.max_concurrent:,}", r.note or "")
        console.print(req)

    for note in c.notes:
        console.print(f"Note: {note}", highlight=False)
    if c.memory is not None:
        console.print("Assumptions (the estimate; a measured capacity replaces it):", highlight=False)
        for a in report.assumptions:
            console.print(f"  - {a}", highlight=False)
