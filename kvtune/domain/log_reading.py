"""How logs are read into a profile: the format, the field mapping, what names a route and what
to do with a bad row, as one value kvtune.api's profile_logs takes whole (the CLI's log options)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

__all__ = ["LogReading", "LogReplay", "DEFAULT_MAX_ROUTES"]

#: Routes a profile keeps by default; the rest (the least busy) fold into `*`. A deployment
#: serves a few dozen routes; thousands mean the route key holds ids (/v1/users/123/...), and
#: a gateway config or nginx.conf with a location per id would be neither readable nor useful.
#: Named once, here on the floor: kvtune.profile, kvtune.api and the CLI (without numpy) read it.
DEFAULT_MAX_ROUTES = 2000


@dataclass(frozen=True, slots=True)
class LogReading:
    """`format` forces a log format (None: detected); `fields` maps a target from a source field
    (output_tokens → usage.completion_tokens); `route_by` names a route by "path" (None: the
    path), "model" or a source field; `tokenizer` counts logs that carry only text; `on_error`
    "skip" counts a bad row, "fail" stops at it (`strict`: any skip is an error); `assume_cap`
    treats outputs ≥ N as cut at a cap; `max_routes` folds the rest into `*` (None: never);
    files matching an `exclude` glob are not read; `since`/`until` (ISO date or datetime) keep
    the rows logged in that window; `log_model` only the rows naming that logged model."""

    format: str | None = None
    fields: Mapping[str, str] = field(default_factory=dict)
    route_by: str | None = None
    tokenizer: str | None = None
    on_error: str = "skip"
    strict: bool = False
    assume_cap: int | None = None
    max_routes: int | None = DEFAULT_MAX_ROUTES
    exclude: tuple[str, ...] = ()
    since: str | None = None
    until: str | None = None
    log_model: str | None = None


@dataclass(frozen=True, slots=True)
class LogReplay:
    """Logs whose requests a run sends at their own timestamps (`kvtune simulate --replay`),
    read as `reading` says, of `routes` (empty: all)."""

    logs: tuple[str, ...]
    reading: LogReading = LogReading()
    routes: tuple[str, ...] = ()
