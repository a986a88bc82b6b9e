"""The traffic a simulation serves, drawn exactly as `kvtune bench` draws it.

Lengths come from bench's own sampler (kvtune.workload.draw.Workload.draw, same seed, same
route mix, same clamping to max_model_len) and send times from bench's own load shapes
(kvtune.workload.arrivals.arrival_offsets with the seed + 1 stream bench uses), bounded the way
bench's driver bounds a run: at most --requests, none sent at or after --duration. So for a seed
the simulated requests are the benchmarked ones. A closed loop (--concurrency) has no send times
up front: the engine's ClosedLoop sends each client's next request when its previous one ends.

Each request reaches the engine `overhead_s` after its client sent it (the calibrated HTTP and
tokenizing overhead); latencies are counted from the send, as bench counts them.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from kvtune.domain.load_shape import LoadShape
from kvtune.profile.routes import Profile
from kvtune.sim.engine import ClosedLoop
from kvtune.sim.requests import Workload
from kvtune.workload.arrivals import arrival_offsets
from kvtune.workload.draw import PromptSynth
from kvtune.workload.draw import Workload as BenchWorkload

# a closed loop bounded by time alone draws this many requests first, then twice as many, ...
CLOSED_LOOP_FIRST_DRAW = 4096
MAX_REQUESTS = 50_000_000  # no --duration-bounded run draws more


@dataclass(frozen=True, slots=True)
class Traffic:
    """Requests as the engine sees them, the lengths the clients asked for, and how they are sent."""

    workload: Workload  # arrival = send + overhead_s; output already capped by the gateway's route
    requested_output: np.ndarray  # drawn output lengths (the max_tokens sent)
    route: tuple[str, ...]  # per request
    routes: tuple[str, ...]
    closed_loop: ClosedLoop | None
    overhead_s: float
    clamped: Counter

    def __len__(self) -> int:
        return len(self.workload)


# where a simulation's load came from: an option, the logs' own arrivals, or the fallback
LOAD_OPTION, LOAD_LOGS, LOAD_DEFAULT = "option", "logs", "default"


def logged_rate(profile: Profile, routes: Sequence[str] = ()) -> float | None:
    """The logs' mean arrival rate in requests/s over the routes simulated (all when none are
    named): their requests over the span of their timestamps; None when the logs carry none."""
    chosen = tuple(r for r in profile.routes if not routes or r.route in routes)
    if not chosen:
        return None
    arrival = Profile(routes=chosen).combined().arrival
    rate = None if arrival is None else arrival.mean_rate_rps
    return rate if rate is not None and rate > 0 else None


def default_load(profile: Profile, routes: Sequence[str] = (), *, burstiness: float = 1.0
                 ) -> tuple[LoadShape, str, str | None]:
    """The load to simulate when none is given: Poisson arrivals at the logs' mean rate; logs
    without timestamps have none, and then one client at a time (synchronous), said in the note."""
    rate = logged_rate(profile, routes)
    if rate is not None:
        return LoadShape.rate(round(rate, 6), burstiness), LOAD_LOGS, None
    return (LoadShape.closed(1), LOAD_DEFAULT,
            "the logs carry no timestamps to take an arrival rate from: simulating one client at a time "
            "(--concurrency 1); give --rate R or --concurrency C for another load")


def _synth(max_model_len: int) -> PromptSynth:
    """No prompt text: the lengths and their clamping are all a simulation needs of bench's draw."""
    return PromptSynth((), 0, "assumed", max_model_len)


def draw_profile(profile: Profile, routes: Sequence[str], *, seed: int, n: int,
                 max_model_len: int) -> tuple[list[tuple[str, int, int]], Counter]:
    """The first `n` (route, prompt, output) draws `kvtune bench` makes for this profile and seed."""
    wl = BenchWorkload.from_profile(profile, routes, _synth(max_model_len), seed)
    return [wl.draw(i) for i in range(n)], wl.clamped


