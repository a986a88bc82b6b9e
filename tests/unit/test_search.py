"""`recommend --objective` as a library: the chosen row is the best feasible one, infeasible
objectives say so with the table, a seed gives the same table, the document reads back strictly,
and `check` simulates a deployment against the objective it was rendered for."""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from objective_logs import CPU_CAPACITY, MODEL, objective_log

import kvtune
from kvtune.deploy.check import Severity
from kvtune.domain.fields import Fields
from kvtune.domain.recommendation import Recommendation
from kvtune.domain.slo import Slo
from kvtune.domain.whatif import Goal, Policy, PolicyKind, Predicted, WhatIfRow
from kvtune.errors import InputError, OptionError
from kvtune.policy.recommendation import read_recommendation
from kvtune.policy.search import GUARANTEED, InfeasibleObjectiveError, SearchGrid
from kvtune.policy.whatif import compute_bound_note


@pytest.fixture(scope="module")
def profile(tmp_path_factory):
    return kvtune.profile_logs([objective_log(tmp_path_factory.mktemp("logs") / "log.jsonl")])


@pytest.fixture(scope="module")
def plan():
    return kvtune.plan(kvtune.Deployment(MODEL), measured=kvtune.measured_capacity(capacity_file=CPU_CAPACITY))


def search(profile, plan, **kwargs) -> Recommendation:
    kwargs.setdefault("requests", 300)
    progress = kwargs.pop("progress", None)
    policy = kvtune.Policy(max_truncation=kwargs.pop("max_truncation", None))
    objective = kvtune.Objective(kwargs.pop("objective", "throughput"), **kwargs)
    return kvtune.recommend(profile, plan, policy, objective, progress=progress)


def metric(row: WhatIfRow, goal: Goal) -> float:
    p = row.predicted
    return (p.goodput_rps or 0.0) if goal is Goal.GOODPUT else p.output_tokens_per_s


def assert_best_feasible(rows: tuple[WhatIfRow, ...], goal: Goal, limits: dict[str, float | None]) -> WhatIfRow:
    """The property the search promises: exactly one chosen row, a feasible candidate, and no
    other feasible candidate beats it on the objective."""
    chosen = [r for r in rows if r.chosen]
    assert len(chosen) == 1
    best = chosen[0]
    assert not best.reference and best.feasible
    for row in rows:
        p = row.predicted
        broken = {"max_preemption_rate": p.preemption_rate, "max_429_share": p.share_429,
                  "max_truncation": p.truncation_share}
        feasible = all(limit is None or broken[name] <= limit for name, limit in limits.items())
        assert row.feasible == feasible, row.label
        if feasible and not row.reference:
            assert metric(row, goal) <= metric(best, goal), row.label
    return best


@pytest.mark.parametrize(("concurrency", "max_preemption_rate", "max_429_share"),
                         [(16, None, None), (16, 0.0, None), (32, 0.05, 0.05), (32, None, 0.01)])
def test_the_chosen_row_is_the_best_feasible_one(profile, plan, concurrency, max_preemption_rate, max_429_share):
    rec = search(profile, plan, concurrency=concurrency, max_preemption_rate=max_preemption_rate,
                 max_429_share=max_429_share)
    assert rec.objective is not None and rec.objective.max_truncation is not None  # the tail rule's share
    best = assert_best_feasible(rec.what_if, Goal.THROUGHPUT, {"max_preemption_rate": max_preemption_rate,
                                                              "max_429_share": max_429_share,
                                                              "max_truncation": rec.objective.max_truncation})
    assert rec.chosen is best
    # the recommendation is the chosen row's: its budget, its caps
    assert rec.budget_blocks == best.budget_blocks
    assert {r.route: r.cap for r in rec.routes} == dict(best.caps)
    # direct to vLLM comes first, then guaranteed, statistical at a few epsilons, overcommit at a
    # few factors (only guaranteed when no preemption is allowed), the whole-context reservation last
    kinds = [r.policy.kind for r in rec.what_if]
    assert kinds[0] is PolicyKind.DIRECT and kinds[-1] is PolicyKind.WORST_CASE
    expected = [PolicyKind.GUARANTEED] if max_preemption_rate == 0 else [
        PolicyKind.GUARANTEED, PolicyKind.STATISTICAL, PolicyKind.OVERCOMMIT]
    assert list(dict.fromkeys(kinds[1:-1])) == expected
    if max_preemption_rate != 0:
        assert sorted({r.policy.epsilon for r in rec.what_if if r.policy.kind is PolicyKind.STATISTICAL}) == [
            0.001, 0.01, 0.05]
    if best.policy.kind is PolicyKind.OVERCOMMIT:
        assert rec.admission.factor == best.policy.factor
    elif best.policy.kind is PolicyKind.STATISTICAL:
        assert rec.admission.kind.value == "statistical" and rec.admission.epsilon == best.policy.epsilon
    else:
        assert rec.admission.kind.value == "guaranteed"
    assert best.why.startswith("chosen: the highest output tokens/s")


