"""The logs' models as a dimension (issue #25 items 4, 5 and 9's `check RECOMMENDATION.json`):
logs naming several models are one error until `--log-model` selects one, in every worker; the
files serve the model the logs name; `--model` may be left out when that id resolves; `check` on a
recommendation.json reads the deployment from the file.

The mixed log is tests/support/mixed_models.py's: a LiteLLM SpendLogs JSONL of Llama chat rows (300) and
Qwen completions rows (200), plus 7 rows naming no model.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import mixed_models
import pytest
from click.testing import CliRunner
from mixed_models import LLAMA, QWEN

from kvtune.cli import cli

ROOT = Path(__file__).resolve().parents[2]
DATA = Path(__file__).parents[1] / "data"
SAMPLES = ROOT / "sample_logs"
TWO_MODELS = (f"Error: logs name 2 models: {LLAMA} (300 rows), {QWEN} (200 rows): pick one with --log-model")


def _cli(*args: str):
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


@pytest.fixture
def mixed(tmp_path: Path) -> Path:
    return mixed_models.write(tmp_path / "litellm.jsonl")


def _recommend_json(*args: str) -> dict:
    result = _cli("recommend", *args, "--gpu", "H100-80GB", "--json")
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


# ---------------------------------------------------------------- item 4: a dimension, selected


def test_profile_counts_rows_per_logged_model_and_saves_them(mixed, tmp_path):
    result = _cli("profile", str(mixed), "--json", "--save", str(tmp_path / "p.json"))
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["models"] == {LLAMA: 300, QWEN: 200}  # the 7 rows naming none are no model
    assert data["requests"] == 507 and "log_model" not in data
    assert result.stderr.strip().endswith(f"models: {LLAMA} (300 rows), {QWEN} (200 rows): one deployment serves "
                                          "one; pick one with --log-model")
    merged = _cli("profile", "--merge", str(tmp_path / "p.json"), str(tmp_path / "p.json"), "--json")
    assert json.loads(merged.stdout)["models"] == {LLAMA: 600, QWEN: 400}


def test_log_model_selects_one_models_rows_ignoring_case_and_says_what_it_left_out(mixed, tmp_path):
    saved = tmp_path / "qwen.json"
    result = _cli("profile", str(mixed), "--json", "--log-model", "qwen/QWEN3-8b", "--save", str(saved))
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert [(r["route"], r["requests"]) for r in data["routes"]] == [("/v1/completions", 200)]
    assert data["models"] == {QWEN: 200}
    assert data["log_model"] == {"name": "qwen/QWEN3-8b", "left_out": {LLAMA: 300}, "unnamed_rows": 7}
    assert f"--log-model qwen/QWEN3-8b left out {LLAMA} (300 rows) and 7 row(s) naming none" in result.stderr
    # saved and merged, the selection stays; and the saved profile serves recommend without the logs
    merged = json.loads(_cli("profile", "--merge", str(saved), str(saved), "--json").stdout)
    assert merged["log_model"] == {"name": "qwen/QWEN3-8b", "left_out": {LLAMA: 600}, "unnamed_rows": 14}
    rec = _recommend_json(str(saved), "--model", "qwen3-8b")
    assert [r["route"] for r in rec["recommendation"]["routes"]] == ["/v1/completions"]


@pytest.mark.parametrize("command", ["recommend", "check", "simulate", "simulate-replay", "bench"])
def test_several_models_without_a_selection_are_one_error_line(mixed, tmp_path, command):
    """Before: recommend built a Llama deployment with a /v1/completions route of Qwen rows, exit 0."""
    serve = tmp_path / "serve.sh"
    serve.write_text(f"vllm serve {LLAMA} --max-model-len 8192\n")
    args = {
        "recommend": ["recommend", str(mixed), "--model", "llama-3.1-8b", "--gpu", "H100-80GB"],
        "check": ["check", str(mixed), "--model", "llama-3.1-8b", "--gpu", "H100-80GB", "--deployed", str(serve)],
        "simulate": ["simulate", str(mixed), "--capacity", str(DATA / "capacity-cpu-0.32-timing.json"), "--rate", "2",
                     "--requests", "20"],
        "simulate-replay": ["simulate", str(mixed), "--capacity", str(DATA / "capacity-cpu-0.32-timing.json"),
                            "--replay", "--requests", "20"],
        "bench": ["bench", "http://127.0.0.1:9", str(mixed), "--requests", "5"],  # refused before connecting
    }[command]
    result = _cli(*args)
    assert result.exit_code == 2
    assert result.stderr.strip().splitlines() == [TWO_MODELS]
    assert result.stdout == ""


def test_a_saved_profile_of_several_models_is_refused_and_cannot_be_selected_afterwards(mixed, tmp_path):
    saved = tmp_path / "both.json"
    assert _cli("profile", str(mixed), "--save", str(saved), "-q").exit_code == 0
    result = _cli("recommend", str(saved), "--model", "llama-3.1-8b", "--gpu", "H100-80GB")
    assert (result.exit_code, result.stderr.strip()) == (2, TWO_MODELS)
    result = _cli("recommend", str(saved), "--model", "llama-3.1-8b", "--gpu", "H100-80GB", "--log-model", LLAMA)
    assert result.exit_code == 2
    assert result.stderr.strip() == (
        f"Error: --log-model: a saved profile holds the histograms of every model it was built from ({LLAMA} "
        f"(300 rows), {QWEN} (200 rows)): profile the logs with --log-model {LLAMA} instead")


def test_a_log_model_no_row_names_is_an_error_listing_the_logged_models(mixed):
    for args in (["profile", str(mixed)], ["recommend", str(mixed), "--model", "qwen3-8b", "--gpu", "H100-80GB"]):
        result = _cli(*args, "--log-model", "Qwen/Qwen3-8B-FP8")
        assert result.exit_code == 2
        assert result.stderr.strip() == (
            "Error: --log-model: no logged row names 'Qwen/Qwen3-8B-FP8' (matched ignoring case): the logs name "
            f"{LLAMA} (300 rows), {QWEN} (200 rows), and 7 row(s) name none")


def test_recommend_on_one_selected_model_has_only_its_routes_and_serves_it(mixed, tmp_path):
    out = tmp_path / "deploy"
    result = _cli("recommend", str(mixed), "--log-model", QWEN, "--model", "qwen3-8b", "--gpu", "H100-80GB",
                  "--out", str(out))
    assert result.exit_code == 0, result.output
    rec = json.loads((out / "recommendation.json").read_text())
    assert [(r["route"], r["requests"]) for r in rec["routes"]] == [("/v1/completions", 200)]
    assert rec["served_model"] == QWEN
    assert f"exec vllm serve {QWEN} " in (out / "vllm-serve.sh").read_text()


def test_the_selection_happens_in_each_worker_with_the_same_bytes_as_one_process(tmp_path):
    parts = mixed_models.write_parts(tmp_path / "logs", parts=3)
    outputs = {}
    for workers in ("1", "2"):
        saved = tmp_path / f"w{workers}.json"
        result = _cli("profile", str(tmp_path / "logs"), "--json", "-q", "--log-model", LLAMA, "--workers", workers,
                      "--save", str(saved))
        assert result.exit_code == 0, result.output
        rec = _recommend_json(*map(str, parts), "--log-model", LLAMA, "--model", "llama-3.1-8b", "--workers", workers)
        outputs[workers] = (result.stdout, saved.read_bytes(), json.dumps(rec))
    assert outputs["2"] == outputs["1"]
    data = json.loads(outputs["2"][0])
    assert data["log_model"] == {"name": LLAMA, "left_out": {QWEN: 200}, "unnamed_rows": 7}
    assert sum(r["requests"] for r in data["routes"]) == 300
    # several models and no selection: the same one line from two workers
    result = _cli("recommend", str(tmp_path / "logs"), "--model", "llama-3.1-8b", "--gpu", "H100-80GB",
                  "--workers", "2")
    assert (result.exit_code, result.stderr.strip()) == (2, TWO_MODELS)


# the selection in each Ray task: test_profile_ray.py, on that module's cluster


# ---------------------------------------------------------------- item 5: the files serve the logs' model


def test_the_files_serve_the_model_the_logs_name_and_check_accepts_the_real_command(tmp_path):
    """Before: the llama-3.1-8b preset rendered `vllm serve meta-llama/Llama-3.1-8B` while every
    logged row names meta-llama/Llama-3.1-8B-Instruct, and check warned model-mismatch on the
    command that really serves the logged model."""
    out = tmp_path / "deploy"
    result = _cli("recommend", str(SAMPLES), "--model", "llama-3.1-8b", "--gpu", "H100-80GB", "--out", str(out))
    assert result.exit_code == 0, result.output
    assert f"exec vllm serve {LLAMA} " in (out / "vllm-serve.sh").read_text()
    assert f'model: "{LLAMA}"' in (out / "gateway.yaml").read_text()
    assert f"# Model {LLAMA} on H100-80GB." in (out / "nginx.conf").read_text()
    rec = json.loads((out / "recommendation.json").read_text())
    assert (rec["model"], rec["served_model"]) == ("llama-3.1-8b", LLAMA)
    assert rec["settings"]["served_model"] == {
        "value": LLAMA, "rule": "served-model-logged",
        "reason": "the model every logged row names (--served-model overrides); the model's own id is "
                  "meta-llama/Llama-3.1-8B"}
    assert (f"# model {LLAMA}: served-model-logged: the model every logged row names"
            in (out / "vllm-serve.sh").read_text())
    check = _cli("check", str(SAMPLES), "--model", "llama-3.1-8b", "--gpu", "H100-80GB",
                 "--deployed", str(out / "vllm-serve.sh"), "--deployed", str(out / "gateway.yaml"))
    assert check.exit_code == 0, check.output
    assert "model-mismatch" not in check.output
    # the base checkpoint is now the one that does not serve what the clients ask for
    base = tmp_path / "base.sh"
    base.write_text((out / "vllm-serve.sh").read_text().replace(f"serve {LLAMA} ", "serve meta-llama/Llama-3.1-8B "))
    check = _cli("check", str(SAMPLES), "--model", "llama-3.1-8b", "--gpu", "H100-80GB", "--deployed", str(base))
    assert "model-mismatch" in check.output


def _chat_tokenizer_dir(path: Path) -> Path:
    """A model directory `kvtune gateway` can count prompts with: tokenizer.json and a chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    path.mkdir()
    tokenizer = Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": "{% for m in messages %}{{ m.content }}{% endfor %}"}))
    return path


