"""Each engine's launch files: rendered from a real recommendation (the bundled sample logs on an
H100), read back into the same settings, and judged by `check` with the risks of that engine.
SGLang's own parser and TensorRT-LLM's source tables check the same files in
test_engine_parsers.py."""

from __future__ import annotations

from pathlib import Path

import pytest

import kvtune
from kvtune.deploy.check import check_deployment
from kvtune.deploy.launch import launcher
from kvtune.deploy.read import load_deployed, parse_deployed
from kvtune.deploy.render import RenderOptions, default_targets, render_files
from kvtune.domain.admission_policy import parse_admission
from kvtune.errors import InputError, OptionError, UnknownNameError

SAMPLE_LOGS = Path(__file__).parents[2] / "sample_logs"


@pytest.fixture(scope="module")
def profile():
    return kvtune.profile_logs([str(SAMPLE_LOGS)])


def recommendation(profile, engine: str, admission: str = "guaranteed"):
    from kvtune.policy.recommend import RecommendOptions
    from kvtune.policy.recommend import recommend as apply_rules

    plan = kvtune.plan(kvtune.Deployment("llama-3.1-8b", gpu="H100-80GB", engine=engine))
    policy = parse_admission({"policy": admission, **({"epsilon": 0.01} if admission == "statistical" else {})},
                             lambda field, why: ValueError(f"{field}: {why}"))
    return apply_rules(profile, plan, RecommendOptions(engine=engine, admission=policy))


def rendered(rec, tmp_path: Path, tokenizer: Path | None = None) -> dict[str, str]:
    files = kvtune.render(rec, gateway_tokenizer=None if tokenizer is None else str(tokenizer))
    kvtune.write_files(tmp_path, files)
    return files


def findings(result) -> set[str]:
    return {f"{f.severity.value} {f.code}" for f in result.findings}


# --- SGLang ---------------------------------------------------------------------------------------


def test_sglang_script_carries_every_setting_with_its_rule(profile, tmp_path):
    rec = recommendation(profile, "sglang")
    files = rendered(rec, tmp_path)
    # the engine's files, then what other tools read: estimates.json/.yaml (no Kubernetes manifests: vLLM only)
    assert sorted(files) == sorted([*default_targets(rec), "estimates.json", "estimates.yaml"])
    assert "sglang-serve.sh" in files and "vllm-serve.sh" not in files
    script = files["sglang-serve.sh"]
    assert "exec python3 -m sglang.launch_server" in script
    assert "export SGLANG_INIT_NEW_TOKEN_RATIO=1.0" in script
    assert "export SGLANG_MIN_NEW_TOKEN_RATIO_FACTOR=1.0" in script
    largest = max(r.cap for r in rec.routes)
    assert f"export SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION={largest}" in script
    assert f"export SGLANG_MAX_NEW_TOKENS_LIMIT={largest}" in script
    assert f"--max-total-tokens {rec.capacity.kv_cache_tokens}" in script
    assert "--page-size 1 " in script  # SGLang's page: the gateway's blocks are tokens
    for flag in ("--context-length", "--max-running-requests", "--chunked-prefill-size", "--mem-fraction-static",
                 "--max-queued-requests", "--schedule-conservativeness", "--enable-metrics", "--tp-size"):
        assert f"\n    {flag}" in script, flag
        assert f"\n# {flag}" in script, flag  # with its rule and reason
    deployed = load_deployed(tmp_path / "sglang-serve.sh")
    assert deployed.kind.value == "sglang"
    assert deployed.max_new_tokens == largest and deployed.kv_cache_tokens == rec.capacity.kv_cache_tokens
    assert deployed.options["init_new_token_ratio"] == 1.0
    gateway = load_deployed(tmp_path / "gateway.yaml")
    assert gateway.block_size == 1
    assert findings(check_deployment([deployed, gateway], rec)) <= {"info gateway-budget"}


def test_sglang_under_a_betting_gateway_keeps_its_own_estimate(profile, tmp_path):
    rec = recommendation(profile, "sglang", "statistical")
    script = rendered(rec, tmp_path)["sglang-serve.sh"]
    assert "SGLANG_INIT_NEW_TOKEN_RATIO=0.7" in script and "SGLANG_MIN_NEW_TOKEN_RATIO_FACTOR=0.14" in script
    assert rec.setting("init_new_token_ratio").rule == "ratio-default"


