"""The admission gateway's configuration: what `kvtune recommend` renders as gateway.yaml and
what `kvtune gateway` and `kvtune check` read back.

Parsing is strict (unknown keys, a zero budget or a route without a cap are errors at load time),
so a typo fails when the file is read, not at the first request.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, overload
from urllib.parse import urlsplit

from kvtune.domain.admission_policy import GUARANTEED, AdmissionPolicy, parse_admission
from kvtune.domain.fields import MAX_INTEGER, is_finite_number, is_integer, is_number, not_one_of
from kvtune.domain.flow_control import DEFAULT_BAND_HEADER, DEFAULT_FLOW_HEADER, MAX_BANDS, Band, FlowControl
from kvtune.domain.output_law import parse_output_law
from kvtune.domain.route import Api, Route, RouteMatch
from kvtune.endpoint import MAX_PORT, host_problem, parse_url, url_problem
from kvtune.errors import InputError
from kvtune.gateway.endpoints import (
    DEFAULT_PASSTHROUGH,
    GENERATE,
    ROUTE_APIS,
    PathClass,
    canonical_path,
    classify,
    never_passthrough,
)
from kvtune.userfiles import CONFIG_MAX_BYTES, brief, load_yaml

SCHEMA_VERSION = 1


class CountingMethod(enum.Enum):
    """How the gateway counts a prompt's tokens (gateway.yaml `prompt_tokens.method`)."""

    UPSTREAM_TOKENIZE = "upstream-tokenize"  # the engine's own /tokenize, exact
    TOKENIZER = "tokenizer"  # the model's tokenizer and chat template in process, exact
    ESTIMATE = "estimate"  # characters / chars_per_token + a margin


#: The methods as gateway.yaml spells them.
PROMPT_COUNT_METHODS = tuple(m.value for m in CountingMethod)


#: The longest route header value gateway.yaml may name: a group name, not a payload.
MAX_ROUTE_HEADER_VALUE = 256
#: What a header name may hold (RFC 9110 token characters).
HEADER_NAME = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
#: What a route header value may hold: printable ASCII, no comma (a header sent twice may arrive
#: joined by one), no space at either end (both enforcers strip them); at most MAX_ROUTE_HEADER_VALUE.
ROUTE_HEADER_VALUE = re.compile(rf"[!-+\--~](?:[ !-+\--~]{{0,{MAX_ROUTE_HEADER_VALUE - 2}}}[!-+\--~])?")


DEFAULT_PAIR_TOKENS = 128


@dataclass(frozen=True, slots=True)
class PromptCounting:
    """How the gateway counts prompt tokens: exactly (upstream /tokenize or a local tokenizer) or by
    an estimate that must carry a safety margin."""

    method: CountingMethod = CountingMethod.UPSTREAM_TOKENIZE
    tokenizer: str | None = None
    chars_per_token: float | None = None
    margin_tokens: int = 0
    # Tokens a pooling model's pair template adds around a (query, document) pair beyond each
    # text's own special tokens: 0 for BERT-style cross-encoders, tens for LLM rerankers whose
    # score template wraps the pair in an instruction.
    pair_tokens: int = DEFAULT_PAIR_TOKENS


def default_max_body_bytes(max_model_len: int) -> int:
    """A request body of a whole context, JSON-escaped, with room: 32 bytes per token of context
    (a token is a few characters, each up to 6 bytes as a JSON escape), at least 1 MiB."""
    return max(1024 * 1024, 32 * max_model_len)


@dataclass(frozen=True, slots=True)
class ClientLimits:
    """What one client connection may hold: the defaults are no longer than nginx's own
    (client_header_timeout and client_body_timeout 60 s, keepalive_timeout 75 s, send_timeout
    60 s, large_client_header_buffers 4 x 8k)."""

    header_timeout_s: float = 60.0  # from a request head's first byte to its end
    body_timeout_s: float = 60.0  # between two reads of a request body
    # the whole body, from the end of the head: a byte every body_timeout_s - 1 s held a connection
    # for as long as the body was long (nginx has no such limit: client_body_timeout is between
    # reads); gateway.yaml's default is twice body_timeout_s
    body_deadline_s: float = 120.0
    keepalive_timeout_s: float = 75.0  # an idle connection between requests
    send_timeout_s: float = 60.0  # between two writes the client accepts
    max_header_bytes: int = 32 * 1024  # a request head in all
    max_header_line_bytes: int = 8 * 1024  # one request line or header field
    max_body_bytes: int = 16 * 1024 * 1024  # a request body, after any Content-Encoding
    max_connections: int = 4096  # open client connections


class Access(enum.Enum):
    """Who may read an admin endpoint (gateway.yaml `admin.metrics`, `admin.ledger`)."""

    LOOPBACK = "loopback"  # clients on this machine only
    TOKEN = "token"  # clients with `Authorization: Bearer $token_env`
    PUBLIC = "public"  # anyone (metrics only: the ledger names routes)


#: The access settings as gateway.yaml spells them.
ADMIN_ACCESS = tuple(a.value for a in Access)


class RefusalDetail(enum.Enum):
    """What a refusal tells the client about the ledger (gateway.yaml `admin.refusal_detail`)."""

    PUBLIC = "public"  # the reason and Retry-After only; no X-Kvtune-Reserved-Blocks
    LEDGER = "ledger"  # blocks needed, reserved and the budget, to clients admin.ledger lets in


REFUSAL_DETAILS = tuple(d.value for d in RefusalDetail)


