"""User-facing errors. The CLI turns each into one stderr line and exit code 2.

    KvtuneError                 any user error: bad input, unknown name, impossible request
     ├── InputError             a file or record that cannot be read (logs, configs, startup logs)
     ├── ModelConfigError       a model config that lacks or contradicts what KV arithmetic needs
     ├── UnknownNameError       a preset, GPU, format or field name that does not exist
     ├── CapacityError          settings that cannot serve (nothing fits, impossible TP split)
     └── EndpointError          a server that cannot be reached or answers nonsense
          └── LedgerUnavailableError  the gateways' shared ledger (Redis) failed or timed out

Anything else that escapes is a bug and keeps its traceback.
"""

from __future__ import annotations


class KvtuneError(Exception):
    """A user error, reported as `path:line: field: message` on one line."""

    def __init__(
        self,
        message: str,
        *,
        path: str | None = None,
        line: int | None = None,
        field: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.path = path
        self.line = line
        self.field = field

    def __str__(self) -> str:
        where = []
        if self.path is not None:
            where.append(str(self.path) if self.line is None else f"{self.path}:{self.line}")
        elif self.line is not None:
            where.append(f"line {self.line}")
        if self.field is not None:
            where.append(self.field)
        text = " ".join(self.message.split())  # always one line
        return ": ".join([*where, text])


class InputError(KvtuneError):
    """A file or record that cannot be read."""


class ModelConfigError(KvtuneError):
    """A model config that lacks or contradicts what the KV arithmetic needs."""


class UnknownNameError(KvtuneError):
    """A preset, GPU, format or field name that does not exist."""


class CapacityError(KvtuneError):
    """Settings that cannot serve: nothing fits, or an impossible parallel split."""


class EndpointError(KvtuneError):
    """A server that cannot be reached or answers something kvtune cannot use."""


class LedgerUnavailableError(EndpointError):
    """The gateways' shared ledger (Redis) failed or timed out: treat the operation as not done."""


class OptionError(KvtuneError):
    """A value the caller chose that kvtune cannot use (the field names the option)."""


class RenderError(KvtuneError):
    """A value a deploy file's syntax cannot hold (a route name nginx cannot take as a word)."""


__all__ = [
    "KvtuneError",
    "InputError",
    "ModelConfigError",
    "UnknownNameError",
    "CapacityError",
    "EndpointError",
    "LedgerUnavailableError",
    "OptionError",
    "RenderError",
]
