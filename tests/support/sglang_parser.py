"""SGLang's own argument parser, run offline in its cached virtualenv, for tests of rendered files.

Why: kvtune renders `python -m sglang.launch_server …`; only SGLang's parser can say whether each
flag exists and what value it becomes. `scripts/setup-sglang-parser.sh` builds the virtualenv
(sglang 0.5.23 with --no-deps, CPU torch); importing sglang costs ~2 s, so every argv of a test
goes through ONE subprocess (tests/support/sglang_parser_child.py).

Interface (import as `from sglang_parser import ...`, as conftest imports vllm_server):

    sglang_python() -> Path | None
        $KVTUNE_SGLANG_VENV/bin/python (default ~/.cache/kvtune/sglang-parser-0.5.23) when the
        venv is complete (its stamp file exists), else None.
    require_sglang_python() -> Path
        The same, or the test is skipped ("run scripts/setup-sglang-parser.sh") — except when the
        `CI` environment variable is set (non-empty): then it fails, so CI can never skip silently.
    parse_sglang(argvs) -> tuple[SglangParser, list[SglangParse]]
        Each argv is what follows `python -m sglang.launch_server`. The parser is built as
        `prepare_server_args` builds it (argparse.ArgumentParser + ServerArgs.add_cli_args), each
        argv parsed, then `ServerArgs.from_cli_args(namespace)`. In 0.5.23 that only builds the
        record: `__post_init__` resolves nothing, device probing and model loading wait for
        `resolve_once()`, which the launcher calls later, so it runs here on CPU without a model.
        Not modelled: `--config FILE` (prepare_server_args merges that YAML into argv first).
    SglangParse: ok, status (2 = argparse error), error (argparse's message), namespace (dest ->
        JSON value), server_args (dest -> value read back from the ServerArgs record, or None with
        server_args_error), and mismatches(expected: {dest: value}) -> list[str] (value AND type).
    SglangParser: version, allow_abbrev (True in 0.5.23), options (every option string ->
        SglangOption(dest, action, type, default, choices, nargs, required, option_strings)),
        option_strings, inexact_options(argv), env_fields (every variable `sglang.srt.environ.Envs`
        declares -> SglangEnvField(kind, default); kind is EnvInt, EnvFloat, EnvBool, …).
    parse_sglang_batch(argvs, envs) -> SglangBatch(parser, results, env_results)
        The same subprocess, also parsing environment mappings ({"SGLANG_X": "1"}, what a rendered
        script exports) each value with its own EnvField.parse: env_results[i][name] is an
        SglangEnvValue(ok, kind, value, error); an undeclared name is not ok. (EnvField.get would
        warn and fall back to the default on a bad value, so a typo there is silent at run time.)
    env_errors(env_result, expected=None) -> list[str]
        One line per variable that is undeclared or does not parse, or (expected given) whose
        parsed value or type differs.
    inexact_options(argv, parser=None) -> list[str]
        Every option token of argv (before a bare `--`, `--opt=value` split at `=`) that is not an
        exact option string: argparse's allow_abbrev accepts `--max-running-req 7` silently, so a
        rendered file must be checked for exact names itself. parser=None reuses the last parser
        parse_sglang returned (or runs one subprocess to get it).

A test that renders sglang-serve.sh:

    calls = script_argv.run_with_stand_ins(script, tmp_path, ["python", "python3"])
    argv = script_argv.after(calls, "-m", "sglang.launch_server")
    parser, (parsed,) = parse_sglang([argv])
    assert parsed.ok, parsed.error
    assert parsed.mismatches({"max_running_requests": 48, "mem_fraction_static": 0.85}) == []
    assert parser.inexact_options(argv) == []

and for its exported environment (the names issue #14 renders are EnvFloat/EnvInt in 0.5.23):

    batch = parse_sglang_batch([argv], [{"SGLANG_MIN_NEW_TOKEN_RATIO_FACTOR": "1"}])
    assert env_errors(batch.env_results[0], {"SGLANG_MIN_NEW_TOKEN_RATIO_FACTOR": 1.0}) == []
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest

SGLANG_VERSION = "0.5.23"
DEFAULT_VENV = Path.home() / ".cache" / "kvtune" / f"sglang-parser-{SGLANG_VERSION}"
SETUP_SCRIPT = "scripts/setup-sglang-parser.sh"
STAMP = ".kvtune-ready"  # written by the setup script once the import check has passed
PARSE_TIMEOUT_S = 180.0
_CHILD = Path(__file__).resolve().parent / "sglang_parser_child.py"
_NEGATIVE_NUMBER = re.compile(r"^-\d+$|^-\d*\.\d+$")  # argparse's own test (_negative_number_matcher)


def _venv() -> Path:
    return Path(os.environ.get("KVTUNE_SGLANG_VENV") or DEFAULT_VENV).expanduser()


def sglang_python() -> Path | None:
    """The SGLang parser venv's python, or None when the venv is missing or half-built."""
    venv = _venv()
    python = venv / "bin" / "python"
    if python.is_file() and (venv / STAMP).is_file():
        return python
    return None


