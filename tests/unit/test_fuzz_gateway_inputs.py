"""Hypothesis over the two gateway inputs issue 26 found read wrongly (item 10, item 7):

- a number in gateway.yaml is read as YAML 1.2's core schema reads it, or refused with one
  `file:line:` error: never as PyYAML's YAML 1.1 reads `1:0` (60), `010` (8), `0x10`, `1_0`;
- a credential in a URL (a password, a user standing for a token, a secret query value) never
  comes back in an error line, whichever command and whichever way the URL is wrong.

A few seconds each (the CLI runs in process)."""

from __future__ import annotations

import math
import re
import string

import yaml
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtune.cli import cli
from kvtune.errors import InputError
from kvtune.gateway.config import load_gateway_config

GATEWAY = {
    "version": 1, "upstream": "http://127.0.0.1:9", "block_size": 16, "block_budget": 100,
    "max_model_len": 2048, "listen": {"port": 0},
    "prompt_tokens": {"method": "estimate", "chars_per_token": 2, "margin_tokens": 8},
    "routes": [{"name": "chat", "match": {"path": "/v1/chat/completions"}, "max_new_tokens": 64}],
}

# --- numbers ----------------------------------------------------------------------------------

# YAML 1.2 core schema (https://yaml.org/spec/1.2.2/#1032-tag-resolution): these and only these
# plain scalars are numbers.
_CORE_INT = re.compile(r"[-+]?[0-9]+")
_CORE_FLOAT = re.compile(r"[-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)([eE][-+]?[0-9]+)?")


def _core(text: str) -> int | float | None:
    """The number YAML 1.2's core schema reads (octal/hex/inf/nan aside: refusing those is fine)."""
    if _CORE_INT.fullmatch(text):
        return int(text)
    if _CORE_FLOAT.fullmatch(text):
        return float(text)
    return None


_digits = st.text(alphabet="0123456789", min_size=1, max_size=4)
spellings = st.one_of(
    _digits, st.builds("{}{}".format, st.sampled_from(["+", "-", "0", "00"]), _digits),
    st.builds("{}:{}".format, _digits, _digits), st.builds("{}:{}:{}".format, _digits, _digits, _digits),
    st.builds("{}_{}".format, _digits, _digits), st.builds("0x{}".format, _digits), st.builds("0o{}".format, _digits),
    st.builds("0b{}".format, st.text(alphabet="01", min_size=1, max_size=6)),
    st.builds("{}.{}".format, _digits, _digits), st.builds("{}e{}".format, _digits, st.sampled_from(["1", "+2", "-1"])),
    st.sampled_from([".inf", "-.inf", ".nan", "~", "null", "yes", "on", "1:30.5", "1e400", "12.", ".5", "0"]))
# (document path, what GatewayConfig holds there)
NUMBER_FIELDS = {
    ("block_size",): lambda c: c.block_size,
    ("block_budget",): lambda c: c.block_budget,
    ("max_model_len",): lambda c: c.max_model_len,
    ("routes", 0, "max_new_tokens"): lambda c: c.routes[0].max_new_tokens,
    ("prompt_tokens", "chars_per_token"): lambda c: c.prompt_tokens.chars_per_token,
    ("prompt_tokens", "margin_tokens"): lambda c: c.prompt_tokens.margin_tokens,
}


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(where=st.sampled_from(sorted(NUMBER_FIELDS, key=str)), written=spellings)
def test_a_yaml_number_is_read_as_yaml_1_2_reads_it_or_refused(tmp_path, where, written):
    doc = yaml.safe_load(yaml.safe_dump(GATEWAY))
    target = doc
    for key in where[:-1]:
        target = target[key]
    target[where[-1]] = "@@"
    text = yaml.safe_dump(doc, sort_keys=False).replace("'@@'", written)
    line = next(i for i, row in enumerate(text.splitlines(), 1) if written in row)
    path = tmp_path / "gateway.yaml"
    path.write_text(text)
    try:
        config = load_gateway_config(path)
    except InputError as exc:
        message = str(exc)
        assert "\n" not in message and message.startswith(f"{path}:"), message
        return
    read = NUMBER_FIELDS[where](config)
    core = _core(written)
    assert core is not None and not isinstance(read, bool), f"{written!r} read as {read!r}; YAML 1.2 reads text"
    assert math.isclose(read, core), f"{written!r} read as {read!r}; YAML 1.2 reads {core!r}"
    assert line  # the field's own line is where a refusal points


# --- credentials ------------------------------------------------------------------------------

_SECRET = st.text(alphabet=string.ascii_letters + string.digits + "-._~!$'()*+,;=", min_size=6, max_size=16)
# How a URL holding a credential is wrong: each reaches a different check.
_BROKEN = ["http://{user}:{pw}@127.0.0.1:8000", "http://{user}:{pw}@127.0.0.1:99999", "ftp://{user}:{pw}@h:1",
           "http://{pw}@127.0.0.1:8000", "http://{user}:{pw}@[::1", "http://127.0.0.1:8000/v1?token={pw}",
           "http://127.0.0.1:8000/?sig={pw}&x=1", "http://{user}:{pw}@h:1/x?access_token={pw}#f",
           "https://{user}:{pw}@h:0", "http://{user}:{pw}@h:1 trailing", "http://{user}:{pw}@"]
# Redis URLs the ledger refuses before connecting (a well-formed one would start the gateway)
_REDIS_BROKEN = ["redis://{user}:{pw}@127.0.0.1:99999/0", "redis://{user}:{pw}@[::1/0", "http://{user}:{pw}@h:1/0",
                 "redis://{user}:{pw}@h:0/0", "redis://{user}:{pw}@h:1/x", "redis://{user}:{pw}@"]


def _run(*args: str):
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(secret=_SECRET, where=st.sampled_from(["option", "yaml", "upstreams", "redis"]), data=st.data())
def test_a_credential_in_a_url_never_comes_back(tmp_path, secret, where, data):
    secret = "Sx" + secret
    shape = data.draw(st.sampled_from(_REDIS_BROKEN if where == "redis" else _BROKEN))
    url = shape.format(user="admin", pw=secret)
    doc = yaml.safe_load(yaml.safe_dump(GATEWAY))
    args = []
    if where == "option":
        args = ["--upstream", url]
    elif where == "yaml":
        doc["upstream"] = url
    elif where == "upstreams":
        del doc["upstream"], doc["block_budget"]
        doc["upstreams"] = [{"url": "http://127.0.0.1:9", "block_budget": 50}, {"url": url, "block_budget": 50}]
    else:
        doc["ledger"] = {"backend": "redis", "url": url}
    path = tmp_path / "gateway.yaml"
    path.write_text(yaml.safe_dump(doc))
    result = _run("gateway", "--config", str(path), *args)
    assert result.exit_code == 2, result.output
    assert secret not in result.output, result.output
    assert len(result.output.strip().splitlines()) == 1, result.output
