"""Per-route traffic profiles: censoring-aware length distributions, tail class, arrival rate.

Pure: takes histograms, returns frozen dataclasses. Building a profile from log batches lives in
`kvtune.profile.build`; this module only knows numbers.

Censoring: a response cut at its cap (finish_reason `length`) has a true length ≥ the logged
one. Output (and prompt+output) percentiles therefore come from the Kaplan–Meier estimate;
without censoring they are exactly numpy's nearest-rank (`inverted_cdf`) percentiles.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

import numpy as np

from kvtune.domain.censored_lengths import CensoredLengths, LengthCounts
from kvtune.domain.tail_class import TailClass
from kvtune.errors import InputError
from kvtune.ingest.paths import SkippedFile
from kvtune.ingest.window import WindowReport, merge_reports
from kvtune.profile.histogram import MAX_SAVED_INTEGER, Histogram, JointHistogram, LogHistogram, distinct
from kvtune.profile.logged_model import ModelSelection
from kvtune.userfiles import brief

__all__ = [
    "PERCENTILES",
    "SCHEMA_VERSION",
    "Quantile",
    "LengthSummary",
    "CensoredHistogram",
    "Tail",
    "classify_tail",
    "Arrival",
    "RouteProfile",
    "InputFile",
    "Profile",
    "merge_profiles",
    "busiest_routes",
    "fold_routes",
    "route_summary",
    "summarize_plain",
]

#: Reported percentiles: JSON key -> percent (as passed to np.percentile).
PERCENTILES: tuple[tuple[str, float], ...] = (
    ("p50", 50),
    ("p90", 90),
    ("p95", 95),
    ("p99", 99),
    ("p999", 99.9),
)

SCHEMA_VERSION = 1
PROFILE_KIND = "kvtune-profile"

# F(t) ≥ q is tested with this relative slack: the KM product of floats can land a hair below a
# q it reaches exactly in real arithmetic (e.g. F = 0.5); 1e-12 is far below any KM step.
_KM_SLACK = 1e-12


@dataclass(frozen=True, slots=True)
class Quantile:
    """A length in tokens; `lower_bound` when censoring hides where the true value lies."""

    value_tokens: int
    lower_bound: bool = False


@dataclass(frozen=True, slots=True)
class LengthSummary:
    """The reported percentiles of one length distribution."""

    requests: int
    percentiles: Mapping[str, Quantile]  # PERCENTILES keys and "max"
    mean_tokens: float
    mean_lower_bound: bool

    def __getitem__(self, key: str) -> Quantile:
        return self.percentiles[key]

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {k: q.value_tokens for k, q in self.percentiles.items()}
        out["mean"] = round(self.mean_tokens, 3)
        out["lower_bound"] = {k: q.lower_bound for k, q in self.percentiles.items()}
        out["lower_bound"]["mean"] = self.mean_lower_bound
        return out


@dataclass(frozen=True, slots=True, eq=False)
class CensoredHistogram:
    """Lengths with right-censored observations, summarised by the Kaplan–Meier estimate.

    `uncensored[t]` counts completions that ended on their own at t tokens; `censored[t]` counts
    responses cut at t (true length ≥ t). At a tie, events come before censorings: a response
    cut at t was still running at t, so it is at risk there.
    """

    uncensored: Histogram
    censored: Histogram
    _times: np.ndarray = field(init=False, repr=False)  # distinct observed lengths
    _survival: np.ndarray = field(init=False, repr=False)  # KM S(t) at each of _times

    def __post_init__(self) -> None:
        times = distinct(np.concatenate((self.uncensored.values, self.censored.values)))
        if self.censored.total == 0:
            survival = np.zeros(0)  # not needed: the exact nearest-rank path is used
        else:
            events = np.zeros(times.size, np.int64)
            events[np.searchsorted(times, self.uncensored.values)] = self.uncensored.counts
            cuts = np.zeros(times.size, np.int64)
            cuts[np.searchsorted(times, self.censored.values)] = self.censored.counts
            observed = events + cuts
            at_risk = observed[::-1].cumsum()[::-1]  # number with length ≥ t
            survival = np.cumprod(1.0 - events / at_risk)
        times.setflags(write=False)
        survival.setflags(write=False)
        object.__setattr__(self, "_times", times)
        object.__setattr__(self, "_survival", survival)

    @classmethod
    def empty(cls) -> CensoredHistogram:
        return cls(Histogram.empty(), Histogram.empty())

    @classmethod
    def of(cls, lengths: Any, censored: Any) -> CensoredHistogram:
        """From raw samples and a parallel boolean censoring flag (tests, small inputs)."""
        lengths = np.asarray(lengths, dtype=np.int64).reshape(-1)
        mask = np.asarray(censored, dtype=bool).reshape(-1)
        return cls(Histogram.of(lengths[~mask]), Histogram.of(lengths[mask]))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, CensoredHistogram):
            return NotImplemented
        return self.uncensored == other.uncensored and self.censored == other.censored

    # unhashable, like the arrays it holds: a class that defines __eq__ gets __hash__ = None

    @property
    def total(self) -> int:
        return self.uncensored.total + self.censored.total

    @property
    def censored_count(self) -> int:
        return self.censored.total

    @property
    def censored_share(self) -> float:
        total = self.total
        return self.censored.total / total if total else 0.0

    @property
    def observed(self) -> Histogram:
        """All logged lengths, censored or not (what a naive percentile would use)."""
        return self.uncensored.merge(self.censored)

    def survival(self, t_tokens: float) -> float:
        """Estimated P(length > t). Beyond the largest observation it stays at its last value."""
        total = self.total
        if total == 0:
            raise ValueError("survival of an empty distribution")
        if self.censored.total == 0:
            return (total - self.uncensored.count_le(t_tokens)) / total
        i = int(np.searchsorted(self._times, t_tokens, side="right"))
        return 1.0 if i == 0 else float(self._survival[i - 1])

    def truncation_share(self, cap_tokens: int) -> float:
        """Estimated share of requests whose true output would exceed `cap_tokens` (1 − F(cap))."""
        return self.survival(cap_tokens)

    def quantile(self, q: float) -> Quantile:
        """Smallest t with F(t) ≥ q; the largest observed length, flagged, if F never gets there."""
        if not 0.0 <= q <= 1.0:
            raise ValueError(f"quantile {q} outside [0, 1]")
        if self.total == 0:
            raise ValueError("quantile of an empty distribution")
        if self.censored.total == 0:
            value = self.uncensored.quantile(q)
            assert value is not None  # total > 0
            return Quantile(value)
        reached = np.flatnonzero(1.0 - self._survival >= q * (1.0 - _KM_SLACK))
        if reached.size == 0:
            return Quantile(int(self._times[-1]), lower_bound=True)
        return Quantile(int(self._times[reached[0]]))

    def percentile(self, p: float) -> Quantile:
        """p in percent, divided exactly as np.percentile divides it."""
        return self.quantile(float(np.float64(p) / 100))

    @property
    def max(self) -> Quantile:
        """Largest logged length; a lower bound when some response was cut at that length."""
        top = int(self._times[-1])
        top_cut = self.censored.max
        return Quantile(top, lower_bound=top_cut is not None and top_cut >= top)

    def summary(self) -> LengthSummary:
        if self.total == 0:
            raise ValueError("summary of an empty distribution")
        percentiles = {key: self.percentile(p) for key, p in PERCENTILES}
        percentiles["max"] = self.max
        return LengthSummary(
            requests=self.total,
            percentiles=percentiles,
            mean_tokens=self.observed.mean or 0.0,
            mean_lower_bound=self.censored.total > 0,
        )

    def merge(self, other: CensoredHistogram) -> CensoredHistogram:
        return CensoredHistogram(
            self.uncensored.merge(other.uncensored), self.censored.merge(other.censored)
        )

    def to_dict(self) -> dict[str, Any]:
        return {"uncensored": self.uncensored.to_dict(), "censored": self.censored.to_dict()}

    def lengths(self) -> CensoredLengths:
        """The counts as plain data (what recommendation.json carries per route)."""
        return CensoredLengths(_plain(self.uncensored), _plain(self.censored))

    @classmethod
    def from_lengths(cls, lengths: CensoredLengths) -> CensoredHistogram:
        """The estimate over plain counts (a recommendation's route, read back)."""
        return cls(_histogram(lengths.uncensored), _histogram(lengths.censored))

    @classmethod
    def from_dict(cls, data: Any, where: str) -> CensoredHistogram:
        if not isinstance(data, Mapping):
            raise InputError("expected an object with uncensored and censored", field=where)
        return cls(
            Histogram.from_dict(data.get("uncensored"), f"{where}.uncensored"),
            Histogram.from_dict(data.get("censored"), f"{where}.censored"),
        )


def _plain(histogram: Histogram) -> LengthCounts:
    return LengthCounts(tuple(histogram.values.tolist()), tuple(histogram.counts.tolist()))


def _histogram(counts: LengthCounts) -> Histogram:
    return Histogram(np.asarray(counts.values, np.int64), np.asarray(counts.counts, np.int64))


def summarize_plain(histogram: Histogram) -> LengthSummary:
    """Percentiles of an uncensored histogram (prompt lengths, requested max_tokens)."""
    return CensoredHistogram(histogram, Histogram.empty()).summary()


# ---------------------------------------------------------------------------------------------
# Tail class

_EXP_P99_OVER_P50 = math.log(100) / math.log(2)  # 6.64
_EXP_P999_OVER_P99 = math.log(1000) / math.log(100)  # 1.5
_MIN_REQUESTS_FOR_P999 = 1000

TAIL_RULE = (
    f"heavy when the tail is heavier than an exponential with the same median: "
    f"p99/p50 > {_EXP_P99_OVER_P50:.2f} or p99.9/p99 > {_EXP_P999_OVER_P99:.2f} "
    f"(the second with ≥ {_MIN_REQUESTS_FOR_P999} requests)"
)


@dataclass(frozen=True, slots=True)
class Tail:
    """Tail class of an output distribution and the ratios that decided it."""

    class_: TailClass
    p99_over_p50: float
    p999_over_p99: float | None  # None with fewer than 1000 requests
    lower_bound: bool  # ratios rest on lower-bound percentiles (censoring)
    rule: str = TAIL_RULE

    def to_dict(self) -> dict[str, Any]:
        return {
            "class": self.class_.value,
            "rule": self.rule,
            "p99_over_p50": round(self.p99_over_p50, 3),
            "p999_over_p99": None if self.p999_over_p99 is None else round(self.p999_over_p99, 3),
            "lower_bound": self.lower_bound,
        }


def classify_tail(summary: LengthSummary) -> Tail:
    """Light or heavy, against the exponential distribution — the textbook light/heavy boundary.

    An exponential has p99/p50 = ln100/ln2 ≈ 6.64 and p99.9/p99 = ln1000/ln100 = 1.5 whatever
    its rate; a ratio above either means the tail decays slower than exponentially at that depth,
    so a p95 cap would cut a long, expensive tail. On the real traces: Azure code (p50 13,
    p99 251: 19.4) is heavy on the first test; Azure conv (p50 129, p99 601: 4.66) passes the
    first but its p99.9 is 954 (954/601 = 1.59), so it is heavy too — its outputs run up to
    the 1000-token cap: heavy-tailed, as DESIGN.md says real outputs are. For a lognormal the
    first test trips at σ > 0.81, the second at σ > 0.53 (σ = 0.4: 2.5 and 1.36, light); routes
    with tightly bounded outputs (classification, extraction) come out light. p99.9 counts only
    with ≥ 1000 requests; below that it is little more than the sample maximum.
    """
    p = summary.percentiles
    p50 = max(p["p50"].value_tokens, 1)
    p99 = max(p["p99"].value_tokens, 1)
    first = p["p99"].value_tokens / p50
    second = None
    if summary.requests >= _MIN_REQUESTS_FOR_P999:
        second = p["p999"].value_tokens / p99
    heavy = first > _EXP_P99_OVER_P50 or (second is not None and second > _EXP_P999_OVER_P99)
    used = ("p50", "p99", "p999") if second is not None else ("p50", "p99")
    return Tail(
        class_=TailClass.HEAVY if heavy else TailClass.LIGHT,
        p99_over_p50=first,
        p999_over_p99=second,
        lower_bound=any(p[k].lower_bound for k in used),
    )


# ---------------------------------------------------------------------------------------------
# Arrivals

PEAK_WINDOW_S = 60


@dataclass(frozen=True, slots=True, eq=False)
class Arrival:
    """Request arrivals: counts per whole second (sparse), so rates merge exactly."""

    per_second: Histogram  # floor(timestamp_s) -> requests
    first_s: float
    last_s: float

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Arrival):
            return NotImplemented
        return (self.per_second, self.first_s, self.last_s) == (other.per_second, other.first_s, other.last_s)

    # unhashable, like the arrays it holds: a class that defines __eq__ gets __hash__ = None

    @property
    def requests(self) -> int:
        return self.per_second.total

    @property
    def duration_s(self) -> float:
        return self.last_s - self.first_s

    @property
    def mean_rate_rps(self) -> float | None:
        return self.requests / self.duration_s if self.duration_s > 0 else None

    @property
    def peak_1s_requests(self) -> int:
        return int(self.per_second.counts.max()) if self.per_second.counts.size else 0

    @property
    def peak_window_requests(self) -> int:
        """Most requests in any PEAK_WINDOW_S-second window (whole seconds)."""
        seconds, counts = self.per_second.values, self.per_second.counts
        if seconds.size == 0:
            return 0
        cumulative = np.concatenate([[0], np.cumsum(counts)])
        ends = np.searchsorted(seconds, seconds + PEAK_WINDOW_S, side="left")
        return int((cumulative[ends] - cumulative[: seconds.size]).max())

    @property
    def peak_rate_rps(self) -> float:
        return self.peak_window_requests / PEAK_WINDOW_S

    def merge(self, other: Arrival) -> Arrival:
        return Arrival(
            self.per_second.merge(other.per_second),
            min(self.first_s, other.first_s),
            max(self.last_s, other.last_s),
        )

    def summary_dict(self) -> dict[str, Any]:
        mean = self.mean_rate_rps
        return {
            "requests": self.requests,
            "first_s": self.first_s,
            "last_s": self.last_s,
            "duration_s": round(self.duration_s, 3),
            "mean_rate_rps": None if mean is None else round(mean, 4),
            "peak_window_s": PEAK_WINDOW_S,
            "peak_window_requests": self.peak_window_requests,
            "peak_rate_rps": round(self.peak_rate_rps, 4),
            "peak_1s_requests": self.peak_1s_requests,
        }

    def to_dict(self) -> dict[str, Any]:
        return {"first_s": self.first_s, "last_s": self.last_s, "per_second": self.per_second.to_dict()}

    @classmethod
    def from_dict(cls, data: Any, where: str) -> Arrival:
        if not isinstance(data, Mapping):
            raise InputError("expected an object", field=where)
        for key in ("first_s", "last_s"):
            value = data.get(key)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) \
                    or abs(value) > MAX_SAVED_INTEGER:
                raise InputError(f"expected a number of seconds within ±{MAX_SAVED_INTEGER}", field=f"{where}.{key}")
        return cls(
            Histogram.from_dict(data.get("per_second"), f"{where}.per_second"),
            float(data["first_s"]),
            float(data["last_s"]),
        )