def test_sglang_without_a_gateway_and_a_decaying_estimate_is_a_retraction_risk(profile, tmp_path):
    rec = recommendation(profile, "sglang")
    script = ("python -m sglang.launch_server --model-path meta-llama/Llama-3.1-8B --context-length 32885 "
              "--max-running-requests 4096 --page-size 1\n")
    result = check_deployment([parse_deployed(script, source="s.sh")], rec)
    codes = findings(result)
    assert "risk no-output-cap" in codes  # no SGLANG_MAX_NEW_TOKENS_LIMIT and no gateway
    assert "risk preemption-risk" in codes
    assert "warn estimate-not-pinned" in codes
    pinned = ("SGLANG_INIT_NEW_TOKEN_RATIO=1 SGLANG_MIN_NEW_TOKEN_RATIO_FACTOR=1 SGLANG_MAX_NEW_TOKENS_LIMIT=1143 "
              "SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION=100 " + script)
    codes = findings(check_deployment([parse_deployed(pinned, source="s.sh")], rec))
    assert "risk preemption-risk" not in codes and "risk no-output-cap" not in codes
    assert "warn estimate-clipped" in codes  # CLIP 100 under-counts the 1143-token route


def test_sglang_environment_is_read_as_the_shell_sets_it():
    text = ("#!/bin/sh\nexport SGLANG_MAX_NEW_TOKENS_LIMIT=512\nSGLANG_INIT_NEW_TOKEN_RATIO=1.0 exec python3 -m "
            "sglang.launch_server --model-path m --tp-size 2 --enable-metrics --page-size 16\n")
    d = parse_deployed(text, source="s.sh")
    assert (d.max_new_tokens, d.options["init_new_token_ratio"], d.tensor_parallel_size, d.block_size) == (
        512, 1.0, 2, 16)
    assert d.model == "m" and d.flags["enable-metrics"] is True


@pytest.mark.parametrize("text,field", [
    ("export SGLANG_MAX_NEW_TOKENS_LIMIT=lots\npython -m sglang.launch_server --model-path m\n",
     "SGLANG_MAX_NEW_TOKENS_LIMIT"),
    ("SGLANG_INIT_NEW_TOKEN_RATIO=1.5 python -m sglang.launch_server --model-path m\n", "SGLANG_INIT_NEW_TOKEN_RATIO"),
    ("python -m sglang.launch_server --model-path m --mem-fraction-static 2\n", "--mem-fraction-static"),
    ("python -m sglang.launch_server --model-path m --context-length\n", "--context-length"),
])
def test_bad_sglang_values_name_the_variable_or_flag(text, field):
    with pytest.raises(InputError) as info:
        parse_deployed(text, source="s.sh")
    assert info.value.field == field and info.value.path == "s.sh"


# --- TensorRT-LLM ---------------------------------------------------------------------------------


def test_trtllm_gateway_counts_with_the_served_models_tokenizer_by_its_hub_id(profile):
    rec = recommendation(profile, "trtllm")
    assert "nginx.conf" not in default_targets(rec)  # nginx counts with /tokenize, which trtllm-serve lacks
    gateway = render_files(rec)["gateway.yaml"]  # the engine's files never wait on a tokenizer directory
    assert '  method: "tokenizer"\n  tokenizer: "meta-llama/Llama-3.1-8B"\n' in gateway
    with pytest.raises(OptionError, match="nginx.conf cannot run a tokenizer"):
        render_files(rec, targets=["nginx.conf"])
    assert "nginx.conf" in render_files(rec, targets=["nginx.conf"], options=RenderOptions(estimate_chars_per_token=4))


def test_trtllm_script_and_options_read_back(profile, tmp_path, model_dir):
    rec = recommendation(profile, "trtllm")
    out = tmp_path / "deploy"
    files = rendered(rec, out, tokenizer=model_dir)
    script, options = files["trtllm-serve.sh"], files["trtllm-llm-api.yaml"]
    assert "exec trtllm-serve meta-llama/Llama-3.1-8B" in script
    assert '--extra_llm_api_options "$(dirname "$0")"/trtllm-llm-api.yaml' in script
    assert "capacity_scheduler_policy: \"GUARANTEED_NO_EVICT\"" in options
    assert f"max_tokens: {rec.capacity.kv_cache_tokens}" in options and "tokens_per_block: 32" in options
    deployed = load_deployed(out / "trtllm-serve.sh")  # reads the YAML beside it
    assert deployed.kind.value == "trtllm"
    assert (deployed.block_size, deployed.kv_cache_tokens, deployed.max_model_len) == (
        32, rec.capacity.kv_cache_tokens, rec.max_model_len)
    assert deployed.options["capacity_scheduler_policy"] == "GUARANTEED_NO_EVICT"
    gateway = load_deployed(out / "gateway.yaml")
    assert findings(check_deployment([deployed, gateway], rec)) <= {"info gateway-budget"}
    # alone, nothing caps output and a request without max_tokens reserves the whole window
    assert "risk no-output-cap" in findings(check_deployment([deployed], rec))


