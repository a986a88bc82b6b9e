"""gateway.yaml parsing: strict, with the key path in every error."""

from __future__ import annotations

import re
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvtune.domain.route import Api
from kvtune.errors import InputError
from kvtune.gateway.config import load_gateway_config, parse_gateway_config


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


def test_prefix_and_model_match():
    config = parse_gateway_config(_doc(routes=[
        {"name": "code", "match": {"path_prefix": "/v1/", "model": "coder"}, "max_new_tokens": 300},
        {"name": "rest", "max_new_tokens": 500},
    ]))
    assert config.route_for("/v1/completions", "coder").name == "code"
    assert config.route_for("/v1/completions", "chat").name == "rest"
    assert config.route_for("/v2/x", "coder").name == "rest"


def test_header_routes_match_the_exact_value_of_a_case_insensitive_name():
    config = parse_gateway_config(_doc(routes=[
        {"name": "rag", "match": {"header": "X-Team", "value": "rag-search"}, "max_new_tokens": 300},
        {"name": "support", "match": {"header": "x-team", "value": "support chat", "path": "/v1/chat/completions"},
         "max_new_tokens": 200},
        {"name": "rest", "max_new_tokens": 500},
    ]))
    assert config.route_headers == ("x-team",) and config.routes[0].match.header == "x-team"
    assert config.route_for("/v1/completions", None, {"x-team": "rag-search"}).name == "rag"
    assert config.route_for("/v1/chat/completions", None, {"x-team": "support chat"}).name == "support"
    assert config.route_for("/v1/completions", None, {"x-team": "support chat"}).name == "rest"
    assert config.route_for("/v1/completions", None, {"x-team": "Rag-Search"}).name == "rest"
    assert config.route_for("/v1/completions", None).name == "rest"


@pytest.mark.parametrize("match, field, words", [
    ({"header": "X-Team"}, "routes[0].match.value", "missing"),
    ({"value": "a"}, "routes[0].match.value", "only with match.header"),
    ({"header": "X Team", "value": "a"}, "routes[0].match.header", "is not a header name"),
    ({"header": "X-Team", "value": "a,b"}, "routes[0].match.value", "no comma"),
    ({"header": "X-Team", "value": " a"}, "routes[0].match.value", "no space at either end"),
    ({"header": "X-Team", "value": "équipe"}, "routes[0].match.value", "printable ASCII"),
    ({"header": "X-Team", "value": "a" * 257}, "routes[0].match.value", "at most 256"),
    ({"header": "X-Team", "value": 7}, "routes[0].match.value", "not a header value"),
])
def test_header_matches_a_gateway_cannot_hold_are_refused(match, field, words):
    with pytest.raises(InputError, match=re.escape(field) + ": .*" + words):
        parse_gateway_config(_doc(routes=[{"name": "r", "max_new_tokens": 20, "match": match}]))


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
    with pytest.raises(InputError, match="nope.yaml: no such file$"):
        load_gateway_config(tmp_path / "nope.yaml")


# --- values validated, not coerced (issue #10, item 10) ----------------------------------------