# ---------------------------------------------------------------------------------------------
# Route and whole profile


def _merge_counts(a: Mapping[str, int], b: Mapping[str, int]) -> dict[str, int]:
    merged = Counter(a)
    merged.update(b)
    return dict(sorted(merged.items()))


_Mergeable = TypeVar("_Mergeable", Arrival, LogHistogram)
_Parsed = TypeVar("_Parsed")


def _merge_optional(a: _Mergeable | None, b: _Mergeable | None) -> _Mergeable | None:
    if a is None:
        return b
    if b is None:
        return a
    return a.merge(b)


@dataclass(frozen=True, slots=True, eq=False)
class RouteProfile:
    """Everything measured for one route. Histograms are exact; derived numbers are properties."""

    route: str
    output: CensoredHistogram  # output tokens
    total: CensoredHistogram  # prompt + output tokens, rows that logged a prompt
    prompt: Histogram  # prompt tokens
    max_tokens: Histogram  # requested max_tokens, rows that logged one
    joint: JointHistogram  # (prompt, output) on log bins
    finish_reasons: Mapping[str, int]
    models: Mapping[str, int]
    arrival: Arrival | None = None
    latency_ms: LogHistogram | None = None
    ttft_ms: LogHistogram | None = None

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, RouteProfile):
            return NotImplemented
        return all(getattr(self, f) == getattr(other, f) for f in _ROUTE_FIELDS)

    # unhashable, like the arrays it holds: a class that defines __eq__ gets __hash__ = None

    @property
    def requests(self) -> int:
        return self.output.total

    @property
    def tail(self) -> Tail:
        return classify_tail(self.output.summary())

    def merge(self, other: RouteProfile) -> RouteProfile:
        if other.route != self.route:
            raise ValueError(f"cannot merge route {other.route!r} into {self.route!r}")
        return RouteProfile(
            route=self.route,
            output=self.output.merge(other.output),
            total=self.total.merge(other.total),
            prompt=self.prompt.merge(other.prompt),
            max_tokens=self.max_tokens.merge(other.max_tokens),
            joint=self.joint.merge(other.joint),
            finish_reasons=_merge_counts(self.finish_reasons, other.finish_reasons),
            models=_merge_counts(self.models, other.models),
            arrival=_merge_optional(self.arrival, other.arrival),
            latency_ms=_merge_optional(self.latency_ms, other.latency_ms),
            ttft_ms=_merge_optional(self.ttft_ms, other.ttft_ms),
        )

    def renamed(self, route: str) -> RouteProfile:
        return RouteProfile(**{f: getattr(self, f) for f in _ROUTE_FIELDS} | {"route": route})

    def to_dict(self) -> dict[str, Any]:
        """The saved form: histograms, not percentiles."""
        return {
            "route": self.route,
            "output_tokens": self.output.to_dict(),
            "total_tokens": self.total.to_dict(),
            "prompt_tokens": self.prompt.to_dict(),
            "max_tokens": self.max_tokens.to_dict(),
            "joint": self.joint.to_dict(),
            "finish_reasons": dict(self.finish_reasons),
            "models": dict(self.models),
            "arrival": None if self.arrival is None else self.arrival.to_dict(),
            "latency_ms": None if self.latency_ms is None else self.latency_ms.to_dict(),
            "ttft_ms": None if self.ttft_ms is None else self.ttft_ms.to_dict(),
        }

    @classmethod
    def from_dict(cls, data: Any, where: str) -> RouteProfile:
        if not isinstance(data, Mapping):
            raise InputError("expected an object", field=where)
        route = data.get("route")
        if not isinstance(route, str):
            raise InputError("expected a string", field=f"{where}.route")

        def optional(key: str, parse: Callable[[Any, str], _Parsed]) -> _Parsed | None:
            value = data.get(key)
            return None if value is None else parse(value, f"{where}.{key}")

        output = CensoredHistogram.from_dict(data.get("output_tokens"), f"{where}.output_tokens")
        if output.total == 0:
            raise InputError("a route needs at least one request", field=f"{where}.output_tokens")
        return cls(
            route=route,
            output=output,
            total=CensoredHistogram.from_dict(data.get("total_tokens"), f"{where}.total_tokens"),
            prompt=Histogram.from_dict(data.get("prompt_tokens"), f"{where}.prompt_tokens"),
            max_tokens=Histogram.from_dict(data.get("max_tokens"), f"{where}.max_tokens"),
            joint=JointHistogram.from_dict(data.get("joint"), f"{where}.joint"),
            finish_reasons=_count_map(data.get("finish_reasons"), f"{where}.finish_reasons"),
            models=_count_map(data.get("models"), f"{where}.models"),
            arrival=optional("arrival", Arrival.from_dict),
            latency_ms=optional("latency_ms", LogHistogram.from_dict),
            ttft_ms=optional("ttft_ms", LogHistogram.from_dict),
        )


