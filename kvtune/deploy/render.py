"""Turn a recommendation (kvtune.policy.recommendation.Recommendation) into files that deploy.

Every template renders through one jinja2 environment with StrictUndefined, so a missing field
fails loudly instead of rendering an empty flag. Anything that came from logs (route names, model
ids) reaches a target only through that target's escaping filter: `shell`, `yaml`, `json`, `lua`,
`md`, and HTML autoescape. Comments are squeezed to one printable line by `one_line`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import shlex
import unicodedata
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Mapping
from urllib.parse import urlsplit

import jinja2

from kvtune import __version__
from kvtune.errors import InputError, KvtuneError
from kvtune.gateway.endpoints import DEFAULT_PASSTHROUGH, GENERATE
from kvtune.gateway.config import (
    ADMIN_ACCESS, DEFAULT_PAIR_TOKENS, AdminAccess, ClientLimits, GatewayConfig, default_max_body_bytes,
)
from kvtune.userfiles import brief

if TYPE_CHECKING:
    from kvtune.policy.recommendation import Recommendation

TEMPLATES_DIR = Path(__file__).parent / "templates"
# output file name -> template name
TARGETS: dict[str, str] = {
    "vllm-serve.sh": "vllm-serve.sh.j2",
    "gateway.yaml": "gateway.yaml.j2",
    "nginx.conf": "nginx.conf.j2",
    "recommendation.json": "",  # json.dumps, no template
    "report.html": "report.html.j2",
    "report.md": "report.md.j2",
}
EXECUTABLE = frozenset({"vllm-serve.sh"})
# Markers around the Lua table that `kvtune check` reads back from a rendered nginx.conf.
NGINX_CONFIG_BEGIN = "-- kvtune:config begin"
NGINX_CONFIG_END = "-- kvtune:config end"
CATCH_ALL_ROUTE = "default"
# Characters YAML 1.1 (PyYAML) or a shell/nginx comment would treat as a line break.
_LINE_BREAKS = "\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"
_HOSTNAME = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9]([A-Za-z0-9.-]{0,251}[A-Za-z0-9])?)$")


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


def local_chat_tokenizer(spec: str | os.PathLike[str] | None) -> str | None:
    """The absolute model directory behind `spec` (a directory, or a file in it such as
    config.json or tokenizer.json) when it holds what `kvtune gateway` needs to count prompts
    exactly in process: tokenizer.json and a chat template (tokenizer_config.json's
    chat_template, or chat_template.jinja). None otherwise: a hub id, a preset name, a folder
    without a template."""
    from kvtune.ingest.tokenize import read_chat_template  # what the gateway itself will read

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


# ---------------------------------------------------------------- filters (one per target)

def one_line(value: Any) -> str:
    """Any text as one printable line: line breaks and other control or format characters become
    spaces, so a comment in a shell script, YAML or nginx.conf cannot end early."""
    text = "" if value is None else str(value)
    out = []
    for ch in text:
        if ch in _LINE_BREAKS or unicodedata.category(ch)[0] == "C":
            out.append(" ")
        else:
            out.append(ch)
    return " ".join("".join(out).split())


def shell_quote(value: Any) -> str:
    """One shell word, single-quoted unless plainly safe: no expansion or substitution survives."""
    return shlex.quote(str(value))


def json_scalar(value: Any) -> str:
    """A JSON value in pure ASCII (also a valid YAML flow scalar)."""
    return json.dumps(value, ensure_ascii=True)


def yaml_scalar(value: Any) -> str:
    """A YAML scalar that reads back exactly: strings double-quoted in pure ASCII with \\u/\\U
    escapes (JSON's surrogate pairs would not round-trip through PyYAML), numbers as JSON."""
    if not isinstance(value, str):
        return json.dumps(value)
    out = ['"']
    for ch in value:
        code = ord(ch)
        if ch in '"\\':
            out.append("\\" + ch)
        elif 0x20 <= code < 0x7F:
            out.append(ch)
        elif code < 0x10000:
            out.append(f"\\u{code:04x}")
        else:
            out.append(f"\\U{code:08x}")
    out.append('"')
    return "".join(out)


_LUA_PLAIN = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789 _-./:,+=@")


def lua_string(value: Any) -> str:
    """A Lua string literal for any text: every byte outside a small safe set becomes a 3-digit
    decimal escape, so quotes, backslashes, newlines, `]]`, braces and `$` never reach the Lua or
    nginx lexers as themselves. Non-string values render as Lua literals: mappings as tables
    keyed `[key] = value`, sequences (sets sorted) as lists."""
    if value is None:
        return "nil"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"cannot render {value!r} as a Lua number")
        return repr(value)
    if isinstance(value, Mapping):
        return "{ " + ", ".join(f"[{lua_string(k)}] = {lua_string(v)}" for k, v in value.items()) + " }"
    if isinstance(value, (list, tuple, frozenset, set)):
        items = sorted(value) if isinstance(value, (frozenset, set)) else value
        return "{ " + ", ".join(lua_string(v) for v in items) + " }"
    data = str(value).encode("utf-8", "surrogateescape")
    return '"' + "".join(chr(b) if b in _LUA_PLAIN else f"\\{b:03d}" for b in data) + '"'


