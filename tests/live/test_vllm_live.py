"""The test bed itself against a real vLLM on CPU: its KV arithmetic and its token-counting rule.

Other live tests (calibrate, bench, gateway) trust these numbers, so they are checked against
what the server says, not against the fixture's own bookkeeping.
"""

from __future__ import annotations

import json
import urllib.request

import pytest
from click.testing import CliRunner
from conftest import REPO
from vllm_server import (
    cache_config_labels,
    chat_prompt_tokens,
    logged_kv_cache_tokens,
    sentencepiece_ids,
    synth_prompt,
)

from kvtune.cli import cli

pytestmark = pytest.mark.vllm


def _post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.load(response)


def test_default_server_has_the_worked_example_capacity(vllm_server_each_tokenizer):
    vllm_server = vllm_server_each_tokenizer  # the tokenizer (and its 32k embedding) changes no KV figure
    # vllm-facts.md §3: 2 layers × 2 kv heads × 32 dim × K+V × 2 B × 128 tokens = 65,536 B per block
    assert (vllm_server.block_size, vllm_server.num_blocks) == (128, 32)
    assert vllm_server.kv_cache_tokens == 4096
    assert "CPU KV cache size: 4,096 tokens, Maximum concurrency for 512 tokens per request: 8.00x" \
        in vllm_server.log_text()
    labels = cache_config_labels(vllm_server.metrics_text())
    assert labels["num_gpu_blocks"] == "32" and labels["block_size"] == "128"
    with urllib.request.urlopen(vllm_server.url + "/v1/models", timeout=10) as response:
        models = json.load(response)["data"]
    assert [(m["id"], m["max_model_len"]) for m in models] == [("tiny", 512)]


@pytest.mark.parametrize("vllm_tokenizer", ["word"], indirect=True)  # with the other word tests
def test_one_token_per_word_on_completions_and_chat(vllm_server_each_tokenizer):
    vllm_server = vllm_server_each_tokenizer
    prompt = synth_prompt(37)
    done = _post(vllm_server.url + "/v1/completions",
                 {"model": "tiny", "prompt": prompt, "max_tokens": 5, "ignore_eos": True})
    assert done["usage"]["prompt_tokens"] == 37
    assert done["usage"]["completion_tokens"] == 5
    messages = [{"role": "system", "content": synth_prompt(3)}, {"role": "user", "content": synth_prompt(11)}]
    chat = _post(vllm_server.url + "/v1/chat/completions",
                 {"model": "tiny", "messages": messages, "max_tokens": 4, "ignore_eos": True})
    assert chat["usage"]["prompt_tokens"] == chat_prompt_tokens(messages) == 1 + 5 + 13 + 1
    assert chat["usage"]["completion_tokens"] == 4


MISTRAL_TEXTS = ["hello world", "didn't the model's cache", "  two leading spaces", "tabs\tand\nnewlines\n\n",
                 "日本語のテキスト", "émoji 🤖 and ß", "12345 67.89 0x1F", "    indented code()", "a    b"]


@pytest.mark.parametrize("vllm_tokenizer", ["mistral-v1"], indirect=True)  # runs with the other mistral tests
def test_the_real_tokenizer_counts_as_sentencepiece_on_both_endpoints(vllm_server_each_tokenizer):
    """The served Mistral tokenizer is SentencePiece's: /tokenize gives <s> + its ids, and the
    server's usage counts the completions prompt and the [INST] template that way."""
    server = vllm_server_each_tokenizer
    system, user = "the model", "didn't  cache 日本 42"
    rendered = f" [INST] {system}\n\n{user} [/INST]"  # after <s>, as the template renders it
    truth = sentencepiece_ids([*MISTRAL_TEXTS, rendered])
    for text, ids in zip(MISTRAL_TEXTS, truth, strict=False):
        assert _post(server.url + "/tokenize", {"model": "tiny", "prompt": text})["tokens"] == [1, *ids], text
    done = _post(server.url + "/v1/completions",
                 {"model": "tiny", "prompt": MISTRAL_TEXTS[1], "max_tokens": 3, "ignore_eos": True})
    assert done["usage"]["prompt_tokens"] == 1 + len(truth[1])
    messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
    chat = _post(server.url + "/v1/chat/completions",
                 {"model": "tiny", "messages": messages, "max_tokens": 3, "ignore_eos": True})
    assert chat["usage"]["prompt_tokens"] == 1 + len(truth[-1])
    assert _post(server.url + "/tokenize", {"model": "tiny", "messages": messages})["tokens"] == [1, *truth[-1]]


