"""estimates.json (and estimates.yaml): a recommendation's per-route caps, output-length
quantiles and per-request KV reservations as a small, versioned file another gateway can read
(llm-d's scheduler plugins, a LiteLLM config, your own router), without kvtune's gateway.

The format is documented in docs/reference/formats.md and described by a JSON Schema shipped
beside this module (schemas/estimates-v1.schema.json); `version` changes when a field's meaning
does, fields are only added otherwise.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from kvtune.deploy.render import RenderOptions, upstream_budgets
from kvtune.policy.route_table import CATCH_ALL_ROUTE
from kvtune.version import __version__

if TYPE_CHECKING:
    from kvtune.domain.recommendation import Recommendation, RouteRecommendation

FORMAT = "kvtune-estimates"
VERSION = 1
JSON_FILE = "estimates.json"
YAML_FILE = "estimates.yaml"
SCHEMA_PATH = Path(__file__).parent / "schemas" / "estimates-v1.schema.json"


def _blocks(tokens: float, block_size: int) -> int:
    return math.ceil(tokens / block_size)


def _route(route: RouteRecommendation, block_size: int) -> dict[str, Any]:
    out = route.output_tokens
    prompt = route.prompt_tokens
    expected_tokens = (prompt.mean if prompt else 0.0) + min(out.mean, route.cap)
    return {
        "name": str(route.route) or "(unnamed)",
        "match": None if route.match is None else route.match.to_dict(),
        "requests": route.requests,
        "share": round(route.share, 6),
        "max_new_tokens": route.cap,
        "truncation_share": round(route.truncation_share, 6),
        "tail": route.tail.value,
        "output_tokens": {"p50": out.p50, "p90": out.p90, "p99": out.p99, "max": out.max, "mean": round(out.mean, 3),
                          "lower_bound": any((out.lower_bound or {}).get(k, False) for k in ("p50", "p90", "p99"))},
        "prompt_tokens": None if prompt is None else {"p50": prompt.p50, "p90": prompt.p90, "p99": prompt.p99,
                                                      "max": prompt.max, "mean": round(prompt.mean, 3)},
        "output_blocks_at_cap": _blocks(route.cap, block_size),
        "reservation_blocks": route.reservation_blocks.to_dict(),
        "expected_blocks": _blocks(expected_tokens, block_size),
    }


def estimates(rec: Recommendation, options: RenderOptions | None = None) -> dict[str, Any]:
    """The estimates document (see the module docstring) as plain data."""
    options = options or RenderOptions()
    block_size = rec.capacity.block_size
    return {
        "format": FORMAT,
        "version": VERSION,
        "kvtune_version": __version__,
        "model": rec.served_model or rec.model,
        "engine": rec.engine.to_dict(),
        "block_size": block_size,
        "max_model_len": rec.max_model_len,
        "block_budget": rec.budget_blocks,
        "upstreams": [{"url": u["url"], "block_budget": u["block_budget"]} for u in upstream_budgets(rec, options)],
        "admission": rec.admission.to_dict(),
        "default_route": {"name": CATCH_ALL_ROUTE, "max_new_tokens": rec.backstop,
                          "output_blocks_at_cap": _blocks(rec.backstop, block_size)},
        "routes": [_route(route, block_size) for route in rec.routes],
    }


def estimate_files(rec: Recommendation, options: RenderOptions | None = None) -> dict[str, str]:
    """estimates.json and estimates.yaml: the same document in both syntaxes."""
    data = estimates(rec, options)
    return {JSON_FILE: json.dumps(data, indent=2) + "\n",
            YAML_FILE: f"# {FORMAT} v{VERSION}, rendered by kvtune {__version__}: see docs/reference/formats.md\n"
                       + yaml.safe_dump(data, sort_keys=False, allow_unicode=False)}


def schema() -> dict[str, Any]:
    """The JSON Schema of the estimates document."""
    return json.loads(SCHEMA_PATH.read_text(encoding="utf-8"))


__all__ = ["estimates", "estimate_files", "schema", "FORMAT", "VERSION", "JSON_FILE", "YAML_FILE", "SCHEMA_PATH"]
