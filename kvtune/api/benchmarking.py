"""The door to `kvtune bench`: the traffic replayed against a live server, and judged (kvtune.bench)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from kvtune.bench.run import BenchConfig, BenchRecorder, run_bench
from kvtune.domain.bench_target import BenchTarget, Expectations
from kvtune.domain.load_shape import Load, LoadShape
from kvtune.domain.log_reading import LogReplay
from kvtune.endpoint import server_root
from kvtune.errors import InputError
from kvtune.ingest import options_for
from kvtune.ingest.tokenize import load_tokenizer
from kvtune.policy.recommendation import load_recommendation as load_recommendation_file
from kvtune.profile.routes import Profile
from kvtune.userfiles import brief
from kvtune.workload.draw import PromptSynth, Workload, replay_rows, select_routes


async def benchmark(
    workload: Profile | Callable[[], Profile] | LogReplay,
    target: BenchTarget,
    load: Load,
    expectations: Expectations | None = None,
    *,
    routes: Sequence[str] = (),
    recorder: BenchRecorder | None = None,
    on_note: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Replay the traffic against a live OpenAI-compatible server, scrape its /metrics, judge:
    what `kvtune bench` runs, as its results JSON (`kvtune bench --help` lists the fields;
    `notes` last: the files the logs' reading left out).

    `workload` is a profile (or a function reading one: called once the options are checked)
    whose `routes` the requests are drawn from, or a LogReplay of logs sent at their own
    timestamps. `recorder` keeps each result as it arrives (an interrupted run keeps what it saw)
    and streams it to a requests log or a progress view; `on_note` hears the replay's notes.
    The verdict (`report["verdict"]`, None without `expectations`) fails on an SLO missed or a
    server that contradicts the recommendation.

    >>> target, load = kvtune.BenchTarget("http://127.0.0.1:8000"), kvtune.Load(rate_rps=5, max_requests=100)
    >>> report = asyncio.run(kvtune.benchmark(profile, target, load))   # doctest: +SKIP
    >>> report["requests"]["completed"]                                 # doctest: +SKIP
    100
    """
    judged = expectations or Expectations()
    base_url = server_root(target.url, field="URL")
    expect = load_recommendation_file(judged.expect, field="--expect") if judged.expect else None
    replay = isinstance(workload, LogReplay)
    if replay:
        load = dataclasses.replace(load, replay=True)
    load.check(from_logs=replay)
    target.check()
    tokenizer = load_tokenizer(target.tokenizer) if target.tokenizer else None
    notes: list[str]  # on the files the logs' reading left out; the report's notes
    build: Callable[[PromptSynth], Workload]
    if isinstance(workload, LogReplay):
        rows, stamps, notes = replay_rows(workload.logs, options_for(workload.reading), workload.routes)
        for line in notes:
            (on_note or (lambda _: None))(line)
        shape = LoadShape.replay(stamps, load.speedup)

        def build(synth: PromptSynth) -> Workload:
            return Workload.from_rows(rows, synth, load.seed)
    else:
        profile = workload() if callable(workload) else workload
        notes = profile.notes
        for r in select_routes(profile, routes):  # fail on bad routes or an empty profile before connecting
            if r.prompt.total == 0:
                raise InputError(f"route {brief(r.route)} logs no prompt lengths; a benchmark needs them",
                                 field="--route")
        shape = load.shape()

        def build(synth: PromptSynth) -> Workload:
            return Workload.from_profile(profile, routes, synth, load.seed)

    config = BenchConfig(
        base_url=base_url, load=shape, max_requests=load.max_requests, duration_s=load.duration_s,
        endpoint=target.endpoint, model=target.model, ignore_eos=target.ignore_eos,
        length_control=target.length_control, eos_token_id=target.eos_token_id, timeout_s=target.timeout_s,
        retry=target.retry, slo=judged.slo, metrics_url=target.metrics_url, scrape_interval_s=target.scrape_interval_s,
        max_connections=target.max_connections, seed=load.seed, api_key=target.api_key, expect=expect,
        slo_attainment=judged.slo_attainment,
    )
    report = await run_bench(config, build, tokenizer=tokenizer, recorder=recorder)
    return {**report, "notes": notes}
