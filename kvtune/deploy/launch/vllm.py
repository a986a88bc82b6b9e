"""vllm-serve.sh: the `vllm serve` command rendered from a recommendation, and any `vllm serve`
(or api_server, or vllm/vllm-openai image) command line read back."""

from __future__ import annotations

import json
import shlex
from typing import TYPE_CHECKING, Any

from kvtune.deploy import command_line as cl
from kvtune.deploy.deployed import Deployed, DeployedKind
from kvtune.deploy.launch import Line
from kvtune.endpoint import parse_url
from kvtune.engines import vllm
from kvtune.errors import InputError
from kvtune.userfiles import brief

if TYPE_CHECKING:
    import jinja2

    from kvtune.domain.recommendation import Recommendation

ENGINE = "vllm"
SCRIPT = "vllm-serve.sh"
FILES = {SCRIPT: "vllm-serve.sh.j2"}  # file name -> template
DEFAULT_BLOCK_SIZE = vllm.BLOCK_SIZE

# Short options vLLM accepts, by their long names.
_SHORT_FLAGS = {"tp": "tensor-parallel-size", "pp": "pipeline-parallel-size", "dp": "data-parallel-size",
                "q": "quantization", "O": "compilation-config"}
# Flags that take no value; anything else with a following non-flag token takes it as its value.
_BOOLEAN_PREFIXES = ("enable-", "no-", "disable-", "enforce-", "trust-", "skip-", "use-")
_SERVER_MODULES = ("vllm.entrypoints.openai.api_server", "vllm.entrypoints.api_server")


def upstream_lines(rec: Recommendation, host_flag: str, port_flag: str) -> list[Line]:
    """--host and --port where the gateway's upstream points (every engine's server takes both)."""
    upstream = parse_url(rec.upstream, field="upstream", allow_prefix=False)
    why = f"the gateway's upstream is {rec.upstream}"
    return [Line(host_flag, upstream.host, "upstream", why), Line(port_flag, upstream.port, "upstream", why)]


def setting_lines(rec: Recommendation, order: list[tuple[str, str]]) -> list[Line]:
    """One line per (setting, flag) whose recommended value is set."""
    lines = []
    for key, flag in order:
        decision = rec.settings.get(key)
        if decision is None or decision.value is None:
            continue
        lines.append(Line(flag, decision.value, decision.rule, decision.reason))
    return lines


def engine_settings(d: Deployed) -> dict[str, Any]:
    """The settings every engine's launch file can set, by kvtune's setting names, as read (None:
    unset); each launch module adds its own and fills its engine's defaults."""
    return {"tensor_parallel_size": d.tensor_parallel_size, "pipeline_parallel_size": d.pipeline_parallel_size,
            "max_model_len": d.max_model_len, "max_num_seqs": d.max_num_seqs,
            "max_num_batched_tokens": d.max_num_batched_tokens, "gpu_memory_utilization": d.gpu_memory_utilization,
            "kv_cache_tokens": d.kv_cache_tokens, "kv_cache_dtype": d.kv_cache_dtype, "block_size": d.block_size}


def flags(rec: Recommendation) -> list[Line]:
    """The `vllm serve` flags for the recommendation's engine version, each with its rule and
    reason. V1 (0.8+) has no --preemption-mode/--swap-space, so they render only on V0."""
    order = [
        ("tensor_parallel_size", "--tensor-parallel-size"),
        ("pipeline_parallel_size", "--pipeline-parallel-size"),
        ("max_model_len", "--max-model-len"),
        ("max_num_seqs", "--max-num-seqs"),
        ("max_num_batched_tokens", "--max-num-batched-tokens"),
        ("gpu_memory_utilization", "--gpu-memory-utilization"),
        ("kv_cache_memory_bytes", "--kv-cache-memory-bytes"),
        ("kv_cache_dtype", "--kv-cache-dtype"),
        ("block_size", "--block-size"),
    ]
    if not rec.engine.v1:
        order += [("preemption_mode", "--preemption-mode"), ("swap_space", "--swap-space")]
    backstop = rec.setting("max_new_tokens_backstop")
    return [*upstream_lines(rec, "--host", "--port"), *setting_lines(rec, order),
            Line("--override-generation-config", json.dumps({"max_new_tokens": backstop.tokens}),
                 backstop.rule, backstop.reason)]


def render(rec: Recommendation, env: jinja2.Environment, context: dict[str, Any]) -> dict[str, str]:
    return {SCRIPT: env.get_template(FILES[SCRIPT]).render({**context, "flags": flags(rec),
                                                            "replica_lines": replica_lines(rec)})}


