"""A transient progress bar on stderr that starts on the first update (after an optional delay)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rich.progress import Progress


@contextlib.contextmanager
def transient_bar(progress: Progress, task: str, *,
                  delay_s: float = 0.0) -> Iterator[Callable[[int, int], None]]:
    """An `update(done, total)` callback driving `progress`: nothing is drawn until an update
    arrives `delay_s` after the start (fast work never flashes a bar), and the bar is gone after."""
    started = time.monotonic()
    task_id = None

    def update(done: int, total: int) -> None:
        nonlocal task_id
        if task_id is None:
            if time.monotonic() - started < delay_s:
                return
            progress.start()
            task_id = progress.add_task(task, total=total)
        progress.update(task_id, completed=done, total=total)

    try:
        yield update
    finally:
        if task_id is not None:
            progress.stop()
