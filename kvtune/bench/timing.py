"""`kvtune calibrate URL --timing`: bounded sweeps against a live vLLM, fitted into a step-time model.

Why these sweeps: each observation must be explainable as a known set of engine steps.
    overhead  a near-empty request alone, max_tokens 1: TTFT = HTTP overhead + one tiny step;
              then bursts of BURST_SIZE of them sent together: the API server is busy for all of
              their work (shared among them, kvtune.sim.frontend), so the burst's length less a
              lone request's, over B − 1, is its work per request
              (kvtune.capacity.timing.fit_frontend; per streamed token it is read off the decode
              cells, the client's gap beyond the engine's)
    prefill   one request at a time, max_tokens 1, prompts up to and past max_num_batched_tokens:
              TTFT = HTTP overhead + one step per chunk (kvtune.capacity.timing.prefill_chunks)
    decode    B clients in a closed loop of waves (all send together, each its next request once
              the wave is done), ignore_eos, streamed: an inter-token gap = one step of B decoding
              requests at the context reached, or a mixed step while the wave's last prompts are
              still prefilled (kvtune.capacity.timing.wave_decode_features replays vLLM's schedule).
              The gaps are the engine's own (vllm:inter_token_latency_seconds): on a busy host the
              API server forwards tokens in bursts, so the client's gaps are not the steps
    load      a closed loop of mixed prompt and output lengths, streamed: prefill chunks beside
              decodes, requests joining mid-run, the pool filling, as under real traffic. Its
              requests are replayed in the simulator at their send times; the replayed steps'
              features, weighted by the decoding requests each served, are one observation of
              the engine's mean inter-token gap over the sweep (`load_observation`), and the
              coefficients are fitted again with it
The server's own counters (vllm:iteration_tokens_total, prompt/generation tokens, preemptions,
its ITL and prefill-time histograms) are read before and after each sweep and reported beside
the client's view, and a decode cell that preempted is dropped: its steps were not B decodes.

`--timing-budget-s` bounds the whole run: each sweep gets a share of what is left, no request
starts after its sweep's deadline, and whatever still runs at the overall deadline is cancelled.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from kvtune import userfiles
from kvtune.bench.client import Target, send_request
from kvtune.bench.prompts import calibrate_prompts
from kvtune.bench.scrape import sum_samples
from kvtune.capacity.measured import METRICS_MAX_BYTES, MeasuredCapacity, scheduler_limits_from_log
from kvtune.capacity.measured import calibrate as calibrate_capacity
from kvtune.capacity.timing import (
    FitError,
    MeasuredAgainst,
    Observation,
    ServerCheck,
    StepTimeFit,
    SweepReport,
    Timing,
    decode_weighted_features,
    fit_errors,
    fit_frontend,
    fit_step_time,
    lone_prefill_features,
    wave_decode_features,
)
from kvtune.endpoint import get, server_root
from kvtune.engines import vllm
from kvtune.errors import EndpointError, KvtuneError
from kvtune.sim import Workload, simulate
from kvtune.sim.setup import engine_setup
from kvtune.version import __version__
from kvtune.workload.draw import PromptSynth
from kvtune.workload.requests import RequestResult, RequestSpec

__all__ = ["DecodeCell", "TimingPlan", "TimingProgress", "plan_timing", "batched_tokens_from_log",
           "calibrate_timing", "DEFAULT_BUDGET_S"]

DEFAULT_BUDGET_S = 300.0
SHARES = {"overhead": 0.08, "prefill": 0.27, "decode": 0.45, "load": 0.20}
OVERHEAD_REQUESTS = 24
BURST_SIZE = 16  # near-empty requests sent together
BURST_ROUNDS = 3
PREFILL_ROUNDS = 6  # at most; fewer when the sweep's share of the budget runs out
DECODE_CONCURRENCY = (1, 2, 4, 8, 16, 32)
DECODE_OUTPUT_TOKENS = 64
DECODE_SEGMENTS = 4  # each request's gaps, in quarters: one observation per quarter, at its context
LOAD_PROMPTS = (16, 32, 64, 128, 256, 512)  # the load sweep's prompt lengths, within max_model_len / 2
LOAD_OUTPUTS = (16, 32, 64, 96)  # … and output lengths, within max_model_len / 4
LOAD_CONCURRENCY = 16  # at most: fewer when the KV pool holds fewer such requests twice over
LOAD_SENDING = 0.7  # share of the load sweep's time in which its clients send
MAX_REQUEST_S = 120.0
SETTLE_S = 3.0


@dataclass(frozen=True, slots=True)
class DecodeCell:
    """One closed-loop decode run: `concurrency` clients, prompts of `prompt_tokens`."""

    concurrency: int
    prompt_tokens: int


@dataclass(frozen=True, slots=True)
class TimingPlan:
    """What the sweeps will send, decided before anything is sent."""

    budget_s: float
    max_num_batched_tokens: int
    overhead_prompt_tokens: int
    overhead_requests: int
    prefill_lengths: tuple[int, ...]
    prefill_rounds: int
    decode_cells: tuple[DecodeCell, ...]
    decode_output_tokens: int
    notes: tuple[tuple[str, str], ...] = ()  # (sweep, what the plan had to leave out)
    load_concurrency: int = 0  # the load sweep's clients (0: no load sweep)
    load_prompts: tuple[int, ...] = ()  # cycled through in this order
    load_outputs: tuple[int, ...] = ()

    def steps(self) -> list[tuple[str, str, int]]:
        """(sweep, what it does, requests at most) in the order they run."""
        lengths = ", ".join(f"{p:,}" for p in self.prefill_lengths)
        concurrency = sorted({c.concurrency for c in self.decode_cells})
        prompts = sorted({c.prompt_tokens for c in self.decode_cells})
        return [
            ("overhead", f"{self.overhead_requests} near-empty requests ({self.overhead_prompt_tokens}-token prompt, "
                         f"max_tokens 1), one at a time, then {BURST_ROUNDS} bursts of {BURST_SIZE} sent together",
             self.overhead_requests + BURST_ROUNDS * BURST_SIZE),
            ("prefill", f"one request at a time, max_tokens 1, prompts of {lengths} tokens "
                        f"(max_num_batched_tokens {self.max_num_batched_tokens:,}), up to {self.prefill_rounds} "
                        "rounds", len(self.prefill_lengths) * self.prefill_rounds),
            ("load", f"closed loop of {self.load_concurrency} clients, prompts of "
                     f"{', '.join(map(str, sorted(set(self.load_prompts))))} and outputs of "
                     f"{', '.join(map(str, sorted(set(self.load_outputs))))} tokens mixed, ignore_eos, streamed: "
                     "chunked prefills beside decodes, replayed in the simulator",
             self.load_concurrency * 8),
            ("decode", f"closed loop at concurrency {', '.join(map(str, concurrency))} × prompts of "
                       f"{', '.join(map(str, prompts))} tokens, {self.decode_output_tokens} output tokens, "
                       "ignore_eos, streamed", sum(c.concurrency for c in self.decode_cells)),
        ]


def plan_timing(*, budget_s: float, max_num_batched_tokens: int, max_model_len: int | None,
                kv_tokens: int | None, block_size: int | None, min_prompt_tokens: int = 1) -> TimingPlan:
    """The sweeps for a server: prompts as long as its context and KV pool allow, decode batches
    whose whole sequences fit in its KV pool at once (a preemption would break the step model)."""
    notes: list[tuple[str, str]] = []
    bs = block_size or 16
    usable = None if kv_tokens is None else max(bs, kv_tokens - bs)  # one block is vLLM's null block
    limit = (max_model_len or 8192) - 1  # prompt + the one output token
    if usable is not None:
        limit = min(limit, usable - 1)
    limit = max(limit, min_prompt_tokens)
    budget_tokens = max_num_batched_tokens
    lengths = {min(limit, max(min_prompt_tokens, p)) for p in (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192,
                                                               16384) if p <= min(limit, budget_tokens)}
    if limit > budget_tokens:
        lengths |= {min(limit, round(budget_tokens * f)) for f in (1.0, 1.25, 1.5, 2.0, 2.5, 3.0)}
    else:
        lengths.add(limit)
        notes.append(("prefill", f"prompts stop at {limit:,} tokens (max_model_len or the KV pool), not past "
                     f"max_num_batched_tokens {budget_tokens:,}: no prefill is chunked"))
    out = DECODE_OUTPUT_TOKENS if max_model_len is None else max(8, min(DECODE_OUTPUT_TOKENS, max_model_len // 4))
    short = max(min_prompt_tokens, 32)
    long = min(1024, (max_model_len or 2048) // 2)
    prompts = [short] + ([long] if long >= 3 * short else [])
    cells = []
    for p in prompts:
        for c in DECODE_CONCURRENCY:
            blocks = -(-(p + out + 1) // bs)
            if usable is None or c * blocks <= usable // bs:
                cells.append(DecodeCell(c, p))
    if not cells:
        cells.append(DecodeCell(1, short))
        notes.append(("decode", "the KV pool holds less than one decode request: decode observations may preempt"))
    dropped = len(prompts) * len(DECODE_CONCURRENCY) - len(cells)
    if dropped > 0:
        notes.append(("decode", f"{dropped} cell(s) left out: their sequences would not all fit in the KV pool"))
    half = max(min_prompt_tokens, (max_model_len or 2048) // 2)
    load_prompts = sorted({min(half, max(min_prompt_tokens, p)) for p in LOAD_PROMPTS})
    load_outputs = sorted({min(max(1, (max_model_len or 2048) // 4), o) for o in LOAD_OUTPUTS})
    mean_tokens = float(np.mean(load_prompts)) + float(np.mean(load_outputs))
    load_c = LOAD_CONCURRENCY if usable is None else max(2, min(LOAD_CONCURRENCY, round(2 * usable / mean_tokens)))
    order = np.random.default_rng(0)
    prompts_cycle = tuple(int(x) for x in order.permutation(np.repeat(load_prompts, len(load_outputs))))
    outputs_cycle = tuple(int(x) for x in order.permutation(np.tile(load_outputs, len(load_prompts))))
    return TimingPlan(budget_s, budget_tokens, min_prompt_tokens, OVERHEAD_REQUESTS, tuple(sorted(lengths)),
                      PREFILL_ROUNDS, tuple(cells), out, tuple(notes), load_c, prompts_cycle, outputs_cycle)


class TimingProgress(Protocol):
    """Live display hooks; the CLI passes a rich one, None is silent."""

    def on_plan(self, steps: Sequence[tuple[str, str, int]]) -> None: ...
    def on_step(self, name: str, total: int, seconds: float) -> None: ...
    def on_advance(self, count: int = 1) -> None: ...
    def on_step_end(self) -> None: ...


# --- the server's side -------------------------------------------------------------------------

_COUNTERS = {
    "iterations": f"{vllm.ITERATION_TOKENS}_count",
    "iteration_tokens": f"{vllm.ITERATION_TOKENS}_sum",
    "prompt_tokens": vllm.PROMPT_TOKENS,
    "generation_tokens": vllm.GENERATION_TOKENS,
    "preemptions": vllm.NUM_PREEMPTIONS,
    "itl_sum": f"{vllm.INTER_TOKEN_LATENCY}_sum",
    "itl_count": f"{vllm.INTER_TOKEN_LATENCY}_count",
    "prefill_sum": f"{vllm.REQUEST_PREFILL_TIME}_sum",
    "prefill_count": f"{vllm.REQUEST_PREFILL_TIME}_count",
    "running": vllm.NUM_REQUESTS_RUNNING,
    "waiting": vllm.NUM_REQUESTS_WAITING,
}
def parse_counters(text: str) -> dict[str, float]:
    """The counters above from a /metrics page, summed over engines (only the lines needed)."""
    sums = sum_samples(text, frozenset(_COUNTERS.values()))
    return {key: sums[name] for key, name in _COUNTERS.items() if name in sums}


async def _counters(session: Any, url: str) -> dict[str, float] | None:
    try:
        page = await get(session, url, timeout_s=5.0, max_bytes=METRICS_MAX_BYTES, accept="text/plain")
    except EndpointError:
        return None
    if page.status != 200:
        return None
    try:
        return parse_counters(page.text)
    except (ValueError, TypeError, IndexError):
        return None


async def _settled_counters(session: Any, url: str) -> dict[str, float] | None:
    """Counters once the engine is idle (vLLM updates them a moment after the last response)."""
    deadline = time.perf_counter() + SETTLE_S
    previous = None
    while True:
        now = await _counters(session, url)
        if now is None:
            return None
        idle = not now.get("running") and not now.get("waiting")
        if idle and previous is not None and previous.get("iterations") == now.get("iterations"):
            return now
        if time.perf_counter() >= deadline:
            return now
        previous = now
        await asyncio.sleep(0.1)


def _server_check(before: dict[str, float] | None, after: dict[str, float] | None) -> ServerCheck:
    if before is None or after is None:
        return ServerCheck()

    def delta(name: str) -> float | None:
        a, b = before.get(name), after.get(name)
        return None if a is None or b is None else b - a

    def count(name: str) -> int | None:
        d = delta(name)
        return None if d is None else int(round(d))

    def mean(total: str, n: str) -> float | None:
        s, c = delta(total), delta(n)
        return None if s is None or not c else s / c

    return ServerCheck(iterations=count("iterations"), iteration_tokens=count("iteration_tokens"),
                       prompt_tokens=count("prompt_tokens"), generation_tokens=count("generation_tokens"),
                       preemptions=count("preemptions"), engine_itl_mean_s=mean("itl_sum", "itl_count"),
                       engine_prefill_mean_s=mean("prefill_sum", "prefill_count"))


# --- max_num_batched_tokens ---------------------------------------------------------------------

def batched_tokens_from_log(text: str) -> int | None:
    """max_num_batched_tokens as a vLLM startup log states it (the last start in the log wins)."""
    return scheduler_limits_from_log(text)[1]


async def _batched_tokens_from_server(session: Any, root: str) -> int | None:
    """From /server_info, which vLLM serves only in its dev mode (VLLM_SERVER_DEV_MODE=1)."""
    import json

    try:
        page = await get(session, f"{root}/server_info?config_format=json", timeout_s=5.0,
                         max_bytes=4 * 1024**2, accept="application/json")
    except EndpointError:
        return None
    if page.status != 200:
        return None
    try:
        data = json.loads(page.body)
        value = data["vllm_config"]["scheduler_config"]["max_num_batched_tokens"]
    except (ValueError, KeyError, TypeError):
        return None
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


# --- the sweeps ---------------------------------------------------------------------------------


@dataclass(slots=True)
class _Sweep:
    """What one sweep collected."""

    name: str
    results: list[RequestResult] = field(default_factory=list)
    observations: list[Observation] = field(default_factory=list)  # fitted: the engine's own times
    client: list[Observation] = field(default_factory=list)  # the client's: TTFT, streamed gaps
    overheads: list[float] = field(default_factory=list)  # TTFT − the engine's prefill time, seconds
    bursts: list[tuple[int, float]] = field(default_factory=list)  # (requests, first send to last answer, s)
    stream: list[tuple[int, float, float]] = field(default_factory=list)  # (B, client gap, engine gap), s
    replay: list[tuple[float, int, int]] = field(default_factory=list)  # load: (send s, prompt, output)
    load_itl_s: float | None = None  # load: the engine's mean inter-token gap over the sweep
    concurrency: set[int] = field(default_factory=set)
    notes: list[str] = field(default_factory=list)
    server: ServerCheck = field(default_factory=ServerCheck)
    wall_s: float = 0.0


class _Runner:
    """Sends the plan's requests over one session; every request is bounded by the run's deadline."""

    def __init__(self, session: Any, target: Target, synth: PromptSynth, plan: TimingPlan, deadline: float,
                 progress: TimingProgress | None, metrics_url: str) -> None:
        self.session, self.target, self.synth, self.plan = session, target, synth, plan
        self.deadline, self.progress, self.metrics_url = deadline, progress, metrics_url
        self.rng = np.random.default_rng(0)
        self.index = 0

    def remaining(self) -> float:
        return self.deadline - time.perf_counter()

    async def send(self, sweep: str, prompt_tokens: int, output_tokens: int) -> RequestResult:
        self.index += 1
        spec = RequestSpec(self.index, sweep, prompt_tokens, output_tokens, self.synth.text(prompt_tokens, self.rng))
        timeout = max(0.1, min(MAX_REQUEST_S, self.remaining()))
        result = await send_request(self.session, self.target, spec, timeout_s=timeout)
        if self.progress is not None:
            self.progress.on_advance()
        return result

    async def run(self, name: str, total: int, share: float, body: Any) -> _Sweep:
        """One sweep with the counters read around it; `body(sweep, sweep_deadline)` sends."""
        sweep = _Sweep(name)
        slice_s = max(0.0, self.remaining()) * share
        if self.progress is not None:
            self.progress.on_step(name, total, slice_s)
        start = time.perf_counter()
        before = await _counters(self.session, self.metrics_url)
        try:
            async with asyncio.timeout(max(0.0, self.remaining())):
                await body(sweep, start + slice_s)
        except TimeoutError:
            sweep.notes.append("cut short by --timing-budget-s")
        sweep.wall_s = time.perf_counter() - start
        sweep.server = _server_check(before, await _settled_counters(self.session, self.metrics_url))
        if self.progress is not None:
            self.progress.on_step_end()
        return sweep

    async def lone(self, sweep: _Sweep, prompt_tokens: int) -> None:
        """One request alone, max_tokens 1: its TTFT (client) and its prefill time (the engine's,
        from the counters around it) both cover the steps of its chunks; TTFT adds the HTTP overhead."""
        before = await _counters(self.session, self.metrics_url)
        result = await self.send(sweep.name, prompt_tokens, 1)
        sweep.results.append(result)
        if not result.ok or result.ttft_ms is None:
            return
        prompt = result.prompt_tokens or result.prompt_tokens_requested
        features = lone_prefill_features(prompt, self.plan.max_num_batched_tokens)
        ttft_s = result.ttft_ms / 1000
        sweep.client.append(Observation.of(sweep.name, features, 1, ttft_s))
        engine = await self._engine_prefill_s(before)
        if engine is not None and 0 < engine < ttft_s:
            # the per-request column (1) takes what the engine spends on a new request besides its steps
            sweep.observations.append(Observation.of(sweep.name, features, 1, engine))
            sweep.overheads.append(ttft_s - engine)

    async def _engine_prefill_s(self, before: dict[str, float] | None) -> float | None:
        """The finished request's prefill time as the engine measured it, once its counters show it."""
        if before is None or "prefill_count" not in before:
            return None
        deadline = time.perf_counter() + 1.0
        while time.perf_counter() < deadline:
            after = await _counters(self.session, self.metrics_url)
            if after is None:
                return None
            if after.get("prefill_count", 0) == before["prefill_count"] + 1:
                return after.get("prefill_sum", 0.0) - before.get("prefill_sum", 0.0)
            if after.get("prefill_count", 0) > before["prefill_count"] + 1:  # someone else's request
                return None
            await asyncio.sleep(0.02)
        return None

    async def overhead(self, sweep: _Sweep, until: float) -> None:
        sweep.concurrency.add(1)
        for _ in range(self.plan.overhead_requests):
            if time.perf_counter() >= until and len(sweep.results) >= 3:
                break
            await self.lone(sweep, self.plan.overhead_prompt_tokens)
        for _ in range(BURST_ROUNDS):
            if time.perf_counter() >= until and sweep.bursts:
                break
            start = time.perf_counter()
            results = await asyncio.gather(*(self.send(sweep.name, self.plan.overhead_prompt_tokens, 1)
                                             for _ in range(BURST_SIZE)))
            sweep.results.extend(results)
            done = [r for r in results if r.ok and r.e2e_ms is not None]
            if len(done) == BURST_SIZE:
                sweep.concurrency.add(BURST_SIZE)
                sweep.bursts.append((BURST_SIZE, time.perf_counter() - start))

    async def prefill(self, sweep: _Sweep, until: float) -> None:
        sweep.concurrency.add(1)
        for _ in range(self.plan.prefill_rounds):
            for prompt in self.plan.prefill_lengths:
                if time.perf_counter() >= until and len(sweep.results) >= len(self.plan.prefill_lengths):
                    return
                await self.lone(sweep, prompt)

    async def decode(self, sweep: _Sweep, until: float) -> None:
        cells = self.plan.decode_cells
        start = time.perf_counter()
        for i, cell in enumerate(cells):
            cell_until = start + (until - start) * (i + 1) / len(cells)
            await self._decode_cell(sweep, cell, cell_until)

    async def _decode_cell(self, sweep: _Sweep, cell: DecodeCell, until: float) -> None:
        out = self.plan.decode_output_tokens
        before = await _counters(self.session, self.metrics_url)
        results: list[RequestResult] = []

        async def client() -> None:
            result = await self.send("decode", cell.prompt_tokens, out)
            results.append(result)
            sweep.results.append(result)

        while True:  # waves: all clients send together, each its next request once all are done
            async with asyncio.TaskGroup() as tg:
                for _ in range(cell.concurrency):
                    tg.create_task(client())
            if time.perf_counter() >= until:
                break
        after = await _settled_counters(self.session, self.metrics_url)
        preempted = _server_check(before, after).preemptions
        if preempted:
            sweep.notes.append(f"concurrency {cell.concurrency} × {cell.prompt_tokens} tokens preempted "
                               f"{preempted} time(s): its observations are left out")
            return
        sweep.concurrency.add(cell.concurrency)
        # the engine's mean inter-token gap over the cell: steps of `concurrency` decoding requests,
        # and the mixed steps where the first of a wave decode while the last still prefill
        features = wave_decode_features(cell.concurrency, cell.prompt_tokens, out, self.plan.max_num_batched_tokens)
        check = _server_check(before, after)
        if check.engine_itl_mean_s is not None and check.engine_itl_mean_s > 0:
            sweep.observations.append(Observation.of("decode", features, 0, check.engine_itl_mean_s))
        tpots = [r.tpot_ms / 1000 for r in results if r.ok and r.output_tokens == out and r.tpot_ms]
        if tpots:  # the client's view: (e2e − TTFT) / (tokens − 1), averaged over the cell
            sweep.client.append(Observation.of("decode", features, 0, float(np.mean(tpots))))
            if check.engine_itl_mean_s is not None and check.engine_itl_mean_s > 0:
                sweep.stream.append((cell.concurrency, float(np.mean(tpots)), check.engine_itl_mean_s))

    async def load(self, sweep: _Sweep, until: float) -> None:
        """A closed loop of mixed lengths, as real traffic has: prefill chunks share steps with
        decodes, requests join and leave mid-run, the pool may fill. Every request is kept as
        (send time, prompt, output) so the simulator can replay the run step by step."""
        plan = self.plan
        before = await _counters(self.session, self.metrics_url)
        start = time.perf_counter()
        stop = start + LOAD_SENDING * (until - start)  # the rest of its share: the last requests finish
        count = 0
        results: list[RequestResult] = []

        async def client() -> None:
            nonlocal count
            while time.perf_counter() < stop:
                i = count
                count += 1
                result = await self.send("load", plan.load_prompts[i % len(plan.load_prompts)],
                                         plan.load_outputs[i % len(plan.load_outputs)])
                results.append(result)
                sweep.results.append(result)

        async with asyncio.TaskGroup() as tg:
            for _ in range(plan.load_concurrency):
                tg.create_task(client())
        sweep.concurrency.add(plan.load_concurrency)
        check = _server_check(before, await _settled_counters(self.session, self.metrics_url))
        if any(not r.ok for r in results):
            sweep.notes.append("a request failed: the run cannot be replayed, so it is left out of the fit")
            return
        sweep.load_itl_s = check.engine_itl_mean_s
        sweep.replay = sorted((r.start_s - start, r.prompt_tokens or r.prompt_tokens_requested,
                               r.output_tokens or r.output_tokens_requested) for r in results)


