"""Prompts of exact length under the server's own tokenizer: the calibration behind the
benchmark's PromptSynth (kvtune.workload.draw), measured through the endpoint it benchmarks.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvtune.errors import EndpointError
from kvtune.workload.draw import WORDS, PromptSynth
from kvtune.workload.requests import RequestSpec

__all__ = ["calibrate_prompts", "check_prompts", "CALIBRATION_MAX_CALLS"]


# ---------------------------------------------------------------------------------------------
# Prompt calibration against the server's tokenizer
#
# A prompt is `lead` followed by N − overhead − 1 units drawn at random, joined by spaces. The
# calibration finds units that each cost exactly one token after another word under the server's
# tokenizer (English words first; pieces of the server's own vocabulary, read back with
# /detokenize, when too few of those are one token), then checks that random sequences of them
# add up. A tokenizer that merges across words gets one unit repeated instead, if its repetition
# adds up. Everything is measured through the endpoint itself (chat template, BOS), so the
# overhead is what the server counts. The number of /tokenize calls is bounded by the candidates
# tried (CALIBRATION_MAX_CALLS) and does not depend on the prompt lengths the workload draws.

MIN_UNITS = 16  # fewer one-token units than this and prompts would repeat too much to vary
GROUP_SIZE = 64  # units checked together in one /tokenize call
SAMPLE_UNITS = (37, 200)  # lengths of the random sequences whose counts must add up
REPEAT_UNITS = (2, 64, 1000)  # lengths at which a repeated unit must add up
VOCABULARY_IDS = tuple(range(3, 3 + 4 * 256, 4))  # token ids whose pieces are tried after WORDS
LEADS = 4  # WORDS[:LEADS] are tried as the word every prompt starts with
CONCURRENT_CALLS = 16
# leads twice, each candidate at most in a group and alone, each vocabulary id read once, samples, repeats
CALIBRATION_MAX_CALLS = (2 * LEADS + 1 + 2 * len(WORDS) + 3 * len(VOCABULARY_IDS) + len(SAMPLE_UNITS)
                         + len(REPEAT_UNITS) * MIN_UNITS)


async def _post_json(session: Any, url: str, payload: dict[str, Any]) -> Any:
    """POST a JSON body; the parsed answer, or None when the server answers anything but 200 JSON."""
    import aiohttp

    try:
        async with session.post(url, json=payload) as resp:
            if resp.status != 200:
                await resp.read()
                return None
            return await resp.json(content_type=None)
    except (aiohttp.ClientError, TimeoutError, ValueError):
        return None


async def _tokenize(session: Any, base_url: str, payload: dict[str, Any]) -> dict[str, Any] | None:
    """POST /tokenize; None when the server has no such endpoint (or answers nonsense)."""
    data = await _post_json(session, f"{base_url}/tokenize", payload)
    return data if isinstance(data, dict) and isinstance(data.get("count"), int) else None


class _Counter:
    """Token counting through /tokenize or a local tokenizer, for prompts or chat messages."""

    def __init__(self, session: Any, base_url: str, model: str, endpoint: str, tokenizer: Any) -> None:
        self.session, self.base_url, self.model, self.endpoint, self.tokenizer = (
            session, base_url, model, endpoint, tokenizer)
        self.max_model_len: int | None = None
        self.calls = 0

    async def count(self, text: str, *, as_endpoint: bool = False) -> int | None:
        chat = as_endpoint and self.endpoint == "chat"
        self.calls += 1
        if self.session is not None:
            payload: dict[str, Any] = {"model": self.model}
            if chat:
                payload |= {"messages": [{"role": "user", "content": text}], "add_generation_prompt": True}
            else:
                payload["prompt"] = text
            data = await _tokenize(self.session, self.base_url, payload)
            if data is None:
                return None
            if isinstance(data.get("max_model_len"), int):
                self.max_model_len = data["max_model_len"]
            return int(data["count"])
        return len(self.tokenizer.encode(text, add_special_tokens=True).ids)

    async def piece(self, token_id: int) -> str | None:
        """The text of one token id (/detokenize, or the local tokenizer); None if there is none."""
        self.calls += 1
        if self.session is not None:
            data = await _post_json(self.session, f"{self.base_url}/detokenize",
                                    {"model": self.model, "tokens": [token_id]})
            text = data.get("prompt") if isinstance(data, dict) else None
            return text if isinstance(text, str) else None
        if token_id >= self.tokenizer.get_vocab_size():
            return None
        return self.tokenizer.decode([token_id], skip_special_tokens=True)


async def _bounded(calls: Sequence[Any]) -> list[Any]:
    """Await coroutines at most CONCURRENT_CALLS at a time, results in order."""
    sem = asyncio.Semaphore(CONCURRENT_CALLS)

    async def one(call: Any) -> Any:
        async with sem:
            return await call

    return list(await asyncio.gather(*(one(c) for c in calls)))


@dataclass(frozen=True, slots=True)
class _Filler:
    lead: str
    units: tuple[str, ...]
    base: int  # tokens of the lead alone, endpoint overhead included
    kind: str  # "words", "vocabulary" or "repeat"


class _FillerSearch:
    """Finds a lead and one-token units under `counter` (see the section comment above)."""

    def __init__(self, counter: _Counter, limit: int | None) -> None:
        self.counter, self.limit = counter, limit
        self.lead, self.base = "", 0

    async def count(self, units: Sequence[str]) -> int | None:
        return await self.counter.count(" ".join([self.lead, *units]), as_endpoint=True)

    def longest(self, wanted: int) -> int:
        """At most `wanted` units, fewer where the server's context would not hold them."""
        limit = self.counter.max_model_len or self.limit
        return wanted if limit is None else max(1, min(wanted, limit - self.base - 2))

    async def find(self) -> _Filler | None:
        if not await self.pick_lead(WORDS[:LEADS]):
            return None
        units = await self.one_token(WORDS)
        kind = "words"
        if len(units) < MIN_UNITS:
            kind = "vocabulary"
            pieces = await _bounded([self.counter.piece(i) for i in VOCABULARY_IDS])
            seen = set(units) | set(WORDS)
            fresh = [p.strip() for p in pieces if p is not None and _usable(p.strip())]
            units += await self.one_token([p for p in dict.fromkeys(fresh) if p not in seen])
            if units:  # a piece alone may cost less than an English lead (which is then several tokens)
                await self.pick_lead([self.lead, *units[:LEADS]])
        if not units:
            return _Filler(self.lead, (), self.base, "none")
        if len(units) >= MIN_UNITS and await self.adds_up(units):
            return _Filler(self.lead, tuple(units), self.base, kind)
        for unit in units[:MIN_UNITS]:  # across-word merges: one unit repeated may still add up
            counts = await _bounded([self.count([unit] * self.longest(k)) for k in REPEAT_UNITS])
            if all(c == self.base + self.longest(k) for c, k in zip(counts, REPEAT_UNITS, strict=True)):
                return _Filler(self.lead, (unit,), self.base, "repeat")
        return _Filler(self.lead, (), self.base, "none")

    async def pick_lead(self, candidates: Sequence[str]) -> bool:
        """The candidate that costs the fewest tokens alone becomes the lead; False if none counts."""
        counts = await _bounded([self.counter.count(w, as_endpoint=True) for w in candidates])
        known = [(c, i) for i, c in enumerate(counts) if c is not None]
        if not known:
            return False
        self.base, best = min(known)
        self.lead = candidates[best]
        return True

    async def one_token(self, candidates: Sequence[str]) -> list[str]:
        """The candidates that cost one token after the lead: groups first, then one by one."""
        size = self.longest(GROUP_SIZE)
        groups = [list(candidates[i:i + size]) for i in range(0, len(candidates), size)]
        totals = await _bounded([self.count(g) for g in groups])
        kept: list[str] = []
        for group, total in zip(groups, totals, strict=True):
            if total == self.base + len(group):
                kept += group
                continue
            singles = await _bounded([self.count([w]) for w in group])
            kept += [w for w, c in zip(group, singles, strict=True) if c == self.base + 1]
        return list(dict.fromkeys(kept))

    async def adds_up(self, units: Sequence[str]) -> bool:
        """Random sequences of the units (a fixed seed) cost one token per unit."""
        rng = np.random.default_rng(0)
        samples = [[units[i] for i in rng.integers(0, len(units), self.longest(k)).tolist()] for k in SAMPLE_UNITS]
        counts = await _bounded([self.count(s) for s in samples])
        return all(c == self.base + len(s) for c, s in zip(counts, samples, strict=True))