def test_goodput_is_maximised_under_the_slo(profile, plan):
    slo = Slo(ttft_ms=500)
    rec = search(profile, plan, objective="goodput", slo=slo, concurrency=32)
    assert all(r.predicted.goodput_rps is not None for r in rec.what_if)
    assert rec.objective is not None
    assert_best_feasible(rec.what_if, Goal.GOODPUT, {"max_truncation": rec.objective.max_truncation})
    with pytest.raises(OptionError, match="needs latency objectives") as exc:
        search(profile, plan, objective="goodput", concurrency=32)
    assert exc.value.field == "slo"


def test_rejected_rows_name_the_constraint_they_broke(profile, plan):
    rec = search(profile, plan, concurrency=32, max_preemption_rate=0.0)
    direct = rec.direct
    assert direct is not None and direct.predicted.preemption_rate > 0  # 32 clients overflow 31 blocks
    assert [v.constraint for v in direct.violations] == ["max_preemption_rate"]
    assert "breaks preemption rate" in direct.why and direct.verdict.startswith("✗ preemption rate")
    for row in rec.what_if[1:]:
        assert row.predicted.preemption_rate == 0  # guaranteed reservations never preempt


def test_no_feasible_row_raises_with_the_table(profile, plan):
    with pytest.raises(InfeasibleObjectiveError) as exc:
        search(profile, plan, concurrency=128, max_429_share=0.0, max_preemption_rate=0.0)
    err = exc.value
    assert "no configuration meets the objective" in str(err) and "429 share" in str(err)
    assert len(err.rows) > 2 and not any(r.chosen for r in err.rows)
    assert all(r.violations for r in err.rows[1:])
    assert all(r.why.startswith("rejected: 429 share") for r in err.rows[1:-1])
    assert {r.policy.kind for r in err.rows[1:-1]} == {PolicyKind.GUARANTEED}


def test_a_seed_gives_the_same_table(profile, plan):
    # 100 requests a run: what a seed fixes does not depend on how many (the other tests run 300)
    a, b = (search(profile, plan, concurrency=24, seed=3, requests=100) for _ in range(2))
    assert [r.to_dict() for r in a.what_if] == [r.to_dict() for r in b.what_if]
    assert a.to_json() == b.to_json()
    c = search(profile, plan, concurrency=24, seed=4, requests=100)
    assert [r.predicted for r in c.what_if] != [r.predicted for r in a.what_if]


def test_the_logged_arrival_rate_is_the_default_load(profile, plan, tmp_path):
    rec = search(profile, plan)
    assert rec.objective is not None and rec.objective.load.source == "logs"
    assert rec.objective.load.rate_rps == pytest.approx(20, rel=0.15)  # the log's Poisson rate
    untimed = kvtune.profile_logs([objective_log(tmp_path / "untimed.jsonl", timestamps=False)])
    with pytest.raises(OptionError, match="no timestamps") as exc:
        search(untimed, plan)
    assert exc.value.field == "rate"
    assert search(untimed, plan, rate_rps=10).objective.load.rate_rps == 10


