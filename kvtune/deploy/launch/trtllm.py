"""trtllm-serve.sh and trtllm-llm-api.yaml: TensorRT-LLM's server (`trtllm-serve`) and its
--extra_llm_api_options file rendered from a recommendation, and read back.

TensorRT-LLM's default scheduler, GUARANTEED_NO_EVICT, reserves KV for prompt + max_tokens before
it starts a request: the guaranteed policy, natively. A request without max_tokens reserves the
whole max_seq_len window, so the rendered gateway always writes its route's cap into the request
and max_seq_len comes from the longest logged request, as vLLM's max_model_len does. A gateway
that bets on the output distribution (statistical, overcommit) pairs with MAX_UTILIZATION, which
schedules for the next step and pauses the last started request when KV runs out.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvtune.deploy import command_line as cl
from kvtune.deploy.deployed import Deployed, DeployedKind
from kvtune.deploy.launch import Line
from kvtune.deploy.launch.vllm import engine_settings, setting_lines, upstream_lines
from kvtune.engines import trtllm
from kvtune.errors import InputError
from kvtune.userfiles import brief, parse_yaml

if TYPE_CHECKING:
    import jinja2

    from kvtune.domain.recommendation import Recommendation

ENGINE = "trtllm"
SCRIPT = "trtllm-serve.sh"
OPTIONS = "trtllm-llm-api.yaml"
FILES = {SCRIPT: "trtllm-serve.sh.j2", OPTIONS: "trtllm-llm-api.yaml.j2"}
DEFAULT_BLOCK_SIZE = trtllm.TOKENS_PER_BLOCK

# recommendation setting -> trtllm-serve option (click spells them with underscores)
FLAGS: tuple[tuple[str, str, Any], ...] = (
    ("tensor_parallel_size", "--tp_size", cl.integer),
    ("pipeline_parallel_size", "--pp_size", cl.integer),
    ("max_model_len", "--max_seq_len", cl.integer),
    ("max_num_seqs", "--max_batch_size", cl.integer),
    ("max_num_batched_tokens", "--max_num_tokens", cl.integer),
    ("gpu_memory_utilization", "--kv_cache_free_gpu_memory_fraction", cl.fraction),
)
# recommendation setting -> (section, key) of the LLM API options YAML
# (trtllm-serve merges this file over its options, and older releases replace the whole
# kv_cache_config with the file's: the memory fraction is written here too, to the same value)
OPTION_KEYS: tuple[tuple[str, tuple[str, ...], Any], ...] = (
    ("gpu_memory_utilization", ("kv_cache_config", "free_gpu_memory_fraction"), cl.fraction),
    ("kv_cache_tokens", ("kv_cache_config", "max_tokens"), cl.integer),
    ("block_size", ("kv_cache_config", "tokens_per_block"), cl.integer),
    ("kv_cache_dtype", ("kv_cache_config", "dtype"), cl.text),
    ("capacity_scheduler_policy", ("scheduler_config", "capacity_scheduler_policy"), cl.text),
)
DEFAULTS: dict[str, Any] = {
    "tensor_parallel_size": 1, "pipeline_parallel_size": 1, "max_num_seqs": trtllm.MAX_BATCH_SIZE,
    "max_num_batched_tokens": trtllm.MAX_NUM_TOKENS,
    "gpu_memory_utilization": trtllm.KV_CACHE_FREE_GPU_MEMORY_FRACTION, "block_size": trtllm.TOKENS_PER_BLOCK,
    "kv_cache_dtype": "auto", "capacity_scheduler_policy": trtllm.GUARANTEED_NO_EVICT,
}
_BOOLEANS = frozenset({"trust_remote_code", "enable_chunked_prefill", "disable_gc"})


def flags(rec: Recommendation) -> list[Line]:
    """trtllm-serve's options, each with its rule and reason (the model is its first argument)."""
    lines = [*upstream_lines(rec, "--host", "--port"),
             *setting_lines(rec, [(key, flag) for key, flag, _ in FLAGS])]
    lines.append(Line("--extra_llm_api_options", OPTIONS, "llm-api-options",
                      "the KV cache and scheduler settings below have no trtllm-serve option"))
    return lines


def options(rec: Recommendation) -> dict[str, list[Line]]:
    """The LLM API options YAML by section, each key with its rule and reason."""
    sections: dict[str, list[Line]] = {}
    for key, (section, name), _ in OPTION_KEYS:
        decision = rec.settings.get(key)
        if decision is None or decision.value is None:
            continue
        sections.setdefault(section, []).append(Line(name, decision.value, decision.rule, decision.reason))
    sections.setdefault("kv_cache_config", []).append(
        Line("enable_block_reuse", True, "prefix-reuse-on",
             "TensorRT-LLM's default; reused prompt blocks count once, so the budget is a bound"))
    return sections


