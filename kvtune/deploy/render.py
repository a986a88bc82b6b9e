"""Turn a recommendation (kvtune.domain.recommendation.Recommendation) into files that deploy.

Every template renders through one jinja2 environment with StrictUndefined, so a missing field
fails loudly instead of rendering an empty flag. Anything that came from logs (route names, model
ids) reaches a target only through that target's escaping filter (kvtune.deploy.filters);
comments are squeezed to one printable line by `one_line`. The report's charts are computed in
kvtune.deploy.charts.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import jinja2

from kvtune.deploy.charts import capacity_segments, histogram_bars, what_if_scatter
from kvtune.deploy.filters import FILTERS
from kvtune.deploy.launch import launcher, vllm
from kvtune.deploy.markers import K8S_FOLDER, NGINX_CONFIG_BEGIN, NGINX_CONFIG_END
from kvtune.deploy.slices import check_slice
from kvtune.domain.admission_policy import PolicyKind
from kvtune.domain.flow_control import FlowControl
from kvtune.domain.recommendation import FLOW_RESERVE_SETTING, FLOW_SETTINGS, flow_control_of
from kvtune.domain.whatif import Goal
from kvtune.domain.whatif import PolicyKind as WhatIfKind
from kvtune.endpoint import parse_upstream
from kvtune.engines import ENGINE_NAMES, ENGINE_TITLES, engine_facts
from kvtune.errors import InputError, OptionError, UnknownNameError
from kvtune.gateway import apis, endpoints, overflow, statistical
from kvtune.gateway.config import (
    ADMIN_ACCESS,
    DEFAULT_PAIR_TOKENS,
    Access,
    AdminAccess,
    ClientLimits,
    GatewayConfig,
    HealthProbe,
    default_max_body_bytes,
)
from kvtune.gateway.counting import TOKENIZE_CONCURRENCY
from kvtune.gateway.endpoints import DEFAULT_PASSTHROUGH, canonical_path
from kvtune.gateway.ledger import RATE_WINDOW_S
from kvtune.gateway.refusals import BUDGET_FULL, NEVER_FITS
from kvtune.ingest.tokenize import read_chat_template
from kvtune.policy.route_table import route_decisions
from kvtune.policy.whatif import TABLE_NOTE, headline, objective_line, replica_cells, table_cells
from kvtune.version import __version__
from kvtune.writer import write_files as write_all

if TYPE_CHECKING:
    from kvtune.domain.recommendation import Recommendation

TEMPLATES_DIR = Path(__file__).parent / "templates"
# The gateway's Lua modules (kvtune/*.lua): nginx.conf holds their data and loads them from
# lua/ under nginx's prefix, so they are written beside it (LUA_FOLDER/kvtune/NAME.lua).
LUA_DIR = Path(__file__).parent / "lua"
LUA_FOLDER = "lua"
# output file name -> template name
# the files every recommendation renders, whichever engine it is for; each engine's launch files
# (kvtune.deploy.launch) come first
COMMON_TARGETS: dict[str, str] = {
    "gateway.yaml": "gateway.yaml.j2",
    "nginx.conf": "nginx.conf.j2",
    "litellm-config.yaml": "litellm-config.yaml.j2",  # gateway.yaml enforced inside a LiteLLM proxy
    "recommendation.json": "",  # json.dumps, no template
    "report.html": "report.html.j2",
    "report.md": "report.md.j2",
}
LAUNCH_TARGETS: dict[str, str] = {name: engine for engine in ENGINE_NAMES for name in launcher(engine).FILES}
TARGETS: dict[str, str] = {**{name: launcher(LAUNCH_TARGETS[name]).FILES[name] for name in LAUNCH_TARGETS},
                           **COMMON_TARGETS}
EXECUTABLE = frozenset(launcher(engine).SCRIPT for engine in ENGINE_NAMES)


@dataclass(frozen=True, slots=True)
class RenderOptions:
    """Deployment details a recommendation does not know: where the gateway listens and where
    nginx keeps its files. Relative nginx paths resolve against nginx's prefix (`nginx -p DIR`)."""

    listen_host: str = "127.0.0.1"
    listen_port: int = 8080
    nginx_user: str | None = None  # `user` directive; only meaningful when nginx starts as root
    nginx_worker_processes: str = "auto"
    nginx_pid: str = "logs/nginx.pid"
    nginx_error_log: str = "logs/error.log"
    nginx_access_log: str | None = None  # None = off
    nginx_modules_dir: str = "/usr/lib/nginx/modules"
    lua_cpath: str = "/usr/lib/x86_64-linux-gnu/lua/5.1/?.so"
    retry_after_min_s: int = 1
    retry_after_max_s: int = 60
    # A fallback when the engine's count fails: characters / estimate_chars_per_token + margin.
    # None (the default): no fallback, a failed count answers 503 (an admission decision is
    # never made on a guess the config did not ask for).
    estimate_chars_per_token: float | None = None
    estimate_margin_tokens: int = 64
    # Paths forwarded untouched (never a governed, pooling or operator path).
    passthrough: tuple[str, ...] = DEFAULT_PASSTHROUGH
    # Per-client bounds; None: ClientLimits' defaults with a body cap sized to the context.
    limits: ClientLimits | None = None
    # Who may read /metrics and /kvtune/ledger.
    admin: AdminAccess = AdminAccess()
    # gateway.yaml counts prompts in process with this tokenizer (a model directory holding
    # tokenizer.json and a chat template, see local_chat_tokenizer): exact like /tokenize, without
    # its round trip. None: the upstream's /tokenize.
    gateway_tokenizer: str | None = None
    # Engine replicas behind the gateway, each with the recommended budget (one engine's): the
    # recommendation's upstream and the ports after it (replica_upstreams). nginx.conf keeps its
    # ledger in one nginx's shared memory and fronts one engine: it renders only for one.
    replicas: int = 1
    # nginx replicas in front of the one engine (kvtune.deploy.slices): each nginx.conf holds
    # floor(budget / nginx_replicas) blocks, since nginx's ledger cannot be shared between machines.
    nginx_replicas: int = 1
    # With several engine replicas: how each is probed, taken out and brought back (gateway.yaml
    # `health`); gateway.yaml and nginx.conf render the same probe.
    health: HealthProbe = HealthProbe()
    # gateway.yaml `flow:` (docs/guides/flow-control.md): the flow-control queue both gateways
    # render, in place of what recommend --flow-control sized; None: that (or none). route_bands:
    # a route's band by route name (routes[].band).
    flow: FlowControl | None = None
    route_bands: Mapping[str, str] = dataclasses.field(default_factory=dict)


