"""The door to `kvtune kv`: KV-cache bytes per token of a deployment's model; it loads only the
model's config reader and kvtune.kv (no numpy), so `kvtune kv` starts within its budget."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvtune import kv
from kvtune.domain.deployment import Deployment
from kvtune.errors import OptionError
from kvtune.model import resolve_model

if TYPE_CHECKING:
    from kvtune.kv import KvBytes


def kv_bytes(deployment: Deployment) -> KvBytes:
    """KV-cache bytes per token of the deployment's model, by layer kind, under its tp and pp, in
    its KV dtype: what `kvtune kv` shows.

    >>> kvtune.kv_bytes(kvtune.Deployment("llama-3.1-70b", tp=4, kv_cache_dtype="fp8")).kv_bytes_per_token
    163840
    """
    if deployment.model is None:
        raise OptionError("name the model (a preset, config.json, model directory or hub id)", field="model")
    return kv.kv_bytes(resolve_model(deployment.model), kv_cache_dtype=deployment.kv_cache_dtype or "auto",
                       tp=deployment.tp, pp=deployment.pp)
