"""Read what is deployed: an engine's launch command (vLLM, SGLang, TensorRT-LLM, each read by its
launch module in kvtune.deploy.launch), a gateway.yaml, an nginx.conf rendered by kvtune, or
Kubernetes manifests (kvtune.deploy.k8s_read: a vLLM Deployment, a ConfigMap holding gateway.yaml), into
one plain record (kvtune.deploy.deployed) that `kvtune check` compares with a recommendation.

The nginx.conf is read from the Lua table that nginx itself runs (between the kvtune:config
markers), not from a comment, so an edited budget or cap is what gets checked.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvtune import userfiles
from kvtune.deploy.command_line import MAX_INTEGER
from kvtune.deploy.deployed import Deployed, DeployedKind, DeployedUpstream
from kvtune.deploy.k8s_read import looks_like_manifests, read_manifests
from kvtune.deploy.launch import launchers, vllm
from kvtune.deploy.markers import NGINX_CONFIG_BEGIN, NGINX_CONFIG_END
from kvtune.domain.admission_policy import AdmissionPolicy, parse_admission
from kvtune.domain.route import Route, RouteMatch
from kvtune.errors import InputError
from kvtune.gateway.config import HealthProbe, parse_gateway_config
from kvtune.userfiles import brief, parse_yaml


def parse_vllm_command(text: str, *, source: str = "<command>") -> Deployed:
    """A `vllm serve` (or api_server) command line, as typed or inside a shell script."""
    return vllm.read(text, source)


# ---------------------------------------------------------------- gateway.yaml

def _deployed_from_gateway(data: Any, source: str) -> Deployed:
    config = parse_gateway_config(data, path=source)
    return Deployed(
        kind=DeployedKind.GATEWAY, source=source, model=config.model, block_size=config.block_size,
        max_model_len=config.max_model_len, upstream=config.upstream,
        block_budget=max(u.block_budget for u in config.upstreams),
        upstreams=tuple(DeployedUpstream(u.url, u.block_budget) for u in config.upstreams),
        routes=config.routes,
        admission=config.admission, queue_max_waiting=config.queue_max_waiting,
        queue_timeout_s=config.queue_timeout_s,
        health=config.health if len(config.upstreams) > 1 else None,
    )


def _gateway_text(text: str, source: str) -> Deployed:
    """A gateway.yaml given as text (a Kubernetes ConfigMap's, kvtune.deploy.k8s_read)."""
    data = parse_yaml(text, path=source)
    if not isinstance(data, dict) or "routes" not in data:
        raise InputError("not a gateway.yaml: no routes", path=source)
    return _deployed_from_gateway(data, source)


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
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_INTEGER:
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
        for key in ("name", "path", "model", "path_prefix", "header", "value"):
            if raw.get(key) is not None and not isinstance(raw[key], str):
                raise InputError("expected a string", path=source, field=f"CONFIG.routes[{i + 1}].{key}")
        if (raw.get("header") is None) != (raw.get("value") is None):
            raise InputError("a route matches a header and its value, both or neither", path=source,
                             field=f"CONFIG.routes[{i + 1}].{'value' if raw.get('header') else 'header'}")
        header = raw.get("header")
        route_match = RouteMatch(raw.get("path"), raw.get("model"), raw.get("path_prefix"),
                                 None if header is None else header.lower(), raw.get("value"))
        routes.append(Route(raw.get("name") or f"route {i + 1}", route_match,
                            integer("max_new_tokens", raw, f"routes[{i + 1}].")))
    upstream = re.search(r"upstream\s+kvtune_upstream\s*\{\s*server\s+([^\s;]+)", text)
    upstreams = []
    raw_upstreams = config.get("upstreams", [])
    if not isinstance(raw_upstreams, list):
        raise InputError("expected a list of upstreams", path=source, field="CONFIG.upstreams")
    for i, raw in enumerate(raw_upstreams):
        if not isinstance(raw, dict) or not isinstance(raw.get("url"), str):
            raise InputError("expected a table with a url", path=source, field=f"CONFIG.upstreams[{i + 1}]")
        upstreams.append(DeployedUpstream(raw["url"], integer("block_budget", raw, f"upstreams[{i + 1}].")))
    return Deployed(
        upstreams=tuple(upstreams),
        kind=DeployedKind.NGINX, source=source, block_size=integer("block_size"),
        block_budget=integer("block_budget"), max_model_len=integer("max_model_len"),
        upstream=upstream.group(1) if upstream else None, routes=tuple(routes),
        admission=_lua_admission(config, source),
        gateway_replicas=integer("nginx_replicas") if "nginx_replicas" in config else 1,
        health=_lua_health(config, source) if len(upstreams) > 1 else None,
    )


def _lua_health(config: dict, source: str) -> HealthProbe:
    """CONFIG.health: the probe, and passive health (nginx.conf files rendered before it have
    none: consecutive_failures 0)."""
    health = config.get("health")
    if not isinstance(health, dict):
        raise InputError("expected a table", path=source, field="CONFIG.health")
    given = {"consecutive_failures": 0, **{k: v for k, v in health.items() if k != "https"}}
    for key, value in given.items():
        if key == "path":
            if not isinstance(value, str):
                raise InputError("expected a string", path=source, field="CONFIG.health.path")
        elif key not in HEALTH_FIELDS:
            raise InputError(f"unknown key (allowed: {', '.join(sorted(HEALTH_FIELDS))})", path=source,
                             field=f"CONFIG.health.{brief(key, 40)}")
        elif isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= MAX_INTEGER \
                or (key == "consecutive_failures" and not isinstance(value, int)):
            raise InputError(f"expected a number ≥ 0, got {brief(value)}", path=source,
                             field=f"CONFIG.health.{key}")
    return HealthProbe(**given)


HEALTH_FIELDS = {f.name for f in dataclasses.fields(HealthProbe)}


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

# Reads a file a launch script names (TensorRT-LLM's --extra_llm_api_options YAML), by the path
# as written in the script; None: the script was given as text alone.
SiblingReader = Callable[[str], str] | None


def parse_deployed(text: str, *, source: str = "<deployed>", read_sibling: SiblingReader = None) -> Deployed:
    """Recognise the file by its content: kvtune's nginx.conf, a gateway.yaml, or an engine's
    launch command (each launch module recognises its own)."""
    if NGINX_CONFIG_BEGIN in text or re.search(r"^\s*http\s*\{", text, re.M):
        return _deployed_from_nginx(text, source)
    if looks_like_manifests(text):
        return read_manifests(text, source, _gateway_text)
    try:
        data, as_yaml = parse_yaml(text, path=source), None
    except InputError as exc:  # a shell script is rarely YAML; say why only if nothing else fits
        data, as_yaml = None, exc
    if isinstance(data, dict) and "routes" in data:
        return _deployed_from_gateway(data, source)
    for launch in launchers():
        if launch.recognise(text, source):
            return launch.read(text, source, read_sibling=read_sibling)
    why = ""
    if as_yaml is not None:
        line = "" if as_yaml.line is None else f"line {as_yaml.line}: "
        why = f" (read as YAML: {line}{as_yaml.message})"
    raise InputError("not a launch command of vLLM, SGLang or TensorRT-LLM, a gateway.yaml or an nginx.conf "
                     "rendered by kvtune" + why, path=source)


def load_deployed(path: str | os.PathLike[str]) -> Deployed:
    """Read a deployed file: a regular file of UTF-8 text, at most CONFIG_MAX_BYTES (kvtune.userfiles).
    A file the script names (`"$(dirname "$0")/x.yaml"` or a relative path) is read from beside it."""
    here = Path(path).parent

    def read_sibling(named: str) -> str:
        named = re.sub(r'^"?\$\(dirname "?\$0"?\)"?/', "", named)
        target = Path(named) if Path(named).is_absolute() else here / named
        return userfiles.read_text(target, max_bytes=userfiles.CONFIG_MAX_BYTES)

    return parse_deployed(userfiles.read_text(path, max_bytes=userfiles.CONFIG_MAX_BYTES), source=os.fspath(path),
                          read_sibling=read_sibling)


__all__ = ["Deployed", "DeployedKind", "SiblingReader", "parse_deployed", "parse_vllm_command",
           "load_deployed"]