#: The most engine replicas one gateway.yaml lists.
MAX_REPLICAS = 256


def replica_upstreams(upstream: str, replicas: int, *, field: str = "replicas") -> list[str]:
    """`replicas` engine URLs on the upstream's host: its port and the ports after it
    (http://10.0.0.5:8000, 3 -> :8000, :8001, :8002), one engine per port."""
    if not 1 <= replicas <= MAX_REPLICAS:
        raise OptionError(f"must be from 1 to {MAX_REPLICAS}, got {replicas}", field=field)
    url = parse_upstream(upstream)
    if url.port + replicas - 1 > 65535:
        raise OptionError(f"{replicas} replicas from port {url.port} run past port 65535", field=field)
    return [f"{url.scheme}://{dataclasses.replace(url, port=url.port + i).host_port}" for i in range(replicas)]


def _upstreams(rec: Recommendation, options: RenderOptions) -> list[dict]:
    """gateway.yaml's upstreams: each measured replica's own URL and budget (rec.upstreams), else
    options.replicas ports from rec.upstream, each with the one recommended budget."""
    if rec.upstreams:
        return [{"url": u.url, "block_budget": u.block_budget} for u in rec.upstreams]
    return [{"url": url, "block_budget": rec.block_budget.value}
            for url in replica_upstreams(rec.upstream, options.replicas)]


def _nginx_upstreams(rec: Recommendation, options: RenderOptions, upstreams: list[dict]) -> list[dict]:
    """nginx.conf's engine replicas: each one's upstream group, budget (its slice of it under
    --nginx-replicas) and admission limit, and where its budget came from."""
    if rec.admission.kind is PolicyKind.STATISTICAL:
        raise OptionError("nginx.conf's statistical ledger holds one engine's sequences in one worker: render "
                          "gateway.yaml for several engine replicas under admission: statistical", field="replicas")
    schemes = {parse_upstream(u["url"]).scheme for u in upstreams}
    if len(schemes) > 1:
        raise OptionError("nginx.conf proxies every engine replica with one scheme: give all of them http or all "
                          "https", field="upstreams")
    sources = [u.capacity_file for u in rec.upstreams] or ["the recommended budget, copied"] * len(upstreams)
    out = []
    for i, (u, source) in enumerate(zip(upstreams, sources, strict=True)):
        budget = u["block_budget"]
        if options.nginx_replicas != 1:
            budget = check_slice(budget, options.nginx_replicas, max_model_len=rec.max_model_len,
                                 block_size=rec.capacity.block_size)
        url = parse_upstream(u["url"])
        out.append({"name": f"kvtune_upstream_{i + 1}", "url": u["url"], "host": url.host, "port": url.port,
                    "netloc": url.netloc, "host_port": url.host_port, "engine_budget": u["block_budget"],
                    "block_budget": budget, "admit_limit": rec.admission.limit_blocks(budget),
                    "source": source if rec.upstreams else sources[i]})
    return out


