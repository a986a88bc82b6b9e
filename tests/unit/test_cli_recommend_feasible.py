"""Issue 25 items 1 and 11: `kvtune recommend` refuses, and writes nothing, when the deployment
cannot serve the logged traffic, says what would fix it, and renders the model's context as
max_model_len unless the pool cannot hold it or --max-model-len is given."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvtune.cli import cli

ROOT = Path(__file__).parents[2]
# the sample logs name meta-llama/Llama-3.1-8B-Instruct: serving the 70B on them is another checkpoint, said so
LLAMA_70B = ["--model", "llama-3.1-70b", "--served-model", "meta-llama/Llama-3.1-70B-Instruct"]
SAMPLE = str(ROOT / "sample_logs")
SHORT = str(ROOT / "tests" / "data" / "logs" / "kvtune.jsonl")  # short requests only


def recommend(*args: str):
    return CliRunner().invoke(cli, ["recommend", *args])


def rec_json(*args: str) -> dict:
    result = recommend(*args, "--json")
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)["recommendation"]


def test_llama_70b_on_two_h100s_is_refused_with_fp8_and_the_smallest_tp_that_fit(tmp_path):
    out = tmp_path / "d"
    result = recommend(SAMPLE, *LLAMA_70B, "--gpu", "H100-80GB", "--tp", "2", "--out", str(out))
    assert result.exit_code == 1
    assert not out.exists()
    assert result.stderr.splitlines() == [
        "Error: this deployment cannot serve the logged traffic: vLLM would refuse to start: one request at "
        "max_model_len 131,072 needs 8,192 blocks of 16, the pool has 1,585 (1,584 usable beside the null block), "
        "so at most 25,344 tokens",
        "Fix: fits with --kv-cache-dtype fp8 (pool 3,171 blocks); or --tp 4 (pool 24,730 blocks)",
        "Nothing was written.",
    ]
    # the fix is right: fp8 KV at tp 2 holds the longest logged request (32,885 tokens) in 3,170 usable blocks,
    # and so does tp 4; tp 3 is not a split the model takes, so 4 is the smallest larger one
    fp8 = recommend(SAMPLE, *LLAMA_70B, "--gpu", "H100-80GB", "--tp", "2", "--kv-cache-dtype", "fp8",
                    "--out", str(out))
    assert fp8.exit_code == 0, fp8.output
    assert "--max-model-len 50720" in (out / "vllm-serve.sh").read_text()  # (3,171 − 1) × 16
    assert recommend(SAMPLE, *LLAMA_70B, "--gpu", "H100-80GB", "--tp", "4", "--out",
                     str(tmp_path / "tp4")).exit_code == 0


def test_json_carries_the_verdict_and_no_files():
    result = recommend(SAMPLE, *LLAMA_70B, "--gpu", "H100-80GB", "--tp", "2", "--json")
    assert result.exit_code == 1
    d = json.loads(result.stdout)
    assert d["files"] == {}
    v = d["recommendation"]["feasibility"]
    assert v["fits"] is False and v["reasons"][0]["code"] == "engine-refuses-start"
    assert v["pool_blocks"] == 1585 and v["longest_held_tokens"] == 1584 * 16
    assert v["longest_request_tokens"] == 32885
    assert v["fix"] == "fits with --kv-cache-dtype fp8 (pool 3,171 blocks); or --tp 4 (pool 24,730 blocks)"
    assert d["error"] == v["why"]


def test_a_measured_pool_of_40000_tokens_holds_the_logs_so_the_largest_length_it_holds_is_rendered(tmp_path):
    """--kv-tokens 40000 holds the longest logged request (32,885 tokens): feasible, and max_model_len is
    the largest length vLLM starts with, (2,500 blocks − 1 null block) × 16, not the model's 131,072."""
    result = recommend(SAMPLE, *LLAMA_70B, "--kv-tokens", "40000", "--out", str(tmp_path))
    assert result.exit_code == 0, result.output
    script = (tmp_path / "vllm-serve.sh").read_text()
    assert "--max-model-len 39984" in script
    rec = json.loads((tmp_path / "recommendation.json").read_text())
    assert rec["settings"]["max_model_len"]["rule"] == "max-model-len-pool-holds"
    assert rec["feasibility"]["fits"] is True
    assert not any("refuse to start" in n for n in rec["notes"])


