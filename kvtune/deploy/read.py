"""Read what is deployed: a `vllm serve` command line, a gateway.yaml, or an nginx.conf rendered by
kvtune, into one plain record that `kvtune check` compares with a recommendation.

The nginx.conf is read from the Lua table that nginx itself runs (between the kvtune:config
markers), not from a comment, so an edited budget or cap is what gets checked.
"""

from __future__ import annotations

import enum
import json
import os
import re
import shlex
from dataclasses import asdict, dataclass, field
from typing import Any

from kvtune.deploy.markers import NGINX_CONFIG_BEGIN, NGINX_CONFIG_END
from kvtune.errors import InputError
from kvtune.gateway.config import RouteMatch
from kvtune.gateway.overflow import OutputLaw
from kvtune.gateway.policy import AdmissionPolicy, parse_admission
from kvtune.userfiles import brief

# Short options vLLM accepts, by their long names.
_SHORT_FLAGS = {"tp": "tensor-parallel-size", "pp": "pipeline-parallel-size", "dp": "data-parallel-size",
                "q": "quantization", "O": "compilation-config"}
# Flags that take no value; anything else with a following non-flag token takes it as its value.
_BOOLEAN_PREFIXES = ("enable-", "no-", "disable-", "enforce-", "trust-", "skip-", "use-")
_SERVER_MODULES = ("vllm.entrypoints.openai.api_server", "vllm.entrypoints.api_server")


@dataclass(frozen=True, slots=True)
class DeployedRoute:
    name: str
    path: str | None
    model: str | None
    max_new_tokens: int
    path_prefix: str | None = None
    output_law: OutputLaw | None = None  # output_histogram: what the statistical policy bets on

    def matches(self, path: str | None, model: str | None) -> bool:
        """Same rule as the gateways (gateway_config.RouteMatch)."""
        return RouteMatch(self.path, self.model, self.path_prefix).matches(path, model)


class DeployedKind(enum.Enum):
    """What a deployed file is: the engine's command or one of the two gateways' configs."""

    VLLM = "vllm"  # a vllm serve command line or script
    GATEWAY = "gateway"  # kvtune's gateway.yaml
    NGINX = "nginx"  # an nginx.conf kvtune rendered


@dataclass(frozen=True, slots=True)
class Deployed:
    """One deployed file. An engine fills the engine fields, a gateway the admission ones;
    None means the file does not set it (the engine's default applies)."""

    kind: DeployedKind
    source: str
    model: str | None = None
    block_size: int | None = None
    max_model_len: int | None = None
    # vllm serve
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    tensor_parallel_size: int | None = None
    pipeline_parallel_size: int | None = None
    kv_cache_dtype: str | None = None
    gpu_memory_utilization: float | None = None
    kv_cache_memory_bytes: int | None = None
    max_new_tokens: int | None = None  # --override-generation-config max_new_tokens
    preemption_mode: str | None = None
    swap_space: float | None = None
    num_gpu_blocks_override: int | None = None
    flags: dict[str, Any] = field(default_factory=dict)
    # gateway / nginx
    upstream: str | None = None
    block_budget: int | None = None
    routes: tuple[DeployedRoute, ...] = ()
    admission: AdmissionPolicy | None = None  # the gateway's admission policy
    queue_max_waiting: int | None = None  # gateway.yaml's wait queue (nginx.conf has none)
    queue_timeout_s: float | None = None

    @property
    def is_gateway(self) -> bool:
        return self.kind is not DeployedKind.VLLM

    def route_for(self, path: str | None, model: str | None) -> DeployedRoute | None:
        return next((r for r in self.routes if r.matches(path, model)), None)

    def to_dict(self) -> dict:
        data = asdict(self)
        data["kind"] = self.kind.value
        # each route's output law stays out: gateway.yaml itself carries it, and it is long
        data["routes"] = [{k: v for k, v in asdict(r).items() if k != "output_law"} for r in self.routes]
        data["admission"] = None if self.admission is None else self.admission.to_dict()
        return data


# ---------------------------------------------------------------- vllm serve

_MAX_INTEGER = 2**53  # exact in a double, like every integer kvtune reads back


