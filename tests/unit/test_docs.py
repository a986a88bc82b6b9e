"""Every command has help with an example; the docs site documents every command and option (the
CLI reference is generated from the commands), its command examples name real options and run,
and `mkdocs build --strict` passes; the README stays a short front door."""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import click
import pytest
from click.testing import CliRunner
from conftest import REPO

from kvtune.cli import COMMANDS, cli

DOCS = REPO / "docs"
GUIDES = DOCS / "guides"


def _docs_reference():
    spec = importlib.util.spec_from_file_location("docs_reference", REPO / "scripts" / "docs_reference.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


docs_reference = _docs_reference()


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_command_help_has_an_example(name):
    result = CliRunner().invoke(cli, [name, "--help"])
    assert result.exit_code == 0, result.output
    assert "Example" in result.output
    assert f"kvtune {name}" in result.output


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_a_guide_documents_the_command(name):
    guides = "\n".join(p.read_text(encoding="utf-8") for p in sorted(GUIDES.glob("*.md")))
    assert f"## `kvtune {name}" in guides


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_the_generated_reference_holds_every_option_of_the_command(name):
    reference = docs_reference.cli_reference()
    section = reference.split(f"## `kvtune {name}`\n", 1)[1].split("\n## `kvtune ", 1)[0]
    assert docs_reference.command_help(name) in section  # --help verbatim
    options = docs_reference.visible_options(name)
    assert options
    for option in options:
        for flag in option.opts + option.secondary_opts:
            assert f"`{flag}`" in section, flag
    rows = [line for line in section.splitlines() if line.startswith("| `-")]
    assert len(rows) == len(options)


@pytest.mark.parametrize("name", ["simulate", "kv"])
def test_the_generated_reference_is_what_kvtune_help_prints(name):
    result = subprocess.run([sys.executable, "-m", "kvtune", name, "--help"], env={**os.environ, "COLUMNS": "200"},
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout == docs_reference.command_help(name) + "\n"


def test_the_api_reference_documents_every_exported_name():
    import kvtune

    reference = docs_reference.api_reference()
    for name in kvtune.__all__:
        assert f"## `kvtune.{name}`" in reference, name
    assert (inspect_doc := kvtune.recommend.__doc__) and inspect_doc.strip().splitlines()[0] in reference


def test_the_pages_hold_the_generation_markers():
    assert docs_reference.CLI_MARKER in (DOCS / "reference" / "cli.md").read_text(encoding="utf-8")
    assert docs_reference.API_MARKER in (DOCS / "reference" / "api.md").read_text(encoding="utf-8")


def test_group_help_lists_every_command():
    result = CliRunner().invoke(cli, ["--help"])
    assert result.exit_code == 0
    for name, (_, _, summary) in COMMANDS.items():
        assert name in result.output
        assert summary.split()[0] in result.output


# --- the command examples in the docs ------------------------------------------------------------

def doc_examples(page: Path) -> list[tuple[int, list[str], str | None]]:
    """The `kvtune …` command lines in a page's code blocks (`$ kvtune …` anywhere, `kvtune …` in a
    bash block), continuation lines joined: (line, argv after `kvtune`, file stdout goes to)."""
    return [(number, argv, stdout_to) for number, argv, stdout_to, _ in doc_examples_shown(page)]


def doc_examples_shown(page: Path) -> list[tuple[int, list[str], str | None, str]]:
    """doc_examples with the line the page shows under each command (its output), or ''."""
    lines = page.read_text(encoding="utf-8").splitlines()
    return [(number, argv, stdout_to, _shown_under(lines, end)) for number, argv, stdout_to, end in _examples(lines)]


def _shown_under(lines: list[str], end: int) -> str:
    after = lines[end] if end < len(lines) else "```"
    return "" if after.startswith(("```", "$ ")) else after


def _examples(lines: list[str]) -> list[tuple[int, list[str], str | None, int]]:
    found: list[tuple[int, list[str], str | None, int]] = []
    fence: str | None = None
    pending: tuple[int, str] | None = None
    for number, line in enumerate(lines, 1):
        if line.startswith("```"):
            fence = None if fence is not None else line[3:].strip()
            continue
        if fence is None:
            continue
        text = line.strip()
        if pending is not None:
            start, joined = pending
            pending = (start, joined + " " + text.rstrip("\\"))
            if not text.endswith("\\"):
                found.append((*_example(*pending), number))
                pending = None
            continue
        command = text[2:] if text.startswith("$ kvtune ") else text if fence in ("bash", "sh") else ""
        if not command.startswith("kvtune "):
            continue
        if text.endswith("\\"):
            pending = (number, command.rstrip("\\"))
        else:
            found.append((*_example(number, command), number))
    return found


def _example(number: int, command: str) -> tuple[int, list[str], str | None]:
    words = shlex.split(command, comments=True)
    stdout_to = None
    for stop in ("|", "&", ">"):
        if stop in words:
            cut = words.index(stop)
            if stop == ">":
                stdout_to = words[cut + 1]
            words = words[:cut]
    return number, words[1:], stdout_to


PAGES = [REPO / "README.md", *sorted(DOCS.rglob("*.md"))]  # the README's quickstart too
EXAMPLES = [(page, number, argv, stdout_to) for page in PAGES for number, argv, stdout_to in doc_examples(page)]


def test_the_docs_hold_command_examples():
    assert len(EXAMPLES) >= 40
    assert {argv[0] for _, _, argv, _ in EXAMPLES} == set(COMMANDS)


def _command(name: str) -> click.Command:
    command = cli.get_command(click.Context(cli), name)
    assert command is not None, f"kvtune has no command {name!r}"
    return command


@pytest.mark.parametrize(("page", "number", "argv", "stdout_to"), EXAMPLES,
                         ids=[f"{p.relative_to(REPO)}:{n}" for p, n, _, _ in EXAMPLES])
def test_every_command_example_names_options_the_command_has(page, number, argv, stdout_to):
    command = _command(argv[0])
    flags = {"--help"}
    for option in docs_reference.visible_options(argv[0]):
        flags.update(option.opts + option.secondary_opts)
    for word in argv[1:]:
        if word.startswith("-") and word != "-" and not re.fullmatch(r"-\d.*", word):
            assert word.split("=", 1)[0] in flags, f"{page.name}:{number}: kvtune {argv[0]} has no {word}"
    assert isinstance(command, click.Command)


# Examples that need what this machine has not: a server, an object store or Ray cluster, a model
# only the hub has, a file the reader brings. Each page's examples run in order in one directory
# holding sample_logs/ and tests/, so a page's later examples read what its earlier ones wrote.
_ELSEWHERE = re.compile(r"^(https?|s3|gs|az|abfs|hf|memory)://|^~|^meta-llama/|^logs/")
_OUTPUTS = {"--out", "--save"}


def _runs_here(argv: list[str], cwd: Path) -> bool:
    if argv[0] in ("gateway", "bench") or "--ray" in argv or any(a.startswith("--ray=") for a in argv):
        return False
    for before, word in zip(["kvtune", *argv], argv, strict=False):
        if _ELSEWHERE.search(word):
            return False
        if before in _OUTPUTS or word.startswith("-"):
            continue
        if ("/" in word or re.search(r"\.(jsonl?|sh|ya?ml|log|csv|parquet)$", word)) and not (cwd / word).exists():
            return False
    return True


RUNNABLE_PAGES = sorted({page for page, _, argv, _ in EXAMPLES if _runs_here(argv, REPO)})


# recommend --objective on the CPU test bed simulates 1,000 requests, 3 seeds, every row, as shown (~50 s)
SLOW_PAGES = {DOCS / "guides" / "simulate-and-objectives.md"}


@pytest.mark.parametrize("page", [pytest.param(p, marks=pytest.mark.slow) if p in SLOW_PAGES else p
                                  for p in RUNNABLE_PAGES], ids=[str(p.relative_to(REPO)) for p in RUNNABLE_PAGES])
def test_the_command_examples_run(page, tmp_path, monkeypatch):
    """Every example whose inputs are here runs as written: exit 0, or 1 where the docs show a
    verdict (a risky check); an example shown with its `Error:` line prints that line and exits 2,
    or 1 for advice refused. Never a traceback."""
    (tmp_path / "sample_logs").symlink_to(REPO / "sample_logs")
    (tmp_path / "tests").symlink_to(REPO / "tests")
    monkeypatch.chdir(tmp_path)
    ran = 0
    for number, argv, stdout_to, shown in doc_examples_shown(page):
        if not _runs_here(argv, tmp_path):
            continue
        result = CliRunner().invoke(cli, argv)
        where = f"{page.name}:{number}: kvtune {shlex.join(argv)}\n{result.output}"
        assert result.exception is None or isinstance(result.exception, SystemExit), where
        if shown.startswith("Error: "):
            assert result.exit_code in (1, 2), where  # refused advice (1) or a user error (2)
            assert result.stderr.splitlines()[0] == shown, where
        else:
            assert result.exit_code in (0, 1), where
        if stdout_to:
            (tmp_path / stdout_to).write_text(result.stdout, encoding="utf-8")
        ran += 1
    assert ran, f"{page.name}: no example ran"


# --- the site and the README ---------------------------------------------------------------------

def test_mkdocs_builds_the_site_strictly(tmp_path):
    """A broken link, a missing anchor or a page left out of the nav fails the build."""
    pytest.importorskip("mkdocs")
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                            cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    cli_page = (tmp_path / "site" / "reference" / "cli" / "index.html").read_text(encoding="utf-8")
    assert "--objective" in cli_page and "kvtune-simulate" in cli_page


def test_the_readme_is_a_short_front_door():
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= 150
    assert "scripts/install-test-deps.sh && scripts/test.sh" in readme  # what .ci/run runs
    assert "pip install . && kvtune recommend sample_logs/" in readme
    for link in re.findall(r"\]\((docs/[^)#]+)", readme):
        assert (REPO / link).is_file(), link


def test_every_benchmark_script_is_listed_with_where_its_figures_are():
    listed = (DOCS / "benchmarks.md").read_text(encoding="utf-8")
    scripts = [p for p in (REPO / "benchmarks").glob("*.py") if "\nif __name__ ==" in p.read_text(encoding="utf-8")]
    assert len(scripts) >= 8
    for script in scripts:
        assert f"| `benchmarks/{script.name}` |" in listed, script.name
