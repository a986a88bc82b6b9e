"""OpenAI-shaped logs (§2.1–2.4): Chat Completions / Completions, Responses API, Anthropic Messages,
request+response pairs, and Batch API input/output JSONL.

The three response bodies are parsed by one function because pair logs and batch outputs wrap
any of them; the field paths in errors keep the wrapper prefix (`response.body.usage...`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from kvtune.ingest.schemas._base import Adapter, Row, has
from kvtune.ingest.schemas._fields import (
    FAILED,
    RowError,
    as_float,
    as_int,
    as_str,
    as_time,
    dig,
    text_of,
)

CHAT_OBJECTS = ("chat.completion", "text_completion")


def body_kind(body: Any) -> str | None:
    """Which response body this is: chat, responses, anthropic, or None."""
    if not isinstance(body, Mapping):
        return None
    obj = body.get("object")
    if obj in CHAT_OBJECTS and ("usage" in body or "choices" in body):
        return "chat"
    if obj == "response" and ("usage" in body or "status" in body):
        return "responses"
    if body.get("type") == "message" and ("stop_reason" in body or "usage" in body):
        return "anthropic"
    return None


def parse_body(body: Mapping[str, Any], prefix: str = "") -> Row:
    """Tokens, finish reason, model and timestamp of one response body of any supported kind."""
    kind = body_kind(body)
    usage = body.get("usage")
    if not isinstance(usage, Mapping):
        usage = {}
    row: Row = {"model": as_str(body.get("model"), prefix + "model")}
    if kind == "chat":
        row["prompt_tokens"] = as_int(usage.get("prompt_tokens"), prefix + "usage.prompt_tokens")
        row["output_tokens"] = as_int(
            usage.get("completion_tokens"), prefix + "usage.completion_tokens"
        )
        row["_out"] = prefix + "usage.completion_tokens"
        row["timestamp_s"] = as_time(body.get("created"), prefix + "created")
        choices = body.get("choices")
        reasons: list[str] = []
        texts: list[str] = []
        if isinstance(choices, list):
            for i, choice in enumerate(choices):
                if not isinstance(choice, Mapping):
                    continue
                r = as_str(choice.get("finish_reason"), f"{prefix}choices[{i}].finish_reason")
                if r is not None:
                    reasons.append(r)
                t = text_of(choice.get("message", choice.get("text")))
                if t:
                    texts.append(t)
        # n > 1: one request, usage sums the choices; it was cut if any choice was cut
        row["finish_reason"] = "length" if "length" in reasons else (reasons[0] if reasons else None)
        row["output_text"] = "\n".join(texts) if texts else None
    elif kind == "responses":
        row["prompt_tokens"] = as_int(usage.get("input_tokens"), prefix + "usage.input_tokens")
        row["output_tokens"] = as_int(usage.get("output_tokens"), prefix + "usage.output_tokens")
        row["_out"] = prefix + "usage.output_tokens"
        row["max_tokens"] = as_int(body.get("max_output_tokens"), prefix + "max_output_tokens")
        row["timestamp_s"] = as_time(body.get("created_at"), prefix + "created_at")
        status = as_str(body.get("status"), prefix + "status")
        if status in ("failed", "cancelled", "in_progress", "queued"):
            raise RowError(prefix + "status", f"response status {status}", FAILED)
        if status == "incomplete":
            # incomplete_details is sometimes null although the output was cut (§2.3)
            reason = as_str(dig(body, "incomplete_details.reason"), "incomplete_details.reason")
            row["finish_reason"] = "content_filter" if reason == "content_filter" else "length"
        elif status == "completed":
            row["finish_reason"] = "stop"
        output = body.get("output")
        row["output_text"] = text_of(
            [item.get("content") for item in output if isinstance(item, Mapping)] if isinstance(output, list) else None
        )
    elif kind == "anthropic":
        # Anthropic input_tokens excludes cached tokens; add them so prompts mean the same (§2.4)
        parts = [
            as_int(usage.get(k), prefix + "usage." + k)
            for k in ("input_tokens", "cache_creation_input_tokens", "cache_read_input_tokens")
        ]
        row["prompt_tokens"] = None if parts[0] is None else sum(p or 0 for p in parts)
        row["output_tokens"] = as_int(usage.get("output_tokens"), prefix + "usage.output_tokens")
        row["_out"] = prefix + "usage.output_tokens"
        row["finish_reason"] = as_str(body.get("stop_reason"), prefix + "stop_reason")
        row["output_text"] = text_of(body.get("content"))
    return row


def request_fields(request: Any, prefix: str) -> Row:
    """What a logged request adds: the cap asked for, the model, the path and the prompt text."""
    row: Row = {}
    if not isinstance(request, Mapping):
        return row
    for key in ("max_tokens", "max_completion_tokens", "max_output_tokens", "max_new_tokens"):
        if request.get(key) is not None:
            row["max_tokens"] = as_int(request[key], prefix + key)
            break
    row["model"] = as_str(request.get("model"), prefix + "model")
    for key in ("messages", "prompt", "input"):
        if key in request:
            prompt = text_of(request[key])
            system = text_of(request.get("system")) if "system" in request else None
            row["prompt_text"] = "\n".join(t for t in (system, prompt) if t) or None
            break
    for key in ("url", "path"):
        if isinstance(request.get(key), str):
            row["path"] = url_path(request[key])
    return row


def url_path(url: str) -> str:
    """`https://api.example.com/v1/chat/completions?x=1` → `/v1/chat/completions`."""
    if "://" in url:
        url = url.split("://", 1)[1]
        url = "/" + url.split("/", 1)[1] if "/" in url else "/"
    return url.split("?", 1)[0]


def _merge(base: Row, extra: Row) -> Row:
    for key, value in extra.items():
        if value is not None and base.get(key) is None:
            base[key] = value
    return base


def _one(record: Mapping[str, Any]) -> Iterator[Row | RowError]:
    try:
        yield parse_body(record)
    except RowError as err:
        yield err


# --- request + response pairs -----------------------------------------------------------------

_PAIR_RESPONSE_KEYS = ("response", "response_body", "output")
_PAIR_REQUEST_KEYS = ("request", "request_body", "body")


def _pair_response(record: Mapping[str, Any]) -> tuple[str, Any]:
    for key in _PAIR_RESPONSE_KEYS:
        value = record.get(key)
        if body_kind(value):
            return key, value
    return "", None


def _match_pair(record: Mapping[str, Any]) -> bool:
    key, _ = _pair_response(record)
    return bool(key) and any(isinstance(record.get(k), Mapping) for k in _PAIR_REQUEST_KEYS)


def _pair_rows(record: Mapping[str, Any]) -> Iterator[Row | RowError]:
    try:
        key, body = _pair_response(record)
        if body is None:
            raise RowError(None, "no response body of a known kind", FAILED)
        row = parse_body(body, key + ".")
        for req_key in _PAIR_REQUEST_KEYS:
            if isinstance(record.get(req_key), Mapping):
                _merge(row, request_fields(record[req_key], req_key + "."))
                break
        for path_key in ("url", "path", "endpoint", "route"):
            if isinstance(record.get(path_key), str):
                row["path"] = url_path(record[path_key])
                break
        for ts_key in ("timestamp", "created_at", "start_time", "time"):
            if record.get(ts_key) is not None:
                row["timestamp_s"] = as_time(record[ts_key], ts_key)
                break
        for lat_key, scale in (("latency_ms", 1.0), ("duration_ms", 1.0), ("latency_s", 1000.0)):
            if record.get(lat_key) is not None:
                v = as_float(record[lat_key], lat_key)
                row["latency_ms"] = None if v is None else v * scale
                break
        for ttft_key, scale in (("ttft_ms", 1.0), ("ttft_s", 1000.0)):
            if record.get(ttft_key) is not None:
                v = as_float(record[ttft_key], ttft_key)
                row["ttft_ms"] = None if v is None else v * scale
                break
        yield row
    except RowError as err:
        yield err


# --- Batch API --------------------------------------------------------------------------------


def _match_batch_output(record: Mapping[str, Any]) -> bool:
    return "custom_id" in record and "response" in record and "error" in record


def _batch_rows(record: Mapping[str, Any]) -> Iterator[Row | RowError]:
    try:
        custom_id = as_str(record.get("custom_id"), "custom_id")
        error = record.get("error")
        response = record.get("response")
        if error:
            code = dig(error, "code") if isinstance(error, Mapping) else None
            raise RowError("error", f"request failed: {code or 'error'}", FAILED)
        if not isinstance(response, Mapping):
            raise RowError("response", "no response", FAILED)
        status = as_int(response.get("status_code"), "response.status_code", tokens=False)
        if status is not None and status >= 400:
            raise RowError("response.status_code", f"HTTP {status}", FAILED)
        body = response.get("body")
        if not isinstance(body, Mapping) or not body_kind(body):
            raise RowError("response.body", "not a chat, responses or messages body", FAILED)
        row = parse_body(body, "response.body.")
        row["_custom_id"] = custom_id
        yield row
    except RowError as err:
        yield err


def _match_batch_input(record: Mapping[str, Any]) -> bool:
    return has(record, "custom_id", "url", "body") and "response" not in record


def batch_input_entry(record: Mapping[str, Any]) -> tuple[str, Row]:
    """custom_id → {path, max_tokens, model} of one Batch API input line, joined to its output."""
    custom_id = as_str(record.get("custom_id"), "custom_id")
    if custom_id is None:
        raise RowError("custom_id", "missing", FAILED)
    row = request_fields(record.get("body"), "body.")
    row.pop("prompt_text", None)  # the batch output carries usage; prompt text is not needed
    if isinstance(record.get("url"), str):
        row["path"] = url_path(record["url"])
    return custom_id, row


def _no_rows(record: Mapping[str, Any]) -> Iterator[Row | RowError]:
    return iter(())


OPENAI = Adapter(
    name="openai",
    description="OpenAI Chat Completions / Completions response objects "
    "(object chat.completion|text_completion, usage.prompt_tokens, usage.completion_tokens)",
    match=lambda r: body_kind(r) == "chat",
    rows=_one,
    containers=frozenset({"json"}),
)

RESPONSES = Adapter(
    name="openai-responses",
    description="OpenAI Responses API objects (object response, usage.input_tokens/output_tokens, "
    "status incomplete = cut)",
    match=lambda r: body_kind(r) == "responses",
    rows=_one,
    containers=frozenset({"json"}),
)

ANTHROPIC = Adapter(
    name="anthropic",
    description="Anthropic Messages responses (type message, usage.output_tokens, "
    "stop_reason max_tokens = cut)",
    match=lambda r: body_kind(r) == "anthropic",
    rows=_one,
    containers=frozenset({"json"}),
)

PAIR = Adapter(
    name="openai-pair",
    description="request+response pairs: {request|body: {...max_tokens, messages}, "
    "response: <chat|responses|messages body>, url?, timestamp?, latency_ms?, ttft_ms?}",
    match=_match_pair,
    rows=_pair_rows,
    containers=frozenset({"json"}),
)

BATCH_OUTPUT = Adapter(
    name="openai-batch",
    description="OpenAI Batch API output JSONL (custom_id, response.body, error); give the "
    "input JSONL too for the route (url) and cap (body.max_tokens)",
    match=_match_batch_output,
    rows=_batch_rows,
    containers=frozenset({"json"}),
)

BATCH_INPUT = Adapter(
    name="openai-batch-input",
    description="OpenAI Batch API input JSONL (custom_id, url, body); joined to the output "
    "file on custom_id, it yields no rows by itself",
    match=_match_batch_input,
    rows=_no_rows,
    containers=frozenset({"json"}),
)
