"""estimates.json and estimates.yaml (kvtune.deploy.estimates): what `recommend --out` exports for
other gateways, valid against the JSON Schema kvtune ships, and the same figures as
recommendation.json."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import jsonschema
import pytest
import yaml
from click.testing import CliRunner

from kvtune.cli import cli
from kvtune.deploy.estimates import SCHEMA_PATH, schema

REPO = Path(__file__).resolve().parents[2]
LOGS = str(REPO / "sample_logs")


@pytest.fixture(scope="module")
def rendered(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("deploy")
    made = CliRunner().invoke(cli, ["recommend", LOGS, "--model", "llama-3.1-8b", "--gpu", "H100-80GB",
                                    "--replicas", "2", "--out", str(out)], catch_exceptions=False)
    assert made.exit_code == 0, made.output
    return out


def validate(data: dict) -> None:
    jsonschema.validate(data, schema(), cls=jsonschema.Draft202012Validator)


def test_the_shipped_schema_is_a_valid_json_schema():
    jsonschema.Draft202012Validator.check_schema(schema())
    assert SCHEMA_PATH.is_relative_to(REPO / "kvtune")  # inside the package: package-data ships it


def test_the_written_file_validates_and_the_yaml_is_the_same_document(rendered):
    data = json.loads((rendered / "estimates.json").read_text())
    validate(data)
    assert yaml.safe_load((rendered / "estimates.yaml").read_text()) == data
    assert (data["format"], data["version"]) == ("kvtune-estimates", 1)


@pytest.mark.parametrize("breakage", [
    lambda d: d.pop("block_size"),
    lambda d: d["routes"][0].update(max_new_tokens=0),
    lambda d: d["routes"][0]["output_tokens"].update(p999=1),
    lambda d: d.update(version=2),
])
def test_the_schema_refuses_a_broken_document(rendered, breakage):
    data = json.loads((rendered / "estimates.json").read_text())
    broken = copy.deepcopy(data)
    breakage(broken)
    with pytest.raises(jsonschema.ValidationError):
        validate(broken)


def test_the_figures_are_the_recommendations(rendered):
    data = json.loads((rendered / "estimates.json").read_text())
    rec = json.loads((rendered / "recommendation.json").read_text())
    block = rec["capacity"]["block_size"]
    assert data["block_size"] == block == 16
    assert data["model"] == rec["served_model"]
    assert data["block_budget"] == rec["block_budget"]["value"]
    gateway = yaml.safe_load((rendered / "gateway.yaml").read_text())
    assert data["upstreams"] == gateway["upstreams"]  # two replicas: each URL with its budget
    assert data["default_route"]["max_new_tokens"] == rec["settings"]["max_new_tokens_backstop"]["value"]
    assert [r["name"] for r in data["routes"]] == [r["route"] for r in rec["routes"]]
    for mine, theirs in zip(data["routes"], rec["routes"], strict=True):
        cap = theirs["max_new_tokens"]["value"]
        assert mine["max_new_tokens"] == cap
        assert mine["match"] == theirs["match"]
        assert {k: mine["output_tokens"][k] for k in ("p50", "p90", "p99", "max")} == \
            {k: theirs["output_tokens"][k] for k in ("p50", "p90", "p99", "max")}
        assert mine["reservation_blocks"] == theirs["reservation_blocks"]
        assert mine["output_blocks_at_cap"] == math.ceil(cap / block)
        expected = theirs["prompt_tokens"]["mean"] + min(theirs["output_tokens"]["mean"], cap)
        assert mine["expected_blocks"] == math.ceil(expected / block)
    chat = data["routes"][0]
    assert (chat["name"], chat["max_new_tokens"], chat["output_tokens"]["p50"], chat["output_blocks_at_cap"]) == \
        ("/v1/chat/completions", 1143, 154, 72)