_NGINX_UNSAFE = re.compile(r'[\x00-\x1f\x7f"\\$]')


def nginx_word(value: Any) -> str:
    """An operator-given path or name as one double-quoted nginx token; the characters nginx would
    still interpret inside quotes (quote, backslash, `$`, control characters) are refused."""
    text = str(value)
    if not text or _NGINX_UNSAFE.search(text):
        raise KvtuneError(f"{brief(text)} cannot be used in nginx.conf: no quotes, backslashes, $ or control "
                          "characters")
    return f'"{text}"'


def nginx_time(seconds: Any) -> str:
    """A duration for an nginx time directive: whole seconds, else milliseconds (nginx takes no
    fractions)."""
    value = float(seconds)
    if not math.isfinite(value) or value < 0:
        raise KvtuneError(f"{seconds!r} is not a duration nginx can take")
    ms = round(value * 1000)
    return f"{ms // 1000}s" if ms % 1000 == 0 else f"{ms}ms"


def nginx_listen(value: Any) -> str:
    """host:port for `listen`, validated."""
    host, _, port = str(value).rpartition(":")
    if not _HOSTNAME.match(host) or not port.isdigit() or not 0 < int(port) < 65536:
        raise KvtuneError(f"cannot listen on {brief(value)}: expected host:port")
    return f"{host}:{int(port)}"


_MD_SPECIAL = re.compile(r"([\\`*_\[\]<>|#!~{}])")


def md_cell(value: Any) -> str:
    """Text safe in a Markdown table cell: one line, pipes/backticks/brackets/HTML escaped."""
    text = one_line(value).replace("&", "&amp;")
    return _MD_SPECIAL.sub(r"\\\1", text)


def human_number(value: Any, digits: int = 3) -> str:
    """1234567 → '1,234,567'; 0.123456 → '0.123'; 5.77 → '5.77'."""
    if value is None:
        return "–"
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, int) or (isinstance(value, float) and value.is_integer() and abs(value) >= 1000):
        return f"{int(value):,}"
    if isinstance(value, float):
        if value == 0:
            return "0"
        magnitude = math.floor(math.log10(abs(value)))
        decimals = max(0, digits - 1 - magnitude)
        return f"{value:,.{decimals}f}"
    return str(value)


def human_bytes(value: Any) -> str:
    """Bytes in binary units: 16060522496 → '14.96 GiB'."""
    if value is None:
        return "–"
    size = float(value)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(size) < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.2f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def percent(value: Any, decimals: int = 1) -> str:
    if value is None:
        return "–"
    return f"{float(value) * 100:.{decimals}f}%"


