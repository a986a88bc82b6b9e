"""JSON for the request path: orjson when it can, the standard library when it cannot.

orjson is ~5x faster on request bodies but narrower: it refuses NaN/Infinity and integers beyond
64 bits, which `json` accepts. Falling back keeps the gateway's reading of a body exactly the
standard library's, so switching parsers changes no answer, only the time it takes.
"""

from __future__ import annotations

import importlib
import json
from types import ModuleType
from typing import Any

orjson: ModuleType | None
try:
    orjson = importlib.import_module("orjson")
except ImportError:  # an optional speed-up; the behaviour is the same without it
    orjson = None


def loads(data: bytes | str) -> Any:
    """json.loads, faster; raises ValueError (or UnicodeDecodeError) as json.loads does."""
    if orjson is not None:
        try:
            return orjson.loads(data)
        except orjson.JSONDecodeError:
            pass  # NaN, huge integers, lone surrogates: let the standard library decide
    return json.loads(data)


def dumps_bytes(value: Any) -> bytes:
    """Compact UTF-8 JSON, the bytes of json.dumps(value, ensure_ascii=False, separators=(",", ":"))."""
    if orjson is not None:
        try:
            return orjson.dumps(value)
        except (orjson.JSONEncodeError, TypeError):
            pass
    return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode()


def dumps_text(value: Any) -> str:
    """The same JSON as text (what a characters-per-token estimate measures)."""
    if orjson is not None:
        try:
            return orjson.dumps(value).decode()
        except (orjson.JSONEncodeError, TypeError):
            pass
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def loads_strict(data: bytes) -> tuple[Any, bool]:
    """(value, fell_back) for a request body: standard JSON (RFC 8259: no NaN or Infinity) in
    UTF-8 (no BOM). fell_back is True when the standard library read what orjson refused
    (integers past 64 bits, lone surrogates), so the caller can check what orjson would have.
    Raises ValueError for anything else, RecursionError for nesting past the library's depth."""
    if orjson is not None:
        try:
            return orjson.loads(data), False
        except orjson.JSONDecodeError:
            pass
    return json.loads(data.decode("utf-8"), parse_constant=_not_json), True


def _not_json(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")
