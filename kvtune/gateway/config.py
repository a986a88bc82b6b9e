"""The admission gateway's configuration: what `kvtune recommend` renders as gateway.yaml and
what `kvtune gateway` and `kvtune check` read back.

Parsing is strict (unknown keys, a zero budget or a route without a cap are errors at load time),
so a typo fails when the file is read, not at the first request.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from kvtune.domain.admission_policy import GUARANTEED, AdmissionPolicy, parse_admission
from kvtune.domain.fields import Fields
from kvtune.domain.flow_control import DEFAULT_BAND_HEADER, DEFAULT_FLOW_HEADER, MAX_BANDS, Band, FlowControl
from kvtune.domain.output_law import parse_output_law
from kvtune.domain.route import Api, Route, RouteMatch
from kvtune.endpoint import MAX_PORT, host_problem, parse_url, url_problem
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


#: gateway.yaml's top-level keys, and those it must have.
TOP_KEYS = frozenset({"version", "listen", "upstream", "engine_id", "upstreams", "model", "block_size", "block_budget",
                      "max_model_len", "prompt_tokens", "retry_after", "queue", "timeouts", "routes", "passthrough",
                      "limits", "admin", "admission", "health", "sticky", "ledger", "flow"})
TOP_REQUIRED = frozenset({"version", "block_size", "max_model_len", "routes"})


def _number(f: Fields, key: str, minimum: float, maximum: float = MAX_SECONDS, *,
            default: float | None = None) -> float:
    """A finite number in range, as a float; the default maximum is for durations, the other
    numbers' is given."""
    return float(f.number(key, minimum=minimum, maximum=maximum, default=default))


def _url(f: Fields, key: str, url: str) -> str:
    """`url` (read at `key`) when it is an engine URL kvtune can send to."""
    problem = url_problem(url)
    if problem:
        raise f.fail(key, problem)
    return url


def _optional_url(f: Fields, key: str) -> str | None:
    url = f.string(key, optional=True, nonempty=True)
    return None if url is None else _url(f, key, url)


def _host(f: Fields, key: str, default: str) -> str:
    host = f.string(key, nonempty=True, default=default)
    problem = host_problem(host)
    if problem:
        raise f.fail(key, problem)
    return host


