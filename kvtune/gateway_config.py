"""The admission gateway's configuration: what `kvtune recommend` renders as gateway.yaml and
what `kvtune gateway` and `kvtune check` read back.

Parsing is strict (unknown keys, a zero budget or a route without a cap are errors at load time),
so a typo fails when the file is read, not at the first request.
"""

from __future__ import annotations

import ipaddress
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from kvtune.capacity import reserved_blocks
from kvtune.errors import InputError
from kvtune.userfiles import CONFIG_MAX_BYTES, brief

SCHEMA_VERSION = 1
PROMPT_COUNT_METHODS = ("upstream-tokenize", "tokenizer", "estimate")


@dataclass(frozen=True, slots=True)
class RouteMatch:
    """A request belongs to a route when every given key matches; none given matches everything."""

    path: str | None = None
    model: str | None = None

    def matches(self, path: str | None, model: str | None) -> bool:
        """Exact path or a prefix ending in `*`, and model equality; a request without a known
        path never matches a route that names one."""
        if self.path is not None:
            if path is None:
                return False
            if self.path.endswith("*"):
                if not path.startswith(self.path[:-1]):
                    return False
            elif path != self.path:
                return False
        return self.model is None or self.model == model


@dataclass(frozen=True, slots=True)
class GatewayRoute:
    name: str
    match: RouteMatch
    max_new_tokens: int
    upstream: str | None = None


@dataclass(frozen=True, slots=True)
class PromptCounting:
    """How the gateway counts prompt tokens: exactly (upstream /tokenize or a local tokenizer) or by
    an estimate that must carry a safety margin."""

    method: str = "upstream-tokenize"
    tokenizer: str | None = None
    chars_per_token: float | None = None
    margin_tokens: int = 0


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    upstream: str
    block_size: int
    block_budget: int
    max_model_len: int
    routes: tuple[GatewayRoute, ...]
    host: str = "127.0.0.1"
    port: int = 8080
    model: str | None = None
    prompt_tokens: PromptCounting = field(default_factory=PromptCounting)
    retry_after_min_s: int = 1
    retry_after_max_s: int = 60
    queue_max_waiting: int = 0
    queue_timeout_s: float = 30.0
    upstream_connect_timeout_s: float = 10.0
    upstream_read_timeout_s: float = 600.0
    drain_timeout_s: float = 30.0

    def route_for(self, path: str, model: str | None) -> GatewayRoute | None:
        """The first route, in file order, whose match accepts the request."""
        return next((r for r in self.routes if r.match.matches(path, model)), None)

    def reservation_blocks(self, prompt_tokens: int, max_new_tokens: int, sequences: int = 1) -> int:
        return sequences * reserved_blocks(prompt_tokens, max_new_tokens, self.block_size)


#: The largest integer a field may hold: exact in a double, so the rendered nginx Lua and every
#: JSON reader see the same number.
MAX_INTEGER = 2**53
MAX_PORT = 65535
#: A day: a longer timeout (or Retry-After) is no timeout at all.
MAX_SECONDS = 86_400
#: No tokenizer averages more characters per token; a larger value would count prompts as nearly
#: free and admit more than the budget holds.
MAX_CHARS_PER_TOKEN = 32.0

_HOST_LABEL = re.compile(r"(?!-)[A-Za-z0-9_-]{1,63}(?<!-)")
_URL_PATH = re.compile(r"(/[A-Za-z0-9._~!$&'()*+,;=:@%-]*)*")


def host_problem(host: str) -> str | None:
    """Why `host` is not an IP address or a hostname to listen on or connect to, or None."""
    try:
        ipaddress.ip_address(host)
        return None
    except ValueError:
        pass
    labels = host[:-1].split(".") if host.endswith(".") else host.split(".")
    if len(host) > 253 or not all(_HOST_LABEL.fullmatch(label) for label in labels):
        return f"expected a hostname or IP address such as 127.0.0.1, 0.0.0.0 or ::1, got {brief(host)}"
    return None


