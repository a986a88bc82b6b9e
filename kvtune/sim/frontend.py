"""The API server in front of the simulated engine: one serial worker whose work queues.

vLLM's OpenAI server is one asyncio process: it parses each request, renders its chat template
and tokenizes it before the engine sees it, and detokenizes and streams every output token after
the engine computed it. On a few shared cores that work is not free, and it is serial: a burst
of arrivals or a busy stream delays everyone behind it. kvtune.domain.step_time.FrontEndModel gives the
costs (`request_s` per request, `token_s` per token); this is their queue, kept as a fluid
backlog of work (integer ticks, as the engine's clock) so a run of k decode steps costs one
update, not k.

  ingress(t)          a request arrives at t: its work joins the backlog; the engine sees it
                      when the backlog ahead of it and its own work are done
  emit(t, n)          a step ending at t produced n tokens: they join the backlog; a token
                      produced now reaches its client when the backlog is done
  emit_run(t0, t1, n, last)
                      n tokens produced evenly over [t0, t1] (a run of decode steps, `last` of
                      them at the final step): the backlog drains meanwhile and ends no lower
                      than the last step's tokens
"""

from __future__ import annotations

from kvtune.domain.step_time import TICKS_PER_S, FrontEndModel

# vLLM's API server when nothing calibrated it (a simulation on silicon data or the roofline):
# `kvtune calibrate --timing` against vLLM 0.32.0's own OpenAI server (vllm/entrypoints/openai,
# the same Python code path as on a GPU host: HTTP, tokenizing, the IPC hand-off to the engine core,
# the first streamed chunk), CPU build, tiny model, /v1/completions (no chat template), on kvtune's
# 2-core test machine, 2026-12-07 (tests/live/test_timing_live.py, `pytest -s` prints it): a lone
# request spends 3.57 ms outside the engine's steps, 2.69 ms of it serial work per request that
# queues (near-empty bursts); per streamed token the work hid behind the engine's steps (0).
# A server CPU core is no slower than this shared one, so these are upper figures for the API
# server itself; they are not fitted to any published GPU run.
# Per streamed token: benchmarks/host_overheads.py on vLLM 0.32.0's CPU build (2026-12-07), the API
# server's CPU time over 24 bursts of 16 to 512 /v1/chat/completions streams decoding at once, is
# 1.18 ms per request + 51.3 µs per SSE chunk + 12.6 µs per token (non-negative least squares).
# Only the per-token part is serial work every token pays: the output processor and detokenizer
# run once per token, but a stream whose client lags gets its tokens merged into one chunk
# (vLLM's RequestOutputCollector), so the chunk's 51.3 µs shrinks per token exactly when the
# server is busy (10 of the 24 bursts merged: 1,328 chunks for 8,320 tokens). token_s is 12.6 µs:
# ~79,000 tokens/s of one process, so streaming does not bound a GPU's output rate; the per-request
# figure measured here (1.18 ms) is below the calibrated 2.69 ms, which stays.
VLLM_API_SERVER = FrontEndModel(request_s=0.00269, token_s=0.0000126)
VLLM_API_SERVER_LONE_S = 0.00357  # http_overhead_s: what a lone request spends outside the steps
VLLM_API_SERVER_SOURCE = ("kvtune calibrate --timing on vLLM 0.32.0's OpenAI API server (CPU build, "
                          "tests/live/test_timing_live.py, 2026-12-07), not this deployment's")


class FrontEnd:
    """The fluid backlog of one API server; times and work in ticks."""

    __slots__ = ("request", "token", "backlog", "at")

    def __init__(self, model: FrontEndModel) -> None:
        self.request = round(model.request_s * TICKS_PER_S)
        self.token = round(model.token_s * TICKS_PER_S)
        self.backlog = 0  # work not done yet, as of `at`
        self.at = 0

    def _drain(self, t: int) -> None:
        if t > self.at:
            self.backlog = max(0, self.backlog - (t - self.at))
            self.at = t

    def ingress(self, t: int) -> int:
        """When the engine receives a request that arrived at the server at `t`."""
        self._drain(t)
        self.backlog += self.request
        return max(t, self.at) + self.backlog

    def emit(self, t: int, tokens: int) -> int:
        """When the tokens a step produced at `t` reach their clients."""
        self._drain(t)
        self.backlog += tokens * self.token
        return max(t, self.at) + self.backlog

    def emit_run(self, start: int, end: int, tokens: int, last: int) -> int:
        """When the last step's tokens of a run over [start, end] reach their clients."""
        self._drain(start)
        work = self.backlog + tokens * self.token - (end - max(start, self.at))
        self.backlog = max(last * self.token, work)
        self.at = max(end, self.at)
        return self.at + self.backlog


__all__ = ["FrontEnd", "VLLM_API_SERVER", "VLLM_API_SERVER_LONE_S", "VLLM_API_SERVER_SOURCE"]
