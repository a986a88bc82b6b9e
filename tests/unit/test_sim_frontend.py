"""The API server's front end in the simulator (kvtune.sim.frontend) and its calibration
(kvtune.capacity.timing.fit_frontend): one processor its requests and its output handler share,
priced from bursts."""

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
from kvtune.sim.engine import ClosedLoop
from kvtune.sim.frontend import DELIVERY, INGRESS, Delivery, FrontEnd
from kvtune.sim.setup import timing_setup

ENGINE = EngineSettings(num_blocks=200, block_size=16, max_num_seqs=16, max_num_batched_tokens=512,
                        max_model_len=2048)


def _s(ticks: int) -> float:
    return ticks / TICKS_PER_S


MS = TICKS_PER_S // 1000


def _drain(fe: FrontEnd) -> list[tuple[int, int, object]]:
    """Everything the server still has to hand on, in the order (and at the ticks) it does."""
    out = []
    while fe.next_tick() is not None:
        out.append(fe.pop())
    return out


def test_a_burst_reaches_the_engine_together_after_all_its_work():
    """Processor sharing: ten requests at once each get a tenth of the server, so all ten finish
    their ingress at 10 × 4 ms, none before (a FIFO server handed the first on after 4 ms)."""
    fe = FrontEnd(FrontEndModel(0.004, 0.001))
    for request in range(10):
        fe.ingress(0, request)
    assert fe.next_tick() == 40 * MS
    assert _drain(fe) == [(40 * MS, INGRESS, request) for request in range(10)]


def test_a_lone_request_pays_its_own_work():
    fe = FrontEnd(FrontEndModel(0.004, 0.001))
    fe.ingress(7 * MS, 0)
    assert _drain(fe) == [(11 * MS, INGRESS, 0)]


def test_two_requests_share_only_while_both_are_in():
    """A at 0 and B at 2 ms, 4 ms of work each: A alone for 2 ms (2 ms left), then both at half
    speed: A's last 2 ms take 4 ms (A at 6 ms), by then B has had 2 ms and finishes alone at 8 ms."""
    fe = FrontEnd(FrontEndModel(0.004, 0.0))
    fe.ingress(0, 0)
    assert fe.next_tick() == 4 * MS  # if nothing else came
    fe.ingress(2 * MS, 1)
    assert _drain(fe) == [(6 * MS, INGRESS, 0), (8 * MS, INGRESS, 1)]


def test_tokens_produced_during_ingress_get_the_output_handlers_share():
    """A request in ingress (4 ms) and, 1 ms in, a step's 2 tokens (1 ms each) with a first token:
    the output handler and the request share the server from 1 ms, so the tokens' 2 ms take 4 ms
    (delivered at 5 ms), and the request, 3 ms served by then, ends alone at 6 ms: 6 ms of work,
    busy 6 ms."""
    fe = FrontEnd(FrontEndModel(0.004, 0.001))
    fe.ingress(0, 0)
    fe.emit(1 * MS, 2, first=np.array([5]))
    got = _drain(fe)
    assert [(tick, kind) for tick, kind, _ in got] == [(5 * MS, DELIVERY), (6 * MS, INGRESS)]
    delivery = got[0][2]
    assert isinstance(delivery, Delivery) and delivery.first.tolist() == [5] and not len(delivery.finished)


def test_tokens_wait_for_the_tokens_before_them_and_a_run_drains_them():
    fe = FrontEnd(FrontEndModel(0.0, 0.001))
    fe.emit(0, 5, finished=np.array([0]))
    assert _drain(fe)[0][0] == 5 * MS
    # 10 steps of 10 tokens from 5 ms to 55 ms (the first ending at 10 ms): the handler streams
    # 1 token per ms, so the 100 tokens end 100 ms after the first step's end, and the next
    # step's 10 tokens (at 60 ms) 10 ms after that
    fe.emit_run(5 * MS, 10 * MS, 55 * MS, 10, 10)
    fe.emit(60 * MS, 10, finished=np.array([1]))
    assert _drain(fe)[0][0] == 120 * MS


