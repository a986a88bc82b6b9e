"""Runs inside the SGLang parser virtualenv (scripts/setup-sglang-parser.sh), never in kvtune's.

Reads {"argvs": [...], "envs": [{NAME: VALUE}, ...]} as JSON on stdin, writes one JSON document to
the path in argv[1]: the parser's actions (every option string with its dest, action kind, type,
default, choices), for each argv the parsed values or argparse's error, and for each environment
mapping each variable parsed by its own `sglang.srt.environ.Envs` field (EnvInt, EnvFloat, EnvBool,
…) or the reason it cannot be. tests/support/sglang_parser.py is its only caller.

The parser is built as `sglang.srt.server_args.prepare_server_args` builds it (a plain
`argparse.ArgumentParser` plus `ServerArgs.add_cli_args`), with `error`/`exit` raising instead of
exiting so one process can parse many argvs.
"""

from __future__ import annotations

import argparse
import contextlib
import enum
import io
import json
import math
import pathlib
import sys
import traceback


class _ParseError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class _RaisingParser(argparse.ArgumentParser):
    """argparse.ArgumentParser as SGLang builds it, but reporting instead of exiting."""

    def error(self, message: str):
        raise _ParseError(2, message)

    def exit(self, status: int = 0, message: str | None = None):
        raise _ParseError(status, message or "")


def _jsonable(value):
    """JSON for what a ServerArgs field can hold; anything else as its repr, flagged."""
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else {"float": repr(value)}
    if isinstance(value, enum.Enum):
        return _jsonable(value.value)
    if isinstance(value, pathlib.PurePath):
        return str(value)
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, set | frozenset):
        return sorted((_jsonable(v) for v in value), key=repr)
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    return {"repr": repr(value)}


def _type_name(action: argparse.Action) -> str | None:
    kind = action.type
    if kind is None:
        return None
    return getattr(kind, "__name__", repr(kind))


def _actions(parser: argparse.ArgumentParser) -> list[dict]:
    rows = []
    for action in parser._actions:
        if not action.option_strings:
            continue
        rows.append({
            "option_strings": list(action.option_strings),
            "dest": action.dest,
            "action": type(action).__name__,
            "type": _type_name(action),
            "default": _jsonable(action.default),
            "choices": None if action.choices is None else [_jsonable(c) for c in action.choices],
            "nargs": action.nargs,
            "required": action.required,
        })
    return rows


def _parse_one(parser: argparse.ArgumentParser, server_args_cls, argv: list[str]) -> dict:
    noise = io.StringIO()
    try:
        with contextlib.redirect_stdout(noise), contextlib.redirect_stderr(noise):
            namespace = parser.parse_args(argv)
    except _ParseError as exc:
        return {"ok": False, "status": exc.status, "error": exc.message}
    result: dict = {"ok": True, "namespace": _jsonable(vars(namespace))}
    # from_cli_args only builds the record (ServerArgs.__post_init__ resolves nothing in 0.5.23;
    # device probing and model loading wait for resolve_once, which the launcher calls later).
    try:
        with contextlib.redirect_stdout(noise), contextlib.redirect_stderr(noise):
            record = server_args_cls.from_cli_args(namespace)
    except Exception as exc:  # reported to the test, which decides
        result["server_args"] = None
        result["server_args_error"] = f"{type(exc).__name__}: {exc}"
        result["server_args_traceback"] = traceback.format_exc(limit=5)
    else:
        result["server_args"] = {
            dest: _jsonable(getattr(record, dest)) for dest in vars(namespace) if hasattr(record, dest)
        }
    return result


def _env_fields(environ_module) -> dict:
    """Envs' declared variables: name -> its EnvField (the class attributes of Envs)."""
    return {name: value for name, value in vars(type(environ_module.envs)).items()
            if isinstance(value, environ_module.EnvField)}


def _parse_env(fields: dict, env: dict) -> dict:
    parsed = {}
    for name, raw in env.items():
        env_field = fields.get(name)
        if env_field is None:
            parsed[name] = {"ok": False, "kind": None, "error": "not declared in sglang.srt.environ.Envs"}
            continue
        try:
            value = env_field.parse(raw)
        except ValueError as exc:  # EnvField.get would warn and fall back to the default
            parsed[name] = {"ok": False, "kind": type(env_field).__name__, "error": str(exc)}
        else:
            parsed[name] = {"ok": True, "kind": type(env_field).__name__, "value": _jsonable(value)}
    return parsed


def _env_table(fields: dict) -> dict:
    return {name: {"kind": type(f).__name__,
                   "default": "<computed>" if callable(f.default) else _jsonable(f.default)}
            for name, f in fields.items()}


def main() -> int:
    out_path = pathlib.Path(sys.argv[1])
    request = json.load(sys.stdin)
    argvs, envs = request["argvs"], request["envs"]
    noise = io.StringIO()
    with contextlib.redirect_stdout(noise):
        import sglang
        from sglang.srt import environ
        from sglang.srt.server_args import ServerArgs

        parser = _RaisingParser(prog="sglang serve")
        ServerArgs.add_cli_args(parser)
    document = {
        "sglang_version": getattr(sglang, "__version__", None),
        "allow_abbrev": parser.allow_abbrev,
        "actions": _actions(parser),
        "results": [_parse_one(parser, ServerArgs, list(argv)) for argv in argvs],
        "env_fields": _env_table(_env_fields(environ)),
        "env_results": [_parse_env(_env_fields(environ), dict(env)) for env in envs],
    }
    out_path.write_text(json.dumps(document), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