# ---------------------------------------------------------------- environment

def _autoescape(name: str | None) -> bool:
    return bool(name) and name.endswith((".html.j2", ".html", ".svg.j2"))


def make_environment() -> jinja2.Environment:
    """The one environment every target renders through."""
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(TEMPLATES_DIR)),
        undefined=jinja2.StrictUndefined,
        autoescape=_autoescape,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters.update(
        shell=shell_quote, json=json_scalar, nginx=nginx_word, nginx_listen=nginx_listen, nginx_time=nginx_time, yaml=yaml_scalar, lua=lua_string, md=md_cell,
        one_line=one_line, human=human_number, bytes=human_bytes, percent=percent,
    )
    return env


# ---------------------------------------------------------------- derived view of a recommendation

@dataclass(frozen=True, slots=True)
class Upstream:
    scheme: str
    host: str
    port: int

    @property
    def host_port(self) -> str:
        return f"{self.host}:{self.port}"


def parse_upstream(url: str) -> Upstream:
    """http(s)://host[:port][/]; anything else would be interpolated into nginx.conf, so refuse it."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise InputError(f"not a valid upstream URL: {url!r}", field="upstream") from exc
    host = parts.hostname or ""
    if parts.scheme not in ("http", "https") or not host or parts.path not in ("", "/") \
            or parts.query or parts.fragment or parts.username or parts.password:
        raise InputError(f"upstream must look like http://host:port, got {url!r}", field="upstream")
    if ":" in host:
        host = f"[{host}]"
    if not _HOSTNAME.match(host):
        raise InputError(f"upstream host {host!r} is not a hostname or IP address", field="upstream")
    return Upstream(parts.scheme, host, port or (443 if parts.scheme == "https" else 80))


def vllm_flags(rec: Recommendation) -> list[dict]:
    """The `vllm serve` flags for the recommendation's engine version, each with its rule and
    reason. V1 (0.8+) has no --preemption-mode/--swap-space, so they render only on V0."""
    upstream = parse_upstream(rec.upstream)
    flags: list[dict] = [
        {"flag": "--host", "value": upstream.host.strip("[]"), "rule": "upstream",
         "reason": f"the gateway's upstream is {rec.upstream}"},
        {"flag": "--port", "value": upstream.port, "rule": "upstream",
         "reason": f"the gateway's upstream is {rec.upstream}"},
    ]
    order = [
        ("tensor_parallel_size", "--tensor-parallel-size"),
        ("pipeline_parallel_size", "--pipeline-parallel-size"),
        ("max_model_len", "--max-model-len"),
        ("max_num_seqs", "--max-num-seqs"),
        ("max_num_batched_tokens", "--max-num-batched-tokens"),
        ("gpu_memory_utilization", "--gpu-memory-utilization"),
        ("kv_cache_memory_bytes", "--kv-cache-memory-bytes"),
        ("kv_cache_dtype", "--kv-cache-dtype"),
        ("block_size", "--block-size"),
    ]
    if not rec.engine.v1:
        order += [("preemption_mode", "--preemption-mode"), ("swap_space", "--swap-space")]
    for key, flag in order:
        decision = rec.settings.get(key)
        if decision is None or decision.value is None:
            continue
        flags.append({"flag": flag, "value": decision.value, "rule": decision.rule, "reason": decision.reason})
    backstop = rec.setting("max_new_tokens_backstop")
    flags.append({
        "flag": "--override-generation-config",
        "value": json.dumps({"max_new_tokens": backstop.tokens}),
        "rule": backstop.rule, "reason": backstop.reason,
    })
    return flags


def gateway_routes(rec: Recommendation) -> list[dict]:
    """The gateway's route table: one route per recommended route, in order, then a catch-all
    capped at the backstop so no request is ever uncapped."""
    routes = []
    for route in rec.routes:
        if route.match is None:
            continue  # routes from a field no gateway sees: the catch-all below serves them
        path = route.match.path or None
        routes.append({
            "name": str(route.route) or "(unnamed)",
            "path": path,
            "model": route.match.model or None,
            # a path that is no vLLM endpoint: gateway.yaml says how its requests are read
            "api": "any" if path is not None and path not in GENERATE else None,
            "max_new_tokens": route.cap,
            "rule": route.max_new_tokens.rule,
            "reason": route.max_new_tokens.reason,
        })
    backstop = rec.setting("max_new_tokens_backstop")
    routes.append({"name": CATCH_ALL_ROUTE, "path": None, "model": None, "api": None,
                   "max_new_tokens": backstop.tokens,
                   "rule": backstop.rule, "reason": "catch-all: " + backstop.reason})
    return routes


def coarsen_histogram(edges: list, counts: list, max_bins: int) -> tuple[list, list]:
    """Merge runs of adjacent bins so at most `max_bins` remain (a context-wide histogram of
    16-token bins has hundreds); trailing empty bins are dropped first."""
    if len(edges) != len(counts) + 1:
        return list(edges), list(counts)
    last = max((i for i, c in enumerate(counts) if c), default=-1)
    edges, counts = list(edges[: last + 2]), list(counts[: last + 1])
    group = max(1, math.ceil(len(counts) / max_bins))
    if group == 1:
        return edges, counts
    new_edges = edges[::group]
    if new_edges[-1] != edges[-1]:
        new_edges.append(edges[-1])
    new_counts = [sum(counts[i:i + group]) for i in range(0, len(counts), group)]
    return new_edges, new_counts


def histogram_bars(edges: list, counts: list, cap: int | None, *, width: int = 560,
                   height: int = 140, max_bins: int = 80) -> dict:
    """Geometry of one inline SVG bar chart of output lengths with the cap marked as a line."""
    edges, counts = coarsen_histogram(edges, counts, max_bins)
    if not counts or len(edges) != len(counts) + 1:
        return {"width": width, "height": height, "bars": [], "cap_x": None, "max_edge": 0}
    lo, hi = float(edges[0]), float(edges[-1])
    span = max(hi - lo, 1.0)
    peak = max(max(counts), 1)
    plot_h = height - 20
    bars = []
    for i, count in enumerate(counts):
        x0 = (float(edges[i]) - lo) / span * width
        x1 = (float(edges[i + 1]) - lo) / span * width
        h = count / peak * plot_h
        bars.append({"x": round(x0, 2), "w": round(max(x1 - x0 - 0.5, 0.5), 2),
                     "y": round(plot_h - h, 2), "h": round(h, 2), "count": count,
                     "lo": edges[i], "hi": edges[i + 1], "above_cap": cap is not None and edges[i] >= cap})
    cap_x = None
    if cap is not None:
        cap_x = round(min(max((cap - lo) / span, 0.0), 1.0) * width, 2)
    return {"width": width, "height": height, "plot_h": plot_h, "bars": bars, "cap_x": cap_x,
            "min_edge": edges[0], "max_edge": edges[-1]}


def capacity_segments(rec: Recommendation) -> list[dict]:
    """Weights, overhead, KV and what is left, as shares of the GPUs' total memory."""
    cap, hw = rec.capacity, rec.hardware
    total = hw.gpu_memory_bytes * hw.gpus if hw.gpu_memory_bytes else None
    parts = [("weights", cap.weights_bytes), ("overhead", cap.overhead_bytes), ("KV cache", cap.kv_cache_bytes)]
    known = sum(int(v) for _, v in parts if v)
    denominator = max(total or 0, known, 1)
    segments: list[dict] = [{"name": n, "bytes": int(v), "share": int(v) / denominator} for n, v in parts if v]
    if total and total > known:
        segments.append({"name": "unused", "bytes": total - known, "share": (total - known) / denominator})
    x = 0.0
    for seg in segments:
        seg["x"] = round(x * 100, 3)
        seg["w"] = round(seg["share"] * 100, 3)
        x += seg["share"]
    return segments