def upstream_budgets(rec: Recommendation, options: RenderOptions) -> list[dict]:
    """Each engine upstream's budget as recommend shows it: url, blocks, tokens, where it came from
    (its capacity file, or the recommended budget copied), and one nginx's slice of it."""
    rows = []
    sources = [u.capacity_file for u in rec.upstreams]
    for i, u in enumerate(_upstreams(rec, options)):
        budget = u["block_budget"]
        own = rec.upstreams[i] if rec.upstreams else None
        rows.append({"url": u["url"], "block_budget": budget, "budget_tokens": budget * rec.capacity.block_size,
                     "source": sources[i] if sources else "copied (the recommended budget)",
                     "slice_blocks": budget // options.nginx_replicas,
                     # several measured replicas: its own engine limits (and with --objective its figures)
                     "max_num_seqs": own.max_num_seqs if own else None,
                     "max_num_batched_tokens": own.max_num_batched_tokens if own else None,
                     "predicted": own.predicted if own else None})
    return rows


def local_chat_tokenizer(spec: str | os.PathLike[str] | None) -> str | None:
    """The absolute model directory behind `spec` (a directory, or a file in it such as
    config.json or tokenizer.json) when it holds what `kvtune gateway` needs to count prompts
    exactly in process: tokenizer.json and a chat template (tokenizer_config.json's
    chat_template, or chat_template.jinja). None otherwise: a hub id, a preset name, a folder
    without a template."""
    if not spec:
        return None
    path = Path(spec).expanduser()
    folder = path if path.is_dir() else path.parent if path.is_file() else None
    if folder is None or not (folder / "tokenizer.json").is_file():
        return None
    try:
        _, template = read_chat_template(folder)
    except InputError:
        return None
    return str(folder.resolve()) if template is not None else None


# ---------------------------------------------------------------- environment

def _autoescape(name: str | None) -> bool:
    return name is not None and name.endswith((".html.j2", ".html", ".svg.j2"))


@functools.cache
def make_environment() -> jinja2.Environment:
    """The one environment every target renders through, built once per process: it caches the
    compiled templates (re-read when a template file changes), and compiling them was ~90 % of a
    render's CPU (0.135 s of every `recommend --out`, 0.04 s of every nginx.conf)."""
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(TEMPLATES_DIR)),
        undefined=jinja2.StrictUndefined,
        autoescape=_autoescape,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters.update(FILTERS)
    return env


# ---------------------------------------------------------------- derived view of a recommendation

def vllm_flags(rec: Recommendation) -> list[dict]:
    """The `vllm serve` flags, each with its rule and reason (kvtune.deploy.launch.vllm)."""
    return [{"flag": line.name, "value": line.value, "rule": line.rule, "reason": line.reason}
            for line in vllm.flags(rec)]


def gateway_routes(rec: Recommendation) -> list[dict]:
    """The gateway's route table (kvtune.policy.route_table) as the templates write it, each
    route with the rule and reason of its cap."""
    routes = []
    for route, decision in route_decisions(rec):
        m = route.match
        routes.append({
            "name": route.name, "path": m.path, "model": m.model, "header": m.header, "value": m.value,
            "api": None if route.api is None else route.api.value,
            "max_new_tokens": route.max_new_tokens,
            "output_histogram": None if route.output_law is None else route.output_law.to_dict(),
            "rule": decision.rule, "reason": decision.reason,
        })
    return routes


