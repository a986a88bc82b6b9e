"""`kvtune capacity MODEL`: how many tokens, blocks and requests fit on given GPUs."""

from __future__ import annotations

import json
import re

import click

from kvtune.errors import KvtuneError

_COUNT = re.compile(r"(?P<num>\d+(?:\.\d+)?)(?P<suffix>[kKmMgG]?)")
_SUFFIX = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "K": 2**10, "M": 2**20, "G": 2**30}


def _parse_count(text: str | None, field: str) -> int | None:
    """A positive integer, also in vLLM's forms: 8k = 8,000, 8K = 8,192, 25.6k = 25,600."""
    if text is None:
        return None
    m = _COUNT.fullmatch(text.strip().replace(",", "").replace("_", ""))
    if m is None:
        raise KvtuneError(f"expected a positive integer such as 8192, 8k or 8K, got {text!r}", field=field)
    value = float(m["num"]) * _SUFFIX[m["suffix"]]
    if not value.is_integer() or value < 1:
        raise KvtuneError(f"expected a positive integer, got {text!r}", field=field)
    return int(value)


def _shapes(prompt_tokens: tuple[int, ...], max_tokens: tuple[int, ...]):
    """Pair the i-th --prompt-tokens with the i-th --max-tokens; a single value pairs with all."""
    from kvtune.capacity import RequestShape

    if not prompt_tokens and not max_tokens:
        return ()
    if not prompt_tokens or not max_tokens:
        missing = "--prompt-tokens" if not prompt_tokens else "--max-tokens"
        raise KvtuneError("a request shape needs both --prompt-tokens and --max-tokens", field=missing)
    if len(prompt_tokens) == 1:
        prompt_tokens = prompt_tokens * len(max_tokens)
    if len(max_tokens) == 1:
        max_tokens = max_tokens * len(prompt_tokens)
    if len(prompt_tokens) != len(max_tokens):
        raise KvtuneError(
            f"{len(prompt_tokens)} --prompt-tokens but {len(max_tokens)} --max-tokens; give them in pairs "
            "(or one value to pair with all of the other)",
            field="--max-tokens",
        )
    return tuple(RequestShape(p, m) for p, m in zip(prompt_tokens, max_tokens, strict=True))


@click.command()
@click.argument("model")
@click.option("--gpu", help="GPU model from the catalog: A10G, L4, L40S, A100-40GB, A100-80GB, H100-80GB, "
              "H200, B200, MI300X, RTX-3090, RTX-4090 (any case; h100, a100 … work).")
@click.option("--gpu-memory", help="Memory per GPU instead of --gpu, with a unit: 79.2GiB, 80GB, 24576MiB.")
@click.option("--tp", type=click.IntRange(min=1), default=1, show_default=True, help="Tensor-parallel size.")
@click.option("--pp", type=click.IntRange(min=1), default=1, show_default=True, help="Pipeline-parallel size.")
@click.option("--gpu-memory-utilization", type=click.FloatRange(min=0, max=1, min_open=True), default=0.92,
              show_default=True, help="vLLM's fraction of each GPU's memory for this instance.")
@click.option("--max-model-len", help="Context length; default the model's derived length (or the log's).")
@click.option("--max-num-batched-tokens", help="Token budget per step; default vllm serve's for the GPU size.")
@click.option("--block-size", type=click.IntRange(min=1), default=None,
              help="KV block size in tokens.  [default: 16; 128 for a CPU server's log]")
@click.option("--kv-cache-dtype", default="auto", show_default=True,
              help="vLLM's --kv-cache-dtype: auto, bfloat16, float16, fp8, fp8_e4m3, fp8_e5m2, …")
@click.option("--enforce-eager", is_flag=True, help="No CUDA graphs: do not reserve memory for them.")
@click.option("--prompt-tokens", "prompt_tokens", type=click.IntRange(min=1), multiple=True,
              help="Prompt length of a request shape; repeat, paired in order with --max-tokens.")
@click.option("--max-tokens", "max_tokens", type=click.IntRange(min=1), multiple=True,
              help="Output cap of a request shape; repeat, paired in order with --prompt-tokens.")
