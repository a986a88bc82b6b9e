"""gateway.yaml parsing: strict, with the key path in every error."""

from __future__ import annotations

import re

import pytest

from kvtune.errors import InputError
from kvtune.gateway.endpoints import Api
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
        {"name": "code", "match": {"path_prefix": "/v1/", "model": "coder"}, "max_new_tokens": 300},
        {"name": "rest", "max_new_tokens": 500},
    ]))
    assert config.route_for("/v1/completions", "coder").name == "code"
    assert config.route_for("/v1/completions", "chat").name == "rest"
    assert config.route_for("/v2/x", "coder").name == "rest"


def test_paths_are_literal():
    """A `*` came from logs as part of a route name: it never widens a route to a prefix."""
    with pytest.raises(InputError, match="routes\\[0\\].match.path: a path is literal"):
        parse_gateway_config(_doc(routes=[{"name": "all", "match": {"path": "/v1/*"}, "max_new_tokens": 20},
                                          {"name": "rest", "max_new_tokens": 500}]))
    config = parse_gateway_config(_doc(routes=[
        {"name": "summ", "match": {"path": "/v1/summarize"}, "max_new_tokens": 20},
        {"name": "rest", "max_new_tokens": 500}]))
    assert config.route_for("/v1/summarize", None).name == "summ"
    assert config.route_for("/v1/summarize/x", None).name == "rest"
    assert config.route_paths() == {"/v1/summarize": config.routes[0]}
    assert config.routes[0].api is Api.ANY  # not a vLLM endpoint: every prompt field is charged


@pytest.mark.parametrize("route, field, words", [
    ({"match": {"path": "/v1/embeddings"}}, "routes[0].match.path", "not a generation endpoint"),
    ({"match": {"path": "/sleep"}}, "routes[0].match.path", "not a generation endpoint"),
    ({"match": {"path": "/v1/chat%2Fcompletions"}}, "routes[0].match.path", "not a plain request path"),
    ({"match": {"path": "/v1/../sleep"}}, "routes[0].match.path", "not a plain request path"),
    ({"match": {"path": "/v1/chat/completions"}, "api": "chat"}, "routes[0].api", "only a route"),
    ({"match": {"path": "/v1/x"}, "api": "pooling"}, "routes[0].api", "is not one of"),
    ({"match": {"path": "/v1/x"}, "api": "completions", "upstream_path": "/v1/chat/completions"},
     "routes[0].api", "reads requests as chat"),
    ({"match": {"path": "/v1/x"}, "upstream_path": "/v1/embeddings"}, "routes[0].upstream_path",
     "not a generation endpoint"),
    ({"match": {"path": "/v1/x", "path_prefix": "/v1/"}}, "routes[0].match", "not both"),
])
def test_route_paths_that_cannot_be_governed_are_refused(route, field, words):
    with pytest.raises(InputError, match=re.escape(field) + ": .*" + words):
        parse_gateway_config(_doc(routes=[{"name": "r", "max_new_tokens": 20, **route}]))


def test_custom_path_forwarded_to_a_vllm_endpoint_reads_by_its_rules():
    config = parse_gateway_config(_doc(routes=[
        {"name": "summ", "match": {"path": "/v1/summarize"}, "upstream_path": "/v1/chat/completions",
         "max_new_tokens": 20}]))
    assert config.routes[0].api is Api.CHAT and config.routes[0].upstream_path == "/v1/chat/completions"


@pytest.mark.parametrize("paths, words", [
    (["/v1/completions"], "governed by the gateway"),
    (["/v1/embeddings"], "governed by the gateway"),
    (["/v1/audio/transcriptions"], "cannot be counted"),
    (["/sleep"], "controls the engine"),
    (["/reset_prefix_cache"], "controls the engine"),
    (["health"], "not a plain request path"),
    ("/health", "expected a list"),
])
def test_passthrough_never_opens_a_governed_or_operator_path(paths, words):
    with pytest.raises(InputError, match="passthrough.*" + words):
        parse_gateway_config(_doc(passthrough=paths))


def test_passthrough_default_and_explicit():
    assert "/v1/models" in parse_gateway_config(_doc()).passthrough
    assert parse_gateway_config(_doc(passthrough=[])).passthrough == ()
    assert parse_gateway_config(_doc(passthrough=["/health", "/health"])).passthrough == ("/health",)


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
