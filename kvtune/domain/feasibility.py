"""The feasibility verdict as data: whether a deployment runs the logged traffic, and when not,
why and one line that would fix it. kvtune.policy.feasibility decides it (`verdict`) and
re-decides it when a recommendation is read back; recommend, check and capacity report it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvtune.domain.deployment import ENGINES
from kvtune.domain.fields import Fields

__all__ = ["Reason", "Verdict"]


@dataclass(frozen=True, slots=True)
class Reason:
    """One failed condition: its code (a `check` finding's code) and what it means, numbers filled in."""

    code: str
    text: str

    def to_dict(self) -> dict[str, str]:
        return {"code": self.code, "text": self.text}


@dataclass(frozen=True, slots=True)
class Verdict:
    """Whether the deployment runs the logged traffic; when not, why and one line that would fix it.
    `longest_held_tokens` is the longest max_model_len the engine serves from the pool (the
    engine's rule, kvtune.policy.feasibility.longest_held_tokens)."""

    engine: str
    pool_blocks: int
    block_size: int
    max_model_len: int
    longest_held_tokens: int
    budget_blocks: int | None = None
    smallest_reservation_blocks: int | None = None
    longest_request_tokens: int | None = None  # the longest logged prompt + its route's cap
    reasons: tuple[Reason, ...] = ()
    fix: str | None = None

    @property
    def fits(self) -> bool:
        return not self.reasons

    @property
    def why(self) -> str | None:
        """The reasons as one sentence (None when it fits)."""
        return "; ".join(r.text for r in self.reasons) or None

    def to_dict(self) -> dict[str, Any]:
        return {"fits": self.fits, "why": self.why, "reasons": [r.to_dict() for r in self.reasons],
                "fix": self.fix, "engine": self.engine, "pool_blocks": self.pool_blocks,
                "block_size": self.block_size, "max_model_len": self.max_model_len,
                "longest_held_tokens": self.longest_held_tokens, "budget_blocks": self.budget_blocks,
                "smallest_reservation_blocks": self.smallest_reservation_blocks,
                "longest_request_tokens": self.longest_request_tokens}

    @classmethod
    def read(cls, f: Fields) -> Verdict:
        """As written. Its reasons are derived from the rest: kvtune.policy.recommendation decides
        them again when it reads a recommendation.json (`fits` and `why` are never read)."""
        return cls(f.choice("engine", ENGINES), f.integer("pool_blocks"), f.integer("block_size", minimum=1),
                   f.integer("max_model_len", minimum=1), f.integer("longest_held_tokens"),
                   f.integer("budget_blocks", optional=True), f.integer("smallest_reservation_blocks", optional=True),
                   f.integer("longest_request_tokens", optional=True),
                   tuple(Reason(r.string("code", nonempty=True), r.string("text")) for r in f.items("reasons")),
                   f.string("fix", optional=True))
