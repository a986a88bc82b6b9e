"""`recommend --engine trtllm` names the served model's tokenizer by hub id in gateway.yaml, and
`kvtune gateway` loads it at start from the Hugging Face cache (a real cache layout in a tmp
HF_HOME, offline) and counts as it does from a local directory; missing, one line naming the fix
(issue #25, item 8)."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from conftest import CHAT_TEMPLATE, REPO

from kvtune.cli import cli
from kvtune.domain.route import Api
from kvtune.gateway.apis import read_request
from kvtune.gateway.counting import LocalTokenizerCounter

MODEL = "meta-llama/Llama-3.1-8B-Instruct"  # the checkpoint the sample logs name, which the files serve
SHA = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def rendered(tmp_path) -> Path:
    out = tmp_path / "deploy"
    r = CliRunner().invoke(cli, ["recommend", str(REPO / "sample_logs" / "openai_chat_pairs.jsonl"), "--model",
                                 "llama-3.1-8b", "--gpu", "H100-80GB", "--engine", "trtllm", "--out", str(out)])
    assert r.exit_code == 0, r.output
    assert f'tokenizer: "{MODEL}"' in (out / "gateway.yaml").read_text()
    return out


def _cache(hf_home: Path, tokenizer_json: Path) -> Path:
    """The Hugging Face hub cache's own layout: blobs, a snapshot of links to them, refs/main."""
    repo = hf_home / "hub" / f"models--{MODEL.replace('/', '--')}"
    snapshot = repo / "snapshots" / SHA
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir()
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(SHA)
    files = {"tokenizer.json": tokenizer_json.read_bytes(),
             "tokenizer_config.json": json.dumps({"chat_template": CHAT_TEMPLATE, "bos_token": "<s>"}).encode()}
    for name, data in files.items():
        blob = repo / "blobs" / f"blob-{name}"
        blob.write_bytes(data)
        (snapshot / name).symlink_to(Path("..") / ".." / "blobs" / blob.name)
    local = hf_home / "local"
    local.mkdir()
    for name, data in files.items():
        (local / name).write_bytes(data)
    return local


def _count(counter: LocalTokenizerCounter, api: Api, body: dict) -> tuple[int, ...]:
    """Count a body as the gateway does: read by its endpoint's rules, then counted."""
    return asyncio.run(counter.count(read_request(api, body).prompts, None)).tokens


def _gateway(config: Path, env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "kvtune", "gateway", "--config", str(config), "--host",
                             "127.0.0.1", "--port", "0"], stderr=subprocess.PIPE, text=True, env=env)


def test_a_tokenizer_missing_from_the_cache_is_one_line_naming_the_fix(rendered, tmp_path):
    env = {**os.environ, "HF_HOME": str(tmp_path / "empty"), "HF_HUB_OFFLINE": "1"}
    proc = _gateway(rendered / "gateway.yaml", env)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 2
    assert err.strip() == (
        f"Error: prompt_tokens.tokenizer: {MODEL} is not in the Hugging Face cache ({tmp_path / 'empty' / 'hub'}) "
        f"and the hub cannot be reached: run huggingface-cli download {MODEL} tokenizer.json tokenizer_config.json, "
        "or set prompt_tokens.tokenizer: to a local directory")


def test_the_cached_tokenizer_loads_at_start_and_counts_as_the_local_one(rendered, tmp_path, monkeypatch):
    from vllm_server import mistral_tokenizer_json

    hf_home = tmp_path / "hf"
    local = _cache(hf_home, mistral_tokenizer_json())
    monkeypatch.setenv("HF_HOME", str(hf_home))
    monkeypatch.setenv("HF_HUB_CACHE", str(hf_home / "hub"))
    import huggingface_hub.constants as constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hf_home / "hub"))
    by_id, by_dir = LocalTokenizerCounter.load(MODEL), LocalTokenizerCounter.load(str(local))
    texts = ["Hello, world!", "Ünïcödé — and emoji 🎉 in a longer prompt, with numbers 12345.", "a b c " * 50]
    bodies = [(Api.CHAT, {"messages": [{"role": "system", "content": texts[0]}, {"role": "user", "content": t}]})
              for t in texts] + [(Api.COMPLETIONS, {"prompt": texts}), (Api.RESPONSES, {"input": texts[1]})]
    counted = [_count(by_id, api, body) for api, body in bodies]
    assert counted == [_count(by_dir, api, body) for api, body in bodies]
    assert all(tokens and min(tokens) > 1 for tokens in counted)
    env = {**os.environ, "HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1"}
    proc = _gateway(rendered / "gateway.yaml", env)
    try:
        first = proc.stderr.readline()
        assert re.search(r"listening on http://127\.0\.0\.1:\d+", first), first + proc.stderr.read()
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(20)
        proc.stderr.close()
    assert proc.returncode == 0


def test_upstream_counting_for_an_engine_without_tokenize_is_refused_in_one_line(tmp_path):
    r = CliRunner().invoke(cli, ["recommend", str(REPO / "sample_logs" / "openai_chat_pairs.jsonl"), "--model",
                                 "llama-3.1-8b", "--gpu", "H100-80GB", "--engine", "trtllm", "--gateway-tokenizer",
                                 "upstream", "--out", str(tmp_path / "out")])
    assert r.exit_code == 2
    assert r.stderr.strip() == (
        "Error: --gateway-tokenizer: TensorRT-LLM's server has no /tokenize to count with: leave --gateway-tokenizer "
        "out (the served model's tokenizer, by its hub id) or give a model directory")
    assert not (tmp_path / "out").exists()