@pytest.mark.parametrize(
    "overrides, field, words",
    [
        ({"listen": {"port": 70000}}, "listen.port", "must be at most 65535, got 70000"),
        ({"listen": {"port": -1}}, "listen.port", "must be at least 0"),
        ({"listen": {"port": 8080.0}}, "listen.port", "expected an integer"),
        ({"listen": {"port": True}}, "listen.port", "expected an integer, got True"),
        ({"listen": ""}, "listen", "expected a mapping"),
        ({"listen": None}, "listen", "expected a mapping"),
        ({"listen": []}, "listen", "expected a mapping"),
        ({"listen": {"host": ""}}, "listen.host", "non-empty"),
        ({"listen": {"host": "bad host"}}, "listen.host", "hostname or IP address"),
        ({"listen": {"host": "a..b"}}, "listen.host", "hostname or IP address"),
        ({"listen": {"host": "[::1]"}}, "listen.host", "hostname or IP address"),
        ({"version": True}, "version", "expected an integer, got True"),
        ({"version": 1.0}, "version", "expected an integer"),
        ({"block_size": True}, "block_size", "expected an integer"),
        ({"block_budget": 2**70}, "block_budget", "must be at most"),
        ({"prompt_tokens": {"method": "estimate", "chars_per_token": float("inf"), "margin_tokens": 8}},
         "prompt_tokens.chars_per_token", "finite"),
        ({"prompt_tokens": {"method": "estimate", "chars_per_token": float("nan"), "margin_tokens": 8}},
         "prompt_tokens.chars_per_token", "finite"),
        ({"prompt_tokens": {"method": "estimate", "chars_per_token": 1e6, "margin_tokens": 8}},
         "prompt_tokens.chars_per_token", "must be at most"),
        ({"prompt_tokens": {"method": "estimate", "chars_per_token": 4, "margin_tokens": True}},
         "prompt_tokens.margin_tokens", "expected an integer"),
        ({"prompt_tokens": {"method": ["upstream-tokenize"]}}, "prompt_tokens.method", "is not one of"),
        ({"timeouts": {"read_s": float("nan")}}, "timeouts.read_s", "finite"),
        ({"timeouts": {"connect_s": float("inf")}}, "timeouts.connect_s", "finite"),
        ({"timeouts": {"drain_s": 10**400}}, "timeouts.drain_s", "must be at most"),
        ({"timeouts": {"drain_s": False}}, "timeouts.drain_s", "expected a number"),
        ({"queue": {"timeout_s": -0.5}}, "queue.timeout_s", "must be at least 0"),
        ({"queue": ""}, "queue", "expected a mapping"),
        ({"retry_after": {"max_s": 10**9}}, "retry_after.max_s", "must be at most"),
        ({"timeouts": 0}, "timeouts", "expected a mapping"),
        ({"prompt_tokens": False}, "prompt_tokens", "expected a mapping"),
        ({"upstream": "127.0.0.1:8000"}, "upstream", "must look like http://host:port"),
        ({"upstream": "ftp://127.0.0.1:8000"}, "upstream", "must look like http://host:port"),
        ({"upstream": "http://"}, "upstream", "must look like http://host:port"),
        ({"upstream": "http://127.0.0.1:99999"}, "upstream", "port"),
        ({"upstream": "http://127.0.0.1:80a"}, "upstream", "port"),
        ({"upstream": "http://user:pw@127.0.0.1:8000"}, "upstream", "user"),
        ({"upstream": "http://127.0.0.1:8000/?q=1"}, "upstream", "query"),
        ({"upstream": "http://127.0.0.1:8000/a b"}, "upstream", "path"),
        ({"upstream": "http://bad_host!:8000"}, "upstream", "hostname or IP address"),
        ({"upstream": "http://[::1:8000"}, "upstream", "must look like http://host:port"),
        ({"routes": [{"name": "x", "max_new_tokens": 10, "upstream": "localhost:9"}]},
         "routes[0].upstream", "must look like http://host:port"),
        ({"routes": [{"name": "x", "match": "", "max_new_tokens": 10}]}, "routes[0].match", "expected a mapping"),
        ({"routes": [{"name": "x", "max_new_tokens": 10**30}]}, "routes[0].max_new_tokens", "must be at most"),
    ],
)
def test_values_are_validated_not_coerced(overrides, field, words):
    with pytest.raises(InputError) as info:
        parse_gateway_config(_doc(**overrides), path="gateway.yaml")
    assert info.value.field == field
    assert words in str(info.value), str(info.value)
    assert str(info.value).startswith(f"gateway.yaml: {field}: ")


def test_port_error_reads_as_one_line():
    with pytest.raises(InputError) as info:
        parse_gateway_config(_doc(listen={"port": 70000}), path="gateway.yaml")
    assert str(info.value) == "gateway.yaml: listen.port: must be at most 65535, got 70000"


@pytest.mark.parametrize("host", ["127.0.0.1", "0.0.0.0", "::", "::1", "localhost", "gw.internal.example.com",
                                  "kvtune-gateway", "my_service"])
def test_well_formed_hosts_listen(host):
    assert parse_gateway_config(_doc(listen={"host": host, "port": 0})).host == host


