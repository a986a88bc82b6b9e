"""`kvtune simulate` next to `kvtune bench` on the real vLLM (CPU): calibrate the step time, run
the same profile, seed and load on the server and in the simulator, print predicted vs measured.

A smoke test of the whole path (calibrate --timing → capacity file → simulate) with a loose
bound; the accuracy targets belong to benchmarks/sim_validation.py.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

from kvtune.cli import cli
from kvtune.profile.build import save_profile
from kvtune.profile.histogram import Histogram, JointHistogram, joint_bin
from kvtune.profile.routes import CensoredHistogram, Profile, RouteProfile

pytestmark = pytest.mark.vllm

RATE, REQUESTS = "4", "40"


def profile_file(path, prompts, outputs) -> str:
    """One chat route with these (prompt, output) pairs, saved as `kvtune profile --save` would."""
    prompts, outputs = np.asarray(prompts), np.asarray(outputs)
    r = RouteProfile(route="/v1/chat/completions", output=CensoredHistogram.of(outputs, np.zeros(outputs.size, bool)),
                     total=CensoredHistogram.empty(), prompt=Histogram.of(prompts), max_tokens=Histogram.empty(),
                     joint=JointHistogram(joint_bin(prompts), joint_bin(outputs), np.ones(prompts.size, np.int64)),
                     finish_reasons={}, models={})
    save_profile(Profile(routes=(r,)), path)
    return str(path)


def _run(*args: str) -> dict:
    result = CliRunner().invoke(cli, list(args), catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_simulate_predicts_the_benchmark(vllm_server, tmp_path):
    rng = np.random.default_rng(0)
    profile = profile_file(tmp_path / "profile.json", rng.integers(16, 200, 200), rng.integers(16, 160, 200))
    cap = tmp_path / "cap.json"
    calibrated = _run("calibrate", vllm_server.url, "--timing", "--timing-budget-s", "12", "--vllm-log",
                      str(vllm_server.log_path), "--save", str(cap), "--json")
    print("capacity file:", json.dumps(calibrated))
    measured = _run("bench", vllm_server.url, "--profile", profile, "--rate", RATE, "--requests", REQUESTS,
                    "--seed", "0", "--json")
    predicted = _run("simulate", "--profile", profile, "--capacity", str(cap), "--rate", RATE, "--requests",
                     REQUESTS, "--seed", "0", "--json")
    assert predicted["requests"]["sent"] == measured["requests"]["sent"] == int(REQUESTS)
    assert predicted["requests"]["completed"] == measured["requests"]["completed"] == int(REQUESTS)
    assert predicted["output_tokens_total"] == measured["output_tokens_total"]  # the same requests
    rows = [("output tokens/s", predicted["throughput"]["output_tokens_per_s"],
             measured["throughput"]["output_tokens_per_s"]),
            ("preemptions", predicted["server"]["preemptions"], (measured["server"] or {}).get("preemptions")),
            ("p50 e2e ms", predicted["latency_ms"]["e2e"]["p50"], measured["latency_ms"]["e2e"]["p50"]),
            ("p50 ttft ms", predicted["latency_ms"]["ttft"]["p50"], measured["latency_ms"]["ttft"]["p50"]),
            ("duration s", predicted["duration_s"], measured["duration_s"])]
    for name, p, m in rows:
        print(f"{name:16} predicted {p!s:>10}  measured {m!s:>10}")
    p_thr, m_thr = rows[0][1], rows[0][2]
    assert abs(p_thr - m_thr) <= 0.5 * m_thr
