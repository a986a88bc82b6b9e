"""The load options `bench` and `simulate` share: one load shape and at least one bound, as the
one `load: LoadArgs` object both commands take."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import click

from kvtune.cli.options import grouped
from kvtune.errors import OptionError

if TYPE_CHECKING:
    from kvtune.domain.load_shape import LoadShape


@dataclass(frozen=True, slots=True)
class LoadArgs:
    """When requests are sent and how many: one load shape and at least one bound."""

    rate: float | None
    burstiness: float
    concurrency: int | None
    replay: bool
    speedup: float
    max_requests: int | None
    duration_s: float | None

    def check(self, logs: tuple[str, ...]) -> None:
        given = {"--rate": self.rate is not None, "--concurrency": self.concurrency is not None,
                 "--replay": self.replay}
        shapes = [name for name, on in given.items() if on]
        if len(shapes) > 1:
            raise OptionError(f"give one load shape, not {' and '.join(shapes)}", field=shapes[1])
        if self.replay and not logs:
            raise OptionError("--replay needs LOGS with per-request timestamps (a profile keeps none)",
                              field="--replay")
        if not self.replay and self.max_requests is None and self.duration_s is None:
            raise OptionError("a run must be bounded: give --requests N and/or --duration S", field="--requests")

    def shape(self) -> LoadShape:
        """The open- or closed-loop shape (replay shapes come from the logs' timestamps)."""
        from kvtune.domain.load_shape import LoadShape

        if self.rate is not None:
            return LoadShape.rate(self.rate, self.burstiness)
        return LoadShape.closed(self.concurrency or 1)


load_options = grouped("load", LoadArgs, [
    click.option("--rate", type=click.FloatRange(min=0, min_open=True), metavar="R",
                 help="Open loop: R requests/s, Poisson gaps (gamma with --burstiness)."),
    click.option("--burstiness", type=click.FloatRange(min=0, min_open=True), default=1.0, show_default=True,
                 help="Gamma shape of the gaps at --rate: 1 Poisson, <1 burstier, >1 smoother."),
    click.option("--concurrency", type=click.IntRange(min=1), metavar="C",
                 help="Closed loop: C requests always in flight (1 = synchronous).  [default: 1]"),
    click.option("--replay", is_flag=True, help="Send LOGS' requests at their own timestamps."),
    click.option("--speedup", type=click.FloatRange(min=0, min_open=True), default=1.0, show_default=True,
                 help="With --replay: divide the logs' time gaps by X."),
    click.option("--requests", "max_requests", type=click.IntRange(min=1), metavar="N",
                 help="Send at most N requests."),
    click.option("--duration", "duration_s", type=click.FloatRange(min=0, min_open=True), metavar="S",
                 help="Stop sending after S seconds (in-flight requests finish)."),
])


__all__ = ["LoadArgs", "load_options"]