def test_progress_is_called_for_each_row(profile, plan):
    calls: list[tuple[int, int]] = []
    rec = search(profile, plan, concurrency=8, progress=lambda done, total: calls.append((done, total)))
    assert calls == [(i, len(rec.what_if)) for i in range(1, len(rec.what_if) + 1)]


@pytest.mark.parametrize(("kwargs", "field", "message"), [
    ({"max_preemption_rate": 1.5}, "max_preemption_rate", "must be a share between 0 and 1"),
    ({"max_429_share": -0.1}, "max_429_share", "must be a share between 0 and 1"),
    ({"rate_rps": 5, "concurrency": 4}, "concurrency", "give a rate or a concurrency, not both"),
    ({"rate_rps": 0}, "rate", "must be a positive number"),
    ({"concurrency": 0}, "concurrency", "must be at least 1"),
    ({"requests": 0}, "requests", "must be from 1 to 100,000"),
    ({"objective": "latency"}, "objective", "is not one of throughput, goodput"),
])
def test_bad_objective_options(profile, plan, kwargs, field, message):
    with pytest.raises(OptionError, match=message) as exc:
        search(profile, plan, **kwargs)
    assert exc.value.field == field


def test_options_without_an_objective_are_refused(profile, plan):
    with pytest.raises(OptionError, match="only applies with `objective`") as exc:
        kvtune.recommend(profile, plan, objective=kvtune.Objective(None, max_preemption_rate=0.1))
    assert exc.value.field == "max_preemption_rate"


def test_an_estimated_capacity_is_simulated_on_its_estimate(profile):
    """Offline (issue 27 item 3): no measured capacity is the plan's own estimate and the roofline
    for its GPU (it was refused before); a plan with no catalog GPU has no step time."""
    plan = kvtune.plan(kvtune.Deployment(MODEL, gpu="H100-80GB", max_model_len=4096))
    rec = search(profile, plan, rate_rps=2, requests=30)
    assert rec.objective is not None and rec.objective.basis.engine.num_blocks == plan.capacity.num_blocks
    assert rec.objective.basis.timing.estimate
    # overcommit ×3's max_num_seqs leaves the estimate no KV (its sampler): left out, and said so
    assert any(n.startswith("3 candidate(s) of the grid left out: on the estimated pool") for n in rec.notes)
    with pytest.raises(OptionError, match="give --gpu \\(or --gpu-spec FILE\\), or --capacity FILE"):
        search(profile, kvtune.plan(kvtune.Deployment(MODEL, gpu_memory="80GB", max_model_len=4096)), rate_rps=2)


def test_a_preemption_budget_of_zero_keeps_only_the_guaranteed_policy(objective):
    grid = SearchGrid(policies=(Policy(PolicyKind.GUARANTEED), Policy(PolicyKind.OVERCOMMIT, factor=1.5)))
    assert grid.for_objective(objective).policies == grid.policies
    strict = dataclasses.replace(objective, max_preemption_rate=0.0)
    assert [p.kind for p in grid.for_objective(strict).policies] == [PolicyKind.GUARANTEED]


# ---------------------------------------------------------------- the choice, as a property


@pytest.fixture(scope="module")
def objective(profile, plan):
    rec = search(profile, plan, concurrency=4, requests=50)
    assert rec.objective is not None
    return rec.objective


def _predicted(tok: float, pre: float, share: float) -> Predicted:
    return Predicted(tok, tok / 100, None, 1.0, 2.0, 3.0, 4.0, pre, share, 0.0, 100, 100)


@settings(max_examples=300, deadline=None)
@given(figures=st.lists(st.tuples(st.floats(0, 1e4), st.sampled_from([0.0, 0.01, 0.2]),
                                  st.sampled_from([0.0, 0.05, 0.5]), st.booleans()), min_size=1, max_size=12),
       max_pre=st.sampled_from([None, 0.0, 0.01, 0.1]), max_429=st.sampled_from([None, 0.0, 0.05, 0.2]))