_ROUTE_FIELDS = tuple(RouteProfile.__dataclass_fields__)


def _count_map(data: Any, where: str) -> dict[str, int]:
    if not isinstance(data, Mapping) or not all(
        isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= MAX_SAVED_INTEGER
        for k, v in data.items()
    ):
        raise InputError(f"expected an object of integer counts from 0 to {MAX_SAVED_INTEGER}", field=where)
    return dict(sorted(data.items()))


def _string_map(data: Any, where: str) -> dict[str, str]:
    if not isinstance(data, Mapping) or not all(isinstance(k, str) and isinstance(v, str) for k, v in data.items()):
        raise InputError("expected an object of strings", field=where)
    return dict(data)


def _latency_summary(h: LogHistogram | None) -> dict[str, Any] | None:
    if h is None or h.total == 0:
        return None
    return {"requests": h.total, **{k: h.quantile(float(np.float64(p) / 100)) for k, p in PERCENTILES},
            "max": h.quantile(1.0)}


def route_summary(route: RouteProfile) -> dict[str, Any]:
    """One route of the `--json` output: percentiles and shares, not histograms."""
    output = route.output.summary()
    return {
        "route": route.route,
        "requests": route.requests,
        "censored": {"count": route.output.censored_count, "share": round(route.output.censored_share, 6)},
        "output_tokens": output.to_dict(),
        "prompt_tokens": summarize_plain(route.prompt).to_dict() if route.prompt.total else None,
        "total_tokens": route.total.summary().to_dict() if route.total.total else None,
        "tail": classify_tail(output).to_dict(),
        "max_tokens_requested": summarize_plain(route.max_tokens).to_dict() if route.max_tokens.total else None,
        "finish_reasons": dict(route.finish_reasons),
        "models": dict(route.models),
        "arrival": None if route.arrival is None else route.arrival.summary_dict(),
        "latency_ms": _latency_summary(route.latency_ms),
        "ttft_ms": _latency_summary(route.ttft_ms),
    }