@dataclass(frozen=True, slots=True)
class AdminAccess:
    """Who may read the gateway's own /metrics and /kvtune/ledger (route names, budget, counts):
    loopback clients only, clients with `Authorization: Bearer $token_env`, or anyone (metrics)."""

    metrics: Access = Access.LOOPBACK
    ledger: Access = Access.LOOPBACK
    token_env: str | None = None
    refusal_detail: RefusalDetail = RefusalDetail.PUBLIC


@dataclass(frozen=True, slots=True)
class GatewayUpstream:
    """One engine replica the gateway sends to, with its own KV block budget (gateway.yaml
    `upstreams[i]`, or the single `upstream` and `block_budget`). `weight` scales its free budget
    when requests are routed (1: the budget alone decides)."""

    url: str
    block_budget: int
    weight: float = 1.0
    # the engine's name in the shared ledger, the same in every replica (kvtune.gateway.engines);
    # None: its canonical URL
    engine_id: str | None = None


@dataclass(frozen=True, slots=True)
class HealthProbe:
    """How an upstream is taken out and brought back (gateway.yaml `health`, with several upstreams
    only): a failed connect takes it out at once; every interval_s it is asked GET `path`, and
    an answer other than 200 (or none within timeout_s) takes it out, a 200 brings it back.

    Passive health (Envoy's outlier detection, consecutive_5xx): an upstream whose last
    consecutive_failures requests each ended in a 5xx or a failed connection is ejected for
    ejection_s, doubled at each ejection in a row up to max_ejection_s, whatever its /health says
    (a replica that passes /health and answers 500 to every generation frees its blocks at once
    and would win "most free"). No more than max_ejected_share of the upstreams (at least one) are
    ejected at once, and never the last one routed to. consecutive_failures 0: off."""

    interval_s: float = 1.0
    timeout_s: float = 1.0
    path: str = "/health"
    consecutive_failures: int = 5
    ejection_s: float = 2.0
    max_ejection_s: float = 60.0
    max_ejected_share: float = 0.5

    def ejection_for_s(self, times_in_a_row: int) -> float:
        """How long the `times_in_a_row`-th ejection in a row lasts (1: ejection_s)."""
        return min(self.max_ejection_s, self.ejection_s * 2.0 ** min(max(0, times_in_a_row - 1), 32))

    def may_eject(self, upstreams: int, ejected: int) -> bool:
        """Whether one more of `upstreams` may be ejected while `ejected` are."""
        allowed = max(1, int(self.max_ejected_share * upstreams + 1e-9))
        return ejected + 1 <= allowed and ejected + 1 < upstreams


class StickyBy(enum.Enum):
    """What keeps a client's requests on one upstream (gateway.yaml `sticky.by`): its prefix cache."""

    USER = "user"  # the body's `user` field (OpenAI's end-user id)
    HEADER = "header"  # a request header, `sticky.header`


@dataclass(frozen=True, slots=True)
class Sticky:
    """Requests with the same key go to the same upstream while it is healthy and they fit there
    (rendezvous hashing over the healthy upstreams); otherwise, and without a key, by free budget."""

    by: StickyBy
    header: str | None = None


class LedgerBackend(enum.Enum):
    """Where the reservations are kept (gateway.yaml `ledger.backend`)."""

    MEMORY = "memory"  # this process only: one gateway replica
    REDIS = "redis"  # one Redis shared by every gateway replica (kvtune.gateway.redis_ledger)


class OnLedgerError(enum.Enum):
    """What a redis-backed gateway does while Redis does not answer (gateway.yaml `ledger.on_error`)."""

    REJECT = "reject"  # 503 + Retry-After: nothing is admitted that cannot be recorded
    LOCAL = "local"  # admit against a static 1/replicas_hint slice of each upstream's budget


#: How long a lapsed replica's reservations stay counted by default: longer than most requests run.
DEFAULT_RECLAIM_GRACE_S = 60.0


