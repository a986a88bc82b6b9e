"""kvtune's vLLM memory estimate against public vLLM startups (tests/data/vllm-startups.csv).

`benchmarks/startup_estimates.py` holds how each row is read (preset, release, defaults) and
prints the table; here each row's error is held to a tolerance, the median to the goal of
issue #14, and each failed startup to a failed estimate.
"""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest
from script_module import load_script

from kvtune.errors import CapacityError

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "startup_estimates.py"
# The goal: the median relative error of the KV-pool estimate over the positive rows (issue #14).
MEDIAN_GOAL = 0.10
# One row may miss by twice the goal: the rows differ in what the profile does beyond the model
# (an LMCache connector, NCCL on PCIe rather than NVLink, the GPU total vLLM sees).
ROW_TOLERANCE = 0.20


bench = load_script(SCRIPT)
RESULTS = {r.startup.label or r.startup.key.strip(): r for r in bench.estimates()}
POSITIVE = [k for k, r in RESULTS.items() if not r.startup.negative]


def test_every_usable_row_of_the_excerpt_is_read():
    rows = bench.load_rows()
    assert len(rows) == 7  # the excerpt holds exactly the usable rows
    assert {bench.row_for(s, rows)["source"] for s in bench.STARTUPS} == set(rows)


@pytest.mark.parametrize("key", [
    k if RESULTS[k].startup.modelled else pytest.param(k, marks=pytest.mark.xfail(
        strict=True, reason=f"outside the modelled releases: {RESULTS[k].startup.outside}"))
    for k in POSITIVE
])
def test_estimate_is_within_tolerance_of_the_startup(key):
    r = RESULTS[key]
    assert r.error is None
    assert abs(r.relative_error) <= ROW_TOLERANCE, (
        f"{key}: estimated {r.estimated_kv_bytes / 2**30:.2f} GiB, measured {r.measured_kv_bytes / 2**30:.2f} GiB")


def test_median_error_over_the_startups_meets_the_goal():
    errors = [abs(RESULTS[k].relative_error) for k in POSITIVE]
    assert len(errors) == 6
    assert statistics.median(errors) <= MEDIAN_GOAL
    modelled = [abs(RESULTS[k].relative_error) for k in POSITIVE if RESULTS[k].startup.modelled]
    assert statistics.median(modelled) <= MEDIAN_GOAL / 2


def test_each_estimate_names_the_release_it_assumes():
    for key in POSITIVE:
        report = RESULTS[key].report
        assert report.engine_version == RESULTS[key].startup.engine_version
        assert any(a.startswith(f"memory model: vLLM {report.engine_version} ") for a in report.assumptions)


def test_releases_outside_the_model_tell_the_user_to_measure():
    for key in POSITIVE:
        r = RESULTS[key]
        if not r.startup.modelled:
            assert any("measure the capacity" in a for a in r.report.assumptions), key
            assert r.relative_error > 0  # the estimate is the larger: vLLM charged memory kvtune cannot see


def test_a_startup_with_no_room_for_kv_fails_the_estimate_too():
    """vllm#13882: 8 GiB × 0.7 less 5.20 GiB of weights left −1.05 GiB for KV; vLLM stopped."""
    r = RESULTS["vllm-project/vllm#13882"]
    assert r.report is None and isinstance(r.error, CapacityError)
    assert "weights + overhead exceed the usable memory per GPU" in r.error.message
    # the overhead kvtune charged, next to vLLM's non_torch 0.03 + activation peak 1.42 GiB
    overhead = float(r.error.message.split("GiB + overhead ")[1].split(" GiB")[0])
    assert abs(overhead - 1.45) / 1.45 <= ROW_TOLERANCE


def test_a_startup_that_could_not_hold_one_request_is_refused_by_the_estimate_too():
    """vllm#27508: gpt-oss-120b on one H100 at 0.95 had 1.71 GiB, too little for max_model_len 131,072."""
    c = RESULTS["vllm-project/vllm#27508"].report.capacity
    assert c.max_concurrency_at_max_model_len < 1
    assert any("vLLM would refuse to start" in n for n in c.notes)
