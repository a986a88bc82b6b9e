"""`kvtune bench URL [LOGS...]`: replay profiled traffic against a live server and judge it."""

from __future__ import annotations

import asyncio
import json
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import click

from kvtune import api
from kvtune.cli._vocabulary import SectionedCommand, quiet_option, renamed
from kvtune.cli.load_options import LoadArgs, load_options
from kvtune.cli.options import LogArgs, grouped, log_options, traffic_source_options
from kvtune.controls import escape_controls
from kvtune.domain.bench_target import BenchTarget, Expectations
from kvtune.domain.log_reading import LogReplay
from kvtune.domain.retry_policy import RetryPolicy
from kvtune.domain.slo import parse_slo
from kvtune.endpoint import server_root
from kvtune.errors import OptionError
from kvtune.writer import OutputFiles

if TYPE_CHECKING:
    from kvtune.domain.recommendation import Recommendation
    from kvtune.profile.routes import Profile

JSON_FIELDS = """\b
--json / --save write one object:
  target          {url, endpoint, model, max_model_len, ignore_eos, length_control}
  load            {kind: synchronous|concurrent|poisson|gamma|replay, rate_rps, burstiness,
                   concurrency, speedup, max_requests, duration_s, timeout_s, max_connections, retry}
  workload        {routes, seed, prompts: {method: tokenize|tokenizer|assumed,
                   filler: words|vocabulary|repeat, overhead_tokens, vocabulary_words,
                   calibration_calls, notes}, prompt_check: {checked, exact}, clamped: {reason: requests}}
  notes           the files the logs' reading left out (kvtune's own outputs, --exclude)
  requests        {sent, completed, failed: {429, 503, 4xx, 5xx, timeout, disconnect, connect,
                   stream_error, cancelled}, retries, retry_wait_s}
  duration_s      first send to last answer
  output_tokens_total            sum of the server's usage.completion_tokens
  output_tokens_requested_total  sum of drawn lengths (max_tokens or min_tokens + 1 sent), completed requests
  output_length   {completed_without_usage, mismatched, shortfall_tokens, excess_tokens}
  prompt_tokens_total, prompt_tokens_requested_total, prompt_length {checked, mismatched}
  latency_ms      {ttft, itl, tpot, e2e}: each {count, mean, p50, p90, p99} (nearest rank)
  throughput      {requests_per_s, output_tokens_per_s}
  goodput         {slo, requests_met, attainment, requests_per_s} with --slo, else null
  finish_reasons, routes {route: {sent, completed, truncated, truncation_share, finish_reasons}}
  server          {preemptions, kv_cache_usage_peak, running_peak, waiting_peak,
                   generation_tokens, prompt_tokens, num_blocks, block_size, samples, …}
                  or null when /metrics cannot be read (server_note says why)
  verdict         {passed, slo?, preemptions?, kv_cache_usage?, admitted_concurrency?,
                   truncation_share?} or null; each check {passed, evaluated, observed, expected, …}

\b
Verdict checks (--expect recommendation.json; a check that cannot be evaluated fails):
  preemptions           vllm:num_preemptions_total delta == 0
  kv_cache_usage        peak vllm:kv_cache_usage_perc <= (block_budget + 1 null block) / num_blocks
  admitted_concurrency  peak vllm:num_requests_running <= block_budget // smallest reservation
                        among the requests sent, ceil((prompt + min(max_tokens, route cap)) / block_size)
  truncation_share      per route, share of responses cut short (finish_reason length with fewer
                        tokens than drawn) within 0.01 + 3 binomial sigma of the predicted share
  slo                   with --slo: share meeting every objective >= --slo-attainment
Peaks are sampled every --scrape-interval; counters are exact before/after deltas.

\b
Exit codes: 0 done (verdict passed or none asked), 1 a verdict check failed, 2 bad input.
"""


def _parse_expect(path: str) -> Recommendation:
    """The recommendation.json a verdict checks against, read back strictly (kvtune.api.benchmark
    reads it again: this checks it in the order the options are judged, before the logs)."""
    return api.load_recommendation(path, field="--expect")


