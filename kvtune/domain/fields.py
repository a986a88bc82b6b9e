"""Typed reading of parsed JSON/YAML objects with the field path in every error.

Every file kvtune reads back (recommendation.json, a saved profile, a capacity file) and the one
people write by hand (gateway.yaml) goes through one reader so a damaged file is one `InputError`
naming the file and the field — `routes[2].
max_new_tokens.value: expected an integer, got "lots"` — instead of a KeyError deep in a check.
Values are validated, never coerced: a bool is not an integer, numbers are finite and in range,
and a quoted value is at most ~80 characters long.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable, Iterator
from typing import Any, Literal, TypeVar, overload

from kvtune.errors import InputError
from kvtune.userfiles import brief

#: The largest integer any file or option kvtune reads may hold: exact in a double, so JSON
#: readers, YAML, the rendered Lua and numpy all see the same number. Named once, here.
MAX_INTEGER = 2**53
_MISSING = object()


# The checks every strict reader of kvtune makes: values are validated, never coerced.

def is_integer(value: Any) -> bool:
    """An int that is not a bool (YAML and JSON `true` are not 1)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    """An int or float that is not a bool (finite or not)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def is_finite_number(value: Any) -> bool:
    return is_number(value) and not (isinstance(value, float) and not math.isfinite(value))


def _shown(value: Any) -> str:
    """A value as an error quotes it: briefly, and YAML's and JSON's null as null."""
    return "null" if value is None else brief(value)


def not_one_of(value: Any, choices: Iterable[str]) -> str | None:
    """Why `value` is none of `choices` (strings), or None when it is one."""
    choices = tuple(choices)
    if isinstance(value, str) and value in choices:
        return None
    return f"{_shown(value)} is not one of {', '.join(choices)}"


E = TypeVar("E", bound=enum.Enum)


class Fields:
    """One parsed object at a path in a file; each getter returns a checked value or raises.

    A getter's key may be `optional` (absent or null: None) or have a `default` (absent: the
    default, returned as given; null: refused like any other wrong type); otherwise it is
    required. `only` refuses keys the reader does not know. `noun` names what a non-object is
    not: "an object" for JSON, "a mapping" for YAML (gateway.yaml)."""

    __slots__ = ("data", "path", "where", "noun")

    def __init__(self, data: Any, *, path: str | None, where: str = "", noun: str = "an object") -> None:
        if not isinstance(data, dict):
            raise InputError(f"expected {noun}, got {_shown(data)}", path=path, field=where or None)
        self.data, self.path, self.where, self.noun = data, path, where, noun

    def field(self, key: str) -> str:
        return f"{self.where}.{key}" if self.where else key

    def fail(self, key: str | None, message: str) -> InputError:
        return InputError(message, path=self.path, field=self.field(key) if key else (self.where or None))

    def fail_at(self, field: str, message: str) -> InputError:
        """An error at a whole field path in the same file (a check written for the whole document)."""
        return InputError(message, path=self.path, field=field)

    def child(self, data: Any, key: str) -> Fields:
        """`data` read as the object at `key` below this one (a check of its raw value came first)."""
        return Fields(data, path=self.path, where=self.field(key), noun=self.noun)

    def only(self, allowed: Iterable[str], required: Iterable[str] = ()) -> Fields:
        """This object, when it holds no key but `allowed` and every `required` one (null counts
        as given: its getter refuses it)."""
        allowed = set(allowed)
        unknown = sorted(set(map(str, self.data)) - allowed)
        if unknown:
            name = unknown[0] if unknown[0].isprintable() and len(unknown[0]) <= 40 else brief(unknown[0], 40)
            raise self.fail(name, f"unknown key (allowed: {', '.join(sorted(allowed))})")
        missing = sorted(set(required) - set(self.data))
        if missing:
            raise self.fail(missing[0], "missing")
        return self

    def _get(self, key: str, optional: bool, default: Any = None) -> tuple[Any, bool]:
        """(value, settled): settled when the key is absent (or null and optional) and the value is
        the default or None; otherwise the value as written, for the getter to check."""
        value = self.data.get(key, _MISSING)
        if value is _MISSING:
            if default is not None or optional:
                return default, True
            raise self.fail(key, "missing")
        if value is None and optional:
            return None, True
        return value, False

    def has(self, key: str) -> bool:
        return self.data.get(key) is not None

    @overload
    def obj(self, key: str, *, optional: Literal[False] = False) -> Fields: ...
    @overload
    def obj(self, key: str, *, optional: Literal[True]) -> Fields | None: ...

    def obj(self, key: str, *, optional: bool = False) -> Fields | None:
        value, settled = self._get(key, optional)
        return None if settled else self.child(value, key)

    def section(self, key: str, allowed: Iterable[str], required: Iterable[str] = ()) -> Fields:
        """An object of known keys that may be left out (then it is empty: every key's default)."""
        value, _ = self._get(key, False, {})
        return self.child(value, key).only(allowed, required)

    @overload
    def integer(self, key: str, *, minimum: int = 0, maximum: int = MAX_INTEGER,
                optional: Literal[False] = False, default: int | None = None) -> int: ...
    @overload
    def integer(self, key: str, *, minimum: int = 0, maximum: int = MAX_INTEGER,
                optional: Literal[True], default: None = None) -> int | None: ...

    def integer(self, key: str, *, minimum: int = 0, maximum: int = MAX_INTEGER, optional: bool = False,
                default: int | None = None) -> int | None:
        value, settled = self._get(key, optional, default)
        if settled:
            return value
        if not is_integer(value):
            raise self.fail(key, f"expected an integer, got {_shown(value)}")
        self._in_range(key, value, minimum, maximum, f"{minimum}", f"{maximum}")
        return value

    @overload
    def number(self, key: str, *, minimum: float = 0.0, maximum: float = float(MAX_INTEGER),
               optional: Literal[False] = False, default: float | None = None) -> float: ...
    @overload
    def number(self, key: str, *, minimum: float = 0.0, maximum: float = float(MAX_INTEGER),
               optional: Literal[True], default: None = None) -> float | None: ...

    def number(self, key: str, *, minimum: float = 0.0, maximum: float = float(MAX_INTEGER),
               optional: bool = False, default: float | None = None) -> float | None:
        """A finite int or float in range, returned as written (an int stays an int)."""
        value, settled = self._get(key, optional, default)
        if settled:
            return value
        if not is_number(value):
            raise self.fail(key, f"expected a number, got {_shown(value)}")
        if not is_finite_number(value):
            raise self.fail(key, f"expected a finite number, got {_shown(value)}")
        self._in_range(key, value, minimum, maximum, f"{minimum:g}", f"{maximum:g}")
        return value

    def _in_range(self, key: str, value: float, minimum: float, maximum: float, low: str, high: str) -> None:
        if value < minimum:
            raise self.fail(key, f"must be at least {low}, got {_shown(value)}")
        if value > maximum:
            raise self.fail(key, f"must be at most {high}, got {_shown(value)}")

    @overload
    def string(self, key: str, *, optional: Literal[False] = False, nonempty: bool = False,
               default: str | None = None) -> str: ...
    @overload
    def string(self, key: str, *, optional: Literal[True], nonempty: bool = False,
               default: None = None) -> str | None: ...

    def string(self, key: str, *, optional: bool = False, nonempty: bool = False,
               default: str | None = None) -> str | None:
        value, settled = self._get(key, optional, default)
        if settled:
            return value
        if not isinstance(value, str) or (nonempty and not value):
            raise self.fail(key, f"expected {'a non-empty' if nonempty else 'a'} string, got {_shown(value)}")
        return value

    @overload
    def boolean(self, key: str, *, optional: Literal[False] = False) -> bool: ...
    @overload
    def boolean(self, key: str, *, optional: Literal[True]) -> bool | None: ...

    def boolean(self, key: str, *, optional: bool = False) -> bool | None:
        value, settled = self._get(key, optional)
        if not settled and not isinstance(value, bool):
            raise self.fail(key, f"expected true or false, got {_shown(value)}")
        return value

    @overload
    def choice(self, key: str, choices: Iterable[str], *, optional: Literal[False] = False,
               default: str | None = None) -> str: ...
    @overload
    def choice(self, key: str, choices: Iterable[str], *, optional: Literal[True],
               default: None = None) -> str | None: ...

    def choice(self, key: str, choices: Iterable[str], *, optional: bool = False,
               default: str | None = None) -> str | None:
        value, settled = self._get(key, optional, default)
        problem = None if settled else not_one_of(value, choices)
        if problem:
            raise self.fail(key, problem)
        return value

    @overload
    def member(self, key: str, kind: type[E], *, among: Iterable[E] | None = None,
               optional: Literal[False] = False, default: E | None = None) -> E: ...
    @overload
    def member(self, key: str, kind: type[E], *, among: Iterable[E] | None = None,
               optional: Literal[True], default: None = None) -> E | None: ...

    def member(self, key: str, kind: type[E], *, among: Iterable[E] | None = None, optional: bool = False,
               default: E | None = None) -> E | None:
        """One of an enum's members (or of `among`, some of them), written as its value."""
        members = {m.value: m for m in (kind if among is None else among)}
        value, settled = self._get(key, optional, default)
        if settled:
            return value
        problem = not_one_of(value, members)
        if problem:
            raise self.fail(key, problem)
        return members[value]

    @overload
    def scalar(self, key: str, *, optional: Literal[False] = False) -> int | float | str | bool: ...
    @overload
    def scalar(self, key: str, *, optional: Literal[True]) -> int | float | str | bool | None: ...

    def scalar(self, key: str, *, optional: bool = False) -> int | float | str | bool | None:
        """A JSON scalar of any type (a setting whose type depends on the setting)."""
        value, settled = self._get(key, optional)
        if not settled and (not isinstance(value, (int, float, str, bool))
                            or (isinstance(value, float) and not math.isfinite(value))):
            raise self.fail(key, f"expected a number, string or boolean, got {_shown(value)}")
        return value

    def items(self, key: str, *, optional: bool = False, nonempty: bool = False) -> Iterator[Fields]:
        """The objects of a list, each at its own path (`routes[3]`)."""
        value, settled = self._get(key, optional)
        if settled:
            return iter(())
        if not isinstance(value, list) or (nonempty and not value):
            raise self.fail(key, f"expected a {'non-empty ' if nonempty else ''}list, got {_shown(value)}")
        return (Fields(item, path=self.path, where=f"{self.field(key)}[{i}]", noun=self.noun)
                for i, item in enumerate(value))

    @overload
    def integers(self, key: str, *, minimum: int = 0, optional: Literal[False] = False) -> list[int]: ...
    @overload
    def integers(self, key: str, *, minimum: int = 0, optional: Literal[True]) -> list[int] | None: ...

    def integers(self, key: str, *, minimum: int = 0, optional: bool = False) -> list[int] | None:
        value, settled = self._get(key, optional)
        if settled:
            return value
        if not isinstance(value, list) or not all(
                isinstance(v, int) and not isinstance(v, bool) and minimum <= v <= MAX_INTEGER for v in value):
            raise self.fail(key, f"expected a list of integers in {minimum}..{MAX_INTEGER}")
        return value

    @overload
    def strings(self, key: str, *, optional: Literal[False] = False, nonempty: bool = False,
                default: list[str] | None = None) -> list[str]: ...
    @overload
    def strings(self, key: str, *, optional: Literal[True], nonempty: bool = False,
                default: None = None) -> list[str] | None: ...

    def strings(self, key: str, *, optional: bool = False, nonempty: bool = False,
                default: list[str] | None = None) -> list[str] | None:
        """A list of strings; with `nonempty`, an empty one is refused at its own path (`paths[2]`)."""
        value, settled = self._get(key, optional, default)
        if settled:
            return value
        if not isinstance(value, list):
            raise self.fail(key, "expected a list of strings")
        for i, item in enumerate(value):
            if nonempty and (not isinstance(item, str) or not item):
                raise self.fail(f"{key}[{i}]", f"expected a non-empty string, got {_shown(item)}")
            if not isinstance(item, str):
                raise self.fail(key, "expected a list of strings")
        return value

    @overload
    def mapping_of(self, key: str, kind: type, *, optional: Literal[False] = False) -> dict[str, Any]: ...
    @overload
    def mapping_of(self, key: str, kind: type, *, optional: Literal[True]) -> dict[str, Any] | None: ...

    def mapping_of(self, key: str, kind: type, *, optional: bool = False) -> dict[str, Any] | None:
        """An object whose values are all of one JSON type (counts by name, say)."""
        value, settled = self._get(key, optional)
        if settled:
            return value
        if not isinstance(value, dict) or not all(
                isinstance(v, kind) and not (kind is int and isinstance(v, bool)) for v in value.values()):
            raise self.fail(key, f"expected an object of {kind.__name__} values")
        return value


__all__ = ["Fields", "MAX_INTEGER", "is_integer", "is_number", "is_finite_number", "not_one_of"]
