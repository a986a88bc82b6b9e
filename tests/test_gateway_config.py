"""gateway.yaml parsing: strict, with the key path in every error."""

from __future__ import annotations

import pytest

from kvtune.errors import InputError
from kvtune.gateway_config import load_gateway_config, parse_gateway_config


def _doc(**overrides):
    doc = {
        "version": 1,
        "upstream": "http://127.0.0.1:8000",
        "block_size": 16,
        "block_budget": 1000,
        "max_model_len": 8192,
        "routes": [
            {"name": "chat", "match": {"path": "/v1/chat/completions"}, "max_new_tokens": 600},
            {"name": "default", "max_new_tokens": 1000},
        ],
    }
    doc.update(overrides)
    return doc


def test_routes_match_in_order():
    config = parse_gateway_config(_doc())
    assert config.route_for("/v1/chat/completions", "m").name == "chat"
    assert config.route_for("/v1/completions", None).name == "default"
    # 100 prompt + 600 cap = 700 tokens → 44 blocks, ×2 sequences for n=2
    assert config.reservation_blocks(100, 600, sequences=2) == 88


def test_prefix_and_model_match():
    config = parse_gateway_config(_doc(routes=[
        {"name": "code", "match": {"path": "/v1/*", "model": "coder"}, "max_new_tokens": 300},
        {"name": "rest", "max_new_tokens": 500},
    ]))
    assert config.route_for("/v1/completions", "coder").name == "code"
    assert config.route_for("/v1/completions", "chat").name == "rest"
    assert config.route_for("/v2/x", "coder").name == "rest"


@pytest.mark.parametrize(
    "overrides, field, words",
    [
        ({"block_budget": 0}, "block_budget", "at least 1"),
        ({"bogus": 1}, "bogus", "unknown key"),
        ({"routes": [{"name": "chat"}]}, "routes[0].max_new_tokens", "missing"),
        ({"routes": []}, "routes", "non-empty"),
        ({"routes": [{"name": "x", "max_new_tokens": 9000}]}, "routes[0].max_new_tokens", "no room"),
        ({"version": 7}, "version", "unsupported"),
        ({"prompt_tokens": {"method": "estimate", "chars_per_token": 4}}, "prompt_tokens", "margin"),
        ({"routes": [{"name": "x", "max_new_tokens": "many"}]}, "routes[0].max_new_tokens", "integer"),
    ],
)
def test_config_errors_name_the_field(overrides, field, words):
    with pytest.raises(InputError) as info:
        parse_gateway_config(_doc(**overrides), path="gw.yaml")
    assert info.value.field == field
    assert words in str(info.value)
    assert str(info.value).startswith(f"gw.yaml: {field}: ")


def test_load_reports_yaml_line(tmp_path):
    path = tmp_path / "gateway.yaml"
    path.write_text("version: 1\nroutes: [\n  {name: a\n")
    with pytest.raises(InputError) as info:
        load_gateway_config(path)
    assert info.value.line is not None and "not valid YAML" in str(info.value)


def test_load_missing_file(tmp_path):
    with pytest.raises(InputError, match="cannot read"):
        load_gateway_config(tmp_path / "nope.yaml")
