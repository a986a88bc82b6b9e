"""`kvtune recommend` on the command line: which prompt counting the rendered gateway.yaml uses."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from kvtune.cli import cli

LOGS = str(Path(__file__).parents[1] / "data" / "logs" / "kvtune.jsonl")


def model_dir(path: Path) -> Path:
    """A served model's directory as far as counting goes: tokenizer.json and a chat template."""
    from tokenizers import Tokenizer, models

    path.mkdir(parents=True)
    Tokenizer(models.WordLevel({"<unk>": 0, "hi": 1}, unk_token="<unk>")).save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages[0]['content'] }}"}))
    return path


def counting(*args: str) -> dict:
    result = CliRunner().invoke(cli, ["recommend", LOGS, "--model", "llama-3.1-8b", "--gpu", "H100-80GB",
                                      "--json", *args], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return yaml.safe_load(json.loads(result.output)["files"]["gateway.yaml"])["prompt_tokens"]


def test_without_a_local_tokenizer_the_gateway_asks_the_upstream():
    assert counting() == {"method": "upstream-tokenize"}


def test_a_local_served_model_is_counted_in_process(tmp_path):
    served = model_dir(tmp_path / "served")
    assert counting("--served-model", str(served)) == {"method": "tokenizer", "tokenizer": str(served.resolve())}
    # the logs' --tokenizer is the model's tokenizer too
    assert counting("--tokenizer", str(served))["tokenizer"] == str(served.resolve())
    # a folder without a chat template cannot count chats: the upstream does
    (served / "tokenizer_config.json").write_text("{}")
    assert counting("--served-model", str(served)) == {"method": "upstream-tokenize"}


def test_gateway_tokenizer_chooses(tmp_path):
    served = model_dir(tmp_path / "served")
    other = model_dir(tmp_path / "other")
    assert counting("--served-model", str(served), "--gateway-tokenizer", "upstream") == {"method": "upstream-tokenize"}
    assert counting("--served-model", str(served), "--gateway-tokenizer", str(other))["tokenizer"] == str(other.resolve())


@pytest.mark.parametrize("given", ["meta-llama/Llama-3.1-8B", "/nonexistent/model"])
def test_gateway_tokenizer_that_is_not_local_is_a_usage_error(given):
    result = CliRunner().invoke(cli, ["recommend", LOGS, "--model", "llama-3.1-8b", "--gpu", "H100-80GB",
                                      "--gateway-tokenizer", given])
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: --gateway-tokenizer: ")
    assert "pass --gateway-tokenizer upstream to count" in lines[0]


# ---------------------------------------------------------------- routes are literal, and checked

HOSTILE_PATHS = ["/v1/*", "/v1/chat%2Fcompletions", "/v1/../sleep", "/sleep", "/v1/embeddings", "/v1/x y"]


def _logs(tmp_path: Path, paths: list[str]) -> str:
    rows = []
    for i in range(400):
        path = paths[i % len(paths)]
        # the hostile routes have tiny outputs: as a prefix route sorted first, /v1/* would cap all at ~20
        out = 20 if path in HOSTILE_PATHS else 100 + (i * 37) % 900
        rows.append({"route": path, "prompt_tokens": 50 + i % 300, "output_tokens": out})
    log = tmp_path / "logs.jsonl"
    log.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(log)


def test_logged_paths_are_literal_and_never_widen_a_route(tmp_path):
    """A logged `/v1/*` once became a prefix wildcard sorted first, capping every route at 20
    tokens while recommend exited 0. Paths from logs that are no plain request path a gateway
    governs are capped by the catch-all now, and every rendered file loads and passes check."""
    from kvtune.deploy.read import parse_deployed
    from kvtune.gateway.config import parse_gateway_config

    logs = _logs(tmp_path, ["/v1/chat/completions", "/v1/completions", *HOSTILE_PATHS])
    out = tmp_path / "deploy"
    result = CliRunner().invoke(cli, ["recommend", logs, "--model", "llama-3.1-8b", "--gpu", "H100-80GB",
                                      "--out", str(out), "--json"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    config = parse_gateway_config(yaml.safe_load((out / "gateway.yaml").read_text()))
    paths = [r.match.path for r in config.routes]
    assert not set(paths) & set(HOSTILE_PATHS)
    caps = {r["route"]: r["max_new_tokens"]["value"] for r in doc["recommendation"]["routes"]}
    for path in ("/v1/chat/completions", "/v1/completions"):
        assert config.route_for(path, None).max_new_tokens == caps[path]
        assert parse_deployed((out / "nginx.conf").read_text()).route_for(path, None).max_new_tokens == caps[path]
    notes = " ".join(doc["recommendation"]["notes"])
    assert "'/v1/*' cannot be matched by path" in notes and "'/sleep' cannot be matched by path" in notes


def test_recommend_refuses_to_write_files_that_would_fail_check(tmp_path, monkeypatch):
    """recommend runs check on what it renders: a gateway.yaml whose first route shadows the
    others with a tiny cap is a risk, so recommend exits 1 and writes nothing."""
    import kvtune.deploy.render as render

    real = render.render_files

    def shadowing(rec, **kwargs):
        files = real(rec, **kwargs)
        files["gateway.yaml"] = files["gateway.yaml"].replace(
            "routes:\n", "routes:\n  - name: \"all\"\n    match:\n      path_prefix: \"/v1/\"\n    max_new_tokens: 1\n", 1)
        return files

    monkeypatch.setattr(render, "render_files", shadowing)
    out = tmp_path / "deploy"
    logs = _logs(tmp_path, ["/v1/chat/completions", "/v1/completions"])
    result = CliRunner().invoke(cli, ["recommend", logs, "--model", "llama-3.1-8b", "--gpu", "H100-80GB",
                                      "--out", str(out)])
    assert result.exit_code == 1
    assert "the rendered gateway.yaml would fail `kvtune check`: cap-truncates" in result.output
    assert not out.exists() or not any(out.iterdir())


@pytest.mark.parametrize("command", ["profile", "recommend", "check", "bench"])
def test_every_command_that_profiles_logs_takes_max_routes(command):
    result = CliRunner().invoke(cli, [command, "--help"])
    assert result.exit_code == 0 and "--max-routes N" in result.output


def test_recommend_folds_routes_beyond_max_routes_with_a_note(tmp_path):
    logs = tmp_path / "routes.jsonl"
    logs.write_text("".join(json.dumps({"route": f"/v1/r{i}", "output_tokens": 10 + k, "prompt_tokens": 100})
                            + "\n" for i in range(6) for k in range(i + 1)))
    result = CliRunner().invoke(cli, ["recommend", str(logs), "--model", "llama-3.1-8b", "--gpu", "H100-80GB",
                                      "--json", "--max-routes", "2"])
    assert result.exit_code == 0, result.output
    routes = [r["route"] for r in json.loads(result.stdout)["recommendation"]["routes"]]
    assert sorted(routes) == ["*", "/v1/r4", "/v1/r5"]
    assert result.stderr.startswith("folded 4 routes (10 requests) into * (--max-routes 2 keeps the busiest)")


def _one_error_line(result, path) -> str:
    assert result.exit_code == 2, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    assert result.stderr.startswith(f"Error: {path}: ") and result.stderr.count("\n") == 1, result.stderr
    return result.stderr


def test_out_with_a_directory_where_a_file_goes_writes_nothing(tmp_path):
    """#10: with deploy/nginx.conf a directory, two files were replaced next to an old
    recommendation.json (a mixed set) and the command died with a traceback."""
    deploy = tmp_path / "deploy"
    args = ["recommend", LOGS, "--model", "llama-3.1-8b", "--gpu", "H100-80GB", "--out", str(deploy)]
    assert CliRunner().invoke(cli, args).exit_code == 0
    def files() -> dict[str, bytes]:  # nginx.conf's Lua modules are under lua/ beside it
        return {p.relative_to(deploy).as_posix(): p.read_bytes() for p in deploy.rglob("*") if p.is_file()}

    old = files()
    (deploy / "nginx.conf").unlink()
    (deploy / "nginx.conf").mkdir()
    result = CliRunner().invoke(cli, [*args, "--safety-fraction", "0.5"])
    message = _one_error_line(result, deploy / "nginx.conf")
    assert "refusing to replace a directory with a file" in message
    assert files() == {k: v for k, v in old.items() if k != "nginx.conf"}
    assert sorted(p.name for p in deploy.iterdir()) == sorted({k.split("/")[0] for k in old})  # no staging folder left


def test_out_that_is_a_file_or_under_proc_is_one_line(tmp_path):
    (tmp_path / "deploy").write_text("not a directory")
    base = ["recommend", LOGS, "--model", "llama-3.1-8b", "--gpu", "H100-80GB", "--out"]
    _one_error_line(CliRunner().invoke(cli, [*base, str(tmp_path / "deploy")]), tmp_path / "deploy")
    assert (tmp_path / "deploy").read_text() == "not a directory"
    _one_error_line(CliRunner().invoke(cli, [*base, "/proc/kvtune-deploy"]), "/proc/kvtune-deploy")


# --- a capacity measured at other settings: the deploy files take the measured basis ------------

MEASURED_FP8 = {"source": "metrics", "num_blocks": 2000, "block_size": 16, "kv_cache_tokens": 32000,
                "max_model_len": 8192, "kv_cache_dtype": "fp8", "gpu_memory_utilization": 0.8}


def serve_flags(script: str) -> dict[str, str]:
    """The `--flag value` pairs of the rendered vllm serve command (comments skipped)."""
    words = " ".join(line.strip().rstrip("\\") for line in script.splitlines()
                     if line.strip().startswith("--")).split()
    return {w: words[i + 1] for i, w in enumerate(words[:-1]) if w.startswith("--")}


def recommend_with(capacity: Path, *extra: str):
    return CliRunner().invoke(cli, ["recommend", LOGS, "--model", "llama-3.1-8b", "--gpu", "H100-80GB",
                                    "--capacity", str(capacity), "--json", *extra], catch_exceptions=False)


def test_a_hand_written_capacity_renders_the_settings_it_was_measured_at(tmp_path):
    capacity = tmp_path / "capacity.json"
    capacity.write_text(json.dumps(MEASURED_FP8))
    result = recommend_with(capacity)
    assert result.exit_code == 0, result.output
    out = json.loads(result.output)
    flags = serve_flags(out["files"]["vllm-serve.sh"])
    assert (flags["--kv-cache-dtype"], flags["--gpu-memory-utilization"], flags["--block-size"]) == ("fp8", "0.8", "16")
    settings = out["recommendation"]["settings"]
    assert [settings[k]["rule"] for k in ("gpu_memory_utilization", "kv_cache_dtype", "block_size")] == [
        "gpu-util-measured", "kv-dtype-measured", "block-size-measured"]
    assert "measured at" in settings["gpu_memory_utilization"]["reason"]
    assert "measured at" in settings["kv_cache_dtype"]["reason"]
    assert out["recommendation"]["capacity"]["block_size"] == 16


def test_settings_the_capacity_file_does_not_name_are_vllms_defaults(tmp_path):
    capacity = tmp_path / "capacity.json"
    capacity.write_text(json.dumps({k: v for k, v in MEASURED_FP8.items()
                                    if k not in ("kv_cache_dtype", "gpu_memory_utilization")}))
    result = recommend_with(capacity, "--kv-cache-dtype", "fp8")
    assert result.exit_code == 0, result.output
    flags = serve_flags(json.loads(result.output)["files"]["vllm-serve.sh"])
    assert (flags["--kv-cache-dtype"], flags["--gpu-memory-utilization"]) == ("fp8", "0.92")


@pytest.mark.parametrize(("flag", "value", "says"), [
    ("--kv-cache-dtype", "auto", "measured at --kv-cache-dtype fp8"),
    ("--gpu-memory-utilization", "0.9", "measured at --gpu-memory-utilization 0.8"),
    ("--block-size", "32", "measured at block size 16"),
])
def test_a_flag_that_contradicts_the_measured_capacity_is_one_line(tmp_path, flag, value, says):
    capacity = tmp_path / "capacity.json"
    capacity.write_text(json.dumps(MEASURED_FP8))
    result = recommend_with(capacity, flag, value)
    assert result.exit_code == 2
    assert result.stderr.startswith(f"Error: {flag}: ") and says in result.stderr
    assert result.stderr.count("\n") == 1 and result.stdout == ""


def test_the_same_value_as_measured_is_no_contradiction(tmp_path):
    capacity = tmp_path / "capacity.json"
    capacity.write_text(json.dumps(MEASURED_FP8))
    result = recommend_with(capacity, "--kv-cache-dtype", "fp8", "--gpu-memory-utilization", "0.80")
    assert result.exit_code == 0, result.output


VLLM_VERSION_WARNING = "Warning: --vllm-version is deprecated; use --engine-version (removed in the next release)\n"


@pytest.mark.parametrize(("flag", "value", "field"), [
    ("--safety-fraction", "1.5", "--safety-fraction"),
    ("--safety-fraction", "0", "--safety-fraction"),
    ("--max-truncation", "2", "--max-truncation"),
    ("--vllm-version", "latest", "--vllm-version"),
    ("--upstream", "http://127.0.0.1:8000/v1", "--upstream"),
    ("--upstream", "http://user:pw@127.0.0.1:8000", "--upstream"),
    ("--upstream", "http://vllm;evil:8000", "--upstream"),
])
def test_a_policy_option_out_of_range_is_one_line_naming_the_flag(flag, value, field):
    result = CliRunner().invoke(cli, ["recommend", LOGS, "--model", "llama-3.1-8b", "--gpu", "H100-80GB", flag, value])
    assert result.exit_code == 2, result.output
    # the old spelling says so on its own line first
    warning = VLLM_VERSION_WARNING if flag == "--vllm-version" else ""
    assert result.stderr.startswith(f"{warning}Error: {field}: ") and result.stderr.count("\n") == 1 + bool(warning)


@pytest.mark.parametrize("flag", ["--engine-version", "--vllm-version"])
def test_engine_version_and_its_older_name_both_set_the_release(flag):
    result = CliRunner().invoke(cli, ["recommend", LOGS, "--model", "llama-3.1-8b", "--gpu", "H100-80GB", "--json",
                                      flag, "0.6.3"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    rec = json.loads(result.stdout)["recommendation"]
    assert rec["engine"]["version"] == "0.6.3" and rec["engine"]["v1"] is False
    assert any(a.startswith("memory model: vLLM 0.6.3 (V0)") for a in rec["capacity"]["assumptions"])


@pytest.mark.parametrize(("version", "rendered"), [("0.19", "0.9"), ("0.20", "0.92")])
def test_the_rendered_utilization_is_the_release_default(tmp_path, version, rendered):
    """recommend --engine-version renders the release's own --gpu-memory-utilization default (0.9
    before 0.20), the one its capacity estimate was computed at."""
    out = tmp_path / "d"
    result = CliRunner().invoke(cli, ["recommend", LOGS, "--model", "llama-3.1-8b", "--gpu", "H100-80GB",
                                      "--engine-version", version, "--out", str(out)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert f"--gpu-memory-utilization {rendered} " in (out / "vllm-serve.sh").read_text()
    rec = json.loads((out / "recommendation.json").read_text())
    assert rec["settings"]["gpu_memory_utilization"]["value"] == float(rendered)


def test_engine_version_and_vllm_version_must_agree():
    result = CliRunner().invoke(cli, ["recommend", LOGS, "--model", "llama-3.1-8b", "--gpu", "H100-80GB",
                                      "--engine-version", "0.6.3", "--vllm-version", "0.19"])
    assert result.exit_code == 2
    assert result.stderr == VLLM_VERSION_WARNING + ("Error: --vllm-version: 0.19 disagrees with --engine-version 0.6.3; give one of them "
                             "(--vllm-version is its older name)\n")


# ---------------------------------------------------------------- --replicas

def test_replicas_render_one_upstream_per_port_each_with_one_engines_budget(tmp_path):
    result = CliRunner().invoke(cli, ["recommend", LOGS, "--model", "llama-3.1-8b", "--gpu", "H100-80GB",
                                      "--upstream", "http://10.0.0.5:8000", "--replicas", "3", "--out",
                                      str(tmp_path)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    nginx = (tmp_path / "nginx.conf").read_text()
    assert "# 3 engine replicas, each with its own block budget under its own keys of the shared dict" in nginx
    assert "Upstream budgets" in result.stdout and "http://10.0.0.5:8002" in result.stdout
    doc = yaml.safe_load((tmp_path / "gateway.yaml").read_text())
    budget = json.loads((tmp_path / "recommendation.json").read_text())["block_budget"]["value"]
    assert "upstream" not in doc and "block_budget" not in doc
    assert doc["upstreams"] == [{"url": f"http://10.0.0.5:{8000 + i}", "block_budget": budget} for i in range(3)]
    checked = CliRunner().invoke(cli, ["check", str(tmp_path / "recommendation.json"), "--model", "llama-3.1-8b",
                                       "--deployed", str(tmp_path / "gateway.yaml")])
    assert checked.exit_code == 0, checked.output


def test_the_health_probe_options_reach_both_gateways_and_check_reads_them_back(tmp_path):
    result = CliRunner().invoke(cli, ["recommend", LOGS, "--model", "llama-3.1-8b", "--gpu", "H100-80GB",
                                      "--replicas", "2", "--health-interval", "0.5", "--health-timeout", "0.25",
                                      "--health-path", "/ready", "--out", str(tmp_path)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    doc = yaml.safe_load((tmp_path / "gateway.yaml").read_text())
    # passive health at its defaults (5 in a row, 2 s doubled up to 60 s, half the replicas)
    assert doc["health"] == {"interval_s": 0.5, "timeout_s": 0.25, "path": "/ready", "consecutive_failures": 5,
                             "ejection_s": 2.0, "max_ejection_s": 60.0, "max_ejected_share": 0.5}
    nginx = (tmp_path / "nginx.conf").read_text()
    assert 'health = { interval_s = 0.5, timeout_s = 0.25, path = "/ready"' in nginx
    assert "consecutive_failures = 5, ejection_s = 2.0, max_ejection_s = 60.0, max_ejected_share = 0.5 }" in nginx
    checked = CliRunner().invoke(cli, ["check", str(tmp_path / "recommendation.json"), "--model", "llama-3.1-8b",
                                       "--deployed", str(tmp_path / "gateway.yaml")])
    assert checked.exit_code == 0, checked.output


def test_passive_health_options_reach_both_gateways_and_check_reads_them_back(tmp_path):
    result = CliRunner().invoke(cli, ["recommend", LOGS, "--model", "llama-3.1-8b", "--gpu", "H100-80GB",
                                      "--replicas", "3", "--health-failures", "3", "--health-ejection", "0.5",
                                      "--health-max-ejection", "8", "--health-max-ejected-share", "0.34",
                                      "--out", str(tmp_path)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    doc = yaml.safe_load((tmp_path / "gateway.yaml").read_text())
    assert doc["health"] == {"interval_s": 1.0, "timeout_s": 1.0, "path": "/health", "consecutive_failures": 3,
                             "ejection_s": 0.5, "max_ejection_s": 8.0, "max_ejected_share": 0.34}
    nginx = (tmp_path / "nginx.conf").read_text()
    assert "consecutive_failures = 3, ejection_s = 0.5, max_ejection_s = 8.0, max_ejected_share = 0.34 }" in nginx
    said = ("ejects an upstream after 3 consecutive 5xx or failed connections, for 0.5 s doubled per ejection "
            "in a row up to 8 s; at most 0.34 of the upstreams at once")
    for name in ("gateway.yaml", "nginx.conf"):
        checked = CliRunner().invoke(cli, ["check", str(tmp_path / "recommendation.json"), "--model",
                                           "llama-3.1-8b", "--deployed", str(tmp_path / name), "--json"])
        assert checked.exit_code == 0, checked.output
        found = {f["code"]: f for f in json.loads(checked.stdout)["findings"]}
        assert said in found["passive-health"]["message"] and "no-passive-health" not in found
    # turned off by hand (or a file rendered before passive health): check warns, in both files
    (tmp_path / "gateway.yaml").write_text((tmp_path / "gateway.yaml").read_text().replace(
        "consecutive_failures: 3", "consecutive_failures: 0"))
    (tmp_path / "nginx.conf").write_text(nginx.replace(
        "consecutive_failures = 3, ejection_s = 0.5, max_ejection_s = 8.0, max_ejected_share = 0.34 }", "}"))
    for name in ("gateway.yaml", "nginx.conf"):
        checked = CliRunner().invoke(cli, ["check", str(tmp_path / "recommendation.json"), "--model",
                                           "llama-3.1-8b", "--deployed", str(tmp_path / name), "--json"])
        assert checked.exit_code == 0, checked.output
        found = {f["code"]: f for f in json.loads(checked.stdout)["findings"]}
        assert found["no-passive-health"]["severity"] == "warn" and "passive-health" not in found
        assert "never ejects an upstream that answers 5xx while its /health passes" in \
            found["no-passive-health"]["message"]


@pytest.mark.parametrize(("args", "line"), [
    (["--health-path", "ready?x"], "Error: health.path: 'ready?x' is not a plain request path"),
    (["--health-interval", "0"], "Error: Invalid value for '--health-interval': 0.0 is not in the range x>=0.05."),
    (["--health-ejection", "90"], "Error: health: passive health needs consecutive_failures ≥ 0, "
                                  "0.01 ≤ ejection_s ≤ max_ejection_s and max_ejected_share in [0, 1]"),
])
def test_a_bad_health_probe_is_one_line_and_writes_nothing(tmp_path, args, line):
    out = tmp_path / "deploy"
    result = CliRunner().invoke(cli, ["recommend", LOGS, "--model", "llama-3.1-8b", "--gpu", "H100-80GB",
                                      "--replicas", "2", *args, "--out", str(out)])
    assert result.exit_code == 2
    assert result.stderr.strip().splitlines()[-1] == line
    assert not out.exists()


@pytest.mark.parametrize(("args", "line"), [
    (["--replicas", "0"], "Error: Invalid value for '--replicas': 0 is not in the range x>=1."),
    (["--replicas", "300"], "Error: --replicas: must be from 1 to 256, got 300"),
    (["--upstream", "http://127.0.0.1:65535", "--replicas", "2"],
     "Error: --replicas: 2 replicas from port 65535 run past port 65535"),
])
def test_replicas_out_of_range_is_one_line(args, line):
    result = CliRunner().invoke(cli, ["recommend", LOGS, "--model", "llama-3.1-8b", "--gpu", "H100-80GB", *args])
    assert result.exit_code == 2 and result.stderr.strip().splitlines()[-1] == line


# ---------------------------------------------------------------- --capacity per replica

def replica_capacity(tmp_path: Path, name: str, num_blocks: int, origin: str | None = None, **extra) -> str:
    """A capacity file as `kvtune calibrate URL --save FILE` writes it for one engine replica."""
    path = tmp_path / name
    path.write_text(json.dumps({"source": "metrics", "num_blocks": num_blocks, "block_size": 16,
                                "kv_cache_tokens": num_blocks * 16, "max_model_len": 8192,
                                **({"origin": origin} if origin else {}), **extra}))
    return str(path)


def recommend_replicas(tmp_path: Path, *args: str):
    return CliRunner().invoke(cli, ["recommend", LOGS, "--model", "llama-3.1-8b", "--gpu", "H100-80GB",
                                    "--upstream", "http://10.0.0.5:8000", *args])


def test_one_capacity_per_replica_gives_each_upstream_its_own_budget(tmp_path):
    small = replica_capacity(tmp_path, "a.json", 2000, origin="http://10.0.0.7:8000/metrics")
    large = replica_capacity(tmp_path, "b.json", 3001)
    out = tmp_path / "deploy"
    result = recommend_replicas(tmp_path, "--capacity", small, "--capacity", large, "--out", str(out))
    assert result.exit_code == 0, result.output
    doc = yaml.safe_load((out / "gateway.yaml").read_text())
    # floor((blocks - 1) x 0.9): the first from its origin, the second on the port after --upstream's
    assert doc["upstreams"] == [{"url": "http://10.0.0.7:8000", "block_budget": 1799},
                                {"url": "http://10.0.0.5:8001", "block_budget": 2700}]
    rec = json.loads((out / "recommendation.json").read_text())
    assert rec["block_budget"]["value"] == 1799  # caps and settings: the smallest replica's
    assert [u["block_budget"] for u in rec["upstreams"]] == [1799, 2700]
    assert any("smallest replica's" in n for n in rec["notes"])
    check = ["check", str(out / "recommendation.json"), "--model", "llama-3.1-8b", "--deployed"]
    checked = CliRunner().invoke(cli, [*check, str(out / "gateway.yaml")])
    assert checked.exit_code == 0, checked.output
    # the larger replica's budget is no risk on it, but the small one's own capacity holds it back
    moved = (out / "gateway.yaml").read_text().replace("block_budget: 1799", "block_budget: 2500")
    (tmp_path / "moved.yaml").write_text(moved)
    flagged = CliRunner().invoke(cli, [*check, str(tmp_path / "moved.yaml")])
    assert flagged.exit_code == 1, flagged.output
    assert "upstream http://10.0.0.7:8000: block budget 2500" in flagged.output
    assert "budget-over-capacity" in flagged.output


def test_each_replica_gets_its_own_engine_limits_without_an_objective(tmp_path):
    """The rules on each replica's own capacity, as one replica alone would get them: its
    max_num_seqs grows with its budget, and vllm-serve.sh's header says what it adds."""
    small = replica_capacity(tmp_path, "a.json", 2000)
    large = replica_capacity(tmp_path, "b.json", 3001)
    out = tmp_path / "deploy"
    result = recommend_replicas(tmp_path, "--capacity", small, "--capacity", large, "--out", str(out))
    assert result.exit_code == 0, result.output
    rec = json.loads((out / "recommendation.json").read_text())
    alone = [json.loads(recommend_replicas(tmp_path, "--capacity", f, "--json").stdout)["recommendation"]["settings"]
             for f in (small, large)]
    limits = [(u["max_num_seqs"], u["max_num_batched_tokens"]) for u in rec["upstreams"]]
    assert limits == [(s["max_num_seqs"]["value"], s["max_num_batched_tokens"]["value"]) for s in alone]
    assert limits[1][0] > limits[0][0] == rec["settings"]["max_num_seqs"]["value"]
    script = (out / "vllm-serve.sh").read_text()
    assert f"#   http://10.0.0.5:8000 ({small}): ./vllm-serve.sh --host 10.0.0.5 --port 8000\n" in script
    assert (f"#   http://10.0.0.5:8001 ({large}): ./vllm-serve.sh --host 10.0.0.5 --port 8001 "
            f"--max-num-seqs {limits[1][0]}") in script
    assert "max_num_seqs" in result.stdout and "batched tokens" in result.stdout  # the upstream budgets table
    checked = CliRunner().invoke(cli, ["check", str(out / "recommendation.json"), "--model", "llama-3.1-8b",
                                       "--deployed", str(out / "gateway.yaml"), "--deployed", str(out / "vllm-serve.sh")])
    assert checked.exit_code == 0, checked.output


@pytest.mark.parametrize(("origin", "args", "line"), [
    (None, ["--replicas", "3"], "Error: --replicas: 3 replicas, but 2 --capacity files (one per replica): give as "
                                "many of each, or leave --replicas out"),
    ("http://10.0.0.9:8000", [], "Error: --capacity: {b} and {a} are both upstream http://10.0.0.9:8000: give one "
                                 "capacity file per engine replica"),
])
def test_capacity_files_that_do_not_make_replicas_are_one_line(tmp_path, origin, args, line):
    a = replica_capacity(tmp_path, "a.json", 2000, origin=origin)
    b = replica_capacity(tmp_path, "b.json", 3000, origin=origin)
    out = tmp_path / "deploy"
    result = recommend_replicas(tmp_path, "--capacity", a, "--capacity", b, *args, "--out", str(out))
    assert result.exit_code == 2, result.output
    assert result.stderr.strip().splitlines() == [line.format(a=a, b=b)]
    assert not out.exists()


@pytest.mark.parametrize(("num_blocks", "extra"), [
    (3000, {"max_model_len": 2048}),  # runs at a shorter context than the logged requests need (3,264)
    (150, {}),  # 149 usable blocks hold 2,384 tokens: the smallest, yet no request of 3,264 fits
])
def test_a_replica_too_small_for_max_model_len_is_one_line_naming_its_file(tmp_path, num_blocks, extra):
    held = min(extra.get("max_model_len", 8192), (num_blocks - 1) * 16)
    a = replica_capacity(tmp_path, "a.json", 2000)
    tiny = replica_capacity(tmp_path, "tiny.json", num_blocks, **extra)
    out = tmp_path / "deploy"
    result = recommend_replicas(tmp_path, "--capacity", a, "--capacity", tiny, "--out", str(out))
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert lines == [f"Error: {tiny}: --max-model-len: this replica holds {held:,} tokens of context, below the "
                     "--max-model-len 3,264 every replica runs at: give it more KV memory or lower --max-model-len"]
    assert not out.exists()


@pytest.mark.parametrize("command", ["capacity", "check"])
def test_several_capacity_files_are_recommends_alone(tmp_path, command):
    a, b = replica_capacity(tmp_path, "a.json", 2000), replica_capacity(tmp_path, "b.json", 3000)
    gateway = tmp_path / "gateway.yaml"
    gateway.write_text(yaml.safe_dump({"version": 1, "upstream": "http://127.0.0.1:8000", "block_size": 16,
                                       "block_budget": 1000, "max_model_len": 4096,
                                       "routes": [{"name": "default", "max_new_tokens": 700}]}))
    head = (["capacity", "llama-3.1-8b"] if command == "capacity"
            else ["check", LOGS, "--model", "llama-3.1-8b", "--deployed", str(gateway)])
    result = CliRunner().invoke(cli, [*head, "--gpu", "H100-80GB", "--capacity", a, "--capacity", b])
    assert result.exit_code == 2, result.output
    assert result.stderr.strip().splitlines()[-1] == (
        "Error: --capacity: give one capacity file here; several (one per engine replica) only "
        "`kvtune recommend` takes")


# ---------------------------------------------------------------- --nginx-replicas

def test_nginx_replicas_render_a_slice_each_say_so_and_pass_check(tmp_path):
    result = CliRunner().invoke(cli, ["recommend", LOGS, "--model", "llama-3.1-8b", "--gpu", "H100-80GB",
                                      "--nginx-replicas", "2", "--out", str(tmp_path)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    budget = json.loads((tmp_path / "recommendation.json").read_text())["block_budget"]["value"]
    share = budget // 2
    text = (tmp_path / "nginx.conf").read_text()
    assert "# this nginx holds 1/2 of the engine's budget" in text and f"block_budget = {share}," in text
    assert "Upstream budgets (2 nginx replicas, a static slice each)" in result.stdout
    assert f"{share:,}" in result.stdout and "copied (the recommended budget)" in result.stdout
    checked = CliRunner().invoke(cli, ["check", str(tmp_path / "recommendation.json"), "--model", "llama-3.1-8b",
                                       "--deployed", str(tmp_path / "nginx.conf")])
    assert checked.exit_code == 0, checked.output


@pytest.mark.parametrize(("args", "line"), [
    (["--nginx-replicas", "0"], "Error: Invalid value for '--nginx-replicas': 0 is not in the range x>=1."),
    (["--nginx-replicas", "257"], "Error: --nginx-replicas: must be from 1 to 256, got 257"),
])
def test_nginx_replicas_refusals_are_one_line(tmp_path, args, line):
    result = CliRunner().invoke(cli, ["recommend", LOGS, "--model", "llama-3.1-8b", "--gpu", "H100-80GB", *args,
                                      "--out", str(tmp_path / "out")])
    assert result.exit_code == 2, result.output
    assert result.stderr.strip().splitlines()[-1] == line
    assert not (tmp_path / "out").exists()
