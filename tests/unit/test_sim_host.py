"""vLLM's host-side work around the forward pass (kvtune.sim.host): added to every step of an
uncalibrated vLLM simulation in releases that schedule between forward passes (before async
scheduling became the default), per step and per running sequence; hidden behind the forward pass
in releases that overlap them; never added to a calibrated step time (which measured it). And the
host's layer-by-layer dispatch of a step vLLM does not replay as one CUDA graph (not a uniform
decode, or past its largest graph; aiconfigurator-core's 0.8 ms per layer), added to those steps of
every vLLM release, never to SGLang's or a calibration's."""

from __future__ import annotations

from pathlib import Path

import pytest
from sim_cli import simulate_json as _simulate
from sim_cli import uniform_log
from test_timing import _capacity, _timing

from kvtune.domain.step_time import StepTimeModel, TimingSource
from kvtune.errors import OptionError
from kvtune.sim import host
from kvtune.sim.host import (
    VLLM_ENGINE_HOST,
    HostWork,
    adds_to_step,
    largest_cuda_graph,
    with_dispatch,
    with_host_work,
)
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
    assert "host_work" not in setup.detail and "dispatch" not in setup.detail
    assert setup.model.mixed_step_s == 0


def test_a_step_that_prefills_pays_the_dispatch_and_a_decode_step_does_not():
    """aiconfigurator's figure, 0.8 ms per layer, on a step where some request computes more than
    one token; a uniform decode batch (vLLM replays it as one CUDA graph) pays nothing more, in
    seconds and in the simulator's integer ticks alike."""
    base = StepTimeModel(0.005, 1e-5, 1e-8, 1e-5, 1e-8, source=TimingSource.SILICON)
    model = with_dispatch(base, 36, 512)
    assert model.mixed_step_s == pytest.approx(36 * 0.8e-3) and model.source is TimingSource.SILICON
    decode, mixed = [(1, 500)] * 64, [(1, 500)] * 63 + [(200, 0)]
    assert model.step_seconds(decode) == base.step_seconds(decode)
    assert model.step_seconds(mixed) == pytest.approx(base.step_seconds(mixed) + 36 * 0.8e-3)
    assert model.step_seconds([(2, 0)]) == pytest.approx(base.step_seconds([(2, 0)]) + 36 * 0.8e-3)
    new, old = model.ticks(), base.ticks()
    assert new.step(64, 64 * 1001, 64, 64 * 501) == old.step(64, 64 * 1001, 64, 64 * 501)
    assert new.step(263, 63 * 1001 + 200 * 200, 64, 63 * 501 + 200) - old.step(
        263, 63 * 1001 + 200 * 200, 64, 63 * 501 + 200) == round(36 * 0.8e-3 * 10**15)
    assert new.decode_run(64, 32_000, 50) == old.decode_run(64, 32_000, 50)
    with pytest.raises(OptionError):
        StepTimeModel(0.005, mixed_step_s=-1e-3)


def test_a_decode_batch_larger_than_vllms_largest_cuda_graph_runs_eagerly_and_pays_the_dispatch():
    """vLLM replays uniform decode batches of up to 512 tokens as CUDA graphs (1,024 on data-center
    Blackwell from 0.32); a larger one runs eagerly, every kernel launched from the host."""
    base = StepTimeModel(0.005, 1e-5, 1e-8, 1e-5, 1e-8, source=TimingSource.SILICON)
    model = with_dispatch(base, 40, largest_cuda_graph("H100-80GB", (0, 11, 0)))
    for batch, paid in ((512, 0.0), (513, 40 * 0.8e-3)):
        decode = [(1, 300)] * batch
        assert model.step_seconds(decode) == pytest.approx(base.step_seconds(decode) + paid)
        ticks, plain = model.ticks(), base.ticks()
        assert ticks.decode_run(batch, batch * 300, 7) - plain.decode_run(batch, batch * 300, 7) == 7 * round(
            paid * 10**15)
    assert largest_cuda_graph("H100-80GB", None) == 512
    assert largest_cuda_graph("B200", (0, 32, 0)) == largest_cuda_graph("GB300", None) == 1024
    assert largest_cuda_graph("B200", (0, 31, 0)) == 512
    with pytest.raises(OptionError):
        StepTimeModel(0.005, largest_graph_tokens=-1)


def test_a_lone_requests_first_token_waits_for_its_prefills_dispatch(tmp_path, monkeypatch):
    """One chat request on an H100, offline: its prefill step is not a uniform decode, so its first
    token comes Llama-3.1-8B's 32 layers × 0.8 ms later than the kernels alone; its decode steps
    are uniform and pay nothing (TPOT unchanged); the output names the term and its source."""
    log = _decode_log(tmp_path, 1, 50, prompt_tokens=200)
    paid = _simulate(log, "--engine-version", "0.32.0")
    monkeypatch.setattr(host, "VLLM_DISPATCH_PER_LAYER_S", 0.0)
    unpaid = _simulate(log, "--engine-version", "0.32.0")
    dispatch = paid["simulation"]["timing"]["dispatch"]
    assert (dispatch["layers"], dispatch["per_layer_s"], dispatch["largest_cuda_graph_tokens"]) == (32, 0.8e-3, 512)
    assert dispatch["mixed_step_s"] == pytest.approx(0.0256) and "aiconfigurator-core" in dispatch["from"]
    assert paid["simulation"]["timing"]["coefficients"]["mixed_step_s"] == pytest.approx(0.0256)
    assert paid["latency_ms"]["ttft"]["p50"] - unpaid["latency_ms"]["ttft"]["p50"] == pytest.approx(25.6, abs=0.01)
    assert paid["latency_ms"]["tpot"]["p50"] == pytest.approx(unpaid["latency_ms"]["tpot"]["p50"], abs=1e-3)


def test_sglang_is_not_charged_vllms_dispatch(tmp_path):
    sglang = _simulate(_decode_log(tmp_path, 1, 50, prompt_tokens=200), "--engine", "sglang", "--kv-tokens", "200000")
    assert sglang["simulation"]["timing"]["dispatch"] is None
    assert "mixed_step_s" not in sglang["simulation"]["timing"]["coefficients"]