@click.option("--kv-tokens", help="Measured KV capacity in tokens (e.g. from vLLM's startup line).")
@click.option("--vllm-log", help="A vLLM startup log to read the measured capacity from.")
@click.option("--metrics-url", help="A running vLLM's /metrics URL to read the measured capacity from.")
@click.option("--json", "json_", is_flag=True, help="Print one JSON object instead of tables.")
def capacity(
    model: str,
    gpu: str | None,
    gpu_memory: str | None,
    tp: int,
    pp: int,
    gpu_memory_utilization: float,
    max_model_len: str | None,
    max_num_batched_tokens: str | None,
    block_size: int | None,
    kv_cache_dtype: str,
    enforce_eager: bool,
    prompt_tokens: tuple[int, ...],
    max_tokens: tuple[int, ...],
    kv_tokens: str | None,
    vllm_log: str | None,
    metrics_url: str | None,
    json_: bool,
) -> None:
    """How many tokens, blocks and requests of given shapes fit for MODEL on given GPUs.

    Each request shape reserves ceil((prompt + max_tokens) / block size) blocks, as an
    admitting gateway must. A measured capacity (--kv-tokens, --vllm-log, --metrics-url)
    replaces the memory estimate; the output names the source used.

    \b
    Example:
        kvtune capacity llama-3.1-8b --gpu H100-80GB \\
          --prompt-tokens 2000 --max-tokens 512 --prompt-tokens 200 --max-tokens 4000
    """
    from kvtune.capacity import CapacitySource, MeasuredCapacity, plan_capacity
    from kvtune.hardware import find_gpu, parse_memory_size
    from kvtune.kv import kv_bytes
    from kvtune.model import resolve_model
    from kvtune.weights import weights_for

    if gpu and gpu_memory:
        raise KvtuneError("give --gpu or --gpu-memory, not both", field="--gpu-memory")
    measured_options = [name for name, value in
                        (("--kv-tokens", kv_tokens), ("--vllm-log", vllm_log), ("--metrics-url", metrics_url))
                        if value is not None]
    if len(measured_options) > 1:
        raise KvtuneError(f"give one measured capacity, not {' and '.join(measured_options)}",
                          field=measured_options[1])
    gpu_name = memory_bytes = None
    if gpu:
        found = find_gpu(gpu)
        gpu_name, memory_bytes = found.name, found.memory_bytes
    elif gpu_memory:
        memory_bytes = parse_memory_size(gpu_memory, field="--gpu-memory")
    shapes = _shapes(prompt_tokens, max_tokens)
    max_len = _parse_count(max_model_len, "--max-model-len")
    batched = _parse_count(max_num_batched_tokens, "--max-num-batched-tokens")

    measured = None
    if kv_tokens is not None:
        measured = MeasuredCapacity(source=CapacitySource.KV_TOKENS,
                                    kv_cache_tokens=_parse_count(kv_tokens, "--kv-tokens"), origin="--kv-tokens")
    elif vllm_log is not None:
        from kvtune.engine_capacity import read_vllm_log

        measured = read_vllm_log(vllm_log)
    elif metrics_url is not None:
        from kvtune.engine_capacity import fetch_metrics

        measured = fetch_metrics(metrics_url)

    spec = resolve_model(model)
    report = plan_capacity(
        spec,
        kv_bytes(spec, kv_cache_dtype=kv_cache_dtype, tp=tp, pp=pp),
        weights_for(spec),
        gpu_name=gpu_name,
        gpu_memory_bytes=memory_bytes,
        gpu_memory_utilization=gpu_memory_utilization,
        max_model_len=max_len,
        max_num_batched_tokens=batched,
        block_size=block_size,
        shapes=shapes,
        measured=measured,
        enforce_eager=enforce_eager,
    )
    if json_:
        click.echo(json.dumps(report.to_dict()))
    else:
        _print_report(report)


def _gib(n: int | None) -> str:
    return "—" if n is None else f"{n / 2**30:,.2f} GiB"


def _print_report(report) -> None:
    """Rich tables for people; rich is imported only here so `--json` stays fast."""
    from rich.console import Console
    from rich.table import Table

    c = report.capacity
    console = Console()
    where = report.gpu or (_gib(report.gpu_memory_bytes) if report.gpu_memory_bytes else "measured server")
    par = f"TP {report.tensor_parallel_size} × PP {report.pipeline_parallel_size}"
    source = c.source.value + (f" ({c.measured.origin})" if c.measured and c.measured.origin else "")

    if c.memory is not None:
        m = c.memory
        mem = Table(title=f"{report.model} on {where}, {par}: memory per GPU (estimate)", title_justify="left")
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
