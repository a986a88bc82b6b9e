"""kvtune.domain.admission_policy: gateway.yaml's and recommendation.json's `admission`, read strictly, and
what each policy holds worst-case reservations against."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvtune.domain.admission_policy import GUARANTEED, AdmissionPolicy, PolicyKind
from kvtune.errors import InputError
from kvtune.gateway.config import parse_gateway_config
from kvtune.policy.recommendation import read_recommendation

DATA = Path(__file__).parents[1] / "data"
GATEWAY = {"version": 1, "upstream": "http://127.0.0.1:8000", "block_size": 16, "block_budget": 100,
           "max_model_len": 2048, "routes": [{"name": "default", "max_new_tokens": 64}]}


def _config(admission):
    return parse_gateway_config({**GATEWAY, "admission": admission})


def test_guaranteed_is_the_default_and_today_s_limit():
    config = parse_gateway_config(dict(GATEWAY))
    assert config.admission == GUARANTEED
    assert config.admit_limit_blocks == 100
    assert _config({"policy": "guaranteed"}).admission == GUARANTEED


@pytest.mark.parametrize("factor, limit", [(1, 100), (1.5, 150), (2, 200), (2.999, 299), (64, 6400)])
def test_overcommit_holds_reservations_against_k_times_the_budget(factor, limit):
    config = _config({"policy": "overcommit", "factor": factor})
    assert config.admission == AdmissionPolicy(PolicyKind.OVERCOMMIT, factor=float(factor))
    assert config.admit_limit_blocks == limit


@pytest.mark.parametrize("epsilon", [0, 0.0, 1e-9, 0.05, 0.999])
def test_statistical_takes_an_epsilon(epsilon):
    config = _config({"policy": "statistical", "epsilon": epsilon})
    assert config.admission.kind is PolicyKind.STATISTICAL and config.admission.epsilon == epsilon
    assert config.admit_limit_blocks == 100


@pytest.mark.parametrize("admission, field, words", [
    ("guaranteed", "admission", "expected a mapping"),
    ({}, "admission.policy", "missing"),
    ({"policy": "greedy"}, "admission.policy", "'greedy' is not one of guaranteed, overcommit, statistical"),
    ({"policy": None}, "admission.policy", "missing"),
    ({"policy": 1}, "admission.policy", "1 is not one of"),
    ({"policy": "guaranteed", "factor": 2}, "admission.factor", "unknown key for policy guaranteed"),
    ({"policy": "overcommit"}, "admission.factor", "missing"),
    ({"policy": "overcommit", "factor": 0.9}, "admission.factor", "must be in [1, 64]"),
    ({"policy": "overcommit", "factor": 65}, "admission.factor", "must be in [1, 64]"),
    ({"policy": "overcommit", "factor": True}, "admission.factor", "expected a number, got True"),
    ({"policy": "overcommit", "factor": "2"}, "admission.factor", "expected a number"),
    ({"policy": "overcommit", "factor": float("nan")}, "admission.factor", "finite"),
    ({"policy": "overcommit", "factor": 2, "epsilon": 0.1}, "admission.epsilon", "unknown key for policy overcommit"),
    ({"policy": "statistical"}, "admission.epsilon", "missing"),
    ({"policy": "statistical", "epsilon": 1}, "admission.epsilon", "below 1"),
    ({"policy": "statistical", "epsilon": -0.01}, "admission.epsilon", "at least 0"),
    ({"policy": "statistical", "epsilon": float("inf")}, "admission.epsilon", "finite"),
    ({"policy": "statistical", "epsilon": 0.1, "factor": 2}, "admission.factor", "unknown key"),
])
def test_bad_admission_is_one_error_naming_the_field(admission, field, words):
    with pytest.raises(InputError) as info:
        _config(admission)
    assert info.value.field == field, info.value
    assert words in str(info.value)
    assert "\n" not in str(info.value)


def test_the_policy_object_refuses_what_the_files_refuse():
    with pytest.raises(ValueError):
        AdmissionPolicy(PolicyKind.GUARANTEED, factor=2)
    with pytest.raises(ValueError):
        AdmissionPolicy.statistical(1.0)
    with pytest.raises(ValueError):
        AdmissionPolicy.overcommit(0.5)


def _rec_doc() -> dict:
    return json.loads((DATA / "recommendation.json").read_text(encoding="utf-8"))


@pytest.mark.parametrize("policy", [GUARANTEED, AdmissionPolicy.overcommit(1.5), AdmissionPolicy.statistical(0.02)])
def test_recommendation_admission_round_trips(policy):
    doc = _rec_doc()
    doc["admission"] = policy.to_dict()
    rec = read_recommendation(doc, path="r.json")
    assert rec.admission == policy
    assert rec.to_dict() == doc


def test_a_recommendation_written_before_admission_reads_as_guaranteed():
    doc = _rec_doc()
    del doc["admission"]
    rec = read_recommendation(doc, path="old.json")
    assert rec.admission == GUARANTEED
    assert rec.to_dict()["admission"] == {"policy": "guaranteed"}


@pytest.mark.parametrize("admission, field", [
    (None, "admission"), ({"policy": "overcommit", "factor": 0}, "admission.factor"),
    ({"policy": "statistical", "epsilon": 0.1, "x": 1}, "admission.x"), ({"policy": "maybe"}, "admission.policy"),
])
def test_a_damaged_recommendation_admission_names_the_field(admission, field):
    doc = _rec_doc()
    doc["admission"] = admission
    with pytest.raises(InputError) as info:
        read_recommendation(copy.deepcopy(doc), path="r.json")
    assert info.value.field == field


@given(st.dictionaries(st.sampled_from(["policy", "factor", "epsilon", "x"]),
                       st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(),
                                 st.sampled_from(POLICY_VALUES := ["guaranteed", "overcommit", "statistical"]),
                                 st.text(max_size=5)), max_size=4))
def test_fuzzed_admission_is_a_policy_or_an_input_error(admission):
    try:
        policy = _config(admission).admission
    except InputError as exc:
        assert exc.field is not None and exc.field.startswith("admission")
        return
    assert policy.name in POLICY_VALUES
    assert _config(policy.to_dict()).admission == policy
