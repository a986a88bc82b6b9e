"""Reading the files a user names: regular files only, bounded in size, decoded and parsed strictly.

A path on the command line can name anything: a FIFO that never sends EOF, /dev/zero, a
directory, a YAML alias bomb, a 50 MB file. Every config-like file kvtune reads (gateway.yaml,
deployed files, recommendation.json, capacity files, saved profiles, vLLM startup logs, model
configs) comes through here, so each of those is one clear `InputError` before it can hang the
process or exhaust memory. Log files are read by `kvtune.ingest`, which streams them.

- Only regular files: the path is checked with stat (symlinks followed) before it is opened,
  opened with O_NONBLOCK so a FIFO swapped in between cannot block, and checked again on the
  open descriptor.
- A size cap per kind of file (the constants below), enforced while reading (cap + 1 bytes at
  most), so /proc files and files growing under the reader cannot exceed it either.
- Strict UTF-8 (a vLLM log is the exception: it is read with replacement characters).
- YAML without anchors, aliases, merge keys, duplicate keys or numbers other than plain decimal
  (YAML 1.1's `1:0` = 60, `010` = 8); JSON without duplicate keys, NaN or Infinity in the files
  kvtune writes itself; lone surrogates refused in both.
- `brief(value)`: the one way an error message quotes a value from a file, at most ~80 chars.
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
import reprlib
import stat
from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING, Any, Protocol

from kvtune.errors import InputError

if TYPE_CHECKING:
    from yaml._yaml import Mark as CMark
    from yaml.error import Mark

__all__ = [
    "CONFIG_MAX_BYTES",
    "RECOMMENDATION_MAX_BYTES",
    "CAPACITY_MAX_BYTES",
    "PROFILE_MAX_BYTES",
    "VLLM_LOG_MAX_BYTES",
    "MODEL_FILE_MAX_BYTES",
    "brief",
    "read_bytes",
    "read_head",
    "read_text",
    "load_yaml",
    "parse_yaml",
    "parse_yaml_documents",
    "load_json",
    "parse_json",
]

MiB = 1024**2

#: gateway.yaml, vllm-serve.sh, nginx.conf. kvtune renders ~100 bytes per route, so 4 MiB holds
#: ~40,000 routes, ten times what it renders at its route limit. The cap is this low because
#: PyYAML builds Python objects at only ~1 MB/s (a 50 MB file took over 130 s).
CONFIG_MAX_BYTES = 4 * MiB
#: recommendation.json: ~3 KB per route (a 40-bin histogram each), so ~20,000 routes.
RECOMMENDATION_MAX_BYTES = 64 * MiB
#: A capacity file is one object of 15 fields (~500 bytes).
CAPACITY_MAX_BYTES = 1 * MiB
#: A saved profile holds exact histograms: up to one (value, count) pair per distinct length per
#: route. 256 MiB is thousands of busy routes; json.loads needs ~8× the file size in memory.
PROFILE_MAX_BYTES = 256 * MiB
#: A vLLM server log: the startup lines plus days of request lines; the last capacity wins, so
#: the whole file is read.
VLLM_LOG_MAX_BYTES = 256 * MiB
#: A model's config.json or model.safetensors.index.json (a few MB for the largest checkpoints).
MODEL_FILE_MAX_BYTES = 16 * MiB


# --- quoting values in errors -----------------------------------------------------------------


class _BriefRepr(reprlib.Repr):
    """reprlib with small limits, and ints too long for repr() described by their size."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.maxlevel, self.maxdict, self.maxlist, self.maxtuple = 2, 3, 4, 4
        self.maxset = self.maxfrozenset = self.maxdeque = self.maxarray = 4
        self.maxstring, self.maxother, self.maxlong = limit, limit, limit
        self.fillvalue = "..."

    def repr_int(self, x: int, level: int) -> str:
        if abs(x).bit_length() > 128:  # repr() refuses ints over 4,300 digits, and needs none here
            return f"<an integer of {x.bit_length()} bits>"
        return super().repr_int(x, level)


