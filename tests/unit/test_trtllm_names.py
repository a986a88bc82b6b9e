"""The TensorRT-LLM name tables (tests/support/trtllm_names.py) and their validators on hand-written argvs and
YAML. TensorRT-LLM cannot be installed here, so these tables stand in for its parser; the tables
cite NVIDIA/TensorRT-LLM commits (serve.py @ SERVE_COMMIT, llm_args.py @ LLM_ARGS_COMMIT)."""

from __future__ import annotations

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st
from script_argv import run_with_stand_ins
from trtllm_names import (
    KV_CACHE_CONFIG,
    OLDER_SERVE_NAMES,
    OPTION_BY_NAME,
    SCHEDULER_CONFIG,
    TOP_LEVEL,
    check_trtllm_conflicts,
    check_trtllm_serve_argv,
    check_trtllm_yaml,
    portable_options,
)

RENDERED_ARGV = [
    "serve", "meta-llama/Llama-3.1-8B", "--host", "0.0.0.0", "--port", "8000", "--backend", "pytorch",
    "--max_batch_size", "64", "--max_num_tokens", "8192", "--max_seq_len", "14512",
    "--kv_cache_free_gpu_memory_fraction", "0.85", "--tp_size", "2",
    "--extra_llm_api_options", "/etc/kvtune/extra-llm-api-options.yaml", "--log_level", "info",
    "--enable_chunked_prefill", "--trust_remote_code",
]
RENDERED_YAML = """\
# extra_llm_api_options, as kvtune would render it
kv_cache_config:
  free_gpu_memory_fraction: 0.85
  max_tokens: 250000
  tokens_per_block: 32
  dtype: fp8
  enable_block_reuse: true
scheduler_config:
  capacity_scheduler_policy: GUARANTEED_NO_EVICT
  context_chunking_policy: FIRST_COME_FIRST_SERVED
max_batch_size: 64
max_num_tokens: 8192
max_seq_len: 14512
enable_chunked_prefill: true
enable_iter_perf_stats: true
tensor_parallel_size: 2
"""


def test_the_options_kvtune_renders_exist_in_both_serve_versions():
    rendered = {"--host", "--port", "--backend", "--max_batch_size", "--max_num_tokens", "--max_seq_len",
                "--kv_cache_free_gpu_memory_fraction", "--tp_size", "--extra_llm_api_options", "--log_level",
                "--enable_chunked_prefill", "--trust_remote_code"}
    assert rendered <= portable_options()
    # the long spellings came later: a script using them fails on the older release
    assert not {"--tensor_parallel_size", "--free_gpu_memory_fraction", "--config"} & portable_options()
    assert OLDER_SERVE_NAMES <= set(OPTION_BY_NAME)  # the newer serve kept every older name


def test_defaults_and_kinds_read_from_serve_py():
    expect = {
        "--max_batch_size": ("int", 2048), "--max_num_tokens": ("int", 8192), "--max_seq_len": ("int", None),
        "--kv_cache_free_gpu_memory_fraction": ("float", 0.9), "--tp_size": ("int", 1),
        "--enable_chunked_prefill": ("flag", False), "--port": ("int", 8000), "--host": ("str", "localhost"),
        "--backend": ("choice", "pytorch"), "--extra_llm_api_options": ("str", None),
    }
    assert {name: (OPTION_BY_NAME[name].kind, OPTION_BY_NAME[name].default) for name in expect} == expect
    assert OPTION_BY_NAME["--tp_size"] is OPTION_BY_NAME["--tensor_parallel_size"]
    assert OPTION_BY_NAME["--kv_cache_free_gpu_memory_fraction"].target == "kv_cache_config.free_gpu_memory_fraction"


