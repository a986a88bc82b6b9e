"""`kvtune check` recomputes the KV pool from the deployed engine's own flags (kvtune.deploy.pool)
and holds every gateway budget to it: an edited flag that shrinks the pool below the budget is a
risk, naming both numbers and the flag; a measured capacity wins over the flags."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvtune.cli import cli

REPO = Path(__file__).resolve().parents[2]
LOGS = str(REPO / "sample_logs")
H100 = ["--model", "llama-3.1-8b", "--gpu", "H100-80GB"]


def recommend(out: Path, *args: str) -> Path:
    made = CliRunner().invoke(cli, ["recommend", LOGS, *H100, *args, "--out", str(out)], catch_exceptions=False)
    assert made.exit_code == 0, made.output
    return out


def check(*args: str):
    return CliRunner().invoke(cli, ["check", LOGS, *H100, *args, "--json"], catch_exceptions=False)


def edit(path: Path, flag: str, value: str) -> None:
    """Set `flag` to `value` in a rendered launch script (adding it when absent)."""
    text = path.read_text()
    if re.search(rf"^    {flag} \S+ \\$", text, flags=re.M):
        text = re.sub(rf"^    {flag} \S+ \\$", f"    {flag} {value} \\\\", text, flags=re.M)
    else:
        text = text.replace('    "$@"', f"    {flag} {value} \\\n    \"$@\"")
    path.write_text(text)


def findings(result, severity: str = "risk") -> dict[str, dict]:
    data = json.loads(result.output)
    return {f["code"]: f for f in data["findings"] if f["severity"] == severity}


@pytest.fixture(scope="module")
def rendered(tmp_path_factory) -> Path:
    return recommend(tmp_path_factory.mktemp("deploy"))


@pytest.mark.parametrize("gateway", ["gateway.yaml", "nginx.conf"])
def test_utilization_edited_down_leaves_a_pool_below_the_budget(tmp_path, rendered, gateway):
    """Issue #25 item 2: --gpu-memory-utilization 0.80 in the rendered script was only `WARN drift`;
    the pool it leaves (20,692 blocks) is under the 24,468-block budget the gateway admits to."""
    serve = tmp_path / "vllm-serve.sh"
    serve.write_text((rendered / "vllm-serve.sh").read_text())
    edit(serve, "--gpu-memory-utilization", "0.80")
    result = check("--deployed", str(serve), "--deployed", str(rendered / gateway))
    assert result.exit_code == 1, result.output
    risk = findings(result)["pool-below-budget"]
    assert risk["source"] == str(rendered / gateway)
    budget = json.loads((rendered / "recommendation.json").read_text())["block_budget"]["value"]
    assert f"budget {budget} × 16 tokens" in risk["message"]
    assert "20,692 blocks × 16 tokens" in risk["message"]
    assert "shrunk by gpu_memory_utilization 0.8 (at the recommended 0.92" in risk["message"]


@pytest.mark.parametrize(("flag", "value", "named"), [
    ("--max-num-seqs", "16384", "max_num_seqs 16384"),  # the profile's dummy sampler sorts 16,384 × vocab logits
    ("--max-num-batched-tokens", "262144", "max_num_batched_tokens 262144"),  # a larger forward activation peak
    ("--kv-cache-memory-bytes", "20000000000", "kv_cache_memory_bytes 20000000000"),
    ("--num-gpu-blocks-override", "20000", None),
])
def test_every_pool_flag_is_recomputed(tmp_path, rendered, flag, value, named):
    serve = tmp_path / "vllm-serve.sh"
    serve.write_text((rendered / "vllm-serve.sh").read_text())
    edit(serve, flag, value)
    result = check("--deployed", str(serve), "--deployed", str(rendered / "gateway.yaml"))
    assert result.exit_code == 1, result.output
    risk = findings(result)["pool-below-budget"]
    if named:
        assert named in risk["message"]


def test_flags_that_grow_the_pool_are_not_a_risk(tmp_path, rendered):
    """fp8 KV and --enforce-eager leave a larger pool than recommended: the budget still fits."""
    serve = tmp_path / "vllm-serve.sh"
    serve.write_text((rendered / "vllm-serve.sh").read_text())
    edit(serve, "--kv-cache-dtype", "fp8")
    edit(serve, "--enforce-eager", "")
    result = check("--deployed", str(serve), "--deployed", str(rendered / "gateway.yaml"))
    assert not {"pool-below-budget", "budget-over-capacity", "budget-above-safety"} & (
        set(findings(result)) | set(findings(result, "warn"))), result.output


def test_a_raised_budget_is_held_to_the_deployed_pool(tmp_path, rendered):
    """Raising block_budget by hand over the pool the unedited flags leave is a risk, as before."""
    gateway = tmp_path / "gateway.yaml"
    text = (rendered / "gateway.yaml").read_text()
    budget = json.loads((rendered / "recommendation.json").read_text())["block_budget"]["value"]
    gateway.write_text(text.replace(f"block_budget: {budget}", "block_budget: 40000"))
    result = check("--deployed", str(rendered / "vllm-serve.sh"), "--deployed", str(gateway))
    assert result.exit_code == 1, result.output
    assert "pool-below-budget" in findings(result)


def test_max_model_len_that_does_not_fit_the_deployed_pool(tmp_path, rendered):
    """At 0.30 of an H100 Llama-3.1-8B keeps a pool smaller than one request of its 131,072-token
    context (rendered since issue 25 item 11; it was 32,896 when max_model_len was the longest
    logged request): vLLM refuses to start."""
    serve = tmp_path / "vllm-serve.sh"
    serve.write_text((rendered / "vllm-serve.sh").read_text())
    edit(serve, "--gpu-memory-utilization", "0.30")
    result = check("--deployed", str(serve), "--deployed", str(rendered / "gateway.yaml"))
    assert result.exit_code == 1, result.output
    risk = findings(result)["max-model-len-over-pool"]
    assert risk["message"].startswith("max_model_len 131,072 needs 8,192 blocks of 16 tokens")
    assert risk["why"].startswith("vLLM would refuse to start")


def test_a_measured_capacity_wins_over_the_flags(tmp_path):
    """With --kv-tokens the pool is the measured one: the edited utilization drifts but the
    budget is held to the measurement, not to the flags' arithmetic."""
    out = recommend(tmp_path / "d", "--kv-tokens", "400000")
    edit(out / "vllm-serve.sh", "--gpu-memory-utilization", "0.80")
    result = check("--kv-tokens", "400000", "--deployed", str(out / "vllm-serve.sh"),
                   "--deployed", str(out / "gateway.yaml"))
    assert result.exit_code == 0, result.output
    assert "pool-below-budget" not in findings(result)
    assert "drift" in findings(result, "warn")