def _human_int(text: str, where: str, source: str) -> int | None:
    """vLLM's human-readable ints: 8k = 8000, 8K = 8192, 1m/1M, 25.6k; -1 or auto = auto-fit."""
    value = text.strip()
    if value in ("-1", "auto"):
        return None
    match = re.fullmatch(r"(\d{1,16}(?:\.\d{1,16})?)([kKmMgG]?)", value)
    if not match:
        raise InputError(f"expected an integer such as 8192 or 8k, got {brief(text)}", path=source, field=where)
    number, unit = float(match.group(1)), match.group(2)
    scale = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "K": 2**10, "M": 2**20, "G": 2**30}[unit]
    return _in_range(int(number * scale), 1, where, source)


def _in_range(value: int, minimum: int, where: str, source: str) -> int:
    if not minimum <= value <= _MAX_INTEGER:
        raise InputError(f"must be from {minimum} to {_MAX_INTEGER}, got {value}", path=source, field=where)
    return value


def _int(text: Any, where: str, source: str, minimum: int = 1) -> int:
    """A whole number as typed (digits, optionally signed), from `minimum` to 2**53."""
    if isinstance(text, bool) or not re.fullmatch(r"[-+]?\d{1,16}", str(text).strip()):
        raise InputError(f"expected an integer, got {brief(text)}", path=source, field=where)
    return _in_range(int(str(text)), minimum, where, source)


def _count(text: Any, where: str, source: str) -> int:
    return _int(text, where, source, minimum=0)


def _float(text: Any, where: str, source: str, maximum: float = _MAX_INTEGER) -> float:
    """A finite number from 0 to `maximum`."""
    try:
        value = float(str(text))
    except ValueError:
        raise InputError(f"expected a number, got {brief(text)}", path=source, field=where) from None
    if not 0 <= value <= maximum:  # also NaN and ±inf
        raise InputError(f"must be a number from 0 to {maximum:g}, got {brief(text)}", path=source, field=where)
    return value


def _fraction(text: Any, where: str, source: str) -> float:
    return _float(text, where, source, maximum=1.0)


_SEPARATORS = frozenset({"\n", ";", "&&", "||", "|", "&", ";;", "(", ")"})


def _shell_commands(text: str) -> list[list[str]]:
    """Split shell text into simple commands, the way a shell would quote and join lines: a quoted
    newline stays inside its word, backslash-newline continues the line."""
    lexer = shlex.shlex(re.sub(r"\\\r?\n", " ", text), posix=True, punctuation_chars=";&|()\n")
    lexer.whitespace = " \t\r"
    lexer.whitespace_split = True
    commands: list[list[str]] = [[]]
    for token in lexer:
        if token in _SEPARATORS or set(token) <= set(";&|()\n"):
            if commands[-1]:
                commands.append([])
        else:
            commands[-1].append(token)
    return [c for c in commands if c]


def _command_args(text: str, source: str) -> list[str] | None:
    """The arguments after `vllm serve`, `python -m vllm.entrypoints.openai.api_server` or a
    vllm/vllm-openai image, from the first command that has one."""
    if "vllm" not in text:
        return None
    try:
        commands = _shell_commands(text)
    except ValueError as exc:
        raise InputError(f"cannot split the command line: {exc}", path=source) from exc
    for words in commands:
        for i, word in enumerate(words):
            name = word.rsplit("/", 1)[-1]
            if name == "vllm" and i + 1 < len(words) and words[i + 1] == "serve":
                return ["<serve>", *words[i + 2:]]
            if word == "-m" and i + 1 < len(words) and words[i + 1] in _SERVER_MODULES:
                return words[i + 2:]
            if word.startswith("vllm/vllm-openai"):
                return words[i + 1:]
    return None