@settings(max_examples=200, deadline=None)
@given(arrivals=st.lists(st.tuples(st.integers(0, 60), st.booleans(), st.integers(0, 9)), min_size=1, max_size=30),
       request_ms=st.integers(0, 7), token_ms=st.integers(0, 3))
def test_sharing_changes_the_order_not_the_busy_period(arrivals, request_ms, token_ms):
    """For any arrivals of requests and streamed tokens, the server is busy exactly as long as a FIFO
    server with the same work: the last thing it hands on leaves when the FIFO server's backlog
    ends, in time order, and everything that came in goes out."""
    fe = FrontEnd(FrontEndModel(request_ms / 1000, token_ms / 1000))
    fifo_end = 0
    out: list[tuple[int, int, object]] = []
    for i, (at_ms, is_request, tokens) in enumerate(sorted(arrivals)):
        t = at_ms * MS
        while (nxt := fe.next_tick()) is not None and nxt <= t:
            out.append(fe.pop())
        if is_request:
            fe.ingress(t, i)
            fifo_end = max(fifo_end, t) + request_ms * MS
        else:
            fe.emit(t, tokens, first=np.array([i]))
            fifo_end = max(fifo_end, t) + tokens * token_ms * MS
    out += _drain(fe)
    ticks = [tick for tick, _, _ in out]
    assert ticks == sorted(ticks)
    assert len(out) == len(arrivals)
    assert max(ticks) == max(fifo_end, max(at * MS for at, _, _ in arrivals))


@settings(max_examples=200, deadline=None)
@given(backlog=st.integers(0, 40), gap=st.integers(0, 20), first=st.integers(1, 15), growth=st.integers(0, 4),
       steps=st.integers(1, 12), per_step=st.integers(0, 6), token_ms=st.integers(0, 4))
def test_a_run_equals_its_steps_one_by_one(backlog, gap, first, growth, steps, per_step, token_ms):
    """emit_run (O(1)) leaves the server as emitting each decode step's tokens at its end does,
    for steps that grow by `growth` ms each, after a backlog of earlier tokens."""
    ends, t = [], gap * MS
    for j in range(steps):
        t += (first + j * growth) * MS
        ends.append(t)
    one, run = (FrontEnd(FrontEndModel(0.0, token_ms / 1000)) for _ in range(2))
    for fe in (one, run):
        fe.emit(0, backlog, finished=np.array([0]))
    for end in ends:
        one.emit(end, per_step)
    run.emit_run(gap * MS, ends[0], ends[-1], per_step, steps)
    for fe in (one, run):
        fe.emit(ends[-1], 0, finished=np.array([1]))
    assert [tick for tick, _, _ in _drain(one)] == [tick for tick, _, _ in _drain(run)]


def test_a_lone_request_pays_one_request_and_its_tokens_after_the_engine():
    timing = StepTimeModel(0.01)
    bare = simulate([SimRequest(0.0, 10, 1)], ENGINE, timing)
    front = simulate([SimRequest(0.0, 10, 1)], ENGINE, timing, frontend=FrontEndModel(0.004, 0.001))
    assert front.requests.first_token_s[0] == pytest.approx(bare.requests.first_token_s[0] + 0.005)
    assert front.duration_s == pytest.approx(bare.duration_s + 0.005)


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


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(engine=engines(), timing=timings, requests=workloads(), request_s=st.sampled_from([0.0, 0.004, 0.03]),
       token_s=st.sampled_from([0.0, 0.0005, 0.004]), clients=st.none() | st.integers(1, 6))
def test_with_a_busy_shared_server_fast_equals_step_by_step(engine, timing, requests, request_s, token_s, clients):
    """Requests in ingress across decode runs, tokens slowed by them, closed-loop clients waiting for
    their deliveries: the O(1) runs still give what every step one by one gives."""
    fe = FrontEndModel(request_s, token_s)
    loop = None if clients is None else ClosedLoop(clients)
    slow = simulate(requests, engine, timing, fast=False, frontend=fe, closed_loop=loop, record_decisions=True)
    fast = simulate(requests, engine, timing, fast=True, frontend=fe, closed_loop=loop, record_decisions=True)
    _assert_same(slow, fast)
    assert slow.decisions == fast.decisions
    _assert_invariants(fast, requests, engine)


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