def send_offsets(shape: LoadShape, *, seed: int, max_requests: int | None, duration_s: float | None) -> list[float]:
    """Open-loop send times, bounded as bench's driver bounds them."""
    if max_requests is None and duration_s is None and shape.offsets_s is None:
        raise ValueError("an open loop needs a bound: max_requests and/or duration_s")
    out: list[float] = []
    for offset in arrival_offsets(shape, np.random.default_rng(seed + 1)):
        if max_requests is not None and len(out) >= max_requests:
            break
        if duration_s is not None and offset >= duration_s:
            break
        if len(out) >= MAX_REQUESTS:
            raise ValueError(f"more than {MAX_REQUESTS:,} requests: bound the run with --requests")
        out.append(offset)
    return out


def build_traffic(draws: Sequence[tuple[str, int, int]], sends: Sequence[float] | None, *, overhead_s: float,
                  cap: Callable[[str, int, int], int] | None, closed_loop: ClosedLoop | None,
                  clamped: Counter) -> Traffic:
    """Columns for the engine; `cap(route, prompt, max_tokens)` is the gateway's output cap, if one runs."""
    n = len(draws)
    route = tuple(r for r, _, _ in draws)
    prompt = np.fromiter((p for _, p, _ in draws), dtype=np.int64, count=n)
    asked = np.fromiter((o for _, _, o in draws), dtype=np.int64, count=n)
    output = asked if cap is None else np.fromiter(
        (min(o, cap(r, p, o)) for r, p, o in zip(route, prompt.tolist(), asked.tolist(), strict=True)),
        dtype=np.int64, count=n)
    arrival = np.zeros(n) if sends is None else np.asarray(sends, dtype=np.float64) + overhead_s
    return Traffic(Workload.from_columns(arrival, prompt, np.maximum(output, 1), asked), asked, route,
                   tuple(sorted(set(route))), closed_loop, overhead_s, clamped)


def profile_traffic(profile: Profile, routes: Sequence[str], shape: LoadShape, *, seed: int, max_requests: int | None,
                    duration_s: float | None, max_model_len: int, overhead_s: float,
                    cap: Callable[[str, int, int], int] | None = None, closed_n: int | None = None) -> Traffic:
    """Bench's traffic for a profile; a closed loop draws `closed_n` (default --requests) requests."""
    if shape.open_loop:
        sends: list[float] | None = send_offsets(shape, seed=seed, max_requests=max_requests, duration_s=duration_s)
        n = len(sends or ())
        loop = None
    else:
        sends = None
        n = closed_n or max_requests or CLOSED_LOOP_FIRST_DRAW
        loop = ClosedLoop(shape.concurrency or 1, overhead_s, duration_s)
    draws, clamped = draw_profile(profile, routes, seed=seed, n=n, max_model_len=max_model_len)
    return build_traffic(draws, sends, overhead_s=overhead_s, cap=cap, closed_loop=loop, clamped=clamped)


def replay_traffic(rows: Sequence[tuple[str, int, int]], stamps: Sequence[float], *, speedup: float, seed: int,
                   max_requests: int | None, duration_s: float | None, max_model_len: int, overhead_s: float,
                   cap: Callable[[str, int, int], int] | None = None) -> Traffic:
    """The logs' own requests at their own times (divided by `speedup`), as `bench --replay` sends them."""
    shape = LoadShape.replay(stamps, speedup)
    limit = min(max_requests or len(rows), len(rows))
    sends = send_offsets(shape, seed=seed, max_requests=limit, duration_s=duration_s)
    wl = BenchWorkload.from_rows(list(rows), _synth(max_model_len), seed)
    draws = [wl.draw(i) for i in range(len(sends))]
    return build_traffic(draws, sends, overhead_s=overhead_s, cap=cap, closed_loop=None, clamped=wl.clamped)


__all__ = ["Traffic", "logged_rate", "default_load", "LOAD_OPTION", "LOAD_LOGS", "LOAD_DEFAULT",
           "draw_profile", "send_offsets", "build_traffic", "profile_traffic", "replay_traffic",
           "CLOSED_LOOP_FIRST_DRAW", "MAX_REQUESTS"]