def _split_flags(args: list[str]) -> tuple[str | None, dict[str, Any]]:
    serve = bool(args) and args[0] == "<serve>"
    args = args[1:] if serve else args
    model: str | None = None
    flags: dict[str, Any] = {}

    def is_flag(word: str) -> bool:
        return word.startswith("-") and not re.fullmatch(r"-\d+(\.\d+)?", word)

    i = 0
    while i < len(args):
        word = args[i]
        i += 1
        if word in ("$@", "$*"):
            continue  # the script's own arguments: not known here
        if word == "--":
            continue
        if is_flag(word):
            long_form = word.startswith("--")
            name, eq, value = word.lstrip("-").partition("=")
            name = name.replace("_", "-") if long_form else _SHORT_FLAGS.get(name, name)
            if eq:
                flags[name] = value
            elif i < len(args) and not is_flag(args[i]) and not name.startswith(_BOOLEAN_PREFIXES) \
                    and args[i] not in ("$@", "$*"):
                flags[name] = args[i]
                i += 1
            else:
                flags[name] = True
        elif serve and model is None:
            model = word
    if "model" in flags and isinstance(flags["model"], str):
        model = model or flags["model"]
    return model, flags


def parse_vllm_command(text: str, *, source: str = "<command>") -> Deployed:
    """A `vllm serve` (or api_server) command line, as typed or inside a shell script."""
    args = _command_args(text, source)
    if args is None:
        raise InputError("no `vllm serve` or `python -m vllm.entrypoints.openai.api_server` command found",
                         path=source)
    model, flags = _split_flags(args)

    def get(name: str, convert):
        value = flags.get(name)
        if value is None:
            return None
        if value is True:
            raise InputError("flag needs a value", path=source, field=f"--{name}")
        return convert(value, f"--{name}", source)

    max_new_tokens = None
    override = flags.get("override-generation-config")
    if isinstance(override, str):
        try:
            parsed = json.loads(override)
        except json.JSONDecodeError as exc:
            raise InputError(f"not JSON: {exc.msg}", path=source, field="--override-generation-config") from exc
        except (ValueError, RecursionError) as exc:  # an int of over 4,300 digits; nesting too deep
            raise InputError(f"not JSON: {brief(str(exc), 100)}", path=source,
                             field="--override-generation-config") from exc
        if not isinstance(parsed, dict):
            raise InputError("expected a JSON object", path=source, field="--override-generation-config")
        if parsed.get("max_new_tokens") is not None:
            max_new_tokens = _int(parsed["max_new_tokens"], "--override-generation-config.max_new_tokens", source)

    return Deployed(
        kind=DeployedKind.VLLM,
        source=source,
        model=model,
        block_size=get("block-size", _int),
        max_model_len=get("max-model-len", _human_int),
        max_num_seqs=get("max-num-seqs", _int),
        max_num_batched_tokens=get("max-num-batched-tokens", _human_int),
        tensor_parallel_size=get("tensor-parallel-size", _int),
        pipeline_parallel_size=get("pipeline-parallel-size", _int),
        kv_cache_dtype=get("kv-cache-dtype", lambda v, *_: str(v)),
        gpu_memory_utilization=get("gpu-memory-utilization", _fraction)
        if "gpu-memory-utilization" in flags else get("device-memory-utilization", _fraction),
        kv_cache_memory_bytes=get("kv-cache-memory-bytes", _human_int),
        max_new_tokens=max_new_tokens,
        preemption_mode=get("preemption-mode", lambda v, *_: str(v)),
        swap_space=get("swap-space", _float),
        num_gpu_blocks_override=get("num-gpu-blocks-override", _count),
        flags=dict(flags),
    )


# ---------------------------------------------------------------- gateway.yaml

def _deployed_from_gateway(data: Any, source: str) -> Deployed:
    from kvtune.gateway.config import parse_gateway_config

    config = parse_gateway_config(data, path=source)
    return Deployed(
        kind=DeployedKind.GATEWAY, source=source, model=config.model, block_size=config.block_size,
        max_model_len=config.max_model_len, upstream=config.upstream, block_budget=config.block_budget,
        routes=tuple(DeployedRoute(r.name, r.match.path, r.match.model, r.max_new_tokens, r.match.path_prefix,
                                   r.output_law) for r in config.routes),
        admission=config.admission, queue_max_waiting=config.queue_max_waiting,
        queue_timeout_s=config.queue_timeout_s,
    )


# ---------------------------------------------------------------- nginx.conf (kvtune's Lua table)

