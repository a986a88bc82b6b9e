"""Every file a command's --help cites from this repository exists (issue #25, item 12:
`profile --help` cited sample_logs/openai_chat.jsonl, which never existed). A cited path is a
token whose first component is a directory of the repository (sample_logs/, tests/, scripts/,
...); paths a command writes (deploy/, out/) or placeholders (logs/) name no such directory."""

from __future__ import annotations

import re
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from kvtune.cli import cli

REPO = Path(__file__).resolve().parents[2]
PATH_TOKEN = re.compile(r"(?<![\w/:.~-])[\w.-]+/[\w./*-]*")


def _commands(group: click.Group, ctx: click.Context, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    out = [prefix]
    for name in group.list_commands(ctx):
        sub = group.get_command(ctx, name)
        out += _commands(sub, ctx, (*prefix, name)) if isinstance(sub, click.Group) else [(*prefix, name)]
    return out


COMMANDS = _commands(cli, click.Context(cli))


def cited_paths(text: str) -> list[str]:
    """Tokens of `text` under a directory of the repository, trailing punctuation dropped."""
    out = []
    for token in PATH_TOKEN.findall(text):
        token = token.rstrip(".,;:")
        if (REPO / token.split("/", 1)[0]).is_dir():
            out.append(token)
    return out


def test_every_command_is_walked():
    assert {"profile", "recommend", "check", "bench", "simulate", "gateway"} <= {c[0] for c in COMMANDS if c}


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: " ".join(c) or "kvtune")
def test_every_path_a_help_cites_exists(command):
    result = CliRunner(env={"COLUMNS": "1000"}).invoke(cli, [*command, "--help"])
    assert result.exit_code == 0, result.output
    missing = [p for p in cited_paths(result.output) if not list(REPO.glob(p))]
    assert not missing, f"kvtune {' '.join(command)} --help cites {missing}, which do not exist"


def test_the_help_cites_sample_logs():
    # the class is not empty: the examples do cite repository files
    text = CliRunner(env={"COLUMNS": "1000"}).invoke(cli, ["profile", "--help"]).output
    assert cited_paths(text) == ["sample_logs/openai_chat_pairs.jsonl"]
