"""The door to `kvtune capacity`: a deployment planned on its measured or estimated KV pool
(kvtune.planning), and whether one request at max_model_len fits it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvtune.capacity.plan import CapacityReport
from kvtune.capacity.reservation import RequestShape
from kvtune.domain.deployment import Deployment, Measurement
from kvtune.planning import Plan, measured_capacity, plan
from kvtune.policy import feasibility

if TYPE_CHECKING:
    from kvtune.domain.feasibility import Verdict


@dataclass(frozen=True, slots=True)
class CapacityFit:
    """What `kvtune capacity` reports: the plan's capacity report, and whether one request at
    max_model_len (and one of each asked shape) fits the pool (`verdict.fits`, `verdict.why`)."""

    report: CapacityReport
    verdict: Verdict

    def to_dict(self) -> dict[str, Any]:
        """`kvtune capacity --json`: the report around a capacity file's fields (a `--capacity FILE`
        for simulate and recommend), and the verdict."""
        doc = self.report.to_dict()
        record = {k: v for k, v in self.report.capacity_file().to_dict().items() if k not in doc}
        return {**doc, **record, "fits": self.verdict.fits, "why": self.verdict.why}


def capacity_fit(deployment: Deployment, measured: Measurement | None = None,
                 shapes: Sequence[RequestShape] = ()) -> CapacityFit:
    """How many tokens, blocks and requests of `shapes` fit on the deployment (its `measured`
    capacity, else the memory estimate), and whether it can serve one request at max_model_len.

    >>> fit = kvtune.capacity_fit(kvtune.Deployment("llama-3.1-8b", gpu="H100-80GB"))
    >>> fit.verdict.fits, fit.report.capacity.block_size
    (True, 16)
    """
    report = plan(deployment, measured=measured or Measurement(), shapes=tuple(shapes)).report
    return CapacityFit(report, feasibility.capacity_verdict(report.engine, report.capacity))


__all__ = ["plan", "measured_capacity", "Plan", "capacity_fit", "CapacityFit"]