@dataclass(frozen=True, slots=True)
class LedgerStore:
    """gateway.yaml `ledger`: in memory (the default), or one Redis every gateway replica shares,
    with each replica's reservations under a lease of lease_s it renews; `on_error` says what is
    done while Redis does not answer, `replicas_hint` how many gateway replicas share it."""

    backend: LedgerBackend = LedgerBackend.MEMORY
    url: str | None = field(default=None, repr=False)  # may hold a password: never printed
    key_prefix: str = "kvtune"
    lease_s: float = 10.0
    on_error: OnLedgerError = OnLedgerError.REJECT
    replicas_hint: int = 1
    # How long one call to Redis may take (its retries included) before it counts as unavailable:
    # on a loaded host 0.5 s can pass without Redis being down (then on_error decides).
    op_timeout_s: float = 0.5
    # How long a replica's reservations outlive its lapsed lease (it is fenced meanwhile): a replica
    # paused or cut off still runs its requests on the engines, so their blocks stay counted until
    # it comes back or this passes (kvtune.gateway.redis_ledger)
    reclaim_grace_s: float = DEFAULT_RECLAIM_GRACE_S

    @property
    def shared(self) -> bool:
        return self.backend is LedgerBackend.REDIS


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    upstreams: tuple[GatewayUpstream, ...]
    block_size: int
    max_model_len: int
    routes: tuple[Route, ...]
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
    passthrough: tuple[str, ...] = DEFAULT_PASSTHROUGH
    limits: ClientLimits = field(default_factory=ClientLimits)
    admin: AdminAccess = field(default_factory=AdminAccess)
    admission: AdmissionPolicy = GUARANTEED
    health: HealthProbe = field(default_factory=HealthProbe)
    sticky: Sticky | None = None  # off by default
    ledger: LedgerStore = field(default_factory=LedgerStore)
    flow: FlowControl | None = None  # the flow-control queue (docs/guides/flow-control.md); None: `queue:`

    @property
    def upstream(self) -> str:
        """The first upstream's URL: the only one of a single-upstream file."""
        return self.upstreams[0].url

    @property
    def block_budget(self) -> int:
        """Every upstream's budget together (a single upstream's own)."""
        return sum(u.block_budget for u in self.upstreams)

    @property
    def admit_limit_blocks(self) -> int:
        """What worst-case reservations are held against (floor(factor x budget) for overcommit),
        on the upstream with the largest budget: no request larger than this is ever admitted."""
        return self.admission.limit_blocks(max(u.block_budget for u in self.upstreams))

    def route_for(self, path: str, model: str | None, headers: Mapping[str, str] | None = None) -> Route | None:
        """The first route, in file order, whose match accepts the request."""
        return next((r for r in self.routes if r.match.matches(path, model, headers)), None)

    def path_route(self, path: str, headers: Mapping[str, str] | None = None) -> Route | None:
        """For a literal route path that is no vLLM endpoint: the first route naming it whose
        header (if any) the request carries; None sends it to route_for."""
        return next((r for r in self.routes if r.match.path == path and r.match.header_matches(headers)), None)

    @property
    def route_headers(self) -> tuple[str, ...]:
        """The request headers routes match on (lower-case names, each once, in file order)."""
        return tuple(dict.fromkeys(r.match.header for r in self.routes if r.match.header is not None))

    def route_paths(self) -> dict[str, Route]:
        """Literal route paths that are not vLLM endpoints: each makes its path governed."""
        out: dict[str, Route] = {}
        for r in self.routes:
            if r.match.path is not None and r.match.path not in GENERATE:
                out.setdefault(r.match.path, r)
        return out



#: The largest upstream weight: beyond it one upstream takes everything whatever its budget.
MAX_WEIGHT = 1000.0
#: A day: a longer timeout (or Retry-After) is no timeout at all.
MAX_SECONDS = 86_400
#: No tokenizer averages more characters per token; a larger value would count prompts as nearly
#: free and admit more than the budget holds.
MAX_CHARS_PER_TOKEN = 32.0


