"""Bundled presets: enough of them, each a public config with its source, each sizeable."""

from __future__ import annotations

import json

import pytest

from kvtune.kv import kv_bytes
from kvtune.model import PRESETS_DIR, load_config_file, preset_names, resolve_model
from tests.conftest import CONFIGS

# preset → the shared real config it was copied from (values must stay identical)
COPIED_FROM_SHARED = {
    "llama-2-7b": "Llama-2-7b-hf.json", "llama-3.1-8b": "Llama-3.1-8B.json", "mistral-7b": "Mistral-7B-v0.1.json",
    "phi-3-mini": "Phi-3-mini-4k-instruct.json", "qwen2-7b": "Qwen2-7B-Instruct.json", "qwen3-8b": "Qwen3-8B.json",
    "gemma-2-9b": "gemma-2-9b-it.json", "gemma-3-27b": "gemma-3-27b-it.json", "gpt-oss-20b": "gpt-oss-20b.json",
    "deepseek-v3": "DeepSeek-V3.json", "jamba-1.5-mini": "AI21-Jamba-1.5-Mini.json",
}


def test_at_least_fifteen_presets_across_families():
    names = preset_names()
    assert len(names) >= 15
    attention = {kv_bytes(resolve_model(n)).attention for n in names}
    assert attention == {"mha", "gqa", "mla", "hybrid"}


@pytest.mark.parametrize("name", preset_names())
def test_preset_names_its_source_and_parses(name):
    raw = load_config_file(PRESETS_DIR / f"{name}.json")
    assert isinstance(raw.get("_source"), str) and "/" in raw["_source"].split()[0]
    result = kv_bytes(resolve_model(name))
    assert result.kv_bytes_per_token > 0 and result.model == name


@pytest.mark.parametrize("name,filename", sorted(COPIED_FROM_SHARED.items()))
def test_preset_equals_the_shared_config(name, filename):
    preset = load_config_file(PRESETS_DIR / f"{name}.json")
    preset.pop("_source")
    assert preset == json.loads((CONFIGS / filename).read_text())


def test_preset_names_are_case_insensitive():
    assert resolve_model("Llama-3.1-70B") == resolve_model("llama-3.1-70b")


@pytest.mark.parametrize(
    "name,expected",
    [
        ("llama-3.1-70b", 327680),  # 80 layers × 8 kv heads × (128+128) × 2 B
        ("llama-3.1-405b", 516096),  # 126 × 8 × 256 × 2
        ("mixtral-8x7b", 131072),  # 32 × 8 × 256 × 2
        ("qwen3-30b-a3b", 98304),  # 48 × 4 × 256 × 2
        ("qwen3-32b", 262144),  # 64 × 8 × 256 × 2
        ("gpt-oss-120b", 73728),  # 36 × 8 × (64+64) × 2
        ("llama-4-scout", 196608),  # 48 × 8 × 256 × 2 (36 chunked + 12 full)
        ("kimi-k2", 70272),  # MLA: 61 × (512+64) × 2
        ("nemotron-h-56b", 40960),  # 10 attention layers ('*') × 8 × 256 × 2
        ("qwen3.5-27b", 65536),  # 16 full-attention layers × 4 × (256+256) × 2
    ],
)
def test_preset_bytes_per_token(name, expected):
    assert kv_bytes(resolve_model(name)).kv_bytes_per_token == expected


def test_qwen3_5_linear_attention_state():
    result = kv_bytes(resolve_model("qwen3.5-27b"))
    # gated delta net layer: conv (4−1) × (128·16·2 + 128·48) = 3 × 10240 elements × 2 B = 61440;
    # recurrent state 48 × 128 × 128 × 4 B (mamba_ssm_dtype float32) = 3145728; 48 layers × 3207168 = 153944064
    assert result.state_bytes_per_sequence == 153944064
