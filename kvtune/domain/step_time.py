"""How long one engine step takes:
T_step = c0 + c1·Σnᵢ + c2·Σnᵢ·(ctxᵢ + nᵢ/2) + c3·|batch| + c4·Σ(ctxᵢ + nᵢ).

nᵢ is the number of tokens request i computes this step (a prefill chunk, or 1 when decoding),
ctxᵢ the tokens it had already computed. c0 is the fixed cost of a step (launching it, reading the
weights), c1 the cost per token computed (the matmuls), c2 the attention compute per (query,
key) pair (a chunk of n tokens attends to ctx + n/2 keys on average), c3 the cost per request in
the batch (sampling, bookkeeping), c4 the cost of reading a request's KV once per step (ctx + n
tokens, whatever n is). The DistServe and BLIS forms, one formula for prefill, decode and the
mixed steps of chunked prefill (reference/scheduler-sim.md), with the KV read split from the
attention FLOPs (c4): a decoding token's attention is bound by reading its KV (c4·ctx), a prefill
chunk's by its FLOPs (c2·n·ctx); one c2 for both charged an 8,192-token chunk at 24k context
as if each of its tokens read the whole KV again (11.5 s on the roofline for Qwen3-14B on H100).
A capacity file calibrated before c4 existed has c4 = 0, and is read as before.

A silicon fit adds one more: `past_knee_s` per token a step computes past its first `knee_tokens`.
A step's matmuls read the weights once whatever its tokens until their arithmetic outgrows the read
(the GPU's ridge point, a few hundred tokens); past it each token costs its FLOPs. A straight line
c0 + c1·Σn cannot bend there: fitted to aiconfigurator's latencies it priced an 8,192-token chunk
11–17 % under them and a 512-token one 17–21 % over. kvtune.capacity.silicon picks the knee that fits
best; calibrate leaves it at 0 and fits the straight line to the steps it measured.

And one term is not a coefficient: `mixed_step_s`, paid by a step vLLM cannot replay as one CUDA
graph: one in which some request computes more than one token (a prefill chunk beside the
decodes), which runs piecewise, or one of more tokens than its largest graph
(`largest_graph_tokens`; 0: no limit), which runs eagerly; either way its host dispatches the
model layer by layer (kvtune.sim.host.VLLM_DISPATCH_PER_LAYER_S). Measured kernels and the roofline leave it out,
so it is added to their step times for vLLM; a calibrated step time measured it (inside its
fitted coefficients) and has 0.

The one home of the model: `kvtune calibrate --timing` fits it (kvtune.capacity.timing), the
capacity file stores it, the roofline estimates it, and the simulator evaluates it. The simulator
keeps time as integer femtoseconds (`StepTimeModel.ticks`), so that k decode steps summed in
closed form are exactly the sum of the k steps taken one at a time (floats would differ in the
last bit and an arrival could land on the other side of a step boundary).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from kvtune.errors import OptionError

COEFFICIENTS = ("c0", "c1", "c2", "c3", "c4")
COEFFICIENT_UNITS: dict[str, str] = {
    "c0": "s per step",
    "c1": "s per token computed",
    "c2": "s per token computed per context token",
    "c3": "s per request in the batch",
    "c4": "s per context token read (ctx + n per request per step)",
}
FORMULA = "T_step = c0 + c1*sum(n_i) + c2*sum(n_i*(ctx_i + n_i/2)) + c3*len(batch) + c4*sum(ctx_i + n_i)"
TICKS_PER_S = 10**15  # femtoseconds: exact integer clock (Python ints do not overflow)


FRONTEND_TERMS = ("request_s", "token_s")
FRONTEND_UNITS: dict[str, str] = {
    "request_s": "s of serial front-end work per request",
    "token_s": "s of serial front-end work per output token streamed",
}


class TimingSource(enum.Enum):
    """Where a step-time model came from."""

    CALIBRATED = "calibrated"
    SILICON = "silicon"  # sampled from aiconfigurator-core's measured kernels (kvtune.capacity.silicon)
    ROOFLINE = "roofline-estimate"


def step_features(batch: Iterable[tuple[int, int]]) -> np.ndarray:
    """[1, Σn, Σn(ctx + n/2), |batch|, Σ(ctx + n)] for one step of (tokens computed, context already computed)."""
    total = attention = read = 0.0
    size = 0
    for n, ctx in batch:
        total += n
        attention += n * (ctx + n / 2)
        read += ctx + n
        size += 1
    return np.array([1.0, total, attention, float(size), read])


def replays_one_graph(tokens: int, batch: int, largest_graph_tokens: int) -> bool:
    """Whether vLLM runs a step of `tokens` = Σn over `batch` requests (each computing at least
    one) as one CUDA graph: a uniform decode (Σn = |batch|) no larger than its largest graph
    (0: no limit). Any other step pays `mixed_step_s` (module docstring)."""
    return tokens == batch and not 0 < largest_graph_tokens < tokens


@dataclass(frozen=True, slots=True)
class StepTimeModel:
    """The coefficients, in seconds (units in COEFFICIENT_UNITS), and where they came from."""

    c0: float
    c1: float = 0.0
    c2: float = 0.0
    c3: float = 0.0
    c4: float = 0.0
    source: TimingSource = TimingSource.CALIBRATED
    mixed_step_s: float = 0.0  # added to a step vLLM does not replay as one CUDA graph (module docstring)
    largest_graph_tokens: int = 0  # a step of more tokens runs eagerly and pays mixed_step_s too; 0: no limit
    past_knee_s: float = 0.0  # s per token computed past the step's first knee_tokens (module docstring)
    knee_tokens: int = 0

    def __post_init__(self) -> None:
        for name in (*COEFFICIENTS, "mixed_step_s", "past_knee_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise OptionError(f"must be a finite number ≥ 0, got {value}", field=name)
        for name in ("largest_graph_tokens", "knee_tokens"):
            if getattr(self, name) < 0:
                raise OptionError(f"must be ≥ 0, got {getattr(self, name)}", field=name)

    @property
    def coefficients(self) -> np.ndarray:
        return np.array([self.c0, self.c1, self.c2, self.c3, self.c4])

    @property
    def estimate(self) -> bool:
        """True when no engine was measured: every output that uses it must say so."""
        return self.source is not TimingSource.CALIBRATED

    def step_seconds(self, batch: Iterable[tuple[int, int]]) -> float:
        """One step's time for a batch of (tokens computed this step, context already computed)."""
        features = step_features(batch)
        tokens, size = int(features[1]), int(features[3])
        graphed = replays_one_graph(tokens, size, self.largest_graph_tokens)
        return (float(features @ self.coefficients) + (0.0 if graphed else self.mixed_step_s)
                + self.past_knee_s * max(0, tokens - self.knee_tokens))

    def to_dict(self) -> dict[str, float]:
        """The coefficients, and the terms beyond them where they are not 0 (a calibrated model's
        never are): `past_knee_s` with its `knee_tokens`, `mixed_step_s` with its `largest_graph_tokens`."""
        out = {name: getattr(self, name) for name in COEFFICIENTS}
        if self.past_knee_s:
            out["past_knee_s"] = self.past_knee_s
            out["knee_tokens"] = self.knee_tokens
        if self.mixed_step_s:
            out["mixed_step_s"] = self.mixed_step_s
            out["largest_graph_tokens"] = self.largest_graph_tokens
        return out

    def ticks(self) -> StepTicks:
        """The same features in integer femtoseconds, c2 halved and applied to Σ n·(2·ctx + n)."""
        ticks = StepTicks(round(self.c0 * TICKS_PER_S), round(self.c1 * TICKS_PER_S),
                          round(self.c2 * TICKS_PER_S / 2), round(self.c3 * TICKS_PER_S),
                          round(self.c4 * TICKS_PER_S), round(self.mixed_step_s * TICKS_PER_S),
                          self.largest_graph_tokens, round(self.past_knee_s * TICKS_PER_S), self.knee_tokens)
        if ticks.c0 <= 0 and ticks.c1 <= 0 and ticks.c3 <= 0:
            raise OptionError("a step must take time: c0, c1 or c3 must be at least a femtosecond", field="c0")
        return ticks


