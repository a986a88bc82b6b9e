"""How a client retries a 429 (or a 503 with Retry-After): bench's client does it, the simulator's
clients do the same, so the policy lives on the floor."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["RetryPolicy"]


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """Retry 429 (and 503 that carries Retry-After) up to `max_retries` times, waiting as told."""

    enabled: bool = False
    max_retries: int = 3
    default_wait_s: float = 1.0
    max_wait_s: float = 30.0
