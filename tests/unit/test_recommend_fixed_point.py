"""One fixed point (issue #25 item 3): the scheduler limits recommend renders are the ones its
memory estimate assumed. vLLM's startup profile sorts max_num_seqs × vocab logits and runs a
forward over max_num_batched_tokens tokens, so re-estimating the pool with the rendered flags
must give exactly the pool and budget recommend printed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvtune.cli import cli
from kvtune.deploy.pool import deployed_capacity
from kvtune.deploy.read import load_deployed
from kvtune.model import resolve_model
from kvtune.weights import weights_for

REPO = Path(__file__).resolve().parents[2]
LOGS = str(REPO / "sample_logs")


@pytest.mark.parametrize(("model", "gpu", "tp"), [
    ("llama-3.1-8b", "H100-80GB", 1),
    ("llama-3.1-8b", "L40S", 1),
    ("qwen3-8b", "L40S", 1),
    ("qwen3-8b", "H100-80GB", 1),
    ("mistral-7b", "A100-80GB", 1),
    ("llama-3.1-70b", "H100-80GB", 4),
])
def test_rendered_flags_reestimate_to_the_printed_pool(tmp_path, model, gpu, tp):
    out = tmp_path / "d"
    # the sample logs name Llama-3.1-8B-Instruct: another model serves its own checkpoint on purpose
    served = ["--served-model", resolve_model(model).serve_id] if not model.startswith("llama-3.1-8b") else []
    result = CliRunner().invoke(cli, ["recommend", LOGS, "--model", model, "--gpu", gpu, "--tp", str(tp),
                                      *served, "--out", str(out)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    rec = json.loads((out / "recommendation.json").read_text())
    blocks, budget = rec["capacity"]["num_blocks"], rec["block_budget"]["value"]
    printed = " ".join(result.output.split())  # the terminal wraps the headline
    assert f"KV pool {blocks:,} blocks × 16 tokens (estimate), budget {budget:,} blocks" in printed

    serve = load_deployed(str(out / "vllm-serve.sh"))
    spec = resolve_model(model)
    again = deployed_capacity(serve, spec, weights_for(spec), gpu=rec["hardware"]["gpu"],
                              gpu_memory_bytes=rec["hardware"]["gpu_memory_bytes"]).capacity
    assert again.num_blocks == blocks
    assert int((again.num_blocks - 1) * rec["safety_fraction"]["value"]) == budget
    seqs = rec["settings"]["max_num_seqs"]
    assert serve.max_num_seqs == seqs["value"]
    assert "the memory estimate profiled the sampler at this count" in seqs["reason"]
    assert "the memory estimate's activation peak assumed it" in rec["settings"]["max_num_batched_tokens"]["reason"]
    # the estimate's own assumption names the count it profiled the sampler at
    assert any(f"dummy sampler: {seqs['value']:,} seqs" in a for a in rec["capacity"]["assumptions"])


def test_rendered_files_check_clean(tmp_path):
    """kvtune check, which recomputes the pool from the deployed flags, finds the rendered files at
    exactly the recommended pool: no budget warning."""
    out = tmp_path / "d"
    common = ["--model", "llama-3.1-8b", "--gpu", "L40S"]
    made = CliRunner().invoke(cli, ["recommend", LOGS, *common, "--out", str(out)], catch_exceptions=False)
    assert made.exit_code == 0, made.output
    result = CliRunner().invoke(cli, ["check", LOGS, *common, "--deployed", str(out / "vllm-serve.sh"),
                                      "--deployed", str(out / "gateway.yaml"), "--json"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert not [f for f in json.loads(result.output)["findings"] if f["severity"] != "info"]


@pytest.mark.parametrize(("engine", "gpu"), [("sglang", "H100-80GB"), ("sglang", "L40S")])
def test_other_engines_rendered_flags_reestimate_to_the_printed_pool(tmp_path, engine, gpu):
    """SGLang's pool does not depend on its scheduler limits in kvtune's model (it pins
    --max-total-tokens to the estimate): its rendered flags re-estimate to the printed pool too."""
    out = tmp_path / "d"
    result = CliRunner().invoke(cli, ["recommend", LOGS, "--model", "llama-3.1-8b", "--gpu", gpu, "--engine", engine,
                                      "--out", str(out)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    rec = json.loads((out / "recommendation.json").read_text())
    spec = resolve_model("llama-3.1-8b")
    again = deployed_capacity(load_deployed(str(out / f"{engine}-serve.sh")), spec, weights_for(spec),
                              gpu=rec["hardware"]["gpu"], gpu_memory_bytes=rec["hardware"]["gpu_memory_bytes"]).capacity
    assert again.num_blocks == rec["capacity"]["num_blocks"]
