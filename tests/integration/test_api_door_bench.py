"""kvtune.api.benchmark is `kvtune bench` (issue 28): the same requests to the same fake vLLM on
loopback, from Python and through the CLI, give the same report but for the clock's fields."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from fake_vllm import TEMPLATED, FakeVllm

import kvtune
from kvtune.cli import cli
from kvtune.errors import OptionError

CHAT = str(Path(__file__).resolve().parents[2] / "sample_logs" / "openai_chat_pairs.jsonl")
#: What a run reports that the clock decides (latencies, rates, scraped peaks): not compared.
TIMED = {"duration_s", "latency_ms", "throughput", "goodput", "server", "server_note", "kvtune_version"}


@pytest.fixture
def fake():
    with FakeVllm(tokens=TEMPLATED) as server:
        yield server


def _untimed(report: dict) -> dict:
    return {k: v for k, v in report.items() if k not in TIMED}


def test_benchmark_from_python_sends_what_the_cli_sends(fake):
    r = CliRunner().invoke(cli, ["bench", fake.url, CHAT, "--concurrency", "2", "--requests", "8", "--seed", "5",
                                 "--json"])
    assert r.exit_code == 0, r.output
    by_cli = json.loads(r.stdout)
    sent_by_cli = len(fake.seen)
    report = asyncio.run(kvtune.benchmark(kvtune.profile_logs([CHAT]), kvtune.BenchTarget(fake.url),
                                          kvtune.Load(concurrency=2, max_requests=8, seed=5)))
    assert _untimed(report) == _untimed(by_cli)
    assert list(report)[-1] == "notes" and report["requests"]["completed"] == 8
    bodies = sorted(json.dumps(b, sort_keys=True) for b in fake.seen)  # two clients: in either order
    assert bodies[::2] == bodies[1::2] and len(bodies) == 2 * sent_by_cli  # the same bodies, prompt text included


def test_benchmarks_option_errors_come_before_any_request(fake):
    target = kvtune.BenchTarget(fake.url, length_control="min-tokens")
    with pytest.raises(OptionError) as caught:
        asyncio.run(kvtune.benchmark(kvtune.profile_logs([CHAT]), target, kvtune.Load(max_requests=1)))
    assert caught.value.field == "--eos-token-id" and fake.seen == []
