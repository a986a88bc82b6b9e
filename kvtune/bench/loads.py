"""Load shapes: when each request is sent.

Open loop (the server cannot slow the sender down): `poisson` (exponential gaps, GuideLLM's
word), `gamma` (vLLM's `--burstiness`: shape B, same mean rate; B < 1 burstier, B > 1 smoother)
and `replay` (the logs' own timestamps divided by a speedup). Closed loop: `concurrent` (C
requests always in flight; `synchronous` is C = 1). Every shape is bounded by a request count
and/or a duration; sending stops at the first bound reached, in-flight requests then finish.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine
from typing import Any

import numpy as np

from kvtune.domain.load_shape import LoadShape
from kvtune.workload.arrivals import arrival_offsets

__all__ = ["drive"]


async def drive(
    shape: LoadShape,
    launch: Callable[[int], Coroutine[Any, Any, Any]],
    *,
    max_requests: int | None,
    duration_s: float | None,
    rng: np.random.Generator,
    clock: Callable[[], float] = time.perf_counter,
) -> int:
    """Call `launch(i)` for i = 0, 1, … in the shape's rhythm until a bound; wait for all.

    Returns how many were launched. Each launch runs in this call's TaskGroup, so cancelling
    the caller cancels every request in flight (each records its own partial result).
    """
    if max_requests is None and duration_s is None and shape.offsets_s is None:
        raise ValueError("a load needs a bound: max_requests and/or duration_s")
    start = clock()
    deadline = None if duration_s is None else start + duration_s
    launched = 0
    async with asyncio.TaskGroup() as tg:
        if shape.open_loop:
            for offset in arrival_offsets(shape, rng):
                if max_requests is not None and launched >= max_requests:
                    break
                if duration_s is not None and offset >= duration_s:
                    break
                delay = start + offset - clock()
                if delay > 0:
                    await asyncio.sleep(delay)
                tg.create_task(launch(launched))
                launched += 1
        else:
            counter = iter(range(max_requests if max_requests is not None else 1 << 62))

            async def worker() -> None:
                nonlocal launched
                for i in counter:
                    if deadline is not None and clock() >= deadline:
                        return
                    launched += 1
                    await launch(i)

            for _ in range(shape.concurrency or 1):
                tg.create_task(worker())
    return launched
