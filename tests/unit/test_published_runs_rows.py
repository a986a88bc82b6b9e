"""benchmarks/published_runs.py reads each published run from free text (the CSV keeps every cell
as its source printed it): which catalog GPU, which model config, which load and which pool. The
runs kept aside to judge the simulator are read by the same code, so a row of another GPU, model,
parallelism or load must become the simulation it describes, or an error row saying why — never a
silently different setup (a 40 GB A100 priced as the 80 GB one, a Poisson load sent at t = 0, an
FP8 checkpoint priced at 16 bits)."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
from script_module import load_script

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "published_runs.py"
runs = load_script(SCRIPT)
COLUMNS = ("case_id gpu num_gpus tp vllm_version model dtype_quant kv_cache_dtype max_model_len max_num_seqs "
           "max_num_batched_tokens gpu_memory_utilization kv_cache_size dataset input_len output_len num_prompts "
           "request_rate max_concurrency bench_cmd total_input_tokens total_output_tokens ttft_mean_ms ttft_median_ms").split()


def row(**cells: str) -> dict[str, str]:
    return dict.fromkeys(COLUMNS, "") | {"case_id": "X", "num_prompts": "100", "request_rate": "inf"} | cells


@pytest.mark.parametrize(("text", "gpu"), [
    ("H100 SXM 80GB", "H100-80GB"),
    ("H100 (implied: 'All Hopper experiments run on a single H100 GPU')", "H100-80GB"),
    ("A100 80GB (form factor not stated)", "A100-80GB"),
    ("NVIDIA A100-SXM4-40GB", "A100-40GB"),  # nvidia-smi's name: the 40 GB part, not the first A100
    ("A100 SXM4 40GB", "A100-40GB"),
    ("H200 141GB", "H200"),
    ("NVIDIA H100 PCIe", "H100-PCIe"),
    ("RTX 4090 24GB (meta.json hardware.device_name 'NVIDIA GeForce RTX 4090', 25,250,627,584 B)", "RTX-4090"),
    ("RTX PRO 6000 (Blackwell, 96 GB per the simulator config)", "RTX-PRO-6000"),
    ("AMD Instinct MI300X", "MI300X"),
    ("NVIDIA L40S", "L40S"),
])
def test_a_gpu_cell_names_its_catalog_entry(text, gpu):
    assert runs.gpu_name(text) == gpu


@pytest.mark.parametrize("text", ["Tesla T4", "H100 NVL 94GB"])
def test_a_gpu_the_catalog_lacks_is_an_error_not_another_gpu(text):
    with pytest.raises(LookupError, match="no catalog"):
        runs.gpu_name(text)


@pytest.mark.parametrize(("model", "quant", "source", "method"), [
    ("Qwen/Qwen3-8B", "bf16", "Qwen/Qwen3-8B", None),  # the checkpoint's own config, shipped by aiconfigurator
    ("meta-llama/Llama-3.1-70B-Instruct", "bf16", "llama-3.1-70b", None),
    ("meta-llama/Llama-3.3-70B-Instruct", "bf16", "llama-3.1-70b", None),  # the same layers
    ("mistralai/Mistral-7B-Instruct-v0.1", "bf16", "mistral-7b", None),
    ("google/gemma-2-9b-it", "bf16", "gemma-2-9b", None),
    ("nvidia/Llama-3.1-70B-Instruct-FP8", "fp8", "nvidia/Llama-3.1-70B-Instruct-FP8", None),  # its own ModelOpt file
    ("neuralmagic/Meta-Llama-3.1-70B-Instruct-FP8", "fp8 (W8A8)", "*.json", "fp8"),
    ("Qwen/Qwen3-8B-AWQ", "AWQ int4", "*.json", "awq"),
])
def test_a_model_cell_becomes_a_config_with_its_weights_format(tmp_path, model, quant, source, method):
    pytest.importorskip("aiconfigurator_core")
    found, how = runs.model_source(row(model=model, dtype_quant=quant), tmp_path)
    if method is None:
        assert found == source, how
    else:  # a preset's layers with the quantization_config vLLM would read from that checkpoint
        assert found.endswith(".json") and Path(found).parent == tmp_path, how
        assert json.loads(Path(found).read_text())["quantization_config"]["quant_method"] == method


def test_a_model_with_no_config_here_is_an_error_row(tmp_path, monkeypatch):
    import huggingface_hub.constants as hf_constants

    monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(LookupError, match="no config for model 'acme/unknown-7b'"):
        runs.model_source(row(model="acme/unknown-7b"), tmp_path)


def test_loads_are_the_printed_ones(tmp_path):
    at_once = runs.workload(runs.Case(row(dataset="random", input_len="1024", output_len="128")), tmp_path)
    assert at_once[1] == ["--replay"]
    assert all(json.loads(line)["timestamp_s"] == 0.0 for line in at_once[0].read_text().splitlines())
    poisson = runs.workload(runs.Case(row(dataset="random", input_len="1024", output_len="128",
                                          request_rate="0.5 (Poisson)")), tmp_path)
    assert poisson[1] == ["--rate", "0.5", "--requests", "100"]
    gamma = runs.workload(runs.Case(row(dataset="random", input_len="1024", output_len="128", request_rate="4",
                                        bench_cmd="vllm bench serve --request-rate 4 --burstiness 0.5")), tmp_path)
    assert gamma[1] == ["--rate", "4.0", "--requests", "100", "--burstiness", "0.5"]
    closed = runs.workload(runs.Case(row(dataset="random", input_len="1024", output_len="128",
                                         max_concurrency="16")), tmp_path)
    assert closed[1] == ["--concurrency", "16", "--requests", "100"]


def test_lengths_follow_the_printed_totals_else_the_nominal_lengths_and_their_spread():
    totals = runs.Case(row(dataset="random", input_len="2000", output_len="100", num_prompts="500",
                           total_input_tokens="998175", total_output_tokens="50000"))
    assert set(runs.lengths(totals)) == {(1996, 100)}
    spread = runs.lengths(runs.Case(row(dataset="random", input_len="1024", output_len="128",
                                        bench_cmd="vllm bench serve --random-range-ratio 0.5")))
    prompts = [p for p, _ in spread]
    assert 512 <= min(prompts) < 700 and 1350 < max(prompts) <= 1536
    blog = runs.lengths(runs.Case(row(dataset="random (±15% length variance)", input_len="~20000 (±15%)",
                                      output_len="~2000 (±15%)")))
    assert all(17000 <= p <= 23000 and 1700 <= o <= 2300 for p, o in blog)
    with pytest.raises(LookupError, match="no prompt/output lengths"):
        runs.lengths(runs.Case(row(dataset="sonnet")))


def test_setup_cells_become_engine_options():
    options, pool = runs.capacity_options(runs.Case(row(
        tp="2", max_model_len="model default (131072)", kv_cache_dtype="fp8 (E4M3)", max_num_seqs="256",
        max_num_batched_tokens="2,048", kv_cache_size="GPU KV cache size: 321,520 tokens")), "llama-3.1-8b")
    assert options == ["--tp", "2", "--max-model-len", "131072", "--kv-cache-dtype", "fp8", "--max-num-seqs", "256",
                       "--max-num-batched-tokens", "2048", "--kv-tokens", "321520"]
    assert pool == "published (321,520 tokens)"
    options, pool = runs.capacity_options(runs.Case(row(gpu_memory_utilization="0.95 (set)")), "llama-3.1-8b")
    assert (options, pool) == (["--gpu-memory-utilization", "0.95"], "kvtune estimate")


def given_cases() -> list:
    """The runs of ../shared/validation (skips where it or aiconfigurator-core is not here)."""
    pytest.importorskip("aiconfigurator_core")
    path = runs.VALIDATION / "published-vllm-runs.csv"
    if not path.is_file():
        pytest.skip(f"{path} is not here")
    with path.open() as f:
        return [runs.Case(r) for r in csv.DictReader(f)]


def test_every_given_run_reads_to_a_setup(tmp_path):
    """The 17 runs of ../shared/validation each resolve to a GPU, a model and a load."""
    cases = given_cases()
    assert len(cases) >= 17
    for case in cases:
        assert case.gpu
        assert runs.model_source(case.row, tmp_path)[0]
        assert runs.workload(case, tmp_path)[1]


def test_a_trace_workload_replays_its_trace_and_another_trace_is_an_error_row(tmp_path):
    dataset = ("other: ShareGPT-derived trace (workloads/sharegpt-llama-3.1-8b-300-sps10.jsonl; shibing624/"
               "sharegpt_gpt4, min input 256, min output 512)")
    log, load = runs.workload(runs.Case(row(case_id="LSS-X", dataset=dataset, input_len="per request (in "
                                            "requests.jsonl)", request_rate="10 (Poisson)")), tmp_path)
    assert (log.name, load) == ("llmss_4090_replay.jsonl", ["--replay"])
    with pytest.raises(LookupError, match="no trace here"):
        runs.workload(runs.Case(row(dataset="other: trace (workloads/another.jsonl)",
                                    input_len="per request (in requests.jsonl)")), tmp_path)


def test_a_pool_printed_in_gib_becomes_whole_blocks_of_the_models_kv():
    case = runs.Case(row(tp="2", kv_cache_dtype="fp8", kv_cache_size="Available KV cache memory: 40.5 GiB"))
    options, pool = runs.capacity_options(case, "llama-3.1-70b")
    # Llama-3.1-70B: 80 layers × 8 KV heads × 128 × 2 (K and V) × 1 B (fp8) ÷ TP 2 = 81,920 B per token
    assert options[-2:] == ["--num-gpu-blocks", str(int(40.5 * 2**30 // (16 * 81_920)))]
    assert pool == f"published (40.5 GiB = {int(40.5 * 2**30 // (16 * 81_920))} × 16)"


def test_a_run_without_num_prompts_sends_its_successful_requests():
    case = runs.Case(row(num_prompts="", successful_requests="250", dataset="random", input_len="512",
                         output_len="64"))
    assert len(runs.lengths(case)) == 250


def test_a_run_over_more_gpus_than_its_tp_is_an_error_row_not_one_engine(tmp_path):
    result = runs.simulate(runs.Case(row(gpu="H100 SXM 80GB", num_gpus="8", tp="4", model="Qwen/Qwen3-8B",
                                         dataset="random", input_len="512", output_len="64")), tmp_path)
    assert result["error"] == "8 GPUs at TP 4: a run over several engines (data or pipeline parallel) is not replayed"


def test_a_16_bit_checkpoint_served_quantized_is_priced_at_its_served_format(tmp_path):
    """`vllm serve Qwen/Qwen3-8B --quantization fp8` quantizes the bf16 checkpoint as it loads: the
    checkpoint's own config (aiconfigurator-core's copy) gets the fp8 quantization_config."""
    pytest.importorskip("aiconfigurator_core")
    found, how = runs.model_source(row(model="Qwen/Qwen3-8B", dtype_quant="fp8 (--quantization fp8)"), tmp_path)
    assert json.loads(Path(found).read_text())["quantization_config"]["quant_method"] == "fp8", how
    assert json.loads(Path(found).read_text())["num_hidden_layers"] == 36


def test_the_ttft_floor_is_every_earlier_prompts_linear_layers_at_the_gpus_peak():
    """N prompts sent at once, served first come first served: the mean TTFT is at least
    (N + 1) / 2 prompts' prefill, each token 2 FLOPs per linear-layer parameter at the peak."""
    from kvtune.hardware import find_gpu
    from kvtune.model.sources import resolve_model
    from kvtune.weights import count_parameters

    case = runs.Case(row(gpu="H100 SXM 80GB", dataset="random", input_len="1000", output_len="10", num_prompts="3"))
    count = count_parameters(resolve_model("llama-3.1-8b"))
    linear = count.total - count.embedding - count.lm_head - count.norms
    assert 6.9e9 < linear < 7.0e9  # Llama-3.1-8B's 32 layers of attention and MLP projections
    expected = 2 * 1000 * 2 * linear / find_gpu("H100-80GB").bf16_dense_flops * 1000
    assert runs.ttft_floor_ms(case, "llama-3.1-8b") == pytest.approx(expected)
    two_gpus = runs.Case(case.row | {"tp": "2"})
    assert runs.ttft_floor_ms(two_gpus, "llama-3.1-8b") == pytest.approx(expected / 2)
    # a request of a closed loop or an open one waits for no earlier prompt: no floor worth stating
    assert runs.ttft_floor_ms(runs.Case(case.row | {"max_concurrency": "8"}), "llama-3.1-8b") is None
    assert runs.ttft_floor_ms(runs.Case(case.row | {"request_rate": "2.5"}), "llama-3.1-8b") is None