def lua_policy() -> dict:
    """The Python gateway's endpoint and field rules as plain data, for the Lua in nginx.conf:
    the path classes, the canonical-path patterns, each API's cap fields and the fields it
    refuses or passes to the chat template, and the counting constants. Rendered from the
    constants the gateway itself runs on (kvtune.gateway.endpoints, apis, counting, ledger), so
    the two enforcers cannot drift apart; only the readers' logic is written twice."""
    def caps(fields: tuple) -> list[dict]:
        return [{"key": f.key, **({"parent": f.parent} if f.parent else {})} for f in fields]

    def refused(fields: dict[str, str]) -> list[list[str]]:  # ordered: the first present one is named
        return [[key, what] for key, what in fields.items()]

    return {
        "generate": {path: api.value for path, api in endpoints.GENERATE.items()},
        "pool": {path: api.value for path, api in endpoints.POOL.items()},
        "uncountable": dict(endpoints.UNCOUNTABLE),
        "operator": dict.fromkeys(sorted(endpoints.OPERATOR), True),
        "operator_prefixes": list(endpoints.OPERATOR_PREFIXES),
        # PCRE spellings of the same regular expressions (re.fullmatch: anchored, \z not $)
        "canonical": r"\A(?:" + endpoints._CANONICAL.pattern + r")\z",
        "dot_segment": endpoints._DOT_SEGMENT.pattern,
        "max_count": apis.MAX_COUNT,
        "template_fields": list(apis.TEMPLATE_FIELDS),
        "estimate_fields": list(apis.ESTIMATE_FIELDS),
        "forcing_fields": list(apis.FORCING_FIELDS),
        "responses_forcing_fields": list(apis.RESPONSES_FORCING_FIELDS),
        "caps": {"chat": caps(apis.CHAT_CAPS), "completions": caps(apis.COMPLETION_CAPS),
                 "responses": caps(apis.RESPONSES_CAPS), "messages": caps(apis.MESSAGES_CAPS),
                 "tokens": caps(apis.TOKENS_CAPS), "any": caps(apis.ANY_CAPS)},
        "refused": {"chat": refused(apis._CHAT_REFUSED), "completions": refused(apis._COMPLETION_REFUSED),
                    "responses": refused(apis._RESPONSES_REFUSED)},
        "text_parts": dict.fromkeys(sorted(apis._TEXT_PARTS), True),
        "anthropic_fields": list(apis._ANTHROPIC_PROMPT_FIELDS),
        "score_sides": [list(pair) for pair in apis._SCORE_SIDES],
        "tokenize_concurrency": TOKENIZE_CONCURRENCY,
        "rate_window_s": RATE_WINDOW_S,
        # orjson's nesting limit, which the Python gateway reads bodies with
        "max_depth": 1024,
    }


def lua_statistical(rec: Recommendation) -> dict | None:
    """The statistical policy's epsilon and kvtune.gateway.overflow's constants for the Lua in
    nginx.conf (None for the other policies), rendered from the values the Python ledger runs on."""
    from kvtune.gateway import relay  # for one constant: relay imports aiohttp, which rendering does not need
    if rec.admission.kind is not PolicyKind.STATISTICAL:
        return None
    return {
        "epsilon": rec.admission.epsilon,
        "thetas": list(overflow.THETAS),
        "edges": [list(e) for e in overflow.interval_edges(rec.max_model_len)],
        "exact_work": overflow.EXACT_WORK,
        "first_mark": overflow.FIRST_MARK,
        "resum_every": statistical.RESUM_EVERY,
        "events_without_tokens": relay.EVENTS_WITHOUT_TOKENS,
    }


def lua_flow(flow: FlowControl | None, route_bands: Mapping[str, str], routes: list[dict]) -> dict | None:
    """gateway.yaml's `flow:` for the Lua in nginx.conf (kvtune.flow), None without one; each
    route's band is set on `routes` (a band the flow lacks is refused, as gateway.yaml's reader
    refuses it)."""
    names = {r["name"] for r in routes}
    for name, band in route_bands.items():
        if name not in names:
            raise OptionError(f"route_bands names {name!r}, which is no route")
        if flow is None or flow.band_index(band) is None:
            raise OptionError(f"route {name!r} names band {band!r}, which flow.bands lacks")
    for r in routes:
        r["band"] = route_bands.get(r["name"])
    if flow is None:
        return None
    from kvtune.gateway import relay  # aiohttp: only where a flow is rendered

    return {
        "token_time_s": flow.token_time_s,
        "bands": [{"name": b.name, "deadline_s": b.deadline_s, "reserve_blocks": b.reserve_blocks} for b in flow.bands],
        "default_band": flow.bands[flow.default_band_index].name,
        # header names as ngx.req.get_headers keys them
        "band_header": flow.band_header.lower(),
        "flow_header": flow.flow_header.lower(),
        "default_weight": flow.default_weight,
        # (flow id, weight) pairs: a flow id is no Lua name, and check's reader takes name = value only
        "weights": [[name, weight] for name, weight in flow.weights.items()],
        "max_waiting": flow.max_waiting,
        "max_waiting_per_flow": flow.max_waiting_per_flow,
        "max_flows": flow.max_flows,
        "metrics_flows": flow.metrics_flows,
        # the events of a stream that carry no token (relay.py): the tokens streamed so far
        "events_without_tokens": relay.EVENTS_WITHOUT_TOKENS,
    }


