"""Typed reading of parsed JSON/YAML objects with the field path in every error.

Every file kvtune reads back (recommendation.json, a saved profile, a capacity file) goes through
one reader so a damaged file is one `InputError` naming the file and the field — `routes[2].
max_new_tokens.value: expected an integer, got "lots"` — instead of a KeyError deep in a check.
Values are validated, never coerced: a bool is not an integer, numbers are finite and in range,
and a quoted value is at most ~80 characters long.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from typing import Any, Literal, overload

from kvtune.errors import InputError
from kvtune.userfiles import brief

#: The largest integer any file or option kvtune reads may hold: exact in a double, so JSON
#: readers, YAML, the rendered Lua and numpy all see the same number. Named once, here.
MAX_INTEGER = 2**53
_MISSING = object()


# The checks every strict reader of kvtune makes (this one, of kvtune's own JSON files, and
# kvtune.gateway.config's of a hand-written gateway.yaml): values are validated, never coerced.

def is_integer(value: Any) -> bool:
    """An int that is not a bool (YAML and JSON `true` are not 1)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    """An int or float that is not a bool (finite or not)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def is_finite_number(value: Any) -> bool:
    return is_number(value) and not (isinstance(value, float) and not math.isfinite(value))


def not_one_of(value: Any, choices: Iterable[str]) -> str | None:
    """Why `value` is none of `choices` (strings), or None when it is one."""
    choices = tuple(choices)
    if isinstance(value, str) and value in choices:
        return None
    return f"{brief(value)} is not one of {', '.join(choices)}"


class Fields:
    """One parsed object at a path in a file; each getter returns a checked value or raises."""

    __slots__ = ("data", "path", "where")

    def __init__(self, data: Any, *, path: str | None, where: str = "") -> None:
        if not isinstance(data, dict):
            raise InputError(f"expected an object, got {brief(data)}", path=path, field=where or None)
        self.data, self.path, self.where = data, path, where

    def field(self, key: str) -> str:
        return f"{self.where}.{key}" if self.where else key

    def fail(self, key: str | None, message: str) -> InputError:
        return InputError(message, path=self.path, field=self.field(key) if key else (self.where or None))

    def _get(self, key: str, optional: bool) -> Any:
        value = self.data.get(key, _MISSING)
        if value is _MISSING:
            if optional:
                return None
            raise self.fail(key, "missing")
        if value is None and not optional:
            raise self.fail(key, "expected a value, got null")
        return value

    def has(self, key: str) -> bool:
        return self.data.get(key) is not None

    @overload
    def obj(self, key: str, *, optional: Literal[False] = False) -> Fields: ...
    @overload
    def obj(self, key: str, *, optional: Literal[True]) -> Fields | None: ...

    def obj(self, key: str, *, optional: bool = False) -> Fields | None:
        value = self._get(key, optional)
        return None if value is None else Fields(value, path=self.path, where=self.field(key))

    @overload
    def integer(self, key: str, *, minimum: int = 0, maximum: int = MAX_INTEGER,
                optional: Literal[False] = False) -> int: ...
    @overload
    def integer(self, key: str, *, minimum: int = 0, maximum: int = MAX_INTEGER,
                optional: Literal[True]) -> int | None: ...

    def integer(self, key: str, *, minimum: int = 0, maximum: int = MAX_INTEGER, optional: bool = False) -> int | None:
        value = self._get(key, optional)
        if value is None:
            return None
        if not is_integer(value):
            raise self.fail(key, f"expected an integer, got {brief(value)}")
        if not minimum <= value <= maximum:
            raise self.fail(key, f"must be in {minimum}..{maximum}, got {brief(value)}")
        return value

    @overload
    def number(self, key: str, *, minimum: float = 0.0, maximum: float = float(MAX_INTEGER),
               optional: Literal[False] = False) -> float: ...
    @overload
    def number(self, key: str, *, minimum: float = 0.0, maximum: float = float(MAX_INTEGER),
               optional: Literal[True]) -> float | None: ...

    def number(self, key: str, *, minimum: float = 0.0, maximum: float = float(MAX_INTEGER),
               optional: bool = False) -> float | None:
        value = self._get(key, optional)
        if value is None:
            return None
        if not is_finite_number(value):
            raise self.fail(key, f"expected a finite number, got {brief(value)}")
        if not minimum <= value <= maximum:
            raise self.fail(key, f"must be in {minimum:g}..{maximum:g}, got {brief(value)}")
        return value

    @overload
    def string(self, key: str, *, optional: Literal[False] = False, nonempty: bool = False) -> str: ...
    @overload
    def string(self, key: str, *, optional: Literal[True], nonempty: bool = False) -> str | None: ...

    def string(self, key: str, *, optional: bool = False, nonempty: bool = False) -> str | None:
        value = self._get(key, optional)
        if value is None:
            return None
        if not isinstance(value, str) or (nonempty and not value):
            raise self.fail(key, f"expected {'a non-empty' if nonempty else 'a'} string, got {brief(value)}")
        return value

    @overload
    def boolean(self, key: str, *, optional: Literal[False] = False) -> bool: ...
    @overload
    def boolean(self, key: str, *, optional: Literal[True]) -> bool | None: ...

    def boolean(self, key: str, *, optional: bool = False) -> bool | None:
        value = self._get(key, optional)
        if value is not None and not isinstance(value, bool):
            raise self.fail(key, f"expected true or false, got {brief(value)}")
        return value

    @overload
    def choice(self, key: str, choices: tuple[str, ...], *, optional: Literal[False] = False) -> str: ...
    @overload
    def choice(self, key: str, choices: tuple[str, ...], *, optional: Literal[True]) -> str | None: ...

    def choice(self, key: str, choices: tuple[str, ...], *, optional: bool = False) -> str | None:
        value = self._get(key, optional)
        problem = None if value is None else not_one_of(value, choices)
        if problem:
            raise self.fail(key, problem)
        return value

    @overload
    def scalar(self, key: str, *, optional: Literal[False] = False) -> int | float | str | bool: ...
    @overload
    def scalar(self, key: str, *, optional: Literal[True]) -> int | float | str | bool | None: ...

    def scalar(self, key: str, *, optional: bool = False) -> int | float | str | bool | None:
        """A JSON scalar of any type (a setting whose type depends on the setting)."""
        value = self._get(key, optional)
        if value is not None and (not isinstance(value, (int, float, str, bool))
                                  or (isinstance(value, float) and not math.isfinite(value))):
            raise self.fail(key, f"expected a number, string or boolean, got {brief(value)}")
        return value

    def items(self, key: str, *, optional: bool = False, nonempty: bool = False) -> Iterator[Fields]:
        """The objects of a list, each at its own path (`routes[3]`)."""
        value = self._get(key, optional)
        if value is None:
            return iter(())
        if not isinstance(value, list) or (nonempty and not value):
            raise self.fail(key, f"expected a {'non-empty ' if nonempty else ''}list, got {brief(value)}")
        return (Fields(item, path=self.path, where=f"{self.field(key)}[{i}]") for i, item in enumerate(value))

    @overload
    def integers(self, key: str, *, minimum: int = 0, optional: Literal[False] = False) -> list[int]: ...
    @overload
    def integers(self, key: str, *, minimum: int = 0, optional: Literal[True]) -> list[int] | None: ...

    def integers(self, key: str, *, minimum: int = 0, optional: bool = False) -> list[int] | None:
        value = self._get(key, optional)
        if value is None:
            return None
        if not isinstance(value, list) or not all(
                isinstance(v, int) and not isinstance(v, bool) and minimum <= v <= MAX_INTEGER for v in value):
            raise self.fail(key, f"expected a list of integers in {minimum}..{MAX_INTEGER}")
        return value

    @overload
    def strings(self, key: str, *, optional: Literal[False] = False) -> list[str]: ...
    @overload
    def strings(self, key: str, *, optional: Literal[True]) -> list[str] | None: ...

    def strings(self, key: str, *, optional: bool = False) -> list[str] | None:
        value = self._get(key, optional)
        if value is None:
            return None
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise self.fail(key, "expected a list of strings")
        return value

    @overload
    def mapping_of(self, key: str, kind: type, *, optional: Literal[False] = False) -> dict[str, Any]: ...
    @overload
    def mapping_of(self, key: str, kind: type, *, optional: Literal[True]) -> dict[str, Any] | None: ...

    def mapping_of(self, key: str, kind: type, *, optional: bool = False) -> dict[str, Any] | None:
        """An object whose values are all of one JSON type (counts by name, say)."""
        value = self._get(key, optional)
        if value is None:
            return None
        if not isinstance(value, dict) or not all(
                isinstance(v, kind) and not (kind is int and isinstance(v, bool)) for v in value.values()):
            raise self.fail(key, f"expected an object of {kind.__name__} values")
        return value


__all__ = ["Fields", "MAX_INTEGER", "is_integer", "is_number", "is_finite_number", "not_one_of"]
