"""Recommendations for tests, built from tests/data/recommendation.json (a file recommend wrote,
trimmed) with the fields a test cares about changed, then read back strictly as recommend's
own output is: `read_recommendation` holds every edit to the file's schema."""

from __future__ import annotations

import copy
import json
from pathlib import Path

from kvtune.domain.recommendation import Recommendation
from kvtune.policy.recommendation import read_recommendation

DATA = Path(__file__).parents[1] / "data"


def rec_dict() -> dict:
    return json.loads((DATA / "recommendation.json").read_text(encoding="utf-8"))


def make_rec_dict(*, budget: int | None = None, num_blocks: int | None = None, block_size: int | None = None,
                  admitted: int | None = None, routes: list[tuple[str, int, float]] | None = None) -> dict:
    """The data file with the budget, capacity, admitted concurrency and routes
    (route name, cap, truncation share; each matched by its path) replaced where given."""
    d = rec_dict()
    if budget is not None:
        d["block_budget"]["value"] = budget
    if num_blocks is not None:
        d["capacity"].update(num_blocks=num_blocks, usable_blocks=num_blocks - 1)
    if block_size is not None:
        d["capacity"]["block_size"] = block_size
        d["settings"]["block_size"]["value"] = block_size
    if admitted is not None:
        c = d["concurrency"]
        c.update(admitted=admitted, gain=round(admitted / c["worst_case"], 3) if c["worst_case"] else None)
    if routes is not None:
        template = d["routes"][0]
        d["routes"] = []
        for name, cap, share in routes:
            route = copy.deepcopy(template)
            route.update(route=name, match={"path": name, "model": None}, truncation_share=share)
            route["max_new_tokens"]["value"] = cap
            d["routes"].append(route)
    return d


def make_rec(**changes) -> Recommendation:
    return read_recommendation(make_rec_dict(**changes), path="test recommendation")
