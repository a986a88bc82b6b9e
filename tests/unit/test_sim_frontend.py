"""The API server's front end in the simulator (kvtune.sim.frontend) and its calibration
(kvtune.capacity.timing.fit_frontend): serial work that queues, fitted from near-empty bursts."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_sim import _assert_invariants, _assert_same, engines, timings, workloads
from test_timing import _capacity, _timing

from kvtune.bench.timing import load_observation
from kvtune.capacity.measured import read_capacity_file, write_capacity_file
from kvtune.capacity.timing import decode_weighted_features, fit_frontend, step_features
from kvtune.domain.step_time import TICKS_PER_S, FrontEndModel, StepTimeModel
from kvtune.errors import InputError, OptionError
from kvtune.sim import EngineSettings, LedgerAdmission, SimRequest, simulate
from kvtune.sim.frontend import FrontEnd
from kvtune.sim.setup import timing_setup

ENGINE = EngineSettings(num_blocks=200, block_size=16, max_num_seqs=16, max_num_batched_tokens=512,
                        max_model_len=2048)


def _s(ticks: int) -> float:
    return ticks / TICKS_PER_S


def test_a_burst_is_taken_in_one_at_a_time():
    fe = FrontEnd(FrontEndModel(0.004, 0.001))
    assert [_s(fe.ingress(0)) for _ in range(3)] == pytest.approx([0.004, 0.008, 0.012])
    # 10 ms later the backlog is gone: the next request costs only its own work
    assert _s(fe.ingress(round(0.022 * TICKS_PER_S))) == pytest.approx(0.026)


def test_tokens_wait_for_the_backlog_and_a_run_drains_it():
    fe = FrontEnd(FrontEndModel(0.0, 0.001))
    assert _s(fe.emit(0, 5)) == pytest.approx(0.005)
    # 100 tokens over 50 ms: the server streams 1 per ms, so 55 ms of work end 55 ms after 0
    assert _s(fe.emit_run(0, round(0.05 * TICKS_PER_S), 100, 10)) == pytest.approx(0.105)
    # a light run drains it to the last step's tokens only
    t = round(0.2 * TICKS_PER_S)
    assert _s(fe.emit_run(round(0.105 * TICKS_PER_S), t, 20, 2)) == pytest.approx(0.202)


def test_a_lone_request_pays_one_request_and_its_tokens_after_the_engine():
    timing = StepTimeModel(0.01)
    bare = simulate([SimRequest(0.0, 10, 1)], ENGINE, timing)
    front = simulate([SimRequest(0.0, 10, 1)], ENGINE, timing, frontend=FrontEndModel(0.004, 0.001))
    assert front.requests.first_token_s[0] == pytest.approx(bare.requests.first_token_s[0] + 0.005)
    assert front.duration_s == pytest.approx(bare.duration_s + 0.005)


def test_a_burst_queues_behind_the_front_end():
    """Ten requests at once: each reaches the engine 4 ms after the one before it."""
    requests = [SimRequest(0.0, 10, 20) for _ in range(10)]
    front = simulate(requests, ENGINE, StepTimeModel(0.001), frontend=FrontEndModel(0.004, 0.0))
    scheduled = np.sort(front.requests.first_scheduled_s)
    assert np.diff(scheduled) == pytest.approx(np.full(9, 0.004), abs=0.0011)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(engine=engines(), timing=timings, requests=workloads())
def test_a_free_front_end_changes_nothing(engine, timing, requests):
    bare = simulate(requests, engine, timing, record_decisions=True)
    free = simulate(requests, engine, timing, record_decisions=True, frontend=FrontEndModel(0.0, 0.0))
    _assert_same(bare, free)
    assert bare.decisions == free.decisions


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(engine=engines(), timing=timings, requests=workloads(), budget_share=st.floats(0.2, 1.5))
def test_with_a_front_end_fast_equals_step_by_step(engine, timing, requests, budget_share):
    fe = FrontEndModel(0.003, 0.0005)

    def admission():
        return LedgerAdmission(max(1, int(engine.usable_blocks * budget_share)), block_size=engine.block_size,
                               max_model_len=engine.max_model_len)

    for make in (lambda: None, admission):
        slow = simulate(requests, engine, timing, admission=make(), fast=False, frontend=fe, record_decisions=True)
        fast = simulate(requests, engine, timing, admission=make(), fast=True, frontend=fe, record_decisions=True)
        _assert_same(slow, fast)
        assert slow.decisions == fast.decisions
        _assert_invariants(fast, requests, engine)
    # the front end delays requests, it neither drops nor shortens them (a delay can move a request
    # across a step boundary, so single latencies may shrink: only the tokens are compared)
    bare = simulate(requests, engine, timing)
    fronted = simulate(requests, engine, timing, frontend=fe)
    assert fronted.requests.output_tokens.tolist() == bare.requests.output_tokens.tolist()
    assert fronted.requests.outcome.tolist() == bare.requests.outcome.tolist()


def test_fit_frontend_from_bursts_and_streams():
    # lone 17 ms; bursts of 16 take 17 + 15 × 5 ms; streamed cells show 0.2 ms per token beyond the steps
    fe = fit_frontend([0.017, 0.0172, 0.0168], [(16, 0.017 + 15 * 0.005)] * 3,
                      [(1, 0.006, 0.005), (4, 0.0068, 0.006), (16, 0.0112, 0.008)])
    assert fe is not None
    assert fe.token_s == pytest.approx(0.0002)
    assert fe.request_s + fe.token_s == pytest.approx(0.005)
    # the client's gaps equal the engine's: the per-token work is hidden, 0
    hidden = fit_frontend([0.017], [(16, 0.092)], [(8, 0.008, 0.0081), (16, 0.009, 0.009)])
    assert hidden is not None and hidden.token_s == 0 and hidden.request_s == pytest.approx(0.005)
    assert fit_frontend([], [(16, 0.09)], []) is None
    assert fit_frontend([0.017], [], []) is None


def test_the_capacity_file_keeps_the_front_end_and_older_files_have_none(tmp_path):
    import dataclasses

    path = tmp_path / "capacity.json"
    timing = dataclasses.replace(_timing(), frontend=FrontEndModel(0.0018, 0.0002))
    write_capacity_file(path, _capacity(timing))
    data = json.loads(path.read_text())
    assert data["timing"]["frontend"] == {"request_s": 0.0018, "token_s": 0.0002, "units": {
        "request_s": "s of serial front-end work per request",
        "token_s": "s of serial front-end work per output token streamed"}}
    assert read_capacity_file(path) == _capacity(timing)
    setup = timing_setup(read_capacity_file(path))
    # a lone request's 3.5 ms outside the engine: 2 ms of it serial work, 1.5 ms latency
    assert setup.frontend == FrontEndModel(0.0018, 0.0002) and setup.fixed_delay_s == pytest.approx(0.0015)
    # a file written before the front end was measured: the fixed overhead, as before
    del data["timing"]["frontend"]
    path.write_text(json.dumps(data))
    old = timing_setup(read_capacity_file(path))
    assert old.frontend is None and old.fixed_delay_s == old.http_overhead_s == 0.0035


@pytest.mark.parametrize("edit, field, words", [
    (lambda f: f.update(token_s=-1), "timing.frontend.token_s", "must be at least 0, got -1"),
    (lambda f: f.pop("request_s"), "timing.frontend.request_s", "missing"),
    (lambda f: f.update(extra=1), "timing.frontend.extra", "unknown field"),
    (lambda f: f["units"].update(token_s=3), "timing.frontend.units.token_s", "expected a string"),
])
def test_a_malformed_front_end_is_one_line_naming_file_and_field(tmp_path, edit, field, words):
    import dataclasses

    path = tmp_path / "capacity.json"
    write_capacity_file(path, _capacity(dataclasses.replace(_timing(), frontend=FrontEndModel(0.002, 0.0001))))
    data = json.loads(path.read_text())
    edit(data["timing"]["frontend"])
    path.write_text(json.dumps(data))
    with pytest.raises(InputError) as info:
        read_capacity_file(path)
    assert str(info.value).startswith(f"{path}: {field}: {words}")


def test_front_end_costs_are_checked():
    with pytest.raises(OptionError):
        FrontEndModel(-0.001)
    with pytest.raises(OptionError):
        FrontEndModel(0.001, float("nan"))


# --- the load sweep: a replayed run as one decode observation -------------------------------------


def test_decode_weighted_features_weigh_each_step_by_its_decoders():
    from kvtune.sim.results import Decision

    # request 0 (prompt 4) prefills alone, then decodes beside request 1's 3-token prefill, then
    # both decode: gaps are the 2nd step (1 decoder) and the 3rd (2 decoders)
    decisions = [Decision(0.0, ((0, 4),), (), ()), Decision(0.1, ((0, 1), (1, 3)), (), ()),
                 Decision(0.2, ((0, 1), (1, 1)), (), (0, 1))]
    got = decode_weighted_features(decisions, [4, 3])
    mixed = step_features([(1, 4), (3, 0)])
    both = step_features([(1, 5), (1, 3)])
    np.testing.assert_allclose(got, (mixed + 2 * both) / 3)
    assert decode_weighted_features(decisions[:1], [4, 3]) is None  # no decode step, no gap


def test_a_load_run_replayed_recovers_the_step_time_it_ran_with():
    """Replay a run on the simulator with the true model: its decode-weighted features times the
    true coefficients are the run's mean inter-token gap, which a load observation then carries."""
    true = StepTimeModel(0.006, 2e-4, 1e-7, 5e-4)
    rng = np.random.default_rng(3)
    n = 60
    replay = sorted((float(t), int(p), int(o)) for t, p, o in zip(
        np.cumsum(rng.exponential(0.05, n)), rng.integers(16, 256, n), rng.integers(8, 64, n), strict=True))
    engine = EngineSettings(num_blocks=9, block_size=128, max_num_seqs=128, max_num_batched_tokens=2048,
                            max_model_len=512)
    wl_times = [t for t, _, _ in replay]
    result = simulate([SimRequest(t, p, o, o) for t, p, o in replay], engine, true)
    ok = result.requests.output_tokens > 1
    gaps = (result.requests.finish_s - result.requests.first_token_s)[ok]
    itl = float(gaps.sum() / (result.requests.output_tokens[ok] - 1).sum())
    row = load_observation(replay, itl, true, engine)
    assert row is not None and row.sweep == "load" and row.http == 0
    assert float(np.array(row.features) @ true.coefficients[:4]) == pytest.approx(itl, rel=0.02)
    assert wl_times == sorted(wl_times)
    assert load_observation(replay, None, true, engine) is None