def test_a_measured_pool_below_the_longest_request_is_refused_with_the_estimated_fix(tmp_path):
    result = recommend(SAMPLE, *LLAMA_70B, "--kv-tokens", "30000", "--gpu", "H100-80GB", "--tp", "2",
                       "--out", str(tmp_path / "d"))
    assert result.exit_code == 1 and not (tmp_path / "d").exists()
    assert ("Fix: fits with --kv-cache-dtype fp8 (pool 3,171 blocks) by the estimate: measure it there; "
            "or --tp 4 (pool 24,730 blocks) by the estimate: measure it there") in result.stderr
    # without a GPU to estimate another pool with, the pool the logs need
    result = recommend(SAMPLE, *LLAMA_70B, "--kv-tokens", "30000")
    assert result.exit_code == 1
    assert ("Fix: needs a KV pool that holds the longest logged prompt + cap (32,885 tokens, the pool holds 29,984)"
            in result.stderr)


def test_a_given_max_model_len_the_pool_cannot_hold_is_refused_with_one_that_fits(tmp_path):
    args = [SAMPLE, *LLAMA_70B, "--kv-tokens", "40000"]
    result = recommend(*args, "--max-model-len", "131072", "--out", str(tmp_path / "d"))
    assert result.exit_code == 1 and not (tmp_path / "d").exists()
    assert "Fix: fits with --max-model-len 39984" in result.stderr
    rec = rec_json(*args, "--max-model-len", "39984")
    assert rec["settings"]["max_model_len"]["value"] == 39984
    assert rec["settings"]["max_model_len"]["rule"] == "max-model-len-given"


def test_qwen3_8b_renders_its_context_when_the_logs_are_short(tmp_path):
    """Item 11: vLLM V1 allocates blocks on demand, so max_model_len is the model's 40,960, not the
    longest logged request; --max-model-len is honoured."""
    qwen = ["--model", "qwen3-8b", "--served-model", "Qwen/Qwen3-8B"]  # the log names llama-3.1-8b
    result = recommend(SHORT, *qwen, "--gpu", "H100-80GB", "--out", str(tmp_path))
    assert result.exit_code == 0, result.output
    assert "--max-model-len 40960" in (tmp_path / "vllm-serve.sh").read_text()
    rec = json.loads((tmp_path / "recommendation.json").read_text())
    mml = rec["settings"]["max_model_len"]
    assert mml["value"] == 40960 and mml["rule"] == "max-model-len-model-context"
    assert "vllm/v1/core/kv_cache_manager.py" in mml["reason"]
    given = rec_json(SHORT, *qwen, "--gpu", "H100-80GB", "--max-model-len", "16384")
    assert given["settings"]["max_model_len"]["value"] == 16384
    assert given["settings"]["max_model_len"]["rule"] == "max-model-len-given"


@pytest.mark.parametrize("engine", ["sglang", "trtllm"])
def test_other_engines_are_refused_when_the_pool_is_below_the_longest_request(engine, tmp_path, tokenizer_dir):
    result = recommend(SAMPLE, *LLAMA_70B, "--engine", engine, "--kv-tokens", "20000",
                       "--gateway-tokenizer", tokenizer_dir if engine == "trtllm" else "upstream",
                       "--out", str(tmp_path / "d"))
    assert result.exit_code == 1 and not (tmp_path / "d").exists()
    assert "starts but" in result.stderr.splitlines()[0]
    assert result.stderr.splitlines()[1].startswith("Fix: needs a KV pool that holds the longest logged prompt")


def test_sglang_renders_the_context_its_pool_holds(tmp_path):
    result = recommend(SAMPLE, *LLAMA_70B, "--engine", "sglang", "--kv-tokens", "40000",
                       "--out", str(tmp_path))
    assert result.exit_code == 0, result.output
    assert "--context-length 40000" in (tmp_path / "sglang-serve.sh").read_text()


# --- the class: recommend never exits 0 with a deployment that cannot serve the logged traffic ---