def url_problem(url: str) -> str | None:
    """Why `url` is not http(s)://host[:port][/path prefix] (no user, query or fragment), or None."""
    shape = f"must look like http://host:port, got {brief(url)}"
    try:
        parts = urlsplit(url)
    except ValueError:  # e.g. an unclosed [ around an IPv6 address
        return shape
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return shape
    try:
        port = parts.port
    except ValueError:
        port = 0
    if port == 0:
        return f"the port must be a number from 1 to {MAX_PORT}, got {brief(url)}"
    if parts.username is not None or parts.password is not None:
        return f"a user or password in the URL is not supported, got {brief(url)}"
    if parts.query or parts.fragment or url.endswith(("?", "#")):
        return f"a query or fragment in the URL is not supported, got {brief(url)}"
    if not _URL_PATH.fullmatch(parts.path):
        return f"the path may hold only URL characters (no spaces or control characters), got {brief(url)}"
    return host_problem(parts.hostname)


class _Reader:
    """Walks a parsed YAML mapping, rejecting unknown keys and wrong types with the key path.

    Values are validated, never coerced: bools are not integers, numbers are finite and in range,
    and an error quotes a value in at most ~80 characters (kvtune.userfiles.brief)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def fail(self, where: str, message: str) -> InputError:
        return InputError(message, path=self.path, field=where)

    def mapping(self, value: Any, where: str, allowed: set[str], required: set[str] = frozenset()) -> dict:
        if not isinstance(value, dict):
            raise self.fail(where, f"expected a mapping, got {brief(value)}")
        unknown = sorted(set(map(str, value)) - allowed)
        if unknown:
            name = unknown[0] if unknown[0].isprintable() and len(unknown[0]) <= 40 else brief(unknown[0], 40)
            raise self.fail(f"{where}.{name}" if where else name,
                            f"unknown key (allowed: {', '.join(sorted(allowed))})")
        missing = sorted(required - set(value))
        if missing:
            raise self.fail(f"{where}.{missing[0]}" if where else missing[0], "missing")
        return value

    def integer(self, value: Any, where: str, minimum: int, maximum: int = MAX_INTEGER) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.fail(where, f"expected an integer, got {brief(value)}")
        if value < minimum:
            raise self.fail(where, f"must be at least {minimum}, got {brief(value)}")
        if value > maximum:
            raise self.fail(where, f"must be at most {maximum}, got {brief(value)}")
        return value

    def number(self, value: Any, where: str, minimum: float, maximum: float = MAX_SECONDS) -> float:
        """A finite int or float in range; the default maximum is for durations, the other numbers'."""
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self.fail(where, f"expected a number, got {brief(value)}")
        if isinstance(value, float) and not math.isfinite(value):
            raise self.fail(where, f"expected a finite number, got {brief(value)}")
        if value < minimum:
            raise self.fail(where, f"must be at least {minimum:g}, got {brief(value)}")
        if value > maximum:
            raise self.fail(where, f"must be at most {maximum:g}, got {brief(value)}")
        return float(value)

    def string(self, value: Any, where: str, optional: bool = False) -> str | None:
        if value is None and optional:
            return None
        if not isinstance(value, str) or not value:
            raise self.fail(where, f"expected a non-empty string, got {brief(value)}")
        return value

    def host(self, value: Any, where: str) -> str:
        host = self.string(value, where)
        problem = host_problem(host)
        if problem:
            raise self.fail(where, problem)
        return host

    def url(self, value: Any, where: str, optional: bool = False) -> str | None:
        url = self.string(value, where, optional)
        problem = None if url is None else url_problem(url)
        if problem:
            raise self.fail(where, problem)
        return url