def brief(value: Any, limit: int = 80) -> str:
    """repr(value) in at most `limit` characters, without ever building the repr of a huge value."""
    text = _BriefRepr(limit).repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# --- reading bytes ----------------------------------------------------------------------------

_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def _not_regular(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def _open_regular(path: str | os.PathLike[str], field: str | None) -> int:
    """A read-only descriptor on a regular file, or an InputError saying what the path is."""
    where = os.fspath(path)
    try:
        mode = os.stat(where).st_mode  # follows symlinks: a link to a FIFO is a FIFO
        if not stat.S_ISREG(mode):
            raise InputError(f"is {_not_regular(mode)}, expected a regular file", path=where, field=field)
        fd = os.open(where, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise InputError("no such file", path=where, field=field) from None
    except OSError as exc:
        raise InputError(f"cannot read: {exc.strerror or exc}", path=where, field=field) from None
    mode = os.fstat(fd).st_mode  # the path may have been replaced between stat and open
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise InputError(f"is {_not_regular(mode)}, expected a regular file", path=where, field=field)
    return fd


def read_bytes(path: str | os.PathLike[str], *, max_bytes: int, field: str | None = None) -> bytes:
    """The whole of a regular file, refused when it holds more than `max_bytes`."""
    where = os.fspath(path)
    fd = _open_regular(where, field)
    too_big = InputError(f"larger than {max_bytes:,} bytes, the limit for this kind of file",
                         path=where, field=field)
    with os.fdopen(fd, "rb") as f:
        if os.fstat(f.fileno()).st_size > max_bytes:
            raise too_big  # without reading it
        try:
            data = f.read(max_bytes + 1)  # +1: a file that grew, or a /proc file of size 0
        except OSError as exc:
            raise InputError(f"cannot read: {exc.strerror or exc}", path=where, field=field) from None
    if len(data) > max_bytes:
        raise too_big
    return data


def read_head(path: str | os.PathLike[str], size: int) -> bytes | None:
    """The first `size` bytes of a regular file; None for anything else (for sniffing a file's kind)."""
    try:
        fd = _open_regular(path, None)
    except InputError:
        return None
    with os.fdopen(fd, "rb") as f:
        try:
            return f.read(size)
        except OSError:
            return None


def read_text(path: str | os.PathLike[str], *, max_bytes: int, field: str | None = None,
              errors: str = "strict") -> str:
    """A regular file as UTF-8 text; invalid UTF-8 is an InputError naming its line (unless `errors`)."""
    data = read_bytes(path, max_bytes=max_bytes, field=field)
    try:
        return data.decode("utf-8", errors)
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise InputError(f"not UTF-8 text: byte {data[exc.start]:#04x} at offset {exc.start}",
                         path=os.fspath(path), line=line, field=field) from None


#: Python's int() refuses longer decimal strings (sys.get_int_max_str_digits); no field needs them.
_MAX_DIGITS = 4300

_SURROGATE = re.compile("[\ud800-\udfff]")


def _refuse_lone_surrogates(data: Any, where: str) -> None:
    """Strings from escapes such as "\\ud800" are not Unicode text and cannot be printed."""
    stack = [data]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            if _SURROGATE.search(item):
                raise InputError(f"a string holds a lone UTF-16 surrogate: {brief(item)}", path=where)
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)


# --- YAML -------------------------------------------------------------------------------------


class _RefusedYAML(Exception):
    """Valid YAML that kvtune's files never need and will not read."""

    def __init__(self, problem: str, mark: Mark | CMark | None) -> None:
        super().__init__(problem)
        self.problem, self.line = problem, None if mark is None else mark.line + 1


class _Loader(Protocol):
    """The one loader method parse_yaml uses, besides dispose."""

    def get_single_data(self) -> Any: ...

    def check_data(self) -> bool: ...

    def get_data(self) -> Any: ...

    def dispose(self) -> None: ...


# PyYAML reads YAML 1.1, where `1:0` is 60 (base 60), `010` is 8, `0b11`, `0x10` and `1_000` are
# numbers; YAML 1.2's core schema reads the first as a string and `010` as 10. Only plain decimal
# means the same in both, so anything else is refused rather than read one way or the other.
_DECIMAL_INT = re.compile(r"[-+]?(?:0|[1-9][0-9]*)")


def _not_decimal(text: object) -> str:
    return (f"the number {brief(text)} is not plain decimal (YAML 1.1 reads 1:0 as 60, 010 as 8, "
            "1_000 as 1000); write it in decimal digits, or quote it if it is text")


@functools.cache
def _strict_loader() -> Callable[[str], _Loader]:
    """PyYAML's safe loader without anchors, aliases, merge keys or duplicate keys (built on first
    use, so importing this module does not import yaml)."""
    import yaml
    from yaml.composer import Composer
    from yaml.constructor import ConstructorError, SafeConstructor
    from yaml.nodes import MappingNode, Node, ScalarNode
    from yaml.resolver import Resolver

    class StrictConstructor(SafeConstructor):
        """Mappings without duplicate keys (the second would silently win) or `<<` merge keys."""

        def construct_mapping(self, node: MappingNode, deep: bool = False) -> dict[Hashable, Any]:
            if not isinstance(node, yaml.MappingNode):
                raise ConstructorError(None, None, f"expected a mapping, found {node.id}", node.start_mark)
            mapping: dict[Hashable, Any] = {}
            lines: dict[Hashable, int] = {}
            for key_node, value_node in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    raise _RefusedYAML("merge keys (<<) are not allowed", key_node.start_mark)
                key = self.construct_object(key_node, deep=deep)
                try:
                    seen = key in mapping
                except TypeError:
                    raise ConstructorError("while constructing a mapping", node.start_mark,
                                           "found an unhashable key", key_node.start_mark) from None
                if seen:
                    raise _RefusedYAML(f"duplicate key {brief(key)} (first at line {lines[key]})",
                                       key_node.start_mark)
                lines[key] = key_node.start_mark.line + 1
                mapping[key] = self.construct_object(value_node, deep=deep)
            return mapping

        def construct_yaml_int(self, node: ScalarNode) -> int:
            digits = len(str(node.value))
            if digits > _MAX_DIGITS:
                raise _RefusedYAML(f"an integer of {digits:,} digits", node.start_mark)
            if not _DECIMAL_INT.fullmatch(str(node.value)):
                raise _RefusedYAML(_not_decimal(node.value), node.start_mark)
            return super().construct_yaml_int(node)

        def construct_yaml_float(self, node: ScalarNode) -> float:
            if any(c in str(node.value) for c in ":_"):
                raise _RefusedYAML(_not_decimal(node.value), node.start_mark)
            return super().construct_yaml_float(node)

        # what add_constructor("tag:yaml.org,2002:int", construct_yaml_int) does: a copy of the
        # inherited table with those entries replaced
        yaml_constructors = {**SafeConstructor.yaml_constructors, "tag:yaml.org,2002:int": construct_yaml_int,
                             "tag:yaml.org,2002:float": construct_yaml_float}

    # libyaml scans and parses in C; composing stays in Python (Composer comes first), where
    # aliases are refused
    if TYPE_CHECKING:  # the Python fallback below has the same interface
        from yaml._yaml import CParser
    else:
        try:
            from yaml._yaml import CParser
        except ImportError:  # pragma: no cover - PyYAML built without libyaml
            from yaml.parser import Parser
            from yaml.reader import Reader
            from yaml.scanner import Scanner

            class PythonParser(Reader, Scanner, Parser):
                def __init__(self, stream: str) -> None:
                    Reader.__init__(self, stream)
                    Scanner.__init__(self)
                    Parser.__init__(self)

            CParser = PythonParser

    class StrictLoader(Composer, CParser, StrictConstructor, Resolver):
        def __init__(self, stream: str) -> None:
            CParser.__init__(self, stream)
            Composer.__init__(self)
            StrictConstructor.__init__(self)
            Resolver.__init__(self)

        def compose_node(self, parent: Node | None, index: int) -> Node | None:
            """No anchors or aliases: a few lines of aliases expand to gigabytes (billion laughs)."""
            event = self.peek_event()
            if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None) is not None:
                anchor = getattr(event, "anchor", None)
                raise _RefusedYAML(f"anchors and aliases are not allowed (&{anchor} / *{anchor}); "
                                   "write each value out", None if event is None else event.start_mark)
            return super().compose_node(parent, index)

    return StrictLoader


