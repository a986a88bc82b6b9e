"""What a simulation reports: per request (columns), per step (optional), and totals.

Times are seconds from the start of the simulation; NaN means "never" (a request refused
before it reached the engine has no first token).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvtune.sim.requests import Outcome

OUTCOMES = (Outcome.OK, Outcome.HTTP_429, Outcome.REJECTED, Outcome.NOT_SENT)  # outcome codes index this


@dataclass(frozen=True, slots=True)
class RequestResult:
    """One request's life: arrival, first scheduled, first token, finish, tokens, preemptions, retries."""

    arrival_s: float
    first_scheduled_s: float
    first_token_s: float
    finish_s: float
    output_tokens: int
    preemptions: int
    retries: int
    outcome: Outcome


@dataclass(frozen=True, slots=True)
class RequestColumns:
    """Every request's result as columns (a million RequestResult objects would be slow)."""

    arrival_s: np.ndarray  # when it reached the admission (closed loop: when its client sent it); NaN if never
    first_scheduled_s: np.ndarray
    first_token_s: np.ndarray
    finish_s: np.ndarray
    output_tokens: np.ndarray
    preemptions: np.ndarray
    retries: np.ndarray
    outcome: np.ndarray  # codes into OUTCOMES
    retry_wait_s: np.ndarray  # seconds its client waited on Retry-After, in all

    def __len__(self) -> int:
        return len(self.arrival_s)

    def row(self, i: int) -> RequestResult:
        return RequestResult(float(self.arrival_s[i]), float(self.first_scheduled_s[i]),
                             float(self.first_token_s[i]), float(self.finish_s[i]), int(self.output_tokens[i]),
                             int(self.preemptions[i]), int(self.retries[i]), OUTCOMES[int(self.outcome[i])])


@dataclass(frozen=True, slots=True)
class StepSeries:
    """One row per simulated step, or per run of identical decode steps (`repeat` > 1): when it
    started, tokens per step, running/waiting at schedule time, blocks in use after allocation."""

    start_s: np.ndarray
    repeat: np.ndarray
    tokens: np.ndarray
    running: np.ndarray
    waiting: np.ndarray
    blocks_used: np.ndarray


@dataclass(frozen=True, slots=True)
class Decision:
    """One step as the scheduler decided it: (request, tokens) in order, preempted, finished."""

    start_s: float
    scheduled: tuple[tuple[int, int], ...]
    preempted: tuple[int, ...]
    finished: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class SimResult:
    """`preemptions` (and each request's) counts the engine's evictions whatever the engine:
    vLLM's preemptions, SGLang's retractions, TensorRT-LLM MAX_UTILIZATION's pauses; the pool
    (`usable_blocks`, `blocks_used_peak`) is in the engine's unit: vLLM's blocks, SGLang's
    tokens, TensorRT-LLM's blocks of tokens_per_block."""

    requests: RequestColumns
    steps: StepSeries | None
    decisions: tuple[Decision, ...] | None
    duration_s: float  # end of the last step (or the last refusal)
    num_steps: int
    preemptions: int
    usable_blocks: int
    blocks_used_peak: int
    running_peak: int
    waiting_peak: int  # the engine's waiting queue
    admission_waiting_peak: int  # the admission's own queue, when it has one
    events: int  # arrivals + retries + scheduled steps + decode runs skipped over
    wall_s: float

    @property
    def kv_usage_peak(self) -> float:
        return self.blocks_used_peak / self.usable_blocks


__all__ = ["RequestResult", "RequestColumns", "StepSeries", "Decision", "SimResult", "OUTCOMES"]
