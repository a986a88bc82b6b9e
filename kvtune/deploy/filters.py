"""Escaping and formatting filters for the deploy templates, one per target syntax.

Anything that came from logs (route names, model ids) reaches a rendered file only through the
filter of that file's syntax: `shell`, `yaml`, `json`, `lua`, `nginx`, `md` (HTML is autoescaped
by jinja2). Each filter either produces text the target reads back as the same value, or
refuses: a value nginx cannot hold unquoted is an error, never a silently altered word.
"""

from __future__ import annotations

import json
import math
import re
import shlex
import unicodedata
from collections.abc import Mapping
from typing import Any

from markupsafe import Markup, escape

from kvtune.errors import RenderError
from kvtune.userfiles import brief

# Characters YAML 1.1 (PyYAML) or a shell/nginx comment would treat as a line break.
_LINE_BREAKS = "\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"
HOSTNAME = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9]([A-Za-z0-9.-]{0,251}[A-Za-z0-9])?)$")


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
        raise RenderError(f"{brief(text)} cannot be used in nginx.conf: no quotes, backslashes, $ or control "
                          "characters")
    return f'"{text}"'


def nginx_time(seconds: Any) -> str:
    """A duration for an nginx time directive: whole seconds, else milliseconds (nginx takes no
    fractions)."""
    value = float(seconds)
    if not math.isfinite(value) or value < 0:
        raise RenderError(f"{seconds!r} is not a duration nginx can take")
    ms = round(value * 1000)
    return f"{ms // 1000}s" if ms % 1000 == 0 else f"{ms}ms"


def nginx_listen(value: Any) -> str:
    """host:port for `listen`, validated."""
    host, _, port = str(value).rpartition(":")
    if not HOSTNAME.match(host) or not port.isdigit() or not 0 < int(port) < 65536:
        raise RenderError(f"cannot listen on {brief(value)}: expected host:port")
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


_NAME_JOINTS = re.compile(r"([_/.=-]+)")


def breakable(value: Any) -> Markup:
    """HTML text of a name (route, model id, URL, setting value) that may wrap after its joints
    (_ / . = -) and nowhere else: a narrow cell breaks `/v1/chat/completions` after a slash,
    never mid-word (code is not word-break: break-all)."""
    return Markup(_NAME_JOINTS.sub(r"\1<wbr>", str(escape(one_line(value)))))


FILTERS = {
    "shell": shell_quote, "json": json_scalar, "yaml": yaml_scalar, "lua": lua_string, "md": md_cell,
    "nginx": nginx_word, "nginx_listen": nginx_listen, "nginx_time": nginx_time,
    "one_line": one_line, "human": human_number, "bytes": human_bytes, "percent": percent,
    "breakable": breakable,
}