@dataclass(frozen=True, slots=True)
class InputFile:
    """One input that went into a profile: a log file (rows, detected format) or a saved profile."""

    path: str
    format: str
    rows: int

    def to_dict(self) -> dict[str, Any]:
        return {"path": self.path, "format": self.format, "rows": self.rows}

    @classmethod
    def from_dict(cls, data: Any, where: str) -> InputFile:
        if (
            not isinstance(data, Mapping)
            or not isinstance(data.get("path"), str)
            or not isinstance(data.get("format"), str)
            or not isinstance(data.get("rows"), int)
            or isinstance(data.get("rows"), bool)
            or not 0 <= data["rows"] <= MAX_SAVED_INTEGER
        ):
            raise InputError("expected {path: str, format: str, rows: int}", field=where)
        return cls(data["path"], data["format"], data["rows"])


@dataclass(frozen=True, slots=True)
class Profile:
    """Route profiles (sorted by route) plus where they came from, what was skipped, and how
    many routes (and their requests) were folded into `*` to keep the profile to max_routes."""

    routes: tuple[RouteProfile, ...]
    inputs: tuple[InputFile, ...] = ()
    skipped: Mapping[str, int] = field(default_factory=dict)  # reason -> rows
    skip_examples: Mapping[str, str] = field(default_factory=dict)  # reason -> first location
    folded_routes: int = 0
    folded_requests: int = 0
    window: WindowReport | None = None  # read with --since/--until: what the window left out
    skipped_files: tuple[SkippedFile, ...] = ()  # files not read: --exclude matched them, or kvtune wrote them
    log_model: ModelSelection | None = None  # read with --log-model: what the selection left out

    def __post_init__(self) -> None:
        names = [r.route for r in self.routes]
        if len(set(names)) != len(names):
            raise ValueError("duplicate route names in a profile")
        object.__setattr__(self, "routes", tuple(sorted(self.routes, key=lambda r: r.route)))
        object.__setattr__(self, "skipped", dict(sorted(self.skipped.items())))
        object.__setattr__(self, "skip_examples", dict(self.skip_examples))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Profile):
            return NotImplemented
        return (self.routes, self.inputs, self.skipped, self.skip_examples, self.folded_routes,
                self.folded_requests, self.window, self.skipped_files, self.log_model) == (
            other.routes,
            other.inputs,
            other.skipped,
            other.skip_examples,
            other.folded_routes,
            other.folded_requests,
            other.window,
            other.skipped_files,
            other.log_model,
        )

    # unhashable, like the arrays it holds: a class that defines __eq__ gets __hash__ = None

    @property
    def requests(self) -> int:
        return sum(r.requests for r in self.routes)

    @property
    def skipped_rows(self) -> int:
        return sum(self.skipped.values())

    @property
    def notes(self) -> list[str]:
        """What a reader must know about the inputs besides the numbers: the files not read."""
        return skipped_file_notes(self.skipped_files)

    @property
    def models(self) -> dict[str, int]:
        """Rows per logged model over every route (rows that name none are not counted)."""
        counts: Counter[str] = Counter()
        for r in self.routes:
            counts.update(r.models)
        return dict(sorted(counts.items()))

    def route(self, name: str) -> RouteProfile:
        for r in self.routes:
            if r.route == name:
                return r
        raise KeyError(name)

    def combined(self, name: str = "*") -> RouteProfile:
        """All routes as one (for a single server-wide setting)."""
        if not self.routes:
            raise ValueError("empty profile")
        merged = self.routes[0].renamed(name)
        for r in self.routes[1:]:
            merged = merged.merge(r.renamed(name))
        return merged

    def merge(self, other: Profile) -> Profile:
        """Exact and order-independent in every histogram; inputs are listed in order, and each
        skip reason keeps its first example (self's, then other's new reasons after self's)."""
        by_name = {r.route: r for r in self.routes}
        for r in other.routes:
            by_name[r.route] = by_name[r.route].merge(r) if r.route in by_name else r
        return Profile(
            routes=tuple(by_name.values()),
            inputs=self.inputs + other.inputs,
            skipped=_merge_counts(self.skipped, other.skipped),
            skip_examples={**self.skip_examples,
                           **{k: v for k, v in other.skip_examples.items() if k not in self.skip_examples}},
            folded_routes=self.folded_routes + other.folded_routes,
            folded_requests=self.folded_requests + other.folded_requests,
            window=merge_reports(self.window, other.window),
            skipped_files=self.skipped_files + other.skipped_files,
            log_model=self.log_model.merge(other.log_model) if self.log_model is not None else other.log_model,
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": PROFILE_KIND,
            "schema_version": SCHEMA_VERSION,
            "routes": [r.to_dict() for r in self.routes],
            "inputs": [i.to_dict() for i in self.inputs],
            "skipped": dict(self.skipped),
            "skip_examples": dict(self.skip_examples),
            "folded": {"routes": self.folded_routes, "requests": self.folded_requests},
            **({"window": self.window.to_dict()} if self.window is not None else {}),
            **({"skipped_files": [_skipped_file_dict(f) for f in self.skipped_files]} if self.skipped_files else {}),
            **({"log_model": self.log_model.to_dict()} if self.log_model is not None else {}),
        }

    @classmethod
    def from_dict(cls, data: Any) -> Profile:
        """Parse a saved profile; errors name the field (the caller adds the file)."""
        if not isinstance(data, Mapping) or data.get("kind") != PROFILE_KIND:
            raise InputError(f"not a kvtune profile (expected kind = {PROFILE_KIND!r})", field="kind")
        version = data.get("schema_version")
        if version != SCHEMA_VERSION:
            raise InputError(
                f"unsupported version {brief(version)}; this kvtune reads version {SCHEMA_VERSION}",
                field="schema_version",
            )
        routes = data.get("routes")
        if not isinstance(routes, list):
            raise InputError("expected a list", field="routes")
        inputs = data.get("inputs", [])
        if not isinstance(inputs, list):
            raise InputError("expected a list", field="inputs")
        parsed = [RouteProfile.from_dict(r, f"routes[{i}]") for i, r in enumerate(routes)]
        if len({r.route for r in parsed}) != len(parsed):
            raise InputError("duplicate route names", field="routes")
        folded = _count_map(data.get("folded", {}), "folded")  # absent in profiles saved before it
        return cls(
            routes=tuple(parsed),
            inputs=tuple(InputFile.from_dict(x, f"inputs[{i}]") for i, x in enumerate(inputs)),
            skipped=_count_map(data.get("skipped", {}), "skipped"),
            skip_examples=_string_map(data.get("skip_examples", {}), "skip_examples"),
            folded_routes=folded.get("routes", 0),
            folded_requests=folded.get("requests", 0),
            window=WindowReport.from_dict(data["window"]) if data.get("window") is not None else None,
            skipped_files=_skipped_files(data.get("skipped_files", [])),
            log_model=ModelSelection.from_dict(data["log_model"]) if data.get("log_model") is not None else None,
        )

    def summary_dict(self) -> dict[str, Any]:
        """The stable `kvtune profile --json` object (fields documented in `kvtune profile --help`)."""
        return {
            "requests": self.requests,
            "routes": [route_summary(r) for r in self.routes],
            "skipped": {
                "count": self.skipped_rows,
                "reasons": dict(self.skipped),
                "examples": {k: v for k, v in self.skip_examples.items() if k in self.skipped},
            },
            "inputs": [i.to_dict() for i in self.inputs],
            "folded": {"routes": self.folded_routes, "requests": self.folded_requests, "into": "*"},
            **({"window": self.window.to_dict()} if self.window is not None else {}),
            "skipped_files": [_skipped_file_dict(f) for f in self.skipped_files],
            "notes": self.notes,
            "models": self.models,
            **({"log_model": self.log_model.to_dict()} if self.log_model is not None else {}),
        }


