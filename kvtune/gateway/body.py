"""A request body as the gateway reads it and as it forwards it.

Reading: the body must be one JSON object, UTF-8 without lone surrogates (no tokenizer can
count them), nested no deeper than the parser allows, with no key given twice at the top level
(two parsers may keep different copies of a repeated key, so what the gateway counts and what
the engine runs could differ).

Forwarding: the gateway changes only the members it governs (the output caps, min_tokens) and
leaves every other byte as the client sent it; a re-encoded body would turn 2**70 into 1.18e21
and NaN into null. `Members` finds the byte spans of an object's members without a second
parse, and `splice` writes new values into them.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from kvtune.gateway import _json
from kvtune.gateway.refusals import Reason


class BodyError(ValueError):
    """A body the gateway will not read: not JSON, not an object, or not countable text."""

    def __init__(self, reason: Reason, message: str) -> None:
        super().__init__(message)
        self.reason = reason


# One JSON string (quotes included), and what matters inside a nested value: strings and brackets.
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NESTED = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"|[\[\]{}]', re.DOTALL)
_WS = re.compile(rb"[ \t\n\r]*")
_SCALAR = re.compile(rb"[^,}\] \t\n\r]+")


def _past(pattern: re.Pattern[bytes], raw: bytes, i: int) -> int:
    """Where `pattern` matched at `i` ends; a body the parser accepted always matches here."""
    m = pattern.match(raw, i)
    if m is None:
        raise BodyError(Reason.INVALID_JSON, "request body must be a JSON object")
    return m.end()


@dataclass(frozen=True, slots=True)
class Member:
    """One `"key": value` of an object: the decoded key and the byte span of its value."""

    key: str
    start: int  # first byte of the value
    end: int  # one past its last byte


def members(raw: bytes, open_at: int) -> list[Member]:
    """The members of the JSON object whose `{` is at `open_at`, in order. `raw` must already
    have been accepted by a JSON parser: this only locates what the parser read."""
    out: list[Member] = []
    i = _past(_WS, raw, open_at + 1)
    if raw[i:i + 1] == b"}":
        return out
    while True:
        key = _STRING.match(raw, i)
        if key is None:
            raise BodyError(Reason.INVALID_JSON, "request body must be a JSON object")
        text = key.group()
        name = text[1:-1].decode("utf-8") if b"\\" not in text else json.loads(text)
        i = _past(_WS, raw, key.end()) + 1  # past the colon
        i = _past(_WS, raw, i)
        end = _value_end(raw, i)
        out.append(Member(name, i, end))
        i = _past(_WS, raw, end)
        if raw[i:i + 1] == b"}":
            return out
        i = _past(_WS, raw, i + 1)  # past the comma


def _value_end(raw: bytes, i: int) -> int:
    first = raw[i:i + 1]
    if first == b'"':
        return _past(_STRING, raw, i)
    if first in (b"{", b"["):
        depth = 0
        for m in _NESTED.finditer(raw, i):
            token = m.group()
            if token in (b"{", b"["):
                depth += 1
            elif token in (b"}", b"]"):
                depth -= 1
                if depth == 0:
                    return m.end()
        raise BodyError(Reason.INVALID_JSON, "request body must be a JSON object")
    return _past(_SCALAR, raw, i)


@dataclass(frozen=True, slots=True)
class Body:
    """A parsed request body: the document and the raw bytes with its top-level members."""

    raw: bytes
    doc: dict
    open_at: int
    top: tuple[Member, ...]

    def member(self, key: str) -> Member | None:
        return next((m for m in self.top if m.key == key), None)


def parse_body(raw: bytes) -> Body:
    """Read a governed request's body, or raise BodyError (answered as a 400)."""
    try:
        doc, fell_back = _json.loads_strict(raw)
    except RecursionError:
        raise BodyError(Reason.INVALID_JSON, "request body nests deeper than the gateway reads") from None
    except ValueError:  # JSONDecodeError and UnicodeDecodeError: not UTF-8 JSON
        raise BodyError(Reason.INVALID_JSON, "request body must be a JSON object in UTF-8") from None
    if not isinstance(doc, dict):
        raise BodyError(Reason.INVALID_JSON, "request body must be a JSON object")
    if fell_back:  # orjson refuses lone surrogates; the standard library lets them through
        _check_text(doc)
    top = members(raw, _past(_WS, raw, 0))
    seen: set[str] = set()
    for m in top:
        if m.key in seen:
            raise BodyError(Reason.DUPLICATE_KEY, f"the request gives {_short(m.key)} twice")
        seen.add(m.key)
    return Body(raw, doc, _past(_WS, raw, 0), tuple(top))


def _check_text(value: Any) -> None:
    """Lone surrogates anywhere (keys included) make a body no tokenizer can count."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            _check_string(item)
        elif isinstance(item, dict):
            for k, v in item.items():
                _check_string(k)
                stack.append(v)
        elif isinstance(item, list):
            stack.extend(item)


def _check_string(text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise BodyError(Reason.INVALID_UNICODE,
                        "request text holds a lone UTF-16 surrogate, which is not text") from None


def _short(key: str) -> str:
    return json.dumps(key[:40] + ("…" if len(key) > 40 else ""), ensure_ascii=False)


def splice(raw: bytes, replacements: Mapping[int, tuple[int, bytes]],
           insert: tuple[int, bytes] | None = None) -> bytes:
    """`raw` with the spans `start -> (end, new bytes)` replaced and `insert = (position, bytes)`
    placed; every other byte stays as it was."""
    pieces: list[bytes] = []
    last = 0
    edits = sorted(replacements.items())
    if insert is not None:
        edits.append((insert[0], (insert[0], insert[1])))
        edits.sort(key=lambda e: (e[0], e[1][0]))
    for start, (end, new) in edits:
        pieces.append(raw[last:start])
        pieces.append(new)
        last = end
    pieces.append(raw[last:])
    return b"".join(pieces)


def iter_strings(value: Any) -> Iterator[str]:
    """Every string in a JSON value (keys too), for estimates that count all of a prompt's text."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            yield item
        elif isinstance(item, dict):
            for k, v in item.items():
                yield k
                stack.append(v)
        elif isinstance(item, list):
            stack.extend(item)


__all__ = ["Body", "BodyError", "Member", "members", "parse_body", "splice", "iter_strings"]
