"""Measured KV capacity: what a running vLLM reported, from its startup log, its /metrics or a
capacity file (`kvtune calibrate` writes one).

These are ground truth; arithmetic from gpu_memory_utilization is not. The startup-log lines of
every release are in kvtune.engines.vllm; /metrics says the same in one info gauge:

    vllm:cache_config_info{block_size="16",num_gpu_blocks="573",...} 1.0

A log may hold several startups; the last capacity in it wins.
"""

from __future__ import annotations

import enum
import json
import os
from dataclasses import dataclass
from typing import Any

from kvtune.engines import vllm
from kvtune.errors import EndpointError, InputError, KvtuneError
from kvtune.userfiles import brief


class CapacitySource(enum.Enum):
    """Where a capacity came from; anything but ESTIMATE was measured on a running server."""

    ESTIMATE = "estimate"
    KV_TOKENS = "kv-tokens"
    VLLM_LOG = "vllm-log"
    METRICS = "metrics"


@dataclass(frozen=True, slots=True)
class MeasuredCapacity:
    """A KV capacity a real server reported. At least one of num_blocks / kv_cache_tokens is set."""

    source: CapacitySource
    kv_cache_tokens: int | None = None
    num_blocks: int | None = None
    block_size: int | None = None  # None: the server's block size was not reported
    max_model_len: int | None = None  # the length vLLM's "Maximum concurrency" line refers to
    max_concurrency: float | None = None  # vLLM's own figure at max_model_len
    device: str | None = None  # "GPU", "CPU", ... as the log names it
    model: str | None = None
    kv_cache_dtype: str | None = None
    num_gpu_blocks_override: int | None = None
    enable_prefix_caching: bool | None = None  # /metrics cache_config_info; None when not reported
    gpu_memory_utilization: float | None = None  # the server's setting (ignored when kv_cache_memory_bytes is set)
    kv_cache_memory_bytes: int | None = None  # the explicit KV size it was started with, if any
    origin: str | None = None  # the log path or URL it was read from
    line: int | None = None  # the log line it was read from

    def __post_init__(self) -> None:
        if self.kv_cache_tokens is None and self.num_blocks is None:
            raise KvtuneError("a measured capacity needs kv_cache_tokens or num_blocks", path=self.origin)
        for name in ("kv_cache_tokens", "num_blocks", "block_size", "max_model_len", "kv_cache_memory_bytes"):
            value = getattr(self, name)
            if value is not None and value < (1 if name in ("block_size", "max_model_len") else 0):
                raise KvtuneError(f"must be positive, got {value}", path=self.origin, field=name)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready; `from_dict(to_dict())` gives back an equal object."""
        return {
            "source": self.source.value,
            "kv_cache_tokens": self.kv_cache_tokens,
            "num_blocks": self.num_blocks,
            "block_size": self.block_size,
            "max_model_len": self.max_model_len,
            "max_concurrency": self.max_concurrency,
            "device": self.device,
            "model": self.model,
            "kv_cache_dtype": self.kv_cache_dtype,
            "num_gpu_blocks_override": self.num_gpu_blocks_override,
            "enable_prefix_caching": self.enable_prefix_caching,
            "gpu_memory_utilization": self.gpu_memory_utilization,
            "kv_cache_memory_bytes": self.kv_cache_memory_bytes,
            "origin": self.origin,
            "line": self.line,
        }

    @classmethod
    def from_dict(cls, data: Any, *, path: str | None = None) -> MeasuredCapacity:
        """Parse a capacity file's object strictly; errors name the field."""
        if not isinstance(data, dict):
            raise InputError(f"expected a JSON object, found {type(data).__name__}", path=path)
        from kvtune.userfiles import brief

        unknown = sorted(k if len(str(k)) <= 40 else brief(k, 40) for k in set(data) - set(_FIELD_TYPES) - {"source"})
        if unknown:
            raise InputError(f"unknown field(s): {', '.join(unknown[:5])}", path=path, field=unknown[0])
        raw_source = data.get("source")
        try:
            source = CapacitySource(raw_source)
        except (ValueError, TypeError):  # TypeError: an unhashable value such as a list
            known = ", ".join(s.value for s in CapacitySource)
            raise InputError(f"unknown source {brief(raw_source)} (known: {known})", path=path,
                             field="source") from None
        values: dict[str, Any] = {}
        for name, kind in _FIELD_TYPES.items():
            value = data.get(name)
            number = isinstance(value, (int, float)) and not isinstance(value, bool)
            if value is None:
                values[name] = None
            elif (kind is float and number) or (kind is int and number and isinstance(value, int)):
                low, high = _FIELD_RANGES.get(name, (0, _MAX_FIELD))
                if not low <= value <= high:  # also NaN
                    raise InputError(f"must be from {low} to {high}, found {brief(value)}", path=path, field=name)
                values[name] = kind(value)
            elif (kind is bool and isinstance(value, bool)) or (kind is str and isinstance(value, str)):
                values[name] = value
            else:
                raise InputError(f"expected {kind.__name__}, found {brief(value)}", path=path, field=name)
        try:
            return cls(source=source, **values)
        except KvtuneError as exc:
            raise InputError(exc.message, path=path, field=exc.field) from None