def parse_gateway_config(data: Any, *, path: str = "gateway.yaml") -> GatewayConfig:
    """Validate a parsed gateway.yaml document into a GatewayConfig."""
    r = _Reader(path)
    top = r.mapping(
        data, "",
        {"version", "listen", "upstream", "model", "block_size", "block_budget", "max_model_len",
         "prompt_tokens", "retry_after", "queue", "timeouts", "routes"},
        {"version", "upstream", "block_size", "block_budget", "max_model_len", "routes"},
    )
    if r.integer(top["version"], "version", 1) != SCHEMA_VERSION:
        raise r.fail("version", f"unsupported version {top['version']} (this kvtune reads {SCHEMA_VERSION})")
    listen = r.mapping(top.get("listen", {}), "listen", {"host", "port"})
    retry = r.mapping(top.get("retry_after", {}), "retry_after", {"min_s", "max_s"})
    queue = r.mapping(top.get("queue", {}), "queue", {"max_waiting", "timeout_s"})
    timeouts = r.mapping(top.get("timeouts", {}), "timeouts", {"connect_s", "read_s", "drain_s"})
    counting = r.mapping(top.get("prompt_tokens", {}), "prompt_tokens",
                         {"method", "tokenizer", "chars_per_token", "margin_tokens"})

    method = counting.get("method", "upstream-tokenize")
    if method not in PROMPT_COUNT_METHODS:
        raise r.fail("prompt_tokens.method", f"{brief(method)} is not one of {', '.join(PROMPT_COUNT_METHODS)}")
    prompt_counting = PromptCounting(
        method=method,
        tokenizer=r.string(counting.get("tokenizer"), "prompt_tokens.tokenizer", optional=True),
        chars_per_token=(r.number(counting["chars_per_token"], "prompt_tokens.chars_per_token", 0.1,
                                  MAX_CHARS_PER_TOKEN)
                         if counting.get("chars_per_token") is not None else None),
        margin_tokens=r.integer(counting.get("margin_tokens", 0), "prompt_tokens.margin_tokens", 0),
    )
    if method == "tokenizer" and prompt_counting.tokenizer is None:
        raise r.fail("prompt_tokens.tokenizer", "method 'tokenizer' needs a tokenizer path or hub id")
    if method == "estimate" and (prompt_counting.chars_per_token is None or prompt_counting.margin_tokens == 0):
        raise r.fail("prompt_tokens", "an estimate needs chars_per_token and a margin_tokens above 0")

    raw_routes = top["routes"]
    if not isinstance(raw_routes, list) or not raw_routes:
        raise r.fail("routes", "expected a non-empty list of routes")
    routes = []
    for i, raw in enumerate(raw_routes):
        where = f"routes[{i}]"
        item = r.mapping(raw, where, {"name", "match", "max_new_tokens", "upstream"}, {"name", "max_new_tokens"})
        match = r.mapping(item.get("match", {}), f"{where}.match", {"path", "model"})
        routes.append(GatewayRoute(
            name=r.string(item["name"], f"{where}.name"),
            match=RouteMatch(
                path=r.string(match.get("path"), f"{where}.match.path", optional=True),
                model=r.string(match.get("model"), f"{where}.match.model", optional=True),
            ),
            max_new_tokens=r.integer(item["max_new_tokens"], f"{where}.max_new_tokens", 1),
            upstream=r.url(item.get("upstream"), f"{where}.upstream", optional=True),
        ))

    config = GatewayConfig(
        upstream=r.url(top["upstream"], "upstream"),
        block_size=r.integer(top["block_size"], "block_size", 1),
        block_budget=r.integer(top["block_budget"], "block_budget", 1),
        max_model_len=r.integer(top["max_model_len"], "max_model_len", 1),
        routes=tuple(routes),
        host=r.host(listen.get("host", "127.0.0.1"), "listen.host"),
        port=r.integer(listen.get("port", 8080), "listen.port", 0, MAX_PORT),
        model=r.string(top.get("model"), "model", optional=True),
        prompt_tokens=prompt_counting,
        retry_after_min_s=r.integer(retry.get("min_s", 1), "retry_after.min_s", 1, MAX_SECONDS),
        retry_after_max_s=r.integer(retry.get("max_s", 60), "retry_after.max_s", 1, MAX_SECONDS),
        queue_max_waiting=r.integer(queue.get("max_waiting", 0), "queue.max_waiting", 0),
        queue_timeout_s=r.number(queue.get("timeout_s", 30), "queue.timeout_s", 0),
        upstream_connect_timeout_s=r.number(timeouts.get("connect_s", 10), "timeouts.connect_s", 0.001),
        upstream_read_timeout_s=r.number(timeouts.get("read_s", 600), "timeouts.read_s", 0.001),
        drain_timeout_s=r.number(timeouts.get("drain_s", 30), "timeouts.drain_s", 0),
    )
    if config.retry_after_max_s < config.retry_after_min_s:
        raise r.fail("retry_after.max_s", "must be at least retry_after.min_s")
    for i, route in enumerate(config.routes):
        if route.max_new_tokens >= config.max_model_len:
            raise r.fail(f"routes[{i}].max_new_tokens",
                         f"cap {route.max_new_tokens} leaves no room for a prompt in max_model_len "
                         f"{config.max_model_len}")
    return config


def load_gateway_config(path: str | Path) -> GatewayConfig:
    """Read and validate a gateway.yaml file: a regular file of at most CONFIG_MAX_BYTES, YAML
    without anchors, aliases or duplicate keys (kvtune.userfiles)."""
    from kvtune.userfiles import load_yaml

    return parse_gateway_config(load_yaml(path, max_bytes=CONFIG_MAX_BYTES), path=str(path))