def _context(rec: Recommendation, options: RenderOptions, *, nginx: bool = True) -> dict:
    routes = gateway_routes(rec)
    gateway_flow = flow_section(rec, options)
    flow = lua_flow(gateway_flow["flow"] if gateway_flow else None, _route_bands(options, gateway_flow, routes), routes)
    upstream = parse_upstream(rec.upstream)
    report_routes = []
    for route in rec.routes:
        edges, counts, cap = list(route.output_histogram.edges), list(route.output_histogram.counts), route.cap
        report_routes.append({**route.to_dict(), "cap": cap,
                              "chart": histogram_bars(edges, counts, cap),
                              "table": histogram_bars(edges, counts, cap, max_bins=24)})
    setting_rows = [{"name": k, **d.to_dict()} for k, d in rec.settings.items() if d is not None]
    if options.retry_after_max_s < options.retry_after_min_s:
        raise OptionError("retry_after_max_s must be at least retry_after_min_s")
    admin = options.admin
    if not isinstance(admin.metrics, Access) or not isinstance(admin.ledger, Access):
        raise OptionError(f"admin access must be one of {', '.join(ADMIN_ACCESS)}")
    if admin.token_env is not None and not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", admin.token_env):
        raise OptionError(f"admin.token_env {admin.token_env!r} is not an environment variable name")
    if Access.TOKEN in (admin.metrics, admin.ledger) and admin.token_env is None:
        raise OptionError("admin access 'token' needs admin.token_env, the variable that holds the token")
    max_model_len = rec.max_model_len
    limits = options.limits or ClientLimits(max_body_bytes=default_max_body_bytes(max_model_len))
    nginx_budget = rec.budget_blocks
    if options.nginx_replicas != 1 and nginx:
        nginx_budget = check_slice(rec.budget_blocks, options.nginx_replicas, max_model_len=max_model_len,
                                   block_size=rec.capacity.block_size)
    lua_config = {
        "block_size": rec.capacity.block_size,
        "block_budget": nginx_budget,
        "policy": rec.admission.name,
        "factor": rec.admission.factor,
        "admit_limit": rec.admission.limit_blocks(nginx_budget),
        "max_model_len": max_model_len,
        "retry_after_min_s": options.retry_after_min_s,
        "retry_after_max_s": options.retry_after_max_s,
        "estimate_chars_per_token": options.estimate_chars_per_token,
        "estimate_margin_tokens": options.estimate_margin_tokens,
        "pair_tokens": DEFAULT_PAIR_TOKENS,
        "max_body_bytes": limits.max_body_bytes,
        "body_deadline_s": limits.body_deadline_s,
        "passthrough": list(options.passthrough),
        "ledger_access": options.admin.ledger.value,
        "refusal_detail": options.admin.refusal_detail.value,
        "budget_full": BUDGET_FULL,
        "never_fits": NEVER_FITS,
        "token_env": options.admin.token_env,
        "statistical": lua_statistical(rec),
        "flow": flow,
        "metrics_access": options.admin.metrics.value,
    }
    nginx_slice = None
    if options.nginx_replicas != 1:
        nginx_slice = {"replicas": options.nginx_replicas, "engine_budget": rec.budget_blocks, "slice": nginx_budget,
                       "total": nginx_budget * options.nginx_replicas}
    upstreams = _upstreams(rec, options)
    nginx_upstreams = _nginx_upstreams(rec, options, upstreams) if nginx and len(upstreams) > 1 else None
    if nginx_upstreams:
        largest = max(nginx_upstreams, key=lambda u: u["admit_limit"])
        lua_config["block_budget"], lua_config["admit_limit"] = largest["block_budget"], largest["admit_limit"]
    return {
        "rec": rec,
        "options": options,
        "kvtune_version": __version__,
        "upstream": upstream,
        "engine_title": ENGINE_TITLES[rec.engine.name],
        "hardware_title": hardware_title(rec, options),
        "served_model": rec.served_model or rec.model,
        "served_model_decision": rec.settings.get("served_model"),  # where the id came from (None: older files)
        "routes": routes,
        # the header routes match on (one per recommendation: the --route-header), for the notes
        "route_header": next((r["header"] for r in routes if r["header"] is not None), None),
        "upstreams": upstreams,
        "queue": {"max_waiting": rec.settings.get("gateway_queue_max_waiting"),
                  "timeout_s": rec.settings.get("gateway_queue_timeout_s")},
        # gateway.yaml `flow:` (recommend --flow-control), which replaces `queue:`; None: the FIFO queue
        "flow": gateway_flow,
        "report_routes": report_routes,
        "settings_rows": setting_rows,
        "segments": capacity_segments(rec),
        "what_if": _what_if(rec),
        "lua_config": lua_config,
        "nginx_slice": nginx_slice,
        "nginx_upstreams": nginx_upstreams,
        "health": _health(options.health),
        "policy": lua_policy(),
        # gateway.yaml leaves these at the Python gateway's defaults; nginx.conf takes the same
        "upstream_timeouts": {name: f.default for f in dataclasses.fields(GatewayConfig)
                              if (name := f.name) in ("upstream_connect_timeout_s", "upstream_read_timeout_s")},
        "limits": limits,
        "config_begin": NGINX_CONFIG_BEGIN,
        "config_end": NGINX_CONFIG_END,
    }