def render(rec: Recommendation, env: jinja2.Environment, context: dict[str, Any]) -> dict[str, str]:
    context = {**context, "flags": flags(rec), "sections": options(rec), "options_file": OPTIONS,
               "command": trtllm.SERVE_COMMAND}
    return {name: env.get_template(template).render(context) for name, template in FILES.items()}


# ---------------------------------------------------------------- reading it back

def _launch(text: str, source: str) -> list[str] | None:
    """The arguments after `trtllm-serve` (or `trtllm-serve serve`)."""
    if trtllm.SERVE_COMMAND not in text:
        return None
    for words in cl.shell_commands(text, source):
        for i, word in enumerate(words):
            if word.rsplit("/", 1)[-1] == trtllm.SERVE_COMMAND:
                rest = words[i + 1:]
                return rest[1:] if rest[:1] == ["serve"] else rest
    return None


def recognise(text: str, source: str) -> bool:
    return _launch(text, source) is not None


def _options(text: str, where: str) -> dict[str, Any]:
    data = parse_yaml(text, path=where)
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise InputError(f"expected a mapping of LLM API options, found {brief(data)}", path=where)
    return data


def read(text: str, source: str = "<command>", *, read_sibling: Any = None) -> Deployed:
    """A trtllm-serve command, as typed or inside a shell script, with the --extra_llm_api_options
    YAML it names when `read_sibling` can read it (kvtune.deploy.read.load_deployed reads it from
    beside the script); a named YAML that cannot be read is an error, never silently skipped."""
    args = _launch(text, source)
    if args is None:
        raise InputError("no `trtllm-serve` command found", path=source)
    model, parsed = cl.split_flags(args, booleans=_BOOLEANS)
    parsed = {name.replace("-", "_"): value for name, value in parsed.items()}
    f = cl.FlagValues(parsed, source)
    values = {key: f.get(flag.lstrip("-"), convert) for key, flag, convert in FLAGS}
    extra: dict[str, Any] = {}
    named = f.get("extra_llm_api_options", cl.text)
    if named is not None and read_sibling is not None:
        try:
            sibling_text = read_sibling(named)
        except InputError as exc:
            raise InputError(f"cannot read {brief(named, 80)}: {exc.message}", path=source,
                             field="--extra_llm_api_options") from exc
        except (OSError, KeyError) as exc:
            raise InputError(f"cannot read {brief(named, 80)}: {exc}", path=source,
                             field="--extra_llm_api_options") from exc
        extra = _options(sibling_text, named)
    for key, (section, name), convert in OPTION_KEYS:
        block = extra.get(section)
        if block is not None and not isinstance(block, dict):
            raise InputError(f"expected a mapping, found {brief(block)}", path=named, field=section)
        value = None if block is None else block.get(name)
        if value is not None:  # the file wins over the option, as trtllm-serve merges them
            values[key] = convert(value, f"{section}.{name}", str(named))
        else:
            values.setdefault(key, None)
    return Deployed(
        kind=DeployedKind.TRTLLM, source=source, model=model,
        block_size=values["block_size"], max_model_len=values["max_model_len"],
        max_num_seqs=values["max_num_seqs"], max_num_batched_tokens=values["max_num_batched_tokens"],
        tensor_parallel_size=values["tensor_parallel_size"], pipeline_parallel_size=values["pipeline_parallel_size"],
        kv_cache_dtype=values["kv_cache_dtype"], gpu_memory_utilization=values["gpu_memory_utilization"],
        kv_cache_tokens=values["kv_cache_tokens"], flags=dict(parsed),
        options={"capacity_scheduler_policy": values["capacity_scheduler_policy"], "llm_api_options": extra,
                 "llm_api_options_read": named is None or read_sibling is not None},
    )


def deployed_settings(d: Deployed) -> dict[str, tuple[Any, bool]]:
    """{setting: (value as deployed or TensorRT-LLM's default, whether the files leave it unset)}."""
    fields = {**engine_settings(d), "capacity_scheduler_policy": d.options.get("capacity_scheduler_policy")}
    if not d.options.get("llm_api_options_read", True):  # the YAML was not given: its keys are unknown
        for key, _, _ in OPTION_KEYS:
            fields.pop(key, None)
    return {key: (DEFAULTS.get(key) if value is None else value, value is None) for key, value in fields.items()}


__all__ = ["ENGINE", "SCRIPT", "OPTIONS", "FILES", "FLAGS", "OPTION_KEYS", "flags", "options", "render", "read",
           "recognise", "deployed_settings"]
