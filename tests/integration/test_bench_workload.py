"""Workload drawing (exact marginals, joint cells) and prompts of exact token length."""

from __future__ import annotations

import asyncio

import aiohttp
import numpy as np
import pytest
from fake_vllm import TEMPLATED, FakeVllm

from kvtune.bench.prompts import (
    CALIBRATION_MAX_CALLS,
    GROUP_SIZE,
    LEADS,
    SAMPLE_UNITS,
    calibrate_prompts,
    check_prompts,
)
from kvtune.errors import KvtuneError
from kvtune.profile.histogram import Histogram, JointHistogram, joint_bin
from kvtune.profile.routes import CensoredHistogram, Profile, RouteProfile
from kvtune.workload.draw import WORDS, PairSampler, PromptSynth, Workload


def route(name: str, prompts, outputs, *, joint: bool = True, censored=None) -> RouteProfile:
    prompts, outputs = np.asarray(prompts), np.asarray(outputs)
    j = JointHistogram(joint_bin(prompts), joint_bin(outputs), np.ones(prompts.size, np.int64)) if joint \
        else JointHistogram.empty()
    return RouteProfile(
        route=name,
        output=CensoredHistogram.of(outputs, np.zeros(outputs.size, bool) if censored is None else censored),
        total=CensoredHistogram.empty(), prompt=Histogram.of(prompts), max_tokens=Histogram.empty(),
        joint=j, finish_reasons={}, models={})


def frequencies(values: np.ndarray) -> dict[int, float]:
    v, c = np.unique(values, return_counts=True)
    return dict(zip(v.tolist(), (c / values.size).tolist(), strict=True))


def assert_marginal(drawn: np.ndarray, h: Histogram):
    """Every value's frequency within 5 binomial σ of its share in the histogram."""
    n = drawn.size
    got = frequencies(drawn)
    assert set(got) <= set(h.values.tolist())
    for v, c in zip(h.values.tolist(), h.counts.tolist(), strict=True):
        p = c / h.total
        assert abs(got.get(v, 0.0) - p) <= 5 * np.sqrt(p * (1 - p) / n) + 1e-9, (v, got.get(v), p)


@pytest.mark.parametrize("joint", [True, False])
def test_marginals_are_the_profile_s(joint):
    rng = np.random.default_rng(0)
    prompts = rng.integers(1, 3000, 400)
    outputs = rng.geometric(0.01, 400)
    r = route("a", prompts, outputs, joint=joint)
    p, o = PairSampler(r).draw(np.random.default_rng(1), 200_000)
    assert_marginal(p, r.prompt)
    assert_marginal(o, r.output.observed)


def test_joint_draws_keep_the_correlation():
    # short prompts get long answers and the reverse: independent draws would mix them
    prompts = [10] * 50 + [1000] * 50
    outputs = [900] * 50 + [5] * 50
    r = route("a", prompts, outputs)
    p, o = PairSampler(r).draw(np.random.default_rng(2), 10_000)
    assert set(zip(p.tolist(), o.tolist(), strict=True)) == {(10, 900), (1000, 5)}
    independent = route("b", prompts, outputs, joint=False)
    p, o = PairSampler(independent).draw(np.random.default_rng(2), 10_000)
    assert (10, 5) in set(zip(p.tolist(), o.tolist(), strict=True))