def test_sglang_mem_fraction_edited_down(tmp_path):
    out = recommend(tmp_path / "d", "--engine", "sglang")
    edit(out / "sglang-serve.sh", "--mem-fraction-static", "0.70")
    result = check("--engine", "sglang", "--deployed", str(out / "sglang-serve.sh"),
                   "--deployed", str(out / "gateway.yaml"))
    assert result.exit_code == 1, result.output
    assert "gpu_memory_utilization 0.7" in findings(result)["pool-below-budget"]["message"]


def test_a_saved_recommendation_is_held_to_the_deployed_pool(tmp_path, rendered):
    """check deploy/recommendation.json recomputes the pool as check on the logs does."""
    serve = tmp_path / "vllm-serve.sh"
    serve.write_text((rendered / "vllm-serve.sh").read_text())
    edit(serve, "--gpu-memory-utilization", "0.80")
    result = CliRunner().invoke(cli, ["check", str(rendered / "recommendation.json"), "--model", "llama-3.1-8b",
                                      "--deployed", str(serve), "--deployed", str(rendered / "nginx.conf"), "--json"],
                                catch_exceptions=False)
    assert result.exit_code == 1, result.output
    assert "20,692 blocks × 16 tokens" in findings(result)["pool-below-budget"]["message"]


def test_a_model_that_cannot_be_resolved_says_the_pool_was_not_recomputed(tmp_path, rendered):
    saved = json.loads((rendered / "recommendation.json").read_text())
    saved["model"] = str(tmp_path / "gone")  # a model directory that no longer exists
    rec = tmp_path / "recommendation.json"
    rec.write_text(json.dumps(saved))
    result = CliRunner().invoke(cli, ["check", str(rec), "--model", saved["model"], "--deployed",
                                      str(rendered / "vllm-serve.sh"), "--json"], catch_exceptions=False)
    info = findings(result, "info")["pool-not-recomputed"]
    assert info["message"].startswith("the KV pool was not recomputed from the engine's flags: ")


