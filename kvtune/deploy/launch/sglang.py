"""sglang-serve.sh: SGLang's server (`python -m sglang.launch_server`) rendered from a
recommendation, with the environment that makes its admission estimate reserve like kvtune's
gateway, and any such command line read back.

SGLang estimates instead of reserving (kvtune.engines.sglang): each running request is charged
min(remaining output, CLIP) × new_token_ratio. Pinning the ratio at 1 (SGLANG_INIT_NEW_TOKEN_RATIO
= SGLANG_MIN_NEW_TOKEN_RATIO_FACTOR = 1) and CLIP at the largest route cap makes that charge the
full remaining cap, which is the guaranteed policy's reservation; SGLANG_MAX_NEW_TOKENS_LIMIT is
the server-wide cap. SGLang has no per-route cap and answers a full queue with 503 and no
Retry-After, so the gateway still clamps each route's max_tokens in front of it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvtune.deploy import command_line as cl
from kvtune.deploy.deployed import Deployed, DeployedKind
from kvtune.deploy.launch import Line
from kvtune.deploy.launch.vllm import engine_settings, setting_lines, upstream_lines
from kvtune.engines import sglang
from kvtune.errors import InputError

if TYPE_CHECKING:
    import jinja2

    from kvtune.domain.recommendation import Recommendation

ENGINE = "sglang"
SCRIPT = "sglang-serve.sh"
FILES = {SCRIPT: "sglang-serve.sh.j2"}
DEFAULT_BLOCK_SIZE = sglang.PAGE_SIZE

# recommendation setting -> SGLang flag, and how the flag's value reads back
FLAGS: tuple[tuple[str, str, Any], ...] = (
    ("tensor_parallel_size", "--tp-size", cl.integer),
    ("pipeline_parallel_size", "--pp-size", cl.integer),
    ("max_model_len", "--context-length", cl.integer),
    ("max_num_seqs", "--max-running-requests", cl.integer),
    ("max_num_batched_tokens", "--chunked-prefill-size", cl.integer),
    ("gpu_memory_utilization", "--mem-fraction-static", cl.fraction),
    ("kv_cache_tokens", "--max-total-tokens", cl.integer),
    ("kv_cache_dtype", "--kv-cache-dtype", cl.text),
    ("block_size", "--page-size", cl.integer),
    ("schedule_conservativeness", "--schedule-conservativeness", cl.number),
    ("engine_max_queued_requests", "--max-queued-requests", cl.integer),
)
# recommendation setting -> environment variable
ENVIRONMENT: tuple[tuple[str, str, Any], ...] = (
    ("init_new_token_ratio", sglang.ENV_INIT_NEW_TOKEN_RATIO, cl.fraction),
    ("min_new_token_ratio_factor", sglang.ENV_MIN_NEW_TOKEN_RATIO_FACTOR, cl.fraction),
    ("clip_max_new_tokens_estimation", sglang.ENV_CLIP_MAX_NEW_TOKENS_ESTIMATION, cl.integer),
    ("max_new_tokens_backstop", sglang.ENV_MAX_NEW_TOKENS_LIMIT, cl.integer),
)
# SGLang's defaults for the settings above, where check compares an unset flag
DEFAULTS: dict[str, Any] = {
    "tensor_parallel_size": 1, "pipeline_parallel_size": 1, "kv_cache_dtype": "auto",
    "block_size": sglang.PAGE_SIZE, "schedule_conservativeness": sglang.SCHEDULE_CONSERVATIVENESS,
    "init_new_token_ratio": sglang.INIT_NEW_TOKEN_RATIO, "min_new_token_ratio_factor":
    sglang.MIN_NEW_TOKEN_RATIO_FACTOR, "clip_max_new_tokens_estimation": sglang.CLIP_MAX_NEW_TOKENS_ESTIMATION,
}
_BOOLEANS = frozenset({"enable-metrics", "trust-remote-code", "enable-mixed-chunk", "disable-radix-cache",
                       "enable-torch-compile", "disable-cuda-graph", "enable-dp-attention", "log-requests",
                       "skip-server-warmup", "enable-cache-report", "disable-overlap-schedule"})
_BOOLEAN_PREFIXES = ("enable-", "disable-", "skip-")


def flags(rec: Recommendation) -> list[Line]:
    """`python -m sglang.launch_server`'s flags, each with its rule and reason."""
    served = rec.served_model or rec.model
    why = rec.settings.get("served_model")  # None in files written before it
    return [Line("--model-path", served, why.rule if why else "served-model",
                 why.reason if why else "the model the recommendation was made for"),
            *upstream_lines(rec, "--host", "--port"),
            *setting_lines(rec, [(key, flag) for key, flag, _ in FLAGS]),
            Line("--enable-metrics", True, "metrics-on",
                 "kvtune calibrate reads sglang:max_total_num_tokens and bench reads the sglang:* gauges")]