@dataclass(frozen=True, slots=True)
class TargetArgs:
    """The server and how each request is sent to it."""

    model: str | None
    endpoint: str
    timeout_s: float
    retry: bool
    max_retries: int
    ignore_eos: bool
    length_control: str
    eos_token_id: int | None
    metrics_url: str | None
    scrape_interval: float
    max_connections: int | None
    api_key: str | None

    def as_target(self, url: str, tokenizer: str | None) -> BenchTarget:
        """The target kvtune.api.bench takes (its checks are BenchTarget.check's)."""
        return BenchTarget(url, model=self.model, endpoint=self.endpoint, timeout_s=self.timeout_s,
                           retry=RetryPolicy(enabled=self.retry, max_retries=self.max_retries),
                           ignore_eos=self.ignore_eos, length_control=self.length_control,
                           eos_token_id=self.eos_token_id, metrics_url=self.metrics_url,
                           scrape_interval_s=self.scrape_interval, max_connections=self.max_connections,
                           api_key=self.api_key, tokenizer=tokenizer)


target_options = grouped("target", TargetArgs, [
    click.option("--request-model", "model", metavar="NAME",
                 help="The `model` field of each request: the served model name.  [default: the first of /v1/models]"),
    click.option("--endpoint", type=click.Choice(["chat", "completions"]), default="chat", show_default=True,
                 help="/v1/chat/completions or /v1/completions."),
    click.option("--timeout", "timeout_s", type=click.FloatRange(min=0, min_open=True), default=300.0,
                 show_default=True, help="Per-request limit in seconds, first byte to [DONE]."),
    click.option("--retry", is_flag=True, help="Retry 429 (and 503 with Retry-After), waiting as Retry-After says."),
    click.option("--max-retries", type=click.IntRange(min=1), default=3, show_default=True,
                 help="Retries per request with --retry."),
    click.option("--ignore-eos/--no-ignore-eos", default=True, show_default=True,
                 help="Force each output to its drawn length (vLLM's ignore_eos); off for servers without it."),
    click.option("--length-control", type=click.Choice(["max-tokens", "min-tokens"]), default="max-tokens",
                 show_default=True,
                 help="How each output is held to its drawn length L. max-tokens sends max_tokens = L. "
                      "min-tokens forces lengths without declaring max_tokens, as clients that leave it "
                      "unset do: use it to test a gateway (it sends min_tokens = L - 1 and a +100 "
                      "logit_bias on --eos-token-id; vLLM refuses min_tokens above max_tokens, so a "
                      "gateway cap below L, or /v1/completions' default max_tokens of 16, answers 400)."),
    click.option("--eos-token-id", type=click.IntRange(min=0), metavar="ID",
                 help="The model's EOS token id (generation_config.json eos_token_id), for --length-control "
                      "min-tokens."),
    click.option("--metrics-url", help="The server's Prometheus page.  [default: URL/metrics]"),
    click.option("--scrape-interval", type=click.FloatRange(min=0.05), default=1.0, show_default=True,
                 help="Seconds between /metrics samples during the run."),
    click.option("--max-connections", type=click.IntRange(min=1),
                 help="Connection pool size.  [default: C, else 4096]"),
    click.option("--api-key", envvar="KVTUNE_API_KEY", help="Bearer token (or $KVTUNE_API_KEY)."),
])


@dataclass(frozen=True, slots=True)
class JudgeArgs:
    """What the run is held to: latency objectives and a recommendation."""

    slo: str | None
    slo_attainment: float
    expect_path: str | None

    def expectations(self) -> Expectations:
        return Expectations(parse_slo(self.slo) if self.slo else None, self.slo_attainment, self.expect_path)


judge_options = grouped("judge", JudgeArgs, [
    click.option("--slo", metavar="SPEC", help="Latency objectives in ms, e.g. ttft=500,tpot=50,e2e=10000."),
    click.option("--slo-attainment", type=click.FloatRange(min=0, max=1), default=0.99, show_default=True,
                 help="With --slo: exit 1 unless this share of requests meets every objective."),
    click.option("--expect", "expect_path", metavar="FILE",
                 help="recommendation.json to check: preemptions, KV peak, admitted concurrency, truncation."),
])


@dataclass(frozen=True, slots=True)
class OutputArgs:
    """Where the results go."""

    out_path: str | None
    json_: bool
    requests_log: str | None
    progress: bool | None