class _LuaReader:
    """Reads the Lua literals kvtune renders: tables, strings with escapes, numbers, booleans, nil."""

    _ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "a": "\a", "b": "\b", "f": "\f", "v": "\v",
                "\\": "\\", '"': '"', "'": "'", "\n": "\n"}

    _MAX_DEPTH = 32  # kvtune renders three levels; recursion must not reach Python's limit

    def __init__(self, text: str, source: str) -> None:
        self.text, self.pos, self.source, self.depth = text, 0, source, 0

    def fail(self, message: str) -> InputError:
        line = self.text.count("\n", 0, self.pos) + 1
        return InputError(f"kvtune's Lua config table: {message} (config line {line})", path=self.source)

    def skip(self) -> None:
        while True:
            match = re.compile(r"\s+|--[^\n]*").match(self.text, self.pos)
            if not match or match.end() == self.pos:
                return
            self.pos = match.end()

    def peek(self) -> str:
        self.skip()
        return self.text[self.pos:self.pos + 1]

    def expect(self, token: str) -> None:
        self.skip()
        if not self.text.startswith(token, self.pos):
            raise self.fail(f"expected {token!r}")
        self.pos += len(token)

    def value(self) -> Any:
        ch = self.peek()
        if ch == "{":
            return self.table()
        if ch in "\"'":
            return self.string()
        match = re.compile(r"-?\d+(\.\d+)?([eE][-+]?\d+)?|true\b|false\b|nil\b").match(self.text, self.pos)
        if not match:
            raise self.fail("expected a value")
        self.pos = match.end()
        word = match.group(0)
        if word in ("true", "false", "nil"):
            return {"true": True, "false": False, "nil": None}[word]
        if len(word) > 40:
            raise self.fail(f"a number of {len(word)} characters")
        return float(word) if match.group(1) or match.group(2) else int(word)

    def string(self) -> str:
        quote = self.text[self.pos]
        self.pos += 1
        out = bytearray()
        while True:
            if self.pos >= len(self.text):
                raise self.fail("unterminated string")
            ch = self.text[self.pos]
            self.pos += 1
            if ch == quote:
                return out.decode("utf-8", "surrogateescape")
            if ch != "\\":
                out += ch.encode("utf-8", "surrogateescape")
                continue
            esc = self.text[self.pos:self.pos + 1]
            digits = re.compile(r"\d{1,3}").match(self.text, self.pos)
            hexa = re.compile(r"x([0-9A-Fa-f]{2})").match(self.text, self.pos)
            if digits:
                code = int(digits.group(0))
                if code > 255:
                    raise self.fail(f"escape \\{code} is not a byte")
                out.append(code)
                self.pos = digits.end()
            elif hexa:
                out.append(int(hexa.group(1), 16))
                self.pos = hexa.end()
            elif esc in self._ESCAPES:
                out += self._ESCAPES[esc].encode()
                self.pos += 1
            else:
                raise self.fail(f"unknown escape \\{esc}")

    def table(self) -> dict | list:
        self.depth += 1
        if self.depth > self._MAX_DEPTH:
            raise self.fail(f"tables nested deeper than {self._MAX_DEPTH}")
        self.expect("{")
        items: list = []
        named: dict = {}
        while self.peek() != "}":
            key = re.compile(r"([A-Za-z_]\w*)\s*=(?!=)").match(self.text, self.pos)
            if key:
                self.pos = key.end()
                named[key.group(1)] = self.value()
            else:
                items.append(self.value())
            if self.peek() in (",", ";"):
                self.pos += 1
            elif self.peek() != "}":
                raise self.fail("expected ',' or '}'")
        self.pos += 1
        if named and items:
            raise self.fail("mixed list and record table")
        self.depth -= 1
        return named if named or not items else items