class _Reader:
    """Walks a parsed YAML mapping, rejecting unknown keys and wrong types with the key path.

    Values are validated, never coerced: bools are not integers, numbers are finite and in range,
    and an error quotes a value in at most ~80 characters (kvtune.userfiles.brief)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def fail(self, where: str, message: str) -> InputError:
        return InputError(message, path=self.path, field=where)

    def mapping(self, value: Any, where: str, allowed: set[str],
                required: frozenset[str] | set[str] = frozenset()) -> dict:
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
        if not is_integer(value):
            raise self.fail(where, f"expected an integer, got {brief(value)}")
        if value < minimum:
            raise self.fail(where, f"must be at least {minimum}, got {brief(value)}")
        if value > maximum:
            raise self.fail(where, f"must be at most {maximum}, got {brief(value)}")
        return value

    def number(self, value: Any, where: str, minimum: float, maximum: float = MAX_SECONDS) -> float:
        """A finite int or float in range; the default maximum is for durations, the other numbers'."""
        if not is_number(value):
            raise self.fail(where, f"expected a number, got {brief(value)}")
        if not is_finite_number(value):
            raise self.fail(where, f"expected a finite number, got {brief(value)}")
        if value < minimum:
            raise self.fail(where, f"must be at least {minimum:g}, got {brief(value)}")
        if value > maximum:
            raise self.fail(where, f"must be at most {maximum:g}, got {brief(value)}")
        return float(value)

    @overload
    def string(self, value: Any, where: str, optional: Literal[False] = False) -> str: ...
    @overload
    def string(self, value: Any, where: str, optional: bool) -> str | None: ...

    def string(self, value: Any, where: str, optional: bool = False) -> str | None:
        if value is None and optional:
            return None
        if not isinstance(value, str) or not value:
            raise self.fail(where, f"expected a non-empty string, got {brief(value)}")
        return value

    def choice(self, value: Any, where: str, choices: Iterable[str]) -> str:
        """One of `choices` (a closed set of words: an enum's values, say)."""
        problem = not_one_of(value, choices)
        if problem:
            raise self.fail(where, problem)
        return value

    def host(self, value: Any, where: str) -> str:
        host = self.string(value, where)
        problem = host_problem(host)
        if problem:
            raise self.fail(where, problem)
        return host

    @overload
    def url(self, value: Any, where: str, optional: Literal[False] = False) -> str: ...
    @overload
    def url(self, value: Any, where: str, optional: bool) -> str | None: ...

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
        {"version", "listen", "upstream", "engine_id", "upstreams", "model", "block_size", "block_budget",
         "max_model_len", "prompt_tokens", "retry_after", "queue", "timeouts", "routes", "passthrough", "limits",
         "admin", "admission", "health", "sticky", "ledger", "flow"},
        {"version", "block_size", "max_model_len", "routes"},
    )
    if r.integer(top["version"], "version", 1) != SCHEMA_VERSION:
        raise r.fail("version", f"unsupported version {top['version']} (this kvtune reads {SCHEMA_VERSION})")
    listen = r.mapping(top.get("listen", {}), "listen", {"host", "port"})
    retry = r.mapping(top.get("retry_after", {}), "retry_after", {"min_s", "max_s"})
    queue = r.mapping(top.get("queue", {}), "queue", {"max_waiting", "timeout_s"})
    timeouts = r.mapping(top.get("timeouts", {}), "timeouts", {"connect_s", "read_s", "drain_s"})
    counting = r.mapping(top.get("prompt_tokens", {}), "prompt_tokens",
                         {"method", "tokenizer", "chars_per_token", "margin_tokens", "pair_tokens"})

    given = counting.get("method", CountingMethod.UPSTREAM_TOKENIZE.value)
    method = CountingMethod(r.choice(given, "prompt_tokens.method", PROMPT_COUNT_METHODS))
    prompt_counting = PromptCounting(
        method=method,
        tokenizer=r.string(counting.get("tokenizer"), "prompt_tokens.tokenizer", optional=True),
        chars_per_token=(r.number(counting["chars_per_token"], "prompt_tokens.chars_per_token", 0.1,
                                  MAX_CHARS_PER_TOKEN)
                         if counting.get("chars_per_token") is not None else None),
        margin_tokens=r.integer(counting.get("margin_tokens", 0), "prompt_tokens.margin_tokens", 0),
        pair_tokens=r.integer(counting.get("pair_tokens", DEFAULT_PAIR_TOKENS), "prompt_tokens.pair_tokens", 0),
    )
    if method is CountingMethod.TOKENIZER and prompt_counting.tokenizer is None:
        raise r.fail("prompt_tokens.tokenizer", "method 'tokenizer' needs a tokenizer path or hub id")
    if method is CountingMethod.ESTIMATE and (prompt_counting.chars_per_token is None
                                              or prompt_counting.margin_tokens == 0):
        raise r.fail("prompt_tokens", "an estimate needs chars_per_token and a margin_tokens above 0")

    raw_routes = top["routes"]
    if not isinstance(raw_routes, list) or not raw_routes:
        raise r.fail("routes", "expected a non-empty list of routes")
    routes = tuple(_route(r, raw, f"routes[{i}]") for i, raw in enumerate(raw_routes))
    max_model_len = r.integer(top["max_model_len"], "max_model_len", 1)

    config = GatewayConfig(
        upstreams=_upstreams(r, top),
        block_size=r.integer(top["block_size"], "block_size", 1),
        max_model_len=max_model_len,
        routes=routes,
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
        passthrough=_passthrough(r, top.get("passthrough", list(DEFAULT_PASSTHROUGH))),
        limits=_limits(r, top.get("limits", {}), max_model_len),
        admin=_admin(r, top.get("admin", {})),
        admission=parse_admission(top.get("admission", {"policy": "guaranteed"}), r.fail),
        health=_health(r, top.get("health", {})),
        sticky=_sticky(r, top.get("sticky")),
        ledger=_ledger(r, top),
        flow=None if top.get("flow") is None else _flow(r, top["flow"]),
    )
    _check_flow(r, config, top)
    if config.retry_after_max_s < config.retry_after_min_s:
        raise r.fail("retry_after.max_s", "must be at least retry_after.min_s")
    for i, route in enumerate(config.routes):
        if route.max_new_tokens >= config.max_model_len:
            raise r.fail(f"routes[{i}].max_new_tokens",
                         f"cap {route.max_new_tokens} leaves no room for a prompt in max_model_len "
                         f"{config.max_model_len}")
        if route.upstream is not None and len(config.upstreams) > 1:
            raise r.fail(f"routes[{i}].upstream", "with several upstreams every route is spread over them: "
                         "a route names its own upstream only in front of a single one")
    return config


def _upstreams(r: _Reader, top: dict) -> tuple[GatewayUpstream, ...]:
    """`upstream` + `block_budget` (one upstream), or `upstreams`: a list of {url, block_budget,
    weight}, each URL once."""
    if "upstreams" not in top:
        for key in ("upstream", "block_budget"):
            if key not in top:
                raise r.fail(key, "missing (or give upstreams: a list of {url, block_budget})")
        return (GatewayUpstream(r.url(top["upstream"], "upstream"),
                                r.integer(top["block_budget"], "block_budget", 1),
                                engine_id=_engine_id(r, top.get("engine_id"), "engine_id")),)
    if "engine_id" in top:
        raise r.fail("engine_id", "with upstreams:, give each its own upstreams[i].engine_id")
    for key in ("upstream", "block_budget"):
        if key in top:
            raise r.fail(key, "give upstreams: (each with its own block_budget) or upstream: and block_budget:, "
                         "not both")
    raw = top["upstreams"]
    if not isinstance(raw, list) or not raw:
        raise r.fail("upstreams", "expected a non-empty list of {url, block_budget, weight}")
    out: list[GatewayUpstream] = []
    seen: dict[tuple, int] = {}
    ids: dict[str, int] = {}
    for i, item in enumerate(raw):
        where = f"upstreams[{i}]"
        doc = r.mapping(item, where, {"url", "block_budget", "weight", "engine_id"}, {"url", "block_budget"})
        engine_id = _engine_id(r, doc.get("engine_id"), f"{where}.engine_id")
        if engine_id is not None:
            if engine_id in ids:
                raise r.fail(f"{where}.engine_id", f"{engine_id} is upstreams[{ids[engine_id]}]'s already: each "
                             "engine is listed once")
            ids[engine_id] = i
        url = r.url(doc["url"], f"{where}.url")
        parsed = parse_url(url, field=f"{where}.url")
        same = (parsed.scheme, parsed.host.lower(), parsed.port, parsed.prefix.rstrip("/"))
        if same in seen:
            raise r.fail(f"{where}.url", f"{url} is upstreams[{seen[same]}] again: each engine replica is listed once")
        seen[same] = i
        out.append(GatewayUpstream(
            url, r.integer(doc["block_budget"], f"{where}.block_budget", 1),
            r.number(doc.get("weight", 1.0), f"{where}.weight", 0.001, MAX_WEIGHT), engine_id))
    return tuple(out)


