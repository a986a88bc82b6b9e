"""Gateway and observability exports (§2.5–2.7): LiteLLM spend logs and standard logging payload,
Langfuse generations, Helicone requests.

These carry token counts as columns, but the finish reason and the requested cap only inside
stored request/response bodies, which CSV exports hold as JSON strings; both are decoded here.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from typing import Any

from kvtune.ingest.schemas._base import Adapter, Row, has
from kvtune.ingest.schemas._fields import (
    FAILED,
    NOT_GENERATION,
    RowError,
    as_float,
    as_int,
    as_str,
    as_time,
    dig,
    text_of,
)
from kvtune.ingest.schemas.openai import body_kind, parse_body, request_fields, url_path


def maybe_json(value: Any) -> Any:
    """Decode a JSON object or list stored as a string (CSV exports, Postgres text columns)."""
    if isinstance(value, str) and value[:1] in ("{", "["):
        try:
            return json.loads(value)
        except ValueError:
            return value
    return value


def _finish_from_response(response: Any, prefix: str) -> str | None:
    response = maybe_json(response)
    if not isinstance(response, Mapping):
        return None
    if body_kind(response):
        try:
            return parse_body(response, prefix).get("finish_reason")
        except RowError:
            return None
    return as_str(dig(response, "choices[0].finish_reason"), prefix + "choices[0].finish_reason")


def _durations(row: Row, record: Mapping[str, Any], start: str, end: str, first: str) -> None:
    """latency = end − start and TTFT = first token − start, when logged (seconds → ms)."""
    t0 = as_time(record.get(start), start)
    row["timestamp_s"] = t0
    if t0 is None:
        return
    t1 = as_time(record.get(end), end)
    if t1 is not None and row.get("latency_ms") is None:
        row["latency_ms"] = (t1 - t0) * 1000.0
    tf = as_time(record.get(first), first)
    if tf is not None and row.get("ttft_ms") is None:
        row["ttft_ms"] = (tf - t0) * 1000.0


def _check_status(record: Mapping[str, Any]) -> None:
    status = record.get("status")
    if isinstance(status, str) and status.lower() in ("failure", "failed", "error"):
        raise RowError("status", f"request status {status}", FAILED)


# --- LiteLLM ----------------------------------------------------------------------------------


def _litellm_rows(record: Mapping[str, Any]) -> Iterator[Row | RowError]:
    try:
        _check_status(record)
        row: Row = {
            "prompt_tokens": as_int(record.get("prompt_tokens"), "prompt_tokens"),
            "output_tokens": as_int(record.get("completion_tokens"), "completion_tokens"),
            "_out": "completion_tokens",
            # model_group is the public name clients asked for; model is the deployment
            "model": as_str(record.get("model_group"), "model_group")
            or as_str(record.get("model"), "model"),
        }
        if record.get("request_duration_ms") is not None:
            row["latency_ms"] = as_float(record["request_duration_ms"], "request_duration_ms")
        _durations(row, record, "startTime", "endTime", "completionStartTime")
        metadata = maybe_json(record.get("metadata"))
        route = dig(metadata, "user_api_key_request_route") if isinstance(metadata, Mapping) else None
        if isinstance(route, str) and route:
            row["path"] = url_path(route)
        request = maybe_json(record.get("proxy_server_request"))
        if isinstance(request, Mapping):
            extra = request_fields(request.get("body", request), "proxy_server_request.")
            extra.pop("model", None)
            extra.pop("prompt_text", None)
            for k, v in extra.items():
                if v is not None and row.get(k) is None:
                    row[k] = v
        params = maybe_json(record.get("model_parameters"))
        if isinstance(params, Mapping) and row.get("max_tokens") is None:
            for key in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
                if params.get(key) is not None:
                    row["max_tokens"] = as_int(params[key], "model_parameters." + key)
                    break
        row["finish_reason"] = _finish_from_response(record.get("response"), "response.")
        if row["output_tokens"] is None:
            response = maybe_json(record.get("response"))
            if isinstance(response, Mapping) and body_kind(response):
                row["output_text"] = parse_body(response, "response.").get("output_text")
            elif isinstance(response, str):
                row["output_text"] = response
        yield row
    except RowError as err:
        yield err


LITELLM_SPEND = Adapter(
    name="litellm-spend",
    description="LiteLLM SpendLogs rows (request_id, spend, startTime, model_group, "
    "prompt_tokens, completion_tokens; JSON, CSV or Parquet)",
    match=lambda r: has(r, "request_id", "spend", "startTime", "completion_tokens"),
    rows=_litellm_rows,
)

LITELLM_PAYLOAD = Adapter(
    name="litellm-payload",
    description="LiteLLM StandardLoggingPayload (trace_id, model_parameters, response_cost, "
    "completionStartTime; route from metadata.user_api_key_request_route)",
    match=lambda r: has(r, "model_parameters", "response_cost", "completion_tokens")
    and ("trace_id" in r or "completionStartTime" in r),
    rows=_litellm_rows,
)


# --- Langfuse ---------------------------------------------------------------------------------


def _langfuse_rows(record: Mapping[str, Any]) -> Iterator[Row | RowError]:
    try:
        kind = record.get("type")
        if kind is not None and kind != "GENERATION":
            raise RowError("type", f"observation type {kind}", NOT_GENERATION)
        if record.get("level") == "ERROR":
            raise RowError("level", "observation level ERROR", FAILED)
        prompt = output = None
        out_field = "usageDetails.output"
        for base, inp, out in (
            ("usageDetails", "input", "output"),
            ("usage", "input", "output"),
            ("", "promptTokens", "completionTokens"),
        ):
            holder = record.get(base) if base else record
            if isinstance(holder, Mapping) and holder.get(out) is not None:
                prefix = base + "." if base else ""
                output = as_int(holder.get(out), prefix + out)
                prompt = as_int(holder.get(inp), prefix + inp)
                out_field = prefix + out
                break
        row: Row = {
            "prompt_tokens": prompt,
            "output_tokens": output,
            "_out": out_field,
            "model": as_str(record.get("model"), "model"),
        }
        params = maybe_json(record.get("modelParameters"))
        if isinstance(params, Mapping):
            for key in ("max_tokens", "max_completion_tokens", "max_output_tokens", "maxTokens"):
                if params.get(key) is not None:
                    row["max_tokens"] = as_int(params[key], "modelParameters." + key)
                    break
        if record.get("latency") is not None:
            latency_s = as_float(record["latency"], "latency")
            row["latency_ms"] = None if latency_s is None else latency_s * 1000.0
        if record.get("timeToFirstToken") is not None:
            ttft_s = as_float(record["timeToFirstToken"], "timeToFirstToken")
            row["ttft_ms"] = None if ttft_s is None else ttft_s * 1000.0
        _durations(row, record, "startTime", "endTime", "completionStartTime")
        metadata = maybe_json(record.get("metadata"))
        output_obj = maybe_json(record.get("output"))
        reason = None
        if isinstance(output_obj, Mapping):
            reason = dig(output_obj, "finish_reason") or dig(output_obj, "choices[0].finish_reason")
        if reason is None and isinstance(metadata, Mapping):
            reason = (
                dig(metadata, "finish_reason")
                or dig(metadata, "stop_reason")
                or dig(metadata, "gen_ai.response.finish_reasons[0]")
            )
        row["finish_reason"] = as_str(reason, "finish_reason")
        if output is None:
            row["output_text"] = text_of(output_obj)
        if prompt is None:
            row["prompt_text"] = text_of(maybe_json(record.get("input")))
        yield row
    except RowError as err:
        yield err


LANGFUSE = Adapter(
    name="langfuse",
    description="Langfuse observations export (traceId, type GENERATION, usageDetails or usage, "
    "modelParameters.max_tokens, completionStartTime)",
    match=lambda r: "traceId" in r
    and "type" in r
    and ("usageDetails" in r or "usage" in r or "completionTokens" in r),
    rows=_langfuse_rows,
)


# --- Helicone ---------------------------------------------------------------------------------


def _helicone_rows(record: Mapping[str, Any]) -> Iterator[Row | RowError]:
    try:
        status = as_int(record.get("response_status"), "response_status", tokens=False)
        if status is not None and (status >= 400 or status < 0):
            raise RowError("response_status", f"HTTP {status}", FAILED)
        row: Row = {
            "prompt_tokens": as_int(record.get("prompt_tokens"), "prompt_tokens"),
            "output_tokens": as_int(record.get("completion_tokens"), "completion_tokens"),
            "_out": "completion_tokens",
            "model": as_str(record.get("request_model"), "request_model")
            or as_str(record.get("model"), "model"),
            "timestamp_s": as_time(record.get("request_created_at"), "request_created_at"),
            "latency_ms": as_float(record.get("delay_ms"), "delay_ms"),
            "ttft_ms": as_float(record.get("time_to_first_token"), "time_to_first_token"),
        }
        path = as_str(record.get("request_path"), "request_path")
        row["path"] = url_path(path) if path else None
        request = maybe_json(record.get("request_body"))
        if isinstance(request, Mapping):
            extra = request_fields(request, "request_body.")
            for k, v in extra.items():
                if v is not None and row.get(k) is None:
                    row[k] = v
        response = maybe_json(record.get("response_body"))
        row["finish_reason"] = _finish_from_response(response, "response_body.")
        if row["output_tokens"] is None and isinstance(response, Mapping) and body_kind(response):
            row["output_text"] = parse_body(response, "response_body.").get("output_text")
        yield row
    except RowError as err:
        yield err


HELICONE = Adapter(
    name="helicone",
    description="Helicone request export (request_created_at, request_path, delay_ms, "
    "prompt_tokens, completion_tokens; bodies with --include-body)",
    match=lambda r: has(r, "request_created_at", "request_path", "delay_ms"),
    rows=_helicone_rows,
)
