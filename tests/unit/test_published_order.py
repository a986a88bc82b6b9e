"""Issue 27 item 5: the predicted order of configurations follows the published runs that vary
one thing (../shared/validation/published-vllm-runs.csv; benchmarks/published_runs.py prints the
ratios). Users choose between configurations, so the order matters even where a ratio is off.

Each case simulates the published setup offline (`kvtune simulate --model --gpu`, no calibration:
silicon data on H100) on a workload of the published shape, and checks only the orders the
published figures show by a clear margin (≥ 5 %); where the published difference is smaller (the
vLLM blog's median TTFT, bf16 vs fp8 KV: 2.7 %) no order is claimed. The CSV has no pair that
varies only max_num_seqs or max_num_batched_tokens (the two LLMServingSim runs also differ in GPU),
so no such order is tested here.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner
from conftest import CONFIGS

from kvtune.capacity.measured import CapacitySource, MeasuredCapacity, write_capacity_file
from kvtune.cli import cli

pytest.importorskip("aiconfigurator_core")


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("kvtune-cache"))


@pytest.fixture(autouse=True)
def _cache(monkeypatch, cache_dir):
    monkeypatch.setenv("KVTUNE_CACHE_DIR", cache_dir)


def sharegpt_like(n: int, seed: int = 1) -> list[tuple[int, int]]:
    """Lognormal lengths filtered as vLLM's ShareGPT sampler filters (both ≥ 4, prompt ≤ 1024,
    prompt + output ≤ 2048), means ≈ 230 in / 220 out as the gpustack runs' totals."""
    rng = np.random.default_rng(seed)
    out: list[tuple[int, int]] = []
    while len(out) < n:
        p, o = int(rng.lognormal(4.9, 1.0)), int(rng.lognormal(4.95, 0.9))
        if p >= 4 and o >= 4 and p <= 1024 and p + o <= 2048:
            out.append((p, o))
    return out


def write_log(path, lengths, *, at_once: bool) -> str:
    with open(path, "w") as f:
        for p, o in lengths:
            row = {"route": "/v1/chat/completions", "prompt_tokens": p, "output_tokens": o, "finish_reason": "stop"}
            if at_once:
                row["timestamp_s"] = 0.0
            f.write(json.dumps(row) + "\n")
    return str(path)


def capacity(tmp_path, name: str, *, num_blocks: int, max_model_len: int, kv: str = "auto") -> str:
    m = MeasuredCapacity(source=CapacitySource.METRICS, num_blocks=num_blocks, block_size=16,
                         kv_cache_tokens=num_blocks * 16, max_model_len=max_model_len, device="GPU",
                         kv_cache_dtype=kv)
    path = tmp_path / f"{name}.json"
    write_capacity_file(path, m)
    return str(path)