def test_choose_never_passes_over_a_better_feasible_row(objective, figures, max_pre, max_429):
    from kvtune.policy.search import choose

    limited = dataclasses.replace(objective, max_preemption_rate=max_pre, max_429_share=max_429)
    predicted = [_predicted(tok, pre, share) for tok, pre, share, _ in figures]
    reference = [ref for *_, ref in figures]
    chosen = choose(limited, predicted, [10 + i for i in range(len(figures))], reference)

    def feasible(i: int) -> bool:
        p = predicted[i]
        return (not reference[i] and (max_pre is None or p.preemption_rate <= max_pre)
                and (max_429 is None or p.share_429 <= max_429))

    if chosen is None:
        assert not any(feasible(i) for i in range(len(figures)))
        return
    assert feasible(chosen)
    for i in range(len(figures)):
        if feasible(i):
            assert predicted[i].output_tokens_per_s <= predicted[chosen].output_tokens_per_s


# ---------------------------------------------------------------- recommendation.json


@pytest.fixture(scope="module")
def searched(profile, plan) -> Recommendation:
    # answers cut up to 10 % allowed (caps from p90 up): the statistical policy's bet pays there
    return search(profile, plan, concurrency=32, max_preemption_rate=0.01, max_truncation=0.1)


def test_the_what_if_table_reads_back(searched):
    data = searched.to_dict()
    assert [set(r) for r in data["what_if"]] == [{
        "policy", "reference", "cap_level", "caps", "budget_blocks", "safety_fraction", "max_num_seqs",
        "max_num_batched_tokens", "predicted", "feasible", "violations", "chosen", "why"}] * len(data["what_if"])
    assert set(data["what_if"][0]["predicted"]) == {
        "output_tokens_per_s", "requests_per_s", "goodput_rps", "ttft_ms", "e2e_ms", "preemption_rate", "share_429",
        "truncation_share", "sent", "completed", "kv_peak_blocks", "waiting_peak", "running_peak"}
    back = read_recommendation(json.loads(searched.to_json()), path="recommendation.json")
    assert back.to_json() == searched.to_json()
    assert back.chosen is not None and searched.chosen is not None and back.chosen.label == searched.chosen.label


def _damaged(searched: Recommendation, edit) -> str:
    data = copy.deepcopy(searched.to_dict())
    edit(data)
    with pytest.raises(InputError) as exc:
        read_recommendation(data, path="r.json")
    return str(exc.value)


@pytest.mark.parametrize(("edit", "expected"), [
    (lambda d: d.pop("objective"), "r.json: objective: missing: a what-if table and its objective come together"),
    (lambda d: d["what_if"][0].update(chosen=True), "r.json: what_if[0].chosen: a reference or infeasible row cannot"),
    (lambda d: d["what_if"][0]["predicted"].update(share_429="lots"), "r.json: what_if[0].predicted.share_429: expected a number, got 'lots'"),
    (lambda d: d["what_if"][0].update(feasible=not d["what_if"][0]["feasible"]), "r.json: what_if[0].feasible: is "),
    (lambda d: d["what_if"][0]["policy"].update(kind="yolo"), "r.json: what_if[0].policy.kind: 'yolo' is not one of"),
    (lambda d: d["objective"].update(kind="latency"), "r.json: objective.kind: 'latency' is not one of"),
    (lambda d: d["objective"]["simulator"]["engine"].update(max_model_len=10**6), "r.json: objective.simulator.engine.max_model_len: 1,000,000 tokens need 7,813 blocks"),
    (lambda d: d["objective"]["traffic"].update(routes=[]), "r.json: objective.traffic.routes: no routes"),
    (lambda d: d["objective"]["load"].update(concurrency=None), "r.json: objective.load.rate_rps: a load is a rate or a concurrency, got neither"),
])
def test_a_damaged_what_if_table_names_the_field(searched, edit, expected):
    assert _damaged(searched, edit).startswith(expected)


def test_exactly_one_row_is_chosen(searched):
    def unchoose(d):
        for row in d["what_if"]:
            row["chosen"] = False

    assert _damaged(searched, unchoose) == "r.json: what_if: expected exactly one chosen row"


def test_files_without_an_objective_stay_valid(searched):
    data = searched.to_dict()
    del data["objective"], data["what_if"]
    rec = read_recommendation(data)
    assert rec.what_if is None and rec.objective is None and "what_if" not in rec.to_dict()