@pytest.mark.parametrize("engine, launch, served", [
    ("sglang", "sglang-serve.sh", f"    --model-path {LLAMA} \\\n"),
    ("trtllm", "trtllm-serve.sh", f"exec trtllm-serve {LLAMA} \\\n"),
])
def test_other_engines_serve_the_logged_model_too(tmp_path, engine, launch, served):
    out = tmp_path / "deploy"
    result = _cli("recommend", str(SAMPLES), "--model", "llama-3.1-8b", "--gpu", "H100-80GB", "--engine", engine,
                  "--gateway-tokenizer", str(_chat_tokenizer_dir(tmp_path / "tok")), "--out", str(out))
    assert result.exit_code == 0, result.output
    text = (out / launch).read_text()
    assert served in text
    assert f"{LLAMA}: served-model-logged: the model every logged row names" in text
    assert f'model: "{LLAMA}"' in (out / "gateway.yaml").read_text()


def test_a_model_whose_architecture_is_not_the_logged_ones_is_refused(mixed):
    """The files serve the logged id: planning it as another model would size a 70B's pool for an
    8B (or an 8B's for a 70B, which then cannot start). --served-model says it is on purpose."""
    result = _cli("recommend", str(mixed), "--log-model", LLAMA, "--model", "llama-3.1-70b", "--gpu", "H100-80GB",
                  "--tp", "2")
    assert (result.exit_code, result.stderr.strip()) == (
        2, f"Error: --model: the logs name '{LLAMA}', which has the llama-3.1-8b preset's architecture, not "
           "llama-3.1-70b's: give --model llama-3.1-8b (or --served-model to serve another checkpoint)")
    rec = _recommend_json(str(mixed), "--log-model", LLAMA, "--model", "llama-3.1-70b", "--tp", "2",
                          "--served-model", "meta-llama/Llama-3.1-70B-Instruct")["recommendation"]
    assert rec["served_model"] == "meta-llama/Llama-3.1-70B-Instruct"
    # the same architecture from a config.json of the base model is fine
    rec = _recommend_json(str(mixed), "--log-model", LLAMA, "--model", str(DATA / "configs" / "Llama-3.1-8B.json"))
    assert rec["recommendation"]["served_model"] == LLAMA