def parse_gateway_config(data: Any, *, path: str = "gateway.yaml") -> GatewayConfig:
    """Validate a parsed gateway.yaml document into a GatewayConfig (kvtune.domain.fields reads
    it: unknown keys refused, values checked, never coerced, each error naming its key path)."""
    top = Fields(data, path=path, noun="a mapping").only(TOP_KEYS, TOP_REQUIRED)
    if top.integer("version", minimum=1) != SCHEMA_VERSION:
        raise top.fail("version", f"unsupported version {top.data['version']} (this kvtune reads {SCHEMA_VERSION})")
    listen = top.section("listen", {"host", "port"})
    retry = top.section("retry_after", {"min_s", "max_s"})
    queue = top.section("queue", {"max_waiting", "timeout_s"})
    timeouts = top.section("timeouts", {"connect_s", "read_s", "drain_s"})
    counting = top.section("prompt_tokens", {"method", "tokenizer", "chars_per_token", "margin_tokens", "pair_tokens"})

    method = counting.member("method", CountingMethod, default=CountingMethod.UPSTREAM_TOKENIZE)
    prompt_counting = PromptCounting(
        method=method,
        tokenizer=counting.string("tokenizer", optional=True, nonempty=True),
        chars_per_token=(_number(counting, "chars_per_token", 0.1, MAX_CHARS_PER_TOKEN)
                         if counting.has("chars_per_token") else None),
        margin_tokens=counting.integer("margin_tokens", default=0),
        pair_tokens=counting.integer("pair_tokens", default=DEFAULT_PAIR_TOKENS),
    )
    if method is CountingMethod.TOKENIZER and prompt_counting.tokenizer is None:
        raise top.fail("prompt_tokens.tokenizer", "method 'tokenizer' needs a tokenizer path or hub id")
    if method is CountingMethod.ESTIMATE and (prompt_counting.chars_per_token is None
                                              or prompt_counting.margin_tokens == 0):
        raise top.fail("prompt_tokens", "an estimate needs chars_per_token and a margin_tokens above 0")

    raw_routes = top.data["routes"]
    if not isinstance(raw_routes, list) or not raw_routes:
        raise top.fail("routes", "expected a non-empty list of routes")
    routes = tuple(_route(item) for item in top.items("routes"))
    max_model_len = top.integer("max_model_len", minimum=1)

    config = GatewayConfig(
        upstreams=_upstreams(top),
        block_size=top.integer("block_size", minimum=1),
        max_model_len=max_model_len,
        routes=routes,
        host=_host(listen, "host", "127.0.0.1"),
        port=listen.integer("port", maximum=MAX_PORT, default=8080),
        model=top.string("model", optional=True, nonempty=True),
        prompt_tokens=prompt_counting,
        retry_after_min_s=retry.integer("min_s", minimum=1, maximum=MAX_SECONDS, default=1),
        retry_after_max_s=retry.integer("max_s", minimum=1, maximum=MAX_SECONDS, default=60),
        queue_max_waiting=queue.integer("max_waiting", default=0),
        queue_timeout_s=_number(queue, "timeout_s", 0, default=30),
        upstream_connect_timeout_s=_number(timeouts, "connect_s", 0.001, default=10),
        upstream_read_timeout_s=_number(timeouts, "read_s", 0.001, default=600),
        drain_timeout_s=_number(timeouts, "drain_s", 0, default=30),
        passthrough=_passthrough(top),
        limits=_limits(top.section("limits", LIMIT_KEYS), max_model_len),
        admin=_admin(top.section("admin", {"metrics", "ledger", "token_env", "refusal_detail"})),
        admission=parse_admission(top.data.get("admission", {"policy": "guaranteed"}), top.fail_at),
        health=_health(top.section("health", {"interval_s", "timeout_s", "path", "consecutive_failures",
                                              "ejection_s", "max_ejection_s", "max_ejected_share"})),
        sticky=None if top.data.get("sticky") is None else _sticky(top.section("sticky", {"by", "header"}, {"by"})),
        ledger=_ledger(top),
        flow=None if top.data.get("flow") is None else _flow(top.section("flow", FLOW_KEYS, {"token_time_s", "bands"})),
    )
    _check_flow(top, config)
    if config.retry_after_max_s < config.retry_after_min_s:
        raise top.fail("retry_after.max_s", "must be at least retry_after.min_s")
    for i, route in enumerate(config.routes):
        if route.max_new_tokens >= config.max_model_len:
            raise top.fail(f"routes[{i}].max_new_tokens",
                           f"cap {route.max_new_tokens} leaves no room for a prompt in max_model_len "
                           f"{config.max_model_len}")
        if route.upstream is not None and len(config.upstreams) > 1:
            raise top.fail(f"routes[{i}].upstream", "with several upstreams every route is spread over them: "
                           "a route names its own upstream only in front of a single one")
    return config


