"""The flow-control queue's settings (gateway.yaml `flow:`): priority bands with their deadlines,
flows and their weights, the queue's bounds and the per-token time its forecast runs on.

gateway.yaml's reader builds it, the gateway's and the simulator's gate run on it, and recommend
writes it, so it lives on the floor. docs/guides/flow-control.md is the specification."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

__all__ = ["Band", "FlowControl", "DEFAULT_BAND_HEADER", "DEFAULT_FLOW_HEADER", "WAIT_BUCKETS_S", "MAX_BANDS"]

DEFAULT_BAND_HEADER = "x-kvtune-priority"
DEFAULT_FLOW_HEADER = "x-kvtune-flow"
MAX_BANDS = 8
#: The wait-time histogram's buckets (seconds), the same in both enforcers.
WAIT_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


@dataclass(frozen=True, slots=True)
class Band:
    """A priority band: its name, its TTFT target (a request must be admitted within it) and the
    blocks of each upstream's ledger the bands after it may not take (trunk reservation)."""

    name: str
    deadline_s: float
    reserve_blocks: int = 0


@dataclass(frozen=True, slots=True)
class FlowControl:
    """gateway.yaml `flow:`; bands highest priority first."""

    token_time_s: float
    bands: tuple[Band, ...]
    default_band: str | None = None  # None: the first band
    band_header: str = DEFAULT_BAND_HEADER
    flow_header: str = DEFAULT_FLOW_HEADER
    default_weight: float = 1.0
    weights: Mapping[str, float] = field(default_factory=lambda: MappingProxyType({}))
    max_waiting: int = 1024
    max_waiting_per_flow: int = 64
    max_flows: int = 1024
    metrics_flows: int = 10

    def __post_init__(self) -> None:
        if not self.bands or len(self.bands) > MAX_BANDS:
            raise ValueError(f"flow control needs 1 to {MAX_BANDS} bands, got {len(self.bands)}")
        names = [b.name for b in self.bands]
        if len(set(names)) != len(names):
            raise ValueError("band names must be unique")
        if self.default_band is not None and self.default_band not in names:
            raise ValueError(f"default_band {self.default_band!r} is not a band")
        if self.token_time_s <= 0:
            raise ValueError("token_time_s must be positive")
        if any(b.reserve_blocks < 0 for b in self.bands):
            raise ValueError("reserve_blocks must be at least 0")
        if self.bands[-1].reserve_blocks:
            raise ValueError("the last band has no band below it to hold back: its reserve_blocks must be 0")

    def kept_blocks(self, band: int) -> int:
        """K_b: the blocks a request of band `band` must leave free, the reserves of the bands
        before it (docs/guides/flow-control.md, The reserve); 0 for the first band."""
        return sum(b.reserve_blocks for b in self.bands[:band])

    @property
    def reserve_blocks(self) -> int:
        """All bands' reserves together: what the last band keeps free."""
        return sum(b.reserve_blocks for b in self.bands)

    def band_index(self, name: str | None) -> int | None:
        """The position of the band called `name` (0 = highest priority), None if there is none."""
        for i, band in enumerate(self.bands):
            if band.name == name:
                return i
        return None

    @property
    def default_band_index(self) -> int:
        index = self.band_index(self.default_band)
        return 0 if index is None else index

    def weight(self, flow: str) -> float:
        return self.weights.get(flow, self.default_weight)

    def to_dict(self) -> dict:
        """As gateway.yaml writes it."""
        out: dict = {"token_time_s": self.token_time_s,
                     "bands": [{"name": b.name, "deadline_s": b.deadline_s}
                               | ({"reserve_blocks": b.reserve_blocks} if b.reserve_blocks else {})
                               for b in self.bands]}
        if self.default_band is not None:
            out["default_band"] = self.default_band
        out.update(band_header=self.band_header, flow_header=self.flow_header, default_weight=self.default_weight)
        if self.weights:
            out["weights"] = dict(self.weights)
        out.update(max_waiting=self.max_waiting, max_waiting_per_flow=self.max_waiting_per_flow,
                   max_flows=self.max_flows, metrics_flows=self.metrics_flows)
        return out