def parse_yaml(text: str, *, path: str) -> Any:
    """One YAML document, strictly (see the module docstring); errors name the file and line."""
    return _parse_yaml(text, path, lambda loader: loader.get_single_data())


def parse_yaml_documents(text: str, *, path: str) -> list[Any]:
    """Every document of a multi-document YAML stream (`---` between them, as Kubernetes manifests
    are written), each read as strictly as parse_yaml reads one."""

    def every(loader: _Loader) -> list[Any]:
        documents = []
        while loader.check_data():
            documents.append(loader.get_data())
        return documents

    return _parse_yaml(text, path, every)


def _parse_yaml(text: str, path: str, read: Callable[[_Loader], Any]) -> Any:
    import yaml

    loader = _strict_loader()(text)
    try:
        data = read(loader)
    except _RefusedYAML as exc:
        raise InputError(f"unsupported YAML: {exc.problem}", path=path, line=exc.line) from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        raise InputError(f"not valid YAML: {getattr(exc, 'problem', None) or exc}", path=path,
                         line=mark.line + 1 if mark else None) from None
    except ValueError as exc:  # a constructor's, e.g. the date 2024-13-45
        raise InputError(f"not valid YAML: {str(exc)[:120]}", path=path) from None
    except RecursionError:
        raise InputError("not valid YAML: nested too deeply", path=path) from None
    finally:
        loader.dispose()
    _refuse_lone_surrogates(data, path)
    return data


