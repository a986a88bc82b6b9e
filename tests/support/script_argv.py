"""Run a rendered launch script with bash, its engine binaries replaced by recording stand-ins.

Why: the argv an engine would get is what bash makes of the script (quoting, variables, "$@"), not
what a regex reads from it; tests/live/test_vllm_args.py does the same for vllm-serve.sh.

    run_with_stand_ins(script, tmp_path, programs, *, args=(), env=None) -> list[Call]
        Writes the script to tmp_path, puts a stand-in for each name in `programs` (e.g.
        ["python", "python3"] for sglang-serve.sh, ["trtllm-serve"] for trtllm-serve.sh) first on
        PATH, runs `bash script *args`, and returns every stand-in call in order. A stand-in
        records its argv and exits 0, so an `exec` line ends the script as the real one would.
    after(calls, *prefix) -> list[str]
        The argv of the first call whose argv starts with `prefix`, without the prefix:
        after(calls, "-m", "sglang.launch_server") is what SGLang's parser must accept.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

_STAND_IN = """#!{python}
import json, os, sys
with open(os.environ["KVTUNE_STAND_IN_LOG"], "a", encoding="utf-8") as log:
    env = {{k: v for k, v in os.environ.items() if k.startswith(("SGLANG_", "TRTLLM_"))}}
    log.write(json.dumps({{"program": {name!r}, "argv": sys.argv[1:], "env": env}}) + "\\n")
"""


@dataclass(frozen=True, slots=True)
class Call:
    """One run of a stand-in: which program the script called, with what argv."""

    program: str
    argv: tuple[str, ...]
    env: Mapping[str, str] = field(default_factory=dict)  # the SGLANG_* / TRTLLM_* variables it saw


def run_with_stand_ins(script: str, tmp_path: Path, programs: Sequence[str], *, args: Sequence[str] = (),
                       env: Mapping[str, str] | None = None, timeout_s: float = 30.0) -> list[Call]:
    """Every stand-in call the script makes when bash runs it; fails on a non-zero exit."""
    bindir = tmp_path / "stand-in-bin"
    bindir.mkdir(exist_ok=True)
    for name in programs:
        path = bindir / name
        path.write_text(_STAND_IN.format(python=sys.executable, name=name), encoding="utf-8")
        path.chmod(0o755)
    log = tmp_path / "stand-in-calls.jsonl"
    log.write_text("", encoding="utf-8")
    script_path = tmp_path / "launch.sh"
    script_path.write_text(script, encoding="utf-8")
    inherited = {k: v for k, v in os.environ.items() if not k.startswith(("SGLANG_", "TRTLLM_"))}
    run_env = {**inherited, **(env or {}), "PATH": f"{bindir}:{os.environ['PATH']}",
               "KVTUNE_STAND_IN_LOG": str(log)}
    proc = subprocess.run(["bash", str(script_path), *args], capture_output=True, text=True, env=run_env,
                          timeout=timeout_s, cwd=tmp_path)
    assert proc.returncode == 0, f"the script exited {proc.returncode}:\n{proc.stderr[-2000:]}"
    calls = []
    for line in log.read_text(encoding="utf-8").splitlines():
        row = json.loads(line)
        calls.append(Call(program=row["program"], argv=tuple(row["argv"]), env=row.get("env", {})))
    return calls


def after(calls: Sequence[Call], *prefix: str) -> list[str]:
    """The argv after `prefix` of the first call that starts with it."""
    for call in calls:
        if call.argv[: len(prefix)] == prefix:
            return list(call.argv[len(prefix):])
    raise AssertionError(f"no stand-in call starts with {list(prefix)}: {calls}")