def test_served_model_overrides_the_logs_and_says_so():
    rec = _recommend_json(str(SAMPLES), "--model", "llama-3.1-8b", "--served-model", "/models/llama-8b-ft")
    assert rec["recommendation"]["served_model"] == "/models/llama-8b-ft"
    assert "exec vllm serve /models/llama-8b-ft " in rec["files"]["vllm-serve.sh"]
    assert rec["recommendation"]["settings"]["served_model"] == {
        "value": "/models/llama-8b-ft", "rule": "served-model-given",
        "reason": f"--served-model, though the logged rows name {LLAMA}"}


def test_model_is_taken_from_the_logs_when_a_preset_has_its_base_model(mixed):
    rec = _recommend_json(str(mixed), "--log-model", LLAMA)["recommendation"]
    assert (rec["model"], rec["served_model"]) == ("llama-3.1-8b", LLAMA)
    rec = _recommend_json(str(mixed), "--log-model", "qwen/qwen3-8b")["recommendation"]
    assert (rec["model"], rec["served_model"]) == ("qwen3-8b", QWEN)


def test_model_is_taken_from_a_local_config_the_logs_name(tmp_path):
    model_dir = tmp_path / "models" / "mistral-7b"
    model_dir.mkdir(parents=True)
    shutil.copy(DATA / "configs" / "Mistral-7B-v0.1.json", model_dir / "config.json")
    logs = mixed_models.write(tmp_path / "logs.jsonl", mixed_models.rows(models={LLAMA: str(model_dir)}))
    rec = _recommend_json(str(logs), "--log-model", str(model_dir))["recommendation"]
    assert (rec["model"], rec["served_model"]) == (str(model_dir), str(model_dir))
    assert rec["kv"]["kv_bytes_per_token"] == 32 * 2 * 8 * 128 * 2  # Mistral-7B's layers, kv heads, head dim