#: Files listed by name in a note; beyond this the note says how many more.
NOTE_FILES = 5


def skipped_file_notes(files: Iterable[SkippedFile]) -> list[str]:
    """One note for the files kvtune wrote and one for those --exclude left out, never silent."""
    own = [f for f in files if not f.reason.startswith("--exclude")]
    excluded = [f for f in files if f.reason.startswith("--exclude")]
    notes = []
    if own:
        notes.append(f"skipped {_files(len(own))} kvtune wrote (not logs): "
                     + _listed(f"{f.path} ({f.reason.partition(': ')[2]})" for f in own)
                     + "; --exclude GLOB leaves any file out by name")
    if excluded:
        notes.append(f"left out {_files(len(excluded))} matching --exclude: " + _listed(f.path for f in excluded))
    return notes


def _files(count: int) -> str:
    return f"{count:,} file" + ("" if count == 1 else "s")


def _listed(items: Iterable[str]) -> str:
    shown = list(items)
    more = len(shown) - NOTE_FILES
    return ", ".join(shown[:NOTE_FILES]) + (f" and {more:,} more" if more > 0 else "")


def _skipped_file_dict(f: SkippedFile) -> dict[str, str]:
    return {"path": f.path, "reason": f.reason}


def _skipped_files(data: Any) -> tuple[SkippedFile, ...]:
    if not isinstance(data, list) or not all(
            isinstance(x, Mapping) and set(x) == {"path", "reason"} and all(isinstance(v, str) for v in x.values())
            for x in data):
        raise InputError("expected a list of {path: str, reason: str}", field="skipped_files")
    return tuple(SkippedFile(x["path"], x["reason"]) for x in data)


