"""The SGLang-parser harness (tests/support/sglang_parser.py) on hand-written argvs: the flags kvtune renders
round-trip with their types, bad values are refused, abbreviations are caught.

SGLANG_FLAGS is the table of those flags as SGLang 0.5.23's own parser defines them (read from
`ServerArgs.add_cli_args`, not from docs); test_flag_table_matches_sglangs_parser keeps it true.
"""

from __future__ import annotations

import pytest
from script_argv import after, run_with_stand_ins
from sglang_parser import SglangParse, env_errors, inexact_options, parse_sglang_batch, require_sglang_python

# option -> (dest, argparse action, type converter, default), SGLang 0.5.23.
# human_readable_int takes an int with an optional SI/IEC suffix ("16k" = 16000, "16Ki" = 16384).
SGLANG_FLAGS: dict[str, tuple[str, str, str | None, object]] = {
    "--model-path": ("model_path", "_StoreAction", "str", None),  # required; alias --model
    "--host": ("host", "_StoreAction", "str", "127.0.0.1"),
    "--port": ("port", "_StoreAction", "int", 30000),
    "--context-length": ("context_length", "_StoreAction", "human_readable_int", None),
    "--max-running-requests": ("max_running_requests", "_StoreAction", "int", None),
    "--max-total-tokens": ("max_total_tokens", "_StoreAction", "human_readable_int", None),
    "--mem-fraction-static": ("mem_fraction_static", "_StoreAction", "float", None),
    "--chunked-prefill-size": ("chunked_prefill_size", "_StoreAction", "int", None),  # -1 disables
    "--max-queued-requests": ("max_queued_requests", "_StoreAction", "int", None),
    "--schedule-conservativeness": ("schedule_conservativeness", "_StoreAction", "float", 1.0),
    "--page-size": ("page_size", "_StoreAction", "int", None),
    "--kv-cache-dtype": ("kv_cache_dtype", "_StoreAction", "str", "auto"),  # choices below
    "--tp-size": ("tp_size", "_StoreAction", "int", 1),  # alias --tensor-parallel-size
    "--enable-metrics": ("enable_metrics", "_StoreTrueAction", None, False),
    "--max-prefill-tokens": ("max_prefill_tokens", "_StoreAction", "human_readable_int", 16384),
    "--served-model-name": ("served_model_name", "_StoreAction", "str", None),
    # not rendered yet, but named by engines.md / issue #14:
    "--retraction-policy": ("retraction_policy", "_StoreAction", "str", "length"),
    "--schedule-policy": ("schedule_policy", "_StoreAction", "str", "fcfs"),
    "--enable-priority-scheduling": ("enable_priority_scheduling", "_StoreTrueAction", None, False),
    "--preferred-sampling-params": ("preferred_sampling_params", "_StoreAction", "loads", None),  # json.loads
}
SGLANG_CHOICES: dict[str, tuple[str, ...]] = {
    "--kv-cache-dtype": ("auto", "fp8_e5m2", "fp8_e4m3", "mxfp8", "bf16", "bfloat16", "nvfp4", "fp4_mx_block16"),
    "--retraction-policy": ("length", "priority"),
    "--schedule-policy": ("lpm", "random", "fcfs", "dfs-weight", "lof", "priority", "routing-key", "hrrn",
                          "shortest-prefill-first"),
}
SGLANG_ALIASES = {"--model-path": ("--model-path", "--model"), "--tp-size": ("--tp-size", "--tensor-parallel-size")}

# variable -> (EnvField class, default) in sglang/srt/environ.py (class Envs), SGLang 0.5.23: the
# environment issue #14 renders to make SGLang reserve like the recommendation (engines.md).
SGLANG_ENV: dict[str, tuple[str, object]] = {
    "SGLANG_INIT_NEW_TOKEN_RATIO": ("EnvFloat", 0.7),
    "SGLANG_MIN_NEW_TOKEN_RATIO_FACTOR": ("EnvFloat", 0.14),
    "SGLANG_NEW_TOKEN_RATIO_DECAY_STEPS": ("EnvInt", 600),
    "SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION": ("EnvInt", 4096),
    "SGLANG_MAX_NEW_TOKENS_LIMIT": ("EnvInt", None),
    "SGLANG_REQ_WAITING_TIMEOUT": ("EnvFloat", -1),  # seconds; -1 off
}
ENVS = {
    "rendered": {"SGLANG_MIN_NEW_TOKEN_RATIO_FACTOR": "1", "SGLANG_INIT_NEW_TOKEN_RATIO": "1.0",
                 "SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION": "8192", "SGLANG_MAX_NEW_TOKENS_LIMIT": "8192"},
    "bad": {"SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION": "8k", "SGLANG_MAX_NEW_TOKEN_LIMIT": "8192",
            "SGLANG_INIT_NEW_TOKEN_RATIO": "high"},
}