# ---------------------------------------------------------------- check: the objective it was rendered for


def _write(tmp_path, rec: Recommendation) -> Path:
    out = tmp_path / "deploy"
    kvtune.write_files(out, kvtune.render(rec))
    return out


def test_check_simulates_the_rendered_files_as_the_table_did(searched, tmp_path):
    out = _write(tmp_path, searched)
    rec = kvtune.load_recommendation(out / "recommendation.json")
    result = kvtune.check(rec, [out / "vllm-serve.sh", out / "gateway.yaml"])
    [met] = [f for f in result.findings if f.code == "objective-met"]
    chosen = searched.chosen
    assert chosen is not None
    assert met.severity is Severity.INFO and met.source == str(out / "gateway.yaml")
    assert f"{chosen.predicted.output_tokens_per_s:,.1f} output tokens/s" in met.message
    assert f"{chosen.predicted.share_429:.1%} answered 429" in met.message
    assert not [f for f in result.findings if f.code == "objective-missed"]


def test_check_flags_a_deployment_that_breaks_the_objective(searched, tmp_path):
    out = _write(tmp_path, searched)
    rec = kvtune.load_recommendation(out / "recommendation.json")
    # the engine alone, no gateway in front: vLLM admits all 32 clients into 31 blocks and preempts
    result = kvtune.check(rec, [out / "vllm-serve.sh"])
    [missed] = [f for f in result.findings if f.code == "objective-missed"]
    assert missed.severity is Severity.RISK and not result.passed
    assert missed.message.startswith("simulated preemption rate ") and "> 1.0%" in missed.message
    # a gateway whose budget was raised past the pool lets vLLM preempt too
    gateway = (out / "gateway.yaml").read_text()
    budget = rec.budget_blocks
    raised = tmp_path / "gateway.yaml"
    raised.write_text(gateway.replace(f"block_budget: {budget}", "block_budget: 200"))
    result = kvtune.check(rec, [out / "vllm-serve.sh", raised])
    assert {"budget-over-capacity", "objective-missed"} <= {f.code for f in result.findings}


def test_check_without_an_objective_simulates_nothing(profile, plan, tmp_path):
    rec = kvtune.recommend(profile, plan)
    out = _write(tmp_path, rec)
    codes = {f.code for f in kvtune.check(rec, [out / "vllm-serve.sh", out / "gateway.yaml"]).findings}
    assert not {"objective-met", "objective-missed"} & codes


def test_an_overcommit_row_renders_and_checks_as_overcommit(profile, plan, tmp_path):
    """16 clients on 31 blocks with 5 % preemption allowed: overcommitting the budget beats every
    guaranteed row, the files say overcommit, and check simulates them as such."""
    from kvtune.deploy.read import load_deployed
    from kvtune.policy.recommend import RecommendOptions
    from kvtune.policy.search import OVERCOMMITS, ObjectiveSpec, recommend_for_objective

    # without the statistical rows, which would beat it here
    grid = SearchGrid(policies=(GUARANTEED, *OVERCOMMITS))
    spec = ObjectiveSpec(Goal.THROUGHPUT, max_preemption_rate=0.05, concurrency=16, requests=300)
    rec = recommend_for_objective(profile, plan, RecommendOptions(), spec, grid=grid)
    chosen = rec.chosen
    assert chosen is not None and chosen.policy.kind is PolicyKind.OVERCOMMIT
    best_guaranteed = max(r.predicted.output_tokens_per_s for r in rec.what_if
                          if r.policy.kind is PolicyKind.GUARANTEED)
    assert chosen.predicted.output_tokens_per_s > best_guaranteed
    assert rec.admission.kind.value == "overcommit" and rec.admission.factor == chosen.policy.factor
    out = _write(tmp_path, rec)
    for name in ("gateway.yaml", "nginx.conf"):
        deployed = load_deployed(out / name)
        assert deployed.admission == rec.admission, name
        result = kvtune.check(kvtune.load_recommendation(out / "recommendation.json"), [out / "vllm-serve.sh",
                                                                                         out / name])
        [met] = [f for f in result.findings if f.code == "objective-met"]
        assert f"{chosen.predicted.output_tokens_per_s:,.1f} output tokens/s" in met.message, name


