"""The body a governed request is forwarded with: its output caps written with the admitted cap.

Only the members the gateway governs change (every cap field the request's readings read, the
first one added where none is present, and a min_tokens above the cap lowered to it, which vLLM
requires); every other byte arrives as the client sent it (kvtune.gateway.body).
"""

from __future__ import annotations

from typing import Any

from kvtune.gateway.apis import CapField, Request
from kvtune.gateway.body import Body, Member, members, splice


def rewrite(body: Body, asked: Request, cap: int) -> bytes:
    """The body with every cap field the request's readings read set to `cap` (the first one
    added where none is present) and a min_tokens above the cap lowered to it; nothing else."""
    fields: dict[CapField, None] = {}
    adds: dict[CapField, None] = {}
    floors: dict[CapField, None] = {}
    for reading in asked.readings:
        if not reading.generates:
            continue
        present = [f for f in reading.caps if _has(body.doc, f)]
        fields.update(dict.fromkeys(present))
        if not present and reading.add_cap is not None:
            adds[reading.add_cap] = None
        if reading.min_tokens is not None:
            floors[reading.min_tokens] = None
    value = str(cap).encode()
    edits: dict[int, tuple[int, bytes]] = {}
    inserts: list[tuple[int, bytes]] = []
    spans: dict[str | None, tuple[int, list[Member]]] = {None: (body.open_at, list(body.top))}
    for f in [*fields, *adds, *floors]:
        if f.parent is not None and f.parent not in spans:
            parent = body.member(f.parent)
            if parent is None:  # only fields present in the body, or under a parent that is, get here
                raise ValueError(f"no member {f.parent!r} in the body")
            spans[f.parent] = (parent.start, members(body.raw, parent.start))
    for f in fields:
        m = _member(spans, f)
        edits[m.start] = (m.end, value)
    for f in floors:
        floor = _value(body.doc, f)
        if isinstance(floor, (int, float)) and not isinstance(floor, bool) and floor > cap:
            m = _member(spans, f)
            edits[m.start] = (m.end, value)
    for f in adds:
        if f in fields:
            continue
        open_at, existing = spans[f.parent]
        sep = b"," if existing else b""
        inserts.append((open_at + 1, b'"' + f.key.encode() + b'":' + value + sep))
    out = body.raw
    if inserts or edits:
        out = _apply(body.raw, edits, inserts)
    return out


def _apply(raw: bytes, edits: dict[int, tuple[int, bytes]], inserts: list[tuple[int, bytes]]) -> bytes:
    merged = dict(edits)
    for position, text in inserts:
        start, (end, new) = position, merged.get(position, (position, b""))
        merged[start] = (end, text + new)
    return splice(raw, merged)


def _has(doc: dict[str, Any], f: CapField) -> bool:
    holder = doc if f.parent is None else doc.get(f.parent)
    return isinstance(holder, dict) and f.key in holder


def _value(doc: dict[str, Any], f: CapField) -> Any:
    holder = doc if f.parent is None else doc.get(f.parent)
    return holder.get(f.key) if isinstance(holder, dict) else None


def _member(spans: dict[str | None, tuple[int, list[Member]]], f: CapField) -> Member:
    _, found = spans[f.parent]
    return next(m for m in reversed(found) if m.key == f.key)


__all__ = ["rewrite"]
