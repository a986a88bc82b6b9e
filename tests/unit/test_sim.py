"""kvtune.sim: the fast path equals the step-by-step reference, and the simulation keeps its invariants.

The step-by-step mode (`fast=False`) runs every engine step through the scheduler; the fast mode
jumps over runs of identical decode steps. Hypothesis draws small engines and workloads tight
enough to preempt, chunk and block, and checks both give the same result to the bit.
test_sim_oracle.py checks the scheduler itself against vLLM's.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtune.domain.retry_policy import RetryPolicy
from kvtune.domain.step_time import TICKS_PER_S, StepTimeModel
from kvtune.errors import OptionError
from kvtune.sim import (
    CLIENT_RETRY,
    EngineSettings,
    LedgerAdmission,
    Outcome,
    SimRequest,
    Workload,
    simulate,
)
from kvtune.sim.blocks import BlockPool
from kvtune.sim.results import OUTCOMES

# --- strategies -------------------------------------------------------------------------------


@st.composite
def engines(draw) -> EngineSettings:
    bs = draw(st.sampled_from([4, 8, 16]))
    blocks = draw(st.integers(6, 48))
    mml = draw(st.integers(bs, (blocks - 1) * bs))
    return EngineSettings(num_blocks=blocks, block_size=bs, max_num_seqs=draw(st.integers(1, 8)),
                          max_num_batched_tokens=draw(st.integers(4, 96)), max_model_len=mml,
                          enable_prefix_caching=draw(st.booleans()),
                          long_prefill_token_threshold=draw(st.sampled_from([0, 0, 5, 16])),
                          reserve_full_sequence=draw(st.booleans()))


timings = st.builds(StepTimeModel, c0=st.floats(1e-3, 0.05), c1=st.floats(0, 1e-3), c2=st.floats(0, 1e-5),
                    c3=st.floats(0, 1e-3), c4=st.floats(0, 1e-5), mixed_step_s=st.just(0.0) | st.floats(0, 0.05),
                    largest_graph_tokens=st.just(0) | st.integers(1, 64), past_knee_s=st.just(0.0) | st.floats(0, 1e-3),
                    knee_tokens=st.integers(0, 256))


@st.composite
def workloads(draw, max_prompt: int = 300) -> list[SimRequest]:
    n = draw(st.integers(1, 24))
    return [SimRequest(draw(st.floats(0, 3)), draw(st.integers(1, max_prompt)), draw(st.integers(1, 160)),
                       draw(st.none() | st.integers(1, 200))) for _ in range(n)]


def _columns(result) -> dict[str, np.ndarray]:
    r = result.requests
    return {name: getattr(r, name) for name in ("arrival_s", "first_scheduled_s", "first_token_s", "finish_s",
                                                 "output_tokens", "preemptions", "retries", "outcome")}


def _assert_same(a, b) -> None:
    for name, col in _columns(a).items():
        np.testing.assert_array_equal(col, _columns(b)[name], err_msg=name)
    for name in ("duration_s", "num_steps", "preemptions", "blocks_used_peak", "running_peak", "waiting_peak",
                 "admission_waiting_peak"):
        assert getattr(a, name) == getattr(b, name), name


def _assert_invariants(result, requests: list[SimRequest], engine: EngineSettings) -> None:
    r = result.requests
    assert result.blocks_used_peak <= engine.usable_blocks
    assert result.running_peak <= engine.max_num_seqs
    if result.steps is not None:
        assert (result.steps.blocks_used <= engine.usable_blocks).all()
        assert (result.steps.running <= engine.max_num_seqs).all()
        assert (result.steps.tokens <= engine.max_num_batched_tokens).all()
    for i, q in enumerate(requests):
        outcome = OUTCOMES[int(r.outcome[i])]
        assert not math.isnan(r.finish_s[i]), f"request {i} never ended"  # ended exactly once: one finish time
        if q.prompt_tokens + 1 > engine.max_model_len:
            assert outcome is Outcome.REJECTED
            continue
        if outcome is Outcome.OK:
            # generated = requested, or capped by max_model_len; preemption does not change it
            assert r.output_tokens[i] == min(q.output_tokens, engine.max_model_len - q.prompt_tokens)
            assert r.arrival_s[i] - 1e-12 <= r.first_scheduled_s[i] < r.first_token_s[i] <= r.finish_s[i]
        else:
            assert r.output_tokens[i] == 0 and math.isnan(r.first_token_s[i])


# --- fast == step by step, invariants, determinism ----------------------------------------------


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(engine=engines(), timing=timings, requests=workloads())
def test_fast_path_equals_step_by_step(engine, timing, requests):
    slow = simulate(requests, engine, timing, fast=False, record_steps=True, record_decisions=True)
    fast = simulate(requests, engine, timing, fast=True, record_steps=True, record_decisions=True)
    _assert_same(slow, fast)
    assert slow.decisions == fast.decisions
    _assert_invariants(slow, requests, engine)
    _assert_invariants(fast, requests, engine)
    assert int(fast.steps.repeat.sum()) == fast.num_steps == slow.num_steps


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(engine=engines(), timing=timings, requests=workloads(), budget_share=st.floats(0.1, 1.5),
       queue=st.integers(0, 4))
def test_ledger_admission_fast_equals_step_by_step(engine, timing, requests, budget_share, queue):
    def admission():
        return LedgerAdmission(max(1, int(engine.usable_blocks * budget_share)), block_size=engine.block_size,
                               max_model_len=engine.max_model_len, queue_max_waiting=queue, queue_timeout_s=0.5)

    slow_adm, fast_adm = admission(), admission()
    slow = simulate(requests, engine, timing, admission=slow_adm, fast=False, record_decisions=True)
    fast = simulate(requests, engine, timing, admission=fast_adm, fast=True, record_decisions=True)
    _assert_same(slow, fast)
    assert slow.decisions == fast.decisions
    _assert_invariants(fast, requests, engine)
    assert fast_adm.reserved_blocks == 0  # every reservation released
    assert (fast.requests.retries <= CLIENT_RETRY.max_retries).all()


class _Recording(LedgerAdmission):
    """The gateway's admission, recording every progress report the simulator makes."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.reports: list[tuple[int, int, float]] = []

    def progress(self, request: int, generated_tokens: int, now_s: float) -> int | None:
        self.reports.append((request, generated_tokens, now_s))
        return super().progress(request, generated_tokens, now_s)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(engine=engines(), timing=timings, requests=workloads(), budget_share=st.floats(0.1, 1.5),
       queue=st.integers(0, 4), epsilon=st.sampled_from([0.001, 0.05, 0.3]),
       law=st.lists(st.integers(1, 5), min_size=1, max_size=6))