def load_observation(replay: Sequence[tuple[float, int, int]], engine_itl_s: float | None, model: Any,
                     settings: Any) -> Observation | None:
    """The load sweep as one decode observation: its steps replayed in the simulator (with the
    step time fitted so far, which decides only who shares a step), their features weighted by
    the tokens each gave to a decoding request, against the engine's mean inter-token gap."""
    if not replay or engine_itl_s is None or not engine_itl_s > 0:
        return None
    offsets = np.array([max(0.0, t) for t, _, _ in replay])
    prompts = np.array([p for _, p, _ in replay], dtype=np.int64)
    outputs = np.array([o for _, _, o in replay], dtype=np.int64)
    result = simulate(Workload.from_columns(offsets, prompts, outputs, outputs), settings, model,
                      record_decisions=True)
    features = decode_weighted_features(result.decisions or (), prompts.tolist())
    return None if features is None else Observation.of("load", features, 0, engine_itl_s)


def _report(sweep: _Sweep, errors: dict[str, FitError]) -> SweepReport:
    ok = [r for r in sweep.results if r.ok]
    prompts = [r.prompt_tokens or r.prompt_tokens_requested for r in ok] or [0]
    outputs = [r.output_tokens or 0 for r in ok] or [0]
    seconds = [o.seconds for o in sweep.client]
    failed: dict[str, int] = {}
    for r in sweep.results:
        if not r.ok:
            failed[r.outcome.value] = failed.get(r.outcome.value, 0) + 1
    notes = list(sweep.notes)
    if failed:
        first = next(r.error for r in sweep.results if not r.ok)
        notes.append("failed: " + ", ".join(f"{n} {k}" for k, n in sorted(failed.items())) + f" (first: {first})")
    return SweepReport(
        name=sweep.name,
        requests=len(sweep.results),
        completed=len(ok),
        prompt_tokens=(min(prompts), max(prompts)),
        output_tokens=(min(outputs), max(outputs)),
        concurrency=tuple(sorted(sweep.concurrency)),
        wall_s=sweep.wall_s,
        error=errors.get(sweep.name),
        client_mean_s=float(np.mean(seconds)) if seconds else None,
        server=sweep.server,
        notes=tuple(notes),
    )