def test_yaml_tables_name_the_fields_issue_14_renders():
    assert {"kv_cache_config", "scheduler_config", "max_batch_size", "max_num_tokens", "max_seq_len",
            "enable_chunked_prefill", "enable_iter_perf_stats", "tensor_parallel_size"} <= set(TOP_LEVEL)
    assert (KV_CACHE_CONFIG["free_gpu_memory_fraction"].default, KV_CACHE_CONFIG["tokens_per_block"].default,
            KV_CACHE_CONFIG["enable_block_reuse"].default, KV_CACHE_CONFIG["dtype"].default,
            KV_CACHE_CONFIG["max_tokens"].default) == (0.9, 32, True, "auto", None)
    assert SCHEDULER_CONFIG["capacity_scheduler_policy"].choices == (
        "MAX_UTILIZATION", "GUARANTEED_NO_EVICT", "STATIC_BATCH")
    assert SCHEDULER_CONFIG["capacity_scheduler_policy"].default == "GUARANTEED_NO_EVICT"


@pytest.mark.parametrize("argv", [
    RENDERED_ARGV,
    RENDERED_ARGV[1:],  # `serve` is the group's default command
    ["--max_batch_size=64", "--tp_size", "2", "org/model"],  # =value, model after the options
    ["m", "--backend", "trt", "--port", "-1"],  # an alias; click takes "-1" as the value
    ["m", "--custom_module_dirs", "/a", "--custom_module_dirs", "/b"],  # multiple=True
    ["--port", "8000", "--", "m"],  # after "--", only positionals
    ["m", "--kv_cache_free_gpu_memory_fraction", "1", "--max_num_tokens", "1_000"],  # int() and float()
])
def test_good_argvs_pass(argv):
    assert check_trtllm_serve_argv(argv) == []


@pytest.mark.parametrize(("argv", "errors"), [
    (["m", "--max-batch-size", "64"], ["--max-batch-size: no such option of trtllm-serve serve "
                                       "(click takes exact names only)"]),
    (["m", "--max_batch", "64"], ["--max_batch: no such option of trtllm-serve serve (click takes exact names only)"]),
    (["m", "--max_batch_size", "64.5"], ["--max_batch_size: '64.5' is not a valid integer"]),
    (["m", "--port", "eight"], ["--port: 'eight' is not a valid integer"]),
    (["m", "--kv_cache_free_gpu_memory_fraction", "high"],
     ["--kv_cache_free_gpu_memory_fraction: 'high' is not a valid float"]),
    (["m", "--kv_cache_free_gpu_memory_fraction", "1.5"],
     ["--kv_cache_free_gpu_memory_fraction: 1.5 is above the maximum 1 (le=1), "
      "enforced by kv_cache_config.free_gpu_memory_fraction"]),
    (["m", "--backend", "torch"], ["--backend: 'torch' is not one of pytorch, tensorrt, _autodeploy"]),
    (["m", "--log_level", "INFO"], ["--log_level: 'INFO' is not one of internal_error, error, warning, info, verbose"]),
    (["m", "--max_seq_len"], ["--max_seq_len: requires a value"]),
    (["m", "--enable_chunked_prefill=true"], ["--enable_chunked_prefill: a flag takes no value (got 'true')"]),
    (["--port", "8000"], ["MODEL: missing argument (model name, HF checkpoint path or engine path)"]),
    (["a", "b", "c"], ["unexpected extra arguments: b c"]),
    (["m", "-p", "8000"], ["-p: no such option of trtllm-serve serve (click takes exact names only)"]),
    (["m", "--bogus", "--port", "x"], ["--bogus: no such option of trtllm-serve serve (click takes exact names only)",
                                       "--port: 'x' is not a valid integer"]),
])
def test_bad_argvs_are_named(argv, errors):
    assert check_trtllm_serve_argv(argv) == errors


def test_rendered_yaml_passes():
    data = yaml.safe_load(RENDERED_YAML)
    assert check_trtllm_yaml(data) == []
    assert check_trtllm_conflicts(RENDERED_ARGV, data) == []


@pytest.mark.parametrize("data", [
    None,  # an empty file
    {},
    {"kv_cache_config": {"dtype": "FP8"}},  # validate_dtype lower-cases
    {"kv_cache_config": {"dtype": "bfloat16", "use_kv_cache_manager_v2": "auto"}},
    {"kv_cache_config": {"use_kv_cache_manager_v2": True, "free_gpu_memory_fraction": 1}},
    {"max_seq_len": None, "max_batch_size": None},  # Optional; normalized to the defaults
    {"scheduler_config": {"capacity_scheduler_policy": "MAX_UTILIZATION", "context_chunking_policy": None,
                          "dynamic_batch_config": {"enable_batch_size_tuning": False}}},
    {"hf_revision": "main", "sampler_type": "auto"},  # accepted on input, not fields
    {"cuda_graph_config": {"anything": 1}, "load_format": "dummy"},  # untabled nested keys pass
])
def test_good_yaml_passes(data):
    assert check_trtllm_yaml(data) == []