def test_statistical_admission_reports_progress_at_its_marks(engine, timing, requests, budget_share, queue, epsilon,
                                                              law):
    """The statistical ledger hears each admitted request at admission and when it has generated
    18, 34, 66, ... tokens (SSE events − 3 = 16, 32, 64, ... streamed, as the live relay reports),
    at the same simulated times in both modes, which still agree to the bit."""
    from kvtune.domain.admission_policy import AdmissionPolicy
    from kvtune.domain.output_law import OutputLaw
    from kvtune.sim.admission import streamed_tokens_seen

    output_law = OutputLaw(tuple(10 * (i + 1) for i in range(len(law))), tuple(law))

    def admission() -> _Recording:
        return _Recording(max(1, int(engine.usable_blocks * budget_share)), block_size=engine.block_size,
                          max_model_len=engine.max_model_len, queue_max_waiting=queue, queue_timeout_s=0.5,
                          policy=AdmissionPolicy.statistical(epsilon), output_law=output_law)

    slow_adm, fast_adm = admission(), admission()
    slow = simulate(requests, engine, timing, admission=slow_adm, fast=False, record_decisions=True)
    fast = simulate(requests, engine, timing, admission=fast_adm, fast=True, record_decisions=True)
    _assert_same(slow, fast)
    assert slow.decisions == fast.decisions
    assert slow_adm.reports == fast_adm.reports
    _assert_invariants(fast, requests, engine)
    assert fast_adm.reserved_blocks == 0
    r = fast.requests
    for i, q in enumerate(requests):
        counts = [g for request, g, _ in fast_adm.reports if request == i]
        if OUTCOMES[int(r.outcome[i])] is not Outcome.OK or q.prompt_tokens + 1 > engine.max_model_len:
            assert counts == []
            continue
        marks = [16 * 2 ** j + 2 for j in range(12)]
        assert counts == [0, *(m for m in marks if m < r.output_tokens[i])]  # the last token ends it first
        assert [streamed_tokens_seen(g) for g in counts[1:]] == [16 * 2 ** j for j in range(len(counts) - 1)]
        times = [t for request, _, t in fast_adm.reports if request == i]
        # admitted (perhaps after retries); simulated time runs in whole ticks (1e-15 s), so a report
        # at the arrival itself is the arrival rounded to its tick
        assert times == sorted(times) and r.arrival_s[i] <= times[0] + 1e-12
        assert all(r.first_token_s[i] < t < r.finish_s[i] for t in times[1:])