def _calibrate(*args: str) -> dict:
    result = CliRunner().invoke(cli, ["calibrate", *args, "--json"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_calibrate_equals_what_the_server_logged_and_reports(vllm_server_each_tokenizer, tmp_path):
    vllm_server = vllm_server_each_tokenizer
    cap = tmp_path / "capacity.json"
    data = _calibrate(vllm_server.url, "--save", str(cap), "--vllm-log", str(vllm_server.log_path))
    logged = logged_kv_cache_tokens(vllm_server.log_text())
    labels = cache_config_labels(vllm_server.metrics_text())
    assert data["kv_cache_tokens"] == logged == int(labels["kv_cache_size_tokens"]) == 4096
    assert data["num_blocks"] == int(labels["num_gpu_blocks"]) == 32
    assert data["block_size"] == int(labels["block_size"]) == 128
    assert (data["model"], data["max_model_len"], data["source"], data["device"]) == ("tiny", 512, "metrics", "CPU")
    assert (data["kv_cache_memory_bytes"], data["enable_prefix_caching"]) == (2097152, True)
    assert json.loads(cap.read_text()) == data
    # the same through the /metrics URL, without the log
    assert {**_calibrate(vllm_server.url + "/metrics"), "device": "CPU"} == data

    # issue 25: this pool (31 usable blocks of 128 = 3,968 tokens) holds no request of
    # openai_chat_pairs.jsonl's longest (32,908 tokens): refused; logs it holds are recommended
    # the logs name other models; this bed serves the tiny model on purpose
    result = CliRunner().invoke(cli, ["recommend", str(REPO / "sample_logs" / "openai_chat_pairs.jsonl"),
                                      "--model", str(vllm_server.model_dir), "--served-model", str(vllm_server.model_dir),
                                      "--capacity", str(cap), "--json"],
                                catch_exceptions=False)
    assert result.exit_code == 1 and "vLLM would refuse to start" in result.stderr
    result = CliRunner().invoke(cli, ["recommend", str(REPO / "tests" / "data" / "logs" / "kvtune.jsonl"),
                                      "--model", str(vllm_server.model_dir), "--served-model", str(vllm_server.model_dir),
                                      "--capacity", str(cap), "--json"],
                                catch_exceptions=False)
    assert result.exit_code == 0, result.output
    rec = json.loads(result.stdout)["recommendation"]
    assert (rec["capacity"]["source"], rec["capacity"]["num_blocks"], rec["capacity"]["block_size"]) == ("metrics", 32, 128)
    assert rec["block_budget"]["value"] == 27  # floor((32 − 1 null block) × 0.9)


def test_num_gpu_blocks_override_replaces_the_profiled_count(vllm_factory):
    server = vllm_factory(max_model_len=512, num_gpu_blocks_override=8)
    assert (server.num_blocks, server.block_size) == (8, 128)
    log = server.log_text()
    assert "num_gpu_blocks_override=8" in log
    assert logged_kv_cache_tokens(log) == server.kv_cache_tokens == 8 * 128

    data = _calibrate(server.url, "--vllm-log", str(server.log_path))
    assert (data["num_blocks"], data["num_gpu_blocks_override"], data["kv_cache_tokens"]) == (8, 8, 1024)