def _usable(piece: str) -> bool:
    """A vocabulary piece that can stand as a word: letters or digits only (no markup, no spaces)."""
    return piece.isalnum() and piece.isprintable()


async def calibrate_prompts(
    session: Any, base_url: str, model: str, endpoint: str, *, tokenizer: Any = None,
    max_model_len: int | None = None,
) -> PromptSynth:
    """A PromptSynth checked against the server's /tokenize, else a local tokenizer, else assumed.

    The endpoint overhead (chat template, BOS) is what the lead word alone costs, less one; every
    other unit must cost one token after it, and random sequences of them must add up.
    """
    notes: list[str] = []
    for method, counter in (("tokenize", _Counter(session, base_url, model, endpoint, None)),
                            ("tokenizer", _Counter(None, base_url, model, endpoint, tokenizer))):
        if method == "tokenizer" and tokenizer is None:
            continue
        if method == "tokenizer" and endpoint == "chat":
            notes.append("a local tokenizer cannot apply the chat template: chat prompt lengths "
                         "omit the template's tokens (compare with the server's usage)")
        found = await _FillerSearch(counter, max_model_len).find()
        if found is None:
            if method == "tokenize":
                notes.append("the server has no /tokenize endpoint")
            continue
        if not found.units:
            raise EndpointError(f"no text adds up to an exact token count under this tokenizer ({counter.calls} "
                                f"counts tried: English words, {len(VOCABULARY_IDS)} vocabulary pieces, "
                                "repeated pieces); cannot build prompts of exact length")
        if found.kind == "repeat":
            notes.append(f"this tokenizer merges across words: prompts repeat one token ({found.units[0]!r}), so "
                         "requests of equal length share their prefix")
        limit = counter.max_model_len or max_model_len
        return PromptSynth(found.units, found.base - 1, method, limit, tuple(notes), lead=found.lead,
                           filler=found.kind, calibration_calls=counter.calls)
    notes.append("prompt lengths are assumed (one token per word, no template overhead): give "
                 "--tokenizer or use a server with /tokenize to make them exact")
    return PromptSynth(WORDS, 0, "assumed", max_model_len, tuple(notes))


async def check_prompts(session: Any, base_url: str, model: str, endpoint: str,
                        specs: Sequence[RequestSpec]) -> dict[str, int]:
    """Tokenize a sample of synthesized prompts on the server: how many have the exact length."""
    counter = _Counter(session, base_url, model, endpoint, None)
    exact = checked = 0
    for spec in specs:
        n = await counter.count(spec.prompt, as_endpoint=True)
        if n is None:
            break
        checked += 1
        exact += n == spec.prompt_tokens
    return {"checked": checked, "exact": exact}