def test_joint_cells_are_drawn_by_count_and_values_stay_in_their_cell():
    rng = np.random.default_rng(3)
    prompts = rng.integers(1, 500, 1000)
    outputs = np.maximum(1, prompts // 3 + rng.integers(0, 5, 1000))  # strongly correlated
    r = route("a", prompts, outputs)
    p, o = PairSampler(r).draw(np.random.default_rng(4), 50_000)
    cells = set(zip(r.joint.prompt_bins.tolist(), r.joint.output_bins.tolist(), strict=True))
    drawn_cells = set(zip(joint_bin(p).tolist(), joint_bin(o).tolist(), strict=False))
    assert drawn_cells <= cells
    assert np.corrcoef(p, o)[0, 1] > 0.9


def test_censored_outputs_are_drawn_at_their_logged_length():
    r = route("a", [100, 100], [50, 400], censored=[False, True])
    _, o = PairSampler(r).draw(np.random.default_rng(5), 1000)
    assert set(o.tolist()) == {50, 400}


def synth(max_model_len=None, overhead=1) -> PromptSynth:
    return PromptSynth(WORDS, overhead, "tokenize", max_model_len)


def test_workload_mixes_routes_by_share_and_is_reproducible():
    profile = Profile(routes=(route("a", [100] * 30, [10] * 30), route("b", [200] * 10, [20] * 10)))
    w = Workload.from_profile(profile, [], synth(), seed=7)
    specs = [w.spec(i) for i in range(4000)]
    share_a = sum(s.route == "a" for s in specs) / len(specs)
    assert share_a == pytest.approx(0.75, abs=0.03)
    assert all((s.prompt_tokens, s.output_tokens) == ((100, 10) if s.route == "a" else (200, 20)) for s in specs)
    again = Workload.from_profile(profile, [], synth(), seed=7)
    assert [again.spec(i) for i in range(50)] == specs[:50]
    only_b = Workload.from_profile(profile, ["b"], synth(), seed=7)
    assert {only_b.spec(i).route for i in range(100)} == {"b"}


def test_prompt_text_has_the_word_count_for_its_tokens():
    s = synth(overhead=4)
    text = s.text(50, np.random.default_rng(0))
    assert len(text.split()) == 46 and set(text.split()) <= set(WORDS)


def test_draws_are_clamped_to_the_server_and_counted():
    profile = Profile(routes=(route("a", [3000], [3000]),))
    w = Workload.from_profile(profile, [], synth(max_model_len=4096), seed=0)
    s = w.spec(0)
    assert (s.prompt_tokens, s.output_tokens) == (3000, 1096)
    assert w.clamped == {"output_over_max_model_len": 1}
    w = Workload.from_profile(Profile(routes=(route("a", [5000], [0]),)), [], synth(max_model_len=4096), seed=0)
    s = w.spec(0)
    assert (s.prompt_tokens, s.output_tokens) == (4095, 1)
    assert w.clamped == {"output_zero": 1, "prompt_over_max_model_len": 1}


def test_route_selection_errors():
    profile = Profile(routes=(route("a", [1], [1]),))
    with pytest.raises(KvtuneError, match="no route 'zzz' in the profile; routes: a"):
        Workload.from_profile(profile, ["zzz"], synth(), seed=0)
    with pytest.raises(KvtuneError, match="the workload is empty"):
        Workload.from_profile(Profile(routes=()), [], synth(), seed=0)


async def _calibrate(server: FakeVllm, endpoint: str, tokenizer=None):
    async with server, aiohttp.ClientSession() as session:
        url = server.url
        s = await calibrate_prompts(session, url, "fake", endpoint, tokenizer=tokenizer)
        rng = np.random.default_rng(0)
        from kvtune.workload.requests import RequestSpec

        specs = [RequestSpec(i, "r", n, 1, s.text(n, rng)) for i, n in enumerate([5, 17, 300])]
        check = await check_prompts(session, url, "fake", endpoint, specs) if "/tokenize" not in server.missing else None
        return s, check


@pytest.mark.parametrize("endpoint,overhead", [("chat", 4), ("completions", 1)])
def test_calibration_on_the_server_tokenizer(endpoint, overhead):
    s, check = asyncio.run(_calibrate(FakeVllm(tokens=TEMPLATED, max_model_len=2048), endpoint))
    assert (s.method, s.overhead_tokens, s.max_model_len) == ("tokenize", overhead, 2048)
    assert check == {"checked": 3, "exact": 3}


def test_calibration_with_a_local_tokenizer_when_the_server_has_no_tokenize():
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({w: i + 1 for i, w in enumerate(WORDS)} | {"<unk>": 0}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    s, _ = asyncio.run(_calibrate(FakeVllm(tokens=TEMPLATED, missing={"/tokenize"}), "completions", tokenizer=tok))
    assert (s.method, s.overhead_tokens) == ("tokenizer", 0)
    assert "no /tokenize" in s.notes[0]


def test_calibration_falls_back_to_assumed_lengths_and_says_so():
    s, _ = asyncio.run(_calibrate(FakeVllm(tokens=TEMPLATED, missing={"/tokenize"}), "chat"))
    assert s.method == "assumed" and "assumed" in s.notes[-1]


# --- tokenizers where English words are not one token each ------------------------------------
# The same calibration runs against a local tokenizer when the server has no /tokenize, so these
# exercise it without a server: every length drawn must come out exact, by the tokenizer itself.

SYLLABLES = ("ka", "lo", "mi", "zu", "te", "ra", "po", "ne", "shi", "vo")


def _bpe(corpus: list[str], vocab_size: int, *, split_words: bool):
    """A BPE with a "▁" word prefix (SentencePiece style) trained on `corpus`; without
    `split_words` it has no pre-tokenizer, so merges may run across words."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    if split_words:
        tok.pre_tokenizer = pre_tokenizers.Metaspace()
    else:
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Metaspace()
    alphabet = list("abcdefghijklmnopqrstuvwxyz▁")
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<unk>", "<s>"],
                                                       initial_alphabet=alphabet))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return tok


def _local_calibration(tok, max_model_len=None) -> PromptSynth:
    async def run():
        async with FakeVllm(tokens=TEMPLATED, missing={"/tokenize", "/detokenize"}) as server, \
                aiohttp.ClientSession() as session:
            return await calibrate_prompts(session, server.url, "fake", "completions", tokenizer=tok,
                                           max_model_len=max_model_len)

    return asyncio.run(run())


def _assert_exact(s: PromptSynth, tok, lengths) -> None:
    rng = np.random.default_rng(11)
    for n in lengths:
        text = s.text(n, rng)
        assert len(tok.encode(text).ids) == n, (n, text)


def test_a_vocabulary_without_english_words_gives_its_own_pieces():
    rng = np.random.default_rng(0)
    corpus = [" ".join("".join(rng.choice(SYLLABLES, rng.integers(1, 4))) for _ in range(50)) for _ in range(200)]
    tok = _bpe(corpus, 300, split_words=True)
    assert len(tok.encode("the").ids) > 2  # "the" is ▁ t h e here
    s = _local_calibration(tok)
    assert (s.method, s.filler, s.overhead_tokens) == ("tokenizer", "vocabulary", 1)
    assert len(s.words) >= 16 and not set(s.words) & set(WORDS)
    assert s.calibration_calls <= CALIBRATION_MAX_CALLS
    _assert_exact(s, tok, [2, 3, 17, 100, 333, 1000])


def test_a_tokenizer_that_merges_across_words_repeats_one_unit():
    rng = np.random.default_rng(1)
    common = ["the", "of", "and", "to", "in"]
    corpus = [" ".join(rng.choice(common, 30)) for _ in range(300)] + ["zu " * 40]
    tok = _bpe(corpus, 400, split_words=False)
    assert len(tok.encode("the of").ids) == 2  # <s> ▁the▁of: one token for two words
    s = _local_calibration(tok)
    assert s.filler == "repeat" and len(s.words) == 1
    assert "merges across words" in s.notes[-1]
    assert s.calibration_calls <= CALIBRATION_MAX_CALLS
    _assert_exact(s, tok, [s.min_tokens, 9, 64, 500])


class _CharsTokenizer:
    """One token per 64 characters: no word adds a token of its own, so no length can be aimed at."""

    def encode(self, text: str, add_special_tokens: bool = True):
        class Encoding:
            ids = [0] * (len(text) // 64 + 1)
        return Encoding()

    def get_vocab_size(self) -> int:
        return 0

    def decode(self, ids, skip_special_tokens=True) -> str:
        return ""


def test_a_tokenizer_that_cannot_make_exact_lengths_is_one_clear_error():
    with pytest.raises(KvtuneError) as info:
        _local_calibration(_CharsTokenizer())
    assert str(info.value).startswith("no text adds up to an exact token count under this tokenizer (")
    assert str(info.value).endswith("); cannot build prompts of exact length")


def test_the_calibration_is_a_few_calls_when_every_word_is_one_token():
    s, _ = asyncio.run(_calibrate(FakeVllm(tokens=TEMPLATED, max_model_len=2048), "chat"))
    # 4 leads, the words in groups of 64, 2 random sequences
    assert (s.filler, s.calibration_calls) == ("words", LEADS + -(-len(WORDS) // GROUP_SIZE) + len(SAMPLE_UNITS))