def test_a_statistical_row_renders_and_checks_as_statistical(searched, tmp_path):
    """32 clients on 31 blocks, 1 % preemption allowed: a statistical row beats every guaranteed
    one; gateway.yaml carries its epsilon and route laws, and check simulates them to the table's
    figures. Edited to epsilon 0, the same gateway is simulated as the guaranteed row it then is."""
    from kvtune.deploy.read import load_deployed

    chosen = searched.chosen
    assert chosen is not None and chosen.policy.kind is PolicyKind.STATISTICAL
    assert chosen.predicted.output_tokens_per_s > max(r.predicted.output_tokens_per_s for r in searched.what_if
                                                      if r.policy.kind is PolicyKind.GUARANTEED)
    assert searched.admission.kind.value == "statistical" and searched.admission.epsilon == chosen.policy.epsilon
    out = _write(tmp_path, searched)
    deployed = load_deployed(out / "gateway.yaml")
    assert deployed.admission == searched.admission
    assert all(r.output_law is not None for r in deployed.routes[:-1])  # the catch-all carries none
    rec = kvtune.load_recommendation(out / "recommendation.json")
    result = kvtune.check(rec, [out / "vllm-serve.sh", out / "gateway.yaml"])
    [met] = [f for f in result.findings if f.code == "objective-met"]
    assert f"{chosen.predicted.output_tokens_per_s:,.1f} output tokens/s" in met.message
    assert "mean of seeds 0–2" in met.message
    edited = tmp_path / "gateway.yaml"
    edited.write_text((out / "gateway.yaml").read_text().replace(
        f"  epsilon: {chosen.policy.epsilon}", "  epsilon: 0.0"))
    assert load_deployed(edited).admission.epsilon == 0.0
    [twin] = [r for r in searched.what_if if r.policy.kind is PolicyKind.GUARANTEED
              and r.cap_level == chosen.cap_level and r.safety_fraction == chosen.safety_fraction]
    [met] = [f for f in kvtune.check(rec, [out / "vllm-serve.sh", edited]).findings if f.code == "objective-met"]
    assert f"{twin.predicted.output_tokens_per_s:,.1f} output tokens/s" in met.message


def test_a_row_is_the_mean_over_its_seeds(objective, profile, plan):
    """Each row is the mean of one simulation per seed (seed, seed + 1, seed + 2): rates and
    percentiles averaged, sent and completed added up."""
    from kvtune.policy.search import Deployment, mean_predicted, simulate_deployment

    assert objective.seeds == 3
    engine = objective.basis.engine
    deployment = Deployment(engine, {r.route: None for r in profile.routes}, Policy(PolicyKind.DIRECT), None)
    runs = [simulate_deployment(dataclasses.replace(objective, seed=s, seeds=1), deployment)
            for s in (objective.seed, objective.seed + 1, objective.seed + 2)]
    mean = simulate_deployment(objective, deployment)
    assert mean == mean_predicted(runs)
    assert mean.sent == sum(r.sent for r in runs)
    assert mean.output_tokens_per_s == pytest.approx(sum(r.output_tokens_per_s for r in runs) / 3, abs=1e-3)
    assert len({r.output_tokens_per_s for r in runs}) == 3  # the seeds draw different requests


def test_an_objective_without_seeds_reads_back_as_one_seed(searched):
    data = copy.deepcopy(searched.to_dict())
    assert data["objective"]["seeds"] == 3
    del data["objective"]["seeds"]  # files written before rows were averaged over seeds
    back = read_recommendation(data)
    assert back.objective is not None and back.objective.seeds == 1
    assert back.objective.seeds_label == "seed 0"