def merge_profiles(profiles: Iterable[Profile]) -> Profile:
    """Many profiles as one: what merging them pairwise in order gives (`Profile.merge`), with each
    route's histograms summed in one sort rather than one per profile (a parallel map step's parts)."""
    merged = Profile(routes=())
    by_name: dict[str, list[RouteProfile]] = {}
    for p in profiles:
        merged = merged.merge(replace(p, routes=()))
        for r in p.routes:
            by_name.setdefault(r.route, []).append(r)
    return replace(merged, routes=tuple(_sum_routes(name, routes) for name, routes in by_name.items()))


def busiest_routes(requests: Mapping[str, int], max_routes: int) -> set[str]:
    """The route names a profile keeps, the same whether it is built from logs or merged from
    saved profiles: the `max_routes` with the most requests (ties by name), and `*` (the rows
    without a route, and where the others fold), which does not count against the limit."""
    named = [name for name in requests if name != "*"]
    star = {"*"} & set(requests)
    if len(named) <= max_routes:
        return set(named) | star
    return set(sorted(named, key=lambda name: (-requests[name], name))[:max_routes]) | star


def fold_routes(profile: Profile, max_routes: int | None) -> Profile:
    """The profile with only its `max_routes` busiest routes (besides `*`); the others summed
    into `*`.

    Exact: every histogram of `*` is the sum of those folded into it. The folded routes and
    their requests are added to the profile's note. None (or few enough routes) changes nothing.
    """
    if max_routes is None or sum(r.route != "*" for r in profile.routes) <= max_routes:
        return profile
    kept = busiest_routes({r.route: r.requests for r in profile.routes}, max_routes)
    into = [r for r in profile.routes if r.route not in kept or r.route == "*"]
    folded = [r for r in into if r.route != "*"]
    star = _sum_routes("*", into)
    return Profile(
        routes=(*(r for r in profile.routes if r.route in kept and r.route != "*"), star),
        inputs=profile.inputs,
        skipped=profile.skipped,
        skip_examples=profile.skip_examples,
        folded_routes=profile.folded_routes + len(folded),
        folded_requests=profile.folded_requests + sum(r.requests for r in folded),
        window=profile.window,
        skipped_files=profile.skipped_files,
        log_model=profile.log_model,
    )


