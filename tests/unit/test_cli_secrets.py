"""A credential typed into a URL never comes back in kvtune's output (issue #26 item 7): every
command that quotes an upstream, a server or a log URL in an error shows it redacted."""

from __future__ import annotations

import json
import string

import pytest
import yaml
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtune.cli import cli
from kvtune.masking import redact

SECRETS = ("pw-s3cret", "tok-s3cret")
URLS = {
    "http://admin:pw-s3cret@127.0.0.1:8000": "'http://admin:***@127.0.0.1:8000'",
    "http://tok-s3cret@127.0.0.1:8000": "'http://***@127.0.0.1:8000'",
    "http://127.0.0.1:8000/v1?token=tok-s3cret": "'http://127.0.0.1:8000/v1?token=***'",
    "http://127.0.0.1:8000/?sig=tok-s3cret&x=1": "'http://127.0.0.1:8000/?sig=***&x=1'",
}
GATEWAY = {
    "version": 1, "upstream": "http://127.0.0.1:9", "block_size": 16, "block_budget": 100,
    "max_model_len": 2048, "listen": {"port": 0},
    "prompt_tokens": {"method": "estimate", "chars_per_token": 2, "margin_tokens": 8},
    "routes": [{"name": "chat", "match": {"path": "/v1/chat/completions"}, "max_new_tokens": 64}],
}


def run(*args: str):
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


def assert_redacted(result, shown: str) -> None:
    assert result.exit_code == 2, result.output
    assert shown in result.stderr, result.stderr
    assert not any(s in result.output for s in SECRETS), result.output
    assert len(result.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("url, shown", URLS.items())
def test_gateway_upstream_option_is_redacted(tmp_path, url, shown):
    config = tmp_path / "gw.yaml"
    config.write_text(yaml.safe_dump(GATEWAY))
    assert_redacted(run("gateway", "--config", str(config), "--upstream", url), shown)


@pytest.mark.parametrize("url, shown", URLS.items())
def test_gateway_yaml_upstream_is_redacted(tmp_path, url, shown):
    config = tmp_path / "gw.yaml"
    config.write_text(yaml.safe_dump({**GATEWAY, "upstream": url}))
    assert_redacted(run("gateway", "--config", str(config)), shown)


@pytest.mark.parametrize("url, shown", URLS.items())
def test_recommend_upstream_is_redacted(tmp_path, url, shown):
    result = run("recommend", "sample_logs/", "--model", "llama-3.1-8b", "--gpu", "H100-80GB",
                 "--upstream", url, "--out", str(tmp_path / "out"))
    assert_redacted(result, shown)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("url, shown", URLS.items())
def test_check_upstream_is_redacted(tmp_path, url, shown):
    config = tmp_path / "gateway.yaml"
    config.write_text(yaml.safe_dump(GATEWAY))
    result = run("check", "sample_logs/", "--model", "llama-3.1-8b", "--gpu", "H100-80GB",
                 "--deployed", str(config), "--upstream", url)
    assert_redacted(result, shown)


@pytest.mark.parametrize("url, shown", URLS.items())
def test_check_deployed_gateway_yaml_upstream_is_redacted(tmp_path, url, shown):
    config = tmp_path / "gateway.yaml"
    config.write_text(yaml.safe_dump({**GATEWAY, "upstream": url}))
    result = run("check", "sample_logs/", "--model", "llama-3.1-8b", "--gpu", "H100-80GB",
                 "--deployed", str(config))
    assert_redacted(result, shown)


@pytest.mark.parametrize("url, shown", URLS.items())
def test_check_recommendation_json_upstream_is_redacted(tmp_path, url, shown):
    assert run("recommend", "sample_logs/", "--model", "llama-3.1-8b", "--gpu", "H100-80GB",
               "--out", str(tmp_path / "out")).exit_code == 0
    rec_path = tmp_path / "out" / "recommendation.json"
    rec = json.loads(rec_path.read_text())
    rec["upstream"] = url
    rec_path.write_text(json.dumps(rec))
    for json_ in ((), ("--json",)):
        result = run("check", str(rec_path), "--deployed", str(tmp_path / "out" / "gateway.yaml"), *json_)
        assert not any(s in result.output for s in SECRETS), result.output


@pytest.mark.parametrize("url, shown", URLS.items())
def test_bench_url_is_redacted(url, shown):
    assert_redacted(run("bench", url, "sample_logs/"), shown)


def test_redis_ledger_url_keeps_only_the_user():
    assert redact("redis://gw:pw-s3cret@127.0.0.1:6379/0") == "redis://gw:***@127.0.0.1:6379/0"
    assert redact("redis://:pw-s3cret@127.0.0.1:6379/0") == "redis://:***@127.0.0.1:6379/0"
    assert redact("http://tok-s3cret@[::1:8000/?token=x") == "http://***@[::1:8000/?***"


_SECRET = st.text(alphabet=string.ascii_letters + string.digits + "-._~!$&'()*+,;=%:", min_size=6, max_size=20)


@settings(max_examples=200, deadline=None)
@given(password=_SECRET, token=_SECRET, key=st.sampled_from(["token", "access_token", "X-Amz-Signature", "sig",
                                                             "api_key", "apiKey", "secret", "password", "auth"]))
def test_redact_never_shows_a_password_or_a_secret_query_value(password, token, key):
    password, token = "Pw" + password.replace("@", ""), "Tk" + token.replace("&", "").replace("#", "")
    url = f"https://user:{password}@logs.example.com:8443/a.jsonl?{key}={token}&part=2"
    shown = redact(url)
    assert password not in shown and token not in shown, shown
    assert shown.startswith("https://user:***@logs.example.com:8443/a.jsonl?") and "part=2" in shown
    bare = redact(f"http://{password.replace(':', '')}@127.0.0.1:8000")  # a lone token
    assert bare == "http://***@127.0.0.1:8000"
