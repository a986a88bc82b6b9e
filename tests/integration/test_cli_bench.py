"""`kvtune bench` through click: exit codes, exact error lines, JSON fields, files written."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from fake_vllm import TEMPLATED, FakeVllm
from recs import make_rec_dict

from kvtune.cli import cli
from kvtune.profile.build import save_profile
from kvtune.profile.histogram import Histogram, JointHistogram, joint_bin
from kvtune.profile.routes import CensoredHistogram, Profile, RouteProfile

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def fake():
    """The fake vLLM on a loop in a thread: the CLI runs asyncio.run itself."""
    with FakeVllm(tokens=TEMPLATED) as server:
        yield server


@pytest.fixture
def profile_path(tmp_path) -> str:
    prompts = np.array([20, 40, 80] * 10)
    outputs = np.array([5, 10, 20] * 10)
    r = RouteProfile(route="/v1/chat/completions", output=CensoredHistogram.of(outputs, np.zeros(30, bool)),
                     total=CensoredHistogram.empty(), prompt=Histogram.of(prompts), max_tokens=Histogram.empty(),
                     joint=JointHistogram(joint_bin(prompts), joint_bin(outputs), np.ones(30, np.int64)),
                     finish_reasons={}, models={})
    path = tmp_path / "profile.json"
    save_profile(Profile(routes=(r,)), path)
    return str(path)


def run(*args: str):
    return CliRunner().invoke(cli, ["bench", *args], catch_exceptions=False)


def test_json_report_has_every_documented_field(fake, profile_path, tmp_path):
    url = fake.url
    out, log = tmp_path / "results.json", tmp_path / "requests.jsonl"
    r = run(url, "--profile", profile_path, "--concurrency", "4", "--requests", "30", "--json",
            "--save", str(out), "--requests-log", str(log), "--slo", "ttft=5000,tpot=1000", "--scrape-interval", "0.1")
    assert r.exit_code == 0, r.output
    data = json.loads(r.output)
    assert data == json.loads(out.read_text())
    assert data["requests"]["sent"] == 30 and data["requests"]["completed"] == 30
    assert set(data["requests"]["failed"]) >= {"429", "503", "4xx", "5xx", "timeout", "disconnect"}
    assert data["output_tokens_total"] == data["output_tokens_requested_total"] == fake.generation_tokens
    for name in ("ttft", "itl", "tpot", "e2e"):
        assert set(data["latency_ms"][name]) >= {"mean", "p50", "p90", "p99"}
    assert set(data["throughput"]) == {"requests_per_s", "output_tokens_per_s"}
    assert data["goodput"]["attainment"] == 1.0
    assert data["server"]["generation_tokens"] == fake.generation_tokens
    assert set(data["server"]) >= {"preemptions", "kv_cache_usage_peak", "running_peak", "waiting_peak",
                                   "generation_tokens", "num_blocks", "block_size"}
    assert data["verdict"] == {"passed": True, "slo": data["verdict"]["slo"]}
    assert data["prompt_length"] == {"checked": 30, "mismatched": 0}
    lines = [json.loads(x) for x in log.read_text().splitlines()]
    assert len(lines) == 30 and all("prompt" not in x and "text" not in x for x in lines)
    assert {x["outcome"] for x in lines} == {"ok"}
    assert fake.peak_active <= 4


def test_table_output_names_the_numbers(fake, profile_path):
    url = fake.url
    r = run(url, "--profile", profile_path, "--rate", "200", "--requests", "20", "--endpoint", "completions")
    assert r.exit_code == 0, r.output
    assert "20 sent, 20 completed" in r.output and "TTFT" in r.output and "preemptions 0" in r.output


def expectation(tmp_path, **over) -> str:
    """A recommendation.json for the fake server: 89 of 100 blocks of 16, chat capped at 64."""
    rec = make_rec_dict(budget=89, num_blocks=100, block_size=16, admitted=9,
                        routes=[("/v1/chat/completions", 64, 0.0)])
    path = tmp_path / "recommendation.json"
    path.write_text(json.dumps(rec | over))
    return str(path)


def test_expect_passes_then_fails_on_preemptions(fake, profile_path, tmp_path):
    url = fake.url
    r = run(url, "--profile", profile_path, "--concurrency", "2", "--requests", "10", "--json",
            "--expect", expectation(tmp_path))
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["verdict"]["passed"] is True

    fake.preempt_per_request = 1  # the fake engine now preempts once per request
    r = run(url, "--profile", profile_path, "--concurrency", "2", "--requests", "10", "--json",
            "--expect", expectation(tmp_path))
    assert r.exit_code == 1
    v = json.loads(r.output)["verdict"]
    assert v["passed"] is False and v["preemptions"]["observed"] == 10


def test_server_without_metrics_is_allowed_and_said(fake, profile_path, tmp_path):
    url = fake.url
    fake.missing.add("/metrics")
    r = run(url, "--profile", profile_path, "--requests", "3", "--json")
    assert r.exit_code == 0, r.output
    data = json.loads(r.output)
    assert data["server"] is None and data["server_note"].startswith("no server metrics: HTTP 404")
    r = run(url, "--profile", profile_path, "--requests", "3", "--json", "--expect", expectation(tmp_path))
    assert r.exit_code == 1 and json.loads(r.output)["verdict"]["preemptions"]["evaluated"] is False


def test_replay_sends_the_logs_own_requests(fake, tmp_path):
    url = fake.url
    logs = tmp_path / "logs.jsonl"
    rows = [{"timestamp": 1000 + i * 0.5, "url": "/v1/chat/completions",
             "request": {"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 64},
             "response": {"object": "chat.completion", "model": "m",
                          "choices": [{"index": 0, "message": {"role": "assistant", "content": "y"},
                                       "finish_reason": "stop"}],
                          "usage": {"prompt_tokens": 10 + i, "completion_tokens": 3 + i}}}
            for i in reversed(range(6))]  # out of order: replay sorts by time
    logs.write_text("".join(json.dumps(x) + "\n" for x in rows))
    r = run(url, str(logs), "--replay", "--speedup", "10", "--json")
    assert r.exit_code == 0, r.output
    data = json.loads(r.output)
    assert data["load"]["kind"] == "replay" and data["requests"]["completed"] == 6
    assert sorted(b["max_tokens"] for b in fake.seen) == [3, 4, 5, 6, 7, 8]
    assert data["prompt_tokens_requested_total"] == sum(range(10, 16))
    assert 0.2 <= data["duration_s"] < 2  # 2.5 s of log at 10× speed


def test_min_tokens_length_control_sends_no_max_tokens(fake, profile_path):
    url = fake.url
    r = run(url, "--profile", profile_path, "--requests", "6", "--concurrency", "3",
            "--length-control", "min-tokens", "--eos-token-id", "2", "--json")
    assert r.exit_code == 0, r.output
    data = json.loads(r.output)
    assert data["target"]["length_control"] == "min-tokens" and data["requests"]["completed"] == 6
    assert len(fake.seen) == 6
    for body in fake.seen:
        assert "max_tokens" not in body and "ignore_eos" not in body
        assert body["logit_bias"] == {"2": 100} and body["min_tokens"] >= 0
    # the fake answers min_tokens + 1 (EOS counted), so every output has its drawn length
    assert data["output_tokens_total"] == data["output_tokens_requested_total"] == \
        sum(b["min_tokens"] + 1 for b in fake.seen)


@pytest.mark.parametrize("args,message", [
    (["http://127.0.0.1:8000", "--profile", "P", "--requests", "1", "--length-control", "min-tokens"],
     "Error: --eos-token-id: --length-control min-tokens needs the model's EOS token id"),
    (["ftp://x", "--profile", "P", "--requests", "1"],
     "Error: URL: must look like http://host:port, got 'ftp://x'"),
    (["http://127.0.0.1:8000", "--profile", "P", "--requests", "1", "--slo", "ttft=abc"],
     "Error: --slo: ttft: expected milliseconds, got 'abc'"),
    (["http://127.0.0.1:8000", "--profile", "P"],
     "Error: --requests: a run must be bounded: give --requests N and/or --duration S"),
    (["http://127.0.0.1:8000", "--profile", "P", "--rate", "1", "--concurrency", "2", "--requests", "1"],
     "Error: --concurrency: give one load shape, not --rate and --concurrency"),
    (["http://127.0.0.1:8000", "--requests", "1"], "Error: LOGS: give LOGS or --profile FILE for the workload"),
    (["http://127.0.0.1:8000", "--profile", "P", "--replay"],
     "Error: --replay: --replay needs LOGS with per-request timestamps (a profile keeps none)"),
    (["http://127.0.0.1:8000", "--profile", "P", "--requests", "1", "--route", "/nope"],
     "Error: --route: no route '/nope' in the profile; routes: /v1/chat/completions"),
])
def test_usage_errors_exit_2_with_one_line(args, message, profile_path):
    args = [profile_path if a == "P" else a for a in args]
    r = run(*args)
    assert r.exit_code == 2
    assert r.output.strip() == message


def test_empty_workload_exits_2(tmp_path):
    path = tmp_path / "empty.json"
    save_profile(Profile(routes=()), path)
    r = run("http://127.0.0.1:8000", "--profile", str(path), "--requests", "1")
    assert r.exit_code == 2
    assert r.output.strip() == "Error: the workload is empty: no requests in the profile or logs"


def test_unreachable_server_exits_2(profile_path):
    with FakeVllm() as gone:
        port = gone.port  # nothing listens after the block
    r = run(f"http://127.0.0.1:{port}", "--profile", profile_path, "--requests", "1")
    assert r.exit_code == 2
    assert r.output.startswith(f"Error: http://127.0.0.1:{port}/v1/models: URL: cannot reach: ")


@pytest.mark.parametrize("routes,message", [
    ({}, "{base}/v1/models: --model: /v1/models answered 404 without a model; pass --model"),
    ({"/v1/models": (200, "application/json", b'{"data": [{"object": "model"}]}')},
     '{base}/v1/models: data[0].id: model entry without a string "id"'),
    ({"/v1/models": (200, "text/html", b"<html></html>")},
     "{base}/v1/models: not an OpenAI-compatible server: /v1/models did not answer JSON"),
])
def test_a_server_without_a_usable_model_list_exits_2(profile_path, routes, message):
    with FakeVllm(routes=routes, routes_only=True) as fake:
        base = fake.url
        r = run(base, "--profile", profile_path, "--requests", "1")
    assert r.exit_code == 2
    assert r.output.strip() == "Error: " + message.format(base=base)


def test_bad_expect_file_exits_2(profile_path, tmp_path):
    bad = tmp_path / "r.json"
    bad.write_text("{}")
    r = run("http://127.0.0.1:8000", "--profile", profile_path, "--requests", "1", "--expect", str(bad))
    assert r.exit_code == 2
    assert r.output.strip() == (f"Error: {bad}: --expect: block_budget: missing: not a recommendation.json? "
                                "(`kvtune recommend --out DIR` writes one)")


def test_outputs_are_checked_before_the_run_and_written_together(fake, profile_path, tmp_path):
    """A bad --save fails before any request is sent; a good pair is written whole, together."""
    url = fake.url
    (tmp_path / "results.json").mkdir()
    r = CliRunner().invoke(cli, ["bench", url, "--profile", profile_path, "--requests", "5", "--json",
                                 "--save", str(tmp_path / "results.json"), "--requests-log", str(tmp_path / "log.jsonl")])
    assert r.exit_code == 2 and r.stderr.count("\n") == 1
    assert r.stderr.startswith(f"Error: {tmp_path / 'results.json'}: refusing to replace a directory")
    assert fake.generation_tokens == 0 and not (tmp_path / "log.jsonl").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["profile.json", "results.json"]
