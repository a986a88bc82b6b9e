"""Typed reads from a config.json dict; every error names the file and the field path.

Not kvtune.domain.fields.Fields, which reads kvtune's own files strictly: configs come from many
writers, so a key has aliases, a whole float is an integer, and errors are ModelConfigErrors.
"""

from __future__ import annotations

import json
import math
from typing import Any

from kvtune.errors import ModelConfigError
from kvtune.userfiles import brief


def shown(value: Any) -> str:
    """A config value quoted in an error: JSON as the file spells it, about 40 characters at most,
    never built in full (a value can be a list of millions)."""
    if isinstance(value, str):
        return json.dumps(value if len(value) <= 40 else value[:37] + "...")
    if isinstance(value, (bool, float)) or value is None or (isinstance(value, int) and value.bit_length() <= 128):
        return json.dumps(value)
    return brief(value, 40)


class ConfigFields:
    """Typed reads from one config dict; every error names the file and the field path."""

    def __init__(self, data: dict[str, Any], *, path: str | None, prefix: str = "") -> None:
        self.data = data
        self.path = path
        self.prefix = prefix

    def error(self, key: str, message: str) -> ModelConfigError:
        return ModelConfigError(message, path=self.path, field=self.prefix + key)

    def has(self, key: str) -> bool:
        return self.data.get(key) is not None

    def first(self, *keys: str) -> str | None:
        """The first of `keys` present with a non-null value."""
        return next((k for k in keys if self.data.get(k) is not None), None)

    def int_(self, *keys: str, minimum: int = 0) -> int | None:
        """The first present key as an integer ≥ minimum; floats only when whole and finite."""
        key = self.first(*keys)
        if key is None:
            return None
        value = self.data[key]
        if isinstance(value, bool):
            raise self.error(key, f"expected an integer, found {shown(value)}")
        if isinstance(value, float):
            if not math.isfinite(value) or not value.is_integer():
                raise self.error(key, f"expected an integer, found {value!r}")
            value = int(value)
        if not isinstance(value, int):
            raise self.error(key, f"expected an integer, found {shown(value)}")
        if value < minimum:
            raise self.error(key, f"must be at least {minimum}, found {value}")
        return value

    def require_int(self, *keys: str, minimum: int = 1, what: str) -> int:
        value = self.int_(*keys, minimum=minimum)
        if value is None:
            raise ModelConfigError(
                f"missing {what} (looked for {', '.join(keys)})", path=self.path, field=self.prefix + keys[0]
            )
        return value

    def str_(self, *keys: str) -> str | None:
        key = self.first(*keys)
        if key is None:
            return None
        value = self.data[key]
        if not isinstance(value, str):
            raise self.error(key, f"expected a string, found {shown(value)}")
        return value

    def bool_(self, key: str, default: bool) -> bool:
        value = self.data.get(key)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise self.error(key, f"expected true or false, found {shown(value)}")
        return value

    def list_(self, key: str) -> list[Any] | None:
        value = self.data.get(key)
        if value is None:
            return None
        if not isinstance(value, list):
            raise self.error(key, f"expected a list, found {shown(value)}")
        return value