def test_a_row_whose_published_ttft_is_under_its_floor_says_the_run_was_not_its_setup():
    case = runs.Case(row(gpu="A100 80GB", dataset="random", input_len="1000", output_len="10", num_prompts="3",
                         ttft_mean_ms="50"))
    floor = runs.ttft_floor_ms(case, "llama-3.1-8b")
    assert floor is not None and floor > 50  # 89 ms: 2 prompts of 1,000 tokens at 312 TFLOP/s
    why = runs.beyond_setup(case, floor)
    assert why is not None and "published mean TTFT 50 ms" in why and "A100-80GB" in why
    assert runs.beyond_setup(runs.Case(case.row | {"ttft_mean_ms": f"{floor * 1.01}"}), floor) is None
    # a median is not held to a floor on the mean
    assert runs.beyond_setup(runs.Case(case.row | {"ttft_mean_ms": "", "ttft_median_ms": "100"}), floor) is None


def test_of_the_given_runs_only_the_a100s_ttft_is_beyond_its_stated_setup(tmp_path):
    """GSREF-Q8-A100-bf16 publishes a mean TTFT of 3.41 s for 1,000 ShareGPT prompts sent at once to
    Qwen3-8B on one A100: their linear layers alone need 4.7 s on average at its 312 TFLOP/s peak."""
    cases = given_cases()
    beyond = [c.id for c in cases if runs.beyond_setup(c, runs.ttft_floor_ms(c, runs.model_source(c.row, tmp_path)[0]))]
    assert beyond == ["GSREF-Q8-A100-bf16"]
