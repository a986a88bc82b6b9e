"""`recommend --objective` never buys throughput by truncating answers (issue #25, item 6): a
row whose caps cut more answers than --max-truncation (default: what the tail cap rule cuts) is
infeasible, and goodput counts an answer cut by a cap the client did not ask for as not met.
Qwen3-8B with reasoning-length outputs on the CPU test bed's calibrated capacity file."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from objective_logs import CPU_CAPACITY, MODEL, objective_log, reasoning_log

import kvtune
from kvtune.cli import cli
from kvtune.domain.whatif import Goal
from kvtune.policy.recommend import RecommendOptions
from kvtune.policy.search import GUARANTEED, ObjectiveSpec, SearchGrid, recommend_for_objective, tail_rule_truncation

QWEN = "/work/shared/configs/Qwen3-8B.json"


@pytest.fixture(scope="module")
def log(tmp_path_factory):
    return reasoning_log(tmp_path_factory.mktemp("reasoning") / "qwen3-reasoning.jsonl")


def recommend(log: str, *args: str):
    return CliRunner(env={"COLUMNS": "250"}).invoke(cli, [
        "recommend", log, "--model", QWEN, "--capacity", CPU_CAPACITY, "--requests", "300", "--concurrency", "32",
        *args], catch_exceptions=False)


def test_the_chosen_row_cuts_no_more_than_the_tail_rule(log):
    result = recommend(log, "--objective", "throughput", "--max-preemption-rate", "0.01", "--json")
    assert result.exit_code == 0, result.output
    rec = json.loads(result.stdout)["recommendation"]
    rows, limit = rec["what_if"], rec["objective"]["max_truncation"]
    tail = {r["predicted"]["truncation_share"] for r in rows if r["cap_level"] == "tail" and not r["reference"]}
    assert limit == max(tail) == pytest.approx(0.05, abs=0.01)  # the tail rule: p95 of a light tail
    [chosen] = [r for r in rows if r["chosen"]]
    assert chosen["predicted"]["truncation_share"] <= limit
    # without the bound the p90 rows (10 % of answers cut) won: statistical ε=0.05 at p90
    p90 = [r for r in rows if r["cap_level"] == "p90"]
    assert p90 and all(r["predicted"]["truncation_share"] > limit for r in p90)
    for r in p90:
        assert not r["feasible"] and not r["chosen"]
        assert {"constraint": "max_truncation", "limit": limit,
                "value": r["predicted"]["truncation_share"]} in r["violations"]
    # every row, engine rows included, shows the share its caps cut; uncapped rows cut none
    for r in rows:
        assert 0 <= r["predicted"]["truncation_share"] <= 1
        if all(c is None for c in r["caps"].values()):
            assert r["predicted"]["truncation_share"] == 0


def test_the_terminal_says_why_a_truncating_row_is_infeasible(log):
    result = recommend(log, "--objective", "throughput", "--max-preemption-rate", "0.01")
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert "within preemption rate ≤ 1.0%, answers truncated by the caps ≤ 5.0%" in out
    assert out.count("✗ truncated 10.0% > 5.0%") >= 5  # the p90 rows, their verdict says why
    headline = out.splitlines()[1]
    assert "caps p90" not in headline and "5.0% truncated" in headline, headline


def test_max_truncation_bounds_every_row(log):
    result = recommend(log, "--objective", "throughput", "--max-truncation", "0.02", "--json")
    assert result.exit_code == 0, result.output
    rec = json.loads(result.stdout)["recommendation"]
    assert rec["objective"]["max_truncation"] == 0.02
    # the caps are raised to the smallest cap within 2 %, so no candidate cuts more
    assert all(r["predicted"]["truncation_share"] <= 0.02 for r in rec["what_if"])


def test_compare_engines_rows_show_their_truncation(log):
    result = recommend(log, "--objective", "throughput", "--compare-engines", "--json", "--requests", "100")
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)["recommendation"]["what_if"]
    engines = {r["policy"].get("engine"): r for r in rows if r["policy"]["kind"] == "engine"}
    assert engines["sglang"]["predicted"]["truncation_share"] == 0  # uncapped
    capped = engines["trtllm-gne"]
    assert capped["predicted"]["truncation_share"] > 0 and capped["cap_level"] == "tail"


def test_goodput_counts_a_truncated_answer_as_not_met(log):
    # an SLO every completed request meets: goodput is then completed requests/s, less the cut ones
    result = recommend(log, "--objective", "goodput", "--slo", "ttft=1000000,e2e=1000000",
                       "--max-truncation", "0.2", "--json")
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)["recommendation"]["what_if"]
    direct = rows[0]["predicted"]
    assert rows[0]["policy"]["kind"] == "direct" and direct["truncation_share"] == 0
    assert direct["goodput_rps"] == pytest.approx(direct["requests_per_s"], rel=1e-3)
    p90 = [r["predicted"] for r in rows if r["cap_level"] == "p90"]
    assert p90
    for p in p90:  # ~10 % of answers cut at the p90 cap: not met, though fast
        assert p["goodput_rps"] < 0.95 * p["requests_per_s"], p



def test_simulated_goodput_misses_the_answers_a_gateway_cap_cut(log, tmp_path):
    # the gateway.yaml recommend renders (tail caps) in front, an SLO every request meets in time
    out = tmp_path / "deploy"
    assert CliRunner().invoke(cli, ["recommend", log, "--model", QWEN, "--capacity", CPU_CAPACITY, "--out",
                                    str(out)]).exit_code == 0
    base = ["simulate", log, "--capacity", CPU_CAPACITY, "--concurrency", "8", "--requests", "300", "--slo",
            "ttft=1000000,e2e=1000000", "--json"]
    direct = json.loads(CliRunner().invoke(cli, base, catch_exceptions=False).stdout)
    gated = json.loads(CliRunner().invoke(cli, [*base, "--gateway", str(out / "gateway.yaml")],
                                          catch_exceptions=False).stdout)
    assert direct["requests"]["completed"] == gated["requests"]["completed"] == 300
    assert direct["goodput"]["requests_met"] == 300  # nothing cut straight to the engine
    assert gated["output_tokens_total"] < gated["output_tokens_requested_total"]  # the caps cut some answers
    assert 0 < 300 - gated["goodput"]["requests_met"] <= 0.1 * 300  # those, and only those, missed
    assert gated["goodput"]["attainment"] < direct["goodput"]["attainment"]


def test_check_holds_a_deployment_to_the_truncation_bound(log, tmp_path):
    out = tmp_path / "deploy"
    result = recommend(log, "--objective", "throughput", "--max-preemption-rate", "0.01", "--requests", "100",
                       "--out", str(out))
    assert result.exit_code == 0, result.output
    rec = json.loads((out / "recommendation.json").read_text())
    [route] = rec["routes"]
    p90 = next(r for r in rec["what_if"] if r["cap_level"] == "p90")["caps"][route["route"]]
    gateway = (out / "gateway.yaml").read_text()
    edited = tmp_path / "gateway.yaml"  # the cap lowered to the p90 the search refused
    cap = route["max_new_tokens"]["value"]
    edited.write_text(gateway.replace(f"max_new_tokens: {cap}\n", f"max_new_tokens: {p90}\n"))
    checked = CliRunner().invoke(cli, ["check", str(out / "recommendation.json"), "--model", QWEN, "--deployed",
                                       str(out / "vllm-serve.sh"), "--deployed", str(edited)])
    assert checked.exit_code == 1
    limit = rec["objective"]["max_truncation"]
    assert f"RISK objective-missed [{edited}]: simulated truncated 10.0% > {limit:.1%}" in checked.stdout
    kept = CliRunner().invoke(cli, ["check", str(out / "recommendation.json"), "--model", QWEN, "--deployed",
                                    str(out / "vllm-serve.sh"), "--deployed", str(out / "gateway.yaml")])
    assert kept.exit_code == 0 and "objective-met" in kept.stdout and "of answers cut by the caps" in kept.stdout


def test_a_grid_without_the_tail_level_is_held_to_the_tail_rule(tmp_path):
    # the library's search on a narrowed grid (no tail-rule row to read the bound from)
    profile = kvtune.profile_logs([objective_log(tmp_path / "log.jsonl")])
    plan = kvtune.plan(kvtune.Deployment(MODEL), measured=kvtune.measured_capacity(capacity_file=CPU_CAPACITY))
    grid = SearchGrid(cap_levels=("p90", "p99"), safety_fractions=(0.9,), policies=(GUARANTEED,))
    rec = recommend_for_objective(profile, plan, RecommendOptions(),
                                  ObjectiveSpec(Goal.THROUGHPUT, concurrency=8, requests=50, seeds=1), grid=grid)
    assert rec.objective is not None and rec.chosen is not None
    assert rec.objective.max_truncation == tail_rule_truncation(rec.objective.traffic) > 0
    assert rec.chosen.cap_level == "p99"
    [p90] = [r for r in rec.what_if if r.cap_level == "p90"]
    assert not p90.feasible
