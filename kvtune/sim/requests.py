"""What the simulator is asked to serve: requests as columns, so a million of them stay cheap.

A request is its arrival (seconds from the start), its prompt length, the number of tokens it
will generate (the target length, already capped: the simulated model never stops early), and
optionally the max_tokens it is sent with, which is what a gateway reserves for (unset: the
engine's default, max_model_len − prompt).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvtune.errors import OptionError


@dataclass(frozen=True, slots=True)
class SimRequest:
    """One request: when it arrives, how long its prompt is, how many tokens it generates."""

    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    max_tokens: int | None = None


class Outcome(enum.Enum):
    """How a simulated request ended."""

    OK = "ok"
    HTTP_429 = "429"  # refused by the admission in front of the engine, retries exhausted
    REJECTED = "rejected"  # can never be served: prompt past the context (400) or past the budget (413)
    NOT_SENT = "not-sent"  # closed loop: the run's duration ended before a client sent it


@dataclass(frozen=True, slots=True)
class Workload:
    """Requests as equal-length integer/float columns; max_tokens −1 means unset."""

    arrival_s: np.ndarray
    prompt_tokens: np.ndarray
    output_tokens: np.ndarray
    max_tokens: np.ndarray

    def __post_init__(self) -> None:
        n = len(self.arrival_s)
        for name in ("prompt_tokens", "output_tokens", "max_tokens"):
            if len(getattr(self, name)) != n:
                raise OptionError(f"has {len(getattr(self, name))} rows, arrival_s has {n}", field=name)
        if n and not np.all(np.isfinite(self.arrival_s)):
            raise OptionError("must be finite", field="arrival_s")
        if n and (self.arrival_s.min() < 0):
            raise OptionError("must be ≥ 0", field="arrival_s")
        if n and self.prompt_tokens.min() < 1:
            raise OptionError("must be at least 1", field="prompt_tokens")
        if n and self.output_tokens.min() < 1:
            raise OptionError("must be at least 1", field="output_tokens")

    def __len__(self) -> int:
        return len(self.arrival_s)

    @classmethod
    def from_columns(cls, arrival_s, prompt_tokens, output_tokens, max_tokens=None) -> Workload:
        """Columns from anything array-like; `max_tokens` None means unset for every request."""
        arrival = np.asarray(arrival_s, dtype=np.float64)
        cap = (np.full(len(arrival), -1, dtype=np.int64) if max_tokens is None
               else np.asarray(max_tokens, dtype=np.int64))
        return cls(arrival, np.asarray(prompt_tokens, dtype=np.int64), np.asarray(output_tokens, dtype=np.int64), cap)

    @classmethod
    def from_requests(cls, requests: Sequence[SimRequest]) -> Workload:
        return cls.from_columns([r.arrival_s for r in requests], [r.prompt_tokens for r in requests],
                                [r.output_tokens for r in requests],
                                [-1 if r.max_tokens is None else r.max_tokens for r in requests])

    def request(self, i: int) -> SimRequest:
        cap = int(self.max_tokens[i])
        return SimRequest(float(self.arrival_s[i]), int(self.prompt_tokens[i]), int(self.output_tokens[i]),
                          None if cap < 0 else cap)


__all__ = ["SimRequest", "Workload", "Outcome"]