def lua_policy() -> dict:
    """The Python gateway's endpoint and field rules as plain data, for the Lua in nginx.conf:
    the path classes, the canonical-path patterns, each API's cap fields and the fields it
    refuses or passes to the chat template, and the counting constants. Rendered from the
    constants the gateway itself runs on (kvtune.gateway.endpoints, apis, counting, ledger), so
    the two enforcers cannot drift apart; only the readers' logic is written twice."""
    from kvtune.gateway import apis, endpoints
    from kvtune.gateway.counting import TOKENIZE_CONCURRENCY
    from kvtune.gateway.ledger import RATE_WINDOW_S

    def caps(fields: tuple) -> list[dict]:
        return [{"key": f.key, **({"parent": f.parent} if f.parent else {})} for f in fields]

    def refused(fields: dict[str, str]) -> list[list[str]]:  # ordered: the first present one is named
        return [[key, what] for key, what in fields.items()]

    return {
        "generate": {path: api.value for path, api in endpoints.GENERATE.items()},
        "pool": {path: api.value for path, api in endpoints.POOL.items()},
        "uncountable": dict(endpoints.UNCOUNTABLE),
        "operator": {path: True for path in sorted(endpoints.OPERATOR)},
        # PCRE spellings of the same regular expressions (re.fullmatch: anchored, \z not $)
        "canonical": r"\A(?:" + endpoints._CANONICAL.pattern + r")\z",
        "dot_segment": endpoints._DOT_SEGMENT.pattern,
        "max_count": apis.MAX_COUNT,
        "template_fields": list(apis.TEMPLATE_FIELDS),
        "estimate_fields": list(apis.ESTIMATE_FIELDS),
        "caps": {"chat": caps(apis.CHAT_CAPS), "completions": caps(apis.COMPLETION_CAPS),
                 "responses": caps(apis.RESPONSES_CAPS), "messages": caps(apis.MESSAGES_CAPS),
                 "tokens": caps(apis.TOKENS_CAPS), "any": caps(apis.ANY_CAPS)},
        "refused": {"chat": refused(apis._CHAT_REFUSED), "completions": refused(apis._COMPLETION_REFUSED),
                    "responses": refused(apis._RESPONSES_REFUSED)},
        "text_parts": {kind: True for kind in sorted(apis._TEXT_PARTS)},
        "anthropic_fields": list(apis._ANTHROPIC_PROMPT_FIELDS),
        "score_sides": [list(pair) for pair in apis._SCORE_SIDES],
        "tokenize_concurrency": TOKENIZE_CONCURRENCY,
        "rate_window_s": RATE_WINDOW_S,
        # orjson's nesting limit, which the Python gateway reads bodies with
        "max_depth": 1024,
    }