@pytest.mark.parametrize(("data", "errors"), [
    ({"max_num_seqs": 64}, ["max_num_seqs: unknown key (extra='forbid' rejects it at startup)"]),
    ({"kv_cache_config": {"free_gpu_mem_fraction": 0.9}},
     ["kv_cache_config.free_gpu_mem_fraction: unknown key (extra='forbid' rejects it at startup)"]),
    ({"kv_cache_config": {"block_reuse_config": {"block_reuse_policy": "per_request"}}},
     ["kv_cache_config.block_reuse_config.block_reuse_policy: unknown key (extra='forbid' rejects it at startup)"]),
    ({"scheduler_config": {"policy": "GUARANTEED_NO_EVICT"}},
     ["scheduler_config.policy: unknown key (extra='forbid' rejects it at startup)"]),
    ({"max_batch_size": "64"}, ["max_batch_size: expected int or null, got str '64'"]),
    ({"max_batch_size": True}, ["max_batch_size: expected int or null, got bool True"]),
    ({"kv_cache_config": {"tokens_per_block": 32.0}},
     ["kv_cache_config.tokens_per_block: expected int, got float 32.0"]),
    ({"kv_cache_config": {"enable_block_reuse": "yes"}},
     ["kv_cache_config.enable_block_reuse: expected bool, got str 'yes'"]),
    ({"kv_cache_config": 0.9}, ["kv_cache_config: expected model, got float 0.9"]),
    ({"enable_chunked_prefill": None}, ["enable_chunked_prefill: null is not allowed (not Optional)"]),
    ({"scheduler_config": {"capacity_scheduler_policy": "max_utilization"}},
     ["scheduler_config.capacity_scheduler_policy: 'max_utilization' is not one of "
      "MAX_UTILIZATION, GUARANTEED_NO_EVICT, STATIC_BATCH"]),
    ({"scheduler_config": {"context_chunking_policy": "FCFS"}},
     ["scheduler_config.context_chunking_policy: 'FCFS' is not one of "
      "FIRST_COME_FIRST_SERVED, EQUAL_PROGRESS, FORCE_CHUNK"]),
    ({"kv_cache_config": {"dtype": "fp8_e4m3"}},
     ["kv_cache_config.dtype: 'fp8_e4m3' is not one of auto, fp8, fp8_ds_mla, nvfp4, bfloat16, float16, "
      "float32, int64, int32, int8, bool"]),
    ({"kv_cache_config": {"free_gpu_memory_fraction": 1.2, "max_gpu_total_bytes": -1}},
     ["kv_cache_config.free_gpu_memory_fraction: 1.2 is above the maximum 1 (le=1)",
      "kv_cache_config.max_gpu_total_bytes: -1 is below the minimum 0 (ge=0)"]),
    ({"num_serve_frontends": 0, "stream_interval": 0},
     ["num_serve_frontends: 0 is below the minimum 1 (ge=1)", "stream_interval: 0 must be greater than 0 (gt=0)"]),
    (["kv_cache_config"], ["the YAML root must be a mapping, got list"]),
])
def test_bad_yaml_is_named(data, errors):
    assert check_trtllm_yaml(data) == errors


def test_a_quoted_number_in_yaml_text_is_caught():
    data = yaml.safe_load('max_batch_size: "64"\nkv_cache_config:\n  max_tokens: 1e5\n')
    assert check_trtllm_yaml(data) == [
        "max_batch_size: expected int or null, got str '64'",
        "kv_cache_config.max_tokens: expected int or null, got str '1e5'",  # YAML 1.1 reads 1e5 as a string
    ]