def _route_bands(options: RenderOptions, gateway_flow: dict | None, routes: list[dict]) -> Mapping[str, str]:
    """RenderOptions.route_bands; without them, a route named like a band of the flow is in that
    band (what recommend sized the reserve on: docs/guides/flow-control.md, The reserve)."""
    if options.route_bands or gateway_flow is None:
        return options.route_bands
    flow: FlowControl = gateway_flow["flow"]
    return {r["name"]: r["name"] for r in routes if flow.band_index(r["name"]) is not None}


def flow_section(rec: Recommendation, options: RenderOptions | None = None) -> dict | None:
    """The rendered `flow:` and the Decisions behind it (for the comments); None without it.
    RenderOptions.flow, when given, is rendered instead (no decisions), in gateway.yaml and
    nginx.conf alike."""
    if options is not None and options.flow is not None:
        return {"section": options.flow.to_dict(), "decisions": [], "flow": options.flow}
    flow = flow_control_of(rec)
    if flow is None:
        return None
    decisions = [d for k in (*FLOW_SETTINGS, FLOW_RESERVE_SETTING) if (d := rec.settings.get(k)) is not None]
    return {"section": flow.to_dict(), "decisions": decisions, "flow": flow}


def _health(probe: HealthProbe) -> dict:
    """The health probe as both gateways' files write it, and whether it is gateway.yaml's default
    (then gateway.yaml leaves it out). Held to gateway.yaml's own bounds, which parse it back."""
    if not (probe.interval_s >= 0.05 and probe.timeout_s >= 0.01):
        raise OptionError("the health probe's interval_s must be at least 0.05 and timeout_s at least 0.01",
                          field="health")
    if canonical_path(probe.path) != probe.path or "?" in probe.path:
        raise OptionError(f"{probe.path!r} is not a plain request path", field="health.path")
    if not (probe.consecutive_failures >= 0 and 0.01 <= probe.ejection_s <= probe.max_ejection_s
            and 0.0 <= probe.max_ejected_share <= 1.0):
        raise OptionError("passive health needs consecutive_failures ≥ 0, 0.01 ≤ ejection_s ≤ max_ejection_s "
                          "and max_ejected_share in [0, 1]", field="health")
    return {"interval_s": probe.interval_s, "timeout_s": probe.timeout_s, "path": probe.path,
            "consecutive_failures": probe.consecutive_failures, "ejection_s": probe.ejection_s,
            "max_ejection_s": probe.max_ejection_s, "max_ejected_share": probe.max_ejected_share,
            "default": probe == HealthProbe()}


def _what_if(rec: Recommendation) -> dict | None:
    """The report's what-if section (`recommend --objective`), or None."""
    if rec.what_if is None or rec.objective is None:
        return None

    chosen = rec.chosen
    return {"headline": headline(rec.what_if, rec.objective), "objective": objective_line(rec.objective),
            "rows": table_cells(rec.what_if), "note": TABLE_NOTE, "goodput": rec.objective.slo is not None,
            "why": chosen.why if chosen is not None else "",
            "replicas": replica_cells(chosen) if chosen is not None else [],
            "plot": _what_if_plot(rec)}


