"""When each request of a load is sent: the offsets a sender (kvtune.bench) waits for and the
simulator (kvtune.sim) draws, from one function, so the same seed sends at the same times.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from kvtune.domain.load_shape import LoadShape

__all__ = ["arrival_offsets"]


def arrival_offsets(shape: LoadShape, rng: np.random.Generator, block: int = 4096) -> Iterator[float]:
    """Send offsets in seconds from the start, increasing; endless for rate shapes."""
    if shape.offsets_s is not None:
        yield from shape.offsets_s
        return
    assert shape.rate_rps is not None
    b = shape.burstiness
    t = 0.0
    while True:
        gaps = rng.gamma(shape=b, scale=1.0 / (shape.rate_rps * b), size=block)
        times = t + np.cumsum(gaps)
        # the first request goes at t = 0, as a sender starts; then the gaps
        yield t
        yield from times[:-1].tolist()
        t = float(times[-1])
