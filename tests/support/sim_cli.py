"""`kvtune simulate --replay --json` on a log of identical requests: what the simulator tests of
the whole server, the host work and the release's admission rule each drive through the CLI."""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner

from kvtune.cli import cli

MODEL, GPU = "llama-3.1-8b", "H100-80GB"


def uniform_log(path: Path, requests: int, prompt_tokens: int, output_tokens: int,
                finish_reason: str = "stop") -> str:
    """`requests` chat requests all sent at t = 0, each `prompt_tokens` in and `output_tokens` out."""
    row = {"route": "/v1/chat/completions", "prompt_tokens": prompt_tokens, "output_tokens": output_tokens,
           "finish_reason": finish_reason, "timestamp_s": 0.0}
    path.write_text("".join(json.dumps(row) + "\n" for _ in range(requests)))
    return str(path)


def simulate_json(log: str, *args: str) -> dict:
    """simulate's --json of the log replayed on MODEL / GPU."""
    result = CliRunner().invoke(cli, ["simulate", log, "--model", MODEL, "--gpu", GPU, "--replay", "--json", *args],
                                catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)
