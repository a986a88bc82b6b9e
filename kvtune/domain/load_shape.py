"""The load a sender puts on a server (closed loop, Poisson or gamma arrivals, a replay): bench
sends it, simulate draws it, recommend --objective searches under it, so it lives on the floor."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvtune.errors import OptionError

__all__ = ["LoadKind", "LoadShape", "Load"]


class LoadKind(enum.Enum):
    SYNCHRONOUS = "synchronous"  # closed loop, one request at a time
    CONCURRENT = "concurrent"  # closed loop, C in flight
    POISSON = "poisson"  # open loop, exponential gaps
    GAMMA = "gamma"  # open loop, gamma gaps of shape B (vLLM's --burstiness)
    REPLAY = "replay"  # open loop, the logs' own timestamps


@dataclass(frozen=True, slots=True)
class LoadShape:
    """What the sender does, and at what rate, concurrency or speed."""

    kind: LoadKind
    rate_rps: float | None = None
    burstiness: float = 1.0
    concurrency: int | None = None
    speedup: float = 1.0
    offsets_s: tuple[float, ...] | None = None  # replay: send times from the start, already sped up

    @classmethod
    def rate(cls, rate_rps: float, burstiness: float = 1.0) -> LoadShape:
        if not rate_rps > 0 or not burstiness > 0:
            raise ValueError("rate and burstiness must be positive")
        return cls(LoadKind.POISSON if burstiness == 1.0 else LoadKind.GAMMA, rate_rps=rate_rps, burstiness=burstiness)

    @classmethod
    def closed(cls, concurrency: int) -> LoadShape:
        if concurrency < 1:
            raise ValueError("concurrency must be at least 1")
        return cls(LoadKind.SYNCHRONOUS if concurrency == 1 else LoadKind.CONCURRENT, concurrency=concurrency)

    @classmethod
    def replay(cls, timestamps_s: Sequence[float], speedup: float = 1.0) -> LoadShape:
        """Send times from log timestamps (any origin, any order), divided by `speedup`."""
        import numpy as np  # only to replay: `simulate --help` and `bench --help` start without it

        if not speedup > 0:
            raise ValueError("speedup must be positive")
        ts = np.sort(np.asarray(timestamps_s, dtype=np.float64))
        offsets = (ts - ts[0]) / speedup if ts.size else ts
        return cls(LoadKind.REPLAY, speedup=speedup, offsets_s=tuple(offsets.tolist()))

    @property
    def open_loop(self) -> bool:
        return self.concurrency is None

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind.value,
            "rate_rps": self.rate_rps,
            "burstiness": self.burstiness if self.rate_rps is not None else None,
            "concurrency": self.concurrency,
            "speedup": self.speedup if self.kind is LoadKind.REPLAY else None,
        }


@dataclass(frozen=True, slots=True)
class Load:
    """A run's load as a caller asks for it (bench sends it, simulate draws it): one shape
    (`rate_rps` with `burstiness`, or `concurrency`; neither: simulate takes the logs' mean
    arrival rate, bench one client), or a `replay` of the logs' own timestamps at `speedup`;
    bounded by `max_requests` and/or `duration_s` (a replay also by its rows); `seed` draws the
    lengths, prompts and gaps, so bench and simulate given one seed send the same requests."""

    rate_rps: float | None = None
    burstiness: float = 1.0
    concurrency: int | None = None
    replay: bool = False
    speedup: float = 1.0
    max_requests: int | None = None
    duration_s: float | None = None
    seed: int = 0

    def check(self, from_logs: bool) -> None:
        """One shape, and a bound; a replay needs logs (`from_logs`: a profile keeps no timestamps).
        The fields are named as the command line's options are (`rate`, `max_requests`)."""
        given = {"rate": self.rate_rps is not None, "concurrency": self.concurrency is not None,
                 "replay": self.replay}
        shapes = [name for name, on in given.items() if on]
        if len(shapes) > 1:
            raise OptionError(f"give one load shape, not {' and '.join(f'`{s}`' for s in shapes)}", field=shapes[1])
        if self.replay and not from_logs:
            raise OptionError("`replay` needs LOGS with per-request timestamps (a profile keeps none)",
                              field="replay")
        if not self.replay and self.max_requests is None and self.duration_s is None:
            raise OptionError("a run must be bounded: give `max_requests` N and/or `duration_s` S",
                              field="max_requests")

    @property
    def given(self) -> bool:
        """Whether a rate or a concurrency was asked for (else each command's default load)."""
        return self.rate_rps is not None or self.concurrency is not None

    def shape(self) -> LoadShape:
        """The open- or closed-loop shape (a replay's comes from the logs' timestamps)."""
        if self.rate_rps is not None:
            return LoadShape.rate(self.rate_rps, self.burstiness)
        return LoadShape.closed(self.concurrency or 1)
