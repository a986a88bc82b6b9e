"""TensorRT-LLM's `trtllm-serve` options and `--extra_llm_api_options` YAML keys, read from its source.

Why: TensorRT-LLM cannot be installed here (its PyPI release is a stub that downloads from another
index; ../shared/reference/engines.md), so a rendered trtllm-serve.sh and its YAML are checked
against these tables instead of the engine's own parser. They are only as current as the commits
below; a key missing here that the source has is a table bug: add it, citing the line.

Source: https://github.com/NVIDIA/TensorRT-LLM (stored snapshots; the files come from different
commits, none of them a release tag):
    SERVE_COMMIT   tensorrt_llm/commands/serve.py     the click options of `serve` (SERVE_OPTIONS)
    OLDER_COMMIT   tensorrt_llm/commands/serve.py     an older `serve`, for the names both accept
    LLM_ARGS_COMMIT tensorrt_llm/llmapi/llm_args.py   BaseLlmArgs, TorchLlmArgs (= LlmArgs),
                   KvCacheConfig, SchedulerConfig, DynamicBatchConfig, BlockReuseConfig,
                   KVEventsConfig, MambaStateConfig, CapacitySchedulerPolicy, ContextChunkingPolicy,
                   WaitingQueuePolicy, update_llm_args_with_extra_dict
    LOGGER_COMMIT  tensorrt_llm/logger.py             severity_map (the --log_level choices)
Places are given as class/function names: line numbers were not available from the snapshots.

What the source does, and what the validators model:
  * Unknown keys are errors at every level. BaseLlmArgs sets
    `model_config = ConfigDict(arbitrary_types_allowed=True, extra="forbid")` (read at
    LLM_ARGS_COMMIT), so TorchLlmArgs(**args) raises a pydantic ValidationError at startup; every
    nested config class derives from StrictBaseModel, which older llm_args.py define in place as
    "A base model that forbids arbitrary fields" (`class Config: extra = "forbid"`). At
    LLM_ARGS_COMMIT it is imported from llmapi/utils.py, whose stored snapshots predate it: that
    it still forbids extras is inferred from its name and history, not read.
  * `serve` builds args from its flags (get_llm_args: KvCacheConfig(free_gpu_memory_fraction=...),
    SchedulerConfig(capacity_scheduler_policy=GUARANTEED_NO_EVICT, dynamic_batch_config=...)), then
    update_llm_args_with_extra_dict merges the YAML over them with `llm_args | llm_args_dict`: a
    top-level YAML key replaces the flag's value (the CLI wins only for names passed as
    explicit_cli_keys, which serve.py at SERVE_COMMIT does not pass). kv_cache_config is deep-merged
    at LLM_ARGS_COMMIT; older llm_utils.py replaced it whole, dropping
    --kv_cache_free_gpu_memory_fraction whenever the YAML had a kv_cache_config. A YAML
    scheduler_config replaces serve's whole (SchedulerConfig's own defaults fill the rest).
  * CapacitySchedulerPolicy and ContextChunkingPolicy are StrEnums whose values equal their names,
    so YAML spells them exactly (case-sensitive). kv_cache_config.dtype is lower-cased by its
    validator before the check.
  * pydantic's lax mode would coerce "8" to 8 or true to 1; these validators do not: a quoted
    number in a rendered YAML is a rendering bug even where TensorRT-LLM forgives it.
  * click has no abbreviations: a long option is its exact name or "No such option".

Interface (import as `from trtllm_names import ...`):
    check_trtllm_serve_argv(argv) -> list[str]   argv after `trtllm-serve` (a leading `serve` is
        optional: trtllm-serve's group defaults to it); one line per unknown option, bad type,
        bad choice, missing value, value given to a flag, missing or extra MODEL.
    check_trtllm_yaml(data) -> list[str]         the parsed YAML mapping; one line per unknown key
        (at any level), wrong type, bad enum value, out-of-range number, with its dotted path.
    check_trtllm_conflicts(argv, data) -> list[str]  a flag and a YAML key that set the same
        field to different values, and a YAML kv_cache_config that would drop the CLI fraction.
    portable_options() -> frozenset[str]         option names both serve.py commits accept.

A test that renders trtllm-serve.sh + its YAML (script_argv runs the script with bash):

    (call,) = script_argv.run_with_stand_ins(script, tmp_path, ["trtllm-serve"])
    data = yaml.safe_load(yaml_text)
    assert check_trtllm_serve_argv(call.argv) == []
    assert check_trtllm_yaml(data) == []
    assert check_trtllm_conflicts(call.argv, data) == []
    assert {a for a in call.argv if a.startswith("--")} <= portable_options()
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

SOURCE_REPO = "NVIDIA/TensorRT-LLM"
SERVE_COMMIT = "00209af149e7774406881a37283dce303571eb11"  # tensorrt_llm/commands/serve.py
OLDER_COMMIT = "4c05a74891e4df8066f08ed4ce14b0972abe4e25"  # tensorrt_llm/commands/serve.py (older)
LLM_ARGS_COMMIT = "0004396720054fd8e205cbf616f21f0b57c6b412"  # tensorrt_llm/llmapi/llm_args.py
LOGGER_COMMIT = "027cd518e3b63809a5c5799187991e7f1164fb12"  # tensorrt_llm/logger.py


# --- trtllm-serve serve: click options -------------------------------------------------------


@dataclass(frozen=True, slots=True)
class CliOption:
    """One click option of `trtllm-serve serve`.

    kind: int | float | str | choice | flag | path (click.Path; existence is not checked here).
    choices None on a choice: the choices are a registry's keys not tabled here (any string).
    target: the LlmArgs field get_llm_args sets from it (dotted), None for server-only options.
    ge/le: a range enforced later by the field it sets (click itself accepts any number).
    """

    names: tuple[str, ...]
    kind: str
    default: object
    choices: tuple[str, ...] | None = None
    aliases: tuple[tuple[str, str], ...] = ()
    multiple: bool = False
    target: str | None = None
    ge: float | None = None
    le: float | None = None
    note: str = ""


# serve.py @ SERVE_COMMIT, the decorators of `def serve`, in order. The defaults of the four size
# options are BuildConfig.model_fields[...].default (tensorrt_llm/builder.py, not read); they equal
# BaseLlmArgs' max_beam_width 1, max_batch_size 2048, max_num_tokens 8192, max_seq_len None.
SERVE_OPTIONS: tuple[CliOption, ...] = (
    CliOption(("--tokenizer",), "str", None, target="tokenizer"),
    CliOption(("--custom_tokenizer",), "str", None, target="custom_tokenizer"),
    CliOption(("--host",), "str", "localhost"),
    CliOption(("--port",), "int", 8000),
    CliOption(("--backend",), "choice", "pytorch", choices=("pytorch", "tensorrt", "_autodeploy"),
              aliases=(("trt", "tensorrt"),), target="backend", note="ChoiceWithAlias"),
    CliOption(("--custom_module_dirs",), "path", None, multiple=True),
    CliOption(("--log_level",), "choice", "info",
              choices=("internal_error", "error", "warning", "info", "verbose"),
              note="click.Choice(severity_map.keys()), logger.py @ LOGGER_COMMIT"),
    CliOption(("--max_beam_width",), "int", 1, target="max_beam_width"),
    CliOption(("--max_batch_size",), "int", 2048, target="max_batch_size"),
    CliOption(("--max_num_tokens",), "int", 8192, target="max_num_tokens"),
    CliOption(("--max_seq_len",), "int", None, target="max_seq_len",
              note="None: deduced from the model config"),
    CliOption(("--tensor_parallel_size", "--tp_size"), "int", 1, target="tensor_parallel_size"),
    CliOption(("--pipeline_parallel_size", "--pp_size"), "int", 1, target="pipeline_parallel_size"),
    CliOption(("--context_parallel_size", "--cp_size"), "int", 1, target="context_parallel_size"),
    CliOption(("--moe_expert_parallel_size", "--ep_size"), "int", None, target="moe_expert_parallel_size"),
    CliOption(("--moe_cluster_parallel_size", "--cluster_size"), "int", None,
              target="moe_cluster_parallel_size"),
    CliOption(("--gpus_per_node",), "int", None, target="gpus_per_node", note="None: torch.cuda.device_count()"),
    CliOption(("--free_gpu_memory_fraction", "--kv_cache_free_gpu_memory_fraction"), "float", 0.9,
              target="kv_cache_config.free_gpu_memory_fraction", ge=0, le=1,
              note="KvCacheConfig(free_gpu_memory_fraction=...): ge=0, le=1"),
    CliOption(("--num_postprocess_workers",), "int", 0, target="num_postprocess_workers"),
    CliOption(("--trust_remote_code",), "flag", False, target="trust_remote_code"),
    CliOption(("--revision",), "str", None, target="revision"),
    CliOption(("--config", "--extra_llm_api_options"), "str", None, note="path of the YAML checked below"),
    CliOption(("--reasoning_parser",), "choice", None, target="reasoning_parser",
              note="click.Choice(ReasoningParserFactory.parsers.keys()), not tabled"),
    CliOption(("--tool_parser",), "choice", None, note="click.Choice(ToolParserFactory.parsers.keys()), not tabled"),
    CliOption(("--metadata_server_config_file",), "str", None),
    CliOption(("--server_role",), "str", None),
    CliOption(("--fail_fast_on_attention_window_too_large",), "flag", False,
              target="fail_fast_on_attention_window_too_large"),
    CliOption(("--otlp_traces_endpoint",), "str", None, target="otlp_traces_endpoint"),
    CliOption(("--disagg_cluster_uri",), "str", None),
    CliOption(("--enable_chunked_prefill",), "flag", False, target="enable_chunked_prefill"),
    CliOption(("--media_io_kwargs",), "str", None, note="JSON, parsed by serve()"),
    CliOption(("--chat_template",), "str", None),
    CliOption(("--help",), "flag", False, note="click's own"),
)

# serve.py @ OLDER_COMMIT: the same command before the long aliases (--tensor_parallel_size,
# --free_gpu_memory_fraction, --config, …) were added.
OLDER_SERVE_NAMES: frozenset[str] = frozenset({
    "--tokenizer", "--host", "--port", "--backend", "--log_level", "--max_beam_width", "--max_batch_size",
    "--max_num_tokens", "--max_seq_len", "--tp_size", "--pp_size", "--ep_size", "--cluster_size",
    "--gpus_per_node", "--kv_cache_free_gpu_memory_fraction", "--num_postprocess_workers",
    "--trust_remote_code", "--extra_llm_api_options", "--reasoning_parser", "--metadata_server_config_file",
    "--server_role", "--fail_fast_on_attention_window_too_large", "--disagg_cluster_uri",
    "--enable_chunked_prefill", "--media_io_kwargs", "--help",
})

OPTION_BY_NAME: dict[str, CliOption] = {name: option for option in SERVE_OPTIONS for name in option.names}


def portable_options() -> frozenset[str]:
    """Option names accepted by serve.py at both commits: what kvtune should render."""
    return frozenset(OPTION_BY_NAME) & OLDER_SERVE_NAMES


# --- the YAML: LlmArgs fields ------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Key:
    """One pydantic field of an LlmArgs config class.

    kind: int | float | bool | str | enum | list_int | list_float | list_str | dict | model | opaque.
    model with fields None: a nested config class whose own keys are not tabled (a mapping is all
    that is checked). opaque: a Python object no YAML can meaningfully give (accepted as is).
    choices: enum / Literal values; also: extra literals a non-str kind accepts ("auto" for a bool).
    """

    kind: str
    default: object = None
    optional: bool = False
    choices: tuple[str, ...] | None = None
    also: tuple[str, ...] = ()
    case_insensitive: bool = False
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    fields: Mapping[str, Key] | None = None
    note: str = ""


def _model(fields: Mapping[str, Key] | None = None, *, optional: bool = False, note: str = "") -> Key:
    return Key("model", None, optional=optional, fields=fields, note=note)


CAPACITY_SCHEDULER_POLICIES = ("MAX_UTILIZATION", "GUARANTEED_NO_EVICT", "STATIC_BATCH")
CONTEXT_CHUNKING_POLICIES = ("FIRST_COME_FIRST_SERVED", "EQUAL_PROGRESS", "FORCE_CHUNK")
WAITING_QUEUE_POLICIES = ("fcfs", "priority")
# KvCacheConfig.validate_dtype: "auto", "fp8", "fp8_ds_mla", "nvfp4" or a key of
# _utils._str_to_torch_dtype_dict (bfloat16 float16 float32 int64 int32 int8 bool fp8), lower-cased.
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_ds_mla", "nvfp4", "bfloat16", "float16", "float32", "int64", "int32",
                   "int8", "bool")

# llm_args.py @ LLM_ARGS_COMMIT, class DynamicBatchConfig(StrictBaseModel, PybindMirror).
DYNAMIC_BATCH_CONFIG: dict[str, Key] = {
    "enable_batch_size_tuning": Key("bool", True),
    "enable_max_num_tokens_tuning": Key("bool", False),
    "dynamic_batch_moving_average_window": Key("int", 128),
}

# llm_args.py @ LLM_ARGS_COMMIT, class SchedulerConfig(StrictBaseModel, PybindMirror).
SCHEDULER_CONFIG: dict[str, Key] = {
    "capacity_scheduler_policy": Key("enum", "GUARANTEED_NO_EVICT", choices=CAPACITY_SCHEDULER_POLICIES),
    "context_chunking_policy": Key("enum", None, optional=True, choices=CONTEXT_CHUNKING_POLICIES),
    "dynamic_batch_config": _model(DYNAMIC_BATCH_CONFIG, optional=True, note="TensorRT backend only"),
    "waiting_queue_policy": Key("enum", "fcfs", choices=WAITING_QUEUE_POLICIES),
    "use_python_scheduler": Key("bool", False),
    "enable_prefix_aware_scheduling": Key("bool", True),
}

# llm_args.py @ LLM_ARGS_COMMIT: KVEventsConfig, MambaStateConfig, BlockReuseConfig.
KV_EVENTS_CONFIG: dict[str, Key] = {
    "enable_kv_cache_events": Key("bool", False),
    "publisher": Key("enum", None, optional=True, choices=("null", "zmq")),
    "endpoint": Key("str", "tcp://*:5557"),
    "replay_endpoint": Key("str", None, optional=True),
    "buffer_steps": Key("int", 10_000, gt=0),
    "hwm": Key("int", 100_000, gt=0),
    "max_queue_size": Key("int", 100_000, gt=0),
    "topic": Key("str", ""),
}
MAMBA_STATE_CONFIG: dict[str, Key] = {
    "periodic_snapshot_interval": Key("int", 0, ge=0),
    "additional_snapshot_offsets_from_start": Key("list_int", []),
    "additional_snapshot_offsets_from_end": Key("list_int", []),
    "enable_branch_snapshot": Key("bool", False),
}
BLOCK_REUSE_CONFIG: dict[str, Key] = {
    "policy": Key("enum", "all_reusable", choices=("all_reusable", "per_request", "per_conversation")),
    "max_num_turns": Key("int", 1, gt=0),
}

# llm_args.py @ LLM_ARGS_COMMIT, class KvCacheConfig(StrictBaseModel, PybindMirror).
KV_CACHE_CONFIG: dict[str, Key] = {
    "enable_block_reuse": Key("bool", True),
    "max_tokens": Key("int", None, optional=True,
                      note="with free_gpu_memory_fraction too, the smaller memory wins"),
    "max_attention_window": Key("list_int", None, optional=True),
    "sink_token_length": Key("int", None, optional=True, note="deprecated, ignored on PyTorch"),
    "free_gpu_memory_fraction": Key("float", 0.9, optional=True, ge=0, le=1),
    "host_cache_size": Key("int", None, optional=True),
    "disk_cache_size": Key("int", None, optional=True, ge=0),
    "disk_cache_path": Key("str", None, optional=True),
    "cross_kv_cache_fraction": Key("float", None, optional=True, ge=0, le=1),
    "secondary_offload_min_priority": Key("int", None, optional=True),
    "event_buffer_max_size": Key("int", 0),
    "attention_dp_events_gather_period_ms": Key("int", 5),
    "kv_events_config": _model(KV_EVENTS_CONFIG, optional=True),
    "enable_partial_reuse": Key("bool", True),
    "copy_on_partial_reuse": Key("bool", True),
    "use_uvm": Key("bool", False),
    "max_gpu_total_bytes": Key("int", 0, ge=0),
    "iteration_stats_interval": Key("int", 1, gt=0),
    "dtype": Key("str", "auto", choices=KV_CACHE_DTYPES, case_insensitive=True),
    "mamba_ssm_cache_dtype": Key("enum", "auto", choices=("auto", "float16", "bfloat16", "float32")),
    "mamba_ssm_stochastic_rounding": Key("bool", False),
    "mamba_ssm_philox_rounds": Key("int", 10, ge=1),
    "tokens_per_block": Key("int", 32),
    "mamba_state_cache_interval": Key("int", None, optional=True, ge=0, note="deprecated alias"),
    "mamba_state_config": _model(MAMBA_STATE_CONFIG),
    "use_kv_cache_manager_v2": Key("bool", "auto", also=("auto",)),
    "enable_swa_scratch_reuse": Key("bool", False),
    "kv_cache_event_hash_algo": Key("enum", "auto", choices=("auto", "v1_block_key", "v2_sha256", "v2_sha256_64")),
    "max_util_for_resume": Key("float", 0.95, gt=0, le=1),
    "enable_kv_pool_rebalance": Key("bool", False),
    "kv_pool_rebalance_min_sampled_kv_caches": Key("int", 2000, ge=0),
    "kv_pool_rebalance_cooldown_secs": Key("float", 120.0, ge=0),
    "kv_pool_rebalance_target_ratio_update_interval": Key("int", 100, gt=0),
    "kv_pool_rebalance_ratio_threshold": Key("float", 1.25, gt=1.0),
    "kv_pool_rebalance_moving_average_decay": Key("float", 0.9999, gt=0, lt=1),
    "kv_pool_rebalance_check_interval": Key("int", 10, gt=0),
    "disk_prefetch_num_reqs": Key("int", 0, ge=0),
    "fp8_context_mla_kv_len_cap": Key("int", None, optional=True),
    "pool_ratio": Key("list_float", None, optional=True),
    "avg_seq_len": Key("int", None, optional=True, gt=0),
    "block_reuse_config": _model(BLOCK_REUSE_CONFIG),
}

# llm_args.py @ LLM_ARGS_COMMIT: class BaseLlmArgs, then class TorchLlmArgs(BaseLlmArgs) (LlmArgs =
# TorchLlmArgs; trtllm-serve's default backend "pytorch" builds it). Nested configs without a
# table here are model(None): their inner keys are not checked.
TOP_LEVEL: dict[str, Key] = {
    # BaseLlmArgs
    "model": Key("str"),
    "tokenizer": Key("str", None, optional=True),
    "tokenizer_mode": Key("enum", "auto", choices=("auto", "slow")),
    "custom_tokenizer": Key("str", None, optional=True),
    "post_processor_hook": Key("str", None, optional=True),
    "skip_tokenizer_init": Key("bool", False),
    "trust_remote_code": Key("bool", False),
    "tensor_parallel_size": Key("int", 1),
    "dtype": Key("str", "auto"),
    "revision": Key("str", None, optional=True),
    "tokenizer_revision": Key("str", None, optional=True),
    "model_kwargs": Key("dict", None, optional=True),
    "pipeline_parallel_size": Key("int", 1),
    "context_parallel_size": Key("int", 1),
    "gpus_per_node": Key("int", None, optional=True),
    "moe_cluster_parallel_size": Key("int", None, optional=True, note="deprecated"),
    "moe_tensor_parallel_size": Key("int", None, optional=True),
    "moe_expert_parallel_size": Key("int", None, optional=True),
    "enable_attention_dp": Key("bool", False),
    "enable_lm_head_tp_in_adp": Key("bool", False),
    "pp_partition": Key("list_int", None, optional=True),
    "cp_config": _model(optional=True),
    "enable_lora": Key("bool", False),
    "lora_config": _model(optional=True),
    "kv_cache_config": _model(KV_CACHE_CONFIG),
    "enable_chunked_prefill": Key("bool", False),
    "guided_decoding_backend": Key("enum", None, optional=True, choices=("xgrammar", "llguidance")),
    "batched_logits_processor": Key("opaque", None, optional=True),
    "iter_stats_max_iterations": Key("int", None, optional=True, ge=-1),
    "request_stats_max_iterations": Key("int", None, optional=True, ge=-1),
    "peft_cache_config": _model(optional=True),
    "scheduler_config": _model(SCHEDULER_CONFIG),
    "cache_transceiver_config": _model(optional=True),
    "sparse_attention_config": _model(optional=True),
    "kv_cache_compression_config": _model(optional=True),
    "speculative_config": _model(optional=True),
    "max_batch_size": Key("int", 2048, optional=True),
    "max_input_len": Key("int", 1024, optional=True),
    "max_seq_len": Key("int", None, optional=True),
    "max_beam_width": Key("int", 1, optional=True),
    "max_num_tokens": Key("int", 8192, optional=True),
    "gather_generation_logits": Key("bool", False),
    "num_postprocess_workers": Key("int", 0),
    "postprocess_tokenizer_dir": Key("str", None, optional=True),
    "num_serve_frontends": Key("int", 1, ge=1, le=64),
    "reasoning_parser": Key("str", None, optional=True),
    "decoding_config": Key("opaque", None, optional=True, note="deprecated: use speculative_config"),
    "otlp_traces_endpoint": Key("str", None, optional=True),
    "return_perf_metrics": Key("bool", False),
    "perf_metrics_output_dir": Key("str", None, optional=True),
    "perf_metrics_max_requests": Key("int", 0, ge=0, note="deprecated"),
    "prometheus_metrics_config": _model(optional=True),
    "enable_energy_metrics": Key("bool", False),
    "orchestrator_type": Key("enum", None, optional=True, choices=("rpc", "ray")),
    "env_overrides": Key("dict", None, optional=True),
    "telemetry_config": _model(),
    # TorchLlmArgs
    "generation_config": Key("enum", "trtllm", choices=("auto", "trtllm")),
    "garbage_collection_gen0_threshold": Key("int", 20000),
    "cuda_graph_config": _model(optional=True),
    "encoder_cuda_graph_config": _model(optional=True),
    "enable_encoder_decoder_mixed_cuda_graph": Key("bool", True),
    "multimodal_config": _model(optional=True, note="None is coerced to the default"),
    "attention_dp_config": _model(optional=True),
    "disable_overlap_scheduler": Key("bool", False),
    "moe_config": _model(),
    "nvfp4_gemm_config": _model(),
    "dwdp_config": _model(optional=True),
    "encoder_max_batch_size": Key("int", None, optional=True, gt=0),
    "encoder_max_num_tokens": Key("int", None, optional=True, gt=0),
    "attn_backend": Key("str", "TRTLLM"),
    "enable_mla_skip_correction": Key("bool", False),
    "mla_skip_correction_threshold": Key("float", 8.0, gt=0, le=32),
    "sampler_force_async_worker": Key("bool", False),
    "enable_in_graph_sampling": Key("bool", False),
    "enable_speculative_beam_history_d2h": Key("bool", False),
    "enable_early_first_token_response": Key("bool", False),
    "enable_low_latency_host_dispatch": Key("bool", False),
    "enable_iter_perf_stats": Key("bool", False),
    "enable_iter_req_stats": Key("bool", False),
    "print_iter_log": Key("bool", False),
    "batch_wait_timeout_ms": Key("float", 0, ge=0),
    "batch_wait_timeout_iters": Key("int", 0, ge=0),
    "batch_wait_max_tokens_ratio": Key("float", 0, ge=0, le=1),
    "torch_compile_config": _model(optional=True),
    "prefill_cuda_graph_backend": Key("enum", "disabled", choices=("disabled", "piecewise", "breakable")),
    "prefill_capture_num_tokens": Key("list_int", None, optional=True),
    "enable_autotuner": Key("bool", True),
    "use_fine_grained_sync": Key("bool", False),
    "enable_layerwise_nvtx_marker": Key("bool", False),
    "load_format": Key("str", "AUTO", choices=("AUTO", "DUMMY", "VISION_ONLY", "GMS"), case_insensitive=True,
                       note="TorchLlmArgs.convert_load_format upper-cases a str (an int is LoadFormat(n))"),
    "enable_min_latency": Key("bool", False),
    "stream_interval": Key("int", 1, gt=0),
    "force_dynamic_quantization": Key("bool", False),
    "allreduce_strategy": Key("enum", "AUTO", optional=True,
                              choices=("AUTO", "NCCL", "UB", "MINLATENCY", "ONESHOT", "TWOSHOT", "LOWPRECISION",
                                       "MNNVL", "NCCL_SYMMETRIC")),
    "checkpoint_loader": Key("opaque", None, optional=True),
    "checkpoint_format": Key("str", None, optional=True),
    "checkpoint_io_policy": Key("enum", "auto", choices=("auto", "native", "rank_striped_read_ahead")),
    "mx_config": _model(),
    "gms_config": _model(),
    "kv_connector_config": _model(optional=True),
    "mm_encoder_only": Key("bool", False),
    "disable_mm_encoder": Key("bool", False),
    "encode_only": Key("bool", False),
    "ray_worker_extension_cls": Key("str", None, optional=True),
    "ray_placement_config": _model(optional=True),
    "ray_worker_nsight_options": Key("dict", None, optional=True),
    "sleep_config": _model(optional=True),
    "reorder_policy_config": _model(optional=True),
    "enable_resource_governor": Key("bool", False),
    "use_cute_dsl_blockscaling_mm": Key("bool", False),
    "use_cute_dsl_blockscaling_bmm": Key("bool", False),
    "use_cute_dsl_bf16_bmm": Key("bool", False),
    "use_cute_dsl_bf16_gemm": Key("bool", False),
    "max_stats_len": Key("int", 1000, ge=-1),
    "layer_wise_benchmarks_config": _model(),
    "backend": Key("enum", "pytorch", choices=("pytorch",), note="TorchLlmArgs narrows BaseLlmArgs' str"),
}
# Accepted on input but not fields: update_llm_args_with_extra_dict renames hf_revision to revision;
# TorchLlmArgs._drop_removed_args drops sampler_type ("auto"/"TorchSampler" warn, others raise).
RENAMED_OR_REMOVED: dict[str, str] = {
    "hf_revision": "renamed to revision by update_llm_args_with_extra_dict",
    "sampler_type": "removed: 'auto' and 'TorchSampler' are dropped with a warning, anything else raises",
}


# --- validators ----------------------------------------------------------------------------------


def _convert(option: CliOption, name: str, value: str) -> tuple[object, str | None]:
    """click's conversion of one value (int()/float() exactly as click's number types call them)."""
    if option.kind == "int":
        try:
            return int(value), None
        except ValueError:
            return None, f"{name}: {value!r} is not a valid integer"
    if option.kind == "float":
        try:
            return float(value), None
        except ValueError:
            return None, f"{name}: {value!r} is not a valid float"
    if option.kind == "choice":
        mapped = dict(option.aliases).get(value, value)
        if option.choices is not None and mapped not in option.choices:
            return None, f"{name}: {value!r} is not one of {', '.join(option.choices)}"
        return mapped, None
    return value, None


def _range_error(path: str, value: float, ge=None, gt=None, le=None, lt=None) -> str | None:
    if isinstance(value, float) and math.isnan(value):
        return f"{path}: nan is not a number in range"
    if ge is not None and value < ge:
        return f"{path}: {value!r} is below the minimum {ge} (ge={ge})"
    if gt is not None and value <= gt:
        return f"{path}: {value!r} must be greater than {gt} (gt={gt})"
    if le is not None and value > le:
        return f"{path}: {value!r} is above the maximum {le} (le={le})"
    if lt is not None and value >= lt:
        return f"{path}: {value!r} must be less than {lt} (lt={lt})"
    return None


@dataclass(slots=True)
class _ParsedArgv:
    values: dict[str, object] = field(default_factory=dict)  # option's first name -> converted value
    given: dict[str, str] = field(default_factory=dict)  # option's first name -> spelling used
    positionals: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def _parse_argv(argv: Sequence[str]) -> _ParsedArgv:
    parsed = _ParsedArgv()
    tokens = list(argv)
    if tokens[:1] == ["serve"]:
        tokens = tokens[1:]
    i = 0
    only_positionals = False
    while i < len(tokens):
        token = tokens[i]
        i += 1
        if only_positionals or token == "-" or not token.startswith("-"):
            parsed.positionals.append(token)
            continue
        if token == "--":
            only_positionals = True
            continue
        name, has_value, inline = token.partition("=")
        option = OPTION_BY_NAME.get(name)
        if option is None:
            parsed.errors.append(f"{name}: no such option of trtllm-serve serve (click takes exact names only)")
            if not has_value and i < len(tokens) and not tokens[i].startswith("-"):
                i += 1  # most likely its value: one error, not a second "extra argument" one
            continue
        if option.kind == "flag":
            if has_value:
                parsed.errors.append(f"{name}: a flag takes no value (got {inline!r})")
            parsed.values[option.names[0]] = True
            parsed.given[option.names[0]] = name
            continue
        if has_value:
            raw = inline
        elif i < len(tokens):
            raw = tokens[i]  # click takes the next token as the value, even one starting with "-"
            i += 1
        else:
            parsed.errors.append(f"{name}: requires a value")
            continue
        value, error = _convert(option, name, raw)
        if error:
            parsed.errors.append(error)
            continue
        if isinstance(value, int | float) and not isinstance(value, bool):
            problem = _range_error(name, value, ge=option.ge, le=option.le)
            if problem:
                parsed.errors.append(f"{problem}, enforced by {option.target}")
        if option.multiple:
            previous = parsed.values.get(option.names[0], ())
            parsed.values[option.names[0]] = (*previous, value)
        else:
            parsed.values[option.names[0]] = value
        parsed.given[option.names[0]] = name
    if not parsed.positionals:
        parsed.errors.append("MODEL: missing argument (model name, HF checkpoint path or engine path)")
    elif len(parsed.positionals) > 1:
        parsed.errors.append(f"unexpected extra arguments: {' '.join(parsed.positionals[1:])}")
    return parsed


def check_trtllm_serve_argv(argv: Sequence[str]) -> list[str]:
    """Errors `trtllm-serve [serve] …` would raise for this argv, one line each."""
    return _parse_argv(argv).errors


def _type_error(path: str, key: Key, value: object) -> str | None:
    if value is None:
        return None if key.optional else f"{path}: null is not allowed (not Optional)"
    if isinstance(value, str) and value in key.also:
        return None
    kind = key.kind
    if kind == "opaque":
        return None
    if kind == "bool":
        ok = isinstance(value, bool)
    elif kind == "int":
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif kind == "float":
        ok = isinstance(value, int | float) and not isinstance(value, bool)
    elif kind in ("str", "enum"):
        ok = isinstance(value, str)
    elif kind == "list_int":
        ok = isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
    elif kind == "list_float":
        ok = isinstance(value, list) and all(isinstance(v, int | float) and not isinstance(v, bool) for v in value)
    elif kind == "list_str":
        ok = isinstance(value, list) and all(isinstance(v, str) for v in value)
    elif kind in ("dict", "model"):
        ok = isinstance(value, dict)
    else:  # a table bug, not a user error
        raise ValueError(f"unknown kind {kind!r} for {path}")
    if not ok:
        return f"{path}: expected {kind}{' or null' if key.optional else ''}, got {type(value).__name__} {value!r}"
    return None


def _check_mapping(path: str, data: Mapping, fields: Mapping[str, Key], errors: list[str]) -> None:
    for name, value in data.items():
        where = f"{path}.{name}" if path else str(name)
        key = fields.get(name) if isinstance(name, str) else None
        if key is None:
            hint = RENAMED_OR_REMOVED.get(name) if not path and isinstance(name, str) else None
            if hint is None:
                errors.append(f"{where}: unknown key (extra='forbid' rejects it at startup)")
            continue
        problem = _type_error(where, key, value)
        if problem:
            errors.append(problem)
            continue
        if value is None or (isinstance(value, str) and value in key.also):
            continue
        if key.choices is not None and isinstance(value, str):
            spelled = value.lower() if key.case_insensitive else value
            allowed = tuple(c.lower() for c in key.choices) if key.case_insensitive else key.choices
            if spelled not in allowed:
                errors.append(f"{where}: {value!r} is not one of {', '.join(key.choices)}")
                continue
        if isinstance(value, int | float) and not isinstance(value, bool):
            problem = _range_error(where, value, key.ge, key.gt, key.le, key.lt)
            if problem:
                errors.append(problem)
        if key.kind == "model" and key.fields is not None:
            _check_mapping(where, value, key.fields, errors)


def check_trtllm_yaml(data: object) -> list[str]:
    """Errors TorchLlmArgs would raise for this extra_llm_api_options mapping, one line each."""
    if data is None:
        return []  # an empty file: update_llm_args_with_extra_options treats it as {}
    if not isinstance(data, dict):
        return [f"the YAML root must be a mapping, got {type(data).__name__}"]
    errors: list[str] = []
    _check_mapping("", data, TOP_LEVEL, errors)
    return errors


def _yaml_value(data: Mapping, dotted: str) -> tuple[bool, object]:
    node: object = data
    for part in dotted.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return False, None
        node = node[part]
    return True, node


def check_trtllm_conflicts(argv: Sequence[str], data: Mapping | None) -> list[str]:
    """A flag and a YAML key that set one field differently: which wins depends on the version."""
    parsed = _parse_argv(argv)
    data = data or {}
    problems = []
    for first_name, value in parsed.values.items():
        option = OPTION_BY_NAME[first_name]
        if option.target is None:
            continue
        present, yaml_value = _yaml_value(data, option.target)
        if present and yaml_value != value:
            problems.append(
                f"{option.target}: {parsed.given[first_name]} {value!r} but the YAML says {yaml_value!r}; "
                "serve.py merges the YAML over the flags (YAML wins unless the CLI key is explicit): "
                "set it in one place")
    fraction = "--free_gpu_memory_fraction"
    if fraction in parsed.values and isinstance(data.get("kv_cache_config"), Mapping) \
            and "free_gpu_memory_fraction" not in data["kv_cache_config"]:
        problems.append(
            f"kv_cache_config: the YAML has one without free_gpu_memory_fraction, so versions that replace "
            f"kv_cache_config whole drop {parsed.given[fraction]} {parsed.values[fraction]!r} "
            "(0.9 instead): write the fraction in the YAML")
    return problems
