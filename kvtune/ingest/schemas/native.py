"""kvtune's own flat format: one row per request with columns named like `kvtune.ingest.COLUMNS`.

Any container works (JSONL, CSV, Parquet); it is the fastest path and what the benchmark uses.
"""

from __future__ import annotations

from kvtune.ingest.schemas._base import TARGETS, TEXT_TARGETS, Adapter, Flat

# Every target a row can fill but the raw texts: the native format carries counts, not prompts.
_NATIVE_COLUMNS = tuple(t for t in TARGETS if t not in TEXT_TARGETS)


def _match(record) -> bool:
    return "output_tokens" in record and any(
        k in record for k in ("route", "prompt_tokens", "finish_reason", "max_tokens", "model")
    )


KVTUNE = Adapter(
    name="kvtune",
    description="kvtune flat rows: route, model, prompt_tokens, output_tokens, max_tokens, "
    "finish_reason, censored, timestamp_s, latency_ms, ttft_ms (JSONL, CSV or Parquet)",
    match=_match,
    flat=Flat(columns={c: c for c in _NATIVE_COLUMNS}),
)
