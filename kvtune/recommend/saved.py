"""Reading back a recommendation.json (`kvtune recommend --out`) for `kvtune check` and `bench --expect`.

The file is validated where it is read: every field `check` uses (or, for `bench --expect`, the
few a verdict uses) must be there with the type and range kvtune writes, so a damaged file is one
`InputError` naming the field instead of a KeyError or ZeroDivisionError deep in a check. Fields
nobody reads back (notes, kv, per-route statistics) are left alone, so newer files still load.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from typing import Any

from kvtune.errors import InputError
from kvtune.userfiles import brief

__all__ = ["looks_like_recommendation", "load_recommendation", "parse_recommendation", "SCHEMA_VERSION"]

SCHEMA_VERSION = 1
#: Integers stay exact in a double (and in the rendered Lua and JSON readers).
MAX_INTEGER = 2**53
_MARKER = b'"kvtune_version"'  # the second key kvtune writes; JSON logs do not carry it
_NUMBER = (int, float)

# settings.<name>.value: (type, minimum, maximum); None means any value of that type
_SETTINGS: dict[str, tuple[type | tuple[type, ...], float | None, float | None]] = {
    "tensor_parallel_size": (int, 1, MAX_INTEGER),
    "pipeline_parallel_size": (int, 1, MAX_INTEGER),
    "max_model_len": (int, 1, MAX_INTEGER),
    "max_num_seqs": (int, 1, MAX_INTEGER),
    "max_num_batched_tokens": (int, 1, MAX_INTEGER),
    "gpu_memory_utilization": (_NUMBER, 0, 1),
    "kv_cache_dtype": (str, None, None),
    "block_size": (int, 1, MAX_INTEGER),
    "preemption_mode": (str, None, None),
    "swap_space": (_NUMBER, 0, MAX_INTEGER),
    "max_new_tokens_backstop": (int, 1, MAX_INTEGER),
}


def looks_like_recommendation(path: str | os.PathLike[str]) -> bool:
    """A regular file whose first 4 KiB carry kvtune's version key (cheap; the rest is not read)."""
    from kvtune.userfiles import read_head

    head = read_head(path, 4096)
    return head is not None and _MARKER in head


def load_recommendation(path: str | os.PathLike[str], *, complete: bool = True,
                        field: str | None = None) -> dict[str, Any]:
    """Read and validate a recommendation.json (a regular file, strict JSON, RECOMMENDATION_MAX_BYTES)."""
    from kvtune import userfiles

    data = userfiles.load_json(path, max_bytes=userfiles.RECOMMENDATION_MAX_BYTES, field=field)
    return parse_recommendation(data, path=os.fspath(path), complete=complete, field=field)


def parse_recommendation(data: Any, *, path: str, complete: bool = True, field: str | None = None) -> dict[str, Any]:
    """`data` itself once every field `check` reads (`complete`), or the ones `bench --expect` reads,
    has its type and range; else an InputError naming the field."""
    if not isinstance(data, dict) or not isinstance(data.get("block_budget"), Mapping) \
            or "value" not in data["block_budget"]:
        raise InputError("not a recommendation.json (no block_budget.value); write one with "
                         "`kvtune recommend --out DIR`", path=path, field=field)
    r = _Reader(path, complete)
    if "schema_version" in data or complete:
        version = r.integer(data, "schema_version", "schema_version", 1)
        if version != SCHEMA_VERSION:
            raise r.fail("schema_version", f"unsupported version {version} (this kvtune reads {SCHEMA_VERSION})")
    r.integer(data["block_budget"], "value", "block_budget.value", 1, required=True)
    r.string(data, "model", "model")
    r.string(data, "served_model", "served_model", nullable=True)
    if (safety := r.mapping(data, "safety_fraction", "safety_fraction", required=False)) is not None:
        r.number(safety, "value", "safety_fraction.value", 0, 1)
    if (engine := r.mapping(data, "engine", "engine")) is not None:
        r.boolean(engine, "v1", "engine.v1")
        r.string(engine, "version", "engine.version", nullable=True, required=False)
    if (hardware := r.mapping(data, "hardware", "hardware")) is not None:
        r.integer(hardware, "gpu_memory_bytes", "hardware.gpu_memory_bytes", 0, nullable=True, required=False)
    if (capacity := r.mapping(data, "capacity", "capacity")) is not None:
        r.integer(capacity, "num_blocks", "capacity.num_blocks", 1)
        r.integer(capacity, "block_size", "capacity.block_size", 1)
    if (concurrency := r.mapping(data, "concurrency", "concurrency")) is not None:
        r.integer(concurrency, "context_tokens", "concurrency.context_tokens", 1, nullable=True, required=False)
        r.integer(concurrency, "admitted", "concurrency.admitted", 0, nullable=True, required=False)
    if (settings := r.mapping(data, "settings", "settings")) is not None:
        for name, (kind, low, high) in _SETTINGS.items():
            needed = name == "max_model_len"  # check falls back on it for the context length
            r.decision(settings, name, f"settings.{name}", kind, low, high, required=complete and needed,
                       nullable=not needed)
    routes = data.get("routes")
    if routes is not None or complete:
        if not isinstance(routes, list) or (complete and not routes):
            raise r.fail("routes", f"expected a non-empty list of routes, got {brief(routes)}")
        for i, route in enumerate(routes):
            _route(r, route, f"routes[{i}]")
    return data