#: What an engine_id may hold (a Redis hash field and a log word).
_ENGINE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,199}")


def _engine_id(r: _Reader, value: Any, where: str) -> str | None:
    """An upstream's engine_id: the name every gateway replica sharing a Redis ledger gives it."""
    name = r.string(value, where, True)
    if name is not None and not _ENGINE_ID.fullmatch(name):
        raise r.fail(where, "expected a name of letters, digits and . _ : / @ + - (at most 200), such as "
                     "vllm-a")
    return name


#: The longest lease: a replica that dies holds its reservations at most this long.
MAX_LEASE_S = 3600.0
#: The most gateway replicas `replicas_hint` may name.
MAX_REPLICAS_HINT = 1024



def _redis_address_ok(scheme: str, url: str) -> bool:
    """A redis(s):// URL redis-py can connect to as written: a host, a port that is one, a
    database number (read at start, where a malformed one was a traceback)."""
    if scheme == "unix":
        return True
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        return False
    database = parts.path.strip("/")
    return bool(parts.hostname) and port != 0 and (not database or database.isdigit())

def _ledger(r: _Reader, top: dict) -> LedgerStore:
    """`ledger: {backend, url, key_prefix, lease_s, on_error, replicas_hint, op_timeout_s, reclaim_grace_s}`. The URL
    is never
    quoted in an error: it may hold a password."""
    value = top.get("ledger", {})
    if isinstance(value, str):  # perhaps a URL, with its password: not quoted
        raise r.fail("ledger", "expected a mapping such as {backend: redis, url: redis://...}, got a string")
    doc = r.mapping(value, "ledger", {"backend", "url", "key_prefix", "lease_s", "on_error", "replicas_hint",
                                      "op_timeout_s", "reclaim_grace_s"})
    for key, item in doc.items():
        if key != "url" and isinstance(item, str) and ("@" in item or "://" in item):
            raise r.fail(f"ledger.{key}", "got a URL-like string (not quoted: it may hold a password); "
                         "the Redis URL goes in ledger.url")
    names = {b.value: b for b in LedgerBackend}
    given = doc.get("backend", LedgerBackend.MEMORY.value)
    backend = names[r.choice(given, "ledger.backend", names)]
    if backend is LedgerBackend.MEMORY:
        for key in ("url", "key_prefix", "lease_s", "on_error", "replicas_hint", "op_timeout_s", "reclaim_grace_s"):
            if key in doc:
                raise r.fail(f"ledger.{key}", "only for ledger.backend: redis")
        return LedgerStore()
    if "url" not in doc:
        raise r.fail("ledger.url", "missing: the Redis every gateway replica shares, e.g. redis://127.0.0.1:6379/0")
    url = doc["url"]
    if not isinstance(url, str) or not url:
        raise r.fail("ledger.url", "expected a redis://, rediss:// or unix:// URL"
                     + ("" if isinstance(url, str) else f", got {brief(url)}"))
    scheme, sep, rest = url.partition("://")
    if not sep or scheme.lower() not in ("redis", "rediss", "unix") or not rest or not url.isprintable() \
            or any(c.isspace() for c in url):
        raise r.fail("ledger.url", "expected a redis://, rediss:// or unix:// URL (not quoted here: it may "
                     "hold a password)")
    if not _redis_address_ok(scheme.lower(), url):
        raise r.fail("ledger.url", "expected a host, a port from 1 to 65535 and a numeric database, as in "
                     "redis://host:6379/0 (not quoted here: it may hold a password)")
    prefix = doc.get("key_prefix", "kvtune")
    if not isinstance(prefix, str) or not prefix:
        raise r.fail("ledger.key_prefix", f"expected a non-empty string, got {brief(prefix)}")
    if not prefix.isprintable() or any(c.isspace() for c in prefix) or len(prefix) > 128:
        raise r.fail("ledger.key_prefix", f"{brief(prefix)} is not a key prefix (printable, no spaces, "
                     "at most 128 characters)")
    on_error = doc.get("on_error", OnLedgerError.REJECT.value)
    errors = {e.value: e for e in OnLedgerError}
    r.choice(on_error, "ledger.on_error", errors)
    if errors[on_error] is OnLedgerError.LOCAL and "replicas_hint" not in doc:
        raise r.fail("ledger.replicas_hint", "missing: on_error: local admits against 1/replicas_hint of "
                     "each budget, so it needs how many gateway replicas share it")
    hint = r.integer(doc.get("replicas_hint", 1), "ledger.replicas_hint", 1, MAX_REPLICAS_HINT)
    lease_s = r.number(doc.get("lease_s", 10.0), "ledger.lease_s", 0.1, MAX_LEASE_S)
    op_timeout_s = r.number(doc.get("op_timeout_s", 0.5), "ledger.op_timeout_s", 0.01, 30.0)
    if "op_timeout_s" in doc and op_timeout_s >= lease_s:
        raise r.fail("ledger.op_timeout_s", f"{op_timeout_s:g} s is not below lease_s ({lease_s:g} s): a call "
                     "that slow would let the replica's own lease lapse while it waits")
    grace = r.number(doc.get("reclaim_grace_s", DEFAULT_RECLAIM_GRACE_S), "ledger.reclaim_grace_s", 0, MAX_LEASE_S)
    return LedgerStore(backend, url, prefix, lease_s, errors[on_error], hint, op_timeout_s, grace)