def test_the_simulated_relay_reports_what_the_live_one_does():
    """streamed_tokens_seen mirrors kvtune.gateway.relay.events_seen_tokens for a chat stream:
    the role event, then one event per generated token."""
    from kvtune.gateway.relay import events_seen_tokens
    from kvtune.sim.admission import streamed_tokens_seen

    assert [streamed_tokens_seen(g) for g in range(200)] == [events_seen_tokens(1 + g) for g in range(200)]


def test_only_the_statistical_ledger_asks_for_progress():
    from kvtune.domain.admission_policy import AdmissionPolicy
    from kvtune.sim.admission import DirectAdmission

    def asks(policy) -> bool:
        return LedgerAdmission(10, block_size=16, max_model_len=512, policy=policy).conditions_on_progress

    assert not DirectAdmission.conditions_on_progress
    assert not asks(AdmissionPolicy()) and not asks(AdmissionPolicy.overcommit(2.0))
    assert not asks(AdmissionPolicy.statistical(0.0))  # epsilon 0 is guaranteed: progress changes nothing
    assert asks(AdmissionPolicy.statistical(0.01))


def test_deterministic():
    rng = np.random.default_rng(7)
    wl = Workload.from_columns(np.sort(rng.uniform(0, 20, 400)), rng.integers(1, 400, 400), rng.integers(1, 300, 400))
    engine = EngineSettings(num_blocks=120, block_size=16, max_num_seqs=32, max_num_batched_tokens=256,
                            max_model_len=1024)
    timing = StepTimeModel(0.01, 1e-4, 1e-7, 1e-4)
    a, b = simulate(wl, engine, timing), simulate(wl, engine, timing)
    _assert_same(a, b)
    assert a.preemptions > 0  # tight enough that the comparison covers preemption


def test_preempted_request_keeps_its_tokens():
    """16 requests that all fit at admission but not as they grow: vLLM preempts, all finish in full."""
    engine = EngineSettings(num_blocks=33, block_size=16, max_num_seqs=16, max_num_batched_tokens=512,
                            max_model_len=512)
    requests = [SimRequest(0.0, 24, 100) for _ in range(16)]
    result = simulate(requests, engine, StepTimeModel(0.01))
    assert result.preemptions > 0
    assert (result.requests.output_tokens == 100).all()
    assert (result.requests.preemptions > 0).sum() >= 1
    _assert_invariants(result, requests, engine)


def test_max_model_len_caps_the_output():
    engine = EngineSettings(num_blocks=40, block_size=16, max_num_seqs=4, max_num_batched_tokens=64,
                            max_model_len=100)
    result = simulate([SimRequest(0.0, 90, 50), SimRequest(0.0, 100, 5), SimRequest(0.0, 99, 5)], engine,
                      StepTimeModel(0.01))
    assert result.requests.output_tokens.tolist() == [10, 0, 1]
    assert [result.requests.row(i).outcome for i in range(3)] == [Outcome.OK, Outcome.REJECTED, Outcome.OK]


def test_first_token_comes_from_the_chunk_that_completes_the_prompt():
    """A 100-token prompt on a 32-token budget: chunks 32, 32, 32, 4; the 4th step samples token 1."""
    engine = EngineSettings(num_blocks=40, block_size=16, max_num_seqs=4, max_num_batched_tokens=32,
                            max_model_len=512)
    result = simulate([SimRequest(0.0, 100, 3)], engine, StepTimeModel(1.0), record_decisions=True)
    assert [d.scheduled for d in result.decisions] == [((0, 32),), ((0, 32),), ((0, 32),), ((0, 4),), ((0, 1),),
                                                       ((0, 1),)]
    row = result.requests.row(0)
    assert (row.first_scheduled_s, row.first_token_s, row.finish_s) == (0.0, 4.0, 6.0)