def test_model_is_taken_from_the_hugging_face_cache_for_a_hub_id_the_logs_name(tmp_path):
    """Offline (HF_HUB_OFFLINE=1), a hub id whose config.json the cache holds resolves; a subprocess,
    because huggingface_hub reads HF_HOME when it is imported."""
    revision = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hf" / "hub" / "models--acme--mistral-7b-ft"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(revision)
    (repo / "snapshots" / revision).mkdir(parents=True)
    shutil.copy(DATA / "configs" / "Mistral-7B-v0.1.json", repo / "snapshots" / revision / "config.json")
    logs = mixed_models.write(tmp_path / "logs.jsonl", mixed_models.rows(models={LLAMA: "acme/mistral-7b-ft"}))
    proc = subprocess.run([sys.executable, "-m", "kvtune", "recommend", str(logs), "--log-model", "acme/mistral-7b-ft",
                           "--gpu", "H100-80GB", "--json"], capture_output=True, text=True, cwd=ROOT, timeout=300,
                          env={**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr
    rec = json.loads(proc.stdout)["recommendation"]
    assert (rec["model"], rec["served_model"]) == ("acme/mistral-7b-ft", "acme/mistral-7b-ft")
    assert rec["kv"]["kv_bytes_per_token"] == 32 * 2 * 8 * 128 * 2


def test_a_logged_model_that_resolves_to_nothing_asks_for_model(tmp_path, mixed):
    logs = mixed_models.write(tmp_path / "logs.jsonl", mixed_models.rows(models={LLAMA: "acme/mystery-7b"}))
    result = _cli("recommend", str(logs), "--log-model", "acme/mystery-7b", "--gpu", "H100-80GB")
    assert result.exit_code == 2
    assert result.stderr.strip() == (
        "Error: --model: the logs name 'acme/mystery-7b', which is no preset's model, and its config.json is not in "
        "the Hugging Face cache nor on a reachable hub: give --model")
    result = _cli("recommend", str(SAMPLES / "azure_style_trace.csv"), "--gpu", "H100-80GB")
    assert (result.exit_code, result.stderr.strip()) == (
        2, "Error: --model: the logs name no model: give --model (a preset, config.json, model directory or hub id)")


# ---------------------------------------------------------------- item 9: check RECOMMENDATION.json


@pytest.fixture(scope="module")
def deployed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("deploy")
    result = _cli("recommend", str(SAMPLES), "--model", "llama-3.1-8b", "--gpu", "H100-80GB", "--out", str(out))
    assert result.exit_code == 0, result.output
    return out


def test_check_reads_model_gpu_and_engine_from_the_recommendation(deployed):
    """Before: `check deploy/recommendation.json` demanded --model although the file names it."""
    files = ["--deployed", str(deployed / "vllm-serve.sh"), "--deployed", str(deployed / "gateway.yaml")]
    result = _cli("check", str(deployed / "recommendation.json"), *files)
    assert result.exit_code == 0, result.output
    assert result.stdout.strip().splitlines()[-1].startswith("passed: 0 risk")
    # options that agree with the file are fine, in any spelling the options take
    agree = _cli("check", str(deployed / "recommendation.json"), "--model", LLAMA, "--gpu", "h100", "--tp", "1",
                 "--engine", "vllm", "--block-size", "16", *files)
    assert agree.exit_code == 0, agree.output


@pytest.mark.parametrize("option, value, message", [
    ("--gpu", "L40S", "'L40S' contradicts the recommendation's 'H100-80GB'"),
    ("--model", "qwen3-8b", "'qwen3-8b' contradicts the recommendation's 'llama-3.1-8b'"),
    ("--tp", "2", "2 contradicts the recommendation's 1"),
    ("--engine", "sglang", "'sglang' contradicts the recommendation's 'vllm'"),
    ("--kv-cache-dtype", "fp8", "'fp8' contradicts the recommendation's 'auto'"),
    ("--upstream", "http://10.0.0.5:8000", "'http://10.0.0.5:8000' contradicts the recommendation's "
                                           "'http://127.0.0.1:8000'"),
])
def test_check_refuses_an_option_that_contradicts_the_recommendation(deployed, option, value, message):
    rec = deployed / "recommendation.json"
    result = _cli("check", str(rec), option, value, "--deployed", str(deployed / "vllm-serve.sh"))
    assert result.exit_code == 2
    assert result.stderr.strip() == (f"Error: {option}: {message}: check reads the deployment from '{rec}'; leave "
                                     f"{option} out, or recommend again with it")


def test_check_refuses_a_measured_capacity_beside_the_recommendations_own(deployed):
    result = _cli("check", str(deployed / "recommendation.json"), "--kv-tokens", "40000",
                  "--deployed", str(deployed / "vllm-serve.sh"))
    assert (result.exit_code, result.stderr.strip()) == (
        2, "Error: --kv-tokens: the recommendation already holds its capacity (estimate); recommend again with "
           "--kv-tokens to check against it")


def test_check_on_logs_without_model_takes_it_from_the_logs(deployed):
    result = _cli("check", str(SAMPLES), "--gpu", "H100-80GB", "--deployed", str(deployed / "vllm-serve.sh"),
                  "--deployed", str(deployed / "gateway.yaml"))
    assert result.exit_code == 0, result.output


# ---------------------------------------------------------------- ids that differ only in case; saved files


def test_ids_that_differ_only_in_case_are_one_model_served_as_most_rows_spell_it(tmp_path):
    records = mixed_models.rows()
    for r in records:  # the Qwen rows: some lowercased (a gateway that logs ids lowercased)
        if r["model_group"] == QWEN and int(r["request_id"][-1]) % 4 == 0:
            r["model_group"] = QWEN.lower()
    lowered = sum(r["model_group"] == QWEN.lower() for r in records)
    assert 0 < lowered < 100
    logs = mixed_models.write(tmp_path / "logs.jsonl", [r for r in records if r["model_group"] not in (LLAMA, "")])
    profile = json.loads(_cli("profile", str(logs), "--json").stdout)
    assert profile["models"] == {QWEN: 200 - lowered, QWEN.lower(): lowered}  # as logged
    rec = _recommend_json(str(logs), "--model", "qwen3-8b")["recommendation"]
    assert rec["served_model"] == QWEN and rec["routes"][0]["requests"] == 200


def test_a_damaged_selection_in_a_saved_profile_is_one_line_naming_the_field(mixed, tmp_path):
    saved = tmp_path / "p.json"
    assert _cli("profile", str(mixed), "--log-model", QWEN, "--save", str(saved), "-q").exit_code == 0
    data = json.loads(saved.read_text())
    data["log_model"]["unnamed_rows"] = -1
    saved.write_text(json.dumps(data))
    result = _cli("recommend", str(saved), "--model", "qwen3-8b", "--gpu", "H100-80GB")
    assert result.exit_code == 2
    assert result.stderr.strip() == f"Error: {saved}: log_model.unnamed_rows: expected a count of rows"


def test_selected_profiles_of_parts_merge_to_the_selected_profile_of_the_whole(tmp_path):
    """Mergeable like the rest of the profile: `profile --merge` of each file's saved profile is the
    profile of all files at once, the left-out counts included."""
    parts = mixed_models.write_parts(tmp_path / "logs", parts=3)
    saved = []
    for part in parts:
        saved.append(tmp_path / f"{part.stem}.json")
        assert _cli("profile", str(part), "--log-model", LLAMA, "--save", str(saved[-1]), "-q").exit_code == 0
    merged = _cli("profile", "--merge", *map(str, saved), "--json")
    whole = _cli("profile", *map(str, parts), "--log-model", LLAMA, "--json")
    assert merged.exit_code == whole.exit_code == 0
    assert json.loads(merged.stdout) == json.loads(whole.stdout)
    assert json.loads(whole.stdout)["log_model"]["left_out"] == {QWEN: 200}