MODELS = ["llama-3.1-8b", "llama-3.1-70b", "qwen3-8b", "qwen3-32b", "mistral-7b", "gemma-2-9b"]
GPUS = ["L4", "L40S", "A100-40GB", "H100-80GB"]


@pytest.fixture(scope="module")
def profile(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("p") / "profile.json"
    result = CliRunner().invoke(cli, ["profile", SAMPLE, "--save", str(path)])
    assert result.exit_code == 0, result.output
    return str(path)


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> str:
    """A model directory the gateway counts with (TensorRT-LLM has no /tokenize)."""
    from tokenizers import Tokenizer, models

    path = tmp_path_factory.mktemp("tok")
    Tokenizer(models.WordLevel({"<unk>": 0, "hi": 1}, unk_token="<unk>")).save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages[0]['content'] }}"}))
    return str(path)


def test_trtllm_keeps_max_seq_len_to_the_longest_request(tmp_path, tokenizer_dir):
    """GUARANTEED_NO_EVICT reserves max_seq_len − prompt for a request without max_tokens: the window
    stays the longest logged request (32,885 → 32,896 in 32-token blocks), not the model's 131,072."""
    result = recommend(SAMPLE, "--model", "llama-3.1-8b", "--gpu", "H100-80GB", "--engine", "trtllm",
                       "--gateway-tokenizer", tokenizer_dir, "--out", str(tmp_path))
    assert result.exit_code == 0, result.output
    assert "--max_seq_len 32896" in (tmp_path / "trtllm-serve.sh").read_text()
    rec = json.loads((tmp_path / "recommendation.json").read_text())
    assert rec["settings"]["max_model_len"]["rule"] == "max-seq-len-longest-request"


@pytest.mark.parametrize("engine", ["vllm", "sglang", "trtllm"])
@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("gpu", GPUS)
@pytest.mark.parametrize("model", MODELS)
def test_exit_0_only_when_the_deployment_serves_the_logged_traffic(profile, tokenizer_dir, model, gpu, tp, engine):
    # --served-model: the sample logs name Llama-3.1-8B-Instruct, each model here is served on its traffic
    result = recommend(profile, "--model", model, "--served-model", f"served/{model}", "--gpu", gpu, "--tp", str(tp),
                       "--engine", engine,
                       "--gateway-tokenizer", tokenizer_dir if engine == "trtllm" else "upstream", "--json")
    if result.exit_code == 2:  # the weights do not fit at all: a capacity error, nothing recommended
        assert result.stderr.startswith("Error: ") and len(result.stderr.strip().splitlines()) == 1
        return
    d = json.loads(result.stdout)
    rec = d["recommendation"]
    v = rec["feasibility"]
    pool, block = rec["capacity"]["num_blocks"], rec["capacity"]["block_size"]
    mml = rec["settings"]["max_model_len"]["value"]
    held = (pool - 1) * block if engine == "vllm" else pool * block
    serves = (mml <= held and v["smallest_reservation_blocks"] <= rec["block_budget"]["value"] <= pool - 1
              and v["longest_request_tokens"] <= held)
    assert result.exit_code == (0 if serves else 1), (result.stderr, v)
    if serves:
        assert d["files"] and v["fits"] is True
    else:
        assert d["files"] == {} and v["fits"] is False and v["fix"]
        assert result.stderr.splitlines()[1].startswith("Fix: ")


def test_objective_search_is_refused_before_any_simulation(tmp_path):
    """--objective on a measured pool (the CPU test bed's 32 blocks of 128 tokens) that holds no
    request of the logs' longest 32,885 tokens: every row would share that pool, so exit 1, nothing
    written (main wrote the files with exit 0)."""
    capacity = str(ROOT / "tests" / "data" / "capacity-cpu-0.32-timing.json")
    result = recommend(SAMPLE, "--model", "llama-3.1-8b", "--capacity", capacity, "--objective", "throughput",
                       "--out", str(tmp_path / "d"))
    assert result.exit_code == 1 and not (tmp_path / "d").exists()
    assert result.stderr.splitlines()[1] == (
        "Fix: needs a KV pool that holds the longest logged prompt + cap (32,885 tokens, the pool holds 3,968): "
        "more GPUs (--tp), a larger GPU or fp8 KV (--kv-cache-dtype fp8)")
