"""Issue 25 item 1, `check`'s part: each failed condition of the feasibility verdict is a RISK
finding (exit 1): the recommendation's own, and a deployed engine's max_model_len its pool cannot hold."""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner

from kvtune.cli import cli

# the sample logs name meta-llama/Llama-3.1-8B-Instruct: serving the 70B on them is another checkpoint, said so
LLAMA_70B = ["--model", "llama-3.1-70b", "--served-model", "meta-llama/Llama-3.1-70B-Instruct"]
SAMPLE = str(Path(__file__).parents[2] / "sample_logs")


def run(*args: str):
    return CliRunner().invoke(cli, list(args))


def test_a_deployed_max_model_len_the_pool_cannot_hold_is_a_risk(tmp_path):
    out = tmp_path / "d"
    assert run("recommend", SAMPLE, *LLAMA_70B, "--kv-tokens", "40000", "--out",
               str(out)).exit_code == 0
    script = out / "vllm-serve.sh"
    rec = str(out / "recommendation.json")
    gateway = str(out / "gateway.yaml")
    passed = run("check", rec, *LLAMA_70B, "--deployed", str(script), "--deployed", gateway, "--json")
    assert passed.exit_code == 0, passed.output
    script.write_text(script.read_text().replace("--max-model-len 39984", "--max-model-len 131072"))
    result = run("check", rec, *LLAMA_70B, "--deployed", str(script), "--deployed", gateway, "--json")
    assert result.exit_code == 1
    risks = [f for f in json.loads(result.stdout)["findings"] if f["severity"] == "risk"]
    refuses = [f for f in risks if f["code"] == "engine-refuses-start"]
    assert len(refuses) == 1
    assert refuses[0]["message"] == ("vLLM would refuse to start: one request at max_model_len 131,072 needs 8,192 "
                                     "blocks of 16, the pool has 2,500 (2,499 usable beside the null block), so at "
                                     "most 39,984 tokens")
    assert "fits with --max-model-len 39984" in refuses[0]["why"]


def test_an_infeasible_recommendation_is_a_risk_against_any_deployed_file(tmp_path):
    """The 70B on 2 H100s: whatever is deployed, the pool holds no logged request."""
    out = tmp_path / "d"
    assert run("recommend", SAMPLE, *LLAMA_70B, "--gpu", "H100-80GB", "--tp", "4", "--out",
               str(out)).exit_code == 0
    result = run("check", SAMPLE, *LLAMA_70B, "--gpu", "H100-80GB", "--tp", "2",
                 "--deployed", str(out / "vllm-serve.sh"))
    assert result.exit_code == 1
    lines = result.output.splitlines()
    risk = next(i for i, line in enumerate(lines) if line.startswith("RISK engine-refuses-start"))
    assert "the pool has 1,585 (1,584 usable beside the null block)" in lines[risk]
    assert lines[risk + 1].strip() == ("why: the deployment cannot serve the logged traffic; fits with "
                                       "--kv-cache-dtype fp8 (pool 3,171 blocks); or --tp 4 (pool 24,730 blocks)")
