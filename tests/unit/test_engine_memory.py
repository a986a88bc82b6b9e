"""SGLang's and TensorRT-LLM's memory models (kvtune.capacity.engine_memory) on hand-computed cases,
and plan() choosing the engine's model, block size and limits.

The worked case throughout: Llama-3.1-8B (bf16, 8,030,261,248 parameters → 16,060,522,496 B of
weights; 32 layers × 8 KV heads × 128 × 2 (K, V) × 2 B = 131,072 B of KV per token) on one
H100-80GB (81,559 MiB = 85,520,809,984 B, as nvidia-smi reports it).
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvtune.capacity.engine_memory import (
    CUDA_BASELINE_BYTES,
    TRTLLM_CUDA_GRAPH_BYTES,
    default_fraction,
    sglang_memory,
    trtllm_memory,
)
from kvtune.capacity.measured import CapacitySource, MeasuredCapacity
from kvtune.domain.deployment import Deployment
from kvtune.engines import sglang
from kvtune.errors import CapacityError
from kvtune.hardware import GiB, MiB, find_gpu
from kvtune.planning import PlanError, plan

H100 = 81_559 * MiB
WEIGHTS_8B = 16_060_522_496
KV_8B = 131_072
LLAMA_8B = {"hidden_size": 4096, "mlp_width": 14_336, "vocab_size": 128_256}


def sglang_8b(**kwargs):
    return sglang_memory(gpu_memory_bytes=H100, weights_bytes=WEIGHTS_8B, kv_bytes_per_token_per_gpu=KV_8B,
                         context_len=131_072, **kwargs)


def trtllm_8b(**kwargs):
    return trtllm_memory(gpu_memory_bytes=H100, weights_bytes=WEIGHTS_8B, kv_bytes_per_token_per_gpu=KV_8B,
                         max_seq_len=131_072, **LLAMA_8B, **kwargs)


# --- SGLang -----------------------------------------------------------------------------------


def test_sglang_default_fraction_on_an_h100_by_hand():
    # memory_hook.py: 81,559 MiB is below 90 GiB → chunked_prefill_size 8192, decode max_bs 256;
    # prefill graphs capture 58 sizes up to 8192 (8 + 14 + 8 + 8 + 12 + 8)
    assert len(sglang.prefill_capture_sizes(8192)) == 58
    # reserved = 512 + 1.5 × 8192 + 1 × 1 / 8 × 1024 + 2 × 256 + 8 × 58 = 13,904 MiB (above the 10 GiB floor)
    # f = round((81,559 − 13,904) / 81,559, 3) = round(0.82952, 3)
    assert sglang.default_mem_fraction_static(H100) == 0.83


@pytest.mark.parametrize("gpu, tp, fraction", [
    # A10G 23,028 MiB: 4096 / max_bs 48; reserved 512 + 6,144 + 128 + 96 + 8 × 50 = 7,280; no floor
    ("A10G", 1, 0.684),
    # H200 143,771 MiB: 8192 / 256, reserved 13,904 as on the H100
    ("H200", 1, 0.903),
    # B200 183,359 MiB: 16384 / 512; reserved 512 + 24,576 + 128 + 1,024 + 8 × 74 = 26,832
    ("B200", 1, 0.854),
    # H100 at tp 4: max_bs 512, tp × pp / 8 × 1024 = 512; reserved 512 + 12,288 + 512 + 1,024 + 464 = 14,800
    ("H100-80GB", 4, 0.819),
])
def test_sglang_default_fraction_by_tier(gpu, tp, fraction):
    assert sglang.default_mem_fraction_static(find_gpu(gpu).memory_bytes, tp=tp) == fraction


# What SGLang 0.5.23's own `handle_gpu_memory_settings` (arg_groups/memory_hook.py) resolved, run once
# on a CPU with its wheel, GPU memory patched in and a stand-in for the server arguments (CUDA
# defaults: decode graphs full, prefill graphs breakable, no DP attention, no post-capture sizing).
SGLANG_RESOLVED = [  # (MiB, tp, mla, mem_fraction_static, chunked_prefill_size)
    (81_559, 1, False, 0.83, 8192), (23_028, 1, False, 0.684, 4096), (143_771, 1, False, 0.903, 8192),
    (183_359, 1, False, 0.854, 16_384), (81_559, 4, False, 0.819, 8192), (40_960, 1, False, 0.823, 4096),
    (46_068, 1, False, 0.843, 4096), (196_288, 1, False, 0.863, 16_384), (24_564, 8, False, 0.658, 4096),
    (81_559, 1, True, 0.816, 8192),
]


@pytest.mark.parametrize("mib, tp, mla, fraction, chunk", SGLANG_RESOLVED)
def test_sglang_default_fraction_matches_sglangs_own_resolution(mib, tp, mla, fraction, chunk):
    assert sglang.default_mem_fraction_static(mib * MiB, tp=tp, mla=mla) == fraction
    assert sglang.memory_tier(mib * MiB, tp)[0] == chunk


def test_sglang_llama_8b_on_an_h100_by_hand():
    m = sglang_8b()
    # free before loading = (81,559 − 1,024) MiB = 84,447,068,160 B (the assumed 1 GiB CUDA baseline)
    assert m.fraction_of_bytes == H100 - CUDA_BASELINE_BYTES == 84_447_068_160
    # static memory = floor(84,447,068,160 × 0.83) = 70,091,066,572 B; KV pool = that − weights
    assert m.requested_memory_bytes == 70_091_066_572
    assert m.kv_cache_bytes == 70_091_066_572 - WEIGHTS_8B == 54_030_544_076
    # 54,030,544,076 / 131,072 = 412,220.3 → 412,220 tokens at page size 1
    assert m.kv_cache_bytes // KV_8B == 412_220
    # max_running_requests: clamp(412,220 / 131,072 × 512 = 1,610, 2048, 4096) = 2048 ≤ tokens // 2
    assert (m.gpu_memory_utilization, m.block_size, m.max_num_seqs, m.max_num_batched_tokens) == (0.83, 1, 2048, 8192)
    assert m.overhead.assumptions[0] == (
        "SGLang 0.5.23's memory model (mem_fraction_static covers weights + KV)")


def test_sglang_given_fraction_and_max_total_tokens_clamp():
    m = sglang_8b(mem_fraction_static=0.9, max_total_tokens=300_000)
    assert m.kv_cache_bytes == 300_000 * KV_8B
    assert m.rows[-1] == ("min(--max-total-tokens 300,000)", 300_000 * KV_8B, "SGLang takes the smaller")
    # above the profiled count the clamp does nothing (SGLang warns and uses the profiled value)
    assert sglang_8b(max_total_tokens=10**9).kv_cache_bytes == 54_030_544_076


def test_sglang_page_size_floors_tokens():
    m = sglang_8b(page_size=64, max_total_tokens=300_001)
    assert m.kv_cache_bytes // KV_8B == 300_001 // 64 * 64 == 299_968


def test_sglang_running_requests_given():
    assert sglang_8b(max_running_requests=64).max_num_seqs == 64


def test_sglang_weights_that_do_not_fit():
    with pytest.raises(CapacityError) as info:
        sglang_memory(gpu_memory_bytes=H100, weights_bytes=141 * GiB, kv_bytes_per_token_per_gpu=KV_8B,
                      context_len=8192)
    assert str(info.value) == (
        "SGLang leaves no KV pool: weights 141.00 GiB per GPU against 65.28 GiB (78.65 GiB free × "
        "mem_fraction_static 0.83); use more GPUs (`tp`/`pp`), a bigger GPU, or quantized weights")


def test_sglang_default_fraction_too_small_for_the_weights_says_what_to_raise():
    # an L4 (23,034 MiB): SGLang derives 0.684; 0.684 × 21.49 GiB free = 14.70 GiB < 14.96 GiB of weights
    with pytest.raises(CapacityError) as info:
        plan(Deployment("llama-3.1-8b", gpu="L4", engine="sglang"))
    assert str(info.value) == (
        "SGLang leaves no KV pool: weights 14.96 GiB per GPU against 14.70 GiB (21.49 GiB free × "
        "mem_fraction_static 0.684); raise mem_fraction_static (`gpu_memory_utilization`) above 0.696, or use "
        "more GPUs (`tp`/`pp`), a bigger GPU, or quantized weights")


@given(f1=st.floats(0.05, 0.99), f2=st.floats(0.05, 0.99), weights=st.integers(0, 40 * GiB))
def test_sglang_pool_grows_with_the_fraction(f1, f2, weights):
    low, high = sorted((f1, f2))
    try:
        small = sglang_memory(gpu_memory_bytes=H100, weights_bytes=weights, kv_bytes_per_token_per_gpu=KV_8B,
                              context_len=8192, mem_fraction_static=low)
    except CapacityError:
        return
    big = sglang_memory(gpu_memory_bytes=H100, weights_bytes=weights, kv_bytes_per_token_per_gpu=KV_8B,
                        context_len=8192, mem_fraction_static=high)
    assert small.kv_cache_bytes <= big.kv_cache_bytes
    assert big.kv_cache_bytes + weights <= big.requested_memory_bytes


# --- TensorRT-LLM -----------------------------------------------------------------------------


def test_trtllm_llama_8b_on_an_h100_by_hand():
    m = trtllm_8b()
    # activation peak: 8192 tokens × 2 B × (4 × 4096 + 3 × 14,336) = 973,078,528 B, plus one dummy
    # request's float32 logits 128,256 × 4 = 513,024 B
    assert m.overhead.activation_bytes == 973_591_552
    # outside torch: 1 GiB baseline + 0.5 GiB CUDA graphs (assumed)
    outside = CUDA_BASELINE_BYTES + TRTLLM_CUDA_GRAPH_BYTES
    # free at the peak = 85,520,809,984 − 16,060,522,496 − 973,591,552 − 1,610,612,736 = 66,876,083,200 B
    assert m.fraction_of_bytes == H100 - WEIGHTS_8B - 973_591_552 - outside == 66_876_083_200
    # × 0.9 = 60,188,474,880 B → 459,201 tokens → 14,350 blocks of 32 = 459,200 tokens
    assert m.kv_cache_bytes == 60_188_474_880
    assert m.kv_cache_bytes // KV_8B // 32 == 14_350
    assert (m.gpu_memory_utilization, m.block_size, m.max_num_seqs, m.max_num_batched_tokens) == (0.9, 32, 2048, 8192)


def test_trtllm_max_tokens_takes_the_min():
    m = trtllm_8b(max_tokens=100_000)
    assert m.kv_cache_bytes == 100_000 * KV_8B  # 3,125 blocks
    assert trtllm_8b(max_tokens=10**9).kv_cache_bytes == 60_188_474_880


def test_trtllm_fraction_and_block_size():
    m = trtllm_8b(free_gpu_memory_fraction=0.5, tokens_per_block=64)
    assert m.kv_cache_bytes == 66_876_083_200 // 2
    assert m.kv_cache_bytes // KV_8B // 64 == 3986


@pytest.mark.parametrize("fraction", [0.0, 1.0, 1.5])
def test_trtllm_fraction_must_be_below_one(fraction):
    with pytest.raises(CapacityError) as info:
        trtllm_8b(free_gpu_memory_fraction=fraction)
    assert str(info.value) == f"free_gpu_memory_fraction: must be in (0, 1), got {fraction}"


@given(weights=st.integers(0, 70 * GiB), fraction=st.floats(0.05, 0.99), per_block=st.sampled_from([8, 16, 32, 64]))
def test_trtllm_blocks_fit_the_budget(weights, fraction, per_block):
    try:
        m = trtllm_memory(gpu_memory_bytes=H100, weights_bytes=weights, kv_bytes_per_token_per_gpu=KV_8B,
                          max_seq_len=8192, **LLAMA_8B, free_gpu_memory_fraction=fraction, tokens_per_block=per_block)
    except CapacityError:
        return
    blocks = m.kv_cache_bytes // KV_8B // per_block
    assert 1 <= blocks and blocks * per_block * KV_8B <= m.kv_cache_bytes <= m.fraction_of_bytes


# --- plan() -----------------------------------------------------------------------------------


def test_plan_with_sglang():
    p = plan(Deployment("llama-3.1-8b", gpu="H100-80GB", engine="sglang"))
    assert (p.engine, p.capacity.block_size, p.capacity.kv_cache_tokens, p.capacity.source) == (
        "sglang", 1, 412_220, CapacitySource.ESTIMATE)
    assert (p.gpu_memory_utilization.value, p.gpu_memory_utilization.source) == (0.83, "default")
    assert (p.report.max_num_seqs, p.report.max_num_batched_tokens, p.report.engine) == (2048, 8192, "sglang")


def test_plan_with_trtllm():
    p = plan(Deployment("llama-3.1-8b", gpu="H100-80GB", engine="trtllm", gpu_memory_utilization=0.9))
    assert (p.capacity.block_size, p.capacity.num_blocks, p.capacity.kv_cache_tokens) == (32, 14_350, 459_200)
    assert p.gpu_memory_utilization.source == "given"


def test_plan_default_engine_is_vllm_unchanged():
    p = plan(Deployment("llama-3.1-8b", gpu="H100-80GB"))
    assert (p.engine, p.capacity.block_size, p.gpu_memory_utilization.value, p.report.engine) == (
        "vllm", 16, 0.92, "vllm")


def test_plan_refuses_a_measurement_from_another_engine():
    measured = MeasuredCapacity(source=CapacitySource.SGLANG_LOG, engine="sglang", kv_cache_tokens=300_000,
                                origin="sglang.log")
    with pytest.raises(PlanError) as info:
        plan(Deployment("llama-3.1-8b", gpu="H100-80GB"), measured=measured)
    assert str(info.value) == ("engine: the capacity was measured on SGLang (sglang.log), not vLLM: "
                               "pass `engine` sglang")
    p = plan(Deployment("llama-3.1-8b", gpu="H100-80GB", engine="sglang"), measured=measured)
    assert (p.capacity.num_blocks, p.capacity.block_size, p.capacity.estimated_num_blocks) == (300_000, 1, 412_220)


def test_plan_keeps_a_measured_sglang_fraction():
    measured = MeasuredCapacity(source=CapacitySource.SGLANG_SERVER, engine="sglang", kv_cache_tokens=412_220,
                                num_blocks=412_220, block_size=1, gpu_memory_utilization=0.83, origin="u")
    with pytest.raises(PlanError):
        plan(Deployment("llama-3.1-8b", gpu="H100-80GB", engine="sglang", gpu_memory_utilization=0.9), measured=measured)
    assert plan(Deployment("llama-3.1-8b", gpu="H100-80GB", engine="sglang"), measured=measured).gpu_memory_utilization.source \
        == "measured"


def test_default_fraction():
    assert default_fraction("trtllm", H100) == 0.9
    assert default_fraction("sglang", None) == 0.95


def test_a_pool_smaller_than_one_request_in_the_engines_words():
    sglang_note = plan(Deployment("llama-3.1-8b", gpu="H100-80GB", engine="sglang", max_kv_tokens=100_000)).capacity.notes
    assert "SGLang caps each request at 99,999 tokens (the pool − 1), below max_model_len 131,072" in sglang_note
    trt = plan(Deployment("llama-3.1-8b", gpu="H100-80GB", engine="trtllm", max_kv_tokens=100_000)).capacity
    assert (trt.num_blocks, trt.kv_cache_tokens) == (3125, 100_000)
    assert "TensorRT-LLM lowers max_seq_len to the pool's 100,000 tokens, below 131,072" in trt.notes


def test_another_release_is_named():
    assert sglang_8b(version="0.5.23").overhead.assumptions[0].endswith("covers weights + KV)")
    assert sglang_8b(version="0.4.6").overhead.assumptions[0].endswith(
        "covers weights + KV), applied to SGLang 0.4.6: not read for that release")
    assert trtllm_8b(version="1.2.1").overhead.assumptions[0].endswith("memory outside torch)")
    assert "applied to TensorRT-LLM 0.21: not read" in trtllm_8b(version="0.21").overhead.assumptions[0]
