"""Which admission policy a gateway enforces: gateway.yaml's and recommendation.json's `admission`.

    guaranteed              reserve max(n, best_of) x ceil((prompt + cap) / block_size) for the
                            request's whole life, never over the budget (the default)
    overcommit, factor k    the same reservation, held against floor(k x budget) (k >= 1): trades
                            preemptions for throughput, with k chosen by simulation
    statistical, epsilon    admit while the probability that the admitted requests' KV outgrows
                            the budget stays <= epsilon (kvtune.gateway.overflow states the rule);
                            epsilon 0 is guaranteed exactly

A request that no ledger state could ever admit (413) is one the policy refuses in an empty
ledger: more blocks than the budget for guaranteed, than floor(k x budget) for overcommit (the
limit the reservations are held against, so what k lets several requests bet on, it lets one
request bet on too), and for statistical one whose own overflow probability alone exceeds
epsilon (at epsilon 0: more blocks than the budget).

Pure data, read strictly by `parse_admission` (one error naming the field) from either file.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvtune.domain.fields import not_one_of
from kvtune.userfiles import brief

#: The largest overcommit factor accepted: beyond it the budget means nothing.
MAX_FACTOR = 64.0


class PolicyKind(enum.Enum):
    GUARANTEED = "guaranteed"
    OVERCOMMIT = "overcommit"
    STATISTICAL = "statistical"


#: The policies as the files spell them.
POLICY_NAMES = tuple(k.value for k in PolicyKind)
_KEYS = {PolicyKind.GUARANTEED: ("policy",), PolicyKind.OVERCOMMIT: ("policy", "factor"),
         PolicyKind.STATISTICAL: ("policy", "epsilon")}


@dataclass(frozen=True, slots=True)
class AdmissionPolicy:
    """One policy and its parameter: `factor` for overcommit, `epsilon` for statistical."""

    kind: PolicyKind = PolicyKind.GUARANTEED
    factor: float = 1.0
    epsilon: float = 0.0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.factor) and 1.0 <= self.factor <= MAX_FACTOR):
            raise ValueError(f"factor must be in [1, {MAX_FACTOR:g}], got {self.factor!r}")
        if not (math.isfinite(self.epsilon) and 0.0 <= self.epsilon < 1.0):
            raise ValueError(f"epsilon must be in [0, 1), got {self.epsilon!r}")
        if self.kind is not PolicyKind.OVERCOMMIT and self.factor != 1.0:
            raise ValueError(f"factor is for overcommit, not {self.kind.value}")
        if self.kind is not PolicyKind.STATISTICAL and self.epsilon != 0.0:
            raise ValueError(f"epsilon is for statistical, not {self.kind.value}")

    @classmethod
    def overcommit(cls, factor: float) -> AdmissionPolicy:
        return cls(PolicyKind.OVERCOMMIT, factor=float(factor))

    @classmethod
    def statistical(cls, epsilon: float) -> AdmissionPolicy:
        return cls(PolicyKind.STATISTICAL, epsilon=float(epsilon))

    @property
    def name(self) -> str:
        return self.kind.value

    def limit_blocks(self, budget_blocks: int) -> int:
        """What the worst-case reservations are held against: floor(factor x budget) for
        overcommit, the budget for the others (statistical goes beyond it only on its probability)."""
        if self.kind is PolicyKind.OVERCOMMIT:
            return max(budget_blocks, math.floor(self.factor * budget_blocks))
        return budget_blocks

    def to_dict(self) -> dict[str, Any]:
        """`{"policy": ...}` plus its parameter, as both files write it."""
        out: dict[str, Any] = {"policy": self.kind.value}
        if self.kind is PolicyKind.OVERCOMMIT:
            out["factor"] = self.factor
        elif self.kind is PolicyKind.STATISTICAL:
            out["epsilon"] = self.epsilon
        return out

    def describe(self) -> str:
        """One line for comments and reports."""
        if self.kind is PolicyKind.OVERCOMMIT:
            return f"overcommit: worst-case reservations held against {self.factor:g} x the budget"
        if self.kind is PolicyKind.STATISTICAL:
            return f"statistical: admitted while P(KV outgrows the budget) <= {self.epsilon:g}"
        return "guaranteed: worst-case reservations never exceed the budget"


GUARANTEED = AdmissionPolicy()


def parse_admission(value: Any, fail: Callable[[str, str], Exception], where: str = "admission") -> AdmissionPolicy:
    """A parsed `admission` mapping, validated: `fail(field, message)` builds the error raised."""
    if not isinstance(value, dict):
        raise fail(where, f"expected a mapping such as {{policy: guaranteed}}, got {brief(value)}")
    given = value.get("policy")
    if given is None:
        raise fail(f"{where}.policy", f"missing (one of {', '.join(POLICY_NAMES)})")
    problem = not_one_of(given, POLICY_NAMES)
    if problem:
        raise fail(f"{where}.policy", problem)
    kind = PolicyKind(given)
    allowed = _KEYS[kind]
    for key in value:
        if key not in allowed:
            name = key if isinstance(key, str) and key.isprintable() and len(key) <= 40 else brief(key, 40)
            raise fail(f"{where}.{name}", f"unknown key for policy {given} (allowed: {', '.join(allowed)})")
    if kind is PolicyKind.OVERCOMMIT:
        factor = _number(value.get("factor"), f"{where}.factor", fail)
        if not 1.0 <= factor <= MAX_FACTOR:
            raise fail(f"{where}.factor", f"must be in [1, {MAX_FACTOR:g}], got {brief(value.get('factor'))}")
        return AdmissionPolicy.overcommit(factor)
    if kind is PolicyKind.STATISTICAL:
        epsilon = _number(value.get("epsilon"), f"{where}.epsilon", fail)
        if not 0.0 <= epsilon < 1.0:
            raise fail(f"{where}.epsilon", f"must be at least 0 and below 1, got {brief(value.get('epsilon'))}")
        return AdmissionPolicy.statistical(epsilon)
    return GUARANTEED


def _number(value: Any, where: str, fail: Callable[[str, str], Exception]) -> float:
    if value is None:
        raise fail(where, "missing")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise fail(where, f"expected a number, got {brief(value)}")
    if isinstance(value, float) and not math.isfinite(value):
        raise fail(where, f"expected a finite number, got {brief(value)}")
    return float(value)


__all__ = ["AdmissionPolicy", "PolicyKind", "POLICY_NAMES", "GUARANTEED", "MAX_FACTOR", "parse_admission"]
