"""The load options `bench` and `simulate` share: one load shape and at least one bound, as the
one `load: LoadArgs` object both commands take."""

from __future__ import annotations

from dataclasses import dataclass

import click

from kvtune.cli.options import grouped
from kvtune.domain.load_shape import Load, LoadShape


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

    def as_load(self, seed: int = 0) -> Load:
        """The load kvtune.api takes (its checks are Load.check's)."""
        return Load(rate_rps=self.rate, burstiness=self.burstiness, concurrency=self.concurrency, replay=self.replay,
                    speedup=self.speedup, max_requests=self.max_requests, duration_s=self.duration_s, seed=seed)

    def check(self, logs: tuple[str, ...]) -> None:
        self.as_load().check(from_logs=bool(logs))

    def shape(self) -> LoadShape:
        """The open- or closed-loop shape (replay shapes come from the logs' timestamps)."""
        return self.as_load().shape()


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