def _upstreams(top: Fields) -> tuple[GatewayUpstream, ...]:
    """`upstream` + `block_budget` (one upstream), or `upstreams`: a list of {url, block_budget,
    weight}, each URL once."""
    if "upstreams" not in top.data:
        for key in ("upstream", "block_budget"):
            if key not in top.data:
                raise top.fail(key, "missing (or give upstreams: a list of {url, block_budget})")
        return (GatewayUpstream(_url(top, "upstream", top.string("upstream", nonempty=True)),
                                top.integer("block_budget", minimum=1), engine_id=_engine_id(top)),)
    if "engine_id" in top.data:
        raise top.fail("engine_id", "with upstreams:, give each its own upstreams[i].engine_id")
    for key in ("upstream", "block_budget"):
        if key in top.data:
            raise top.fail(key, "give upstreams: (each with its own block_budget) or upstream: and block_budget:, "
                           "not both")
    raw = top.data["upstreams"]
    if not isinstance(raw, list) or not raw:
        raise top.fail("upstreams", "expected a non-empty list of {url, block_budget, weight}")
    out: list[GatewayUpstream] = []
    seen: dict[tuple, int] = {}
    ids: dict[str, int] = {}
    for i, item in enumerate(top.items("upstreams")):
        doc = item.only({"url", "block_budget", "weight", "engine_id"}, {"url", "block_budget"})
        engine_id = _engine_id(doc)
        if engine_id is not None:
            if engine_id in ids:
                raise doc.fail("engine_id", f"{engine_id} is upstreams[{ids[engine_id]}]'s already: each "
                               "engine is listed once")
            ids[engine_id] = i
        url = _url(doc, "url", doc.string("url", nonempty=True))
        parsed = parse_url(url, field=doc.field("url"))
        same = (parsed.scheme, parsed.host.lower(), parsed.port, parsed.prefix.rstrip("/"))
        if same in seen:
            raise doc.fail("url", f"{url} is upstreams[{seen[same]}] again: each engine replica is listed once")
        seen[same] = i
        out.append(GatewayUpstream(url, doc.integer("block_budget", minimum=1),
                                   _number(doc, "weight", 0.001, MAX_WEIGHT, default=1.0), engine_id))
    return tuple(out)


#: What an engine_id may hold (a Redis hash field and a log word).
_ENGINE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,199}")


def _engine_id(f: Fields) -> str | None:
    """An upstream's engine_id: the name every gateway replica sharing a Redis ledger gives it."""
    name = f.string("engine_id", optional=True, nonempty=True)
    if name is not None and not _ENGINE_ID.fullmatch(name):
        raise f.fail("engine_id", "expected a name of letters, digits and . _ : / @ + - (at most 200), such as "
                     "vllm-a")
    return name


#: The longest lease: a replica that dies holds its reservations at most this long.
MAX_LEASE_S = 3600.0
#: The most gateway replicas `replicas_hint` may name.
MAX_REPLICAS_HINT = 1024
#: ledger: keys only a Redis ledger takes, in the order a memory ledger names the first one given.
REDIS_LEDGER_KEYS = ("url", "key_prefix", "lease_s", "on_error", "replicas_hint", "op_timeout_s", "reclaim_grace_s")


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


