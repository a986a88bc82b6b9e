"""Every command that reads a file the user names (not a log) refuses a FIFO, a device, a directory,
a socket or a link to a FIFO in one `Error:` line (exit 2), without blocking or reading forever;
files over their size cap are refused the same way (issue #10, item 9)."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvtune import userfiles
from kvtune.cli import cli

REPO = Path(__file__).resolve().parents[2]
DATA = Path(__file__).parents[1] / "data"
REC = str(DATA / "recommendation.json")
MODEL = ["--model", "llama-3.1-8b"]


@pytest.fixture(scope="module")
def saved_profile(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("profile") / "p.json"
    result = CliRunner().invoke(cli, ["profile", str(REPO / "sample_logs"), "--save", str(path), "--json"])
    assert result.exit_code == 0, result.output
    return str(path)


# Each entry point: the arguments with {} where the user-named file goes, and the flag named in the error.
ENTRY_POINTS = {
    "gateway --config": (["gateway", "--config", "{}"], None),
    "check --deployed": (["check", REC, *MODEL, "--deployed", "{}"], None),
    "capacity --vllm-log": (["capacity", "llama-3.1-8b", "--vllm-log", "{}"], "--vllm-log"),
    "capacity --capacity": (["capacity", "llama-3.1-8b", "--capacity", "{}"], None),
    "recommend --capacity": (["recommend", "{profile}", *MODEL, "--capacity", "{}"], None),
    "recommend --vllm-log": (["recommend", "{profile}", *MODEL, "--vllm-log", "{}"], "--vllm-log"),
    "bench --profile": (["bench", "http://127.0.0.1:9", "--profile", "{}", "--requests", "1"], None),
    "bench --expect": (["bench", "http://127.0.0.1:9", "--profile", "{profile}", "--requests", "1",
                        "--expect", "{}"], "--expect"),
    "kv MODEL": (["kv", "{}"], None),
}
# Not here: a FIFO given as LOGS (or as a recommendation.json or saved profile in their place) is
# not sniffed as one and goes to the log readers in kvtune.ingest, which stream it.


@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_non_regular_files_are_one_error_line(entry, non_regular_file, saved_profile, without_hanging):
    template, flag = ENTRY_POINTS[entry]
    args = [a.replace("{profile}", saved_profile).replace("{}", str(non_regular_file)) for a in template]
    result = without_hanging(lambda: CliRunner().invoke(cli, args), non_regular_file)
    assert result.exit_code == 2, result.output
    if entry == "kv MODEL" and non_regular_file.is_dir():
        # a directory is a model directory: the error is about its config.json, on one line
        assert result.stderr.startswith("Error: ") and result.stderr.count("\n") == 1
        assert "config.json" in result.stderr
        return
    where = f"{non_regular_file}: {flag}: " if flag else f"{non_regular_file}: "
    assert result.stderr == f"Error: {where}is {_kind(non_regular_file)}, expected a regular file\n"


def _kind(path: Path) -> str:
    mode = os.stat(path).st_mode
    return ("a directory" if stat.S_ISDIR(mode) else "a FIFO (named pipe)" if stat.S_ISFIFO(mode)
            else "a character device" if stat.S_ISCHR(mode) else "a socket")


def test_a_saved_profile_over_its_cap_is_refused(saved_profile, monkeypatch):
    monkeypatch.setattr(userfiles, "PROFILE_MAX_BYTES", 1000)
    result = CliRunner().invoke(cli, ["profile", "--merge", saved_profile, "--json"])
    assert result.exit_code == 2
    assert result.stderr == f"Error: {saved_profile}: larger than 1,000 bytes, the limit for this kind of file\n"


@pytest.mark.parametrize("cap, argv", [
    ("RECOMMENDATION_MAX_BYTES", ["check", REC, *MODEL, "--deployed", "{gateway}"]),
    ("CAPACITY_MAX_BYTES", ["capacity", "llama-3.1-8b", "--capacity", "{capacity}"]),
    ("VLLM_LOG_MAX_BYTES", ["capacity", "llama-3.1-8b", "--vllm-log", str(DATA / "vllm-0.12-tp2-startup.log")]),
    ("CONFIG_MAX_BYTES", ["check", REC, *MODEL, "--deployed", "{gateway}"]),
])
def test_each_kind_of_file_has_its_cap(cap, argv, tmp_path, monkeypatch):
    from kvtune.capacity.measured import read_vllm_log, write_capacity_file

    gateway = tmp_path / "gateway.yaml"
    gateway.write_text(json.dumps({"version": 1, "upstream": "http://127.0.0.1:8000", "block_size": 16,
                                   "block_budget": 100, "max_model_len": 8192,
                                   "routes": [{"name": "default", "max_new_tokens": 100}]}))
    capacity = tmp_path / "capacity.json"
    write_capacity_file(capacity, read_vllm_log(DATA / "vllm-0.12-tp2-startup.log"))
    monkeypatch.setattr(userfiles, cap, 100)
    args = [a.replace("{gateway}", str(gateway)).replace("{capacity}", str(capacity)) for a in argv]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 2, result.output
    assert "larger than 100 bytes, the limit for this kind of file" in result.stderr
    assert len(result.stderr.splitlines()) == 1


def test_vllm_log_keeps_reading_past_bad_bytes(tmp_path):
    log = tmp_path / "vllm.log"
    log.write_bytes(b"\xff\xfe garbage\nINFO GPU KV cache size: 686,320 tokens\n")
    result = CliRunner().invoke(cli, ["capacity", "llama-3.1-8b", "--vllm-log", str(log), "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["kv_cache_tokens"] == 686_320