def _deployed_from_nginx(text: str, source: str) -> Deployed:
    begin, end = text.find(NGINX_CONFIG_BEGIN), text.find(NGINX_CONFIG_END)
    if begin < 0 or end < begin:
        raise InputError("an nginx.conf without kvtune's route table; render one with `kvtune recommend`",
                         path=source)
    block = text[begin + len(NGINX_CONFIG_BEGIN):end]
    match = re.search(r"local\s+CONFIG\s*=", block)
    if not match:
        raise InputError("kvtune's Lua config table has no `local CONFIG = {...}`", path=source)
    reader = _LuaReader(block[match.end():], source)
    config = reader.value()
    if not isinstance(config, dict):
        raise reader.fail("CONFIG is not a table")

    def integer(key: str, data: dict = config, where: str = "") -> int:
        value = data.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= _MAX_INTEGER:
            raise InputError(f"expected a positive integer, got {brief(value)}", path=source,
                             field=f"CONFIG.{where}{key}")
        return value

    routes = []
    raw_routes = config.get("routes")
    if not isinstance(raw_routes, list) or not raw_routes:
        raise InputError("expected a non-empty list of routes", path=source, field="CONFIG.routes")
    for i, raw in enumerate(raw_routes):
        if not isinstance(raw, dict):
            raise InputError("expected a table", path=source, field=f"CONFIG.routes[{i + 1}]")
        for key in ("name", "path", "model", "path_prefix"):
            if raw.get(key) is not None and not isinstance(raw[key], str):
                raise InputError("expected a string", path=source, field=f"CONFIG.routes[{i + 1}].{key}")
        routes.append(DeployedRoute(raw.get("name") or f"route {i + 1}", raw.get("path"), raw.get("model"),
                                    integer("max_new_tokens", raw, f"routes[{i + 1}]."), raw.get("path_prefix")))
    upstream = re.search(r"upstream\s+kvtune_upstream\s*\{\s*server\s+([^\s;]+)", text)
    return Deployed(
        kind=DeployedKind.NGINX, source=source, block_size=integer("block_size"),
        block_budget=integer("block_budget"), max_model_len=integer("max_model_len"),
        upstream=upstream.group(1) if upstream else None, routes=tuple(routes),
        admission=_lua_admission(config, source),
    )


def _lua_admission(config: dict, source: str) -> AdmissionPolicy:
    """CONFIG.policy and CONFIG.factor or CONFIG.statistical.epsilon (nginx.conf files rendered
    before them: guaranteed)."""
    policy = config.get("policy", "guaranteed")
    given: dict[str, Any] = {"policy": policy}
    if policy == "overcommit":
        given["factor"] = config.get("factor")
    elif policy == "statistical":
        statistical = config.get("statistical")
        given["epsilon"] = statistical.get("epsilon") if isinstance(statistical, dict) else None

    def fail(field: str, message: str) -> InputError:
        return InputError(message, path=source, field="CONFIG." + field.removeprefix("admission."))

    return parse_admission(given, fail)


# ---------------------------------------------------------------- any of them

def parse_deployed(text: str, *, source: str = "<deployed>") -> Deployed:
    """Recognise the file by its content: kvtune's nginx.conf, a gateway.yaml, or a vllm command."""
    from kvtune.userfiles import parse_yaml

    if NGINX_CONFIG_BEGIN in text or re.search(r"^\s*http\s*\{", text, re.M):
        return _deployed_from_nginx(text, source)
    try:
        data, as_yaml = parse_yaml(text, path=source), None
    except InputError as exc:  # a shell script is rarely YAML; say why only if nothing else fits
        data, as_yaml = None, exc
    if isinstance(data, dict) and "routes" in data:
        return _deployed_from_gateway(data, source)
    if _command_args(text, source) is not None:
        return parse_vllm_command(text, source=source)
    why = ""
    if as_yaml is not None:
        line = "" if as_yaml.line is None else f"line {as_yaml.line}: "
        why = f" (read as YAML: {line}{as_yaml.message})"
    raise InputError("not a `vllm serve` command line, a gateway.yaml or an nginx.conf rendered by kvtune" + why,
                     path=source)


def load_deployed(path: str | os.PathLike[str]) -> Deployed:
    """Read a deployed file: a regular file of UTF-8 text, at most CONFIG_MAX_BYTES (kvtune.userfiles)."""
    from kvtune import userfiles

    return parse_deployed(userfiles.read_text(path, max_bytes=userfiles.CONFIG_MAX_BYTES), source=os.fspath(path))


__all__ = ["Deployed", "DeployedRoute", "parse_deployed", "parse_vllm_command", "load_deployed"]
