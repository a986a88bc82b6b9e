"""kvtune.policy.feasibility: the one verdict recommend, check and capacity share."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kvtune.policy import feasibility
from kvtune.policy.recommendation import read_recommendation


@given(st.sampled_from(["vllm", "sglang", "trtllm"]), st.integers(0, 5000), st.sampled_from([1, 16, 32, 128]),
       st.integers(1, 200_000), st.integers(0, 6000), st.integers(1, 300))
def test_each_condition_fails_exactly_when_its_arithmetic_says(engine, pool, block, mml, budget, smallest):
    v = feasibility.verdict(engine, pool_blocks=pool, block_size=block, max_model_len=mml, budget_blocks=budget,
                            smallest_reservation_blocks=smallest, fix="x")
    usable = max(0, pool - 1)
    # vLLM's startup check: cdiv(max_model_len, block) blocks must fit the pool less its null block
    held = usable * block if engine == "vllm" else pool * block
    engine_fails = -(-mml // block) > usable if engine == "vllm" else mml > held
    codes = {r.code for r in v.reasons}
    assert (feasibility.ENGINE_REFUSES in codes or feasibility.ENGINE_SHORTENS in codes) == engine_fails
    assert (feasibility.BUDGET_ADMITS_NOTHING in codes) == (smallest > budget)
    assert (feasibility.POOL_BELOW_BUDGET in codes) == (budget > usable)
    assert v.fits == (not codes) and (v.fix is None) == v.fits and (v.why is None) == v.fits
    assert v.longest_held_tokens == held


def test_the_verdict_reads_back_from_recommendation_json(tmp_path):
    import json
    from pathlib import Path

    data = json.loads((Path(__file__).parents[1] / "data" / "recommendation.json").read_text())
    v = feasibility.verdict("vllm", pool_blocks=204, block_size=16, max_model_len=131072, budget_blocks=182,
                            smallest_reservation_blocks=8, longest_request_tokens=32885, fix="fits with --tp 4")
    data["feasibility"] = v.to_dict()
    rec = read_recommendation(data)
    assert rec.feasibility == v and rec.to_dict()["feasibility"] == v.to_dict()
    del data["feasibility"]  # a file written before the field: no verdict
    assert read_recommendation(data).feasibility is None
