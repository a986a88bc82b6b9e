"""Issue 28: one strict field reader. gateway.yaml (written by hand) and kvtune's own files
(recommendation.json) are read by kvtune.domain.fields.Fields, so the same fault reads as the same
words in both: the key path, the bound that was broken, the value as written."""

from __future__ import annotations

import ast
import copy
from pathlib import Path

import pytest
from recs import rec_dict

import kvtune
from kvtune.errors import InputError
from kvtune.gateway.config import parse_gateway_config
from kvtune.policy.recommendation import read_recommendation

GATEWAY = {"version": 1, "upstream": "http://127.0.0.1:8000", "block_size": 16, "block_budget": 1000,
           "max_model_len": 8192, "routes": [{"name": "default", "max_new_tokens": 1000}]}


def gateway_error(**changes) -> str:
    with pytest.raises(InputError) as info:
        parse_gateway_config({**copy.deepcopy(GATEWAY), **changes}, path="gateway.yaml")
    return str(info.value)


def recommendation_error(edit) -> str:
    doc = rec_dict()
    edit(doc)
    with pytest.raises(InputError) as info:
        read_recommendation(doc, path="recommendation.json")
    return str(info.value)


@pytest.mark.parametrize(("gateway", "recommendation", "words"), [
    # below a minimum: the bound broken, not 1..2**53
    ({"block_size": 0}, lambda d: d["capacity"].update(block_size=0), "block_size: must be at least 1, got 0"),
    # above a maximum
    ({"health": {"max_ejected_share": 1.5}}, lambda d: d["safety_fraction"].update(value=1.5),
     "must be at most 1, got 1.5"),
    # a bool is not a number, and says so (not "a finite number")
    ({"queue": {"timeout_s": True}}, lambda d: d["concurrency"].update(mean_reservation_blocks=True),
     "expected a number, got True"),
    # nor an integer
    ({"block_size": True}, lambda d: d["capacity"].update(block_size=True), "block_size: expected an integer, got True"),
])
def test_the_same_fault_reads_as_the_same_words(gateway, recommendation, words):
    g, r = gateway_error(**gateway), recommendation_error(recommendation)
    assert g.startswith("gateway.yaml: ") and r.startswith("recommendation.json: ")
    assert words in g and words in r, (g, r)


def test_gateway_yaml_has_no_reader_of_its_own():
    """kvtune/gateway/config.py reads through Fields: it defines no reader class and none of the
    checks Fields makes (the integer, number and choice checks)."""
    source = (Path(kvtune.__file__).parent / "gateway" / "config.py").read_text(encoding="utf-8")
    tree = ast.parse(source)
    classes = {n.name for n in ast.walk(tree) if isinstance(n, ast.ClassDef)}
    assert "_Reader" not in classes
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module == "kvtune.domain.fields"
                for a in n.names}
    assert imported == {"Fields"}


def test_a_gateway_yaml_that_is_no_mapping_names_no_empty_field():
    """The whole document is no mapping: the file, then the problem (gateway's own reader printed
    an empty field: `gateway.yaml: : expected a mapping`)."""
    for doc, shown in (([1], "[1]"), (None, "null"), ("x", "'x'")):
        with pytest.raises(InputError) as info:
            parse_gateway_config(doc, path="gateway.yaml")
        assert str(info.value) == f"gateway.yaml: expected a mapping, got {shown}"