RENDERED = [
    "--model-path", "meta-llama/Llama-3.1-8B", "--host", "0.0.0.0", "--port", "30001",
    "--context-length", "14512", "--max-running-requests", "304", "--max-total-tokens", "250000",
    "--mem-fraction-static", "0.85", "--chunked-prefill-size", "8192", "--max-queued-requests", "512",
    "--schedule-conservativeness", "1.5", "--page-size", "16", "--kv-cache-dtype", "fp8_e4m3",
    "--tp-size", "2", "--enable-metrics", "--max-prefill-tokens", "16384", "--served-model-name", "llama",
]
RENDERED_VALUES = {
    "model_path": "meta-llama/Llama-3.1-8B", "host": "0.0.0.0", "port": 30001, "context_length": 14512,
    "max_running_requests": 304, "max_total_tokens": 250000, "mem_fraction_static": 0.85,
    "chunked_prefill_size": 8192, "max_queued_requests": 512, "schedule_conservativeness": 1.5,
    "page_size": 16, "kv_cache_dtype": "fp8_e4m3", "tp_size": 2, "enable_metrics": True,
    "max_prefill_tokens": 16384, "served_model_name": "llama",
}

CASES: dict[str, list[str]] = {
    "rendered": RENDERED,
    "defaults": ["--model-path", "m"],
    "equals-and-aliases": ["--model=m", "--tensor-parallel-size=4", "--chunked-prefill-size=-1",
                           "--context-length=16k", "--max-total-tokens", "1Mi",
                           "--preferred-sampling-params", '{"max_new_tokens": 700}'],
    "bad-choice": ["--model-path", "m", "--kv-cache-dtype", "fp7"],
    "vllm-flag": ["--model-path", "m", "--max-model-len", "4096"],
    "float-for-int": ["--model-path", "m", "--max-running-requests", "7.5"],
    "word-for-float": ["--model-path", "m", "--mem-fraction-static", "high"],
    "missing-value": ["--model-path", "m", "--max-running-requests"],
    "missing-model": ["--max-running-requests", "7"],
    "abbreviated": ["--model-path", "m", "--max-running-req", "7"],
    "ambiguous": ["--model-path", "m", "--max", "7"],
    "flag-with-value": ["--model-path", "m", "--enable-metrics=yes"],
}


@pytest.fixture(scope="module")
def batch():
    """ONE subprocess for every argv and environment of this module."""
    return parse_sglang_batch(list(CASES.values()), list(ENVS.values()))


@pytest.fixture(scope="module")
def parsed(batch):
    """(parser, {case: SglangParse})."""
    return batch.parser, dict(zip(CASES, batch.results, strict=True))


def test_flag_table_matches_sglangs_parser(parsed):
    parser, _ = parsed
    assert parser.version == "0.5.23"
    assert parser.allow_abbrev is True
    for option, (dest, action, type_, default) in SGLANG_FLAGS.items():
        defined = parser.options[option]
        assert (defined.dest, defined.action, defined.type, defined.default) == (dest, action, type_, default), option
        assert defined.choices == SGLANG_CHOICES.get(option), option
        assert defined.option_strings == SGLANG_ALIASES.get(option, (option,)), option
    assert parser.options["--model-path"].required


def test_rendered_flags_round_trip_with_their_types(parsed):
    _, results = parsed
    rendered = results["rendered"]
    assert rendered.ok, rendered.error
    assert rendered.server_args is not None, rendered.server_args_error  # from_cli_args ran on CPU
    assert rendered.mismatches(RENDERED_VALUES) == []
    assert rendered.namespace == {**rendered.namespace, **RENDERED_VALUES}  # record == namespace here


def test_omitted_flags_take_sglangs_defaults(parsed):
    _, results = parsed
    defaults = results["defaults"]
    assert defaults.mismatches({
        "host": "127.0.0.1", "port": 30000, "schedule_conservativeness": 1.0, "max_prefill_tokens": 16384,
        "kv_cache_dtype": "auto", "tp_size": 1, "enable_metrics": False}) == []
    for dest in ("context_length", "max_running_requests", "max_total_tokens", "mem_fraction_static",
                 "chunked_prefill_size", "max_queued_requests", "page_size", "served_model_name"):
        assert defaults.values[dest] is None, dest  # resolved later from the GPU and the model


def test_equals_form_aliases_suffixes_and_negative_values(parsed):
    parser, results = parsed
    case = results["equals-and-aliases"]
    assert case.mismatches({
        "model_path": "m", "tp_size": 4, "chunked_prefill_size": -1, "context_length": 16000,
        "max_total_tokens": 1024**2, "preferred_sampling_params": {"max_new_tokens": 700}}) == []
    assert parser.inexact_options(CASES["equals-and-aliases"]) == []