def _route(r: _Reader, route: Any, where: str) -> None:
    if not isinstance(route, dict):
        raise r.fail(where, f"expected an object, got {brief(route)}")
    r.string(route, "route", f"{where}.route", required=True)
    if (match := r.mapping(route, "match", f"{where}.match", nullable=True, required=False)) is not None:
        r.string(match, "path", f"{where}.match.path", nullable=True, required=False)
        r.string(match, "model", f"{where}.match.model", nullable=True, required=False)
    r.decision(route, "max_new_tokens", f"{where}.max_new_tokens", int, 1, MAX_INTEGER, required=r.complete,
               nullable=False)
    r.number(route, "truncation_share", f"{where}.truncation_share", 0, 1, nullable=True, required=False)
    if (prompt := r.mapping(route, "prompt_tokens", f"{where}.prompt_tokens")) is not None:
        r.integer(prompt, "max", f"{where}.prompt_tokens.max", 0)
    hist = r.mapping(route, "output_histogram", f"{where}.output_histogram", nullable=True, required=False)
    if hist is not None:
        edges = r.integers(hist, "edges", f"{where}.output_histogram.edges")
        counts = r.integers(hist, "counts", f"{where}.output_histogram.counts")
        if len(edges) != len(counts) + 1 or any(b <= a for a, b in zip(edges, edges[1:])):
            raise r.fail(f"{where}.output_histogram", "expected increasing edges, one more than counts")


class _Reader:
    """Typed access to one parsed object; `complete` makes the fields `check` needs required."""

    def __init__(self, path: str, complete: bool) -> None:
        self.path, self.complete = path, complete

    def fail(self, where: str, message: str) -> InputError:
        return InputError(message, path=self.path, field=where)

    def _get(self, obj: Mapping, key: str, where: str, required: bool | None, nullable: bool) -> Any:
        """The value, or None when it may be absent (required=None: required when complete) or null."""
        if key not in obj:
            if self.complete if required is None else required:
                raise self.fail(where, "missing")
            return None
        if obj[key] is None and not nullable:
            raise self.fail(where, "expected a value, got None")
        return obj[key]

    def mapping(self, obj: Mapping, key: str, where: str, *, nullable: bool = False,
                required: bool | None = None) -> dict | None:
        value = self._get(obj, key, where, required, nullable)
        if value is not None and not isinstance(value, dict):
            raise self.fail(where, f"expected an object, got {brief(value)}")
        return value

    def integer(self, obj: Mapping, key: str, where: str, minimum: int, *, nullable: bool = False,
                required: bool | None = None) -> int | None:
        value = self._get(obj, key, where, required, nullable)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.fail(where, f"expected an integer, got {brief(value)}")
        if not minimum <= value <= MAX_INTEGER:
            raise self.fail(where, f"must be in {minimum}..{MAX_INTEGER}, got {brief(value)}")
        return value

    def number(self, obj: Mapping, key: str, where: str, minimum: float, maximum: float, *,
               nullable: bool = False, required: bool | None = None) -> float | None:
        value = self._get(obj, key, where, required, nullable)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, _NUMBER) or \
                (isinstance(value, float) and not math.isfinite(value)):
            raise self.fail(where, f"expected a finite number, got {brief(value)}")
        if not minimum <= value <= maximum:
            raise self.fail(where, f"must be in {minimum:g}..{maximum:g}, got {brief(value)}")
        return value

    def string(self, obj: Mapping, key: str, where: str, *, nullable: bool = False,
               required: bool | None = None) -> str | None:
        value = self._get(obj, key, where, required, nullable)
        if value is not None and not isinstance(value, str):
            raise self.fail(where, f"expected a string, got {brief(value)}")
        return value

    def boolean(self, obj: Mapping, key: str, where: str) -> bool | None:
        value = self._get(obj, key, where, False, False)
        if value is not None and not isinstance(value, bool):
            raise self.fail(where, f"expected true or false, got {brief(value)}")
        return value

    def integers(self, obj: Mapping, key: str, where: str) -> list[int]:
        value = self._get(obj, key, where, True, False)
        if not isinstance(value, list) or not all(
                isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= MAX_INTEGER for v in value):
            raise self.fail(where, f"expected a list of integers in 0..{MAX_INTEGER}")
        return value

    def decision(self, obj: Mapping, key: str, where: str, kind: Any, low: float | None, high: float | None, *,
                 required: bool, nullable: bool = True) -> None:
        """A rule's decision: {value, rule, reason} (null for a setting that does not apply)."""
        decision = self.mapping(obj, key, where, nullable=nullable, required=required)
        if decision is None:
            return
        self.string(decision, "rule", f"{where}.rule", required=False)
        self.string(decision, "reason", f"{where}.reason", required=False)
        where = f"{where}.value"
        if kind is int:
            self.integer(decision, "value", where, int(low), nullable=nullable, required=True)
        elif kind is str:
            self.string(decision, "value", where, nullable=nullable, required=True)
        else:
            self.number(decision, "value", where, low, high, nullable=nullable, required=True)
