"""Measured KV capacity: what a running vLLM reported, read from the server itself, its startup
log or a capacity file (`kvtune calibrate` writes one).

Why: arithmetic from gpu_memory_utilization has been seen 31% off; the server's own figures are
not. A live server answers in two places, each ground truth for part of the capacity:

    GET /v1/models   the served model id and its max_model_len (vLLM adds that field)
    GET /metrics     vllm:cache_config_info{block_size="16",num_gpu_blocks="573",...} 1.0:
                     blocks, block size, kv_cache_size_tokens, cache dtype, prefix caching, ...

A startup log says the same in the lines kvtune.engines.vllm lists (a log may hold several
startups; the last capacity in it wins). Given both, `cross_check` insists they agree, so a stale
log or the wrong server is caught instead of silently trusted.

SGLang's and TensorRT-LLM's readers (kvtune.capacity.engine_logs) return the same object with
`engine` set and their own sources; capacity files record the engine (absent: vLLM).

Everything here is pure except `fetch_capacity`, the one read of a live server: `calibrate URL`
and `--metrics-url` (recommend, check, capacity) both go through it and get the same object.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvtune import userfiles
from kvtune.capacity.timing import Timing
from kvtune.domain.fields import MAX_INTEGER, Fields
from kvtune.endpoint import get_ok, server_root
from kvtune.engines import ENGINE_NAMES, vllm
from kvtune.errors import CapacityError, EndpointError, InputError, KvtuneError, OptionError
from kvtune.userfiles import brief
from kvtune.writer import write_text

TIMEOUT_S = 10.0  # for each of a server's answers
METRICS_MAX_BYTES = 16 * 1024**2
MODELS_MAX_BYTES = 4 * 1024**2


class CapacitySource(enum.Enum):
    """Where a capacity came from; anything but ESTIMATE was measured on a running server."""

    ESTIMATE = "estimate"
    KV_TOKENS = "kv-tokens"
    VLLM_LOG = "vllm-log"
    METRICS = "metrics"
    SGLANG_LOG = "sglang-log"  # an SGLang startup log (kvtune.capacity.engine_logs)
    SGLANG_SERVER = "sglang-server"  # a running SGLang's /server_info (and /metrics)
    TRTLLM_LOG = "trtllm-log"  # a TensorRT-LLM startup log
    TRTLLM_METRICS = "trtllm-metrics"  # trtllm-serve's /metrics iteration stats


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
    timing: Timing | None = None  # a step-time model, when `calibrate --timing` measured one
    max_num_seqs: int | None = None  # the scheduler's limits, where the server or its log states them
    max_num_batched_tokens: int | None = None
    tensor_parallel_size: int | None = None  # where known (`kvtune capacity --json` states it; servers do not)
    # the engine that reported it (kvtune.engines.ENGINE_NAMES); with SGLang gpu_memory_utilization
    # holds mem_fraction_static, block_size the page size, max_num_seqs max_running_requests and
    # max_num_batched_tokens chunked_prefill_size; with TensorRT-LLM block_size is tokens_per_block,
    # max_model_len max_seq_len, max_num_seqs max_batch_size, max_num_batched_tokens max_num_tokens
    engine: str = "vllm"

    def __post_init__(self) -> None:
        if self.kv_cache_tokens is None and self.num_blocks is None:
            raise InputError("a measured capacity needs kv_cache_tokens or num_blocks", path=self.origin)
        for name in ("kv_cache_tokens", "num_blocks", "block_size", "max_model_len", "kv_cache_memory_bytes",
                     "max_num_seqs", "max_num_batched_tokens", "tensor_parallel_size"):
            value = getattr(self, name)
            positive = name in ("block_size", "max_model_len", "max_num_seqs", "max_num_batched_tokens",
                                "tensor_parallel_size")
            if value is not None and value < (1 if positive else 0):
                raise InputError(f"must be positive, got {value}", path=self.origin, field=name)
            if value is not None and value > _MAX_FIELD:  # so that its capacity file reads back
                raise InputError(f"must be at most 2^53, got {value}", path=self.origin, field=name)
        if self.engine not in ENGINE_NAMES:
            raise InputError(f"unknown engine {brief(self.engine)} (known: {', '.join(ENGINE_NAMES)})",
                             path=self.origin, field="engine")
        owner = _SOURCE_ENGINES.get(self.source)
        if owner is not None and owner != self.engine:
            raise InputError(f"source {self.source.value} is {owner}'s, not {self.engine}'s", path=self.origin,
                             field="engine")

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
            **{name: getattr(self, name) for name in _SCHEDULER_FIELDS if getattr(self, name) is not None},
            **({} if self.engine == "vllm" else {"engine": self.engine}),
            **({} if self.timing is None else {"timing": self.timing.to_dict()}),
        }

    @classmethod
    def from_dict(cls, data: Any, *, path: str | None = None) -> MeasuredCapacity:
        """Parse a capacity file's object strictly; errors name the field."""
        if not isinstance(data, dict):
            raise InputError(f"expected a JSON object, found {type(data).__name__}", path=path)
        unknown = sorted(k if len(str(k)) <= 40 else brief(k, 40)
                         for k in set(data) - set(_FIELD_TYPES) - {"source", "timing"} - REPORT_FIELDS)
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
        if values.get("engine") is None:  # files from before engines were recorded are vLLM's
            values.pop("engine", None)
        timing = None
        if data.get("timing") is not None:
            try:
                timing = Timing.from_fields(Fields(data["timing"], path=path, where="timing"))
            except KvtuneError as exc:
                raise InputError(exc.message, path=path, field=_timing_field(exc.field)) from None
        try:
            return cls(source=source, timing=timing, **values)
        except KvtuneError as exc:
            raise InputError(exc.message, path=path, field=exc.field) from None


