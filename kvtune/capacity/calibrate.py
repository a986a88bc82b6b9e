"""Calibrate: the KV capacity a running vLLM really has, read from the server itself.

Why: arithmetic from gpu_memory_utilization has been seen 31% off; the server's own figures are
not. Two sources, each ground truth for part of the answer:

    GET /v1/models   the served model id and its max_model_len (vLLM adds that field)
    GET /metrics     vllm:cache_config_info: num_gpu_blocks, block_size, kv_cache_size_tokens,
                     cache_dtype, enable_prefix_caching, gpu_memory_utilization, ...

A startup log (`--vllm-log`) says the same in its "KV cache size: N tokens, Maximum concurrency
for L tokens per request" line; given both, `cross_check` insists they agree, so a stale log or
the wrong server is caught instead of silently trusted.

`capacity_from_server` and `cross_check` are pure; `fetch_calibration` is the only network code.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from kvtune.capacity.measured import MeasuredCapacity, blocks_from_tokens
from kvtune.capacity.measured import METRICS_MAX_BYTES, parse_metrics_text
from kvtune.errors import CapacityError, EndpointError
from kvtune.userfiles import brief

TIMEOUT_S = 10.0
MODELS_MAX_BYTES = 4 * 1024**2


@dataclass(frozen=True, slots=True)
class ServedModel:
    """One entry of an OpenAI-compatible /v1/models answer."""

    id: str
    max_model_len: int | None  # vLLM's extension; None from servers that do not say


def server_root(url: str) -> str:
    """The server's base URL from its root, its /metrics or its /v1 URL (no trailing slash)."""
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise EndpointError("expected an http:// or https:// URL such as http://127.0.0.1:8000", path=url)
    path = parts.path.rstrip("/")
    for suffix in ("/metrics", "/v1/models", "/v1"):
        if path.endswith(suffix):
            path = path[: -len(suffix)]
            break
    return urlunsplit((parts.scheme, parts.netloc, path, "", ""))


def parse_models(data: Any, *, origin: str) -> tuple[ServedModel, ...]:
    """The models of a /v1/models JSON body, strictly; anything else is an EndpointError."""
    entries = data.get("data") if isinstance(data, dict) else None
    if not isinstance(entries, list):
        raise EndpointError("not an OpenAI-compatible /v1/models answer (no \"data\" list)", path=origin)
    if not entries:
        raise EndpointError("the server lists no models", path=origin)
    models = []
    for i, entry in enumerate(entries):
        model_id = entry.get("id") if isinstance(entry, dict) else None
        if not isinstance(model_id, str) or not model_id:
            raise EndpointError("model entry without a string \"id\"", path=origin, field=f"data[{i}].id")
        max_len = entry.get("max_model_len")
        if max_len is not None and (isinstance(max_len, bool) or not isinstance(max_len, int) or max_len < 1):
            raise EndpointError(f"expected a positive integer, found {brief(max_len)}", path=origin,
                                field=f"data[{i}].max_model_len")
        models.append(ServedModel(model_id, max_len))
    return tuple(models)


def capacity_from_server(models: tuple[ServedModel, ...], metrics_text: str, *, root: str) -> MeasuredCapacity:
    """Join /v1/models and /metrics into one measured capacity (source "metrics").

    The served model is the one /metrics names (model_name), else the first listed: vLLM serves
    one model per process. kv_cache_tokens is the server's own kv_cache_size_tokens; releases that
    do not report it get num_blocks × block_size, the tokens the pool holds.
    """
    measured = parse_metrics_text(metrics_text, origin=f"{root}/metrics")
    served = next((m for m in models if m.id == measured.model), models[0])
    tokens = measured.kv_cache_tokens
    if tokens is None:
        tokens = measured.num_blocks * measured.block_size
    return dataclasses.replace(measured, model=served.id, max_model_len=served.max_model_len,
                               kv_cache_tokens=tokens, origin=root)