def environment(rec: Recommendation) -> list[Line]:
    """The SGLANG_* variables the script exports, each with its rule and reason."""
    return setting_lines(rec, [(key, name) for key, name, _ in ENVIRONMENT])


def render(rec: Recommendation, env: jinja2.Environment, context: dict[str, Any]) -> dict[str, str]:
    return {SCRIPT: env.get_template(FILES[SCRIPT]).render(
        {**context, "flags": flags(rec), "environment": environment(rec), "module": sglang.LAUNCH_MODULE})}


# ---------------------------------------------------------------- reading it back

def _launch(text: str, source: str) -> tuple[list[list[str]], list[str]] | None:
    """(every command, the arguments after `-m sglang.launch_server` or `sglang serve`)."""
    if "sglang" not in text:
        return None
    commands = cl.shell_commands(text, source)
    for words in commands:
        for i, word in enumerate(words):
            if word == "-m" and i + 1 < len(words) and words[i + 1] == sglang.LAUNCH_MODULE:
                return commands, words[i + 2:]
            if word.rsplit("/", 1)[-1] == "sglang" and i + 1 < len(words) and words[i + 1] == "serve":
                return commands, words[i + 2:]
    return None


def recognise(text: str, source: str) -> bool:
    return _launch(text, source) is not None


def read(text: str, source: str = "<command>", *, read_sibling: Any = None) -> Deployed:
    """An SGLang launch command, as typed or inside a shell script, with the SGLANG_* variables the
    script sets (exported, or assigned before the command)."""
    found = _launch(text, source)
    if found is None:
        raise InputError("no `python -m sglang.launch_server` command found", path=source)
    commands, args = found
    _, parsed = cl.split_flags(args, booleans=_BOOLEANS, boolean_prefixes=_BOOLEAN_PREFIXES, positional=False)
    f = cl.FlagValues(parsed, source)
    env = cl.shell_environment(commands, [name for _, name, _ in ENVIRONMENT])
    e = cl.FlagValues(env, source, prefix="")
    values = {key: f.get(flag.lstrip("-"), convert) for key, flag, convert in FLAGS}
    values.update({key: e.get(name, convert) for key, name, convert in ENVIRONMENT})
    model = f.get("model-path", cl.text) or f.get("model", cl.text)
    return Deployed(
        kind=DeployedKind.SGLANG, source=source, model=model,
        block_size=values["block_size"], max_model_len=values["max_model_len"],
        max_num_seqs=values["max_num_seqs"], max_num_batched_tokens=values["max_num_batched_tokens"],
        tensor_parallel_size=values["tensor_parallel_size"], pipeline_parallel_size=values["pipeline_parallel_size"],
        kv_cache_dtype=values["kv_cache_dtype"], gpu_memory_utilization=values["gpu_memory_utilization"],
        kv_cache_tokens=values["kv_cache_tokens"], max_new_tokens=values["max_new_tokens_backstop"],
        flags=dict(parsed), env=env,
        options={key: values[key] for key in ("schedule_conservativeness", "engine_max_queued_requests",
                                              "init_new_token_ratio", "min_new_token_ratio_factor",
                                              "clip_max_new_tokens_estimation")},
    )


def deployed_settings(d: Deployed) -> dict[str, tuple[Any, bool]]:
    """{setting: (value as deployed or SGLang's default, whether the file leaves it unset)}."""
    fields = {**engine_settings(d), "max_new_tokens_backstop": d.max_new_tokens, **d.options}
    return {key: (DEFAULTS.get(key) if value is None else value, value is None) for key, value in fields.items()}


__all__ = ["ENGINE", "SCRIPT", "FILES", "FLAGS", "ENVIRONMENT", "flags", "environment", "render", "read",
           "recognise", "deployed_settings"]
