"""`kvtune gateway`: config errors are one line and exit 2 before anything listens; a real run
serves, answers, and drains on SIGTERM."""

from __future__ import annotations

import http.client
import json
import re
import signal
import subprocess
import sys
import threading

import pytest
import yaml
from click.testing import CliRunner

from kvtune.cli import cli

GOOD = {
    "version": 1, "upstream": "http://127.0.0.1:9", "block_size": 16, "block_budget": 100,
    "max_model_len": 2048, "listen": {"port": 0},
    "prompt_tokens": {"method": "estimate", "chars_per_token": 2, "margin_tokens": 8},
    "routes": [{"name": "chat", "match": {"path": "/v1/chat/completions"}, "max_new_tokens": 64}],
}


def write(tmp_path, doc) -> str:
    path = tmp_path / "gw.yaml"
    path.write_text(yaml.safe_dump(doc))
    return str(path)


@pytest.mark.parametrize("change, line", [
    ({"routes": [{"name": "chat"}]}, "routes[0].max_new_tokens: missing"),
    ({"block_budget": 0}, "block_budget: must be at least 1, got 0"),
    ({"colour": "blue"}, "colour: unknown key"),
    ({"prompt_tokens": {"method": "tokenizer", "tokenizer": "/nonexistent/dir/tok.json"}},
     "prompt_tokens.tokenizer"),
    ({"health": {"consecutive_failures": -1}}, "health.consecutive_failures: must be at least 0, got -1"),
    ({"health": {"consecutive_failures": 2.5}}, "health.consecutive_failures: expected an integer, got 2.5"),
    ({"health": {"ejection_s": 30, "max_ejection_s": 10}}, "health.max_ejection_s: 10 is below health.ejection_s (30)"),
    ({"health": {"max_ejected_share": 1.5}}, "health.max_ejected_share: must be at most 1, got 1.5"),
    ({"health": {"ejection": 2}}, "health.ejection: unknown key"),
])
def test_config_errors_exit_2_in_one_line(tmp_path, change, line):
    path = write(tmp_path, {**GOOD, **change})
    result = CliRunner().invoke(cli, ["gateway", "--config", path])
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: ") and line in lines[0]


def test_bad_upstream_override(tmp_path):
    result = CliRunner().invoke(cli, ["gateway", "--config", write(tmp_path, GOOD), "--upstream", "ftp://x"])
    assert result.exit_code == 2
    assert result.stderr.strip() == "Error: --upstream: must look like http://host:port, got 'ftp://x'"


def test_upstream_override_of_several_upstreams_is_refused(tmp_path):
    doc = {k: v for k, v in GOOD.items() if k not in ("upstream", "block_budget")}
    doc["upstreams"] = [{"url": "http://127.0.0.1:9", "block_budget": 100},
                        {"url": "http://127.0.0.1:10", "block_budget": 50}]
    path = write(tmp_path, doc)
    result = CliRunner().invoke(cli, ["gateway", "--config", path, "--upstream", "http://127.0.0.1:11"])
    assert result.exit_code == 2
    assert result.stderr.strip() == (f"Error: --upstream: {path} names 2 upstreams, each with its own budget: "
                                     "edit its upstreams: instead")


def test_listed_in_help():
    result = CliRunner().invoke(cli, ["--help"])
    assert re.search(r"^\s+gateway\s+Run the admission gateway", result.output, re.M)
    assert "Example" in CliRunner().invoke(cli, ["gateway", "--help"]).output


@pytest.mark.slow
def test_runs_serves_and_drains_on_sigterm(tmp_path):
    from fake_vllm import FakeVllm

    with FakeVllm() as up:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvtune", "gateway", "--config", write(tmp_path, GOOD),
             "--upstream", f"http://127.0.0.1:{up.port}", "--host", "127.0.0.1", "--port", "0"],
            stderr=subprocess.PIPE, text=True)
        try:
            first = proc.stderr.readline()
            match = re.search(r"listening on http://127\.0\.0\.1:(\d+)", first)
            assert match, first
            port = int(match.group(1))
            up.hold()
            results: list = []

            def stream() -> None:
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=20)
                body = {"model": "m", "messages": [{"role": "user", "content": "a b c"}], "stream": True,
                        "x_mode": "hold_stream"}
                try:
                    conn.request("POST", "/v1/chat/completions", body=json.dumps(body),
                                 headers={"Content-Type": "application/json"})
                    resp = conn.getresponse()
                    results.append((resp.status, resp.read()))
                finally:
                    conn.close()

            t = threading.Thread(target=stream)
            t.start()
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
            for _ in range(200):
                conn.request("GET", "/kvtune/ledger")
                ledger = json.loads(conn.getresponse().read())
                if ledger["reserved"]:
                    break
                threading.Event().wait(0.02)
            prompt = -(-len('[{"role":"user","content":"a b c"}]') // 2) + 8  # the configured estimate
            assert ledger["reserved"] == -(-(prompt + 64) // 16)
            conn.close()
            proc.send_signal(signal.SIGTERM)  # drains: the held stream finishes once released
            threading.Event().wait(0.3)
            assert proc.poll() is None
            up.release()
            t.join(20)
            assert proc.wait(20) == 0
            assert results and results[0][0] == 200 and results[0][1].endswith(b"data: [DONE]\n\n")
            assert "stopped; 0 blocks still reserved" in proc.stderr.read()
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(5)
            proc.stderr.close()


def test_bad_host_override_is_one_line(tmp_path):
    result = CliRunner().invoke(cli, ["gateway", "--config", write(tmp_path, GOOD), "--host", "bad host"])
    assert result.exit_code == 2
    assert result.stderr.strip() == ("Error: --host: expected a hostname or IP address such as 127.0.0.1, "
                                     "0.0.0.0 or ::1, got 'bad host'")


def test_upstream_override_with_an_impossible_port(tmp_path):
    result = CliRunner().invoke(cli, ["gateway", "--config", write(tmp_path, GOOD), "--upstream",
                                      "http://127.0.0.1:99999"])
    assert result.exit_code == 2
    assert result.stderr.strip() == ("Error: --upstream: the port must be a number from 1 to 65535, "
                                     "got 'http://127.0.0.1:99999'")