def simulate(*args: str) -> dict:
    r = CliRunner().invoke(cli, ["simulate", *args, "--json"], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert data["simulation"]["timing"]["source"] == "silicon"
    return data


def figures(data: dict) -> dict[str, float]:
    lat = data["latency_ms"]
    total = (data["prompt_tokens_requested_total"] + data["output_tokens_total"]) / data["duration_s"]
    return {"tok/s": data["throughput"]["output_tokens_per_s"], "total tok/s": total,
            "ttft": lat["ttft"]["mean"], "tpot": lat["tpot"]["mean"], "tpot p50": lat["tpot"]["p50"]}


def test_load_levels_order_as_gpustacks_qwen3_8b_closed_loops(tmp_path):
    """GS-Q8-H100-c1…c8: output tok/s 133 < 257 < 497 < 917; TTFT 59.0 ≤ 63.8 ≤ 64.0 < 74.6 ms (c8 ≥ 5 %
    above c1); TPOT 7.28 ≤ 7.37 ≤ 7.38 < 7.71 ms (c8 ≥ 5 % above c1)."""
    log = write_log(tmp_path / "sharegpt.jsonl", sharegpt_like(2000), at_once=False)
    cap = capacity(tmp_path, "q8", num_blocks=23661, max_model_len=40960)
    runs = [figures(simulate(log, "--capacity", cap, "--model", "qwen3-8b", "--gpu", "h100", "--concurrency", str(c),
                             "--requests", "100")) for c in (1, 2, 4, 8)]
    tput = [r["tok/s"] for r in runs]
    assert tput == sorted(tput) and tput[-1] > 4 * tput[0]
    assert runs[-1]["ttft"] > 1.05 * runs[0]["ttft"]
    assert runs[-1]["tpot"] > 1.03 * runs[0]["tpot"]
    assert [r["tpot"] for r in runs] == sorted(r["tpot"] for r in runs)


def test_prompt_length_orders_as_gpustacks_qwen3_14b_random_runs(tmp_path):
    """GS-Q14-H100-r2000x100, r4000x200, r32000x100 (all requests at t = 0): output tok/s
    506 > 439 > 25; mean TTFT 51 s < 113 s < 191 s."""
    cap = capacity(tmp_path, "q14", num_blocks=16270, max_model_len=40960)
    model = str(CONFIGS / "Qwen3-14B.json")
    runs = []
    for n, prompt, output in ((100, 1996, 100), (100, 3996, 200), (30, 32000, 99)):
        log = write_log(tmp_path / f"r{prompt}.jsonl", [(prompt, output)] * n, at_once=True)
        runs.append(figures(simulate(log, "--replay", "--capacity", cap, "--model", model, "--gpu", "h100")))
    assert runs[0]["tok/s"] > runs[1]["tok/s"] > runs[2]["tok/s"]
    assert runs[2]["tok/s"] < 0.2 * runs[1]["tok/s"]
    # TTFT grows with the prompt: compared per request queued, since the runs here are shorter
    assert runs[0]["ttft"] < runs[1]["ttft"]
    assert runs[2]["ttft"] / 30 > runs[1]["ttft"] / 100


@pytest.mark.parametrize("case", ["vblog-llama-3.1-8b", "gsref-qwen3-8b"])
def test_fp8_kv_orders_as_published(tmp_path, case):
    """FP8 KV against bf16 KV on one H100 (the fp8 pool is twice the blocks, as vLLM sizes it):
    VBLOG-L8 (c = 8, ~20k in / ~2k out): output tok/s 450 → 518, median ITL 15.2 → 12.9 ms;
    GSREF-Q8 (1,000 ShareGPT at once): mean TPOT 126.6 → 103.2 ms, mean TTFT 5,173 → 5,688 ms."""
    if case.startswith("vblog"):
        rng = np.random.default_rng(0)
        lengths = [(int(20000 * rng.uniform(0.85, 1.15)), int(2000 * rng.uniform(0.85, 1.15))) for _ in range(40)]
        log = write_log(tmp_path / "long.jsonl", lengths, at_once=False)
        load = ["--concurrency", "8", "--requests", "40"]
        model, blocks, mml = "llama-3.1-8b", 27188, 131072
    else:
        log = write_log(tmp_path / "burst.jsonl", sharegpt_like(1000, seed=2), at_once=True)
        load = ["--replay"]
        model, blocks, mml = "qwen3-8b", 23661, 40960
    bf16, fp8 = (figures(simulate(log, *load, "--capacity", capacity(tmp_path, kv, num_blocks=n, max_model_len=mml,
                                                                     kv=kv),
                                  "--model", model, "--gpu", "h100"))
                 for kv, n in (("auto", blocks), ("fp8", 2 * blocks)))
    if case.startswith("vblog"):
        assert fp8["tok/s"] > 1.05 * bf16["tok/s"]
        assert fp8["tpot p50"] < 0.95 * bf16["tpot p50"]
    else:
        assert fp8["tpot"] < 0.97 * bf16["tpot"]
        # the published TTFT rises 10 % with FP8 KV (5,173 → 5,688 ms); kvtune's stays within 1 % of
        # bf16's either way (the burst's API-server ingress dominates it, and aiconfigurator's FP8-KV
        # kernels are no slower): the order it printed held by 0.6 % until the fit's knee, and now
        # misses by 0.2 % (test_fp8_kv_ttft_order_is_not_reproduced_for_gsref)


@pytest.mark.xfail(strict=True, reason="kvtune's FP8-KV TTFT stays within 1 % of bf16's where the published one "
                                       "rises 10 %: not modelled (docs/validation.md, Orders)")
def test_fp8_kv_ttft_order_is_not_reproduced_for_gsref(tmp_path):
    """GSREF-Q8: mean TTFT 5,173 → 5,688 ms with FP8 KV. Strict: if kvtune starts ordering it as
    published, this fails and the claim moves back into test_fp8_kv_orders_as_published."""
    log = write_log(tmp_path / "burst.jsonl", sharegpt_like(1000, seed=2), at_once=True)
    bf16, fp8 = (figures(simulate(log, "--replay", "--capacity", capacity(tmp_path, kv, num_blocks=n, max_model_len=40960,
                                                                          kv=kv),
                                  "--model", "qwen3-8b", "--gpu", "h100"))
                 for kv, n in (("auto", 23661), ("fp8", 2 * 23661)))
    assert fp8["ttft"] > 1.05 * bf16["ttft"]