@pytest.mark.parametrize(("case", "says"), [
    ("bad-choice", "argument --kv-cache-dtype: invalid choice: 'fp7'"),
    ("vllm-flag", "unrecognized arguments: --max-model-len 4096"),
    ("float-for-int", "argument --max-running-requests: invalid int value: '7.5'"),
    ("word-for-float", "argument --mem-fraction-static: invalid float value: 'high'"),
    ("missing-value", "argument --max-running-requests: expected one argument"),
    ("missing-model", "the following arguments are required: --model-path/--model"),
    ("ambiguous", "ambiguous option: --max could match"),
    ("flag-with-value", "argument --enable-metrics: ignored explicit argument 'yes'"),
])
def test_sglangs_parser_rejects(parsed, case, says):
    _, results = parsed
    result = results[case]
    assert not result.ok
    assert result.status == 2
    assert says in result.error
    assert result.mismatches({"port": 30000}) == [f"argv was rejected: {result.error}"]


def test_abbreviation_is_accepted_by_sglang_but_flagged(parsed):
    parser, results = parsed
    abbreviated = results["abbreviated"]
    assert abbreviated.ok and abbreviated.values["max_running_requests"] == 7  # allow_abbrev at work
    assert parser.inexact_options(CASES["abbreviated"]) == ["--max-running-req"]
    assert inexact_options(CASES["abbreviated"]) == ["--max-running-req"]  # reuses the cached parser


def test_inexact_options_reads_only_option_tokens(parsed):
    parser, _ = parsed
    assert parser.inexact_options(RENDERED) == []
    argv = ["--model-path", "m", "--chunked-prefill-size", "-1", "--schedule-conservativeness", "-.5",
            "--max-run=3", "--", "--after-double-dash"]
    assert parser.inexact_options(argv) == ["--max-run"]
    assert parser.inexact_options(["-x", "--Port", "8"]) == ["-x", "--Port"]


def test_mismatches_compare_type_as_well_as_value():
    parse = SglangParse(argv=(), ok=True, namespace={"tp_size": 1, "mem_fraction_static": 0.5, "flag": True},
                        server_args=None, server_args_error="RuntimeError: no GPU")
    assert parse.values is parse.namespace  # the Namespace stands in when the record failed
    assert parse.mismatches({"tp_size": 1, "mem_fraction_static": 0.5}) == []
    assert parse.mismatches({"tp_size": 1.0, "flag": 1, "nope": 3}) == [
        "tp_size: expected 1.0 (float), parsed 1 (int)",
        "flag: expected 1 (int), parsed True (bool)",
        "nope: not a dest of SGLang's parser",
    ]


def test_a_missing_venv_skips_locally_and_fails_under_ci(monkeypatch, tmp_path):
    monkeypatch.setenv("KVTUNE_SGLANG_VENV", str(tmp_path / "absent"))
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match="scripts/setup-sglang-parser.sh"):
        require_sglang_python()
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="CI must run these tests"):
        require_sglang_python()
    (tmp_path / "absent" / "bin").mkdir(parents=True)
    (tmp_path / "absent" / "bin" / "python").write_text("")
    with pytest.raises(pytest.fail.Exception):  # a python without the stamp is a half-built venv
        require_sglang_python()


def test_stand_ins_record_what_bash_passes(tmp_path):
    script = ('#!/usr/bin/env bash\nset -euo pipefail\nMODEL="org/mo del \'x\'"\n'
              'exec python3 -m sglang.launch_server --model-path "$MODEL" \\\n  --port 30001 "$@"\n')
    calls = run_with_stand_ins(script, tmp_path, ["python", "python3"], args=["--enable-metrics"])
    assert [c.program for c in calls] == ["python3"]
    assert after(calls, "-m", "sglang.launch_server") == [
        "--model-path", "org/mo del 'x'", "--port", "30001", "--enable-metrics"]
    with pytest.raises(AssertionError, match="no stand-in call"):
        after(calls, "-m", "vllm")


def test_env_table_matches_sglangs_envs(batch):
    fields = batch.parser.env_fields
    assert len(fields) > 500  # the whole Envs class came back, not a subset
    assert {name: (fields[name].kind, fields[name].default) for name in SGLANG_ENV} == SGLANG_ENV


def test_rendered_environment_parses_with_sglangs_own_fields(batch):
    rendered, bad = batch.env_results
    assert env_errors(rendered, {"SGLANG_MIN_NEW_TOKEN_RATIO_FACTOR": 1.0, "SGLANG_INIT_NEW_TOKEN_RATIO": 1.0,
                                 "SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION": 8192,
                                 "SGLANG_MAX_NEW_TOKENS_LIMIT": 8192}) == []
    assert env_errors(rendered, {"SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION": 8192.0}) == [
        "SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION: expected 8192.0 (float), EnvInt parsed 8192 (int)"]
    assert env_errors(bad) == [
        'SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION: "8k" is not a valid integer value',
        "SGLANG_MAX_NEW_TOKEN_LIMIT: not declared in sglang.srt.environ.Envs",
        'SGLANG_INIT_NEW_TOKEN_RATIO: "high" is not a valid float value',
    ]