def require_sglang_python() -> Path:
    """The venv's python; a missing venv skips the test, or fails it under CI (CI set)."""
    python = sglang_python()
    if python is not None:
        return python
    message = (f"the SGLang parser virtualenv is missing or incomplete ({_venv()}); run {SETUP_SCRIPT} "
               "(or set KVTUNE_SGLANG_VENV to a finished one)")
    if os.environ.get("CI"):
        pytest.fail(message + "; CI must run these tests, not skip them", pytrace=False)
    pytest.skip(message)


@dataclass(frozen=True, slots=True)
class SglangOption:
    """One argparse action of SGLang's parser, as the parser itself defines it."""

    option_strings: tuple[str, ...]
    dest: str
    action: str  # argparse's class name: _StoreAction, _StoreTrueAction, …
    type: str | None  # the converter's __name__: int, float, str, human_readable_int, …
    default: object
    choices: tuple[object, ...] | None
    nargs: object
    required: bool


@dataclass(frozen=True, slots=True)
class SglangParse:
    """One argv's outcome: argparse's error, or the values it produced."""

    argv: tuple[str, ...]
    ok: bool
    status: int | None = None
    error: str | None = None
    namespace: Mapping[str, object] = field(default_factory=dict)
    server_args: Mapping[str, object] | None = None
    server_args_error: str | None = None

    @property
    def values(self) -> Mapping[str, object]:
        """The ServerArgs record's values, or the Namespace's where the record could not be built."""
        return self.server_args if self.server_args is not None else self.namespace

    def mismatches(self, expected: Mapping[str, object]) -> list[str]:
        """One line per dest whose parsed value differs from `expected` in value or type."""
        if not self.ok:
            return [f"argv was rejected: {self.error}"]
        problems = []
        for dest, want in expected.items():
            if dest not in self.values:
                problems.append(f"{dest}: not a dest of SGLang's parser")
                continue
            got = self.values[dest]
            if type(got) is not type(want) or not _same(got, want):
                problems.append(f"{dest}: expected {want!r} ({type(want).__name__}), "
                                f"parsed {got!r} ({type(got).__name__})")
        return problems


def _same(got: object, want: object) -> bool:
    if isinstance(got, float) and isinstance(want, float):
        return got == want or (math.isnan(got) and math.isnan(want))
    return got == want


@dataclass(frozen=True, slots=True)
class SglangEnvField:
    """One variable declared in sglang.srt.environ.Envs: its EnvField class and default."""

    kind: str
    default: object  # "<computed>" where the default is a function


@dataclass(frozen=True, slots=True)
class SglangEnvValue:
    """One environment variable's value as its own EnvField parsed it, or why it could not."""

    ok: bool
    kind: str | None
    value: object = None
    error: str | None = None


@dataclass(frozen=True, slots=True)
class SglangParser:
    """What SGLang's parser defines: every option string and its action, and its env variables."""

    version: str | None
    allow_abbrev: bool
    options: Mapping[str, SglangOption]  # keyed by every option string
    env_fields: Mapping[str, SglangEnvField] = field(default_factory=dict)

    @property
    def option_strings(self) -> frozenset[str]:
        return frozenset(self.options)

    def inexact_options(self, argv: Iterable[str]) -> list[str]:
        """Option tokens of argv that are not exact option strings (abbreviations, typos)."""
        found = []
        for token in argv:
            if token == "--":
                break
            if len(token) < 2 or not token.startswith("-") or _NEGATIVE_NUMBER.match(token):
                continue
            name = token.split("=", 1)[0]
            if name not in self.options:
                found.append(name)
        return found


