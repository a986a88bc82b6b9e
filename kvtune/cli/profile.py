"""`kvtune profile PATH...`: per-route output and prompt length distributions from logs."""

from __future__ import annotations

import json
import sys

import click

from kvtune import api
from kvtune.cli._vocabulary import SectionedCommand, quiet_option
from kvtune.cli.options import LogArgs, log_options
from kvtune.errors import InputError

JSON_FIELDS = """\b
--json prints one object:
  requests        rows profiled (all routes)
  routes[]        one per route, sorted by name:
    route, requests
    censored        {count, share}: responses cut at their cap (finish_reason length, …)
    output_tokens   {p50, p90, p95, p99, p999, max, mean, lower_bound: {p50: bool, …}}
                    Kaplan–Meier when censored; lower_bound = the true value may be higher
    prompt_tokens   same keys (never censored); null when no prompt lengths were logged
    total_tokens    prompt + output, same keys; null without prompt lengths
    tail            {class: light|heavy, rule, p99_over_p50, p999_over_p99, lower_bound}
    max_tokens_requested  percentiles of the requested max_tokens, or null
    finish_reasons, models   {name: count}
    arrival         {requests, first_s, last_s, duration_s, mean_rate_rps,
                     peak_window_s, peak_window_requests, peak_rate_rps, peak_1s_requests} or null
    latency_ms, ttft_ms   {requests, p50, p90, p95, p99, p999, max} (±1%) or null
  skipped         {count, reasons: {reason: rows}, examples: {reason: first location}}
  inputs[]        {path, format, rows}: each log file (format detected) or saved profile
  folded          {routes, requests, into: "*"}: routes beyond --max-routes (the least busy)
                  and their requests, summed into the route `*`
  window          with --since/--until only: {since, until (ISO UTC or null), pruned_files
                  (not read: partition date outside), outside_rows (timestamp outside)}
  skipped_files[] {path, reason}: files not read: kvtune's own outputs (a recommendation.json,
                  a saved profile …, told by content) and those --exclude matched
  notes[]         what to know about the inputs beside the numbers (the files not read)
  models          {logged model id: rows} over every route (rows naming none not counted)
  log_model       with --log-model only: {name, left_out: {model: rows} (other models'
                  rows), unnamed_rows (rows naming no model)}
"""


@click.command(cls=SectionedCommand, epilog=JSON_FIELDS)
@quiet_option(passed=True)
@click.argument("paths", nargs=-1, required=True, metavar="PATH...")
@log_options
@click.option("--trace-max-is-cap", is_flag=True,
              help="Treat the largest output in the input as a cap (reads the input twice).")
@click.option("--save", "save_path", type=click.Path(), metavar="FILE",
              help="Write the profile (histograms, mergeable) to FILE as JSON.")
@click.option("--merge", is_flag=True, help="PATHs may be saved profiles: merge them exactly (with any logs given).")
@click.option("--json", "json_", is_flag=True, help="Print one JSON object (fields below) instead of tables.")
def profile(paths: tuple[str, ...], log: LogArgs, trace_max_is_cap: bool, save_path: str | None, merge: bool,
            json_: bool, quiet: bool) -> None:
    """Per-route output and prompt length distributions from request logs.

    PATH: files, directories or globs of JSONL, CSV or Parquet (.gz, .zst), any mix of schemas;
    or URLs of them (s3://, gs://, az://, abfs://, hf://, https://: read by ranges through
    fsspec; the stores' packages: pip install 'kvtune[remote]').

    \b
    Example:
        kvtune profile sample_logs/openai_chat_pairs.jsonl
        kvtune profile logs/ --save week1.json --json
        kvtune profile 's3://my-logs/2026-11-*/*.parquet' --json
        kvtune profile --merge week1.json week2.json
    """
    from kvtune.cli._profile_view import (
        progress_bar,
        render_folded,
        render_models,
        render_profile,
        render_skipped,
        render_skipped_files,
        render_window,
    )  # numpy: only once profile runs, not for --help

    strict = log.strict
    if log.assume_cap is not None and trace_max_is_cap:
        raise click.UsageError("--assume-cap and --trace-max-is-cap exclude each other")
    saved = [p for p in paths if api.is_saved_profile(p)]
    log.window_for_logs(saved)
    if saved and not merge:
        raise InputError("this is a saved profile; pass --merge to combine saved profiles", path=saved[0])
    logs = [p for p in paths if p not in saved]
    parts = [api.load_profile(p) for p in saved]
    if logs:
        reading = log.reading()
        with progress_bar(enabled=not quiet and sys.stderr.isatty()) as progress:
            parts.append(api.profile_logs(logs, reading, progress=progress, workers=log.workers,
                                          ray_address=log.ray_address, trace_max_is_cap=trace_max_is_cap))
    result = api.merge_profiles(parts, max_routes=log.max_routes)
    if strict and result.skipped_rows:  # from merged saved profiles; ingest already fails on its own
        reason, count = next(iter(result.skipped.items()))
        raise InputError(f"--strict: {count} row(s) skipped ({reason}) in the merged profiles")
    if log.log_model is not None:  # a NAME no row names is an error; several models are shown, not refused
        log.logged_model(result)
    if save_path:
        api.save_profile(result, save_path)
    if json_:
        click.echo(json.dumps(result.summary_dict()))
    else:
        render_profile(result)
        render_skipped(result)
        render_window(result)
    render_models(result)
    render_folded(result, log.max_routes)
    render_skipped_files(result)
    if save_path and not json_:
        click.echo(f"saved profile to {save_path}", err=True)
