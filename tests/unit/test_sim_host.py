"""vLLM's host-side work around the forward pass (kvtune.sim.host): added to every step of an
uncalibrated vLLM simulation in releases that schedule between forward passes (before async
scheduling became the default), per step and per running sequence; hidden behind the forward pass
in releases that overlap them; never added to a calibrated step time (which measured it)."""

from __future__ import annotations

from pathlib import Path

import pytest
from sim_cli import simulate_json as _simulate
from sim_cli import uniform_log
from test_timing import _capacity, _timing

from kvtune.domain.step_time import StepTimeModel, TimingSource
from kvtune.errors import OptionError
from kvtune.sim.host import VLLM_ENGINE_HOST, HostWork, adds_to_step, with_host_work
from kvtune.sim.setup import timing_setup


@pytest.mark.parametrize(("version", "adds"), [
    ((0, 9, 2), True), ((0, 11, 0), True), ((0, 12, 0), False), ((0, 19, 1), False), ((0, 32, 0), False),
    (None, False),
])
def test_the_host_work_adds_to_a_step_only_before_async_scheduling(version, adds):
    assert adds_to_step(version) is adds


def test_the_measured_host_work_is_not_nothing():
    """The figure kvtune ships (benchmarks/host_overheads.py on vLLM 0.32's CPU build)."""
    assert VLLM_ENGINE_HOST.sequence_s > 0


def test_each_running_sequence_pays_its_host_work_every_step():
    base = StepTimeModel(0.005, 1e-5, 0.0, 0.0, 1e-8, source=TimingSource.SILICON)
    host = HostWork(step_s=0.001, sequence_s=2e-5)
    model = with_host_work(base, host)
    batch = [(1, 500)] * 256
    assert model.step_seconds(batch) == pytest.approx(base.step_seconds(batch) + 0.001 + 256 * 2e-5)
    assert model.source is TimingSource.SILICON


@pytest.mark.parametrize("value", [-1e-6, float("nan"), 2.0])
def test_host_work_refuses_a_nonsense_figure(value):
    with pytest.raises(OptionError):
        HostWork(step_s=value, sequence_s=0.0)


def _decode_log(tmp_path: Path, requests: int, output_tokens: int, prompt_tokens: int = 32) -> str:
    return uniform_log(tmp_path / "decode.jsonl", requests, prompt_tokens, output_tokens)


def test_a_synchronous_release_pays_the_host_work_in_every_decode_step(tmp_path):
    """64 clients decoding 2,000-token contexts together on an H100: vLLM 0.11.0 (scheduling between
    forward passes) takes each decode step longer by the host work of 64 sequences; 0.32.0 (async
    scheduling) does not, and the output says which, and why (same pool for both: --num-gpu-blocks)."""
    log = _decode_log(tmp_path, 64, 500, prompt_tokens=2000)
    load = ("--num-gpu-blocks", "20000")
    old = _simulate(log, "--engine-version", "0.11.0", *load)
    new = _simulate(log, "--engine-version", "0.32.0", *load)
    assert old["simulation"]["timing"]["host_work"]["added"] is True
    assert "schedules between forward passes" in old["simulation"]["timing"]["host_work"]["why"]
    assert new["simulation"]["timing"]["host_work"]["added"] is False
    extra_ms = (VLLM_ENGINE_HOST.step_s + 64 * VLLM_ENGINE_HOST.sequence_s) * 1e3
    old_tpot, new_tpot = old["latency_ms"]["tpot"]["p50"], new["latency_ms"]["tpot"]["p50"]
    assert old_tpot - new_tpot == pytest.approx(extra_ms, rel=0.2)


def test_a_calibrated_step_time_is_not_charged_twice():
    """A calibrated capacity file measured the whole step, host work included: nothing is added."""
    calibrated = _capacity(_timing())
    setup = timing_setup(calibrated)
    assert setup.model == calibrated.timing.model
    assert "host_work" not in setup.detail
