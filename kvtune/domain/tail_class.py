"""The tail class of an output distribution: light or heavy. kvtune.profile decides it (its
TAIL_RULE); the rules pick a cap by it and recommendation.json records it per route."""

from __future__ import annotations

import enum

__all__ = ["TailClass", "TAIL_CLASSES"]


class TailClass(enum.Enum):
    """How an output distribution's tail decays against an exponential's (kvtune.profile.routes'
    TAIL_RULE); the values are the words profile and recommendation JSON use."""

    LIGHT = "light"
    HEAVY = "heavy"


TAIL_CLASSES = tuple(t.value for t in TailClass)
