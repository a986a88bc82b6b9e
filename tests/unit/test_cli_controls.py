"""Control characters in logged strings never reach a terminal raw (issue #26 item 8): routes,
model ids and paths from logs are printed with their controls escaped by `profile`, `recommend`
and error lines, and kept exact in --json."""

from __future__ import annotations

import json
import re
from pathlib import Path

from click.testing import CliRunner
from conftest import REPO
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtune.cli import cli
from kvtune.controls import escape_controls

EVIL = "/v1/chat/completions\x1b[2J\x1b]0;pwned\x07\u202e\rX\x9b31m"
SHOWN = "/v1/chat/completions\\x1b[2J\\x1b]0;pwned\\x07\\u202e\\x0dX\\x9b31m"
# Any raw control a terminal acts on; "\n" separates output lines and is kvtune's own.
RAW = re.compile("[\x00-\x09\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069]")
PAIRS = REPO / "sample_logs" / "openai_chat_pairs.jsonl"


def evil_log(path: Path, route: str = EVIL, model: str | None = None) -> Path:
    rows = [json.loads(line) for line in PAIRS.read_text().splitlines()]
    for i, row in enumerate(rows):
        if i % 3 == 0:
            row["url"] = route
        if model is not None and i == 0:
            row["request"]["model"] = row["response"]["model"] = model
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def run(*args: str):
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


def assert_no_raw_control(*texts: str) -> None:
    for text in texts:
        assert not RAW.search(text), RAW.findall(text)


def test_escape_controls_writes_each_control_as_its_escape():
    assert escape_controls(EVIL) == SHOWN
    assert escape_controls("/v1/ünïcode ok") == "/v1/ünïcode ok"


def test_profile_shows_a_logged_route_escaped_and_json_keeps_it_exact(tmp_path):
    log = str(evil_log(tmp_path / "evil.jsonl"))
    result = run("profile", log)
    assert result.exit_code == 0, result.output
    assert_no_raw_control(result.stdout, result.stderr)
    assert SHOWN in result.stdout
    result = run("profile", log, "--json")
    assert EVIL in [r["route"] for r in json.loads(result.stdout)["routes"]]


def test_recommend_output_and_reports_hold_no_raw_control(tmp_path):
    out = tmp_path / "out"
    result = run("recommend", str(evil_log(tmp_path / "evil.jsonl")), "--model", "llama-3.1-8b",
                 "--gpu", "H100-80GB", "--out", str(out))
    assert result.exit_code == 0, result.output
    assert_no_raw_control(result.stdout, result.stderr)
    assert SHOWN in result.stdout
    assert_no_raw_control((out / "report.md").read_text(), (out / "report.html").read_text())
    assert EVIL in [r["route"] for r in json.loads((out / "recommendation.json").read_text())["routes"]]


def test_a_logged_model_id_in_an_error_line_is_escaped(tmp_path):
    log = evil_log(tmp_path / "evil.jsonl", model="evil\x1b]0;pwned\x07\u202emodel")
    result = run("recommend", str(log), "--model", "llama-3.1-8b", "--gpu", "H100-80GB",
                 "--out", str(tmp_path / "out"))
    assert result.exit_code == 2, result.output
    assert "evil\\x1b]0;pwned\\x07\\u202emodel" in result.stderr
    assert_no_raw_control(result.stdout, result.stderr)


def test_a_path_with_controls_in_an_error_line_is_escaped(tmp_path):
    log = tmp_path / "log\x1b[2J\u202e.jsonl"
    log.write_text('{"url": "/v1/chat/completions", "usage": \n')
    result = run("profile", str(log))
    assert result.exit_code == 2, result.output
    assert "log\\x1b[2J\\u202e.jsonl" in result.stderr
    assert_no_raw_control(result.stdout, result.stderr)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(route=st.text(min_size=1, max_size=30))
def test_no_route_string_puts_a_raw_control_on_the_terminal(tmp_path, route):
    log = evil_log(tmp_path / "fuzz.jsonl", route=route)
    result = run("profile", str(log))
    assert result.exit_code in (0, 2), result.output
    assert_no_raw_control(result.stdout, result.stderr)


def test_check_lines_escape_a_deployed_path_with_controls(tmp_path):
    out = tmp_path / "out"
    assert run("recommend", str(PAIRS), "--model", "llama-3.1-8b", "--gpu", "H100-80GB",
               "--out", str(out)).exit_code == 0
    deployed = tmp_path / "gw\x1b]0;pwned\x07.yaml"
    deployed.write_text((out / "gateway.yaml").read_text())
    result = run("check", str(PAIRS), "--model", "llama-3.1-8b", "--gpu", "H100-80GB", "--deployed", str(deployed))
    assert result.exit_code == 0, result.output
    assert "gw\\x1b]0;pwned\\x07.yaml" in result.stdout
    assert_no_raw_control(result.stdout, result.stderr)