_SOURCE_ENGINES = {
    CapacitySource.VLLM_LOG: "vllm", CapacitySource.METRICS: "vllm",
    CapacitySource.SGLANG_LOG: "sglang", CapacitySource.SGLANG_SERVER: "sglang",
    CapacitySource.TRTLLM_LOG: "trtllm", CapacitySource.TRTLLM_METRICS: "trtllm",
}


def _timing_field(field: str | None) -> str:
    """Errors from inside the timing object name their path under it (the coefficients' own checks
    name only the coefficient)."""
    if field is None:
        return "timing"
    return field if field.startswith("timing") else f"timing.coefficients.{field}"


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
    "max_num_seqs": int,
    "max_num_batched_tokens": int,
    "tensor_parallel_size": int,
    "engine": str,
}
# `kvtune capacity --json` is a capacity file too (one format): its report (kvtune.capacity.plan.
# CapacityReport.to_dict, `fits`, `why`) around the fields above, which CapacityReport.capacity_file
# fills. A reader takes the fields above and leaves the report's own figures to the people who read it.
REPORT_FIELDS = frozenset({
    "gpu", "gpu_memory_bytes", "pipeline_parallel_size", "engine_version",
    "kv_bytes_per_token_per_gpu", "measured_from", "kv_cache_bytes", "estimated_num_blocks",
    "max_concurrency_at_max_model_len", "requested_memory_bytes", "weights_bytes", "weights_bytes_total",
    "weights_source", "weights_format", "overhead_bytes", "overhead", "requests", "assumptions", "notes", "fits",
    "why",
})
# written only when known (engine: when not vLLM), so capacity files from before they were
# recorded read back equal
_SCHEDULER_FIELDS = ("max_num_seqs", "max_num_batched_tokens", "tensor_parallel_size")
_MAX_FIELD = MAX_INTEGER  # exact in a double: what JSON readers and the rendered files agree on
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


# --- startup logs ------------------------------------------------------------------------------