def test_trtllm_free_gpu_memory_fraction_edited_down(tmp_path):
    """TensorRT-LLM's pool follows kv_cache_config.free_gpu_memory_fraction in the extra YAML."""
    from tokenizers import Tokenizer, models

    tokenizer = tmp_path / "tokenizer"
    tokenizer.mkdir()
    Tokenizer(models.WordLevel({"<unk>": 0, "hi": 1}, unk_token="<unk>")).save(str(tokenizer / "tokenizer.json"))
    (tokenizer / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages[0]['content'] }}"}))
    out = recommend(tmp_path / "d", "--engine", "trtllm", "--gateway-tokenizer", str(tokenizer))
    deployed = ["--deployed", str(out / "trtllm-serve.sh"), "--deployed", str(out / "gateway.yaml")]
    assert check("--engine", "trtllm", *deployed).exit_code == 0
    options = out / "trtllm-llm-api.yaml"
    text = options.read_text()
    assert "  free_gpu_memory_fraction: 0.9\n" in text
    options.write_text(text.replace("  free_gpu_memory_fraction: 0.9\n", "  free_gpu_memory_fraction: 0.6\n"))
    result = check("--engine", "trtllm", *deployed)
    assert result.exit_code == 1, result.output
    risk = findings(result)["pool-below-budget"]["message"]
    assert "blocks × 32 tokens" in risk and "gpu_memory_utilization 0.6 (at the recommended 0.9" in risk


def test_every_upstream_of_a_replicated_gateway_is_held_to_the_deployed_pool(tmp_path, rendered):
    """gateway.yaml with --replicas 3 holds one engine's budget per upstream: each is checked
    against the pool the deployed engine's flags leave."""
    out = recommend(tmp_path / "d", "--replicas", "3")
    edit(out / "vllm-serve.sh", "--gpu-memory-utilization", "0.80")
    result = check("--deployed", str(out / "vllm-serve.sh"), "--deployed", str(out / "gateway.yaml"))
    assert result.exit_code == 1, result.output
    risks = [f for f in json.loads(result.output)["findings"] if f["code"] == "pool-below-budget"]
    assert [r["message"].split(": block budget")[0] for r in risks] == [
        f"upstream http://127.0.0.1:{8000 + i}" for i in range(3)]
    assert all("20,692 blocks × 16 tokens" in r["message"] for r in risks)


def test_nginx_slices_together_are_held_to_the_deployed_pool(tmp_path):
    """nginx.conf rendered with --nginx-replicas 2 holds one slice per nginx: both slices together
    are checked against the pool the deployed engine's flags leave."""
    out = recommend(tmp_path / "d", "--nginx-replicas", "2")
    edit(out / "vllm-serve.sh", "--gpu-memory-utilization", "0.80")
    result = check("--deployed", str(out / "vllm-serve.sh"), "--deployed", str(out / "nginx.conf"))
    assert result.exit_code == 1, result.output
    risk = findings(result)["pool-below-budget"]["message"]
    assert risk.startswith("2 nginx replicas x slice ") and "20,692 blocks × 16 tokens" in risk