def test_a_flag_and_a_yaml_key_that_disagree_are_named():
    argv = ["m", "--max_batch_size", "64", "--enable_chunked_prefill", "--kv_cache_free_gpu_memory_fraction", "0.85"]
    assert check_trtllm_conflicts(argv, {"max_batch_size": 64, "enable_chunked_prefill": True}) == []
    assert check_trtllm_conflicts(argv, {"max_batch_size": 128, "enable_chunked_prefill": False,
                                         "kv_cache_config": {"free_gpu_memory_fraction": 0.8}}) == [
        "max_batch_size: --max_batch_size 64 but the YAML says 128; serve.py merges the YAML over the flags "
        "(YAML wins unless the CLI key is explicit): set it in one place",
        "enable_chunked_prefill: --enable_chunked_prefill True but the YAML says False; serve.py merges the YAML "
        "over the flags (YAML wins unless the CLI key is explicit): set it in one place",
        "kv_cache_config.free_gpu_memory_fraction: --kv_cache_free_gpu_memory_fraction 0.85 but the YAML says 0.8; "
        "serve.py merges the YAML over the flags (YAML wins unless the CLI key is explicit): set it in one place",
    ]
    assert check_trtllm_conflicts(argv, {"kv_cache_config": {"tokens_per_block": 32}}) == [
        "kv_cache_config: the YAML has one without free_gpu_memory_fraction, so versions that replace "
        "kv_cache_config whole drop --kv_cache_free_gpu_memory_fraction 0.85 (0.9 instead): "
        "write the fraction in the YAML"]
    assert check_trtllm_conflicts(["m"], None) == []


def test_a_rendered_pair_checked_as_the_lead_will(tmp_path):
    options = tmp_path / "extra-llm-api-options.yaml"
    options.write_text(RENDERED_YAML, encoding="utf-8")
    script = ("#!/usr/bin/env bash\nset -euo pipefail\nHERE=\"$(cd \"$(dirname \"$0\")\" && pwd)\"\n"
              "exec trtllm-serve serve meta-llama/Llama-3.1-8B --max_batch_size 64 --max_num_tokens 8192 \\\n"
              "  --max_seq_len 14512 --kv_cache_free_gpu_memory_fraction 0.85 --tp_size 2 \\\n"
              "  --extra_llm_api_options \"$HERE/extra-llm-api-options.yaml\" \"$@\"\n")
    (call,) = run_with_stand_ins(script, tmp_path, ["trtllm-serve"])
    argv = list(call.argv)
    data = yaml.safe_load(options.read_text(encoding="utf-8"))
    assert check_trtllm_serve_argv(argv) == []
    assert check_trtllm_yaml(data) == []
    assert check_trtllm_conflicts(argv, data) == []
    assert argv[argv.index("--extra_llm_api_options") + 1] == str(options)


_TOKENS = st.one_of(st.sampled_from(sorted(OPTION_BY_NAME)), st.sampled_from(["serve", "--", "-", "m", "1", "-1",
                                                                              "0.5", "trt", "info", "x=y"]),
                    st.text(max_size=8))
_YAML_SCALARS = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=True), st.text(max_size=6))
_YAML = st.recursive(_YAML_SCALARS, lambda inner: st.one_of(
    st.lists(inner, max_size=3),
    st.dictionaries(st.one_of(st.sampled_from(sorted(TOP_LEVEL) + sorted(KV_CACHE_CONFIG) + sorted(SCHEDULER_CONFIG)),
                              st.text(max_size=6), st.integers()), inner, max_size=4)), max_leaves=12)


@given(st.lists(_TOKENS, max_size=10))
def test_any_argv_gives_error_lines_never_an_exception(argv):
    errors = check_trtllm_serve_argv(argv)
    assert all(isinstance(e, str) and e for e in errors)
    assert all(isinstance(e, str) for e in check_trtllm_conflicts(argv, {"max_batch_size": 1}))


@given(_YAML)
def test_any_yaml_gives_error_lines_never_an_exception(data):
    errors = check_trtllm_yaml(data)
    assert all(isinstance(e, str) and e for e in errors)
    if isinstance(data, dict) and not errors:
        assert set(data) <= set(TOP_LEVEL) | {"hf_revision", "sampler_type"}