def test_step_time_is_the_formula():
    timing = StepTimeModel(0.005, 1e-5, 1e-8, 2e-4)
    n, ctx = [100, 1, 1], [0, 50, 70]
    expected = 0.005 + 1e-5 * 102 + 1e-8 * (100 * 50 + 1 * 50.5 + 1 * 70.5) + 2e-4 * 3
    assert timing.step_seconds(zip(n, ctx, strict=True)) == pytest.approx(expected)
    engine = EngineSettings(num_blocks=100, block_size=16, max_num_seqs=4, max_num_batched_tokens=512,
                            max_model_len=512)
    result = simulate([SimRequest(0.0, 100, 1)], engine, timing)
    assert result.duration_s == pytest.approx(timing.step_seconds([(100, 0)]), rel=1e-9)


@given(c=st.tuples(st.floats(1e-4, 0.1), st.floats(0, 1e-3), st.floats(0, 1e-5), st.floats(0, 1e-3),
                   st.floats(0, 1e-5)), mixed=st.floats(0, 0.05), graph=st.integers(0, 300),
       knee=st.tuples(st.floats(0, 1e-4), st.integers(0, 300)),
       batch=st.integers(1, 300), ctx=st.integers(0, 10**6), k=st.integers(1, 400), window=st.integers(1, 10**16))
def test_decode_run_closed_form(c, mixed, graph, knee, batch, ctx, k, window):
    # decode steps are uniform: the dispatch only where the batch is larger than the largest graph,
    # and the knee's cost the same every step of a run (Σn is its batch)
    ticks = StepTimeModel(*c, mixed_step_s=mixed, largest_graph_tokens=graph, past_knee_s=knee[0],
                          knee_tokens=knee[1]).ticks()
    # step j: every context grew by j; each request reads its ctx + 1 tokens of KV (c4)
    steps = [ticks.step(batch, 2 * (ctx + j * batch) + batch, batch, ctx + j * batch + batch) for j in range(k)]
    assert ticks.decode_run(batch, ctx, k) == sum(steps)
    starts = np.cumsum([0, *steps[:-1]])
    expected = int((starts < window).sum())
    got = ticks.decode_steps_before(batch, ctx, window)
    assert min(got, k) == expected


def test_a_step_past_the_knee_pays_each_token_past_it():
    """The silicon fit's bend: past_knee_s per token a step computes past its first knee_tokens,
    in seconds and in the simulator's ticks alike."""
    base = StepTimeModel(0.005, 1e-5, 1e-8, 2e-4, 1e-8)
    bent = StepTimeModel(0.005, 1e-5, 1e-8, 2e-4, 1e-8, past_knee_s=3e-5, knee_tokens=512)
    for batch, past in (([(400, 0), (1, 90)], 0), ([(512, 0)], 0), ([(2000, 100), (1, 50), (1, 60)], 1490)):
        assert bent.step_seconds(batch) == pytest.approx(base.step_seconds(batch) + 3e-5 * past)
        tokens, size = sum(n for n, _ in batch), len(batch)
        attention2 = sum(n * (2 * ctx + n) for n, ctx in batch)
        kv = sum(ctx + n for n, ctx in batch)
        assert bent.ticks().step(tokens, attention2, size, kv) - base.ticks().step(tokens, attention2, size, kv) == (
            past * round(3e-5 * 10**15))
    assert bent.to_dict()["knee_tokens"] == 512 and "knee_tokens" not in base.to_dict()
    with pytest.raises(OptionError):
        StepTimeModel(0.005, knee_tokens=-1)


def test_step_time_rejects_nonsense():
    with pytest.raises(OptionError):
        StepTimeModel(-1.0)
    with pytest.raises(OptionError):  # a model that takes no time cannot drive a simulation
        StepTimeModel(0.0).ticks()
    with pytest.raises(OptionError):
        EngineSettings(num_blocks=10, block_size=16, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=512)


# --- the block pool's free queue ---------------------------------------------------------------


def test_pool_evicts_a_preempted_requests_blocks_tail_first():
    pool = BlockPool(11, caching=True)  # 10 usable
    pool.take(10)
    pool.give_back(4, 3, owner=7)  # preempted: 3 hashed blocks to the tail, 1 partial to the front
    assert (pool.free, pool.cached(7)) == (4, 3)
    pool.take(1)  # the partial block (front) goes first: nothing evicted
    assert pool.cached(7) == 3
    pool.take(2)  # then request 7's last two blocks: its first block is still a hit
    assert pool.cached(7) == 1
    pool.touch(7, 1)
    assert (pool.free, pool.used, pool.cached(7)) == (0, 10, 0)