def test_compare_engines_adds_a_reference_row_per_engine_that_reads_back(profile, plan):
    """--compare-engines: after direct to vLLM, one row per engine rule on the same requests,
    never chosen; the capped ones carry the default recommendation's caps; the file reads back."""
    from kvtune.domain.whatif import ENGINE_ROWS
    from kvtune.policy.recommend import RecommendOptions
    from kvtune.policy.search import ObjectiveSpec, recommend_for_objective

    spec = ObjectiveSpec(Goal.THROUGHPUT, concurrency=16, requests=100, seeds=1, compare_engines=True)
    rec = recommend_for_objective(profile, plan, RecommendOptions(), spec,
                                  grid=SearchGrid(cap_levels=("tail",), safety_fractions=(0.9,), policies=(GUARANTEED,)))
    engines = [r for r in rec.what_if if r.policy.kind is PolicyKind.ENGINE]
    assert [r.policy.engine for r in engines] == list(ENGINE_ROWS)
    assert rec.what_if[0].policy.kind is PolicyKind.DIRECT and rec.what_if[1:5] == tuple(engines)
    assert all(r.reference and not r.chosen and r.budget_blocks is None for r in engines)
    assert [r.label for r in engines] == list(ENGINE_ROWS.values())
    guaranteed = next(r for r in rec.what_if if r.policy.kind is PolicyKind.GUARANTEED)
    by_name = {r.policy.engine: r for r in engines}
    assert all(c is None for c in by_name["sglang"].caps.values())
    assert dict(by_name["trtllm-gne"].caps) == dict(guaranteed.caps)
    assert by_name["trtllm-gne"].predicted.preemption_rate == 0.0  # GUARANTEED_NO_EVICT never evicts
    assert all(r.predicted.completed > 0 for r in engines)
    back = read_recommendation(json.loads(rec.to_json()), path="recommendation.json")
    assert back.to_json() == rec.to_json()
    data = rec.to_dict()
    data["what_if"][1]["policy"]["engine"] = "tgi"
    with pytest.raises(InputError, match=r"what_if\[1\].policy.engine: 'tgi' is not one of"):
        read_recommendation(data, path="r.json")
    data["what_if"][1]["policy"].pop("engine")
    with pytest.raises(InputError, match="an engine row names its engine"):
        read_recommendation(data, path="r.json")


def test_compare_engines_only_applies_with_an_objective(profile, plan):
    with pytest.raises(OptionError, match="only applies with `objective`"):
        kvtune.recommend(profile, plan, objective=kvtune.Objective(None, compare_engines=True))


def test_a_compute_bound_flow_control_row_says_flow_control_cannot_meet_the_ttft_target():
    """The what-if note for a prefill-bound workload: the engine's KV peak under the gateway's
    budget while TTFT p99 misses the target means requests waited inside vLLM for compute."""
    def predicted(ttft_p99_ms: float, kv_peak_blocks: int | None, waiting: int = 120, running: int = 140) -> Predicted:
        return Predicted(100.0, 1.0, 0.5, 500.0, ttft_p99_ms, 3.0, 4.0, 0.0, 0.0, 0.0, 100, 100, kv_peak_blocks,
                         waiting, running)

    note = compute_bound_note(predicted(9_000.0, 600), 1_000, 2_000.0)
    assert note == ("compute-bound: vLLM queued up to 120 requests beside 140 running while KV peaked at 600 of "
                    "the 1,000-block budget, and TTFT p99 9,000 ms missed the 2,000 ms target: they wait inside "
                    "vLLM for compute, which no KV gate (flow control included) shortens")
    assert compute_bound_note(predicted(9_000.0, 1_000), 1_000, 2_000.0) is None  # KV-bound: the gate helps
    # the gateway holds them back in front of vLLM, whose queue stays short: the gate is at work
    assert compute_bound_note(predicted(9_000.0, 600, waiting=18, running=333), 1_000, 2_000.0) is None
    assert compute_bound_note(predicted(1_500.0, 600), 1_000, 2_000.0) is None  # the target is met
    assert compute_bound_note(predicted(9_000.0, None), 1_000, 2_000.0) is None  # not known (older files)
    assert compute_bound_note(predicted(9_000.0, 600), None, 2_000.0) is None  # no gateway
    row = predicted(9_000.0, 600)
    assert Predicted.read(Fields(json.loads(json.dumps(row.to_dict())), path="rec", where="predicted")) == row