def load_yaml(path: str | os.PathLike[str], *, max_bytes: int = CONFIG_MAX_BYTES, field: str | None = None) -> Any:
    """Read a regular file (at most `max_bytes`) and parse it with `parse_yaml`."""
    return parse_yaml(read_text(path, max_bytes=max_bytes, field=field), path=os.fspath(path))


# --- JSON -------------------------------------------------------------------------------------


class _RefusedJSON(ValueError):
    """Valid JSON (to Python's json) that a file kvtune writes never holds."""


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    data: dict[str, Any] = {}
    for key, value in pairs:
        if key in data:
            raise _RefusedJSON(f"duplicate key {brief(key)}")
        data[key] = value
    return data


def _bounded_int(text: str) -> int:
    if len(text) > _MAX_DIGITS:
        raise _RefusedJSON(f"an integer of {len(text):,} digits")
    return int(text)


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _RefusedJSON(f"number {brief(text)} is out of range")
    return value


def _no_constant(name: str) -> Any:
    raise _RefusedJSON(f"{name} is not JSON")


_ESCAPED_SURROGATE = re.compile(r"\\u[dD][89a-fA-F]")


def parse_json(text: str, *, path: str, strict: bool = True) -> Any:
    """JSON; `strict` (files kvtune writes) refuses duplicate keys, NaN, Infinity and 1e400."""
    try:
        if strict:
            data = json.loads(text, object_pairs_hook=_unique_keys, parse_float=_finite,
                              parse_int=_bounded_int, parse_constant=_no_constant)
        else:
            data = json.loads(text, parse_int=_bounded_int)
    except json.JSONDecodeError as exc:
        raise InputError(f"invalid JSON: {exc.msg} (column {exc.colno})", path=path, line=exc.lineno) from None
    except _RefusedJSON as exc:
        raise InputError(f"invalid JSON: {exc}", path=path) from None
    except RecursionError:
        raise InputError("invalid JSON: nested too deeply", path=path) from None
    if _ESCAPED_SURROGATE.search(text):  # only escapes can make a lone surrogate in decoded text
        _refuse_lone_surrogates(data, path)
    return data


def load_json(path: str | os.PathLike[str], *, max_bytes: int, field: str | None = None, strict: bool = True) -> Any:
    """Read a regular file (at most `max_bytes`) and parse it with `parse_json`."""
    return parse_json(read_text(path, max_bytes=max_bytes, field=field), path=os.fspath(path), strict=strict)
