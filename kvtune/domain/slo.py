"""Latency objectives (an SLO): shared by bench (goodput, verdict), sim (goodput of a simulated
run) and policy (what-if, search, the latency bound), so it lives on the floor."""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvtune.errors import OptionError

__all__ = ["Slo", "parse_slo", "SLO_KEYS"]

SLO_KEYS = ("ttft", "tpot", "e2e")


@dataclass(frozen=True, slots=True)
class Slo:
    """Latency objectives in ms; None = not constrained."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2e_ms: float | None = None

    def meets(self, ok: bool, ttft_ms: float | None, tpot_ms: float | None, e2e_ms: float | None) -> bool:
        """Whether a request known by its figures meets every objective; a TPOT objective holds
        trivially for one-token answers (no TPOT)."""
        if not ok:
            return False
        if self.ttft_ms is not None and (ttft_ms is None or ttft_ms > self.ttft_ms):
            return False
        if self.tpot_ms is not None and tpot_ms is not None and tpot_ms > self.tpot_ms:
            return False
        return not (self.e2e_ms is not None and (e2e_ms is None or e2e_ms > self.e2e_ms))

    def to_dict(self) -> dict[str, float | None]:
        return {"ttft_ms": self.ttft_ms, "tpot_ms": self.tpot_ms, "e2e_ms": self.e2e_ms}


def parse_slo(text: str) -> Slo:
    """'ttft=500,tpot=50,e2e=10000' (ms) → Slo; a bad key or value is a KvtuneError."""
    values: dict[str, float] = {}
    for part in text.split(","):
        key, sep, raw = part.strip().partition("=")
        key = key.strip().lower().removesuffix("_ms")
        if not sep or key not in SLO_KEYS:
            raise OptionError(f"expected KEY=MS pairs with keys {', '.join(SLO_KEYS)}, got {part.strip()!r}",
                              field="slo")
        try:
            value = float(raw.strip().removesuffix("ms"))
        except ValueError:
            raise OptionError(f"{key}: expected milliseconds, got {raw.strip()!r}", field="slo") from None
        if not math.isfinite(value) or value <= 0:
            raise OptionError(f"{key}: expected a positive number of milliseconds, got {raw.strip()!r}",
                              field="slo")
        if key in values:
            raise OptionError(f"{key} given twice", field="slo")
        values[key] = value
    return Slo(values.get("ttft"), values.get("tpot"), values.get("e2e"))