def scheduler_limits_from_log(text: str) -> tuple[int | None, int | None]:
    """(max_num_seqs, max_num_batched_tokens) as a startup log states them; the last start wins."""
    seqs_line = vllm.non_default_arg_line("max_num_seqs")
    batched_line = vllm.non_default_arg_line("max_num_batched_tokens")
    seqs = batched = None
    for line in text.splitlines():
        if "non-default args" in line:  # a new start: what it does not state is the default again
            seqs = batched = None
            if m := seqs_line.search(line):
                seqs = int(m["n"])
        if m := (vllm.CHUNKED_PREFILL_LINE.search(line) or batched_line.search(line)):
            batched = int(m["n"])
    return seqs, batched


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
        if m is not None and override is not None and found is not None:
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
    seqs, batched = scheduler_limits_from_log(text)
    return MeasuredCapacity(source=CapacitySource.VLLM_LOG, origin=path, max_num_seqs=seqs,
                            max_num_batched_tokens=batched, **found)


def read_vllm_log(path: str | os.PathLike[str]) -> MeasuredCapacity:
    """Read a startup log file (a regular file of at most VLLM_LOG_MAX_BYTES; encoding errors
    replaced, as logs hold whatever the server printed) and parse it."""
    text = userfiles.read_text(path, max_bytes=userfiles.VLLM_LOG_MAX_BYTES, field="--vllm-log", errors="replace")
    return parse_vllm_log(text, path=str(path))


# --- /metrics ----------------------------------------------------------------------------------


def _label_int(labels: Mapping[str, str], name: str, origin: str) -> int | None:
    raw = labels.get(name)
    if raw is None or raw in ("None", "null", ""):
        return None
    try:
        value = float(raw)
    except ValueError:
        raise EndpointError(f"label {name}={brief(raw)} is not a number", path=origin,
                            field=vllm.CACHE_CONFIG_INFO) from None
    if not value.is_integer() or value < 0:
        raise EndpointError(f"label {name}={brief(raw)} is not a whole number", path=origin,
                            field=vllm.CACHE_CONFIG_INFO)
    return int(value)


def _label_float(labels: Mapping[str, str], name: str) -> float | None:
    try:
        return float(labels[name])
    except (KeyError, ValueError):  # absent, or "None" on servers that leave it unset
        return None


def _label_bool(labels: Mapping[str, str], name: str) -> bool | None:
    return {"true": True, "false": False}.get(labels.get(name, "").lower())


def parse_cache_config(labels: Mapping[str, str], *, origin: str = "<metrics>") -> MeasuredCapacity:
    """Capacity from the labels of one `vllm:cache_config_info` sample.

    num_gpu_blocks and block_size are authoritative; kv_cache_size_tokens (newer releases)
    is kept as the server's own token figure.
    """
    blocks = _label_int(labels, "num_gpu_blocks", origin)
    block_size = _label_int(labels, "block_size", origin)
    if blocks is None or block_size is None:
        raise EndpointError(
            "vllm:cache_config_info has no num_gpu_blocks/block_size yet (the engine has not finished "
            "profiling); retry when the server is up",
            path=origin,
        )
    try:
        return MeasuredCapacity(
            source=CapacitySource.METRICS,
            num_blocks=blocks,
            block_size=block_size,
            kv_cache_tokens=_label_int(labels, "kv_cache_size_tokens", origin),
            max_concurrency=_label_float(labels, "kv_cache_max_concurrency"),
            model=labels.get("model_name"),
            kv_cache_dtype=labels.get("cache_dtype"),
            num_gpu_blocks_override=_label_int(labels, "num_gpu_blocks_override", origin),
            enable_prefix_caching=_label_bool(labels, "enable_prefix_caching"),
            gpu_memory_utilization=_label_float(labels, "gpu_memory_utilization"),
            kv_cache_memory_bytes=_label_int(labels, "kv_cache_memory_bytes", origin),
            origin=origin,
        )
    except KvtuneError as exc:
        raise EndpointError(exc.message, path=origin, field=exc.field) from None


def parse_metrics_text(text: str, *, origin: str = "<metrics>") -> MeasuredCapacity:
    """Capacity from the `vllm:cache_config_info` sample of a Prometheus exposition (with
    several engines, the first)."""
    from prometheus_client.parser import text_string_to_metric_families

    samples: list[Any] = []
    try:
        for family in text_string_to_metric_families(text):
            samples.extend(s for s in family.samples if s.name == vllm.CACHE_CONFIG_INFO)
    except (ValueError, TypeError, IndexError) as exc:
        raise EndpointError(f"not a Prometheus text exposition: {exc}", path=origin) from None
    if not samples:
        raise EndpointError("no vllm:cache_config_info metric; is this a vLLM /metrics endpoint?", path=origin)
    return parse_cache_config(samples[0].labels, origin=origin)