async def calibrate_timing(url: str, *, vllm_log: str | None = None, timeout_s: float = 10.0,
                           budget_s: float = DEFAULT_BUDGET_S, max_num_batched_tokens: int | None = None,
                           progress: TimingProgress | None = None) -> MeasuredCapacity:
    """The server's capacity (`kvtune calibrate`) with a fitted step-time model in `timing`."""
    import aiohttp

    measured = await calibrate_capacity(url, vllm_log=vllm_log, timeout_s=timeout_s)
    root = server_root(url, field="URL")
    log_text = None
    if vllm_log is not None:
        log_text = userfiles.read_text(vllm_log, max_bytes=userfiles.VLLM_LOG_MAX_BYTES, field="--vllm-log",
                                       errors="replace")
    started = time.perf_counter()
    deadline = started + budget_s
    connector = aiohttp.TCPConnector(limit=max(DECODE_CONCURRENCY) + 4, limit_per_host=0)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=timeout_s)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout, auto_decompress=False) as session:
        budget_tokens, budget_from = max_num_batched_tokens, "option"
        if budget_tokens is None and log_text is not None:
            budget_tokens, budget_from = batched_tokens_from_log(log_text), "vllm-log"
        if budget_tokens is None:
            budget_tokens, budget_from = await _batched_tokens_from_server(session, root), "server-info"
        if budget_tokens is None:
            # the CPU and GPUs under 70 GiB; larger GPUs default higher (kvtune.engines.vllm)
            budget_tokens, budget_from = vllm.MAX_NUM_BATCHED_TOKENS, "engine-default"
        model = measured.model
        if model is None:
            raise EndpointError("the server names no model in /v1/models", path=f"{root}/v1/models", field="URL")
        synth = await calibrate_prompts(session, root, model, "completions", max_model_len=measured.max_model_len)
        plan = plan_timing(budget_s=budget_s, max_num_batched_tokens=budget_tokens,
                           max_model_len=synth.max_model_len or measured.max_model_len,
                           kv_tokens=_pool_tokens(measured), block_size=measured.block_size,
                           min_prompt_tokens=synth.min_tokens)
        if progress is not None:
            progress.on_plan(plan.steps())
        target = Target(root, model, "completions", ignore_eos=True)
        runner = _Runner(session, target, synth, plan, deadline, progress, f"{root}/metrics")
        # one untimed request first: the first forward passes of a fresh server are slow
        await runner.send("warmup", max(plan.prefill_lengths), 2)
        overhead = await runner.run("overhead", plan.steps()[0][2], SHARES["overhead"], runner.overhead)
        prefill = await runner.run("prefill", plan.steps()[1][2], SHARES["prefill"] / (1 - SHARES["overhead"]),
                                   runner.prefill)
        load = await runner.run("load", plan.steps()[2][2], SHARES["load"] / (SHARES["decode"] + SHARES["load"]),
                                runner.load)
        # the rest, less a margin for the last round and the counters' settling
        decode = await runner.run("decode", plan.steps()[3][2], 0.9, runner.decode)
        sweeps = [overhead, prefill, load, decode]
    engine_rows = [o for s in sweeps for o in s.observations]
    client_rows = [o for s in sweeps for o in s.client]
    overheads = [x for s in sweeps[:2] for x in s.overheads]
    try:
        if engine_rows and any(o.sweep == "decode" for o in engine_rows) and overheads:
            # the engine's own step times, free of the API server's scheduling; the per-request
            # overhead is what the engine spends on admitting a request (fitted) plus TTFT − its
            # prefill time (measured): HTTP, tokenizing, detokenizing
            engine_fit = fit_step_time(engine_rows)
            load_row = _load_row(load, engine_fit, measured, budget_tokens)
            if load_row is not None:  # refitted with the steps of mixed traffic
                engine_rows.append(load_row)
                engine_fit = fit_step_time(engine_rows)
            fit = StepTimeFit(engine_fit.model, engine_fit.http_overhead_s + float(np.median(overheads)), {})
        else:  # no readable /metrics: the client's times, the overhead fitted with the steps
            fit = fit_step_time(client_rows)
    except KvtuneError as exc:
        raise EndpointError(f"{exc.message}; see the sweeps' failures with --json", path=root,
                            field="--timing") from None
    # the error users meet: TTFT for lone requests (client), the engine's step time for decode
    errors = fit_errors(fit, [o for o in client_rows if o.sweep != "decode"]
                        + [o for o in (engine_rows or client_rows) if o.sweep in ("decode", "load")])
    lone_ttft = [o.seconds for o in overhead.client]
    frontend = fit_frontend(lone_ttft, overhead.bursts, decode.stream)
    reports = [_report(s, errors) for s in sweeps]
    reports = [dataclasses.replace(r, notes=tuple(n for sweep, n in plan.notes if sweep == r.name) + r.notes)
               for r in reports]
    timing = Timing(
        model=fit.model,
        http_overhead_s=fit.http_overhead_s,
        sweeps=tuple(reports),
        measured_against=MeasuredAgainst(url=root, model=model, max_model_len=measured.max_model_len,
                                         block_size=measured.block_size, num_blocks=measured.num_blocks,
                                         kv_cache_dtype=measured.kv_cache_dtype,
                                         max_num_batched_tokens=budget_tokens,
                                         max_num_batched_tokens_from=budget_from),
        budget_s=budget_s,
        wall_s=time.perf_counter() - started,
        kvtune_version=__version__,
        frontend=frontend,
    )
    stated = budget_from != "engine-default"  # what the server runs with, not kvtune's guess
    return dataclasses.replace(measured, timing=timing, max_num_batched_tokens=budget_tokens if stated
                               else measured.max_num_batched_tokens)


def _load_row(sweep: _Sweep, fit: StepTimeFit, measured: MeasuredCapacity, budget_tokens: int) -> Observation | None:
    try:
        setup = engine_setup(dataclasses.replace(measured, max_num_batched_tokens=budget_tokens))
    except KvtuneError:
        return None  # no blocks or no max_model_len: nothing to replay on
    return load_observation(sweep.replay, sweep.load_itl_s, fit.model, setup.settings)


def _pool_tokens(m: MeasuredCapacity) -> int | None:
    if m.num_blocks is not None and m.block_size is not None:
        return m.num_blocks * m.block_size
    return m.kv_cache_tokens