_FIELD_TYPES: dict[str, type] = {
    "kv_cache_tokens": int,
    "num_blocks": int,
    "block_size": int,
    "max_model_len": int,
    "max_concurrency": float,
    "device": str,
    "model": str,
    "kv_cache_dtype": str,
    "num_gpu_blocks_override": int,
    "enable_prefix_caching": bool,
    "gpu_memory_utilization": float,
    "kv_cache_memory_bytes": int,
    "origin": str,
    "line": int,
}
_MAX_FIELD = 2**53  # exact in a double: what JSON readers and the rendered files agree on
# (minimum, maximum) where 0..2**53 is not the range; the dataclass checks what must be positive
_FIELD_RANGES: dict[str, tuple[float, float]] = {
    "max_concurrency": (0, _MAX_FIELD),
    "gpu_memory_utilization": (0, 1),
    "line": (1, _MAX_FIELD),
}


def blocks_from_tokens(kv_cache_tokens: int, block_size: int, max_model_len: int | None = None) -> int:
    """Invert vLLM's token count back to blocks.

    vLLM (V1) logs tokens = int(num_blocks / ceil(L / block_size) × L) for max_model_len L, which is
    below num_blocks × block_size when L is not a multiple of block_size. The smallest block count
    that reproduces the logged tokens is ceil(tokens × ceil(L/bs) / L). Without L: tokens // bs.
    """
    if max_model_len is None:
        return kv_cache_tokens // block_size
    blocks_per_request = -(-max_model_len // block_size)
    num = kv_cache_tokens * blocks_per_request
    blocks = -(-num // max_model_len)
    # a single-group model logs exactly int(blocks * L / c); anything else (hybrid groups) falls back
    if (blocks * max_model_len) // blocks_per_request != kv_cache_tokens:
        return kv_cache_tokens // block_size
    return blocks



METRICS_TIMEOUT_S = 5.0
METRICS_MAX_BYTES = 16 * 1024**2


def _int(text: str) -> int:
    return int(text.replace(",", ""))


def parse_vllm_log(text: str, *, path: str = "<log>") -> MeasuredCapacity:
    """The last KV capacity a vLLM startup log reports, from any release's format."""
    found: dict[str, Any] | None = None  # the latest capacity seen
    override: int | None = None  # an override line applies to the capacity line that follows it

    for lineno, line in enumerate(text.splitlines(), start=1):
        if m := vllm.BLOCKS_OVERRIDE_LINE.search(line):
            override = _int(m["new"])
            found = {"num_blocks": override, "num_gpu_blocks_override": override, "device": "GPU", "line": lineno}
        if m := vllm.KV_CACHE_SIZE_LINE.search(line):
            found = {"kv_cache_tokens": _int(m["tokens"]), "device": m["device"].removesuffix(" + host"),
                     "line": lineno}
        elif m := vllm.NUM_BLOCKS_LINE.search(line):
            device = m["device"].upper()
            found = {"num_blocks": _int(m["blocks"]), "device": "GPU" if device == "CUDA" else device,
                     "line": lineno}
        else:
            m = None
        if m is not None and override is not None:
            found.update(num_blocks=override, num_gpu_blocks_override=override)
            override = None
        if (m := vllm.MAX_CONCURRENCY_LINE.search(line)) and found is not None:
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
            samples.extend(s for s in family.samples if s.name == vllm.CACHE_CONFIG_INFO)
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
    "CapacitySource",
    "MeasuredCapacity",
    "blocks_from_tokens",
    "parse_vllm_log",
    "read_vllm_log",
    "parse_metrics_text",
    "metrics_url",
    "fetch_metrics",
    "read_capacity_file",
    "write_capacity_file",
]
