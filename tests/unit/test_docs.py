"""Every command has help with an example, and the README documents it."""

from __future__ import annotations

import pytest
from click.testing import CliRunner
from conftest import REPO

from kvtune.cli import COMMANDS, cli


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_command_help_has_an_example(name):
    result = CliRunner().invoke(cli, [name, "--help"])
    assert result.exit_code == 0, result.output
    assert "Example" in result.output
    assert f"kvtune {name}" in result.output


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_readme_documents_the_command(name):
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert f"### `kvtune {name}" in readme


def test_group_help_lists_every_command():
    result = CliRunner().invoke(cli, ["--help"])
    assert result.exit_code == 0
    for name, (_, _, summary) in COMMANDS.items():
        assert name in result.output
        assert summary.split()[0] in result.output