def test_pool_finished_blocks_queue_before_later_preemptions():
    pool = BlockPool(21, caching=True)
    pool.take(20)
    pool.give_back(5, 5)  # a finished request: hashed but anonymous, at the tail
    pool.give_back(3, 2, owner=1)  # then a preempted one behind it
    pool.take(6)  # 1 partial (front) + the 5 anonymous ones
    assert pool.cached(1) == 2
    pool.take(1)
    assert pool.cached(1) == 1


def test_pool_without_caching_keeps_nothing():
    pool = BlockPool(11, caching=False)
    pool.take(10)
    pool.give_back(4, 3, owner=7)
    assert (pool.free, pool.cached(7)) == (4, 0)


# --- admission -----------------------------------------------------------------------------------


def test_ledger_admission_429s_retry_then_give_up():
    """A budget of 10 blocks, requests reserving 8 each: one at a time, the rest 429 and retry."""
    engine = EngineSettings(num_blocks=200, block_size=16, max_num_seqs=16, max_num_batched_tokens=512,
                            max_model_len=2048)
    admission = LedgerAdmission(10, block_size=16, max_model_len=2048, retry_after_min_s=1, retry_after_max_s=60)
    requests = [SimRequest(0.0, 28, 100, max_tokens=100) for _ in range(5)]  # ceil(128/16) = 8 blocks
    result = simulate(requests, engine, StepTimeModel(1.0), admission=admission)  # each takes ~100 s
    outcomes = [result.requests.row(i).outcome for i in range(5)]
    assert outcomes[0] is Outcome.OK
    assert (result.requests.retries <= CLIENT_RETRY.max_retries).all()
    gave_up = [i for i, o in enumerate(outcomes) if o is Outcome.HTTP_429]
    assert gave_up and all(result.requests.retries[i] == CLIENT_RETRY.max_retries for i in gave_up)
    assert admission.reserved_blocks == 0
    # nobody ran beside another: the ledger let one 8-block reservation in at a time
    assert result.running_peak == 1


def test_ledger_admission_queue_serves_in_order():
    engine = EngineSettings(num_blocks=200, block_size=16, max_num_seqs=16, max_num_batched_tokens=512,
                            max_model_len=2048)
    admission = LedgerAdmission(10, block_size=16, max_model_len=2048, queue_max_waiting=8, queue_timeout_s=1e6)
    requests = [SimRequest(0.0, 28, 20, max_tokens=100) for _ in range(4)]
    result = simulate(requests, engine, StepTimeModel(1.0), admission=admission)
    assert all(result.requests.row(i).outcome is Outcome.OK for i in range(4))
    assert (result.requests.retries == 0).all()
    assert np.all(np.diff(result.requests.first_scheduled_s) > 0)
    assert result.admission_waiting_peak == 3


def test_ledger_admission_refuses_what_never_fits():
    engine = EngineSettings(num_blocks=200, block_size=16, max_num_seqs=16, max_num_batched_tokens=512,
                            max_model_len=2048)
    admission = LedgerAdmission(4, block_size=16, max_model_len=2048)
    result = simulate([SimRequest(0.0, 100, 10, max_tokens=1000)], engine, StepTimeModel(1.0), admission=admission)
    assert result.requests.row(0).outcome is Outcome.REJECTED


def test_no_retry_policy_gives_up_at_once():
    engine = EngineSettings(num_blocks=200, block_size=16, max_num_seqs=16, max_num_batched_tokens=512,
                            max_model_len=2048)
    admission = LedgerAdmission(10, block_size=16, max_model_len=2048)
    result = simulate([SimRequest(0.0, 28, 100, max_tokens=100)] * 2, engine, StepTimeModel(1.0), admission=admission,
                      retry=RetryPolicy(enabled=False))
    assert [result.requests.row(i).outcome for i in range(2)] == [Outcome.OK, Outcome.HTTP_429]
    assert result.requests.finish_s[1] == 0.0


def test_times_are_exact_ticks():
    engine = EngineSettings(num_blocks=40, block_size=16, max_num_seqs=4, max_num_batched_tokens=64,
                            max_model_len=512)
    result = simulate([SimRequest(0.25, 10, 3)], engine, StepTimeModel(0.125))
    assert result.requests.finish_s[0] * TICKS_PER_S == pytest.approx((0.25 + 3 * 0.125) * TICKS_PER_S)
