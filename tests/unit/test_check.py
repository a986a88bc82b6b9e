"""`kvtune check` findings, one rule at a time, on hand-made deployed files; and the parsers behind it."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
from recs import rec_dict

from kvtune.deploy.check import Severity, check_deployment
from kvtune.deploy.read import DeployedKind, load_deployed, parse_deployed, parse_vllm_command
from kvtune.deploy.render import render_files
from kvtune.domain.recommendation import Recommendation
from kvtune.errors import InputError
from kvtune.hardware import GPUS
from kvtune.policy.recommendation import read_recommendation
from kvtune.profile.routes import CensoredHistogram

DATA = Path(__file__).parents[1] / "data"


def rec() -> Recommendation:
    return read_recommendation(rec_dict(), path="recommendation.json")


def codes(result, severity=None) -> list[str]:
    return [f.code for f in result.findings if severity is None or f.severity is Severity(severity)]


def gateway_yaml(budget=26999, block_size=16, max_model_len=14512, routes=None) -> str:
    routes = routes if routes is not None else [
        {"name": "chat", "match": {"path": "/v1/chat/completions"}, "max_new_tokens": 451},
        {"name": "completions", "match": {"path": "/v1/completions"}, "max_new_tokens": 700},
        {"name": "default", "max_new_tokens": 700},
    ]
    return json.dumps({"version": 1, "upstream": "http://127.0.0.1:8000", "block_size": block_size,
                       "block_budget": budget, "max_model_len": max_model_len, "routes": routes})


GOOD_VLLM = ("vllm serve meta-llama/Llama-3.1-8B --max-model-len 14512 --max-num-seqs 304 "
             "--max-num-batched-tokens 8192 --gpu-memory-utilization 0.9 --kv-cache-dtype auto "
             "--block-size 16 --override-generation-config '{\"max_new_tokens\": 700}'")


# ---------------------------------------------------------------- parsing deployed files

def test_parse_vllm_command_forms():
    script = textwrap.dedent("""\
        #!/bin/sh
        # serve it
        export HF_HOME=/data
        CUDA_VISIBLE_DEVICES=0,1 exec python3 -m vllm.entrypoints.openai.api_server \\
            --model "meta-llama/Llama-3.1-8B" -tp 2 --max_model_len=8K \\
            --enforce-eager --gpu-memory-utilization=0.85 --kv-cache-dtype fp8 \\
            --override-generation-config '{"max_new_tokens": 512, "temperature": 0.7}' \\
            --max-num-seqs 128 "$@"
        echo never
        """)
    d = parse_vllm_command(script)
    assert d.kind is DeployedKind.VLLM and d.model == "meta-llama/Llama-3.1-8B"
    assert d.tensor_parallel_size == 2 and d.max_model_len == 8192
    assert d.gpu_memory_utilization == 0.85 and d.kv_cache_dtype == "fp8"
    assert d.max_new_tokens == 512 and d.max_num_seqs == 128
    assert d.flags["enforce-eager"] is True
    assert parse_vllm_command("vllm serve m --max-model-len 8k").max_model_len == 8000
    assert parse_vllm_command("vllm serve m --max-model-len auto").max_model_len is None
    assert parse_vllm_command("docker run --gpus all vllm/vllm-openai:v0.33.0 --model x -pp=2").pipeline_parallel_size == 2


def test_parse_vllm_command_errors_name_the_flag():
    with pytest.raises(InputError, match="--max-num-seqs: expected an integer"):
        parse_vllm_command("vllm serve m --max-num-seqs lots", source="s.sh")
    with pytest.raises(InputError, match="--override-generation-config: not JSON"):
        parse_vllm_command("vllm serve m --override-generation-config '{max_new_tokens: 5}'")
    with pytest.raises(InputError, match="no `vllm serve`"):
        parse_vllm_command("echo hello")
    with pytest.raises(InputError, match="s.sh: not a launch command of vLLM, SGLang or TensorRT-LLM"):
        parse_deployed("just text", source="s.sh")


def test_rendered_files_read_back_exactly():
    d = rec_dict()
    d["routes"][0]["route"] = "we\"ird ]] $(x)\nname é"
    d["routes"][0]["match"]["model"] = "m']]\\"
    r = read_recommendation(d)
    files = render_files(r)
    nginx = parse_deployed(files["nginx.conf"], source="nginx.conf")
    gateway = parse_deployed(files["gateway.yaml"], source="gateway.yaml")
    engine = parse_deployed(files["vllm-serve.sh"], source="vllm-serve.sh")
    for d in (nginx, gateway):
        assert d.block_budget == 26999 and d.block_size == 16 and d.max_model_len == 14512
        assert [(x.name, x.path, x.model, x.max_new_tokens) for x in d.routes] == [
            ("we\"ird ]] $(x)\nname é", "/v1/chat/completions", "m']]\\", 451),
            ("/v1/completions", "/v1/completions", None, 700),
            ("default", None, None, 700),
        ]
    assert (nginx.kind, gateway.kind, engine.kind) == (DeployedKind.NGINX, DeployedKind.GATEWAY, DeployedKind.VLLM)
    assert engine.model == "meta-llama/Llama-3.1-8B" and engine.max_new_tokens == 700
    assert engine.max_num_seqs == 304 and engine.block_size == 16


def test_edited_nginx_budget_is_what_gets_checked():
    text = render_files(rec(), targets=["nginx.conf"])["nginx.conf"]
    edited = text.replace("block_budget = 26999,", "block_budget = 40000,")
    d = parse_deployed(edited, source="nginx.conf")
    assert d.block_budget == 40000
    assert "budget-over-capacity" in codes(check_deployment([d], rec()), "risk")
    with pytest.raises(InputError, match="without kvtune's route table"):
        parse_deployed("events {}\nhttp {\n}\n", source="plain.conf")
    broken = text.replace("block_budget = 26999,", "block_budget = ,")
    with pytest.raises(InputError, match="nginx.conf: kvtune's Lua config table"):
        parse_deployed(broken, source="nginx.conf")


def test_load_deployed_reports_unreadable_files(tmp_path):
    with pytest.raises(InputError, match="missing.sh: no such file$"):
        load_deployed(tmp_path / "missing.sh")
    (tmp_path / "g.yaml").write_text(gateway_yaml(budget=0))
    with pytest.raises(InputError, match="block_budget: must be at least 1"):
        load_deployed(tmp_path / "g.yaml")


# ---------------------------------------------------------------- findings, one rule each

def test_recommended_gateway_passes():
    result = check_deployment([parse_deployed(gateway_yaml())], rec())
    assert result.passed and codes(result, "risk") == [] and codes(result, "warn") == []


def test_no_output_cap_is_a_risk_without_a_gateway():
    d = parse_deployed(GOOD_VLLM.replace("--override-generation-config '{\"max_new_tokens\": 700}'", ""))
    result = check_deployment([d], rec())
    assert "no-output-cap" in codes(result, "risk") and not result.passed
    with_gateway = check_deployment([d, parse_deployed(gateway_yaml(), source="g.yaml")], rec())
    assert "no-output-cap" not in codes(with_gateway)
    assert "no-backstop-cap" in codes(with_gateway, "warn") and with_gateway.passed


def test_uncapped_route_in_gateway():
    routes = [{"name": "chat", "match": {"path": "/v1/chat/completions"}, "max_new_tokens": 451}]
    result = check_deployment([parse_deployed(gateway_yaml(routes=routes))], rec())
    assert "uncapped-route" in codes(result, "risk")
    assert "no-catch-all-route" in codes(result, "warn")
    message = next(f.message for f in result.findings if f.code == "uncapped-route")
    assert "'/v1/completions'" in message


def test_truncation_share_is_the_routes_kaplan_meier_estimate():
    """check judges a cap by the same estimate the recommendation chose it with: 20 of 100
    responses were cut at 15 tokens, so their true lengths are only known to be ≥ 15. Kaplan–Meier
    says a cap of 15 cuts 50% (the naive share of logged lengths above 15 would say 30%)."""
    d = rec_dict()
    chat = d["routes"][0]
    chat["output_lengths"] = {"uncensored": {"values": [10, 20], "counts": [50, 30]},
                              "censored": {"values": [15], "counts": [20]}}
    chat["max_new_tokens"]["value"] = 20
    r = read_recommendation(d)
    assert CensoredHistogram.from_lengths(r.routes[0].output_lengths).truncation_share(15) == pytest.approx(0.5)
    routes = [{"name": "chat", "match": {"path": "/v1/chat/completions"}, "max_new_tokens": 15},
              {"name": "default", "max_new_tokens": 700}]
    result = check_deployment([parse_deployed(gateway_yaml(routes=routes))], r)
    finding = next(f for f in result.findings if f.code == "cap-truncates")
    assert "cap 15 cuts 50.0% of logged responses" in finding.message


def test_cap_that_truncates_more_than_the_budget():
    routes = [{"name": "chat", "match": {"path": "/v1/chat/completions"}, "max_new_tokens": 100},
              {"name": "default", "max_new_tokens": 700}]
    result = check_deployment([parse_deployed(gateway_yaml(routes=routes))], rec())
    assert "cap-truncates" in codes(result, "risk")
    finding = next(f for f in result.findings if f.code == "cap-truncates")
    assert "route '/v1/chat/completions': cap 100 cuts" in finding.message
    # below the recommendation but within an explicit 65% budget (cap 100 cuts 61%): only a warning
    loose = check_deployment([parse_deployed(gateway_yaml(routes=routes))], rec(), max_truncation=0.65)
    assert "cap-truncates" not in codes(loose) and "cap-below-recommendation" in codes(loose, "warn")


def test_cap_above_recommendation_warns():
    routes = [{"name": "all", "max_new_tokens": 4000}]
    result = check_deployment([parse_deployed(gateway_yaml(routes=routes))], rec())
    assert codes(result, "warn").count("cap-above-recommendation") == 2 and result.passed


def test_budget_over_capacity_and_above_safety():
    over = check_deployment([parse_deployed(gateway_yaml(budget=30000))], rec())
    assert "budget-over-capacity" in codes(over, "risk")  # 30000 > 29999 usable blocks
    above = check_deployment([parse_deployed(gateway_yaml(budget=29000))], rec())
    assert "budget-above-safety" in codes(above, "warn") and above.passed
    # budget counted in tokens: 15000 blocks of 32 tokens = 480,000 tokens > 479,984
    bigger_blocks = check_deployment([parse_deployed(gateway_yaml(budget=15000, block_size=32))], rec())
    assert "budget-over-capacity" in codes(bigger_blocks, "risk")


def test_gateway_blocks_smaller_than_the_engines():
    engine = parse_deployed(GOOD_VLLM.replace("--block-size 16", "--block-size 32"), source="v.sh")
    result = check_deployment([engine, parse_deployed(gateway_yaml(budget=10000), source="g.yaml")], rec())
    assert "block-size-mismatch" in codes(result, "risk")


def test_preemption_risk_without_a_gateway():
    result = check_deployment([parse_deployed(GOOD_VLLM)], rec())
    assert "preemption-risk" in codes(result, "risk")
    message = next(f.message for f in result.findings if f.code == "preemption-risk")
    assert "max_num_seqs 304" in message and "479,984" in message
    # a small max_num_seqs whose worst sequences fit in KV: no risk
    # 33 × ceil((14050 + 700 capped at 14512) / 16) × 16 = 33 × 14512 = 478,896 ≤ 479,984
    small = check_deployment([parse_deployed(GOOD_VLLM.replace("--max-num-seqs 304", "--max-num-seqs 33"))], rec())
    assert "preemption-risk" not in codes(small)
    # with a gateway in front, the budget bounds reservations instead
    fronted = check_deployment([parse_deployed(GOOD_VLLM), parse_deployed(gateway_yaml(), source="g")], rec())
    assert "preemption-risk" not in codes(fronted) and "engine-bounded-by-gateway" in codes(fronted, "info")
    assert fronted.passed


def test_preemption_risk_uses_vllms_default_max_num_seqs_for_the_gpu():
    # vllm serve keeps max_num_seqs 256 on an A100-80GB (≥ 70 GiB, but an A100) and on GPUs
    # below 70 GiB; 1024 on an H100 (vllm-facts.md §1)
    without_flag = parse_deployed(GOOD_VLLM.replace("--max-num-seqs 304 ", ""))
    for gpu, seqs in (("A100-80GB", 256), ("H100-80GB", 1024), ("L4", 256)):
        edited = rec_dict()
        edited["hardware"].update(gpu=gpu, gpu_memory_bytes=GPUS[gpu].memory_bytes)
        planned = read_recommendation(edited)
        message = next(f.message for f in check_deployment([without_flag], planned).findings
                       if f.code == "preemption-risk")
        assert message.startswith(f"max_num_seqs {seqs} (default) × 14512 tokens"), (gpu, message)


def test_max_model_len_that_rejects_logged_prompts():
    rejects = check_deployment([parse_deployed(gateway_yaml(max_model_len=8192))], rec())
    assert "max-model-len-rejects" in codes(rejects, "risk")
    assert "14050 tokens" in next(f.message for f in rejects.findings if f.code == "max-model-len-rejects")
    cuts = check_deployment([parse_deployed(gateway_yaml(max_model_len=14400))], rec())
    assert "max-model-len-rejects" not in codes(cuts)
    assert "max-model-len-cuts-output" in codes(cuts, "warn")


def test_v1_refuses_v0_flags():
    result = check_deployment([parse_deployed(GOOD_VLLM + " --preemption-mode swap --swap-space 4")], rec())
    assert codes(result, "risk").count("invalid-flag") == 2
    edited = rec_dict()
    edited["engine"] = {"name": "vllm", "version": "0.6", "v1": False}
    old = read_recommendation(edited)
    assert "invalid-flag" not in codes(check_deployment([parse_deployed(GOOD_VLLM + " --preemption-mode swap")], old))


def test_drift_from_the_recommendation_warns():
    drifted = (GOOD_VLLM.replace("--max-num-seqs 304", "--max-num-seqs 256")
               .replace("--gpu-memory-utilization 0.9", "--gpu-memory-utilization 0.95")
               .replace("--kv-cache-dtype auto", "--kv-cache-dtype fp8"))
    result = check_deployment([parse_deployed(drifted), parse_deployed(gateway_yaml(), source="g")], rec())
    messages = [f.message for f in result.findings if f.code == "drift"]
    assert "max_num_seqs: deployed 256, recommended 304" in messages
    assert "gpu_memory_utilization: deployed 0.95, recommended 0.9" in messages
    assert "kv_cache_dtype: deployed fp8, recommended auto" in messages
    assert result.passed
    unset = check_deployment([parse_deployed("vllm serve meta-llama/Llama-3.1-8B --override-generation-config "
                                             "'{\"max_new_tokens\": 700}'"), parse_deployed(gateway_yaml(), source="g")], rec())
    assert "max_num_seqs: deployed not set (engine default), recommended 304" in [
        f.message for f in unset.findings if f.code == "drift"]
    # settings that match the recommendation are not reported
    assert not any("block_size" in f.message for f in unset.findings if f.code == "drift")


def test_model_mismatch_warns():
    result = check_deployment([parse_deployed(GOOD_VLLM.replace("meta-llama/Llama-3.1-8B", "Qwen/Qwen3-8B"))], rec())
    assert "model-mismatch" in codes(result, "warn")


def test_result_json_shape():
    result = check_deployment([parse_deployed(gateway_yaml(), source="gateway.yaml")], rec())
    data = result.to_dict()
    assert set(data) == {"deployed", "findings", "passed"}
    assert data["deployed"]["gateway.yaml"]["block_budget"] == 26999
    assert all(set(f) == {"severity", "code", "message", "why", "source"} for f in data["findings"])
    json.dumps(data)
    severities = [f["severity"] for f in data["findings"]]
    assert severities == sorted(severities, key=["risk", "warn", "info"].index)


@pytest.mark.parametrize("flags, field, words", [
    ("--gpu-memory-utilization 5", "--gpu-memory-utilization", "must be a number from 0 to 1"),
    ("--gpu-memory-utilization nan", "--gpu-memory-utilization", "must be a number from 0 to 1"),
    ("--swap-space inf", "--swap-space", "must be a number from 0"),
    ("--max-num-seqs -5", "--max-num-seqs", "must be from 1"),
    ("--max-num-seqs 0x10", "--max-num-seqs", "expected an integer, got '0x10'"),
    ("--max-model-len " + "9" * 5000, "--max-model-len", "expected an integer such as 8192"),
    ("--block-size " + "9" * 5000, "--block-size", "expected an integer, got '999"),
    ("--override-generation-config '{\"max_new_tokens\": " + "9" * 5000 + "}'",
     "--override-generation-config", "not JSON"),
    ("--override-generation-config '{\"max_new_tokens\": true}'",
     "--override-generation-config.max_new_tokens", "expected an integer, got True"),
])
def test_vllm_command_values_are_validated(flags, field, words):
    with pytest.raises(InputError) as info:
        parse_vllm_command(f"vllm serve m {flags}", source="serve.sh")
    assert str(info.value).startswith(f"serve.sh: {field}: ") and words in str(info.value)
    assert len(str(info.value)) < 300


def test_nginx_lua_table_nested_too_deeply_or_huge_numbers(tmp_path):
    text = render_files(rec())["nginx.conf"]
    deep = text.replace("block_budget = 26999,", "block_budget = 26999, x = " + "{" * 5000 + "}" * 5000 + ",")
    with pytest.raises(InputError, match="nested deeper than 32"):
        parse_deployed(deep, source="nginx.conf")
    huge = text.replace("block_budget = 26999,", "block_budget = " + "9" * 5000 + ",")
    with pytest.raises(InputError, match="a number of 5000 characters"):
        parse_deployed(huge, source="nginx.conf")


def test_a_gateway_yaml_refused_as_yaml_says_why(tmp_path):
    path = tmp_path / "gateway.yaml"
    path.write_text("version: 1\nroutes: &r []\nroutes: *r\n")
    with pytest.raises(InputError) as info:
        load_deployed(path)
    assert str(info.value) == (f"{path}: not a launch command of vLLM, SGLang or TensorRT-LLM, a gateway.yaml or "
                               "an nginx.conf rendered by kvtune (read as YAML: line 2: unsupported YAML: anchors and aliases are not allowed "
                               "(&r / *r); write each value out)")


# ---------------------------------------------------------------- a gateway.yaml with several upstreams

def upstreams_yaml(*budgets: int) -> str:
    doc = json.loads(gateway_yaml())
    del doc["upstream"], doc["block_budget"]
    doc["upstreams"] = [{"url": f"http://10.0.0.{i + 1}:8000", "block_budget": b} for i, b in enumerate(budgets)]
    return json.dumps(doc)


def test_each_upstreams_budget_is_checked_against_one_engines_capacity():
    d = parse_deployed(upstreams_yaml(26999, 26999), source="gateway.yaml")
    assert [(u.url, u.block_budget) for u in d.upstreams] == [("http://10.0.0.1:8000", 26999),
                                                              ("http://10.0.0.2:8000", 26999)]
    assert d.block_budget == 26999  # one engine's, not the sum
    result = check_deployment([d], rec())
    assert result.passed and codes(result, "warn") == []
    info = next(f for f in result.findings if f.code == "gateway-budget")
    assert info.message.startswith("gateway budgets 26999, 26999 blocks of 16 tokens on 2 upstreams")
    over = check_deployment([parse_deployed(upstreams_yaml(26999, 30000), source="gateway.yaml")], rec())
    risks = [f.message for f in over.findings if f.severity is Severity.RISK]
    assert risks == ["upstream http://10.0.0.2:8000: block budget 30000 × 16 tokens = 480,000 tokens exceeds "
                     "the KV capacity of 479,984 tokens (29999 blocks)"]
    drift = check_deployment([parse_deployed(upstreams_yaml(20000, 26999), source="gateway.yaml")], rec())
    assert [f.message for f in drift.findings if f.code == "drift"] == [
        "upstreams[0].block_budget: deployed 20000, recommended 26999"]
