"""Measured KV capacity from SGLang and TensorRT-LLM: their startup logs, SGLang's /server_info
and /metrics, trtllm-serve's /metrics iteration stats; the same `MeasuredCapacity` vLLM's
readers give (kvtune.capacity.measured), with `engine` saying whose it is.

    SGLang         log: `max_total_num_tokens=N, chunked_prefill_size=…, max_prefill_tokens=…,
                   max_running_requests=…, context_len=…, available_gpu_mem=… GB` (the scheduler's
                   figures) and `KV Cache is allocated. dtype: …, #tokens: N, K size: …`;
                   GET /server_info (max_total_num_tokens, page_size, mem_fraction_static, …),
                   /v1/models (max_model_len), /metrics when --enable-metrics (sglang:max_total_num_tokens,
                   sglang:page_size, sglang:context_len): all must agree
    TensorRT-LLM   log: `Number of tokens per block: 32.` and `[MemUsageChange] Allocated X GiB for
                   max tokens in paged KV cache (N).`, with `max_seq_len=…, max_num_requests=…,
                   max_num_tokens=…`; GET /metrics (JSON iteration stats, kvCacheStats.maxNumBlocks
                   and tokensPerBlock) holds the capacity only once requests have run with
                   enable_iter_perf_stats: there is no endpoint that states it at startup

kvtune.engines.sglang and kvtune.engines.trtllm quote each line with the source file it comes
from. A log may hold several startups: the last capacity in it wins.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from typing import Any

from kvtune import userfiles
from kvtune.capacity.measured import (
    METRICS_MAX_BYTES,
    MODELS_MAX_BYTES,
    TIMEOUT_S,
    CapacitySource,
    MeasuredCapacity,
    ServedModel,
    calibrate,
    fetch_capacity,
    parse_models_body,
    parse_vllm_log,
    read_vllm_log,
)
from kvtune.endpoint import get, get_ok, server_root
from kvtune.engines import ENGINE_NAMES, ENGINE_TITLES, sglang, trtllm
from kvtune.errors import CapacityError, EndpointError, InputError, KvtuneError, OptionError
from kvtune.userfiles import brief

SERVER_INFO_MAX_BYTES = 16 * 1024**2

# SGLang's --kv-cache-dtype names that kvtune's KV arithmetic knows (vLLM's names; "bf16" is SGLang's
# alias of bfloat16). Others (mxfp8, nvfp4, fp4_mx_block16) are left unpinned.
_SGLANG_KV_DTYPES = {"auto": "auto", "bf16": "bfloat16", "bfloat16": "bfloat16", "fp8_e4m3": "fp8_e4m3",
                     "fp8_e5m2": "fp8_e5m2"}


def _optional_int(text: str | None) -> int | None:
    return None if text is None or text == "None" else int(text)


# --- SGLang startup logs -----------------------------------------------------------------------


def parse_sglang_log(text: str, *, path: str = "<log>") -> MeasuredCapacity:
    """The last KV capacity an SGLang startup log reports.

    The scheduler's line is authoritative (it follows the pool's sizing and states the limits);
    a `KV Cache is allocated` line alone (a start that stopped before the scheduler was up)
    still gives the pool's tokens. The log does not state the page size.
    """
    found: dict[str, Any] | None = None
    for lineno, line in enumerate(text.splitlines(), start=1):
        if m := (sglang.KV_ALLOCATED_LINE.search(line) or sglang.POST_CAPTURE_KV_LINE.search(line)):
            found = {"kv_cache_tokens": int(m["tokens"]), "line": lineno, "device": "GPU"}
        elif m := sglang.SCHEDULER_CAPACITY_LINE.search(line):
            fields = {f["name"]: f["value"] for f in sglang.SCHEDULER_FIELD.finditer(line, m.end())}
            chunk = _optional_int(fields.get("chunked_prefill_size"))
            found = {
                "kv_cache_tokens": int(m["tokens"]),
                "line": lineno,
                "device": "CPU" if "available_cpu_mem=" in line else "GPU",
                "max_model_len": _optional_int(fields.get("context_len")),
                "max_num_seqs": _optional_int(fields.get("max_running_requests")),
                "max_num_batched_tokens": chunk if chunk is not None and chunk > 0 else None,
            }
    if found is None:
        raise InputError(
            "no KV cache capacity in this log (looked for SGLang's 'max_total_num_tokens=N, …' and "
            "'KV Cache is allocated. … #tokens: N'); pass the SGLang server's startup log",
            path=path,
        )
    try:
        return MeasuredCapacity(source=CapacitySource.SGLANG_LOG, engine="sglang", origin=path, **found)
    except KvtuneError as exc:
        raise InputError(exc.message, path=path, line=found["line"], field=exc.field) from None


# --- TensorRT-LLM startup logs -----------------------------------------------------------------


def parse_trtllm_log(text: str, *, path: str = "<log>") -> MeasuredCapacity:
    """The last KV capacity a TensorRT-LLM startup log reports: the last `Allocated … for max
    tokens in paged KV cache (N)` (the PyTorch backend logs one for its estimation run first),
    with the tokens-per-block line before it and the executor's limits after it."""
    found: dict[str, Any] | None = None
    tokens_per_block: int | None = None
    for lineno, line in enumerate(text.splitlines(), start=1):
        if m := trtllm.TOKENS_PER_BLOCK_LINE.search(line):
            tokens_per_block = int(m["n"])
        elif m := trtllm.KV_ALLOCATED_LINE.search(line):
            tokens = int(m["tokens"])
            if tokens_per_block is not None and tokens % tokens_per_block:
                raise InputError(f"{tokens:,} tokens is not a whole number of {tokens_per_block}-token blocks",
                                 path=path, line=lineno, field="paged KV cache")
            found = {"kv_cache_tokens": tokens, "line": lineno, "device": "GPU", "block_size": tokens_per_block,
                     "num_blocks": None if tokens_per_block is None else tokens // tokens_per_block}
            tokens_per_block = None  # the next allocation states its own
        elif (m := trtllm.EXECUTOR_LIMITS_LINE.search(line)) and found is not None:
            found.update(max_model_len=int(m["max_seq_len"]), max_num_batched_tokens=int(m["max_num_tokens"]),
                         max_num_seqs=int(m["max_batch_size"] or m["max_num_requests"]))
    if found is None:
        raise InputError(
            "no KV cache capacity in this log (looked for TensorRT-LLM's '[MemUsageChange] Allocated X GiB "
            "for max tokens in paged KV cache (N)'); pass the trtllm-serve startup log",
            path=path,
        )
    try:
        return MeasuredCapacity(source=CapacitySource.TRTLLM_LOG, engine="trtllm", origin=path, **found)
    except KvtuneError as exc:
        raise InputError(exc.message, path=path, line=found["line"], field=exc.field) from None


_LOG_PARSERS = {"sglang": parse_sglang_log, "trtllm": parse_trtllm_log}


def parse_engine_log(engine: str, text: str, *, path: str = "<log>") -> MeasuredCapacity:
    """The last capacity in `engine`'s startup log (vLLM's through kvtune.capacity.measured)."""
    if engine == "vllm":
        return parse_vllm_log(text, path=path)
    return _LOG_PARSERS[_engine(engine)](text, path=path)


def read_engine_log(engine: str, path: str | os.PathLike[str]) -> MeasuredCapacity:
    """Read `engine`'s startup log file (at most VLLM_LOG_MAX_BYTES, encoding errors replaced) and
    parse it."""
    if engine == "vllm":
        return read_vllm_log(path)
    _engine(engine)
    text = userfiles.read_text(path, max_bytes=userfiles.VLLM_LOG_MAX_BYTES, field="--engine-log", errors="replace")
    return parse_engine_log(engine, text, path=str(path))


def _engine(engine: str) -> str:
    if engine not in ENGINE_NAMES:
        raise OptionError(f"unknown engine {brief(engine)} (known: {', '.join(ENGINE_NAMES)})", field="--engine")
    return engine


# --- SGLang's /server_info and /metrics -----------------------------------------------------------


def _field_int(data: Mapping[str, Any], name: str, origin: str, *, positive: bool = True) -> int | None:
    value = data.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < (1 if positive else 0):
        raise EndpointError(f"expected a {'positive ' if positive else ''}integer, found {brief(value)}",
                            path=origin, field=name)
    return value


def parse_server_info(data: Any, *, origin: str = "<server_info>") -> MeasuredCapacity:
    """Capacity from a JSON body of SGLang's GET /server_info."""
    if not isinstance(data, dict):
        raise EndpointError("not SGLang's /server_info: expected a JSON object", path=origin)
    tokens = _field_int(data, "max_total_num_tokens", origin)
    if tokens is None:
        raise EndpointError("no max_total_num_tokens: is this an SGLang server that has finished starting?",
                            path=origin, field="max_total_num_tokens")
    page = _field_int(data, "page_size", origin)
    running = None
    states = data.get("internal_states")
    if isinstance(states, list) and states and isinstance(states[0], dict):
        running = _field_int(states[0], "effective_max_running_requests_per_dp", origin)
    chunk = data.get("chunked_prefill_size")
    fraction = data.get("mem_fraction_static")
    if fraction is not None and (isinstance(fraction, bool) or not isinstance(fraction, (int, float))
                                 or not 0 < fraction <= 1):
        raise EndpointError(f"expected a fraction in (0, 1], found {brief(fraction)}", path=origin,
                            field="mem_fraction_static")
    dtype = data.get("kv_cache_dtype")
    model = data.get("served_model_name") or data.get("model_path")
    try:
        return MeasuredCapacity(
            source=CapacitySource.SGLANG_SERVER,
            engine="sglang",
            kv_cache_tokens=tokens,
            num_blocks=None if page is None else tokens // page,
            block_size=page,
            max_model_len=_field_int(data, "context_length", origin),
            model=model if isinstance(model, str) else None,
            kv_cache_dtype=_SGLANG_KV_DTYPES.get(dtype) if isinstance(dtype, str) else None,
            gpu_memory_utilization=None if fraction is None else float(fraction),
            max_num_seqs=running or _field_int(data, "max_running_requests", origin),
            max_num_batched_tokens=chunk if isinstance(chunk, int) and not isinstance(chunk, bool) and chunk > 0
            else None,
            device="CPU" if data.get("device") == "cpu" else "GPU",
            origin=origin,
        )
    except KvtuneError as exc:
        raise EndpointError(exc.message, path=origin, field=exc.field) from None


def parse_sglang_metrics(text: str, *, origin: str = "<metrics>") -> dict[str, int]:
    """SGLang's startup constants in a Prometheus exposition: {"max_total_num_tokens", "page_size",
    "context_len"} as far as present (first sample of each)."""
    from prometheus_client.parser import text_string_to_metric_families

    names = {sglang.MAX_TOTAL_NUM_TOKENS_METRIC: "max_total_num_tokens", sglang.PAGE_SIZE_METRIC: "page_size",
             sglang.CONTEXT_LEN_METRIC: "context_len"}
    found: dict[str, int] = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                key = names.get(sample.name)
                if key is not None and key not in found:
                    if not float(sample.value).is_integer() or sample.value < 0:
                        raise EndpointError(f"{sample.name} {sample.value} is not a whole number", path=origin,
                                            field=sample.name)
                    found[key] = int(sample.value)
    except (ValueError, TypeError, IndexError) as exc:
        raise EndpointError(f"not a Prometheus text exposition: {exc}", path=origin) from None
    return found


def sglang_capacity(info: MeasuredCapacity, models: tuple[ServedModel, ...], metrics: Mapping[str, int] | None,
                    *, root: str) -> MeasuredCapacity:
    """/server_info completed by /v1/models (the context length) and checked against /metrics."""
    served = next((m for m in models if m.id == info.model), models[0]) if models else None
    measured = dataclasses.replace(
        info, origin=root,
        model=served.id if served else info.model,
        max_model_len=info.max_model_len or (served.max_model_len if served else None)
        or (metrics or {}).get("context_len") or None,
    )
    for key, value in (("max_total_num_tokens", measured.kv_cache_tokens), ("page_size", measured.block_size),
                       ("context_len", measured.max_model_len)):
        reported = (metrics or {}).get(key)
        if reported is not None and value is not None and reported != value:
            raise EndpointError(f"/server_info says {key} {value:,} but /metrics says {reported:,}",
                                path=f"{root}/metrics", field=key)
    return measured


async def fetch_sglang_capacity(url: str, *, timeout_s: float = TIMEOUT_S,
                                field: str | None = None) -> MeasuredCapacity:
    """The capacity of the SGLang at `url` (its root, /server_info, /metrics or /v1): GET
    /server_info and /v1/models, then /metrics (served only with --enable-metrics; a 404 there
    is skipped)."""
    import aiohttp

    stripped = url.strip().rstrip("/")
    root = server_root(stripped.removesuffix(sglang.SERVER_INFO_PATH) or stripped, field=field)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
        info_url = f"{root}{sglang.SERVER_INFO_PATH}"
        body = await get_ok(session, info_url, timeout_s=timeout_s, max_bytes=SERVER_INFO_MAX_BYTES,
                            accept="application/json", field=field)
        try:
            data = json.loads(body)
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise EndpointError("not SGLang: /server_info did not answer JSON", path=info_url, field=field) from None
        info = parse_server_info(data, origin=info_url)
        models_url = f"{root}/v1/models"
        models = parse_models_body(await get_ok(session, models_url, timeout_s=timeout_s, max_bytes=MODELS_MAX_BYTES,
                                                accept="application/json", field=field), origin=models_url)
        page = await get(session, f"{root}/metrics", timeout_s=timeout_s, max_bytes=METRICS_MAX_BYTES,
                         accept="text/plain", field=field)
        metrics = None
        if page.status == 200:
            metrics = parse_sglang_metrics(page.text, origin=page.url)
        elif page.status != 404:
            raise EndpointError(f"HTTP {page.status} {page.reason}".strip(), path=page.url, field=field)
    return sglang_capacity(info, models, metrics, root=root)


# --- trtllm-serve's /metrics ---------------------------------------------------------------------------


NO_TRTLLM_ENDPOINT = (
    "TensorRT-LLM has no endpoint that states its KV capacity at startup: /metrics lists iteration "
    "stats (kvCacheStats.maxNumBlocks, tokensPerBlock) only after requests have run, with "
    "enable_iter_perf_stats: true in the --extra_llm_api_options YAML, and empties the list as it is "
    "read; send a request and retry, or pass the startup log (--engine-log FILE)"
)


def parse_trtllm_metrics(data: Any, *, origin: str = "<metrics>") -> MeasuredCapacity:
    """Capacity from trtllm-serve's /metrics JSON: the last iteration's kvCacheStats."""
    if not isinstance(data, list):
        raise EndpointError("not trtllm-serve's /metrics: expected a JSON list of iteration stats", path=origin)
    for i in range(len(data) - 1, -1, -1):
        entry = data[i]
        stats = entry.get(trtllm.KV_CACHE_STATS) if isinstance(entry, dict) else None
        if not isinstance(stats, dict):
            continue
        where = f"[{i}].{trtllm.KV_CACHE_STATS}"
        try:
            blocks = _field_int(stats, trtllm.MAX_NUM_BLOCKS_FIELD, origin)
            per_block = _field_int(stats, trtllm.TOKENS_PER_BLOCK_FIELD, origin)
        except EndpointError as exc:
            raise EndpointError(exc.message, path=origin, field=f"{where}.{exc.field}") from None
        if blocks is None or per_block is None:
            missing = trtllm.MAX_NUM_BLOCKS_FIELD if blocks is None else trtllm.TOKENS_PER_BLOCK_FIELD
            raise EndpointError("kvCacheStats without it", path=origin, field=f"{where}.{missing}")
        return MeasuredCapacity(source=CapacitySource.TRTLLM_METRICS, engine="trtllm", num_blocks=blocks,
                                block_size=per_block, kv_cache_tokens=blocks * per_block, device="GPU",
                                origin=origin)
    raise EndpointError(NO_TRTLLM_ENDPOINT, path=origin)


async def fetch_trtllm_capacity(url: str, *, timeout_s: float = TIMEOUT_S,
                                field: str | None = None) -> MeasuredCapacity:
    """The capacity trtllm-serve at `url` reports in /metrics (see NO_TRTLLM_ENDPOINT), with the
    served model from /v1/models."""
    import aiohttp

    root = server_root(url, field=field)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
        models_url = f"{root}/v1/models"
        models = parse_models_body(await get_ok(session, models_url, timeout_s=timeout_s, max_bytes=MODELS_MAX_BYTES,
                                                accept="application/json", field=field), origin=models_url)
        metrics_url = f"{root}{trtllm.METRICS_PATH}"
        page = await get(session, metrics_url, timeout_s=timeout_s, max_bytes=METRICS_MAX_BYTES,
                         accept="application/json", field=field)
    if page.status == 404:
        raise EndpointError(NO_TRTLLM_ENDPOINT, path=metrics_url, field=field)
    if page.status != 200:
        raise EndpointError(f"HTTP {page.status} {page.reason}".strip(), path=metrics_url, field=field)
    try:
        data = json.loads(page.body)
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise EndpointError("not trtllm-serve: /metrics did not answer JSON", path=metrics_url, field=field) from None
    measured = parse_trtllm_metrics(data, origin=metrics_url)
    return dataclasses.replace(measured, origin=root, model=models[0].id, max_model_len=models[0].max_model_len)


async def fetch_engine_capacity(engine: str, url: str, *, timeout_s: float = TIMEOUT_S,
                                field: str | None = None) -> MeasuredCapacity:
    """The capacity the running `engine` at `url` reports."""
    if engine == "vllm":
        return await fetch_capacity(url, timeout_s=timeout_s, field=field)
    if _engine(engine) == "sglang":
        return await fetch_sglang_capacity(url, timeout_s=timeout_s, field=field)
    return await fetch_trtllm_capacity(url, timeout_s=timeout_s, field=field)


# --- calibrate ---------------------------------------------------------------------------------


def cross_check_engine(live: MeasuredCapacity, logged: MeasuredCapacity) -> MeasuredCapacity:
    """`live` completed by `logged`, or a CapacityError naming the first figure they disagree on."""
    where = f"{logged.origin}:{logged.line}" if logged.line else logged.origin
    for name in ("kv_cache_tokens", "num_blocks", "block_size", "max_model_len"):
        server_value, log_value = getattr(live, name), getattr(logged, name)
        if server_value is not None and log_value is not None and server_value != log_value:
            title = ENGINE_TITLES[live.engine]
            raise CapacityError(
                f"the {title} server reports {name} {server_value:,} but the log {where} says {log_value:,}; "
                "is the log from this server's latest start?", field="--engine-log")
    return dataclasses.replace(
        live,
        max_model_len=live.max_model_len or logged.max_model_len,
        max_num_seqs=live.max_num_seqs or logged.max_num_seqs,
        max_num_batched_tokens=live.max_num_batched_tokens or logged.max_num_batched_tokens,
    )


async def calibrate_engine(engine: str, url: str | None, *, engine_log: str | None = None,
                           timeout_s: float = TIMEOUT_S) -> MeasuredCapacity:
    """`kvtune calibrate --engine ENGINE`: the capacity from a live server, a startup log, or both
    cross-checked."""
    if engine == "vllm":
        return await calibrate(url, vllm_log=engine_log, timeout_s=timeout_s)
    _engine(engine)
    if url is None and engine_log is None:
        raise OptionError("give the server's URL, its startup log (--engine-log FILE), or both", field="URL")
    logged = read_engine_log(engine, engine_log) if engine_log is not None else None
    if url is None:
        assert logged is not None
        return logged
    live = await fetch_engine_capacity(engine, url, timeout_s=timeout_s, field="URL")
    return live if logged is None else cross_check_engine(live, logged)


__all__ = [
    "parse_sglang_log", "parse_trtllm_log", "parse_engine_log", "read_engine_log", "parse_server_info",
    "parse_sglang_metrics", "sglang_capacity", "fetch_sglang_capacity", "NO_TRTLLM_ENDPOINT", "parse_trtllm_metrics",
    "fetch_trtllm_capacity", "fetch_engine_capacity", "cross_check_engine", "calibrate_engine",
]
