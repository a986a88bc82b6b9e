"""How long one engine step takes, from what the step computes.

T = c0 + c1·Σnᵢ + c2·Σnᵢ·(ctxᵢ + nᵢ/2) + c3·|batch|, where nᵢ is the number of tokens request i
computes in the step and ctxᵢ the tokens it had computed before: a fixed cost, a per-token
(weights/MLP) cost, an attention cost that grows with the context each new token attends to,
and a per-sequence cost. Calibration fits the coefficients; the simulator only evaluates them.

The simulator keeps time as integer femtoseconds, so that k decode steps summed in closed form
are exactly the sum of the k steps taken one at a time (floats would differ in the last bit and
an arrival could land on the other side of a step boundary).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from kvtune.errors import OptionError

TICKS_PER_S = 10**15  # femtoseconds: exact integer clock, 2^63 fs ≈ 2.5 hours but Python ints do not overflow


@dataclass(frozen=True, slots=True)
class StepTime:
    """Step-time coefficients, in seconds (per token, per token² of attention, per sequence)."""

    c0_s: float
    c1_s_per_token: float = 0.0
    c2_s_per_token_ctx: float = 0.0
    c3_s_per_seq: float = 0.0

    def __post_init__(self) -> None:
        for name in ("c0_s", "c1_s_per_token", "c2_s_per_token_ctx", "c3_s_per_seq"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise OptionError(f"must be a finite number ≥ 0, got {value!r}", field=name)
        if self.c0_s <= 0 and self.c1_s_per_token <= 0 and self.c3_s_per_seq <= 0:
            raise OptionError("a step must take time: c0_s, c1_s_per_token or c3_s_per_seq must be > 0",
                              field="c0_s")

    def step_s(self, new_tokens: Sequence[int], computed_tokens: Sequence[int]) -> float:
        """Duration of one step in which request i computes new_tokens[i] after computed_tokens[i]."""
        total = sum(new_tokens)
        attention = sum(n * (c + n / 2) for n, c in zip(new_tokens, computed_tokens, strict=True))
        return (self.c0_s + self.c1_s_per_token * total + self.c2_s_per_token_ctx * attention
                + self.c3_s_per_seq * len(new_tokens))

    def ticks(self) -> StepTicks:
        """The same model in integer femtoseconds (c2 halved, applied to Σ n·(2·ctx + n))."""
        ticks = StepTicks(round(self.c0_s * TICKS_PER_S), round(self.c1_s_per_token * TICKS_PER_S),
                          round(self.c2_s_per_token_ctx * TICKS_PER_S / 2), round(self.c3_s_per_seq * TICKS_PER_S))
        if ticks.c0 <= 0 and ticks.c1 <= 0 and ticks.c3 <= 0:
            raise OptionError("a step must take at least a femtosecond", field="c0_s")
        return ticks


@dataclass(frozen=True, slots=True)
class StepTicks:
    """StepTime in femtoseconds; `c2_half` multiplies Σ n·(2·ctx + n), which is an integer."""

    c0: int
    c1: int
    c2_half: int
    c3: int

    def step(self, tokens: int, attention2: int, batch: int) -> int:
        """One step: `tokens` = Σn, `attention2` = Σ n·(2·ctx + n), `batch` = |batch|."""
        return self.c0 + self.c1 * tokens + self.c2_half * attention2 + self.c3 * batch

    def decode_first(self, batch: int, ctx_sum: int) -> int:
        """The first of a run of pure decode steps (n = 1 each) over contexts summing to ctx_sum."""
        return self.step(batch, 2 * ctx_sum + batch, batch)

    def decode_run(self, batch: int, ctx_sum: int, k: int) -> int:
        """k decode steps in a row: each context grows by one, so step j costs first + j·2·c2_half·batch."""
        growth = 2 * self.c2_half * batch
        return k * self.decode_first(batch, ctx_sum) + growth * (k * (k - 1) // 2)

    def decode_steps_before(self, batch: int, ctx_sum: int, window: int) -> int:
        """How many decode steps of a run start strictly less than `window` ticks from now."""
        if window <= 0:
            return 0
        a, d = self.decode_first(batch, ctx_sum), 2 * self.c2_half * batch
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


__all__ = ["StepTime", "StepTicks", "TICKS_PER_S"]
