"""OpenTelemetry GenAI spans (§2.8): OTLP JSON export lines, or flat `gen_ai.*` records
(Envoy AI Gateway access logs, spans dumped with a plain attribute dict).

Both the current attribute names (`gen_ai.usage.input_tokens`/`output_tokens`) and the
deprecated ones vLLM still emits (`prompt_tokens`/`completion_tokens`) are read. Spans with no
`gen_ai.*` attribute (HTTP parents, DB calls) are not requests: they lend their `http.route` to
their children and are otherwise ignored, counted apart from skipped rows.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from kvtune.ingest.schemas._base import Adapter, Row
from kvtune.ingest.schemas._fields import (
    BAD_STRUCTURE,
    FAILED,
    NOT_GENERATION,
    RowError,
    as_float,
    as_int,
    as_str,
    as_time,
    text_of,
)
from kvtune.ingest.schemas.gateways import maybe_json
from kvtune.ingest.schemas.openai import url_path

_OUTPUT = ("gen_ai.usage.output_tokens", "gen_ai.usage.completion_tokens")
_INPUT = ("gen_ai.usage.input_tokens", "gen_ai.usage.prompt_tokens")
_ROUTE = ("http.route", "url.path", "x-envoy-origin-path", "http.target")


def any_value(value: Any) -> Any:
    """OTLP JSON AnyValue → Python (int64 values arrive as strings and stay strings here)."""
    if not isinstance(value, Mapping):
        return value
    for key in ("stringValue", "intValue", "doubleValue", "boolValue", "bytesValue"):
        if key in value:
            return value[key]
    if "arrayValue" in value:
        values = value["arrayValue"].get("values") if isinstance(value["arrayValue"], Mapping) else None
        return [any_value(v) for v in values or []]
    if "kvlistValue" in value:
        kv = value["kvlistValue"].get("values") if isinstance(value["kvlistValue"], Mapping) else None
        return attributes(kv)
    return None


def attributes(items: Any) -> dict[str, Any]:
    """`[{key, value: {intValue: "12"}}]` → {key: "12"}; a plain dict passes through."""
    if isinstance(items, Mapping):
        return dict(items)
    out: dict[str, Any] = {}
    if isinstance(items, list):
        for item in items:
            if isinstance(item, Mapping) and isinstance(item.get("key"), str):
                out[item["key"]] = any_value(item.get("value"))
    return out


def _first(attrs: Mapping[str, Any], names: tuple[str, ...]) -> tuple[str, Any]:
    for name in names:
        if attrs.get(name) is not None:
            return name, attrs[name]
    return names[0], None


def _finish(value: Any, field: str) -> str | None:
    value = maybe_json(value)
    if isinstance(value, list):
        reasons = [as_str(v, field) for v in value]
        reasons = [r for r in reasons if r]
        return "length" if "length" in reasons else (reasons[0] if reasons else None)
    return as_str(value, field)


def _is_generation(attrs: Mapping[str, Any]) -> bool:
    return any(k.startswith("gen_ai.") for k in attrs)


def span_row(attrs: Mapping[str, Any], span: Mapping[str, Any], path: str | None) -> Row:
    """One GenAI span (attributes already decoded) → a row."""
    if not _is_generation(attrs):
        raise RowError(None, "span without gen_ai attributes", NOT_GENERATION)
    status = span.get("status")
    code = status.get("code") if isinstance(status, Mapping) else None
    if code in (2, "2", "STATUS_CODE_ERROR") or attrs.get("error.type"):
        raise RowError("status", f"span error {attrs.get('error.type') or code}", FAILED)
    out_name, out_value = _first(attrs, _OUTPUT)
    in_name, in_value = _first(attrs, _INPUT)
    row: Row = {
        "output_tokens": as_int(out_value, out_name),
        "_out": out_name,
        "prompt_tokens": as_int(in_value, in_name),
        "max_tokens": as_int(attrs.get("gen_ai.request.max_tokens"), "gen_ai.request.max_tokens"),
        "model": as_str(attrs.get("gen_ai.response.model"), "gen_ai.response.model")
        or as_str(attrs.get("gen_ai.request.model"), "gen_ai.request.model"),
        "finish_reason": _finish(
            attrs.get("gen_ai.response.finish_reasons"), "gen_ai.response.finish_reasons"
        ),
        "path": path,
    }
    start = as_time(span.get("startTimeUnixNano"), "startTimeUnixNano", "ns")
    end = as_time(span.get("endTimeUnixNano"), "endTimeUnixNano", "ns")
    if start is None and "start_time" in span:  # flat access-log records
        start = as_time(span.get("start_time"), "start_time")
    row["timestamp_s"] = start
    if start is not None and end is not None:
        row["latency_ms"] = (end - start) * 1000.0
    elif attrs.get("gen_ai.latency.e2e") is not None:
        e2e = as_float(attrs["gen_ai.latency.e2e"], "gen_ai.latency.e2e")
        row["latency_ms"] = None if e2e is None else e2e * 1000.0
    elif span.get("duration") is not None:  # Envoy %DURATION% is milliseconds
        row["latency_ms"] = as_float(span["duration"], "duration")
    ttft_name, ttft = _first(
        attrs, ("gen_ai.response.time_to_first_chunk", "gen_ai.latency.time_to_first_token")
    )
    ttft_s = as_float(ttft, ttft_name)
    row["ttft_ms"] = None if ttft_s is None else ttft_s * 1000.0
    if row["output_tokens"] is None:
        row["output_text"] = text_of(
            maybe_json(attrs.get("gen_ai.output.messages") or attrs.get("gen_ai.completion"))
        )
    if row["prompt_tokens"] is None:
        row["prompt_text"] = text_of(
            maybe_json(attrs.get("gen_ai.input.messages") or attrs.get("gen_ai.prompt"))
        )
    row["_ctx"] = {**{k: v for k, v in span.items() if k != "attributes"}, **attrs}
    return row


def _list(value: Any, field: str) -> list[Any]:
    """An OTLP array, or a RowError: a mistyped array makes the whole record unusable."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise RowError(field, f"expected a list, got {type(value).__name__}", BAD_STRUCTURE)
    return value


