"""Schema adapters, one module per log family, and the order detection tries them in.

Order matters: specific shapes (OTLP, Batch, Responses, Anthropic, Chat) come before the loose
ones (kvtune flat rows), following the reference doc §2.13.
"""

from __future__ import annotations

from kvtune.ingest.schemas._base import REGISTRY, Adapter, Flat
from kvtune.ingest.schemas.gateways import HELICONE, LANGFUSE, LITELLM_PAYLOAD, LITELLM_SPEND
from kvtune.ingest.schemas.native import KVTUNE
from kvtune.ingest.schemas.openai import (
    ANTHROPIC,
    BATCH_INPUT,
    BATCH_OUTPUT,
    OPENAI,
    PAIR,
    RESPONSES,
)
from kvtune.ingest.schemas.otel import OTEL
from kvtune.ingest.schemas.traces import AZURE, BURSTGPT, MOONCAKE, SPLITWISE, VIDUR

ADAPTERS: tuple[Adapter, ...] = (
    OTEL,
    BATCH_OUTPUT,
    BATCH_INPUT,
    RESPONSES,
    ANTHROPIC,
    OPENAI,
    PAIR,
    LITELLM_SPEND,
    LITELLM_PAYLOAD,
    LANGFUSE,
    HELICONE,
    AZURE,
    BURSTGPT,
    MOONCAKE,
    SPLITWISE,
    VIDUR,
    KVTUNE,
)

REGISTRY.update({a.name: a for a in ADAPTERS})
BY_NAME: dict[str, Adapter] = REGISTRY

# --format names and what each reads; "fields" = only the --field mapping, no detection.
FORMATS: dict[str, str] = {a.name: a.description for a in ADAPTERS}
FORMATS["fields"] = "any flat records described only by --field target=column mappings"

__all__ = ["ADAPTERS", "BY_NAME", "FORMATS", "Adapter", "Flat"]
