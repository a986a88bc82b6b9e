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

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvtune.errors import InputError, UnknownNameError
from kvtune.ingest import read_logs
from kvtune.profile.histogram import JOINT_EDGES, Histogram
from kvtune.profile.logged_model import ModelSelection, one_logged_model, same_model
from kvtune.profile.routes import Profile, RouteProfile, skipped_file_notes
from kvtune.userfiles import brief
from kvtune.workload.requests import RequestSpec

__all__ = [
    "PairSampler",
    "Workload",
    "PromptSynth",
    "replay_rows",
    "text_rng",
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
    """Builds prompt text of an exact token count: `overhead` template tokens, then the lead word
    (when there is one) and random words, one token each."""

    words: tuple[str, ...]
    overhead_tokens: int
    method: str  # "tokenize" (server), "tokenizer" (local), "assumed" (unchecked)
    max_model_len: int | None = None
    notes: tuple[str, ...] = ()
    lead: str | None = None  # the word every prompt starts with: its cost at the start was measured
    filler: str = "words"  # "words" (English), "vocabulary" (the server's own pieces), "repeat"
    calibration_calls: int = 0  # /tokenize and /detokenize calls the calibration made

    @property
    def min_tokens(self) -> int:
        return self.overhead_tokens + 1

    def text(self, prompt_tokens: int, rng: np.random.Generator) -> str:
        n = max(1, prompt_tokens - self.overhead_tokens)
        words = self.words
        if self.lead is None:
            return " ".join([words[i] for i in rng.integers(0, len(words), size=n).tolist()])
        if n == 1:
            return self.lead
        picks = rng.integers(0, len(words), size=n - 1).tolist()
        return " ".join([self.lead, *[words[i] for i in picks]])

    def to_dict(self) -> dict[str, Any]:
        return {"method": self.method, "filler": self.filler, "overhead_tokens": self.overhead_tokens,
                "vocabulary_words": len(self.words), "calibration_calls": self.calibration_calls,
                "notes": list(self.notes)}


def text_rng(seed: int) -> np.random.Generator:
    """The prompt-text stream, apart from the lengths' so that a run without text (`kvtune
    simulate`) draws the same lengths as one that builds prompts (`kvtune bench`)."""
    return np.random.default_rng([seed, 1])


@dataclass(slots=True)
class Workload:
    """Request specs in send order, drawn lazily and reproducibly from a seed: the lengths from
    `rng`, the prompt text from `text`."""

    routes: tuple[str, ...]
    synth: PromptSynth
    rng: np.random.Generator
    text: np.random.Generator
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
        return cls(tuple(r.route for r in chosen), synth, np.random.default_rng(seed), text_rng(seed), samplers,
                   np.cumsum(weights) / weights.sum())

    @classmethod
    def from_rows(cls, rows: list[tuple[str, int, int]], synth: PromptSynth, seed: int) -> Workload:
        if not rows:
            raise InputError("no requests to replay", field="LOGS")
        return cls(tuple(sorted({r for r, _, _ in rows})), synth, np.random.default_rng(seed), text_rng(seed),
                   rows=rows)

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

    def draw(self, index: int) -> tuple[str, int, int]:
        """The next (route, prompt, output) lengths, fitted to the server (increasing indices)."""
        if self.rows is not None:
            route, prompt, output = self.rows[index]
        else:
            if not self._buffer:
                self._refill()
            route, prompt, output = self._buffer.pop()
        prompt, output = self._clamp(prompt, output)
        return route, prompt, output

    def spec(self, index: int) -> RequestSpec:
        """The next request, its prompt text included (call with increasing indices)."""
        route, prompt, output = self.draw(index)
        return RequestSpec(index, route, prompt, output, self.synth.text(prompt, self.text))

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
                ) -> tuple[list[tuple[str, int, int]], list[float], list[str]]:
    """(route, prompt, output) and timestamps of every logged request with both, in time order, and
    the notes on the files not read (`Profile.notes`); of one logged model (options.log_model selects
    it; logs naming several without it are an error, as for a profile: kvtune.profile.logged_model).
    None at all: one InputError naming the inputs and why each row went (ingest's skip reasons, then
    the fields missing here)."""
    batches, stats = read_logs(list(paths), options)
    keep_routes = set(routes)
    triples: list[tuple[str, int, int]] = []
    stamps: list[float] = []
    skipped: Counter = Counter()
    selected = options.log_model
    named: Counter[str] = Counter()
    left_out: Counter[str] = Counter()
    unnamed = 0
    for batch in batches:
        cols = batch.to_pydict()
        columns = (cols["route"], cols["model"], cols["prompt_tokens"], cols["output_tokens"], cols["timestamp_s"])
        for route, model, p, o, ts in zip(*columns, strict=True):
            if selected is not None and (model is None or not same_model(model, selected)):
                if model is None:
                    unnamed += 1
                else:
                    left_out[model] += 1
                continue
            if model is not None:
                named[model] += 1
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
    one_logged_model(named, None if selected is None else ModelSelection(selected, left_out, unnamed))
    notes = skipped_file_notes(stats.skipped_files)
    if not triples:
        why = ", ".join(f"{k}: {v:,}" for k, v in (stats.skipped + skipped).most_common()) or "no rows"
        raise InputError(f"nothing to replay: no request has a timestamp, prompt and output length ({why})"
                         + "".join(f"; {note}" for note in notes),
                         path=", ".join(paths[:3]) + (f" and {len(paths) - 3} more" if len(paths) > 3 else ""))
    order = np.argsort(np.asarray(stamps, dtype=np.float64), kind="stable")
    return [triples[i] for i in order.tolist()], [stamps[i] for i in order.tolist()], notes
