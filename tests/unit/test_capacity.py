"""Capacity arithmetic worked by hand: pool, blocks, tokens, reservations, measured capacities."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvtune.capacity.measured import CapacitySource, MeasuredCapacity, blocks_from_tokens
from kvtune.capacity.memory import (
    COLLECTIVE_BYTES,
    Overhead,
    estimate_overhead,
    kv_pool,
    memory_model,
    num_blocks_for,
    profile_limits,
)
from kvtune.capacity.plan import (
    CapacityInputs,
    capacity_from_blocks,
    estimate_capacity,
    measured_capacity,
    plan_capacity,
)
from kvtune.capacity.reservation import RequestShape, fit_request, reserved_blocks
from kvtune.errors import CapacityError, InputError, OptionError
from kvtune.hardware import GPUS
from kvtune.kv import kv_bytes
from kvtune.model import resolve_model
from kvtune.weights import estimate_from_parameters

GiB = 1024**3
FIXED = Overhead(activation_bytes=GiB, cuda_graph_bytes=GiB // 2, non_torch_bytes=GiB // 4, assumptions=())


def test_kv_pool_by_hand():
    # 80 GiB × 0.9 = 72 GiB requested; − 16 GiB weights − 1.75 GiB overhead = 54.25 GiB
    m = kv_pool(gpu_memory_bytes=80 * GiB, gpu_memory_utilization=0.9, weights_bytes=16 * GiB, overhead=FIXED)
    assert m.requested_memory_bytes == 72 * GiB == 77_309_411_328
    assert m.overhead_bytes == 1_879_048_192  # 1.75 GiB
    assert m.kv_cache_bytes == 58_250_493_952  # 54.25 GiB = 54.25 × 1,073,741,824
    # Llama-3.1-8B bf16: 131,072 B/token; block of 16 tokens = 2 MiB; 54.25 GiB / 2 MiB = 27,776 blocks
    assert num_blocks_for(m.kv_cache_bytes, 16, 131_072) == 27_776
    cap = estimate_capacity(memory=m, kv_bytes_per_token_per_gpu=131_072, block_size=16, max_model_len=131_072)
    assert cap.kv_cache_tokens == 27_776 * 16 == 444_416
    # 131,072 / 16 = 8,192 blocks per full-length request: 27,776 / 8,192 = 3.390625
    assert cap.max_concurrency_at_max_model_len == 3.390625
    assert cap.kv_cache_bytes == m.kv_cache_bytes
    assert cap.source is CapacitySource.ESTIMATE


def test_requested_memory_rounds_up_like_vllm():
    # ceil(1,000,001 × 0.5) = 500,001
    m = kv_pool(gpu_memory_bytes=1_000_001, gpu_memory_utilization=0.5, weights_bytes=1,
                overhead=Overhead(0, 0, 0, ()))
    assert m.requested_memory_bytes == 500_001
    assert m.kv_cache_bytes == 500_000


def test_weights_that_exceed_memory_say_so_with_numbers():
    with pytest.raises(CapacityError) as info:
        kv_pool(gpu_memory_bytes=24 * GiB, gpu_memory_utilization=0.92, weights_bytes=140 * GiB, overhead=FIXED)
    assert str(info.value).startswith(
        "weights alone exceed the usable memory per GPU: weights 140.00 GiB + overhead 1.75 GiB > "
        "24.00 GiB × 0.92 = 22.08 GiB"
    )
    with pytest.raises(CapacityError, match="weights \\+ overhead exceed"):
        kv_pool(gpu_memory_bytes=24 * GiB, gpu_memory_utilization=0.92, weights_bytes=21 * GiB, overhead=FIXED)


def test_overhead_model_by_hand():
    o = estimate_overhead(hidden_size=4096, mlp_width=14336, vocab_size=128_256,
                          max_num_batched_tokens=8192, max_num_seqs=1024)
    # forward: per token 2 B × (4·4096 + 3·14336) = 2 × 59,392 = 118,784 B; × 8,192 tokens = 973,078,528 B
    # dummy sampler (top-k/top-p sort): 1,024 × 128,256 × 36 B = 4,728,029,184 B, + the forward's output
    # hidden states 8,192 × 4,096 × 2 B = 67,108,864 B; the peak is the larger of the two runs
    assert o.activation_bytes == max(973_078_528, 4_728_029_184 + 67_108_864)
    assert o.cuda_graph_bytes == GiB // 2  # the current release (0.33) subtracts its CUDA-graph estimate
    assert o.non_torch_bytes == GiB // 4
    assert len(o.assumptions) == 4 and "vLLM 0.33 (V1)" in o.assumptions[0]
    assert "8,192 batched tokens" in o.assumptions[1]


def test_overhead_under_tp_and_eager():
    o = estimate_overhead(hidden_size=4096, mlp_width=14336, vocab_size=128_256,
                          max_num_batched_tokens=2048, max_num_seqs=256, tp=2, enforce_eager=True)
    # forward per token 2 × (16,384 + 3 · 7,168) = 75,776 B; × 2,048 = 155,189,248; sampler 256 × 128,256 × 36
    # = 1,182,007,296 + hidden states 2,048 × 4,096 × 2 = 16,777,216
    assert o.activation_bytes == 1_182_007_296 + 16_777_216
    assert o.cuda_graph_bytes == 0
    assert o.non_torch_bytes == GiB // 4 + COLLECTIVE_BYTES  # workspaces + NCCL/all-reduce buffers (1.79 GiB)


def test_issue_example_long_cap_costs_more_than_long_prompt():
    # 200 + 4,000 = 4,200 tokens → ceil(4200/16) = 263 blocks; 3,000 + 200 = 3,200 → 200 blocks
    assert reserved_blocks(200, 4000, 16) == 263
    assert reserved_blocks(3000, 200, 16) == 200
    a = fit_request(RequestShape(200, 4000), usable_blocks=27_775, block_size=16, max_model_len=131_072)
    b = fit_request(RequestShape(3000, 200), usable_blocks=27_775, block_size=16, max_model_len=131_072)
    assert (a.max_concurrent, b.max_concurrent) == (27_775 // 263, 27_775 // 200) == (105, 138)


def test_cap_beyond_context_is_clamped_as_vllm_clamps():
    # max_model_len 4,096: 200 + 4,000 > 4,096, so max_tokens becomes 3,896 → 4,096 tokens = 256 blocks
    fit = fit_request(RequestShape(200, 4000), usable_blocks=1000, block_size=16, max_model_len=4096)
    assert (fit.reserved_tokens, fit.reserved_blocks, fit.max_concurrent) == (4096, 256, 3)
    assert "clamped to max_model_len − prompt = 3,896" in fit.note


def test_prompt_longer_than_context_fits_zero():
    fit = fit_request(RequestShape(5000, 10), usable_blocks=1000, block_size=16, max_model_len=4096)
    assert fit.max_concurrent == 0
    assert "vLLM rejects it" in fit.note


def test_shape_larger_than_the_whole_cache_fits_zero():
    fit = fit_request(RequestShape(1000, 1000), usable_blocks=100, block_size=16, max_model_len=8192)
    # 2,000 / 16 = 125 blocks > 100
    assert (fit.reserved_blocks, fit.max_concurrent) == (125, 0)
    assert fit.note == "does not fit: needs 125 blocks, only 100 usable"


def test_request_shape_rejects_non_positive():
    with pytest.raises(OptionError, match="prompt_tokens"):
        RequestShape(0, 10)
    with pytest.raises(OptionError, match="max_tokens"):
        RequestShape(10, 0)


def test_capacity_from_blocks_reproduces_vllm_cpu_example():
    # vllm-facts §3: 32 blocks × 128 tokens, max_model_len 512 → 4 blocks per request → 8.00x
    cap = capacity_from_blocks(source=CapacitySource.METRICS, num_blocks=32, block_size=128, max_model_len=512,
                               shapes=(RequestShape(24, 400),))
    assert cap.kv_cache_tokens == 4096
    assert cap.max_concurrency_at_max_model_len == 8.0
    # 24 + 400 = 424 tokens → 4 blocks; 31 usable blocks (one null block) → 7 at once
    assert cap.usable_blocks == 31
    assert cap.requests[0].reserved_blocks == 4 and cap.requests[0].max_concurrent == 7


def test_too_small_for_one_full_request_is_noted():
    cap = capacity_from_blocks(source=CapacitySource.ESTIMATE, num_blocks=100, block_size=16, max_model_len=8192)
    assert cap.max_concurrency_at_max_model_len == 100 / 512
    # vLLM's startup check plans without its null block (kv_cache_utils.py check_enough_kv_cache_memory):
    # 99 usable blocks hold 1,584 tokens (the note said 100 × 16 = 1,600 before issue 25, one block too many)
    assert any("vLLM would refuse to start" in n and "at most 1,584" in n for n in cap.notes)


def test_per_sequence_state_reserves_whole_blocks():
    # block = 16 × 131,072 B = 2 MiB; 3 MiB of Mamba state → 2 extra blocks per request
    cap = capacity_from_blocks(source=CapacitySource.ESTIMATE, num_blocks=1001, block_size=16, max_model_len=4096,
                               shapes=(RequestShape(100, 60),), kv_bytes_per_token_per_gpu=131_072,
                               state_bytes_per_sequence_per_gpu=3 * 2**20)
    assert cap.requests[0].reserved_blocks == 10 + 2  # ceil(160/16) + 2
    assert cap.requests[0].max_concurrent == 1000 // 12


@pytest.mark.parametrize(
    ("tokens", "block_size", "max_len", "blocks"),
    [
        (4096, 128, 512, 32),  # CPU example: ceil(4096 · 4 / 512) = 32
        (686_320, 16, 100_000, 42_895),  # ceil(686,320 · 6,250 / 100,000) = 42,895; 42,895 · 100,000 // 6,250 = 686,320
        (1587, 16, 1000, 100),  # 100 blocks, 63 per request: int(100/63·1000) = 1,587 (not 100 · 16)
        (4096, 16, None, 256),  # no length known: tokens // block size
    ],
)
def test_blocks_from_tokens_inverts_vllm(tokens, block_size, max_len, blocks):
    assert blocks_from_tokens(tokens, block_size, max_len) == blocks


@given(st.integers(1, 10**6), st.sampled_from([16, 32, 128]), st.integers(1, 300_000))
def test_blocks_from_tokens_round_trips_vllm_formula(num_blocks, block_size, max_len):
    per_request = -(-max_len // block_size)
    logged = int(num_blocks / per_request * max_len)
    if logged == (num_blocks * max_len) // per_request:  # float rounding in vLLM's own formula aside
        assert blocks_from_tokens(logged, block_size, max_len) == num_blocks


def test_measured_block_size_wins_and_is_noted():
    m = MeasuredCapacity(source=CapacitySource.METRICS, num_blocks=573, block_size=16, kv_cache_tokens=None)
    cap = measured_capacity(m, block_size=128, max_model_len=8192)
    assert (cap.num_blocks, cap.block_size, cap.kv_cache_tokens) == (573, 16, 9168)
    assert any("block size 16 reported by the server" in n for n in cap.notes)
    assert cap.source is CapacitySource.METRICS


def test_measured_tokens_use_the_given_block_size():
    m = MeasuredCapacity(source=CapacitySource.KV_TOKENS, kv_cache_tokens=100_000)
    cap = measured_capacity(m, block_size=16, max_model_len=8192, kv_bytes_per_token_per_gpu=131_072)
    assert (cap.num_blocks, cap.kv_cache_tokens) == (6250, 100_000)
    assert cap.kv_cache_bytes == 6250 * 16 * 131_072


def test_measured_capacity_round_trips_through_json():
    m = MeasuredCapacity(source=CapacitySource.VLLM_LOG, kv_cache_tokens=686_320, max_model_len=100_000,
                         max_concurrency=6.86, device="GPU", origin="server.log", line=3)
    again = MeasuredCapacity.from_dict(json.loads(json.dumps(m.to_dict())))
    assert again == m


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"source": "guess", "num_blocks": 1}, "source: unknown source 'guess'"),
        ({"source": "metrics", "num_blocks": "many"}, "num_blocks: expected int, found 'many'"),
        ({"source": "metrics", "num_blocks": True}, "num_blocks: expected int"),
        ({"source": "metrics"}, "a measured capacity needs kv_cache_tokens or num_blocks"),
        ({"source": "metrics", "num_blocks": 4, "blocks": 4}, "blocks: unknown field(s): blocks"),
        ({"source": "metrics", "num_blocks": 4, "block_size": 0}, "block_size: must be positive"),
        ([1, 2], "expected a JSON object"),
    ],
)
def test_measured_capacity_from_dict_rejects_bad_files(data, message):
    with pytest.raises(InputError) as info:
        MeasuredCapacity.from_dict(data, path="cap.json")
    assert str(info.value).startswith("cap.json: ")
    assert message in str(info.value)


# --- the whole plan on a real model ------------------------------------------------------------


@pytest.fixture
def llama():
    return resolve_model("llama-3.1-8b")


def test_plan_on_h100_is_consistent_arithmetic(llama):
    h100 = GPUS["H100-80GB"]
    weights = estimate_from_parameters(llama)
    report = plan_capacity(llama, kv_bytes(llama), CapacityInputs(
        weights, gpu_name=h100.name, gpu_memory_bytes=h100.memory_bytes,
        shapes=(RequestShape(200, 4000), RequestShape(3000, 200))))
    c = report.capacity
    m = c.memory
    assert m.requested_memory_bytes == -(-h100.memory_bytes * 92 // 100)  # ceil(85,520,809,984 × 0.92)
    assert m.weights_bytes == 16_060_522_496
    assert report.max_num_batched_tokens == 8192 and report.max_num_seqs == 1024
    assert m.kv_cache_bytes == m.requested_memory_bytes - m.weights_bytes - m.overhead_bytes
    assert c.num_blocks == m.kv_cache_bytes // (16 * 131_072)
    assert c.requests[0].reserved_blocks > c.requests[1].reserved_blocks
    d = report.to_dict()
    assert d["source"] == "estimate" and d["weights_bytes"] + d["overhead_bytes"] + d["kv_cache_bytes"] == \
        d["requested_memory_bytes"]


def test_plan_needs_memory_or_a_measurement(llama):
    with pytest.raises(OptionError, match="give `gpu` or `gpu_memory`"):
        plan_capacity(llama, kv_bytes(llama), CapacityInputs(estimate_from_parameters(llama)))


def test_plan_keeps_a_measurement_when_the_estimate_says_nothing_fits(llama):
    measured = MeasuredCapacity(source=CapacitySource.KV_TOKENS, kv_cache_tokens=1600)
    report = plan_capacity(llama, kv_bytes(llama), CapacityInputs(
        estimate_from_parameters(llama), gpu_memory_bytes=8 * GiB, max_model_len=1024, measured=measured))
    assert report.capacity.num_blocks == 100 and report.capacity.memory is None
    assert any("the estimate disagrees" in n for n in report.capacity.notes)


def test_plan_uses_cpu_block_size_for_a_cpu_log(llama):
    measured = MeasuredCapacity(source=CapacitySource.VLLM_LOG, kv_cache_tokens=4096, max_model_len=512,
                                device="CPU")
    c = plan_capacity(llama, kv_bytes(llama), CapacityInputs(estimate_from_parameters(llama), measured=measured)).capacity
    assert (c.block_size, c.num_blocks, c.max_model_len, c.max_concurrency_at_max_model_len) == (128, 32, 512, 8.0)


def test_plan_notes_sliding_window_layers():
    spec = resolve_model("gpt-oss-20b")
    report = plan_capacity(spec, kv_bytes(spec), CapacityInputs(
        estimate_from_parameters(spec), gpu_memory_bytes=GPUS["H100-80GB"].memory_bytes))
    assert any("sliding-window" in n and "window 128" in n for n in report.capacity.notes)


# --- properties --------------------------------------------------------------------------------


@given(st.integers(20 * GiB, 200 * GiB), st.integers(1, 50 * GiB), st.sampled_from([16, 32, 128]))
def test_more_memory_never_fewer_blocks(memory, extra, block_size):
    def blocks(mem):
        m = kv_pool(gpu_memory_bytes=mem, gpu_memory_utilization=0.92, weights_bytes=16 * GiB, overhead=FIXED)
        return num_blocks_for(m.kv_cache_bytes, block_size, 131_072)

    assert blocks(memory + extra) >= blocks(memory)


@given(st.integers(1, 100_000), st.integers(1, 100_000), st.integers(0, 5000), st.sampled_from([1, 16, 128]))
def test_reserved_blocks_monotone_in_prompt_and_cap(prompt, cap, more, block_size):
    base = reserved_blocks(prompt, cap, block_size)
    assert reserved_blocks(prompt + more, cap, block_size) >= base
    assert reserved_blocks(prompt, cap + more, block_size) >= base
    assert base * block_size >= prompt + cap > (base - 1) * block_size


@given(st.integers(1, 50_000), st.integers(1, 50_000), st.integers(0, 10**6), st.sampled_from([16, 128]))
def test_reservations_never_oversubscribe(prompt, cap, usable, block_size):
    fit = fit_request(RequestShape(prompt, cap), usable_blocks=usable, block_size=block_size, max_model_len=131_072)
    assert fit.max_concurrent * fit.reserved_blocks <= usable
    if fit.max_concurrent:
        assert (fit.max_concurrent + 1) * fit.reserved_blocks > usable


def test_plan_notes_mla_block_size():
    spec = resolve_model("deepseek-v3")
    report = plan_capacity(spec, kv_bytes(spec, tp=8), CapacityInputs(
        estimate_from_parameters(spec), gpu_memory_bytes=GPUS["H200"].memory_bytes))
    assert any(n.startswith("MLA:") for n in report.capacity.notes)
    # MLA is replicated on every TP rank: 61 layers × (512 + 64) × 2 B = 70,272 B per token per GPU
    assert report.capacity.kv_bytes_per_token_per_gpu == 70_272


# --- the memory model by vLLM release ------------------------------------------------------------


@pytest.mark.parametrize(("version", "v1", "non_torch", "whole_device", "graphs"), [
    ("0.2.4", False, False, False, False),  # torch peak only, before vllm#2031
    ("0.2.7", False, True, True, False),  # all device memory in use after the profile (vllm#2031)
    ("0.6.3", False, True, True, False),
    ("0.6.5", False, True, False, False),  # per part (vllm#10511)
    ("v0.7.3", False, True, False, False),
    ("0.8.0", True, True, False, False),  # V1; CUDA graphs captured after the pool
    ("0.10.1.post1", True, True, False, False),
    ("0.21.0", True, True, False, True),  # the CUDA-graph estimate is subtracted
    (None, True, True, False, True),  # the current release
])
def test_memory_model_by_release(version, v1, non_torch, whole_device, graphs):
    m = memory_model(version)
    assert (m.v1, m.counts_non_torch, m.whole_device, m.counts_cuda_graphs) == (v1, non_torch, whole_device, graphs)
    assert m.label.endswith("(V1)" if v1 else "(V0)")


def test_a_bad_engine_version_names_the_field():
    with pytest.raises(OptionError, match="not a vLLM version: 'latest'") as err:
        memory_model("latest")
    assert err.value.field == "engine_version"


def test_v0_profiles_max_model_len_and_charges_no_cuda_graphs():
    kw = {"hidden_size": 4096, "mlp_width": 14336, "vocab_size": 128_256, "max_num_seqs": 256}
    v0, v1 = memory_model("0.6.3"), memory_model("0.19.0")
    # V0 without chunked prefill: max(max_model_len, 2048) tokens and 256 sequences; V1: the GPU-size default
    assert profile_limits(v0, max_model_len=32_768, max_num_batched_tokens=None, max_num_seqs=None,
                          gpu_memory_bytes=80 * GiB, gpu_name="H100-80GB")[:2] == (32_768, 256)
    assert profile_limits(v1, max_model_len=32_768, max_num_batched_tokens=None, max_num_seqs=None,
                          gpu_memory_bytes=80 * GiB, gpu_name="H100-80GB")[:2] == (8192, 1024)
    old = estimate_overhead(max_num_batched_tokens=32_768, engine_version="0.6.3", **kw)
    assert old.cuda_graph_bytes == 0 and "captures them after allocating it" in old.assumptions[2]
    assert old.activation_bytes == 32_768 * 118_784  # the 32k-token forward outweighs 256 × vocab logits sorted
    assert estimate_overhead(max_num_batched_tokens=8192, engine_version="0.21", **kw).cuda_graph_bytes == GiB // 2
    assert estimate_overhead(max_num_batched_tokens=8192, engine_version="0.2.4", **kw).non_torch_bytes == 0


def test_every_part_of_the_estimate_names_the_release(llama):
    report = plan_capacity(llama, kv_bytes(llama, tp=2), CapacityInputs(
        estimate_from_parameters(llama), gpu_memory_bytes=GPUS["A100-80GB"].memory_bytes, gpu_name="A100-80GB",
        max_model_len=8192, engine_version="0.6.3"))
    assert report.engine_version == "0.6.3" and report.to_dict()["engine_version"] == "0.6.3"
    assert report.max_num_batched_tokens == 8192 and report.max_num_seqs == 256
    assert any(a.startswith("memory model: vLLM 0.6.3 (V0)") for a in report.assumptions)
    assert any("max(max_model_len, 2,048)" in a and "vLLM 0.6.3 (V0)" in a for a in report.assumptions)
    assert any("measure the capacity" in a for a in report.assumptions)  # whole-device profiler at TP 2
    current = plan_capacity(llama, kv_bytes(llama), CapacityInputs(
        estimate_from_parameters(llama), gpu_memory_bytes=GPUS["A100-80GB"].memory_bytes, gpu_name="A100-80GB"))
    assert current.engine_version == "0.33" and any("vLLM 0.33 (V1)" in a for a in current.assumptions)


@given(st.sampled_from(["0.2.4", "0.2.7", "0.6.5", "0.7.3", "0.9.2", "0.21", None]), st.integers(1, 65_536),
       st.integers(0, 65_536), st.integers(1, 1024), st.integers(0, 1024), st.sampled_from([1, 2, 8]))
def test_overhead_grows_with_the_profiled_batch(version, tokens, more_tokens, seqs, more_seqs, tp):
    def overhead(t, s):
        return estimate_overhead(hidden_size=4096, mlp_width=14336, vocab_size=128_256, max_num_batched_tokens=t,
                                 max_num_seqs=s, tp=tp, engine_version=version)

    base = overhead(tokens, seqs)
    assert overhead(tokens + more_tokens, seqs + more_seqs).total_bytes >= base.total_bytes
    model = memory_model(version)
    assert (base.cuda_graph_bytes > 0) == model.counts_cuda_graphs
    assert (base.non_torch_bytes > 0) == model.counts_non_torch