@dataclass(frozen=True, slots=True)
class SglangBatch:
    """Everything one subprocess answered: the parser, each argv's parse, each env's parse."""

    parser: SglangParser
    results: list[SglangParse]
    env_results: list[dict[str, SglangEnvValue]]


_last_parser: SglangParser | None = None


def parse_sglang(argvs: Sequence[Sequence[str]]) -> tuple[SglangParser, list[SglangParse]]:
    """Parse every argv with SGLang's parser in one subprocess of the venv."""
    batch = parse_sglang_batch(argvs)
    return batch.parser, batch.results


def parse_sglang_batch(argvs: Sequence[Sequence[str]],
                       envs: Sequence[Mapping[str, str]] = ()) -> SglangBatch:
    """Parse every argv, and every environment mapping, in one subprocess of the venv."""
    global _last_parser
    python = require_sglang_python()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env.update(HF_HUB_OFFLINE="1", CUDA_VISIBLE_DEVICES="", PYTHONNOUSERSITE="1", PYTHONWARNINGS="ignore")
    request = {"argvs": [list(a) for a in argvs], "envs": [dict(e) for e in envs]}
    with tempfile.TemporaryDirectory(prefix="kvtune-sglang-") as folder:
        out = Path(folder) / "parsed.json"
        proc = subprocess.run([str(python), str(_CHILD), str(out)], input=json.dumps(request),
                              capture_output=True, text=True, timeout=PARSE_TIMEOUT_S, env=env, cwd=folder)
        if proc.returncode != 0 or not out.is_file():
            pytest.fail(f"SGLang's parser did not run (exit {proc.returncode}):\n{proc.stderr[-3000:]}",
                        pytrace=False)
        document = json.loads(out.read_text(encoding="utf-8"))
    options: dict[str, SglangOption] = {}
    for row in document["actions"]:
        option = SglangOption(
            option_strings=tuple(row["option_strings"]), dest=row["dest"], action=row["action"],
            type=row["type"], default=row["default"],
            choices=None if row["choices"] is None else tuple(row["choices"]),
            nargs=row["nargs"], required=row["required"])
        for name in option.option_strings:
            options[name] = option
    env_fields = {name: SglangEnvField(kind=row["kind"], default=row["default"])
                  for name, row in document["env_fields"].items()}
    parser = SglangParser(version=document["sglang_version"], allow_abbrev=document["allow_abbrev"],
                          options=options, env_fields=env_fields)
    _last_parser = parser
    results = [
        SglangParse(argv=tuple(argv), ok=row["ok"], status=row.get("status"), error=row.get("error"),
                    namespace=row.get("namespace", {}), server_args=row.get("server_args"),
                    server_args_error=row.get("server_args_error"))
        for argv, row in zip(argvs, document["results"], strict=True)
    ]
    env_results = [
        {name: SglangEnvValue(ok=v["ok"], kind=v["kind"], value=v.get("value"), error=v.get("error"))
         for name, v in row.items()}
        for row in document["env_results"]
    ]
    return SglangBatch(parser=parser, results=results, env_results=env_results)


def env_errors(env_result: Mapping[str, SglangEnvValue], expected: Mapping[str, object] | None = None) -> list[str]:
    """One line per variable that SGLang would not read as meant."""
    problems = []
    for name, parsed in env_result.items():
        if not parsed.ok:
            problems.append(f"{name}: {parsed.error}")
            continue
        if expected is not None and name in expected:
            want = expected[name]
            if type(parsed.value) is not type(want) or not _same(parsed.value, want):
                problems.append(f"{name}: expected {want!r} ({type(want).__name__}), "
                                f"{parsed.kind} parsed {parsed.value!r} ({type(parsed.value).__name__})")
    return problems


def sglang_parser() -> SglangParser:
    """The parser's option table: the last one parse_sglang returned, or one subprocess's worth."""
    if _last_parser is not None:
        return _last_parser
    parser, _ = parse_sglang([])
    return parser


def inexact_options(argv: Iterable[str], parser: SglangParser | None = None) -> list[str]:
    """Option tokens of argv that are not exact option strings of SGLang's parser."""
    return (parser or sglang_parser()).inexact_options(argv)
