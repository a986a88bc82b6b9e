"""`kvtune kv MODEL`: KV-cache bytes per token, by layer kind, under TP and PP."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import click

from kvtune import api
from kvtune.cli._vocabulary import SectionedCommand, model_argument, quiet_option
from kvtune.domain.deployment import Deployment

if TYPE_CHECKING:
    from kvtune.kv import KvBytes


@click.command(cls=SectionedCommand)
@quiet_option()
@model_argument("config.json, model directory, preset name or hub id")
@click.option("--tp", "tp", type=click.IntRange(min=1), default=1, show_default=True, help="Tensor-parallel size.")
@click.option("--pp", "pp", type=click.IntRange(min=1), default=1, show_default=True, help="Pipeline-parallel size.")
@click.option(
    "--kv-cache-dtype",
    default="auto",
    show_default=True,
    help="vLLM's --kv-cache-dtype: auto (the model's dtype), bfloat16, float16, fp8, fp8_e4m3, fp8_e5m2, …",
)
@click.option("--json", "json_", is_flag=True, help="Print one JSON object instead of a table.")
def kv(model: str, tp: int, pp: int, kv_cache_dtype: str, json_: bool) -> None:
    """KV-cache bytes per token for MODEL (config.json, model dir, preset or hub id).

    \b
    Example:
        kvtune kv llama-3.1-70b --tp 4 --kv-cache-dtype fp8
    """
    result = api.kv_bytes(Deployment(model, tp=tp, pp=pp, kv_cache_dtype=kv_cache_dtype))
    if json_:
        click.echo(json.dumps(result.to_dict()))
    else:
        _print_table(result)


def _print_table(result: KvBytes) -> None:
    """A rich table for people; rich is imported only here so `--json` stays fast."""
    from rich.table import Table

    from kvtune.cli._console import output_console  # rich: only for the table

    title = (f"{result.model}: {result.attention.upper()}, {result.num_kv_heads} KV heads × "
             f"head_dim {result.head_dim}, kv-cache dtype {result.kv_cache_dtype} "
             f"({result.bytes_per_element} B/element)")
    table = Table(title=title, title_justify="left")
    table.add_column("layers")
    table.add_column("count", justify="right")
    table.add_column("window", justify="right")
    table.add_column("bytes/token", justify="right")
    table.add_column("KiB/token", justify="right")
    for layer in result.layers:
        table.add_row(layer.kind.value, str(layer.count), "" if layer.window is None else f"{layer.window:,}",
                      f"{layer.kv_bytes_per_token:,}", f"{layer.kv_bytes_per_token / 1024:,.2f}")
    table.add_row("total", str(sum(layer.count for layer in result.layers)), "", f"{result.kv_bytes_per_token:,}",
                  f"{result.kv_kib_per_token:,.2f}", style="bold")
    console = output_console()
    console.print(table)
    per_gpu = result.kv_bytes_per_token_per_gpu
    console.print(
        f"Per GPU (TP {result.tensor_parallel_size} × PP {result.pipeline_parallel_size}, "
        f"{result.num_kv_heads_per_gpu} KV head(s) per GPU, stages of {list(result.stage_layers)} layers): "
        f"{per_gpu:,} bytes/token ({per_gpu / 1024:,.2f} KiB) on the fullest GPU",
        highlight=False,
    )
    if result.state_bytes_per_sequence:
        console.print(
            f"State per sequence (Mamba/linear layers, independent of length): "
            f"{result.state_bytes_per_sequence:,} bytes ({result.state_bytes_per_sequence / 2**20:,.2f} MiB); "
            f"{result.state_bytes_per_sequence_per_gpu:,} bytes on the fullest GPU",
            highlight=False,
        )
    if any(layer.window for layer in result.layers):
        console.print("Windowed layers are counted for every token here; with vLLM's hybrid KV cache manager "
                      "they hold only about window + one batch of tokens per request.", highlight=False)
