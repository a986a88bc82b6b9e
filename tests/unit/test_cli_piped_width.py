"""Piped output is never squeezed into 80 columns (issue #25, item 12): with stdout a pipe and no
$COLUMNS, every route name appears whole in every command that prints routes; $COLUMNS, when
set, is the width."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SAMPLES = str(REPO / "sample_logs")


def piped(*args: str, columns: str | None = None) -> str:
    """`python -m kvtune ARGS` with stdin, stdout and stderr no terminal, $COLUMNS as given."""
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    if columns is not None:
        env["COLUMNS"] = columns
    done = subprocess.run([sys.executable, "-m", "kvtune", *args], cwd=REPO, env=env, stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.fixture(scope="module")
def routes() -> list[str]:
    names = [r["route"] for r in json.loads(piped("profile", SAMPLES, "--json"))["routes"]]
    assert {"/v1/chat/completions", "/v1/code/completions"} <= set(names)
    return names


@pytest.mark.parametrize("args", [
    ("profile", SAMPLES),
    ("recommend", SAMPLES, "--model", "llama-3.1-8b", "--gpu", "H100-80GB"),
], ids=["profile", "recommend"])
def test_every_route_name_appears_whole_in_a_pipe(routes, args):
    out = piped(*args)
    table_rows = [line for line in out.splitlines() if line.startswith(("│", "┃"))]
    for name in routes:
        assert any(f" {name} " in line for line in table_rows), (name, out[:3000])
    assert "…" not in out


def test_columns_is_the_width_of_a_pipe_when_set():
    out = piped("recommend", SAMPLES, "--model", "llama-3.1-8b", "--gpu", "H100-80GB", columns="100")
    assert max(len(line) for line in out.splitlines()) <= 100
