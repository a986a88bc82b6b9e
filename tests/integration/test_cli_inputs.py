"""CI inputs (issue #25 item 9): logs without one usable row exit 2 with one line naming the inputs
and the skip reasons, in every command that reads logs; files kvtune wrote into a log directory are
skipped with a note (never silently), and --exclude GLOB leaves files out by relative path or base
name, in one process, in worker processes and for URLs alike."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import fsspec
import pytest
from click.testing import CliRunner
from conftest import DATA, REPO
from http_files import FileServer

from kvtune.cli import cli

SAMPLES = REPO / "sample_logs"
SAMPLE_MODEL = "meta-llama/Llama-3.1-8B-Instruct"  # the model every sample log row names
CAPACITY = DATA / "capacity-cpu-0.32-timing.json"
REASON = "no token counts (use --tokenizer)"


def kvtune(*args: str):
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


@pytest.fixture
def unusable(tmp_path) -> Path:
    """A real OpenAI pair log whose responses lost their usage: every row is skipped."""
    path = tmp_path / "no_usage.jsonl"
    lines = (SAMPLES / "openai_chat_pairs.jsonl").read_text().splitlines()[:7]
    with path.open("w") as f:
        for line in lines:
            row = json.loads(line)
            del row["response"]["usage"]
            f.write(json.dumps(row) + "\n")
    return path


@pytest.fixture
def deployed(tmp_path) -> Path:
    out = tmp_path / "deploy"
    r = kvtune("recommend", str(SAMPLES / "openai_chat_pairs.jsonl"), "--model", "llama-3.1-8b", "--gpu", "H100-80GB",
               "--out", str(out))
    assert r.exit_code == 0, r.output
    return out


def test_profile_of_logs_without_a_usable_row_exits_2_naming_the_input_and_the_reasons(unusable):
    r = kvtune("profile", str(unusable), "--json")
    assert r.exit_code == 2
    assert r.stdout == ""
    assert r.stderr.strip() == (
        f"Error: {unusable}: no usable row: 7 rows skipped (7 {REASON}; first at {unusable}:1: "
        "response.usage.completion_tokens: text but no token counts: pass --tokenizer) "
        "(see --tokenizer, --field, --format, --on-error)")


@pytest.mark.parametrize("command", [
    ["recommend", "--model", "llama-3.1-8b", "--gpu", "H100-80GB"],
    ["check", "--model", "llama-3.1-8b", "--deployed", "DEPLOYED"],
    ["bench", "http://127.0.0.1:9", "--requests", "5"],  # fails before connecting
    ["simulate", "--capacity", str(CAPACITY), "--requests", "5"],
    ["profile", "--workers", "2"],
])
def test_every_command_that_reads_logs_exits_2_when_no_row_is_usable(unusable, deployed, tmp_path, command):
    second = tmp_path / "also_no_usage.jsonl"
    shutil.copy(unusable, second)
    args = [a.replace("DEPLOYED", str(deployed / "vllm-serve.sh")) for a in command]
    if command[0] == "bench":
        args = [args[0], args[1], str(unusable), str(second), *args[2:]]
    else:
        args = [args[0], str(unusable), str(second), *args[1:]]
    r = kvtune(*args)
    assert r.exit_code == 2, r.output
    line = r.stderr.strip().splitlines()[-1]
    assert line.startswith(f"Error: {unusable}, {second}: no usable row: 14 rows skipped (14 {REASON}; first at "), line
    assert not (tmp_path / "out").exists()


def test_a_window_that_leaves_no_row_says_so(tmp_path):
    r = kvtune("profile", str(SAMPLES / "openai_chat_pairs.jsonl"), "--since", "2030-01-01")
    assert r.exit_code == 2
    assert "no usable row: 2,400 rows outside --since/--until" in r.stderr


def _same_model_copy(source: Path, target: Path) -> None:
    """A copy of an OpenAI response log whose rows all name the sample logs' model: one deployment
    serves one model, so logs naming several are refused (tests/integration/test_cli_log_model.py)."""
    rows = [json.loads(line) for line in source.read_text().splitlines()]
    target.write_text("".join(json.dumps({**row, "model": SAMPLE_MODEL}) + "\n" for row in rows))


def _log_dir_with_kvtune_outputs(tmp_path: Path) -> Path:
    """A log directory into which `recommend --out` and `profile --save` wrote (the issue's case),
    with a capacity file from `calibrate` beside them."""
    logs = tmp_path / "logs"
    (logs / "2026-11-30").mkdir(parents=True)
    shutil.copy(SAMPLES / "openai_chat_pairs.jsonl", logs / "2026-11-30" / "chat.jsonl")
    _same_model_copy(DATA / "logs" / "openai_chat.jsonl", logs / "openai_chat.jsonl")
    r = kvtune("recommend", str(logs), "--model", "llama-3.1-8b", "--gpu", "H100-80GB", "--out", str(logs))
    assert r.exit_code == 0, r.output
    assert kvtune("profile", str(logs), "--save", str(logs / "week.json"), "-q").exit_code == 0
    shutil.copy(CAPACITY, logs / "capacity.json")
    return logs


OWN = {"capacity.json": "written by kvtune calibrate", "estimates.json": "written by kvtune recommend --out",
       "recommendation.json": "written by kvtune recommend --out",
       "week.json": "written by kvtune profile --save"}


def test_files_kvtune_wrote_into_a_log_directory_are_skipped_with_a_note(tmp_path):
    logs = _log_dir_with_kvtune_outputs(tmp_path)
    only = kvtune("profile", str(logs / "2026-11-30" / "chat.jsonl"), str(logs / "openai_chat.jsonl"), "--json")
    r = kvtune("profile", str(logs), "--json", "--workers", "1")
    assert r.exit_code == 0, r.output
    out, alone = json.loads(r.stdout), json.loads(only.stdout)
    assert out["requests"] == alone["requests"] == 2403 and out["routes"] == alone["routes"]
    assert out["skipped_files"] == [{"path": str(logs / name), "reason": f"kvtune's own output: {what}"}
                                    for name, what in OWN.items()]
    note = ("skipped 4 files kvtune wrote (not logs): "
            + ", ".join(f"{logs / name} ({what})" for name, what in OWN.items())
            + "; --exclude GLOB leaves any file out by name")
    assert out["notes"] == [note]
    assert f"note: {note}" in r.stderr.splitlines()
    human = kvtune("profile", str(logs))
    assert human.exit_code == 0 and f"note: {note}" in human.stderr.splitlines()
    rec = kvtune("recommend", str(logs), "--model", "llama-3.1-8b", "--gpu", "H100-80GB", "--json")
    assert rec.exit_code == 0, rec.output
    assert note in json.loads(rec.stdout)["recommendation"]["notes"]
    assert f"note: {note}" in rec.stderr.splitlines()


def test_the_same_files_are_skipped_by_worker_processes_with_the_same_output(tmp_path):
    logs = _log_dir_with_kvtune_outputs(tmp_path)
    one = kvtune("profile", str(logs), "--json", "--workers", "1")
    two = kvtune("profile", str(logs), "--json", "--workers", "2")
    assert one.exit_code == two.exit_code == 0, two.output
    assert one.stdout == two.stdout


def test_exclude_matches_the_relative_path_and_the_base_name(tmp_path):
    logs = _log_dir_with_kvtune_outputs(tmp_path)
    by_path = kvtune("profile", str(logs), "--json", "--exclude", "2026-11-*/*.jsonl")
    assert by_path.exit_code == 0, by_path.output
    out = json.loads(by_path.stdout)
    assert [i["path"] for i in out["inputs"]] == [str(logs / "openai_chat.jsonl")] and out["requests"] == 3
    assert {"path": str(logs / "2026-11-30" / "chat.jsonl"), "reason": "--exclude 2026-11-*/*.jsonl"} in \
        out["skipped_files"]
    assert f"left out 1 file matching --exclude: {logs / '2026-11-30' / 'chat.jsonl'}" in out["notes"]
    by_name = kvtune("profile", str(logs), "--json", "--exclude", "openai_*", "--exclude", "*.json", "--workers", "2")
    assert by_name.exit_code == 0, by_name.output
    out = json.loads(by_name.stdout)
    assert [i["path"] for i in out["inputs"]] == [str(logs / "2026-11-30" / "chat.jsonl")]
    assert sorted(f["path"] for f in out["skipped_files"] if f["reason"].startswith("--exclude")) == sorted(
        str(logs / n) for n in ("openai_chat.jsonl", *OWN))
    everything = kvtune("profile", str(logs), "--exclude", "*")
    assert everything.exit_code == 2
    assert everything.stderr.startswith(f"Error: {logs}: no usable row: 6 files not read (left out 6 files matching ")


def test_exclude_and_own_outputs_in_a_store_and_over_http(tmp_path):
    logs = _log_dir_with_kvtune_outputs(tmp_path)
    folder = "kvtune-test-exclude"
    memory = fsspec.filesystem("memory")
    for path in logs.rglob("*"):
        if path.is_file():
            memory.pipe_file(f"/{folder}/{path.relative_to(logs).as_posix()}", path.read_bytes())
    url = f"memory://{folder}"
    r = kvtune("profile", url, "--json", "--exclude", "2026-11-30/*")
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["requests"] == 3
    assert {f["reason"] for f in out["skipped_files"]} == {"--exclude 2026-11-30/*", *(
        f"kvtune's own output: {what}" for what in OWN.values())}
    with FileServer(logs) as server:
        base = f"http://127.0.0.1:{server.port}/dir/"
        r = kvtune("profile", base, "--json", "--workers", "2")
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["requests"] == 3  # the index page lists the top level only
    assert sorted(f["path"] for f in out["skipped_files"]) == sorted(base + name for name in OWN)


@pytest.mark.parametrize("command", [
    ["bench", "http://127.0.0.1:9", "--replay", "--requests", "5"],  # fails before connecting
    ["simulate", "--replay", "--capacity", str(CAPACITY), "--requests", "5"],
])
def test_a_replay_of_logs_without_a_usable_row_names_the_inputs_and_the_skip_reasons(unusable, command):
    args = [command[0], command[1], str(unusable), *command[2:]] if command[0] == "bench" else \
        [command[0], str(unusable), *command[1:]]
    r = kvtune(*args)
    assert r.exit_code == 2
    assert r.stderr.strip() == (f"Error: {unusable}: nothing to replay: no request has a timestamp, prompt and "
                                f"output length ({REASON}: 7)")


def test_a_replay_and_check_say_which_files_kvtune_wrote(tmp_path, deployed):
    logs = _log_dir_with_kvtune_outputs(tmp_path)
    r = kvtune("simulate", str(logs), "--replay", "--capacity", str(CAPACITY), "--requests", "5", "--json")
    assert r.exit_code == 0, r.output
    notes = [ln for ln in r.stderr.splitlines() if ln.startswith("note: skipped 4 files kvtune wrote (not logs): ")]
    assert len(notes) == 1
    assert json.loads(r.stdout)["notes"] == [notes[0].removeprefix("note: ")]
    by_profile = kvtune("simulate", str(logs), "--capacity", str(CAPACITY), "--requests", "5", "--json")
    assert by_profile.exit_code == 0, by_profile.output
    assert json.loads(by_profile.stdout)["notes"] == [notes[0].removeprefix("note: ")]
    c = kvtune("check", str(logs), "--model", "llama-3.1-8b", "--gpu", "H100-80GB", "--deployed",
               str(deployed / "vllm-serve.sh"), "--json")
    assert c.exit_code in (0, 1), c.output
    assert notes[0].removeprefix("note: ") in json.loads(c.stdout)["notes"]
    assert notes[0] in c.stderr.splitlines()


def test_a_glob_over_a_directory_recommend_wrote_into_reads_only_the_logs(tmp_path):
    """`logs/*` reaches every file recommend --out wrote (gateway.yaml, nginx.conf, the launch
    script, the reports): each is told by its first lines and skipped with the note."""
    logs = tmp_path / "logs"
    logs.mkdir()
    shutil.copy(SAMPLES / "openai_chat_pairs.jsonl", logs / "chat.jsonl")
    shutil.copy(SAMPLES / "azure_style_trace.csv", logs / "trace.csv")
    # vLLM last: its run writes k8s/ manifests, which a later run for another engine refuses to leave
    # behind (`kubectl apply -f k8s/` would deploy them beside it)
    for engine in ("sglang", "trtllm", "vllm"):
        r = kvtune("recommend", str(logs / "chat.jsonl"), "--model", "llama-3.1-8b", "--gpu", "H100-80GB",
                   "--engine", engine, "--out", str(logs))
        assert r.exit_code == 0, r.output
    rendered = sorted(p.name for p in logs.iterdir() if p.name not in ("chat.jsonl", "trace.csv") and p.is_file())
    # gateway.yaml, nginx.conf, recommendation.json, report.{html,md}, 4 launch files, estimates.{json,yaml},
    # litellm-config.yaml
    assert len(rendered) == 12
    assert (logs / "lua" / "kvtune" / "gateway.lua").is_file()  # nginx.conf's Lua: a folder, which * does not read
    r = kvtune("profile", str(logs / "*"), "--json")
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert [i["path"] for i in out["inputs"]] == [str(logs / "chat.jsonl"), str(logs / "trace.csv")]
    assert sorted(Path(f["path"]).name for f in out["skipped_files"]) == rendered
    assert out["notes"][0].startswith("skipped 12 files kvtune wrote (not logs): ")
    assert out["notes"][0].endswith(" and 7 more; --exclude GLOB leaves any file out by name")


def test_the_python_api_takes_exclude_and_reports_the_files_not_read(tmp_path):
    import kvtune
    from kvtune.errors import InputError

    logs = _log_dir_with_kvtune_outputs(tmp_path)
    profile = kvtune.profile_logs([logs], kvtune.LogReading(exclude=("openai_*",)))
    assert profile.requests == 2400
    assert [f.reason for f in profile.skipped_files] == ["--exclude openai_*", *(
        f"kvtune's own output: {what}" for what in OWN.values())]
    with pytest.raises(InputError, match="no usable row"):
        kvtune.profile_logs([logs], kvtune.LogReading(exclude=("*.jsonl",)))


def test_bench_against_a_server_says_which_files_kvtune_wrote(tmp_path):
    """A real bench run (the fake vLLM on loopback), profiled and replayed: --json's notes."""
    from fake_vllm import FakeVllm

    logs = _log_dir_with_kvtune_outputs(tmp_path)
    with FakeVllm() as fake:
        for extra in ((), ("--replay", "--speedup", "1000")):
            r = kvtune("bench", fake.url, str(logs), "--requests", "3", "--json", *extra)
            assert r.exit_code == 0, r.output
            note = next(ln for ln in r.stderr.splitlines() if ln.startswith("note: skipped 4 files kvtune wrote"))
            assert json.loads(r.stdout)["notes"] == [note.removeprefix("note: ")]


def test_a_kvtune_file_given_as_the_only_input_is_no_usable_row(deployed):
    r = kvtune("profile", str(deployed / "recommendation.json"))
    assert r.exit_code == 2
    assert r.stderr.strip() == (
        f"Error: {deployed / 'recommendation.json'}: no usable row: 1 file not read (skipped 1 file kvtune wrote "
        f"(not logs): {deployed / 'recommendation.json'} (written by kvtune recommend --out); --exclude GLOB leaves "
        "any file out by name)")
