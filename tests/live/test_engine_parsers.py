"""The launch files `recommend --engine sglang|trtllm` renders, run by bash with the engines'
binaries replaced by recording stand-ins, then parsed by what each engine itself would parse
them with: SGLang 0.5.23's own ServerArgs parser and its environment fields (tests/support/sglang_parser.py,
in its cached virtualenv), and TensorRT-LLM's option and YAML names and types read from its source
(tests/support/trtllm_names.py; TensorRT-LLM cannot be installed here)."""

from __future__ import annotations

from pathlib import Path

import pytest
import script_argv
import sglang_parser
import trtllm_names
import yaml

import kvtune
from kvtune.domain.admission_policy import parse_admission

SAMPLE_LOGS = Path(__file__).parents[2] / "sample_logs"

# (engine, admission, plan keywords): the variants each engine's files are rendered in
VARIANTS = [
    ("guaranteed", {"gpu": "H100-80GB"}),
    ("statistical", {"gpu": "H100-80GB"}),
    ("guaranteed", {"gpu": "A100-40GB", "tp": 2, "kv_cache_dtype": "fp8"}),
    # SGLang's derived mem_fraction_static on an L4 (0.684) leaves no room beside 8B bf16 weights
    ("guaranteed", {"gpu": "L4", "max_model_len": 8192, "gpu_memory_utilization": 0.85}),
]


@pytest.fixture(scope="module")
def profile():
    return kvtune.profile_logs([str(SAMPLE_LOGS)])


def recommendation(profile, engine: str, admission: str, plan: dict):
    from kvtune.policy.recommend import RecommendOptions
    from kvtune.policy.recommend import recommend as apply_rules

    policy = parse_admission({"policy": admission, **({"epsilon": 0.01} if admission == "statistical" else {})},
                             lambda field, why: ValueError(f"{field}: {why}"))
    return apply_rules(profile, kvtune.plan(kvtune.Deployment("llama-3.1-8b", engine=engine, **plan)),
                       RecommendOptions(engine=engine, admission=policy))


def value(rec, name: str):
    decision = rec.settings.get(name)
    return None if decision is None else decision.value


def test_sglang_parses_every_rendered_script(profile, tmp_path):
    recs, argvs, envs = [], [], []
    for i, (admission, plan) in enumerate(VARIANTS):
        rec = recommendation(profile, "sglang", admission, plan)
        script = kvtune.render(rec)["sglang-serve.sh"]  # held to `kvtune check` with its gateways
        folder = tmp_path / str(i)
        folder.mkdir()
        calls = script_argv.run_with_stand_ins(script, folder, ["python", "python3"])
        recs.append(rec)
        argvs.append(script_argv.after(calls, "-m", "sglang.launch_server"))
        envs.append(dict(calls[0].env))
    batch = sglang_parser.parse_sglang_batch(argvs, envs)
    for rec, argv, result, env in zip(recs, argvs, batch.results, batch.env_results, strict=True):
        assert result.ok, result.error
        assert batch.parser.inexact_options(argv) == []  # SGLang would accept an abbreviation: kvtune never writes one
        expected = {
            "model_path": rec.served_model, "host": "127.0.0.1", "port": 8000,
            "tp_size": value(rec, "tensor_parallel_size"), "pp_size": value(rec, "pipeline_parallel_size"),
            "context_length": value(rec, "max_model_len"), "max_running_requests": value(rec, "max_num_seqs"),
            "chunked_prefill_size": value(rec, "max_num_batched_tokens"),
            "mem_fraction_static": value(rec, "gpu_memory_utilization"),
            "max_total_tokens": value(rec, "kv_cache_tokens"), "kv_cache_dtype": value(rec, "kv_cache_dtype"),
            "page_size": value(rec, "block_size"),
            "schedule_conservativeness": value(rec, "schedule_conservativeness"),
            "max_queued_requests": value(rec, "engine_max_queued_requests"), "enable_metrics": True,
        }
        assert result.mismatches(expected) == []
        assert sglang_parser.env_errors(env, {
            "SGLANG_INIT_NEW_TOKEN_RATIO": value(rec, "init_new_token_ratio"),
            "SGLANG_MIN_NEW_TOKEN_RATIO_FACTOR": value(rec, "min_new_token_ratio_factor"),
            "SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION": value(rec, "clip_max_new_tokens_estimation"),
            "SGLANG_MAX_NEW_TOKENS_LIMIT": rec.backstop,
        }) == []
        assert set(env) == {"SGLANG_INIT_NEW_TOKEN_RATIO", "SGLANG_MIN_NEW_TOKEN_RATIO_FACTOR",
                            "SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION", "SGLANG_MAX_NEW_TOKENS_LIMIT"}
    fp8 = recs[2]
    assert value(fp8, "kv_cache_dtype") == "fp8_e4m3"  # SGLang has no plain "fp8"


@pytest.mark.parametrize("admission, plan", VARIANTS)
def test_trtllm_files_use_only_names_and_types_its_source_defines(profile, tmp_path, model_dir, admission, plan):
    rec = recommendation(profile, "trtllm", admission, plan)
    files = kvtune.render(rec, gateway_tokenizer=str(model_dir))
    kvtune.write_files(tmp_path / "deploy", files)
    (call,) = script_argv.run_with_stand_ins(files["trtllm-serve.sh"], tmp_path, ["trtllm-serve"])
    data = yaml.safe_load(files["trtllm-llm-api.yaml"])
    assert trtllm_names.check_trtllm_serve_argv(call.argv) == []
    assert trtllm_names.check_trtllm_yaml(data) == []
    assert trtllm_names.check_trtllm_conflicts(call.argv, data) == []
    assert {a for a in call.argv if a.startswith("--")} <= trtllm_names.portable_options()
    argv = list(call.argv)
    assert argv[0] == rec.served_model
    assert argv[argv.index("--max_seq_len") + 1] == str(rec.max_model_len)
    assert argv[argv.index("--max_batch_size") + 1] == str(value(rec, "max_num_seqs"))
    assert data["kv_cache_config"]["max_tokens"] == rec.capacity.kv_cache_tokens
    assert data["kv_cache_config"]["tokens_per_block"] == rec.capacity.block_size
    policy = data["scheduler_config"]["capacity_scheduler_policy"]
    assert policy == ("GUARANTEED_NO_EVICT" if admission == "guaranteed" else "MAX_UTILIZATION")
    # the script passes the YAML beside it, wherever it is run from
    options = argv[argv.index("--extra_llm_api_options") + 1]
    assert options.endswith("/trtllm-llm-api.yaml") and Path(options).parent == tmp_path
