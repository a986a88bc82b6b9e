"""What an admitted request's sequences may reach: the gateway's admission builds it, every ledger
(block, statistical, shared) takes it, so it sits below them all rather than in one of them."""

from __future__ import annotations

from dataclasses import dataclass

from kvtune.domain.output_law import OutputLaw

__all__ = ["Demand"]


@dataclass(frozen=True, slots=True)
class Demand:
    """What an admitted request's sequences may reach, for the statistical ledger."""

    prompts: tuple[int, ...]  # prompt tokens of each sequence the engine runs (copies included)
    cap: int  # output tokens each may generate at most
    law: OutputLaw | None = None  # its route's output law; None: every sequence reaches its cap
