"""Measured KV capacity from a running vLLM: its startup log, its /metrics, or a capacity file.

These are ground truth; arithmetic from gpu_memory_utilization is not. Formats read:

    GPU KV cache size: 686,320 tokens, Maximum concurrency for 100,000 tokens per request: 6.86x
                                                   (vLLM ≥ 0.12, one line; "CPU" on CPU)
    GPU KV cache size: 686,320 tokens              (older V1: the same facts on two lines)
    Maximum concurrency for 100,000 tokens per request: 6.86x
    # GPU blocks: 33660                            (early V1, with the concurrency line after it)
    # GPU blocks: 865, # CPU blocks: 327           (V0)
    Overriding num_gpu_blocks=1000 with num_gpu_blocks_override=32
    vllm:cache_config_info{block_size="16",num_gpu_blocks="573",...} 1.0   (/metrics)

A log may hold several startups; the last capacity in it wins.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

from kvtune.capacity import CapacitySource, MeasuredCapacity
from kvtune.errors import EndpointError, InputError, KvtuneError
from kvtune.userfiles import brief

_SIZE = re.compile(r"\b(?P<device>[A-Z][A-Za-z]*(?: \+ host)?) KV cache size: (?P<tokens>[\d,]+) tokens")
_CONCURRENCY = re.compile(
    r"Maximum concurrency for (?P<len>[\d,]+) tokens per request: (?P<x>\d+(?:\.\d+)?)x"
)
_BLOCKS = re.compile(r"# (?P<device>[A-Za-z]+) blocks: (?P<blocks>\d+)")  # first on the line: GPU, cuda, CPU
_OVERRIDE = re.compile(r"Overriding num_gpu_blocks=(?P<old>\d+) with num_gpu_blocks_override=(?P<new>\d+)")

METRICS_TIMEOUT_S = 5.0
METRICS_MAX_BYTES = 16 * 1024**2


def _int(text: str) -> int:
    return int(text.replace(",", ""))


def parse_vllm_log(text: str, *, path: str = "<log>") -> MeasuredCapacity:
    """The last KV capacity a vLLM startup log reports, from any release's format."""
    found: dict[str, Any] | None = None  # the latest capacity seen
    override: int | None = None  # an override line applies to the capacity line that follows it

    for lineno, line in enumerate(text.splitlines(), start=1):
        if m := _OVERRIDE.search(line):
            override = _int(m["new"])
            found = {"num_blocks": override, "num_gpu_blocks_override": override, "device": "GPU", "line": lineno}
        if m := _SIZE.search(line):
            found = {"kv_cache_tokens": _int(m["tokens"]), "device": m["device"].removesuffix(" + host"),
                     "line": lineno}
        elif m := _BLOCKS.search(line):
            device = m["device"].upper()
            found = {"num_blocks": _int(m["blocks"]), "device": "GPU" if device == "CUDA" else device,
                     "line": lineno}
        else:
            m = None
        if m is not None and override is not None:
            found.update(num_blocks=override, num_gpu_blocks_override=override)
            override = None
        if (m := _CONCURRENCY.search(line)) and found is not None:
            found["max_model_len"] = _int(m["len"])
            found["max_concurrency"] = float(m["x"])
    if found is None:
        raise InputError(
            "no KV cache capacity in this log (looked for 'GPU KV cache size: N tokens', "
            "'# GPU blocks: N' and 'Overriding num_gpu_blocks'); pass the vLLM server's startup log",
            path=path,
        )
    return MeasuredCapacity(source=CapacitySource.VLLM_LOG, origin=path, **found)


def read_vllm_log(path: str | os.PathLike[str]) -> MeasuredCapacity:
    """Read a startup log file (a regular file of at most VLLM_LOG_MAX_BYTES; encoding errors
    replaced, as logs hold whatever the server printed) and parse it."""
    from kvtune import userfiles

    text = userfiles.read_text(path, max_bytes=userfiles.VLLM_LOG_MAX_BYTES, field="--vllm-log", errors="replace")
    return parse_vllm_log(text, path=str(path))


def _label_int(labels: dict[str, str], name: str, origin: str) -> int | None:
    raw = labels.get(name)
    if raw is None or raw in ("None", "null", ""):
        return None
    try:
        value = float(raw)
    except ValueError:
        raise EndpointError(f"label {name}={brief(raw)} is not a number", path=origin,
                            field="vllm:cache_config_info") from None
    if not value.is_integer() or value < 0:
        raise EndpointError(f"label {name}={brief(raw)} is not a whole number", path=origin,
                            field="vllm:cache_config_info")
    return int(value)


def _label_float(labels: dict[str, str], name: str) -> float | None:
    try:
        return float(labels[name])
    except (KeyError, ValueError):  # absent, or "None" on servers that leave it unset
        return None