def _what_if_plot(rec: Recommendation) -> dict:
    """The what-if rows as marks: output tokens/s against TTFT p99 (against goodput when that is
    the objective), the chosen row and direct-to-vLLM labelled, infeasible rows greyed with why."""
    assert rec.what_if is not None and rec.objective is not None
    goodput = rec.objective.goal is Goal.GOODPUT
    points = []
    for cells, row in zip(table_cells(rec.what_if), rec.what_if, strict=True):
        p = row.predicted
        direct = row.policy.kind is WhatIfKind.DIRECT
        kind = ("chosen" if row.chosen else "infeasible" if row.violations else "direct" if direct
                else "reference" if row.reference else "ok")
        tag = f"chosen (#{cells['index']})" if row.chosen else f"direct to vLLM (#{cells['index']})" if direct else None
        ttft = "—" if p.ttft_p99_ms is None else f"{p.ttft_p99_ms:,.0f} ms"
        good = "" if p.goodput_rps is None else f", goodput {p.goodput_rps:,.2f} req/s"
        points.append({"index": cells["index"], "x": p.goodput_rps if goodput else p.ttft_p99_ms,
                       "y": p.output_tokens_per_s, "kind": kind, "tag": tag, "label": row.label,
                       "reason": "; ".join(v.text for v in row.violations),
                       "title": f"#{cells['index']} {row.label}: {p.output_tokens_per_s:,.1f} output tok/s, "
                                f"TTFT p99 {ttft}{good} — {cells['verdict']}"})
    x_label = "goodput (requests/s within --slo)" if goodput else "TTFT p99 (ms)"
    plot = what_if_scatter(points, x_label=x_label, y_label="output tokens/s")
    plot["greyed"] = [p for p in points if p["kind"] == "infeasible"]
    return plot


def default_targets(rec: Recommendation, options: RenderOptions | None = None) -> list[str]:
    """What `recommend` writes for the recommendation's engine: its launch files, then the rest.
    nginx.conf counts prompts with the engine's /tokenize, so it is left out for an engine
    without one (TensorRT-LLM), and is left out for several replicas under admission: statistical
    (NGINX_ONE_ENGINE)."""
    replicas = max(1 if options is None else options.replicas, len(rec.upstreams))
    nginx = engine_facts(rec.engine.name).HAS_TOKENIZE and (replicas == 1
                                                            or rec.admission.kind is not PolicyKind.STATISTICAL)
    return [*launcher(rec.engine.name).FILES, *(t for t in COMMON_TARGETS if nginx or t != "nginx.conf")]


#: Why nginx.conf is not rendered for several engine replicas under admission: statistical.
NGINX_ONE_ENGINE = ("under admission: statistical nginx.conf's Lua ledger holds one engine's sequences in one "
                    "worker: render gateway.yaml for several replicas (one budget each), or one nginx.conf per "
                    "engine, each without --replicas and with --upstream of its own engine")


def gateway_counting(rec: Recommendation, options: RenderOptions) -> RenderOptions:
    """A gateway for an engine without /tokenize counts prompts itself: gateway.yaml in process with
    the tokenizer given, else the served model's by its hub id (`kvtune gateway` loads it at start
    from the Hugging Face cache), so the engine's files never wait on a tokenizer directory."""
    if engine_facts(rec.engine.name).HAS_TOKENIZE or options.gateway_tokenizer is not None:
        return options
    return dataclasses.replace(options, gateway_tokenizer=rec.served_model or rec.model)


def _counting(rec: Recommendation, wanted: list[str], options: RenderOptions) -> None:
    """nginx.conf for an engine without /tokenize counts only by the estimate it was asked for."""
    if engine_facts(rec.engine.name).HAS_TOKENIZE:
        return
    title = ENGINE_TITLES[rec.engine.name]
    if "nginx.conf" in wanted and options.estimate_chars_per_token is None:
        raise OptionError(f"{title}'s server has no /tokenize and nginx.conf cannot run a tokenizer: render "
                          "gateway.yaml instead, or ask nginx.conf for an estimate (estimate_chars_per_token)",
                          field="targets")


def render_files(rec: Recommendation, *, targets: Iterable[str] | None = None,
                 options: RenderOptions | None = None) -> dict[str, str]:
    """Render the recommendation into file name → text for each requested target (default: the
    engine's launch files and every common one)."""
    options = options or RenderOptions()
    wanted = default_targets(rec, options) if targets is None else list(targets)
    unknown = [t for t in wanted if t not in TARGETS]
    if unknown:
        raise UnknownNameError(f"unknown render target {unknown[0]!r} (known: {', '.join(TARGETS)})")
    other = [t for t in wanted if LAUNCH_TARGETS.get(t, rec.engine.name) != rec.engine.name]
    if other:
        raise OptionError(f"{other[0]} launches {ENGINE_TITLES[LAUNCH_TARGETS[other[0]]]}, but the recommendation "
                          f"is for {ENGINE_TITLES[rec.engine.name]}", field="targets")
    options = gateway_counting(rec, options)
    _counting(rec, wanted, options)
    env = make_environment()
    context = _context(rec, options, nginx="nginx.conf" in wanted)
    launch = launcher(rec.engine.name)
    reports = any(t in REPORT_TARGETS for t in wanted)
    launch_files = launch.render(rec, env, context) if reports or any(t in launch.FILES for t in wanted) else {}
    context["launch_commands"] = [{"file": name, "text": command, "fence": code_fence(command)}
                                  for name, text in launch_files.items() for command in [launch_command(text)]]
    files: dict[str, str] = {}
    for name in wanted:
        if name in launch_files:
            files[name] = launch_files[name]
        elif name == "recommendation.json":
            files[name] = rec.to_json()
        else:
            files[name] = env.get_template(TARGETS[name]).render(context)
    return files