def _ledger(top: Fields) -> LedgerStore:
    """`ledger: {backend, url, key_prefix, lease_s, on_error, replicas_hint, op_timeout_s, reclaim_grace_s}`.
    The URL is never quoted in an error: it may hold a password."""
    if isinstance(top.data.get("ledger"), str):  # perhaps a URL, with its password: not quoted
        raise top.fail("ledger", "expected a mapping such as {backend: redis, url: redis://...}, got a string")
    doc = top.section("ledger", {"backend", *REDIS_LEDGER_KEYS})
    for key, item in doc.data.items():
        if key != "url" and isinstance(item, str) and ("@" in item or "://" in item):
            raise doc.fail(key, "got a URL-like string (not quoted: it may hold a password); "
                           "the Redis URL goes in ledger.url")
    backend = doc.member("backend", LedgerBackend, default=LedgerBackend.MEMORY)
    if backend is LedgerBackend.MEMORY:
        for key in REDIS_LEDGER_KEYS:
            if key in doc.data:
                raise doc.fail(key, "only for ledger.backend: redis")
        return LedgerStore()
    if "url" not in doc.data:
        raise doc.fail("url", "missing: the Redis every gateway replica shares, e.g. redis://127.0.0.1:6379/0")
    url = doc.data["url"]
    if not isinstance(url, str) or not url:
        raise doc.fail("url", "expected a redis://, rediss:// or unix:// URL"
                       + ("" if isinstance(url, str) else f", got {brief(url)}"))
    scheme, sep, rest = url.partition("://")
    if not sep or scheme.lower() not in ("redis", "rediss", "unix") or not rest or not url.isprintable() \
            or any(c.isspace() for c in url):
        raise doc.fail("url", "expected a redis://, rediss:// or unix:// URL (not quoted here: it may "
                       "hold a password)")
    if not _redis_address_ok(scheme.lower(), url):
        raise doc.fail("url", "expected a host, a port from 1 to 65535 and a numeric database, as in "
                       "redis://host:6379/0 (not quoted here: it may hold a password)")
    prefix = doc.string("key_prefix", nonempty=True, default="kvtune")
    if not prefix.isprintable() or any(c.isspace() for c in prefix) or len(prefix) > 128:
        raise doc.fail("key_prefix", f"{brief(prefix)} is not a key prefix (printable, no spaces, "
                       "at most 128 characters)")
    on_error = doc.member("on_error", OnLedgerError, default=OnLedgerError.REJECT)
    if on_error is OnLedgerError.LOCAL and "replicas_hint" not in doc.data:
        raise doc.fail("replicas_hint", "missing: on_error: local admits against 1/replicas_hint of "
                       "each budget, so it needs how many gateway replicas share it")
    hint = doc.integer("replicas_hint", minimum=1, maximum=MAX_REPLICAS_HINT, default=1)
    lease_s = _number(doc, "lease_s", 0.1, MAX_LEASE_S, default=10.0)
    op_timeout_s = _number(doc, "op_timeout_s", 0.01, 30.0, default=0.5)
    if "op_timeout_s" in doc.data and op_timeout_s >= lease_s:
        raise doc.fail("op_timeout_s", f"{op_timeout_s:g} s is not below lease_s ({lease_s:g} s): a call "
                       "that slow would let the replica's own lease lapse while it waits")
    grace = _number(doc, "reclaim_grace_s", 0, MAX_LEASE_S, default=DEFAULT_RECLAIM_GRACE_S)
    return LedgerStore(backend, url, prefix, lease_s, on_error, hint, op_timeout_s, grace)