def replica_lines(rec: Recommendation) -> list[dict[str, Any]]:
    """Several measured replicas (rec.upstreams): how each one starts from this one script, its
    own flags after it ("$@" comes last, and vllm serve takes the last of a repeated flag): its
    host and port, and its own KV pool and engine limits where they differ from the script's."""
    if len(rec.upstreams) < 2:
        return []
    script = {line.name: line.value for line in flags(rec)}
    out = []
    for u in rec.upstreams:
        url = parse_url(u.url, field="upstreams", allow_prefix=False)
        own: list[tuple[str, Any]] = [("--host", url.host), ("--port", url.port)]
        for name, value in (("--kv-cache-memory-bytes", u.kv_cache_memory_bytes), ("--max-num-seqs", u.max_num_seqs),
                            ("--max-num-batched-tokens", u.max_num_batched_tokens)):
            if value is not None and name in script and script[name] != value:
                own.append((name, value))
        out.append({"url": u.url, "capacity_file": u.capacity_file,
                    "args": " ".join(f"{name} {shlex.quote(str(value))}" for name, value in own)})
    return out


# ---------------------------------------------------------------- reading it back

def command_args(text: str, source: str) -> list[str] | None:
    """The arguments after `vllm serve`, `python -m vllm.entrypoints.openai.api_server` or a
    vllm/vllm-openai image, from the first command that has one ("<serve>" first for `vllm serve`,
    whose first positional word is the model)."""
    if "vllm" not in text:
        return None
    for words in cl.shell_commands(text, source):
        for i, word in enumerate(words):
            name = word.rsplit("/", 1)[-1]
            if name == "vllm" and i + 1 < len(words) and words[i + 1] == "serve":
                return ["<serve>", *words[i + 2:]]
            if word == "-m" and i + 1 < len(words) and words[i + 1] in _SERVER_MODULES:
                return words[i + 2:]
            if word.startswith("vllm/vllm-openai"):
                return words[i + 1:]
    return None


def recognise(text: str, source: str) -> bool:
    return command_args(text, source) is not None


def _generation_cap(override: Any, source: str) -> int | None:
    """--override-generation-config's max_new_tokens."""
    field = "--override-generation-config"
    if not isinstance(override, str):
        return None
    try:
        parsed = json.loads(override)
    except json.JSONDecodeError as exc:
        raise InputError(f"not JSON: {exc.msg}", path=source, field=field) from exc
    except (ValueError, RecursionError) as exc:  # an int of over 4,300 digits; nesting too deep
        raise InputError(f"not JSON: {brief(str(exc), 100)}", path=source, field=field) from exc
    if not isinstance(parsed, dict):
        raise InputError("expected a JSON object", path=source, field=field)
    if parsed.get("max_new_tokens") is None:
        return None
    return cl.integer(parsed["max_new_tokens"], field + ".max_new_tokens", source)


def read(text: str, source: str = "<command>", *, read_sibling: Any = None) -> Deployed:
    """A `vllm serve` (or api_server) command line, as typed or inside a shell script."""
    args = command_args(text, source)
    if args is None:
        raise InputError("no `vllm serve` or `python -m vllm.entrypoints.openai.api_server` command found",
                         path=source)
    serve = args[0] == "<serve>"
    model, parsed = cl.split_flags(args[1:] if serve else args, short_flags=_SHORT_FLAGS,
                                   boolean_prefixes=_BOOLEAN_PREFIXES, positional=serve)
    if isinstance(parsed.get("model"), str):
        model = model or parsed["model"]
    f = cl.FlagValues(parsed, source)
    return Deployed(
        kind=DeployedKind.VLLM,
        source=source,
        model=model,
        block_size=f.get("block-size", cl.integer),
        max_model_len=f.get("max-model-len", cl.human_int),
        max_num_seqs=f.get("max-num-seqs", cl.integer),
        max_num_batched_tokens=f.get("max-num-batched-tokens", cl.human_int),
        tensor_parallel_size=f.get("tensor-parallel-size", cl.integer),
        pipeline_parallel_size=f.get("pipeline-parallel-size", cl.integer),
        kv_cache_dtype=f.get("kv-cache-dtype", cl.text),
        gpu_memory_utilization=f.get("gpu-memory-utilization", cl.fraction)
        if "gpu-memory-utilization" in f else f.get("device-memory-utilization", cl.fraction),
        kv_cache_memory_bytes=f.get("kv-cache-memory-bytes", cl.human_int),
        max_new_tokens=_generation_cap(parsed.get("override-generation-config"), source),
        preemption_mode=f.get("preemption-mode", cl.text),
        swap_space=f.get("swap-space", cl.number),
        num_gpu_blocks_override=f.get("num-gpu-blocks-override", cl.count),
        flags=dict(parsed),
    )


__all__ = ["ENGINE", "SCRIPT", "FILES", "flags", "render", "read", "recognise", "command_args",
           "upstream_lines", "setting_lines", "engine_settings"]