def render_gateway_yaml(rec: Recommendation, options: RenderOptions, upstream_urls: list[str]) -> str:
    """gateway.yaml for a gateway that reaches the engines at other addresses than the
    recommendation's upstreams (the Kubernetes Services of kvtune.deploy.k8s): the same file,
    each upstream's URL replaced in order, its budget kept."""
    options = gateway_counting(rec, options)
    upstreams = _upstreams(rec, options)
    if len(upstream_urls) != len(upstreams):
        raise OptionError(f"{len(upstream_urls)} upstream URLs for {len(upstreams)} engine replicas", field="upstreams")
    context = _context(dataclasses.replace(rec, upstream=upstream_urls[0]), options, nginx=False)
    context["upstreams"] = [{**u, "url": url} for u, url in zip(upstreams, upstream_urls, strict=True)]
    return make_environment().get_template(TARGETS["gateway.yaml"]).render(context)


REPORT_TARGETS = ("report.html", "report.md")  # they show the launch commands rendered beside them


def launch_command(text: str) -> str:
    """What a rendered launch file runs, as the report shows it: a script without its shebang,
    comment header and `set` line (the command itself); any other file (YAML options) whole."""
    lines = text.splitlines()
    if not lines or not lines[0].startswith("#!"):
        return text.strip()
    body = [line for line in lines if not line.startswith("#") and not line.startswith("set -")]
    return "\n".join(body).strip()


def code_fence(text: str) -> str:
    """A Markdown code fence longer than any run of backticks in `text`, so it cannot end early."""
    longest = max((len(run) for run in re.findall(r"`+", text)), default=0)
    return "`" * max(3, longest + 1)


def hardware_title(rec: Recommendation, options: RenderOptions) -> str:
    """What the deployment runs on, as the report titles it: "3 replicas × L40S × 1" (GPUs per replica)."""
    gpus = rec.hardware.tensor_parallel_size * rec.hardware.pipeline_parallel_size
    one = f"{rec.hardware.gpu or 'the given GPU memory'} × {gpus}"
    replicas = max(options.replicas, len(rec.upstreams))
    return f"{replicas} replicas × {one}" if replicas > 1 else one


def lua_modules() -> dict[str, str]:
    """The gateway's Lua modules as nginx.conf loads them: relative path under nginx's prefix
    (lua/kvtune/gateway.lua, ...) -> text, from the installed package."""
    return {f"{LUA_FOLDER}/{path.relative_to(LUA_DIR).as_posix()}": path.read_text(encoding="utf-8")
            for path in sorted(LUA_DIR.rglob("*.lua"))}


#: The one folder `recommend --out` writes files into (kvtune.deploy.k8s: the Kubernetes manifests).
SUBFOLDERS = (K8S_FOLDER,)


def _plain_name(name: str) -> bool:
    """A plain file name, or one in a folder of SUBFOLDERS (k8s/vllm.yaml)."""
    folder, _, rest = name.rpartition("/")
    if folder and folder not in SUBFOLDERS:
        return False
    return Path(rest).name == rest and rest not in ("", ".", "..")


def write_files(out_dir: str | os.PathLike[str], files: Mapping[str, str]) -> list[Path]:
    """Write every file into out_dir or none (kvtune.writer: targets checked first, staged,
    replaced together, put back if a rename fails); names must be plain file names. An
    nginx.conf brings the Lua modules it loads (lua_modules), so the folder deploys whole."""
    target = Path(out_dir)
    for name in files:
        if not _plain_name(name):
            raise OptionError(f"refusing to write {name!r}: not a plain file name")
    modules = lua_modules() if "nginx.conf" in files else {}
    return write_all({target / name: text for name, text in {**files, **modules}.items()},
                     executable=[target / name for name in files if name in EXECUTABLE])


__all__ = [
    "RenderOptions", "TARGETS", "COMMON_TARGETS", "LAUNCH_TARGETS", "default_targets", "render_files",
    "write_files", "lua_modules", "make_environment", "local_chat_tokenizer",
    "vllm_flags", "upstream_budgets", "gateway_routes", "replica_upstreams", "NGINX_ONE_ENGINE",
    "MAX_REPLICAS", "render_gateway_yaml", "SUBFOLDERS",
]