def _context(rec: Recommendation, options: RenderOptions) -> dict:
    routes = gateway_routes(rec)
    upstream = parse_upstream(rec.upstream)
    report_routes = []
    for route in rec.routes:
        edges, counts, cap = list(route.output_histogram.edges), list(route.output_histogram.counts), route.cap
        report_routes.append({**route.to_dict(), "cap": cap,
                              "chart": histogram_bars(edges, counts, cap),
                              "table": histogram_bars(edges, counts, cap, max_bins=24)})
    setting_rows = [{"name": k, **d.to_dict()} for k, d in rec.settings.items() if d is not None]
    max_model_len = rec.max_model_len
    limits = options.limits or ClientLimits(max_body_bytes=default_max_body_bytes(max_model_len))
    lua_config = {
        "block_size": rec.capacity.block_size,
        "block_budget": rec.budget_blocks,
        "max_model_len": max_model_len,
        "retry_after_min_s": options.retry_after_min_s,
        "retry_after_max_s": options.retry_after_max_s,
        "estimate_chars_per_token": options.estimate_chars_per_token,
        "estimate_margin_tokens": options.estimate_margin_tokens,
        "pair_tokens": DEFAULT_PAIR_TOKENS,
        "max_body_bytes": limits.max_body_bytes,
        "passthrough": list(options.passthrough),
        "ledger_access": options.admin.ledger,
        "token_env": options.admin.token_env,
    }
    if options.retry_after_max_s < options.retry_after_min_s:
        raise KvtuneError("retry_after_max_s must be at least retry_after_min_s")
    admin = options.admin
    if admin.metrics not in ADMIN_ACCESS or admin.ledger not in ADMIN_ACCESS:
        raise KvtuneError(f"admin access must be one of {', '.join(ADMIN_ACCESS)}")
    if admin.token_env is not None and not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", admin.token_env):
        raise KvtuneError(f"admin.token_env {admin.token_env!r} is not an environment variable name")
    if "token" in (admin.metrics, admin.ledger) and admin.token_env is None:
        raise KvtuneError("admin access 'token' needs admin.token_env, the variable that holds the token")
    return {
        "rec": rec,
        "options": options,
        "kvtune_version": __version__,
        "upstream": upstream,
        "flags": vllm_flags(rec),
        "served_model": rec.served_model or rec.model,
        "routes": routes,
        "report_routes": report_routes,
        "settings_rows": setting_rows,
        "segments": capacity_segments(rec),
        "lua_config": lua_config,
        "policy": lua_policy(),
        # gateway.yaml leaves these at the Python gateway's defaults; nginx.conf takes the same
        "upstream_timeouts": {name: f.default for f in dataclasses.fields(GatewayConfig)
                              if (name := f.name) in ("upstream_connect_timeout_s", "upstream_read_timeout_s")},
        "limits": limits,
        "config_begin": NGINX_CONFIG_BEGIN,
        "config_end": NGINX_CONFIG_END,
    }