def cross_check(live: MeasuredCapacity, logged: MeasuredCapacity) -> MeasuredCapacity:
    """`live` completed by a startup log, or a CapacityError naming the first figure they disagree on."""
    where = f"{logged.origin}:{logged.line}" if logged.line else logged.origin
    checks: list[tuple[str, Any, Any]] = [("max_model_len", live.max_model_len, logged.max_model_len)]
    if logged.num_blocks is not None:
        checks.append(("num_blocks", live.num_blocks, logged.num_blocks))
    if logged.kv_cache_tokens is not None:
        checks.append(("kv_cache_tokens", live.kv_cache_tokens, logged.kv_cache_tokens))
        if live.num_blocks is not None and live.block_size:
            derived = blocks_from_tokens(logged.kv_cache_tokens, live.block_size, logged.max_model_len)
            checks.append(("num_blocks", live.num_blocks, derived))
    for name, server_value, log_value in checks:
        if server_value is not None and log_value is not None and server_value != log_value:
            raise CapacityError(
                f"the server reports {name} {server_value:,} but the log {where} says {log_value:,}; "
                "is the log from this server's latest start?",
                field="--vllm-log",
            )
    return dataclasses.replace(
        live,
        device=live.device or logged.device,
        max_concurrency=live.max_concurrency if live.max_concurrency is not None else logged.max_concurrency,
        max_model_len=live.max_model_len or logged.max_model_len,
    )


async def _get(session: Any, url: str, *, max_bytes: int, accept: str) -> bytes:
    """GET `url`: the body, or an EndpointError saying why not in one line."""
    import aiohttp

    try:
        async with session.get(url, headers={"Accept": accept}, allow_redirects=True) as response:
            if response.status != 200:
                raise EndpointError(f"HTTP {response.status} {response.reason or ''}".strip(), path=url)
            body = bytearray()
            async for chunk in response.content.iter_chunked(64 * 1024):
                body += chunk
                if len(body) > max_bytes:
                    raise EndpointError(f"response larger than {max_bytes:,} bytes", path=url)
            return bytes(body)
    except TimeoutError:
        raise EndpointError("no complete answer within the timeout", path=url) from None
    except aiohttp.ClientConnectorError as exc:
        raise EndpointError(f"cannot reach: {exc.os_error.strerror or exc.os_error}", path=url) from None
    except (aiohttp.ClientError, OSError) as exc:
        raise EndpointError(f"cannot reach: {exc}", path=url) from None


async def fetch_calibration(url: str, *, timeout_s: float = TIMEOUT_S) -> MeasuredCapacity:
    """Read /v1/models and /metrics of the vLLM at `url` (root or /metrics) into a capacity."""
    import aiohttp

    root = server_root(url)
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        models_url = f"{root}/v1/models"
        body = await _get(session, models_url, max_bytes=MODELS_MAX_BYTES, accept="application/json")
        try:
            data = json.loads(body)
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise EndpointError("not an OpenAI-compatible server: /v1/models did not answer JSON",
                                path=models_url) from None
        models = parse_models(data, origin=models_url)
        metrics = await _get(session, f"{root}/metrics", max_bytes=METRICS_MAX_BYTES, accept="text/plain")
    return capacity_from_server(models, metrics.decode("utf-8", errors="replace"), root=root)


async def calibrate(url: str | None, *, vllm_log: str | None = None,
                    timeout_s: float = TIMEOUT_S) -> MeasuredCapacity:
    """The capacity from a live server, a startup log, or both cross-checked."""
    from kvtune.capacity.measured import read_vllm_log
    from kvtune.errors import KvtuneError

    if url is None and vllm_log is None:
        raise KvtuneError("give the server's URL, a startup log (--vllm-log FILE), or both", field="URL")
    logged = read_vllm_log(vllm_log) if vllm_log is not None else None
    if url is None:
        return logged
    live = await fetch_calibration(url, timeout_s=timeout_s)
    return live if logged is None else cross_check(live, logged)


__all__ = [
    "calibrate",
    "ServedModel",
    "server_root",
    "parse_models",
    "capacity_from_server",
    "cross_check",
    "fetch_calibration",
]
