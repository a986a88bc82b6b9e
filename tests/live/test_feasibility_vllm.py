"""The feasibility verdict's startup condition against a real vLLM (CPU, 0.32): one request at
max_model_len must fit the pool less its null block, or vLLM refuses to start
(vllm/v1/core/kv_cache_utils.py `check_enough_kv_cache_memory`). The test bed's 2 MiB of KV is 32
blocks of 128 tokens: 31 usable, so 3,968 tokens start and 4,096 (the tiny model's context) do not."""

from __future__ import annotations

import json
import os
import subprocess

import pytest
from click.testing import CliRunner
from vllm_server import free_port, venv_python

from kvtune.cli import cli

pytestmark = pytest.mark.vllm
KV_BYTES = 2 * 1024**2


def capacity(*args: str):
    return CliRunner().invoke(cli, ["capacity", *args, "--json"])


def test_vllm_starts_at_the_length_kvtune_says_fits_and_refuses_one_block_more(vllm_factory, vllm_model_dir):
    server = vllm_factory(max_model_len=3968, kv_cache_memory_bytes=KV_BYTES)
    assert (server.num_blocks, server.block_size) == (32, 128)
    fits = capacity(str(vllm_model_dir), "--metrics-url", server.url, "--max-model-len", "3968")
    assert fits.exit_code == 0 and json.loads(fits.stdout)["fits"] is True
    too_long = capacity(str(vllm_model_dir), "--metrics-url", server.url, "--max-model-len", "4096")
    assert too_long.exit_code == 1
    assert json.loads(too_long.stdout)["why"].startswith(
        "vLLM would refuse to start: one request at max_model_len 4,096 needs 32 blocks of 128, the pool has 32 "
        "(31 usable beside the null block), so at most 3,968 tokens")
    # recommend renders the largest length the pool holds (the model's 4,096 does not fit): the one vLLM started at
    logs = str(vllm_model_dir.parent / "short.jsonl")
    with open(logs, "w") as f:
        for prompt, output in ((100, 50), (1000, 300), (3000, 500)):
            f.write(json.dumps({"route": "/v1/chat/completions", "prompt_tokens": prompt, "output_tokens": output,
                                "finish_reason": "stop"}) + "\n")
    # (the pool as a token count: /metrics would add the max_model_len this server was started at)
    result = CliRunner().invoke(cli, ["recommend", logs, "--model", str(vllm_model_dir), "--kv-tokens",
                                      str(server.kv_cache_tokens), "--block-size", str(server.block_size), "--json"])
    assert result.exit_code == 0, result.output
    mml = json.loads(result.stdout)["recommendation"]["settings"]["max_model_len"]
    assert (mml["value"], mml["rule"]) == (3968, "max-model-len-pool-holds")

    # and vLLM itself at 4,096: it refuses to start, naming 3,968 as the length that fits
    port = free_port()
    done = subprocess.run(
        [str(venv_python()), "-m", "vllm.entrypoints.openai.api_server", "--model", str(vllm_model_dir),
         "--load-format", "dummy", "--max-model-len", "4096", "--kv-cache-memory-bytes", str(KV_BYTES),
         "--enforce-eager", "--host", "127.0.0.1", "--port", str(port)],
        capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"})
    output = done.stdout + done.stderr
    assert done.returncode != 0, output[-3000:]
    assert "To serve at least one request with the model's max seq len (4096)" in output, output[-3000:]
    assert "the estimated maximum model length is 3968" in output, output[-3000:]