def render_files(rec: Recommendation, *, targets: Iterable[str] | None = None,
                 options: RenderOptions | None = None) -> dict[str, str]:
    """Render the recommendation into file name → text for each requested target."""
    wanted = list(TARGETS) if targets is None else list(targets)
    unknown = [t for t in wanted if t not in TARGETS]
    if unknown:
        raise KvtuneError(f"unknown render target {unknown[0]!r} (known: {', '.join(TARGETS)})")
    options = options or RenderOptions()
    env = make_environment()
    context = _context(rec, options)
    files: dict[str, str] = {}
    for name in wanted:
        if name == "recommendation.json":
            files[name] = rec.to_json()
            continue
        files[name] = env.get_template(TARGETS[name]).render(context)
    return files


def write_files(out_dir: str | os.PathLike[str], files: Mapping[str, str]) -> list[Path]:
    """Write every file into out_dir or none (kvtune.writer: targets checked first, staged,
    replaced together, put back if a rename fails); names must be plain file names."""
    from kvtune.writer import write_files as write_all

    target = Path(out_dir)
    for name in files:
        if Path(name).name != name or name in ("", ".", ".."):
            raise KvtuneError(f"refusing to write {name!r}: not a plain file name")
    return write_all({target / name: text for name, text in files.items()},
                     executable=[target / name for name in files if name in EXECUTABLE])


__all__ = [
    "RenderOptions", "TARGETS", "render_files", "write_files", "make_environment", "local_chat_tokenizer",
    "one_line", "shell_quote", "json_scalar", "yaml_scalar", "lua_string", "md_cell",
    "human_number", "human_bytes", "parse_upstream", "vllm_flags", "gateway_routes",
    "histogram_bars", "coarsen_histogram", "capacity_segments", "NGINX_CONFIG_BEGIN", "NGINX_CONFIG_END",
]
