"""kvtune.sim's SGLang and TensorRT-LLM rules: hand-computed cases from each engine's source, and
properties on random small workloads (every admitted request finishes, tokens add up, the pool
is never overdrawn, GUARANTEED_NO_EVICT never evicts, the fast path equals the step-by-step one).

The hand cases drive a scheduler step by step (schedule, then complete) and check what the
cited source says it does; docstrings of kvtune.sim.sglang and kvtune.sim.trtllm cite it.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtune.domain.step_time import StepTimeModel
from kvtune.errors import OptionError
from kvtune.sim import EngineSettings, SimRequest, Workload, simulate
from kvtune.sim.results import OUTCOMES
from kvtune.sim.rules import ENGINE_NAMES, CapacityPolicy, SGLangRule, TrtllmRule, engine_rule
from kvtune.sim.sglang import SGLangScheduler
from kvtune.sim.trtllm import TrtllmScheduler

TIMING = StepTimeModel(c0=0.01, c1=1e-4, c2=1e-7, c3=1e-4, c4=3e-8)


def _cols(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.int64)


DEFAULTS = SGLangRule()


def _sglang(tokens: int, prompts, outputs, caps, rule: SGLangRule = DEFAULTS, *,
            max_running: int = 8, chunk: int = 512) -> SGLangScheduler:
    """An SGLang scheduler over a `tokens`-token pool (block size 1: the null block aside)."""
    settings = EngineSettings(num_blocks=tokens + 1, block_size=1, max_num_seqs=max_running,
                              max_num_batched_tokens=chunk, max_model_len=tokens)
    prompt = _cols(*prompts)
    return SGLangScheduler(settings, rule, prompt, prompt + _cols(*outputs), _cols(*caps))


def _step(s) -> tuple:
    batch = s.schedule()
    first, finished = s.complete()
    return batch, first.tolist(), finished.tolist()


# --- SGLang -------------------------------------------------------------------------------------


def test_sglang_refuses_a_request_when_the_ratio_weighted_reservation_leaves_no_room():
    # A (prompt 10, cap 50) runs with 1 token out: it reserves (50 − 1) × ratio; B needs
    # 10 + 50 + 1 = 61 tokens below the 90 free minus that (PrefillAdder.add_one_req)
    s = _sglang(100, (10, 10), (50, 5), (50, 50))
    s.add(0)
    _step(s)
    assert s.free == 90 and s.ratio == pytest.approx(0.7)
    s.add(1)
    batch, _, _ = _step(s)  # 61 < 90 − 49 × 0.7 = 55.7 is false: refused, a decode step instead
    assert batch.admitted == [] and s.batch_is_full and list(s.waiting) == [1]
    # at ratio 0.5: 61 < 90 − 24.5 = 65.5, admitted
    s = _sglang(100, (10, 10), (50, 5), (50, 50), SGLangRule(init_new_token_ratio=0.5))
    s.add(0)
    _step(s)
    s.add(1)
    batch, first, _ = _step(s)
    assert batch.admitted == [1] and first == [1]


def test_sglang_a_refused_request_waits_for_the_batch_to_shrink_even_as_the_ratio_decays():
    # batch_is_full stays set until a request leaves the running batch (update_running_batch)
    s = _sglang(100, (10, 10), (30, 5), (50, 50))
    s.add(0)
    _step(s)
    s.add(1)
    admitted_at = None
    for step in range(40):
        batch, _, finished = _step(s)
        if batch.admitted:
            admitted_at = step
            break
        if finished:
            assert finished == [0]
    assert admitted_at is not None and s.ntok_all[0] == 40  # after A's finish, not before


def test_sglang_the_ratio_decays_linearly_per_decode_step_to_its_floor():
    rule = SGLangRule(new_token_ratio_decay_steps=4)
    assert rule.init_ratio == pytest.approx(0.7) and rule.min_ratio == pytest.approx(0.7 * 0.14)
    s = _sglang(1000, (10,), (50,), (50,), rule)
    s.add(0)
    _step(s)  # a prefill step: no decay
    assert s.ratio == pytest.approx(0.7)
    seen = []
    for _ in range(6):
        _step(s)
        seen.append(s.ratio)
    step = (0.7 - 0.098) / 4
    assert seen == pytest.approx([0.7 - step, 0.7 - 2 * step, 0.7 - 3 * step, 0.098, 0.098, 0.098])


def test_sglang_ratio_starts_at_conservativeness_times_init_capped_at_one():
    assert SGLangRule(schedule_conservativeness=0.5).init_ratio == pytest.approx(0.35)
    assert SGLangRule(schedule_conservativeness=2.0).init_ratio == 1.0
    assert SGLangRule(init_new_token_ratio=1.0, min_new_token_ratio_factor=1.0).ratio_decay == 0.0
    rendered = SGLangRule.as_rendered(800)
    assert (rendered.init_ratio, rendered.min_ratio, rendered.clip_max_new_tokens) == (1.0, 1.0, 800)
    assert SGLangRule.as_rendered(None).clip_max_new_tokens == 4096


def test_sglang_retracts_the_shortest_output_when_the_estimate_was_wrong_and_resets_the_ratio():
    # four requests admitted one by one at ratio 0.1 each grow to 50 tokens: 200 > 100
    rule = SGLangRule(init_new_token_ratio=0.1, min_new_token_ratio_factor=1.0)
    s = _sglang(100, (10, 10, 10, 10, 10), (40, 40, 40, 40, 40), (40, 40, 40, 40, 40), rule)
    for r in range(5):
        s.add(r)
        _step(s)
    assert s.n == 4 and list(s.waiting) == [4]  # E: 51 < 60 − 4 × ~3.7 is false
    while True:
        before = {int(s.rid[i]): int(s.ntok[i]) for i in range(s.n)}
        batch, _, _ = _step(s)
        if batch.preempted:
            break
    # the last admitted (request 3) has generated least: retracted first, to the back of the queue
    assert batch.preempted == [3] and list(s.waiting) == [4, 3] and s.preemptions[3] == 1
    kept = [r for r in before if r != 3]
    decoded = sum(before[r] - 10 for r in kept)
    assert s.ratio == pytest.approx(min(1.0, (decoded + 20 * len(kept)) / (40 * len(kept) + 1)))
    assert s.ntok_all[3] == before[3]  # it keeps its output: re-prefilled as prompt + output


def test_sglang_ratio_pinned_at_one_with_the_estimate_unclipped_never_retracts_hand_case():
    rule = SGLangRule.as_rendered(40)
    s = _sglang(100, (10,) * 5, (40,) * 5, (40,) * 5, rule)
    for r in range(5):
        s.add(r)
    retracted = 0
    while not s.idle():
        batch, _, _ = _step(s)
        retracted += len(batch.preempted)
    assert retracted == 0 and (s.ntok_all == 50).all()


def test_sglang_chunks_a_long_prompt_and_reserves_its_output_at_the_last_chunk():
    s = _sglang(1000, (100,), (5,), (5,), chunk=32)
    s.add(0)
    extends = []
    while True:
        batch, first, _ = _step(s)
        extends.append(batch.total_tokens)
        if first:
            break
    assert extends == [32, 32, 32, 4]
    assert s.n == 1 and s.held[0] == 100


# --- TensorRT-LLM -------------------------------------------------------------------------------


def _trt(blocks: int, prompts, outputs, caps, policy=CapacityPolicy.GUARANTEED_NO_EVICT, *,
         max_batch: int = 8, tokens: int = 256) -> TrtllmScheduler:
    """A TensorRT-LLM scheduler over `blocks` blocks of 4 tokens."""
    settings = EngineSettings(num_blocks=blocks + 1, block_size=4, max_num_seqs=max_batch,
                              max_num_batched_tokens=tokens, max_model_len=blocks * 4)
    prompt = _cols(*prompts)
    return TrtllmScheduler(settings, TrtllmRule(policy, tokens_per_block=4), prompt, prompt + _cols(*outputs),
                           _cols(*caps))


def test_trtllm_no_evict_holds_back_a_request_whose_remaining_blocks_do_not_fit():
    # each needs ceil((8 + 16) / 4) = 6 of the 10 blocks to completion: B waits for A to finish
    s = _trt(10, (8, 8), (16, 16), (16, 16))
    s.add(0)
    s.add(1)
    admitted_at, finished_at = {}, {}
    for step in range(60):
        batch, _, finished = _step(s)
        assert not batch.preempted
        for r in batch.admitted:
            admitted_at[r] = step
        for r in finished:
            finished_at[r] = step
        if s.idle():
            break
    assert admitted_at[0] == 0 and admitted_at[1] > finished_at[0]
    # a cap that fits next to A's 6 blocks: ceil((8 + 8) / 4) = 4 ≤ 10 − 6
    s = _trt(10, (8, 8), (16, 8), (16, 8))
    s.add(0)
    s.add(1)
    batch, _, _ = _step(s)
    assert batch.admitted == [0, 1]


def test_trtllm_no_evict_stops_at_the_first_request_that_does_not_fit():
    # after A's 3 blocks, B's worst case (8 + 40 → 12 blocks) does not fit in 14; C's would
    # (3 blocks) but waits behind it
    s = _trt(14, (8, 8, 8), (4, 40, 4), (4, 40, 4))
    for r in range(3):
        s.add(r)
    batch, _, _ = _step(s)
    assert batch.admitted == [0]


def test_trtllm_max_utilization_pauses_the_last_started_request():
    # A and B start together (2 blocks each); at 20 + 20 tokens they need 10 + ... > 10 blocks
    s = _trt(10, (8, 8), (24, 24), (24, 24), CapacityPolicy.MAX_UTILIZATION)
    s.add(0)
    s.add(1)
    paused = []
    for _ in range(100):
        batch, _, _ = _step(s)
        paused += batch.preempted
        if s.idle():
            break
    assert paused and set(paused) == {1} and s.preemptions.tolist() == [0, len(paused)]
    assert (s.ntok_all == 32).all()  # both finished; B recomputed prompt + what it had generated


def test_trtllm_max_utilization_admits_what_the_next_step_needs_only():
    # GUARANTEED_NO_EVICT would hold B back (6 + 6 > 10); MAX_UTILIZATION takes both prompts (2 + 2)
    s = _trt(10, (8, 8), (16, 16), (16, 16), CapacityPolicy.MAX_UTILIZATION)
    s.add(0)
    s.add(1)
    batch, first, _ = _step(s)
    assert batch.admitted == [0, 1] and first == [0, 1] and s.free == 6


def test_trtllm_micro_batch_chunks_contexts_in_block_units():
    s = _trt(64, (30,), (2,), (2,), tokens=12)
    s.add(0)
    chunks = []
    while True:
        batch, first, _ = _step(s)
        chunks.append(batch.total_tokens)
        if first:
            break
    assert chunks == [12, 12, 6]


# --- engine names -------------------------------------------------------------------------------


def test_engine_names_pick_rules():
    assert engine_rule("vllm") is None
    assert isinstance(engine_rule("sglang"), SGLangRule)
    assert engine_rule("trtllm-maxutil").capacity_policy is CapacityPolicy.MAX_UTILIZATION
    with pytest.raises(OptionError, match="unknown engine 'tgi'"):
        engine_rule("tgi")


# --- properties on random small workloads -------------------------------------------------------


@st.composite
def engines(draw) -> EngineSettings:
    bs = draw(st.sampled_from([4, 8, 16]))
    blocks = draw(st.integers(8, 48))
    mml = draw(st.integers(bs * 2, (blocks - 1) * bs))
    return EngineSettings(num_blocks=blocks, block_size=bs, max_num_seqs=draw(st.integers(1, 8)),
                          max_num_batched_tokens=draw(st.integers(8, 96)), max_model_len=mml)


@st.composite
def workloads(draw) -> list[SimRequest]:
    n = draw(st.integers(1, 20))
    out = []
    for _ in range(n):
        output = draw(st.integers(1, 120))
        cap = draw(st.none() | st.integers(output, output + 80))
        out.append(SimRequest(draw(st.floats(0, 3)), draw(st.integers(1, 200)), output, cap))
    return out


rules = st.sampled_from(["sglang", "trtllm-gne", "trtllm-maxutil"]).map(engine_rule) | st.builds(
    SGLangRule, schedule_conservativeness=st.sampled_from([0.3, 1.0, 2.0]),
    new_token_ratio_decay_steps=st.integers(1, 50), page_size=st.sampled_from([1, 4]),
    retract_decode_steps=st.integers(0, 20)) | st.builds(
    TrtllmRule, st.sampled_from(list(CapacityPolicy)), tokens_per_block=st.sampled_from([4, 8, 32]),
    enable_chunked_context=st.just(True))


def _served(wl: Workload, engine: EngineSettings) -> np.ndarray:
    return wl.prompt_tokens + 1 <= engine.max_model_len


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(engine=engines(), rule=rules, requests=workloads())
def test_every_engine_finishes_what_it_admits_tokens_add_up_and_the_pool_holds(engine, rule, requests):
    wl = Workload.from_requests(requests)
    fast = simulate(wl, engine, TIMING, engine=rule)
    slow = simulate(wl, engine, TIMING, engine=rule, fast=False)
    served = _served(wl, engine)
    r = fast.requests
    ok = OUTCOMES.index(OUTCOMES[0])
    assert (r.outcome[served] == ok).all() and not np.isnan(r.finish_s[served]).any()
    target = np.minimum(wl.prompt_tokens + wl.output_tokens, engine.max_model_len) - wl.prompt_tokens
    assert np.array_equal(r.output_tokens[served], target[served])
    assert fast.blocks_used_peak <= fast.usable_blocks
    assert fast.preemptions == int(r.preemptions.sum())
    if isinstance(rule, TrtllmRule) and rule.capacity_policy is CapacityPolicy.GUARANTEED_NO_EVICT:
        assert fast.preemptions == 0
    for name in ("first_scheduled_s", "first_token_s", "finish_s", "output_tokens", "preemptions"):
        assert np.array_equal(getattr(r, name), getattr(slow.requests, name), equal_nan=True), name
    assert fast.num_steps == slow.num_steps


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(engine=engines(), requests=workloads())
def test_sglang_with_the_ratio_pinned_at_one_never_retracts(engine, requests):
    # SGLANG_MIN_NEW_TOKEN_RATIO_FACTOR=1 and a ratio of 1.0 reserve every request's remaining
    # max_new_tokens; prompts within the chunk budget (a chunking request's output is reserved
    # only at its last chunk, so others may be admitted past it meanwhile)
    chunk = engine.max_num_batched_tokens
    wl = Workload.from_requests([SimRequest(q.arrival_s, min(q.prompt_tokens, chunk), q.output_tokens,
                                            q.max_tokens) for q in requests])
    # (the rendered gateway caps every request; uncapped ones here may ask up to the context)
    result = simulate(wl, engine, TIMING, engine=SGLangRule.as_rendered(engine.max_model_len))
    assert result.preemptions == 0


def test_engine_names_cover_the_four_rules():
    assert ENGINE_NAMES == ("vllm", "sglang", "trtllm-gne", "trtllm-maxutil")


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(blocks=st.integers(8, 40), tpb=st.sampled_from([4, 8]), max_batch=st.integers(1, 6),
       lengths=st.lists(st.tuples(st.integers(1, 60), st.integers(1, 60), st.integers(0, 40)), min_size=1,
                        max_size=15))
def test_trtllm_no_evict_never_promises_more_blocks_than_it_has(blocks, tpb, max_batch, lengths):
    """After every step, the blocks every admitted request will hold at completion fit the pool."""
    mml = blocks * tpb
    settings_ = EngineSettings(num_blocks=blocks * tpb // 4 + 1, block_size=4, max_num_seqs=max_batch,
                               max_num_batched_tokens=64, max_model_len=mml)
    prompt = _cols(*(min(p, mml - 1) for p, _, _ in lengths))
    end = np.minimum(prompt + _cols(*(o for _, o, _ in lengths)), mml)
    max_new = np.maximum(np.minimum(end - prompt + _cols(*(x for _, _, x in lengths)), mml - prompt), end - prompt)
    s = TrtllmScheduler(settings_, TrtllmRule(tokens_per_block=tpb), prompt, end, max_new)
    for r in range(len(lengths)):
        s.add(r)
    for _ in range(10_000):
        if s.idle():
            break
        batch, _, _ = _step(s)
        assert not batch.preempted
        admitted = [int(s.rid[i]) for i in range(s.n)] + [r for _, r in s.pending if s.held_all[r] > 0]
        assert int(s.total_blocks[admitted].sum()) <= s.usable
    assert s.idle() and np.array_equal(s.ntok_all, end)