@dataclass(frozen=True, slots=True)
class FrontEndModel:
    """vLLM's API server in front of the engine: one process (an asyncio loop) that does
    `request_s` of work per request before the engine sees it (HTTP, chat template, tokenizing)
    and `token_s` per output token on its way out (detokenizing, one SSE chunk). The requests in
    it and its output handler share it (kvtune.sim.frontend): a burst of B arrivals reaches the
    engine together after B × request_s, and tokens produced meanwhile stream at the handler's share."""

    request_s: float
    token_s: float = 0.0

    def __post_init__(self) -> None:
        for name in FRONTEND_TERMS:
            value = getattr(self, name)
            if not (math.isfinite(value) and 0 <= value <= 3600):
                raise OptionError(f"must be a finite number of seconds in [0, 3600], got {value}", field=name)

    def to_dict(self) -> dict[str, float]:
        return {name: getattr(self, name) for name in FRONTEND_TERMS}


@dataclass(frozen=True, slots=True)
class StepTicks:
    """StepTimeModel in femtoseconds; `c2_half` multiplies Σ n·(2·ctx + n), which is an integer."""

    c0: int
    c1: int
    c2_half: int
    c3: int
    c4: int = 0
    mixed: int = 0  # StepTimeModel.mixed_step_s
    largest_graph: int = 0  # StepTimeModel.largest_graph_tokens
    past_knee: int = 0  # StepTimeModel.past_knee_s
    knee: int = 0  # StepTimeModel.knee_tokens

    def step(self, tokens: int, attention2: int, batch: int, kv_read: int = 0) -> int:
        """One step: `tokens` = Σn, `attention2` = Σ n·(2·ctx + n), `batch` = |batch| (`mixed` unless
        it replays one CUDA graph: replays_one_graph), `kv_read` = Σ(ctx + n)."""
        graphed = replays_one_graph(tokens, batch, self.largest_graph)
        return (self.c0 + self.c1 * tokens + self.c2_half * attention2 + self.c3 * batch + self.c4 * kv_read
                + (0 if graphed else self.mixed) + self.past_knee * max(0, tokens - self.knee))

    def decode_first(self, batch: int, ctx_sum: int) -> int:
        """The first of a run of pure decode steps (n = 1 each) over contexts summing to ctx_sum."""
        return self.step(batch, 2 * ctx_sum + batch, batch, ctx_sum + batch)

    def decode_growth(self, batch: int) -> int:
        """How much longer each decode step of a run is than the one before (every context grew by one)."""
        return (2 * self.c2_half + self.c4) * batch

    def decode_run(self, batch: int, ctx_sum: int, k: int) -> int:
        """k decode steps in a row: step j costs first + j·decode_growth."""
        return k * self.decode_first(batch, ctx_sum) + self.decode_growth(batch) * (k * (k - 1) // 2)

    def decode_steps_before(self, batch: int, ctx_sum: int, window: int) -> int:
        """How many decode steps of a run start strictly less than `window` ticks from now."""
        if window <= 0:
            return 0
        a, d = self.decode_first(batch, ctx_sum), self.decode_growth(batch)
        # start_j = j·a + d·j(j−1)/2 < window; count j = 0, 1, ... (start_0 = 0 always counts)
        if d == 0:
            return (window - 1) // a + 1
        # solve d/2·j² + (a − d/2)·j − window = 0 for an estimate, then fix it exactly
        b = a - d / 2
        j = int((-b + math.sqrt(b * b + 2 * d * window)) / d)
        j = max(j - 2, 0)
        while j * a + d * (j * (j - 1) // 2) < window:
            j += 1
        while j > 0 and (j - 1) * a + d * ((j - 1) * (j - 2) // 2) >= window:
            j -= 1
        return j


__all__ = ["COEFFICIENTS", "COEFFICIENT_UNITS", "FORMULA", "TICKS_PER_S", "TimingSource", "StepTimeModel",
           "StepTicks", "step_features", "replays_one_graph", "FRONTEND_TERMS", "FRONTEND_UNITS", "FrontEndModel"]
