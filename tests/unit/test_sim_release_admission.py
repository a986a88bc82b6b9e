"""vLLM's admission rule per release: from 0.19 a waiting request is admitted only when its whole
prompt fits in the free KV blocks (`scheduler_reserve_full_isl`); before it (0.9.2, 0.11.0: the
gpustack runs) `allocate_slots` is asked for the chunk it computes this step alone, so under
chunked prefill a long prompt is admitted on its first chunk and preempted chunks later when the
rest does not fit (kvtune.engines.vllm.FIRST_FULL_SEQUENCE_ADMISSION_VERSION)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from sim_cli import simulate_json as _simulate
from sim_cli import uniform_log

from kvtune.cli import cli
from kvtune.domain.step_time import StepTimeModel
from kvtune.engines.vllm import default_batch_limits, reserves_full_sequence
from kvtune.hardware import GiB
from kvtune.sim import EngineSettings, SimRequest, simulate

MODEL = "llama-3.1-8b"


@pytest.mark.parametrize(("version", "full"), [
    ((0, 9, 2), False), ((0, 11, 0), False), ((0, 18, 1), False), ((0, 19, 0), True), ((0, 19, 1), True),
    ((0, 32, 0), True), (None, True),
])
def test_the_whole_prompt_must_fit_from_0_19(version, full):
    assert reserves_full_sequence(version) is full


def _engine(full: bool) -> EngineSettings:
    # 32 usable blocks × 16 = 512 tokens: one 300-token prompt and its answer fit, two do not
    return EngineSettings(num_blocks=33, block_size=16, max_num_seqs=4, max_num_batched_tokens=64,
                          max_model_len=512, reserve_full_sequence=full)


def test_before_0_19_a_long_prompt_is_admitted_on_its_chunk_and_preempted():
    """Two 300-token prompts on a 64-token budget and a 512-token pool. With the whole-prompt rule
    the second waits for the first to finish, never preempted; admitted on its 20-token chunk (two
    blocks, free) it starts while the first is decoding, and is preempted when the first's answer
    and its own prompt no longer fit."""
    requests = [SimRequest(0.0, 300, 40), SimRequest(0.0, 300, 40)]
    whole = simulate(requests, _engine(True), StepTimeModel(0.01))
    chunk = simulate(requests, _engine(False), StepTimeModel(0.01))
    assert whole.preemptions == 0
    assert whole.requests.first_scheduled_s[1] >= whole.requests.finish_s[0]
    assert chunk.requests.first_scheduled_s[1] < chunk.requests.finish_s[0]
    assert chunk.preemptions >= 1
    assert (chunk.requests.output_tokens == 40).all()  # preempted, recomputed, finished in full
    assert chunk.blocks_used_peak <= 32


def _long_prompt_log(tmp_path: Path, requests: int, prompt_tokens: int, output_tokens: int) -> str:
    return uniform_log(tmp_path / "long.jsonl", requests, prompt_tokens, output_tokens)


def test_vllm_0_11_admits_long_prompts_past_the_pool_where_0_19_queues_them(tmp_path):
    """24 prompts of 30,000 tokens at once, 200 tokens out each, on a pool of 12,000 blocks × 16
    (192,000 tokens: six whole prompts) on an H100: 0.11.0 admits a seventh on the leftover of a
    step's budget, so more run than fit and the last admitted are preempted; 0.19.0 admits one only
    when all its blocks are free, runs six at most and never preempts. The output says which rule
    ran and where it came from."""
    log = _long_prompt_log(tmp_path, 24, 30_000, 200)
    pool = ("--num-gpu-blocks", "12000")
    old = _simulate(log, "--engine-version", "0.11.0", *pool)
    new = _simulate(log, "--engine-version", "0.19.0", *pool)
    assert old["simulation"]["engine"]["reserve_full_sequence"] == {"value": False, "from": "engine-default"}
    assert new["simulation"]["engine"]["reserve_full_sequence"] == {"value": True, "from": "engine-default"}
    assert new["server"]["preemptions"] == 0
    assert new["server"]["running_peak"] == 6
    assert old["server"]["preemptions"] > 0
    assert old["server"]["running_peak"] > 6
    assert old["output_tokens_total"] == new["output_tokens_total"] == 24 * 200


@pytest.mark.parametrize(("version", "limits"), [((0, 11, 0), (8192, 1024)), ((0, 27, 1), (8192, 1024)),
                                                 ((0, 28, 0), (16384, 1024)), (None, (16384, 1024))])
def test_the_160_gib_tier_starts_in_0_28(version, limits):
    """A B200 (180 GB): `get_batch_defaults` has a ≥ 160 GiB tier from 0.28.0; before, the ≥ 70 GiB one."""
    assert default_batch_limits(178 * GiB, "B200", version) == limits


@pytest.mark.parametrize(("version", "batched"), [("0.24.0", "8,192"), ("0.28.0", "16,384")])
def test_capacity_profiles_a_b200_at_its_releases_default_budget(version, batched):
    """`kvtune capacity` sizes the profile run with the release's default budget: 8,192 tokens on a
    B200 before 0.28 (no ≥ 160 GiB tier yet), 16,384 from it."""
    result = CliRunner().invoke(cli, ["capacity", "--model", MODEL, "--gpu", "B200", "--engine-version", version,
                                      "--json"], catch_exceptions=False)
    data = json.loads(result.stdout)
    assert any(line.startswith(f"max_num_batched_tokens {batched}: vllm serve's default")
               for line in data["assumptions"])


@pytest.mark.parametrize(("version", "limits"), [((0, 8, 5), (8192, 1024)), ((0, 9, 0, 1), (2048, 256)),
                                                 ((0, 9, 2), (2048, 256)), (None, (2048, 256))])
def test_an_a100_80gb_keeps_the_small_defaults_from_0_9(version, limits):
    """vllm PR #17885 (in 0.9.0.1's arg_utils.py, not 0.8.5's) keeps an A100 on 2048/256 whatever its
    memory; before it, an 80 GB A100 got the ≥ 70 GiB tier."""
    assert default_batch_limits(80 * GiB, "A100-80GB", version) == limits


@pytest.mark.parametrize(("version", "warned"), [("0.6.3", True), ("0.7.3", True), ("0.8.5", False),
                                                 ("0.11.0", False)])
def test_a_release_that_ran_v0_says_its_scheduler_is_not_simulated(tmp_path, version, warned):
    """Before 0.8 vLLM ran its V0 engine by default: its own scheduler and defaults, which kvtune does
    not simulate; the simulation says so, with the V1 limits it used, rather than pass them as that
    release's."""
    log = uniform_log(tmp_path / "log.jsonl", 4, 100, 10)
    result = CliRunner().invoke(cli, ["simulate", log, "--model", MODEL, "--gpu", "H100-80GB", "--replay", "--json",
                                      "--engine-version", version], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["requests"]["completed"] == 4
    line = (f"note: vLLM {version} ran its V0 engine by default (V1 from 0.8), whose scheduler kvtune does not "
            "simulate")
    assert (line in result.stderr) is warned
    if warned:
        assert "this is V1's scheduler with max_num_seqs 1,024 and max_num_batched_tokens 8,192" in result.stderr