def _sum_histograms(histograms: list[Histogram]) -> Histogram:
    """The exact sum of many histograms in one sort (merging them pairwise would be quadratic)."""
    if len(histograms) == 1:
        return histograms[0]
    return Histogram(np.concatenate([h.values for h in histograms]), np.concatenate([h.counts for h in histograms]))


def _sum_routes(name: str, routes: list[RouteProfile]) -> RouteProfile:
    """Many route profiles as one route, summed exactly."""

    def summed(get: Callable[[RouteProfile], Histogram]) -> Histogram:
        return _sum_histograms([get(r) for r in routes])

    arrivals = [r.arrival for r in routes if r.arrival is not None]
    latency = [r.latency_ms.bins for r in routes if r.latency_ms is not None]
    ttft = [r.ttft_ms.bins for r in routes if r.ttft_ms is not None]
    finish: Counter[str] = Counter()
    models: Counter[str] = Counter()
    for r in routes:
        finish.update(r.finish_reasons)
        models.update(r.models)
    return RouteProfile(
        route=name,
        output=CensoredHistogram(summed(lambda r: r.output.uncensored), summed(lambda r: r.output.censored)),
        total=CensoredHistogram(summed(lambda r: r.total.uncensored), summed(lambda r: r.total.censored)),
        prompt=summed(lambda r: r.prompt),
        max_tokens=summed(lambda r: r.max_tokens),
        joint=JointHistogram(
            np.concatenate([r.joint.prompt_bins for r in routes]),
            np.concatenate([r.joint.output_bins for r in routes]),
            np.concatenate([r.joint.counts for r in routes]),
        ),
        finish_reasons=dict(sorted(finish.items())),
        models=dict(sorted(models.items())),
        arrival=Arrival(
            _sum_histograms([a.per_second for a in arrivals]),
            min(a.first_s for a in arrivals),
            max(a.last_s for a in arrivals),
        ) if arrivals else None,
        latency_ms=LogHistogram(_sum_histograms(latency)) if latency else None,
        ttft_ms=LogHistogram(_sum_histograms(ttft)) if ttft else None,
    )