@pytest.mark.parametrize("url", ["http://127.0.0.1:8000", "https://vllm.example.com", "http://[::1]:8000/",
                                 "http://vllm:8000/prefix/v2", "HTTP://Vllm:8000"])
def test_well_formed_upstreams(url):
    assert parse_gateway_config(_doc(upstream=url)).upstream == url


def test_errors_quote_values_briefly():
    huge = "x" * 1_000_000
    for doc in (_doc(upstream=huge), _doc(listen={"port": [huge] * 1000}), _doc(**{huge: 1}),
                _doc(prompt_tokens={"method": huge})):
        with pytest.raises(InputError) as info:
            parse_gateway_config(doc, path="gateway.yaml")
        assert len(str(info.value)) < 300, str(info.value)[:400]


def test_rendered_gateway_yaml_still_loads(tmp_path):
    from click.testing import CliRunner

    from kvtune.cli import cli

    out = tmp_path / "out"
    result = CliRunner().invoke(cli, ["recommend", "sample_logs/", "--model", "llama-3.1-8b", "--gpu", "H100-80GB",
                                      "--out", str(out)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    config = load_gateway_config(out / "gateway.yaml")
    assert config.port == 8080 and config.upstream == "http://127.0.0.1:8000"


# --- parsed safely (issue #10, item 9) ---------------------------------------------------------


def test_config_that_is_not_a_regular_file_is_refused(non_regular_file, without_hanging):
    with pytest.raises(InputError) as info:
        without_hanging(lambda: load_gateway_config(non_regular_file), non_regular_file)
    assert "expected a regular file" in str(info.value)


def test_billion_laughs_is_refused_quickly(tmp_path):
    path = tmp_path / "gateway.yaml"
    # nine levels of nine aliases: 9**9 "lol"s under `model`, which must be a string, so an error
    # that quotes the value unbounded would expand them (1.5-3 GB before the fix)
    levels = ['  - &a0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    levels += [f"  - &a{i} [" + ",".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, 9)]
    path.write_text("version: 1\nupstream: http://127.0.0.1:8000\nblock_size: 16\nblock_budget: 10\n"
                    "max_model_len: 100\nroutes: [{name: x, max_new_tokens: 5}]\nmodel:\n" + "\n".join(levels) + "\n")
    start = time.perf_counter()
    with pytest.raises(InputError) as info:
        load_gateway_config(path)
    assert time.perf_counter() - start < 1
    assert info.value.line == 8 and "anchors and aliases are not allowed" in str(info.value)


def test_duplicate_keys_name_key_and_line(tmp_path):
    path = tmp_path / "gateway.yaml"
    path.write_text("version: 1\nlisten:\n  port: 8080\n  port: 70000\nupstream: http://127.0.0.1:8000\n")
    with pytest.raises(InputError) as info:
        load_gateway_config(path)
    assert str(info.value) == f"{path}:4: unsupported YAML: duplicate key 'port' (first at line 3)"


def test_oversized_config_is_refused_before_parsing(tmp_path):
    from kvtune.userfiles import CONFIG_MAX_BYTES

    path = tmp_path / "gateway.yaml"
    path.write_bytes(b"version: 1\n" + b"# padding\n" * (CONFIG_MAX_BYTES // 10))
    with pytest.raises(InputError, match="larger than"):
        load_gateway_config(path)


def test_yaml_numbers_too_large_for_python_are_refused(tmp_path):
    path = tmp_path / "gateway.yaml"
    path.write_text("version: 1\nblock_budget: " + "9" * 5000 + "\n")
    with pytest.raises(InputError, match="an integer of 5,000 digits"):
        load_gateway_config(path)


def test_unknown_keys_are_named_as_written_or_briefly():
    with pytest.raises(InputError) as info:
        parse_gateway_config(_doc(queue={"max-waiting": 5}), path="gw.yaml")
    assert info.value.field == "queue.max-waiting"
    with pytest.raises(InputError) as info:
        parse_gateway_config(_doc(queue={"k" * 10_000: 5}), path="gw.yaml")
    assert len(info.value.field) <= len("queue.") + 40


def test_client_limits_default_to_nginx_own_and_a_body_cap_sized_to_the_context():
    limits = parse_gateway_config(_doc()).limits
    assert (limits.header_timeout_s, limits.body_timeout_s, limits.keepalive_timeout_s) == (60.0, 60.0, 75.0)
    assert limits.send_timeout_s == 60.0 and limits.max_connections == 4096
    assert limits.body_deadline_s == 120.0  # the whole body; nginx has no such limit
    assert parse_gateway_config(_doc(limits={"body_timeout_s": 3})).limits.body_deadline_s == 6.0  # twice
    assert limits.max_body_bytes == 1024 * 1024  # 32 bytes a token of an 8k context is under the 1 MiB floor
    assert parse_gateway_config(_doc(max_model_len=131072)).limits.max_body_bytes == 32 * 131072
    given = parse_gateway_config(_doc(limits={"keepalive_timeout_s": 4, "max_connections": 64,
                                              "max_body_bytes": 4096})).limits
    assert (given.keepalive_timeout_s, given.max_connections, given.max_body_bytes) == (4.0, 64, 4096)


@pytest.mark.parametrize(("limits", "field", "says"), [
    ({"header_timeout_s": float("nan")}, "limits.header_timeout_s", "finite"),
    ({"body_timeout_s": 0}, "limits.body_timeout_s", "at least"),
    ({"body_deadline_s": 0}, "limits.body_deadline_s", "at least"),
    ({"keepalive_timeout_s": 10**6}, "limits.keepalive_timeout_s", "at most"),
    ({"send_timeout_s": "60"}, "limits.send_timeout_s", "expected a number"),
    ({"max_connections": 0}, "limits.max_connections", "at least 1"),
    ({"max_connections": True}, "limits.max_connections", "expected an integer"),
    ({"max_body_bytes": 1.5e6}, "limits.max_body_bytes", "expected an integer"),
    ({"max_header_bytes": 100}, "limits.max_header_bytes", "at least 1024"),
    ({"max_header_bytes": 2048, "max_header_line_bytes": 4096}, "limits.max_header_line_bytes",
     "at most limits.max_header_bytes"),
    ({"idle_s": 5}, "limits.idle_s", "unknown key"),
    ([], "limits", "expected a mapping"),
])
def test_client_limits_are_validated_and_name_the_field(limits, field, says):
    with pytest.raises(InputError) as caught:
        parse_gateway_config(_doc(limits=limits))
    assert caught.value.field == field and says in caught.value.message


# ---------------------------------------------------------------- ledger: memory | redis

def test_ledger_defaults_to_memory_and_reads_redis():
    from kvtune.gateway.config import LedgerBackend, OnLedgerError

    assert not parse_gateway_config(_doc()).ledger.shared
    ledger = parse_gateway_config(_doc(ledger={
        "backend": "redis", "url": "redis://:s3cret@127.0.0.1:6379/0", "key_prefix": "{gw}", "lease_s": 5,
        "on_error": "local", "replicas_hint": 3, "op_timeout_s": 2})).ledger
    assert (ledger.backend, ledger.key_prefix, ledger.lease_s, ledger.on_error, ledger.replicas_hint,
            ledger.op_timeout_s) == (LedgerBackend.REDIS, "{gw}", 5.0, OnLedgerError.LOCAL, 3, 2.0)
    assert "s3cret" not in repr(ledger)
    assert parse_gateway_config(_doc(ledger={"backend": "redis", "url": "redis://h/0"})).ledger.on_error \
        is OnLedgerError.REJECT


REDIS = {"backend": "redis", "url": "redis://127.0.0.1:6379/0"}


@pytest.mark.parametrize(("overrides", "field", "words"), [
    ({"ledger": {"backend": "etcd"}}, "ledger.backend", "is not one of memory, redis"),
    ({"ledger": {"backend": "redis"}}, "ledger.url", "missing"),
    ({"ledger": {**REDIS, "url": "http://127.0.0.1:6379"}}, "ledger.url", "redis://"),
    ({"ledger": {**REDIS, "url": 6379}}, "ledger.url", "got 6379"),
    ({"ledger": {**REDIS, "lease_s": 0}}, "ledger.lease_s", "at least 0.1"),
    ({"ledger": {**REDIS, "lease_s": True}}, "ledger.lease_s", "expected a number"),
    ({"ledger": {**REDIS, "key_prefix": "a b"}}, "ledger.key_prefix", "not a key prefix"),
    ({"ledger": {**REDIS, "on_error": "retry"}}, "ledger.on_error", "is not one of reject, local"),
    ({"ledger": {**REDIS, "on_error": "local"}}, "ledger.replicas_hint", "missing"),
    ({"ledger": {**REDIS, "on_error": "local", "replicas_hint": 0}}, "ledger.replicas_hint", "at least 1"),
    ({"ledger": {**REDIS, "ttl": 3}}, "ledger.ttl", "unknown key"),
    ({"ledger": {**REDIS, "op_timeout_s": 0}}, "ledger.op_timeout_s", "at least 0.01"),
    ({"ledger": {**REDIS, "op_timeout_s": 31}}, "ledger.op_timeout_s", "at most 30"),
    ({"ledger": {**REDIS, "lease_s": 2, "op_timeout_s": 2}}, "ledger.op_timeout_s", "not below lease_s (2 s)"),
    ({"ledger": {"backend": "memory", "op_timeout_s": 1}}, "ledger.op_timeout_s", "only for ledger.backend"),
    ({"ledger": {"url": "redis://h"}}, "ledger.url", "only for ledger.backend: redis"),
    ({"ledger": {"backend": "memory", "replicas_hint": 2}}, "ledger.replicas_hint", "only for ledger.backend"),
])
def test_ledger_errors_name_the_field(overrides, field, words):
    with pytest.raises(InputError) as info:
        parse_gateway_config(_doc(**overrides), path="gateway.yaml")
    assert info.value.field == field and words in str(info.value), str(info.value)
    assert "\n" not in str(info.value)


def test_the_statistical_policy_runs_on_the_redis_ledger():
    config = parse_gateway_config(_doc(ledger=REDIS, admission={"policy": "statistical", "epsilon": 0.01}))
    assert config.ledger.url == REDIS["url"] and config.admission.epsilon == 0.01


@pytest.mark.parametrize("url", ["http://user:hunter2@host:6379/0", "redis://user:hunter2@host:6379/0 x",
                                 "redis//user:hunter2@host"])
def test_a_bad_ledger_url_is_never_quoted(url):
    with pytest.raises(InputError) as info:
        parse_gateway_config(_doc(ledger={"backend": "redis", "url": url}))
    assert "hunter2" not in str(info.value) and info.value.field == "ledger.url"


_LEDGER_VALUES = st.one_of(st.none(), st.booleans(), st.integers(-5, 10**6), st.floats(allow_nan=True),
                           st.text(max_size=12), st.sampled_from(["memory", "redis", "reject", "local",
                                                                  "redis://:pw-42@h:1/0", "unix:///tmp/r.sock"]),
                           st.lists(st.integers(), max_size=2))


@given(st.one_of(_LEDGER_VALUES, st.dictionaries(
    st.sampled_from(["backend", "url", "key_prefix", "lease_s", "on_error", "replicas_hint", "op_timeout_s", "x"]),
    _LEDGER_VALUES, max_size=6)))
def test_fuzzed_ledgers_are_a_ledger_or_an_error_naming_the_field(ledger):
    try:
        config = parse_gateway_config(_doc(ledger=ledger))
    except InputError as exc:
        assert exc.field is not None and exc.field.startswith("ledger"), exc.field
        assert "pw-42" not in str(exc)
        return
    spec = config.ledger
    assert spec.lease_s >= 0.1 and spec.replicas_hint >= 1 and spec.key_prefix
    assert (spec.url is not None) is spec.shared


@pytest.mark.parametrize("key", ["backend", "key_prefix", "on_error", "url", "lease_s", "replicas_hint"])
def test_a_url_in_the_wrong_ledger_field_is_never_quoted(key):
    ledger = {"backend": "redis", "url": "redis://h/0", "on_error": "local", "replicas_hint": 2,
              key: "redis://:hunter2@h:6379/0 "}
    with pytest.raises(InputError) as info:
        parse_gateway_config(_doc(ledger=ledger))
    assert "hunter2" not in str(info.value) and info.value.field == f"ledger.{key}", str(info.value)


@pytest.mark.parametrize("written", ["1:0", "010", "0x10", "1_6", "1:30.5"])
def test_yaml_numbers_other_than_plain_decimal_are_refused(tmp_path, written):
    """YAML 1.1 (PyYAML) reads `block_size: 1:0` as 60 and `010` as 8; YAML 1.2 reads neither so."""
    path = tmp_path / "gateway.yaml"
    path.write_text(f"version: 1\nupstream: http://127.0.0.1:8000\nblock_size: {written}\n")
    with pytest.raises(InputError) as info:
        load_gateway_config(path)
    assert str(info.value).startswith(f"{path}:3: unsupported YAML: the number '{written}' is not plain decimal")


FLOW = {"token_time_s": 0.02, "bands": [{"name": "interactive", "deadline_s": 2}, {"name": "batch", "deadline_s": 60}]}


def test_flow_section_reads_with_its_defaults_and_routes_name_bands():
    doc = _doc(flow=FLOW)
    doc["routes"][0]["band"] = "batch"
    config = parse_gateway_config(doc)
    flow = config.flow
    assert flow is not None and [b.name for b in flow.bands] == ["interactive", "batch"]
    assert (flow.band_header, flow.flow_header, flow.max_waiting, flow.max_waiting_per_flow, flow.max_flows,
            flow.metrics_flows, flow.default_weight, flow.default_band_index) == (
        "x-kvtune-priority", "x-kvtune-flow", 1024, 64, 1024, 10, 1.0, 0)
    assert config.routes[0].band == "batch" and config.routes[1].band is None
    assert parse_gateway_config(_doc()).flow is None  # absent: today's queue


@pytest.mark.parametrize("overrides, field, words", [
    ({"flow": FLOW, "queue": {"max_waiting": 4}}, "queue", "replaces queue"),
    ({"flow": {**FLOW, "bands": []}}, "flow.bands", "1 to 8"),
    ({"flow": {**FLOW, "bands": [{"name": "A", "deadline_s": 1}]}}, "flow.bands[0].name", "band name"),
    ({"flow": {**FLOW, "bands": [{"name": "a", "deadline_s": 1}] * 2}}, "flow.bands[1].name", "twice"),
    ({"flow": {**FLOW, "bands": [{"name": "a", "deadline_s": -1}]}}, "flow.bands[0].deadline_s", "at least 0"),
    ({"flow": {**FLOW, "default_band": "x"}}, "flow.default_band", "not one of"),
    ({"flow": {**FLOW, "token_time_s": 0}}, "flow.token_time_s", "at least"),
    ({"flow": {**FLOW, "weights": {"t": 0}}}, "flow.weights.t", "at least"),
    ({"flow": {"bands": FLOW["bands"]}}, "flow.token_time_s", "missing"),
    ({"flow": {**FLOW, "band_header": "bad header"}}, "flow.band_header", "header name"),
    ({"routes": [{"name": "x", "max_new_tokens": 10, "band": "interactive"}]}, "routes[0].band", "flow:"),
    ({"flow": FLOW, "routes": [{"name": "x", "max_new_tokens": 10, "band": "gold"}]}, "routes[0].band", "not one of"),
    ({"flow": FLOW, "ledger": {"backend": "redis", "url": "redis://127.0.0.1:6379"}}, "flow", "not yet supported"),
    ({"flow": {**FLOW, "bands": [{**FLOW["bands"][0], "reserve_blocks": -1}, FLOW["bands"][1]]}},
     "flow.bands[0].reserve_blocks", "at least 0"),
    ({"flow": {**FLOW, "bands": [{**FLOW["bands"][0], "reserve_blocks": 1.5}, FLOW["bands"][1]]}},
     "flow.bands[0].reserve_blocks", "expected an integer"),
    ({"flow": {**FLOW, "bands": [FLOW["bands"][0], {**FLOW["bands"][1], "reserve_blocks": 10}]}},
     "flow.bands[1].reserve_blocks", "the last band has no band below it"),
    ({"flow": {**FLOW, "bands": [{**FLOW["bands"][0], "reserve_blocks": 1000}, FLOW["bands"][1]]}},
     "flow.bands[0].reserve_blocks", "add up to 1000 blocks, not below the block budget 1000"),
])
def test_flow_errors_name_the_field(overrides, field, words):
    with pytest.raises(InputError) as info:
        parse_gateway_config(_doc(**overrides), path="gw.yaml")
    assert info.value.field == field and words in str(info.value)


def test_a_bands_reserve_reads_back_as_written():
    """flow.bands[].reserve_blocks (docs/guides/flow-control.md, The reserve): read, K_b derived,
    and FlowControl.to_dict writes what the reader reads back."""
    import yaml

    flow = {**FLOW, "bands": [{**FLOW["bands"][0], "reserve_blocks": 120}, FLOW["bands"][1]]}
    config = parse_gateway_config(_doc(flow=flow))
    assert config.flow is not None
    assert [b.reserve_blocks for b in config.flow.bands] == [120, 0]
    assert [config.flow.kept_blocks(i) for i in range(2)] == [0, 120]
    written = yaml.safe_load(yaml.safe_dump(config.flow.to_dict()))
    assert written["bands"] == [{"name": "interactive", "deadline_s": 2, "reserve_blocks": 120},
                                {"name": "batch", "deadline_s": 60}]  # none written where there is none
    assert parse_gateway_config(_doc(flow=written)).flow == config.flow


def test_a_reserve_error_names_the_file_and_field(tmp_path):
    path = tmp_path / "gateway.yaml"
    path.write_text("version: 1\nupstream: http://127.0.0.1:8000\nblock_size: 16\nblock_budget: 100\n"
                    "max_model_len: 1000\nroutes: [{name: x, max_new_tokens: 5}]\nflow:\n  token_time_s: 0.02\n"
                    "  bands:\n    - {name: interactive, deadline_s: 2, reserve_blocks: 100}\n"
                    "    - {name: batch, deadline_s: 60}\n")
    with pytest.raises(InputError) as info:
        load_gateway_config(path)
    # the reader's field errors name the file and the field (no line: gateway.yaml's reader keeps none)
    assert str(info.value) == (f"{path}: flow.bands[0].reserve_blocks: the bands' reserves add up to 100 blocks, "
                               "not below the block budget 100: the last band could never be admitted")


def test_the_reserves_together_must_stay_below_every_upstreams_budget():
    doc = {k: v for k, v in _doc().items() if k not in ("upstream", "block_budget")}
    doc["upstreams"] = [{"url": "http://127.0.0.1:8000", "block_budget": 1000},
                        {"url": "http://127.0.0.1:8001", "block_budget": 50}]
    bands = [{"name": "a", "deadline_s": 1, "reserve_blocks": 30}, {"name": "b", "deadline_s": 1, "reserve_blocks": 19},
             {"name": "c", "deadline_s": 1}]
    config = parse_gateway_config({**doc, "flow": {**FLOW, "bands": bands}})
    assert config.flow is not None and config.flow.kept_blocks(2) == 49
    bands[1]["reserve_blocks"] = 20
    with pytest.raises(InputError) as info:
        parse_gateway_config({**doc, "flow": {**FLOW, "bands": bands}})
    assert info.value.field == "flow.bands[1].reserve_blocks"
    assert "add up to 50 blocks, not below the block budget 50" in str(info.value)


def test_an_upstream_weight_past_1000_is_refused_while_a_flow_weight_may_be_larger():
    """Two limits named alike: the flow weights' (10^6) once rebound the upstream weights' (1000)."""
    doc = {k: v for k, v in _doc().items() if k not in ("upstream", "block_budget")}
    doc["upstreams"] = [{"url": "http://127.0.0.1:8000", "block_budget": 100, "weight": 1001},
                        {"url": "http://127.0.0.1:8001", "block_budget": 100}]
    with pytest.raises(InputError, match=r"upstreams\[0\]\.weight: must be at most 1000, got 1001"):
        parse_gateway_config(doc, path="gateway.yaml")
    doc["upstreams"][0]["weight"] = 1000
    assert parse_gateway_config(doc, path="gateway.yaml").upstreams[0].weight == 1000