def _label_bool(labels: dict[str, str], name: str) -> bool | None:
    return {"true": True, "false": False}.get(labels.get(name, "").lower())


def parse_metrics_text(text: str, *, origin: str = "<metrics>") -> MeasuredCapacity:
    """Capacity from the `vllm:cache_config_info` labels of a Prometheus exposition.

    num_gpu_blocks and block_size are authoritative; kv_cache_size_tokens (newer releases)
    is kept as the server's own token figure. With several engines, the first is used.
    """
    from prometheus_client.parser import text_string_to_metric_families

    samples = []
    try:
        for family in text_string_to_metric_families(text):
            samples.extend(s for s in family.samples if s.name == "vllm:cache_config_info")
    except (ValueError, TypeError, IndexError) as exc:
        raise EndpointError(f"not a Prometheus text exposition: {exc}", path=origin) from None
    if not samples:
        raise EndpointError("no vllm:cache_config_info metric; is this a vLLM /metrics endpoint?", path=origin)
    labels = samples[0].labels
    blocks = _label_int(labels, "num_gpu_blocks", origin)
    block_size = _label_int(labels, "block_size", origin)
    if blocks is None or block_size is None:
        raise EndpointError(
            "vllm:cache_config_info has no num_gpu_blocks/block_size yet (the engine has not finished "
            "profiling); retry when the server is up",
            path=origin,
        )
    override = _label_int(labels, "num_gpu_blocks_override", origin)
    try:
        return MeasuredCapacity(
            source=CapacitySource.METRICS,
            num_blocks=blocks,
            block_size=block_size,
            kv_cache_tokens=_label_int(labels, "kv_cache_size_tokens", origin),
            max_concurrency=_label_float(labels, "kv_cache_max_concurrency"),
            model=labels.get("model_name"),
            kv_cache_dtype=labels.get("cache_dtype"),
            num_gpu_blocks_override=override,
            enable_prefix_caching=_label_bool(labels, "enable_prefix_caching"),
            gpu_memory_utilization=_label_float(labels, "gpu_memory_utilization"),
            kv_cache_memory_bytes=_label_int(labels, "kv_cache_memory_bytes", origin),
            origin=origin,
        )
    except KvtuneError as exc:
        raise EndpointError(exc.message, path=origin, field=exc.field) from None


def metrics_url(url: str) -> str:
    """`url` itself, or `url` + /metrics when it names only the server."""
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise EndpointError("expected an http:// or https:// URL, e.g. http://127.0.0.1:8000/metrics",
                            path=url, field="--metrics-url")
    if parts.path in ("", "/"):
        parts = parts._replace(path="/metrics")
    return urlunsplit(parts)


def fetch_metrics(url: str, *, timeout_s: float = METRICS_TIMEOUT_S) -> MeasuredCapacity:
    """GET a vLLM /metrics page (loopback or remote) and read its capacity."""
    import urllib.error
    import urllib.request

    target = metrics_url(url)
    request = urllib.request.Request(target, headers={"Accept": "text/plain"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            body = response.read(METRICS_MAX_BYTES + 1)
    except urllib.error.HTTPError as exc:
        exc.close()  # the error carries the open response
        raise EndpointError(f"HTTP {exc.code} {exc.reason}", path=target, field="--metrics-url") from None
    except urllib.error.URLError as exc:
        raise EndpointError(f"cannot reach: {exc.reason}", path=target, field="--metrics-url") from None
    except (TimeoutError, OSError) as exc:
        raise EndpointError(f"cannot reach: {exc}", path=target, field="--metrics-url") from None
    if len(body) > METRICS_MAX_BYTES:
        raise EndpointError(f"response larger than {METRICS_MAX_BYTES:,} bytes", path=target)
    return parse_metrics_text(body.decode("utf-8", errors="replace"), origin=target)


def read_capacity_file(path: str | os.PathLike[str]) -> MeasuredCapacity:
    """A capacity file as `write_capacity_file` (and `kvtune calibrate`) writes it: a regular file of
    strict JSON, at most CAPACITY_MAX_BYTES."""
    from kvtune import userfiles

    data = userfiles.load_json(path, max_bytes=userfiles.CAPACITY_MAX_BYTES)
    return MeasuredCapacity.from_dict(data, path=str(path))


def write_capacity_file(path: str | os.PathLike[str], measured: MeasuredCapacity) -> None:
    """Write `measured` as JSON, whole or not at all (kvtune.writer)."""
    from kvtune.writer import write_text

    write_text(path, json.dumps(measured.to_dict(), indent=2) + "\n")


__all__ = [
    "parse_vllm_log",
    "read_vllm_log",
    "parse_metrics_text",
    "metrics_url",
    "fetch_metrics",
    "read_capacity_file",
    "write_capacity_file",
]