def _sticky(doc: Fields) -> Sticky:
    by = doc.member("by", StickyBy)
    header = doc.string("header", optional=True, nonempty=True)
    if by is StickyBy.HEADER:
        if header is None:
            raise doc.fail("header", "missing: the request header whose value keeps requests together")
        if not re.fullmatch(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+", header):
            raise doc.fail("header", f"{brief(header)} is not a header name")
    elif header is not None:
        raise doc.fail("header", "only for sticky.by: header")
    return Sticky(by, header)


def _health(doc: Fields) -> HealthProbe:
    d = HealthProbe()
    path = doc.string("path", nonempty=True, default=d.path)
    _literal_path(doc, "path", path)
    ejection_s = _number(doc, "ejection_s", 0.01, default=d.ejection_s)
    max_ejection_s = _number(doc, "max_ejection_s", 0.01, default=max(d.max_ejection_s, ejection_s))
    if max_ejection_s < ejection_s:
        raise doc.fail("max_ejection_s", f"{max_ejection_s:g} is below health.ejection_s ({ejection_s:g})")
    return HealthProbe(interval_s=_number(doc, "interval_s", 0.05, default=d.interval_s),
                       timeout_s=_number(doc, "timeout_s", 0.01, default=d.timeout_s),
                       path=path,
                       consecutive_failures=doc.integer("consecutive_failures", maximum=1_000_000,
                                                        default=d.consecutive_failures),
                       ejection_s=ejection_s, max_ejection_s=max_ejection_s,
                       max_ejected_share=_number(doc, "max_ejected_share", 0.0, 1.0, default=d.max_ejected_share))


BAND_NAME = re.compile(r"[a-z0-9_-]{1,32}")
#: The largest flow weight (a flow's share of the queue, not an upstream's).
MAX_FLOW_WEIGHT = 1_000_000.0
MAX_DEADLINE_S = 86_400.0
FLOW_KEYS = frozenset({"token_time_s", "bands", "default_band", "band_header", "flow_header", "default_weight",
                       "weights", "max_waiting", "max_waiting_per_flow", "max_flows", "metrics_flows"})


def _flow(doc: Fields) -> FlowControl:
    """gateway.yaml `flow:` (docs/guides/flow-control.md, Configuration)."""
    raw_bands = doc.data["bands"]
    if not isinstance(raw_bands, list) or not 1 <= len(raw_bands) <= MAX_BANDS:
        raise doc.fail("bands", f"expected a list of 1 to {MAX_BANDS} bands, highest priority first")
    bands: list[Band] = []
    for i, item in enumerate(doc.items("bands")):
        band = item.only({"name", "deadline_s", "reserve_blocks"}, {"name", "deadline_s"})
        name = band.string("name", nonempty=True)
        if not BAND_NAME.fullmatch(name):
            raise band.fail("name", f"{brief(name)} is not a band name ([a-z0-9_-], at most 32 characters)")
        if any(b.name == name for b in bands):
            raise band.fail("name", f"band {name} is named twice")
        reserve = band.integer("reserve_blocks", default=0)
        if reserve and i == len(raw_bands) - 1:
            raise band.fail("reserve_blocks", "the last band has no band below it to hold back: give the "
                            "reserve to the band it protects")
        bands.append(Band(name, _number(band, "deadline_s", 0, MAX_DEADLINE_S), reserve))
    default_band = doc.string("default_band", optional=True, nonempty=True)
    if default_band is not None and all(b.name != default_band for b in bands):
        raise doc.fail("default_band", f"{brief(default_band)} is not one of flow.bands")
    headers = {}
    for key, default in (("band_header", DEFAULT_BAND_HEADER), ("flow_header", DEFAULT_FLOW_HEADER)):
        header = doc.string(key, nonempty=True, default=default)
        if not HEADER_NAME.fullmatch(header):
            raise doc.fail(key, f"{brief(header)} is not a header name")
        headers[key] = header.lower()
    raw_weights = doc.data.get("weights", {})
    if not isinstance(raw_weights, dict):
        raise doc.fail("weights", f"expected a mapping of flow id to weight, got {brief(raw_weights)}")
    by_flow = doc.child(raw_weights, "weights")
    weights = {}
    for name in raw_weights:
        if not isinstance(name, str) or not 1 <= len(name) <= 128:
            raise doc.fail("weights", f"{brief(name)} is not a flow id (1 to 128 characters)")
        weights[name] = _number(by_flow, name, 1e-6, MAX_FLOW_WEIGHT)
    return FlowControl(
        token_time_s=_number(doc, "token_time_s", 1e-6, 60.0),
        bands=tuple(bands), default_band=default_band, band_header=headers["band_header"],
        flow_header=headers["flow_header"],
        default_weight=_number(doc, "default_weight", 1e-6, MAX_FLOW_WEIGHT, default=1.0),
        weights=weights,
        max_waiting=doc.integer("max_waiting", default=1024),
        max_waiting_per_flow=doc.integer("max_waiting_per_flow", minimum=1, default=64),
        max_flows=doc.integer("max_flows", minimum=1, default=1024),
        metrics_flows=doc.integer("metrics_flows", maximum=1000, default=10),
    )


def _check_flow(top: Fields, config: GatewayConfig) -> None:
    """`flow:` replaces `queue:`, is not yet run over a shared ledger, and routes name its bands."""
    flow = config.flow
    if flow is None:
        for i, route in enumerate(config.routes):
            if route.band is not None:
                raise top.fail(f"routes[{i}].band", "a band needs the flow: section that defines it")
        return
    if "queue" in top.data:
        raise top.fail("queue", "flow: replaces queue: (its bands' deadlines and bounds): give one of them")
    if config.ledger.shared:
        raise top.fail("flow", "flow control is not yet supported with ledger.backend: redis (each replica would "
                       "forecast from its own reservations only)")
    budget = min(u.block_budget for u in config.upstreams)
    if flow.reserve_blocks >= budget:
        last = max(i for i, b in enumerate(flow.bands) if b.reserve_blocks)
        raise top.fail(f"flow.bands[{last}].reserve_blocks", f"the bands' reserves add up to {flow.reserve_blocks} "
                       f"blocks, not below the block budget {budget}: the last band could never be admitted")
    for i, route in enumerate(config.routes):
        if route.band is not None and flow.band_index(route.band) is None:
            raise top.fail(f"routes[{i}].band", f"{brief(route.band)} is not one of flow.bands")


ROUTE_KEYS = frozenset({"name", "match", "max_new_tokens", "upstream", "api", "upstream_path", "output_histogram",
                        "band"})


def _route(item: Fields) -> Route:
    item.only(ROUTE_KEYS, {"name", "max_new_tokens"})
    match = item.section("match", {"path", "path_prefix", "model", "header", "value"})
    header, value = _route_header(match)
    path = match.string("path", optional=True, nonempty=True)
    prefix = match.string("path_prefix", optional=True, nonempty=True)
    if path is not None and prefix is not None:
        raise match.fail(None, "give path or path_prefix, not both")
    if path is not None:
        _literal_path(match, "path", path)
        if "*" in path:
            raise match.fail("path", "a path is literal: for every path that starts with "
                             "something, write path_prefix")
        endpoint = classify(path, ())
        if endpoint.path_class not in (PathClass.GENERATE, PathClass.UNKNOWN):
            raise match.fail("path", f"{path} is not a generation endpoint a route can cap "
                             f"({endpoint.path_class.value})")
    if prefix is not None and not prefix.startswith("/"):
        raise match.fail("path_prefix", "must start with /")
    custom = path is not None and path not in GENERATE
    upstream_path = item.string("upstream_path", optional=True, nonempty=True)
    api = None
    if item.has("api") or upstream_path is not None:
        if not custom:
            raise item.fail("api" if item.has("api") else "upstream_path",
                            "only a route whose match.path is not a vLLM endpoint says how it is read or forwarded")
    if custom:
        api = item.member("api", Api, among=ROUTE_APIS, optional=True)
        if upstream_path is not None:
            _literal_path(item, "upstream_path", upstream_path)
            target = classify(upstream_path, ())
            if target.path_class is PathClass.GENERATE and target.api is not None:  # classify names its API
                if api is not None and api is not target.api:
                    raise item.fail("api", f"{upstream_path} reads requests as {target.api.value}, "
                                    f"not {api.value}")
                api = target.api
            elif target.path_class is not PathClass.UNKNOWN:
                raise item.fail("upstream_path", f"{upstream_path} is not a generation endpoint")
        api = api or Api.ANY
    return Route(
        name=item.string("name", nonempty=True),
        match=RouteMatch(path=path, model=match.string("model", optional=True, nonempty=True),
                         path_prefix=prefix, header=header, value=value),
        max_new_tokens=item.integer("max_new_tokens", minimum=1),
        upstream=_optional_url(item, "upstream"),
        api=api,
        upstream_path=upstream_path,
        output_law=(None if not item.has("output_histogram")
                    else parse_output_law(item.data["output_histogram"], item.fail_at, item.field("output_histogram"))),
        band=item.string("band", optional=True, nonempty=True),
    )


def _route_header(match: Fields) -> tuple[str | None, str | None]:
    """`match.header` and `match.value`, both or neither: a header name (kept lower-case: names
    are case-insensitive) and the exact value a request's single such header must hold."""
    header = match.string("header", optional=True, nonempty=True)
    value = match.data.get("value")
    if header is None:
        if value is not None:
            raise match.fail("value", "only with match.header: the request header whose value this is")
        return None, None
    if not HEADER_NAME.fullmatch(header):
        raise match.fail("header", f"{brief(header)} is not a header name")
    if value is None:
        raise match.fail("value", "missing: the exact value of the header that selects this route")
    if not isinstance(value, str) or not ROUTE_HEADER_VALUE.fullmatch(value):
        raise match.fail("value", f"{brief(value)} is not a header value a route can match (printable "
                         f"ASCII, no comma, no space at either end, at most {MAX_ROUTE_HEADER_VALUE} characters)")
    return header.lower(), value


def _literal_path(f: Fields, key: str, path: str) -> None:
    if canonical_path(path) != path or "?" in path:
        raise f.fail(key, f"{brief(path)} is not a plain request path (printable ASCII from /, no "
                     "percent-escapes, '//', '.' or '..' segments)")


def _passthrough(top: Fields) -> tuple[str, ...]:
    if not isinstance(top.data.get("passthrough", []), list):
        raise top.fail("passthrough", "expected a list of request paths")
    paths = top.strings("passthrough", nonempty=True, default=list(DEFAULT_PASSTHROUGH))
    for i, path in enumerate(paths):
        where = f"passthrough[{i}]"
        _literal_path(top, where, path)
        why = never_passthrough(path)
        if why is not None:
            raise top.fail(where, f"{path} cannot pass through untouched: {why}")
    return tuple(dict.fromkeys(paths))


LIMIT_KEYS = frozenset({"header_timeout_s", "body_timeout_s", "body_deadline_s", "keepalive_timeout_s",
                        "send_timeout_s", "max_header_bytes", "max_header_line_bytes", "max_body_bytes",
                        "max_connections"})


def _limits(doc: Fields, max_model_len: int) -> ClientLimits:
    d = ClientLimits()

    def seconds(key: str) -> float:
        return _number(doc, key, 0.001, default=getattr(d, key))

    limits = ClientLimits(
        header_timeout_s=seconds("header_timeout_s"),
        body_timeout_s=seconds("body_timeout_s"),
        body_deadline_s=_number(doc, "body_deadline_s", 0.001, default=2 * seconds("body_timeout_s")),
        keepalive_timeout_s=seconds("keepalive_timeout_s"),
        send_timeout_s=seconds("send_timeout_s"),
        max_header_bytes=doc.integer("max_header_bytes", minimum=1024, default=d.max_header_bytes),
        max_header_line_bytes=doc.integer("max_header_line_bytes", minimum=256, default=d.max_header_line_bytes),
        max_body_bytes=doc.integer("max_body_bytes", minimum=1024, default=default_max_body_bytes(max_model_len)),
        max_connections=doc.integer("max_connections", minimum=1, default=d.max_connections),
    )
    if limits.max_header_line_bytes > limits.max_header_bytes:
        raise doc.fail("max_header_line_bytes", "must be at most limits.max_header_bytes")
    return limits


def _admin(doc: Fields) -> AdminAccess:
    metrics = doc.member("metrics", Access, default=Access.LOOPBACK)
    ledger = doc.member("ledger", Access, among=(Access.LOOPBACK, Access.TOKEN), default=Access.LOOPBACK)
    token_env = doc.string("token_env", optional=True, nonempty=True)
    if token_env is not None and not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", token_env):
        raise doc.fail("token_env", f"{brief(token_env)} is not an environment variable name")
    if Access.TOKEN in (metrics, ledger) and token_env is None:
        raise doc.fail("token_env", "access 'token' needs the environment variable that holds the token")
    return AdminAccess(metrics=metrics, ledger=ledger, token_env=token_env,
                       refusal_detail=doc.member("refusal_detail", RefusalDetail, default=RefusalDetail.PUBLIC))


def load_gateway_config(path: str | Path) -> GatewayConfig:
    """Read and validate a gateway.yaml file: a regular file of at most CONFIG_MAX_BYTES, YAML
    without anchors, aliases or duplicate keys (kvtune.userfiles)."""
    return parse_gateway_config(load_yaml(path, max_bytes=CONFIG_MAX_BYTES), path=str(path))
