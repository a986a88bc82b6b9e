"""Reading a launch command back: shell text split as a shell would, its flags, the environment it
sets, and the values typed into them. Shared by every engine's launch module, which knows its
own command, option spellings and value types.

Every value is validated as typed, never coerced: a bad one is an InputError naming the file
and the flag.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterable, Mapping
from typing import Any

from kvtune.domain.fields import MAX_INTEGER
from kvtune.errors import InputError
from kvtune.userfiles import brief

_SEPARATORS = frozenset({"\n", ";", "&&", "||", "|", "&", ";;", "(", ")"})
_ASSIGNMENT = re.compile(r"(?P<name>[A-Za-z_][A-Za-z0-9_]*)=(?P<value>.*)", re.S)


def shell_commands(text: str, source: str) -> list[list[str]]:
    """Split shell text into simple commands, the way a shell would quote and join lines: a quoted
    newline stays inside its word, backslash-newline continues the line."""
    lexer = shlex.shlex(re.sub(r"\\\r?\n", " ", text), posix=True, punctuation_chars=";&|()\n")
    lexer.whitespace = " \t\r"
    lexer.whitespace_split = True
    commands: list[list[str]] = [[]]
    try:
        for token in lexer:
            if token in _SEPARATORS or set(token) <= set(";&|()\n"):
                if commands[-1]:
                    commands.append([])
            else:
                commands[-1].append(token)
    except ValueError as exc:
        raise InputError(f"cannot split the command line: {exc}", path=source) from exc
    return [c for c in commands if c]


def shell_environment(commands: Iterable[list[str]], names: Iterable[str] | None = None) -> dict[str, str]:
    """The variables the script sets for what it runs: `export NAME=VALUE` lines and `NAME=VALUE`
    words before a command (the last setting wins). `names` keeps only those; None keeps all."""
    wanted = None if names is None else set(names)
    env: dict[str, str] = {}
    for words in commands:
        start = 1 if words and words[0] == "export" else 0
        for word in words[start:]:
            match = _ASSIGNMENT.fullmatch(word)
            if match is None:
                break  # the command itself: assignments end here
            if wanted is None or match["name"] in wanted:
                env[match["name"]] = match["value"]
    return env


def _is_flag(word: str) -> bool:
    return word.startswith("-") and not re.fullmatch(r"-\d+(\.\d+)?", word)


def split_flags(args: list[str], *, short_flags: Mapping[str, str] | None = None,
                boolean_prefixes: tuple[str, ...] = (), booleans: frozenset[str] = frozenset(),
                positional: bool = True) -> tuple[str | None, dict[str, Any]]:
    """(the first positional word, {flag name: value or True}) from a command's arguments.

    Long names keep their spelling with `_` read as `-` (both engines' parsers accept one
    spelling; the launch module checks which); a flag named in `booleans` or starting with a
    `boolean_prefixes` entry takes no value, any other takes the next word unless it is a flag."""
    model: str | None = None
    flags: dict[str, Any] = {}
    i = 0
    while i < len(args):
        word = args[i]
        i += 1
        if word in ("$@", "$*", "--"):
            continue  # the script's own arguments: not known here
        if _is_flag(word):
            long_form = word.startswith("--")
            name, eq, value = word.lstrip("-").partition("=")
            name = name.replace("_", "-") if long_form else (short_flags or {}).get(name, name)
            if eq:
                flags[name] = value
            elif i < len(args) and not _is_flag(args[i]) and name not in booleans \
                    and not name.startswith(boolean_prefixes) and args[i] not in ("$@", "$*"):
                flags[name] = args[i]
                i += 1
            else:
                flags[name] = True
        elif positional and model is None:
            model = word
    return model, flags


# ---------------------------------------------------------------- values as typed

def in_range(value: int, minimum: int, where: str, source: str) -> int:
    if not minimum <= value <= MAX_INTEGER:
        raise InputError(f"must be from {minimum} to {MAX_INTEGER}, got {value}", path=source, field=where)
    return value


def human_int(text: Any, where: str, source: str) -> int | None:
    """vLLM's human-readable ints: 8k = 8000, 8K = 8192, 1m/1M, 25.6k; -1 or auto = auto-fit."""
    value = str(text).strip()
    if value in ("-1", "auto"):
        return None
    match = re.fullmatch(r"(\d{1,16}(?:\.\d{1,16})?)([kKmMgG]?)", value)
    if not match:
        raise InputError(f"expected an integer such as 8192 or 8k, got {brief(text)}", path=source, field=where)
    number, unit = float(match.group(1)), match.group(2)
    scale = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "K": 2**10, "M": 2**20, "G": 2**30}[unit]
    return in_range(int(number * scale), 1, where, source)


def integer(text: Any, where: str, source: str, minimum: int = 1) -> int:
    """A whole number as typed (digits, optionally signed), from `minimum` to MAX_INTEGER (2**53)."""
    if isinstance(text, bool) or not re.fullmatch(r"[-+]?\d{1,16}", str(text).strip()):
        raise InputError(f"expected an integer, got {brief(text)}", path=source, field=where)
    return in_range(int(str(text)), minimum, where, source)


def count(text: Any, where: str, source: str) -> int:
    return integer(text, where, source, minimum=0)


def number(text: Any, where: str, source: str, maximum: float = MAX_INTEGER) -> float:
    """A finite number from 0 to `maximum`."""
    if isinstance(text, bool):
        raise InputError(f"expected a number, got {brief(text)}", path=source, field=where)
    try:
        value = float(str(text))
    except ValueError:
        raise InputError(f"expected a number, got {brief(text)}", path=source, field=where) from None
    if not 0 <= value <= maximum:  # also NaN and ±inf
        raise InputError(f"must be a number from 0 to {maximum:g}, got {brief(text)}", path=source, field=where)
    return value


def fraction(text: Any, where: str, source: str) -> float:
    return number(text, where, source, maximum=1.0)


def text(value: Any, where: str, source: str) -> str:
    return str(value)


__all__ = ["MAX_INTEGER", "FlagValues", "shell_commands", "shell_environment", "split_flags", "in_range", "human_int",
           "integer", "count", "number", "fraction", "text"]


class FlagValues:
    """A command's flags read by name with a converter: None when absent, an InputError naming the
    flag when it has no value or a bad one."""

    def __init__(self, flags: Mapping[str, Any], source: str, prefix: str = "--") -> None:
        self.flags, self.source, self.prefix = flags, source, prefix

    def __contains__(self, name: str) -> bool:
        return name in self.flags

    def get(self, name: str, convert: Any) -> Any:
        value = self.flags.get(name)
        if value is None:
            return None
        if value is True:
            raise InputError("flag needs a value", path=self.source, field=self.prefix + name)
        return convert(value, self.prefix + name, self.source)

    def switch(self, name: str) -> bool:
        """A flag that takes no value: present or not."""
        value = self.flags.get(name)
        if value not in (None, True):
            raise InputError(f"takes no value, got {brief(value)}", path=self.source, field=self.prefix + name)
        return value is True