# --- /v1/models --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ServedModel:
    """One entry of an OpenAI-compatible /v1/models answer."""

    id: str
    max_model_len: int | None  # vLLM's extension; None from servers that do not say


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


def parse_models_body(body: bytes, *, origin: str) -> tuple[ServedModel, ...]:
    """`parse_models` of the bytes a server answered."""
    try:
        data = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise EndpointError("not an OpenAI-compatible server: /v1/models did not answer JSON", path=origin) from None
    return parse_models(data, origin=origin)


# --- a live server -----------------------------------------------------------------------------


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
        assert measured.num_blocks is not None and measured.block_size is not None  # parse_cache_config
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
        max_num_seqs=live.max_num_seqs or logged.max_num_seqs,
        max_num_batched_tokens=live.max_num_batched_tokens or logged.max_num_batched_tokens,
    )


async def fetch_capacity(url: str, *, timeout_s: float = TIMEOUT_S, field: str | None = None) -> MeasuredCapacity:
    """The capacity of the vLLM at `url` (its root, /metrics or /v1): GET /v1/models, then /metrics.

    `field` names the option the URL came from in error lines.
    """
    import aiohttp

    root = server_root(url, field=field)
    models_url = f"{root}/v1/models"
    # each GET is bounded by its own timeout (endpoint.get), not by the session's
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
        body = await get_ok(session, models_url, timeout_s=timeout_s, max_bytes=MODELS_MAX_BYTES,
                            accept="application/json", field=field)
        models = parse_models_body(body, origin=models_url)
        metrics = await get_ok(session, f"{root}/metrics", timeout_s=timeout_s, max_bytes=METRICS_MAX_BYTES,
                               accept="text/plain", field=field)
    return capacity_from_server(models, metrics.decode("utf-8", errors="replace"), root=root)


async def calibrate(url: str | None, *, vllm_log: str | None = None,
                    timeout_s: float = TIMEOUT_S) -> MeasuredCapacity:
    """The capacity from a live server, a startup log, or both cross-checked (`kvtune calibrate`)."""
    if url is None and vllm_log is None:
        raise OptionError("give the server's URL, a startup log (`vllm_log` FILE), or both", field="url")
    logged = read_vllm_log(vllm_log) if vllm_log is not None else None
    if url is None:
        assert logged is not None
        return logged
    live = await fetch_capacity(url, timeout_s=timeout_s, field="URL")
    return live if logged is None else cross_check(live, logged)


# --- capacity files ----------------------------------------------------------------------------


def read_capacity_file(path: str | os.PathLike[str]) -> MeasuredCapacity:
    """A capacity file as `write_capacity_file` (and `kvtune calibrate`) writes it: a regular file of
    strict JSON, at most CAPACITY_MAX_BYTES."""
    data = userfiles.load_json(path, max_bytes=userfiles.CAPACITY_MAX_BYTES)
    return MeasuredCapacity.from_dict(data, path=str(path))


def write_capacity_file(path: str | os.PathLike[str], measured: MeasuredCapacity) -> None:
    """Write `measured` as JSON, whole or not at all (kvtune.writer)."""
    write_text(path, json.dumps(measured.to_dict(), indent=2) + "\n")


__all__ = [
    "CapacitySource",
    "MeasuredCapacity",
    "REPORT_FIELDS",
    "ServedModel",
    "blocks_from_tokens",
    "parse_vllm_log",
    "read_vllm_log",
    "scheduler_limits_from_log",
    "parse_cache_config",
    "parse_metrics_text",
    "parse_models",
    "parse_models_body",
    "capacity_from_server",
    "cross_check",
    "fetch_capacity",
    "calibrate",
    "read_capacity_file",
    "write_capacity_file",
]