def test_trtllm_statistical_gateway_pairs_with_max_utilization(profile, tmp_path, model_dir):
    rec = recommendation(profile, "trtllm", "statistical")
    files = rendered(rec, tmp_path, tokenizer=model_dir)
    assert 'capacity_scheduler_policy: "MAX_UTILIZATION"' in files["trtllm-llm-api.yaml"]
    deployed = load_deployed(tmp_path / "trtllm-serve.sh")
    # MAX_UTILIZATION evicts: without the gateway the engine's batch can outgrow the pool
    assert "risk preemption-risk" in findings(check_deployment([deployed], rec))


def test_trtllm_options_file_errors_name_the_file(tmp_path):
    script = tmp_path / "serve.sh"
    script.write_text("trtllm-serve m --max_seq_len 4096 --extra_llm_api_options opts.yaml\n")
    with pytest.raises(InputError) as info:
        load_deployed(script)
    assert info.value.field == "--extra_llm_api_options"
    (tmp_path / "opts.yaml").write_text("kv_cache_config:\n  tokens_per_block: many\n")
    with pytest.raises(InputError) as info:
        load_deployed(script)
    assert (info.value.path, info.value.field) == ("opts.yaml", "kv_cache_config.tokens_per_block")
    (tmp_path / "opts.yaml").write_text("kv_cache_config: 3\n")
    with pytest.raises(InputError, match="expected a mapping"):
        load_deployed(script)


def test_a_file_for_another_engine_is_named_and_not_drift_checked(profile, tmp_path):
    rec = recommendation(profile, "sglang")
    vllm_script = "vllm serve meta-llama/Llama-3.1-8B --max-model-len 4096\n"
    codes = findings(check_deployment([parse_deployed(vllm_script, source="v.sh")], rec))
    assert "warn engine-mismatch" in codes and "warn drift" not in codes


def test_every_engine_has_a_launch_module():
    for engine in ("vllm", "sglang", "trtllm"):
        module = launcher(engine)
        assert module.ENGINE == engine and module.SCRIPT in module.FILES
    with pytest.raises(UnknownNameError, match="unknown engine"):
        launcher("tgi")


def test_the_cli_renders_the_engine_release_it_was_told(tmp_path):
    from click.testing import CliRunner

    from kvtune.cli import cli

    result = CliRunner().invoke(cli, ["recommend", str(SAMPLE_LOGS), "--model", "llama-3.1-8b", "--gpu", "H100-80GB",
                                      "--engine", "sglang", "--engine-version", "0.4.6", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    script = (tmp_path / "sglang-serve.sh").read_text(encoding="utf-8")
    assert script.splitlines()[1].startswith("# Rendered by kvtune") and "SGLang 0.4.6 serving" in script
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["sglang-serve.sh", "gateway.yaml", "nginx.conf", "litellm-config.yaml", "lua", "recommendation.json",
         "report.html", "report.md", "estimates.json", "estimates.yaml"])
    result = CliRunner().invoke(cli, ["recommend", str(SAMPLE_LOGS), "--model", "llama-3.1-8b", "--gpu", "H100-80GB",
                                      "--engine", "trtllm", "--out", str(tmp_path / "t")])
    assert result.exit_code == 0, result.output  # no --gateway-tokenizer: the engine's files all the same
    assert sorted(p.name for p in (tmp_path / "t").iterdir()) == sorted(
        ["trtllm-serve.sh", "trtllm-llm-api.yaml", "gateway.yaml", "litellm-config.yaml", "recommendation.json",
         "report.html", "report.md", "estimates.json", "estimates.yaml"])
    assert "Note: nginx.conf is not rendered for TensorRT-LLM: its server has no /tokenize" in result.stderr
