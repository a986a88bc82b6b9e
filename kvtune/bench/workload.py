"""What to send: (route, prompt length, output length) per request, and prompts of exact length.

Why: a benchmark only tests the traffic it sends. Pairs are drawn from the profile's route mix,
jointly where the profile kept the (prompt, output) joint histogram (a cell by its count, then
each length from its exact marginal restricted to the cell's bin, which keeps both marginals
exact), independently otherwise. Prompts are random words that each cost one token under the
server's tokenizer, checked with its /tokenize (or a local tokenizer), so a prompt of N tokens
is the template overhead plus N − overhead words; random words also keep one request from
hitting another's prefix cache.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvtune.bench.client import RequestSpec
from kvtune.errors import EndpointError, InputError, UnknownNameError
from kvtune.profile.histogram import JOINT_EDGES, Histogram
from kvtune.profile.routes import Profile, RouteProfile
from kvtune.userfiles import brief

__all__ = [
    "PairSampler",
    "Workload",
    "PromptSynth",
    "calibrate_prompts",
    "replay_rows",
    "WORDS",
]

# Common lowercase English words: one token each in most BPE/SentencePiece vocabularies when
# preceded by a space; calibration drops any that are not, under the server's own tokenizer.
WORDS = tuple("""
the of and to in is was for on are with as at be by this had not but from or have an they which
one you were her all she there would their we him been has when who will more no if out so said
what up its about into than them can only other new some could time these two may then do first
any my now such like our over man me even most made after also did many before must through back
years where much your way well down should because each just those people how too little state
good very make world still own see men work long get here between both life being under never
day same another know while last might us great old year off come since against go came right
used take three states himself few house use during without again place around however home
small found thought went say part once general high upon school every does got united left number
course war until always away something fact though water less public put think almost hand
enough far took head yet government system better set told nothing night end why called didn
""".split())


def _restricted(h: Histogram, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
    """Values of `h` in [lo, hi) and their cumulative probabilities."""
    i, j = np.searchsorted(h.values, [lo, hi], side="left")
    values, counts = h.values[i:j], h.counts[i:j]
    return values, np.cumsum(counts) / counts.sum() if counts.size else counts.astype(float)


def _draw(values: np.ndarray, cumulative: np.ndarray, rng: np.random.Generator, n: int) -> np.ndarray:
    index = np.searchsorted(cumulative, rng.random(n), side="right")
    return values[np.minimum(index, values.size - 1)]


class PairSampler:
    """Draws (prompt, output) token pairs for one route."""

    def __init__(self, route: RouteProfile) -> None:
        if route.prompt.total == 0:
            raise InputError(f"route {brief(route.route)} logs no prompt lengths; a benchmark needs them",
                             field="--route")
        self.route = route.route
        self.prompt = route.prompt
        self.output = route.output.observed  # what was logged, cut responses at their logged length
        joint = route.joint
        self.joint = joint.total > 0
        if self.joint:
            self._cells_p = joint.prompt_bins
            self._cells_o = joint.output_bins
            self._cells_cum = np.cumsum(joint.counts) / joint.total
            self._within: dict[tuple[str, int], tuple[np.ndarray, np.ndarray]] = {}
        self._p_all = _restricted(self.prompt, 0, 1 << 62)
        self._o_all = _restricted(self.output, 0, 1 << 62)

    def _bin(self, which: str, b: int) -> tuple[np.ndarray, np.ndarray]:
        key = (which, b)
        found = self._within.get(key)
        if found is None:
            h = self.prompt if which == "p" else self.output
            hi = int(JOINT_EDGES[b + 1]) if b + 1 < JOINT_EDGES.size else 1 << 62
            found = _restricted(h, int(JOINT_EDGES[b]), hi)
            if found[0].size == 0:  # the joint saw a bin the marginal did not: use the marginal
                found = self._p_all if which == "p" else self._o_all
            self._within[key] = found
        return found

    def draw(self, rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
        if not self.joint:
            return _draw(*self._p_all, rng, n), _draw(*self._o_all, rng, n)
        cells = np.minimum(np.searchsorted(self._cells_cum, rng.random(n), side="right"),
                           self._cells_cum.size - 1)
        prompts = np.empty(n, np.int64)
        outputs = np.empty(n, np.int64)
        for which, bins, out in (("p", self._cells_p[cells], prompts), ("o", self._cells_o[cells], outputs)):
            for b in np.unique(bins):
                where = np.flatnonzero(bins == b)
                out[where] = _draw(*self._bin(which, int(b)), rng, where.size)
        return prompts, outputs


@dataclass(frozen=True, slots=True)
class PromptSynth:
    """Builds prompt text of an exact token count: `overhead` template tokens + one per word."""

    words: tuple[str, ...]
    overhead_tokens: int
    method: str  # "tokenize" (server), "tokenizer" (local), "assumed" (unchecked)
    max_model_len: int | None = None
    notes: tuple[str, ...] = ()

    @property
    def min_tokens(self) -> int:
        return self.overhead_tokens + 1

    def text(self, prompt_tokens: int, rng: np.random.Generator) -> str:
        n = max(1, prompt_tokens - self.overhead_tokens)
        picks = rng.integers(0, len(self.words), size=n)
        words = self.words
        return " ".join([words[i] for i in picks.tolist()])

    def to_dict(self) -> dict[str, Any]:
        return {"method": self.method, "overhead_tokens": self.overhead_tokens,
                "vocabulary_words": len(self.words), "notes": list(self.notes)}


@dataclass(slots=True)
class Workload:
    """Request specs in send order, drawn lazily and reproducibly from a seed."""

    routes: tuple[str, ...]
    synth: PromptSynth
    rng: np.random.Generator
    samplers: tuple[PairSampler, ...] = ()
    weights: np.ndarray | None = None
    rows: list[tuple[str, int, int]] | None = None  # replay: (route, prompt, output) in time order
    clamped: Counter = field(default_factory=Counter)  # reason -> requests
    _buffer: list[tuple[str, int, int]] = field(default_factory=list)

    @classmethod
    def from_profile(cls, profile: Profile, routes: Sequence[str], synth: PromptSynth, seed: int) -> Workload:
        chosen = select_routes(profile, routes)
        samplers = tuple(PairSampler(r) for r in chosen)
        weights = np.array([r.requests for r in chosen], dtype=np.float64)
        return cls(tuple(r.route for r in chosen), synth, np.random.default_rng(seed), samplers,
                   np.cumsum(weights) / weights.sum())

    @classmethod
    def from_rows(cls, rows: list[tuple[str, int, int]], synth: PromptSynth, seed: int) -> Workload:
        if not rows:
            raise InputError("no requests to replay", field="LOGS")
        return cls(tuple(sorted({r for r, _, _ in rows})), synth, np.random.default_rng(seed), rows=rows)

    def _refill(self, n: int = 1024) -> None:
        assert self.weights is not None
        which = np.minimum(np.searchsorted(self.weights, self.rng.random(n), side="right"), len(self.samplers) - 1)
        drawn: list[tuple[str, int, int]] = [("", 0, 0)] * n
        for k, sampler in enumerate(self.samplers):
            where = np.flatnonzero(which == k)
            if where.size:
                p, o = sampler.draw(self.rng, where.size)
                for i, pi, oi in zip(where.tolist(), p.tolist(), o.tolist(), strict=True):
                    drawn[i] = (sampler.route, pi, oi)
        self._buffer.extend(reversed(drawn))

    def spec(self, index: int) -> RequestSpec:
        """The next request (call with increasing indices)."""
        if self.rows is not None:
            route, prompt, output = self.rows[index]
        else:
            if not self._buffer:
                self._refill()
            route, prompt, output = self._buffer.pop()
        prompt, output = self._clamp(prompt, output)
        return RequestSpec(index, route, prompt, output, self.synth.text(prompt, self.rng))

    def _clamp(self, prompt: int, output: int) -> tuple[int, int]:
        """Fit a draw to what the server can take; every change is counted by reason."""
        limit = self.synth.max_model_len
        if prompt < self.synth.min_tokens:
            self.clamped["prompt_below_template"] += 1
            prompt = self.synth.min_tokens
        if output < 1:
            self.clamped["output_zero"] += 1
            output = 1
        if limit is not None:
            if prompt > limit - 1:
                self.clamped["prompt_over_max_model_len"] += 1
                prompt = limit - 1
            if prompt + output > limit:
                self.clamped["output_over_max_model_len"] += 1
                output = limit - prompt
        return prompt, output


def select_routes(profile: Profile, routes: Sequence[str]) -> list[RouteProfile]:
    if not profile.routes:
        raise InputError("the workload is empty: no requests in the profile or logs")
    if not routes:
        return list(profile.routes)
    names = {r.route: r for r in profile.routes}
    missing = [r for r in routes if r not in names]
    if missing:
        raise UnknownNameError(f"no route {missing[0]!r} in the profile; routes: {', '.join(sorted(names))}",
                               field="routes")
    return [names[r] for r in dict.fromkeys(routes)]


def replay_rows(paths: Sequence[str], options: Any, routes: Sequence[str]
                ) -> tuple[list[tuple[str, int, int]], list[float], Counter]:
    """(route, prompt, output) and timestamps of every logged request with both, in time order."""
    from kvtune.ingest import read_logs

    batches, _stats = read_logs(list(paths), options)
    keep_routes = set(routes)
    triples: list[tuple[str, int, int]] = []
    stamps: list[float] = []
    skipped: Counter = Counter()
    for batch in batches:
        cols = batch.to_pydict()
        columns = (cols["route"], cols["prompt_tokens"], cols["output_tokens"], cols["timestamp_s"])
        for route, p, o, ts in zip(*columns, strict=True):
            route = route if route is not None else "default"
            if keep_routes and route not in keep_routes:
                continue
            if ts is None:
                skipped["no_timestamp"] += 1
            elif p is None:
                skipped["no_prompt_tokens"] += 1
            elif o is None:
                skipped["no_output_tokens"] += 1
            else:
                triples.append((route, int(p), int(o)))
                stamps.append(float(ts))
    order = np.argsort(np.asarray(stamps, dtype=np.float64), kind="stable")
    return [triples[i] for i in order.tolist()], [stamps[i] for i in order.tolist()], skipped


# ---------------------------------------------------------------------------------------------
# Prompt calibration against the server's tokenizer


async def _tokenize(session: Any, base_url: str, payload: dict[str, Any]) -> dict[str, Any] | None:
    """POST /tokenize; None when the server has no such endpoint (or answers nonsense)."""
    import aiohttp

    try:
        async with session.post(f"{base_url}/tokenize", json=payload) as resp:
            if resp.status != 200:
                await resp.read()
                return None
            data = await resp.json(content_type=None)
    except (aiohttp.ClientError, TimeoutError, ValueError):
        return None
    return data if isinstance(data, dict) and isinstance(data.get("count"), int) else None


class _Counter:
    """Token counting through /tokenize or a local tokenizer, for prompts or chat messages."""

    def __init__(self, session: Any, base_url: str, model: str, endpoint: str, tokenizer: Any) -> None:
        self.session, self.base_url, self.model, self.endpoint, self.tokenizer = (
            session, base_url, model, endpoint, tokenizer)
        self.max_model_len: int | None = None

    async def count(self, text: str, *, as_endpoint: bool = False) -> int | None:
        chat = as_endpoint and self.endpoint == "chat"
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


async def _single_token_words(counter: _Counter) -> tuple[list[str], int] | None:
    """Vocabulary words that cost exactly one token, and the raw-prompt overhead (BOS …)."""
    first = WORDS[0]
    c1 = await counter.count(first)
    if c1 is None:
        return None
    c2 = await counter.count(f"{first} {first}")
    call = await counter.count(" ".join(WORDS))
    if c2 is not None and call is not None and c2 - c1 == 1 and call - c1 == len(WORDS) - 1:
        return list(WORDS), c1 - 1
    sem = asyncio.Semaphore(16)

    async def one(w: str) -> int | None:
        async with sem:
            return await counter.count(w)

    counts = await asyncio.gather(*(one(w) for w in WORDS))
    known = [c for c in counts if c is not None]
    if not known:
        return None
    mode = Counter(known).most_common(1)[0][0]
    return [w for w, c in zip(WORDS, counts, strict=True) if c == mode], mode - 1


async def calibrate_prompts(
    session: Any, base_url: str, model: str, endpoint: str, *, tokenizer: Any = None,
    max_model_len: int | None = None,
) -> PromptSynth:
    """A PromptSynth checked against the server's /tokenize, else a local tokenizer, else assumed.

    The endpoint overhead (chat template, BOS) is measured at two prompt sizes and must agree;
    the words must each cost one token, and 100 of them must cost exactly 100 more.
    """
    notes: list[str] = []
    for method, counter in (("tokenize", _Counter(session, base_url, model, endpoint, None)),
                            ("tokenizer", _Counter(None, base_url, model, endpoint, tokenizer))):
        if method == "tokenizer" and tokenizer is None:
            continue
        if method == "tokenizer" and endpoint == "chat":
            notes.append("a local tokenizer cannot apply the chat template: chat prompt lengths "
                         "omit the template's tokens (compare with the server's usage)")
        found = await _single_token_words(counter)
        if found is None:
            if method == "tokenize":
                notes.append("the server has no /tokenize endpoint")
            continue
        words, raw_overhead = found
        if len(words) < 16:
            raise EndpointError(f"only {len(words)} of {len(WORDS)} vocabulary words are one token under "
                                f"this tokenizer; cannot build prompts of exact length")
        sample = words[:100] if len(words) >= 100 else (words * (100 // len(words) + 1))[:100]
        if method == "tokenize" or endpoint != "chat":
            c_small = await counter.count(words[0], as_endpoint=True)
            c_large = await counter.count(" ".join(sample), as_endpoint=True)
            if c_small is None or c_large is None:
                continue
            overhead = c_small - 1
            if c_large - 100 != overhead:
                raise EndpointError(f"prompt length is not additive under this tokenizer ({c_small} tokens "
                                    f"for 1 word, {c_large} for 100); cannot build prompts of exact length")
        else:
            overhead = raw_overhead
        limit = counter.max_model_len or max_model_len
        return PromptSynth(tuple(words), overhead, method, limit, tuple(notes))
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