def _spans(record: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    spans: list[Mapping[str, Any]] = []
    for rs in _list(record.get("resourceSpans"), "resourceSpans"):
        if not isinstance(rs, Mapping):
            continue
        scopes = (_list(rs.get("scopeSpans"), "resourceSpans[].scopeSpans")
                  + _list(rs.get("instrumentationLibrarySpans"), "resourceSpans[].instrumentationLibrarySpans"))
        for ss in scopes:
            if isinstance(ss, Mapping):
                spans.extend(s for s in _list(ss.get("spans"), "scopeSpans[].spans") if isinstance(s, Mapping))
    return spans


def _otlp_rows(record: Mapping[str, Any]) -> Iterator[Row | RowError]:
    if "resourceSpans" not in record:  # a flat gen_ai record
        try:
            attrs = attributes(record.get("attributes", record))
            _, path = _first({**record, **attrs}, _ROUTE)
            yield span_row(attrs, record, url_path(path) if isinstance(path, str) else None)
        except RowError as err:
            yield err
        return
    try:
        spans = _spans(record)
    except RowError as err:
        yield err
        return
    decoded = [attributes(s.get("attributes")) for s in spans]
    by_id = {s.get("spanId"): i for i, s in enumerate(spans) if s.get("spanId")}

    def route_of(span: int) -> str | None:
        at: int | None = span
        seen: set[int] = set()
        while at is not None and at not in seen:  # walk up to the HTTP span, guarding cycles
            seen.add(at)
            _, path = _first(decoded[at], _ROUTE)
            if isinstance(path, str) and path:
                return url_path(path)
            at = by_id.get(spans[at].get("parentSpanId"))
        return None

    for i, (span, attrs) in enumerate(zip(spans, decoded, strict=True)):
        try:
            yield span_row(attrs, span, route_of(i))
        except RowError as err:
            yield err


def _match(record: Mapping[str, Any]) -> bool:
    if "resourceSpans" in record:
        return True
    attrs = record.get("attributes")
    keys = attrs.keys() if isinstance(attrs, Mapping) else record.keys()
    return any(isinstance(k, str) and k.startswith("gen_ai.usage.") for k in keys)


OTEL = Adapter(
    name="otel",
    description="OpenTelemetry GenAI spans: OTLP JSON (resourceSpans[].scopeSpans[].spans[]) or "
    "flat gen_ai.* records; gen_ai.usage.{input,output,prompt,completion}_tokens, "
    "gen_ai.request.max_tokens, gen_ai.response.finish_reasons",
    match=_match,
    rows=_otlp_rows,
    containers=frozenset({"json"}),
)
