"""`kvtune recommend`: traffic + model + capacity → caps, KV budget, engine settings and deploy files."""

from __future__ import annotations

import json
from typing import Any

import click

from kvtune.cli.options import (
    capacity_options,
    compose,
    ingest_options_from,
    log_options,
    plan_from_options,
)
from kvtune.errors import KvtuneError
from kvtune.recommend.rules import CURRENT_VLLM_VERSION


def build_recommendation(paths: tuple[str, ...], model: str, opts: dict[str, Any]):
    """The whole pipeline behind `recommend` (and `check`): profile, plan capacity, apply the rules."""
    from kvtune.engines.vllm import default_batch_limits
    from kvtune.profile.build import load_profile_or_logs
    from kvtune.recommend.policy import RecommendOptions, recommend
    from kvtune.recommend.rules import parse_vllm_version

    try:
        parse_vllm_version(opts.get("vllm_version") or CURRENT_VLLM_VERSION)
    except ValueError as exc:
        raise KvtuneError(str(exc), field="--vllm-version") from None
    safety = opts.get("safety_fraction")
    if safety is not None and not 0 < safety <= 1:
        raise KvtuneError(f"must be in (0, 1], got {safety}", field="--safety-fraction")
    truncation = opts.get("max_truncation")
    if truncation is not None and not 0 <= truncation < 1:
        raise KvtuneError(f"must be in [0, 1), got {truncation}", field="--max-truncation")

    profile = load_profile_or_logs(list(paths), ingest_options_from(opts), max_routes=opts.get("max_routes"))
    from kvtune.cli._profile_view import render_folded

    render_folded(profile, opts.get("max_routes"))
    planned = plan_from_options(model, opts)
    capacity = planned.report.capacity
    engine_default = (default_batch_limits(planned.gpu_memory_bytes, planned.gpu_name)[0]
                      if planned.gpu_memory_bytes else 2048)
    options = RecommendOptions(
        safety_fraction=safety,
        max_truncation=truncation,
        vllm_version=opts.get("vllm_version") or CURRENT_VLLM_VERSION,
        upstream=opts.get("upstream") or "http://127.0.0.1:8000",
        route_by=opts.get("route_by") or "path",
        gpu=planned.gpu_name,
        gpu_memory_bytes=planned.gpu_memory_bytes,
        gpu_memory_utilization=opts.get("gpu_memory_utilization", 0.92),
        engine_default_batched_tokens=engine_default,
        served_model=opts.get("served_model") or planned.spec.serve_id or model,
        model_limit=capacity.max_model_len,
    )
    return recommend(profile, planned.kv, capacity, options, model=model)


def _gateway_tokenizer(given: str | None, candidates: tuple[str | None, ...]) -> str | None:
    """The model directory gateway.yaml counts prompts with (None: the upstream's /tokenize):
    the one given, else the first candidate that holds a tokenizer and a chat template."""
    from kvtune.deploy.render import local_chat_tokenizer

    if given == "upstream":
        return None
    if given is not None:
        found = local_chat_tokenizer(given)
        if found is None:
            raise KvtuneError(f"{given!r} is not a local model directory with tokenizer.json and a chat "
                              "template (tokenizer_config.json chat_template or chat_template.jinja); "
                              "pass `upstream` to count with vLLM's /tokenize", field="--gateway-tokenizer")
        return found
    return next(filter(None, map(local_chat_tokenizer, candidates)), None)


def _gate(files: dict[str, str], rec: dict) -> None:
    """Fail (exit 1, nothing written) when the rendered files would not pass `kvtune check`."""
    from kvtune.deploy.check import check_rendered

    result = check_rendered(files, rec)
    if result.passed:
        return
    for f in result.findings:
        if f.severity == "risk":
            click.echo(f"Error: the rendered {f.source} would fail `kvtune check`: {f.code}: {f.message}", err=True)
    click.echo("Error: nothing was written; this is a kvtune bug or a hostile log: please report it", err=True)
    click.get_current_context().exit(1)


recommend_options = compose([
    click.option("--model", "-m", "model", required=True,
                 help="config.json, model directory, preset name or hub id."),
    click.option("--served-model", help="What `vllm serve` loads (hub id or path).  [default: the model's hub id]"),
    click.option("--upstream", default="http://127.0.0.1:8000", show_default=True,
                 help="The vLLM the gateway configs point at."),
    click.option("--vllm-version", default=CURRENT_VLLM_VERSION, show_default=True,
                 help="Target vLLM release; 0.6 … 0.7 are V0-era (swap and --preemption-mode)."),
    click.option("--safety-fraction", type=float, help="Share of usable KV blocks the gateway may reserve.  [default: 0.9]"),
    click.option("--max-truncation", type=float,
                 help="Pick the smallest cap whose expected truncation share is ≤ F (e.g. 0.01) instead of p95/p99."),
])


@click.command()
@click.argument("logs", nargs=-1, required=True)
@recommend_options
@capacity_options
@log_options
@click.option("--gateway-tokenizer", metavar="DIR|upstream",
              help="Model directory (tokenizer.json + chat template) gateway.yaml counts prompts with, in "
                   "process; `upstream` counts with vLLM's /tokenize instead (one more round trip per "
                   "request).  [default: the --served-model, --model or --tokenizer directory that holds "
                   "both, else upstream]")
@click.option("--out", "out_dir", type=click.Path(), help="Write the deploy files into DIR (all of them, or none).")
@click.option("--json", "json_", is_flag=True, help="Print the recommendation and rendered files as one JSON object.")
def recommend(logs: tuple[str, ...], model: str, gateway_tokenizer: str | None, out_dir: str | None,
              json_: bool, **opts: Any) -> None:
    """Recommend output caps, a KV block budget and vLLM settings from real traffic.

    LOGS are log files, directories or globs (any format `kvtune profile` reads), or one
    profile saved with `kvtune profile --save`. Every number comes with the rule behind it.

    \b
    Example:
        kvtune recommend sample_logs/ --model llama-3.1-8b --gpu H100-80GB --out deploy/
    """
    from kvtune.deploy.render import RenderOptions, render_files, write_files

    counting_with = _gateway_tokenizer(gateway_tokenizer, (opts.get("served_model"), model, opts.get("tokenizer")))
    rec = build_recommendation(logs, model, opts)
    data = rec.to_dict()
    files = render_files(data, options=RenderOptions(gateway_tokenizer=counting_with))
    _gate(files, data)
    written = write_files(out_dir, files) if out_dir else []
    if json_:
        click.echo(json.dumps({"recommendation": data, "files": files}, indent=2))
        return
    from kvtune.cli._recommend_view import show_recommendation

    show_recommendation(data, [str(p) for p in written])