output_options = grouped("output", OutputArgs, [
    click.option("--save", "out_path", type=click.Path(), metavar="FILE", help="Write the results JSON to FILE."),
    click.option("--json", "json_", is_flag=True, help="Print the results JSON instead of the table."),
    click.option("--requests-log", type=click.Path(), metavar="FILE",
                 help="One JSON line per request (timings, tokens, outcome; never text)."),
    click.option("--progress/--no-progress", default=None, help="Live progress on stderr.  [default: when a terminal]"),
])


@click.command(cls=SectionedCommand, epilog=JSON_FIELDS)
@quiet_option()
@renamed("--model", "--request-model", "model")
@renamed("--out", "--save", "out_path", type=click.Path(), metavar="FILE")
@click.argument("url")
@click.argument("logs", nargs=-1)
@traffic_source_options
@log_options
@target_options
@load_options
@judge_options
@click.option("--seed", type=int, default=0, show_default=True, help="Seed for lengths, prompts and arrival gaps.")
@output_options
def bench(url: str, logs: tuple[str, ...], profile_path: str | None, routes: tuple[str, ...], log: LogArgs,
          target: TargetArgs, load: LoadArgs, judge: JudgeArgs, seed: int, output: OutputArgs) -> None:
    """Replay profiled traffic against a live OpenAI-compatible server, scrape its /metrics, judge.

    Each request draws (prompt, output) lengths from the profile's routes, builds a prompt of
    exactly that many tokens under the server's tokenizer, and forces the output length with
    max_tokens + ignore_eos (--length-control min-tokens: without declaring max_tokens).
    With --expect, exit 1 when the server contradicts the recommendation.
    Prompt lengths are checked with the server's /tokenize; --tokenizer (also used for logs) is
    the fallback for servers without it.

    \b
    Example:
        kvtune bench http://127.0.0.1:8000 --profile profile.json --rate 5 --duration 60 \\
            --slo ttft=500,tpot=50 --expect deploy/recommendation.json --save results.json
    """
    server_root(url, field="URL")  # the URL's own error first, as kvtune.api.benchmark checks it
    expectations = judge.expectations()
    if expectations.expect is not None:
        _parse_expect(expectations.expect)
    load.check(logs)
    if profile_path and logs:
        raise OptionError("give --profile or LOGS, not both", field="--profile")
    if not profile_path and not logs:
        raise OptionError("give LOGS or --profile FILE for the workload", field="LOGS")
    notes: list[str] = []  # on the files the logs' reading left out; --json's notes

    def note(line: str) -> None:
        notes.append(line)
        click.echo(escape_controls(f"note: {line}"), err=True)

    def read_profile() -> Profile:
        profile = log.traffic_profile(logs, profile_path)
        notes.extend(profile.notes)
        return profile

    from rich.console import Console

    from kvtune.cli._bench_view import RichBenchProgress  # rich: only once bench runs

    workload = LogReplay(logs, log.reading(), routes) if load.replay else read_profile
    err = Console(stderr=True)
    show = output.progress if output.progress is not None else err.is_terminal
    progress = None
    if show:
        progress = RichBenchProgress(err)

    # --save and --requests-log are staged before the run (a bad target fails now, not after it)
    # and written together at the end, or not at all
    with OutputFiles() as outputs:
        out_file = outputs.open(output.out_path) if output.out_path else None
        log_file = outputs.open(output.requests_log) if output.requests_log else None
        recorder = api.BenchRecorder(requests_log=log_file, progress=progress)
        try:
            report = asyncio.run(api.benchmark(workload, target.as_target(url, log.tokenizer), load.as_load(seed),
                                           expectations, routes=routes, recorder=recorder, on_note=note))
        except KeyboardInterrupt:
            report = recorder.report(server=None, slo=expectations.slo, expect=None, interrupted=True)
            _emit({**report, "notes": notes}, output, outputs, out_file)
            click.echo("interrupted: partial results written", err=True)
            sys.exit(130)
        _emit(report, output, outputs, out_file)
    verdict = report.get("verdict")
    if verdict is not None and not verdict["passed"]:
        sys.exit(1)


def _emit(report: dict[str, Any], output: OutputArgs, outputs: Any, out_file: Any) -> None:
    text = json.dumps(report, indent=2, default=dict)
    if out_file is not None:
        out_file.write(text + "\n")
    outputs.commit()
    if output.json_:
        click.echo(text)
    else:
        from kvtune.cli._bench_view import render_summary  # rich: only for the table
        from kvtune.cli._console import output_console  # rich: only for the table

        render_summary(report, output_console())