def _sticky(r: _Reader, value: Any) -> Sticky | None:
    if value is None:
        return None
    doc = r.mapping(value, "sticky", {"by", "header"}, {"by"})
    names = {b.value: b for b in StickyBy}
    by = doc["by"]
    r.choice(by, "sticky.by", names)
    header = r.string(doc.get("header"), "sticky.header", optional=True)
    if names[by] is StickyBy.HEADER:
        if header is None:
            raise r.fail("sticky.header", "missing: the request header whose value keeps requests together")
        if not re.fullmatch(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+", header):
            raise r.fail("sticky.header", f"{brief(header)} is not a header name")
    elif header is not None:
        raise r.fail("sticky.header", "only for sticky.by: header")
    return Sticky(names[by], header)


def _health(r: _Reader, value: Any) -> HealthProbe:
    doc = r.mapping(value, "health", {"interval_s", "timeout_s", "path", "consecutive_failures", "ejection_s",
                                      "max_ejection_s", "max_ejected_share"})
    d = HealthProbe()
    path = r.string(doc.get("path", d.path), "health.path")
    _literal_path(r, path, "health.path")
    ejection_s = r.number(doc.get("ejection_s", d.ejection_s), "health.ejection_s", 0.01)
    max_ejection_s = r.number(doc.get("max_ejection_s", max(d.max_ejection_s, ejection_s)),
                              "health.max_ejection_s", 0.01)
    if max_ejection_s < ejection_s:
        raise r.fail("health.max_ejection_s", f"{max_ejection_s:g} is below health.ejection_s ({ejection_s:g})")
    return HealthProbe(interval_s=r.number(doc.get("interval_s", d.interval_s), "health.interval_s", 0.05),
                       timeout_s=r.number(doc.get("timeout_s", d.timeout_s), "health.timeout_s", 0.01),
                       path=path,
                       consecutive_failures=r.integer(doc.get("consecutive_failures", d.consecutive_failures),
                                                      "health.consecutive_failures", 0, 1_000_000),
                       ejection_s=ejection_s, max_ejection_s=max_ejection_s,
                       max_ejected_share=r.number(doc.get("max_ejected_share", d.max_ejected_share),
                                                  "health.max_ejected_share", 0.0, 1.0))


BAND_NAME = re.compile(r"[a-z0-9_-]{1,32}")
MAX_WEIGHT = 1_000_000.0
MAX_DEADLINE_S = 86_400.0


def _flow(r: _Reader, value: Any) -> FlowControl:
    """gateway.yaml `flow:` (docs/guides/flow-control.md, Configuration)."""
    doc = r.mapping(value, "flow", {"token_time_s", "bands", "default_band", "band_header", "flow_header",
                                    "default_weight", "weights", "max_waiting", "max_waiting_per_flow", "max_flows",
                                    "metrics_flows"}, {"token_time_s", "bands"})
    raw_bands = doc["bands"]
    if not isinstance(raw_bands, list) or not 1 <= len(raw_bands) <= MAX_BANDS:
        raise r.fail("flow.bands", f"expected a list of 1 to {MAX_BANDS} bands, highest priority first")
    bands: list[Band] = []
    for i, raw in enumerate(raw_bands):
        where = f"flow.bands[{i}]"
        band = r.mapping(raw, where, {"name", "deadline_s", "reserve_blocks"}, {"name", "deadline_s"})
        name = r.string(band["name"], f"{where}.name")
        if not BAND_NAME.fullmatch(name):
            raise r.fail(f"{where}.name", f"{brief(name)} is not a band name ([a-z0-9_-], at most 32 characters)")
        if any(b.name == name for b in bands):
            raise r.fail(f"{where}.name", f"band {name} is named twice")
        reserve = r.integer(band.get("reserve_blocks", 0), f"{where}.reserve_blocks", 0)
        if reserve and i == len(raw_bands) - 1:
            raise r.fail(f"{where}.reserve_blocks", "the last band has no band below it to hold back: give the "
                         "reserve to the band it protects")
        bands.append(Band(name, r.number(band["deadline_s"], f"{where}.deadline_s", 0, MAX_DEADLINE_S), reserve))
    default_band = r.string(doc.get("default_band"), "flow.default_band", optional=True)
    if default_band is not None and all(b.name != default_band for b in bands):
        raise r.fail("flow.default_band", f"{brief(default_band)} is not one of flow.bands")
    headers = {}
    for key, default in (("band_header", DEFAULT_BAND_HEADER), ("flow_header", DEFAULT_FLOW_HEADER)):
        header = r.string(doc.get(key, default), f"flow.{key}")
        if not HEADER_NAME.fullmatch(header):
            raise r.fail(f"flow.{key}", f"{brief(header)} is not a header name")
        headers[key] = header.lower()
    raw_weights = doc.get("weights", {})
    if not isinstance(raw_weights, dict):
        raise r.fail("flow.weights", f"expected a mapping of flow id to weight, got {brief(raw_weights)}")
    weights = {}
    for name, weight in raw_weights.items():
        if not isinstance(name, str) or not 1 <= len(name) <= 128:
            raise r.fail("flow.weights", f"{brief(name)} is not a flow id (1 to 128 characters)")
        weights[name] = r.number(weight, f"flow.weights.{name}", 1e-6, MAX_WEIGHT)
    return FlowControl(
        token_time_s=r.number(doc["token_time_s"], "flow.token_time_s", 1e-6, 60.0),
        bands=tuple(bands), default_band=default_band, band_header=headers["band_header"],
        flow_header=headers["flow_header"],
        default_weight=r.number(doc.get("default_weight", 1.0), "flow.default_weight", 1e-6, MAX_WEIGHT),
        weights=weights,
        max_waiting=r.integer(doc.get("max_waiting", 1024), "flow.max_waiting", 0),
        max_waiting_per_flow=r.integer(doc.get("max_waiting_per_flow", 64), "flow.max_waiting_per_flow", 1),
        max_flows=r.integer(doc.get("max_flows", 1024), "flow.max_flows", 1),
        metrics_flows=r.integer(doc.get("metrics_flows", 10), "flow.metrics_flows", 0, 1000),
    )


def _check_flow(r: _Reader, config: GatewayConfig, top: dict) -> None:
    """`flow:` replaces `queue:`, is not yet run over a shared ledger, and routes name its bands."""
    flow = config.flow
    if flow is None:
        for i, route in enumerate(config.routes):
            if route.band is not None:
                raise r.fail(f"routes[{i}].band", "a band needs the flow: section that defines it")
        return
    if "queue" in top:
        raise r.fail("queue", "flow: replaces queue: (its bands' deadlines and bounds): give one of them")
    if config.ledger.shared:
        raise r.fail("flow", "flow control is not yet supported with ledger.backend: redis (each replica would "
                     "forecast from its own reservations only)")
    budget = min(u.block_budget for u in config.upstreams)
    if flow.reserve_blocks >= budget:
        last = max(i for i, b in enumerate(flow.bands) if b.reserve_blocks)
        raise r.fail(f"flow.bands[{last}].reserve_blocks", f"the bands' reserves add up to {flow.reserve_blocks} "
                     f"blocks, not below the block budget {budget}: the last band could never be admitted")
    for i, route in enumerate(config.routes):
        if route.band is not None and flow.band_index(route.band) is None:
            raise r.fail(f"routes[{i}].band", f"{brief(route.band)} is not one of flow.bands")


def _route(r: _Reader, raw: Any, where: str) -> Route:
    item = r.mapping(raw, where, {"name", "match", "max_new_tokens", "upstream", "api", "upstream_path",
                                  "output_histogram", "band"}, {"name", "max_new_tokens"})
    match_doc = r.mapping(item.get("match", {}), f"{where}.match", {"path", "path_prefix", "model", "header", "value"})
    header, value = _route_header(r, match_doc, f"{where}.match")
    path = r.string(match_doc.get("path"), f"{where}.match.path", optional=True)
    prefix = r.string(match_doc.get("path_prefix"), f"{where}.match.path_prefix", optional=True)
    if path is not None and prefix is not None:
        raise r.fail(f"{where}.match", "give path or path_prefix, not both")
    if path is not None:
        _literal_path(r, path, f"{where}.match.path")
        if "*" in path:
            raise r.fail(f"{where}.match.path", "a path is literal: for every path that starts with "
                         "something, write path_prefix")
        endpoint = classify(path, ())
        if endpoint.path_class not in (PathClass.GENERATE, PathClass.UNKNOWN):
            raise r.fail(f"{where}.match.path", f"{path} is not a generation endpoint a route can cap "
                         f"({endpoint.path_class.value})")
    if prefix is not None and not prefix.startswith("/"):
        raise r.fail(f"{where}.match.path_prefix", "must start with /")
    custom = path is not None and path not in GENERATE
    upstream_path = r.string(item.get("upstream_path"), f"{where}.upstream_path", optional=True)
    api = None
    if item.get("api") is not None or upstream_path is not None:
        if not custom:
            raise r.fail(f"{where}.api" if item.get("api") is not None else f"{where}.upstream_path",
                         "only a route whose match.path is not a vLLM endpoint says how it is read or forwarded")
    if custom:
        names = {a.value: a for a in ROUTE_APIS}
        given = item.get("api")
        api = names[r.choice(given, f"{where}.api", names)] if given is not None else None
        if upstream_path is not None:
            _literal_path(r, upstream_path, f"{where}.upstream_path")
            target = classify(upstream_path, ())
            if target.path_class is PathClass.GENERATE and target.api is not None:  # classify names its API
                if api is not None and api is not target.api:
                    raise r.fail(f"{where}.api", f"{upstream_path} reads requests as {target.api.value}, "
                                 f"not {api.value}")
                api = target.api
            elif target.path_class is not PathClass.UNKNOWN:
                raise r.fail(f"{where}.upstream_path", f"{upstream_path} is not a generation endpoint")
        api = api or Api.ANY
    return Route(
        name=r.string(item["name"], f"{where}.name"),
        match=RouteMatch(path=path, model=r.string(match_doc.get("model"), f"{where}.match.model", optional=True),
                         path_prefix=prefix, header=header, value=value),
        max_new_tokens=r.integer(item["max_new_tokens"], f"{where}.max_new_tokens", 1),
        upstream=r.url(item.get("upstream"), f"{where}.upstream", optional=True),
        api=api,
        upstream_path=upstream_path,
        output_law=(None if item.get("output_histogram") is None
                    else parse_output_law(item["output_histogram"], r.fail, f"{where}.output_histogram")),
        band=r.string(item.get("band"), f"{where}.band", optional=True),
    )


def _route_header(r: _Reader, doc: dict, where: str) -> tuple[str | None, str | None]:
    """`match.header` and `match.value`, both or neither: a header name (kept lower-case: names
    are case-insensitive) and the exact value a request's single such header must hold."""
    header = r.string(doc.get("header"), f"{where}.header", optional=True)
    value = doc.get("value")
    if header is None:
        if value is not None:
            raise r.fail(f"{where}.value", "only with match.header: the request header whose value this is")
        return None, None
    if not HEADER_NAME.fullmatch(header):
        raise r.fail(f"{where}.header", f"{brief(header)} is not a header name")
    if value is None:
        raise r.fail(f"{where}.value", "missing: the exact value of the header that selects this route")
    if not isinstance(value, str) or not ROUTE_HEADER_VALUE.fullmatch(value):
        raise r.fail(f"{where}.value", f"{brief(value)} is not a header value a route can match (printable "
                     f"ASCII, no comma, no space at either end, at most {MAX_ROUTE_HEADER_VALUE} characters)")
    return header.lower(), value


def _literal_path(r: _Reader, path: str, where: str) -> None:
    if canonical_path(path) != path or "?" in path:
        raise r.fail(where, f"{brief(path)} is not a plain request path (printable ASCII from /, no "
                     "percent-escapes, '//', '.' or '..' segments)")


def _passthrough(r: _Reader, value: Any) -> tuple[str, ...]:
    if not isinstance(value, list):
        raise r.fail("passthrough", "expected a list of request paths")
    out = []
    for i, item in enumerate(value):
        where = f"passthrough[{i}]"
        path = r.string(item, where)
        _literal_path(r, path, where)
        why = never_passthrough(path)
        if why is not None:
            raise r.fail(where, f"{path} cannot pass through untouched: {why}")
        out.append(path)
    return tuple(dict.fromkeys(out))


def _limits(r: _Reader, value: Any, max_model_len: int) -> ClientLimits:
    doc = r.mapping(value, "limits", {"header_timeout_s", "body_timeout_s", "body_deadline_s", "keepalive_timeout_s",
                                      "send_timeout_s", "max_header_bytes", "max_header_line_bytes",
                                      "max_body_bytes", "max_connections"})
    d = ClientLimits()

    def seconds(key: str) -> float:
        return r.number(doc.get(key, getattr(d, key)), f"limits.{key}", 0.001)

    limits = ClientLimits(
        header_timeout_s=seconds("header_timeout_s"),
        body_timeout_s=seconds("body_timeout_s"),
        body_deadline_s=r.number(doc.get("body_deadline_s", 2 * seconds("body_timeout_s")), "limits.body_deadline_s",
                                 0.001),
        keepalive_timeout_s=seconds("keepalive_timeout_s"),
        send_timeout_s=seconds("send_timeout_s"),
        max_header_bytes=r.integer(doc.get("max_header_bytes", d.max_header_bytes), "limits.max_header_bytes", 1024),
        max_header_line_bytes=r.integer(doc.get("max_header_line_bytes", d.max_header_line_bytes),
                                        "limits.max_header_line_bytes", 256),
        max_body_bytes=r.integer(doc.get("max_body_bytes", default_max_body_bytes(max_model_len)),
                                 "limits.max_body_bytes", 1024),
        max_connections=r.integer(doc.get("max_connections", d.max_connections), "limits.max_connections", 1),
    )
    if limits.max_header_line_bytes > limits.max_header_bytes:
        raise r.fail("limits.max_header_line_bytes", "must be at most limits.max_header_bytes")
    return limits


def _admin(r: _Reader, value: Any) -> AdminAccess:
    doc = r.mapping(value, "admin", {"metrics", "ledger", "token_env", "refusal_detail"})
    metrics = doc.get("metrics", Access.LOOPBACK.value)
    ledger = doc.get("ledger", Access.LOOPBACK.value)
    r.choice(metrics, "admin.metrics", ADMIN_ACCESS)
    r.choice(ledger, "admin.ledger", ADMIN_ACCESS[:2])
    token_env = r.string(doc.get("token_env"), "admin.token_env", optional=True)
    if token_env is not None and not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", token_env):
        raise r.fail("admin.token_env", f"{brief(token_env)} is not an environment variable name")
    if Access.TOKEN.value in (metrics, ledger) and token_env is None:
        raise r.fail("admin.token_env", "access 'token' needs the environment variable that holds the token")
    detail = doc.get("refusal_detail", RefusalDetail.PUBLIC.value)
    r.choice(detail, "admin.refusal_detail", REFUSAL_DETAILS)
    return AdminAccess(metrics=Access(metrics), ledger=Access(ledger), token_env=token_env,
                       refusal_detail=RefusalDetail(detail))


def load_gateway_config(path: str | Path) -> GatewayConfig:
    """Read and validate a gateway.yaml file: a regular file of at most CONFIG_MAX_BYTES, YAML
    without anchors, aliases or duplicate keys (kvtune.userfiles)."""
    return parse_gateway_config(load_yaml(path, max_bytes=CONFIG_MAX_BYTES), path=str(path))
