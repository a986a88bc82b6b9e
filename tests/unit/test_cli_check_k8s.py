"""`kvtune check` reads the Kubernetes manifests `recommend --out` wrote (kvtune.deploy.k8s_read):
a hand-edited Deployment or ConfigMap is judged as the same edit in vllm-serve.sh or gateway.yaml
would be, and each finding names the file, the document and the field to fix."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from kvtune.cli import cli

REPO = Path(__file__).resolve().parents[2]
LOGS = str(REPO / "sample_logs")
H100 = ["--model", "llama-3.1-8b", "--gpu", "H100-80GB"]
ENGINE_DOC = "Deployment/kvtune-vllm: containers[0].args"
GATEWAY_DOC = "ConfigMap/kvtune-gateway: data[gateway.yaml]"


@pytest.fixture(scope="module")
def rendered(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("deploy")
    made = CliRunner().invoke(cli, ["recommend", LOGS, *H100, "--out", str(out)], catch_exceptions=False)
    assert made.exit_code == 0, made.output
    return out


def check(rendered: Path, *deployed: Path, json_: bool = False):
    args = ["check", str(rendered / "recommendation.json")]
    for path in deployed:
        args += ["--deployed", str(path)]
    return CliRunner().invoke(cli, [*args, *(["--json"] if json_ else [])], catch_exceptions=False)


def copy(rendered: Path, tmp_path: Path, name: str) -> Path:
    target = tmp_path / "k8s" / name
    target.parent.mkdir(exist_ok=True)
    target.write_text((rendered / "k8s" / name).read_text())
    return target


def edit_arg(path: Path, flag: str, value: str) -> None:
    """Change a flag's value in the Deployment's args by hand: the line after the flag's."""
    text, n = re.subn(rf'(- "{flag}"\n\s+- )"[^"]*"', rf'\1"{value}"', path.read_text())
    assert n == 1, flag
    path.write_text(text)


def edit_documents(path: Path, change) -> None:
    docs = list(yaml.safe_load_all(path.read_text()))
    for doc in docs:
        change(doc)
    path.write_text(yaml.safe_dump_all(docs, sort_keys=False))


def test_the_rendered_manifests_pass(rendered):
    result = check(rendered, rendered / "k8s" / "vllm.yaml", rendered / "k8s" / "gateway.yaml")
    assert result.exit_code == 0, result.output
    assert "0 risk, 0 warning(s)" in result.output


def test_utilization_lowered_in_the_deployment_fails_naming_file_document_and_field(rendered, tmp_path):
    """The issue's example: --gpu-memory-utilization changed in the Deployment's args."""
    vllm = copy(rendered, tmp_path, "vllm.yaml")
    edit_arg(vllm, "--gpu-memory-utilization", "0.80")
    result = check(rendered, vllm, rendered / "k8s" / "gateway.yaml")
    assert result.exit_code == 1, result.output
    lines = result.output.splitlines()
    risk = next(line for line in lines if line.startswith("RISK pool-below-budget"))
    assert f"[{rendered / 'k8s' / 'gateway.yaml'}: {GATEWAY_DOC}]" in risk
    assert f"the KV pool {vllm}: {ENGINE_DOC}'s flags leave: 20,692 blocks" in risk
    assert "shrunk by gpu_memory_utilization 0.8 (at the recommended 0.92" in risk
    drift = next(line for line in lines if line.startswith("WARN drift"))
    assert drift.endswith(f"[{vllm}: {ENGINE_DOC}]: gpu_memory_utilization: deployed 0.8, recommended 0.92")


def test_max_num_seqs_raised(rendered, tmp_path):
    """Alone, the Deployment's --max-num-seqs raised is vLLM preempting (a risk, naming the document
    though only one file is checked); behind the gateway's ConfigMap, the pool it leaves (the
    profile's sampler sorts more logits) is below the ConfigMap's budget, and it drifted."""
    vllm = copy(rendered, tmp_path, "vllm.yaml")
    edit_arg(vllm, "--max-num-seqs", "4096")
    alone = check(rendered, vllm)
    assert alone.exit_code == 1, alone.output
    risk = next(line for line in alone.output.splitlines() if line.startswith("RISK preemption-risk"))
    assert f"[{vllm}: {ENGINE_DOC}]: max_num_seqs 4096 × " in risk
    behind = check(rendered, vllm, rendered / "k8s" / "gateway.yaml")
    assert behind.exit_code == 1, behind.output
    assert "shrunk by max_num_seqs 4096 (at the recommended 1752: 25,585 blocks)" in behind.output
    drift = next(line for line in behind.output.splitlines() if line.startswith("WARN drift"))
    assert drift.endswith(f"[{vllm}: {ENGINE_DOC}]: max_num_seqs: deployed 4096, recommended 1752")


def test_max_model_len_lowered_below_the_logged_prompts(rendered, tmp_path):
    vllm = copy(rendered, tmp_path, "vllm.yaml")
    edit_arg(vllm, "--max-model-len", "8192")
    result = check(rendered, vllm, rendered / "k8s" / "gateway.yaml", json_=True)
    assert result.exit_code == 1, result.output
    risk = next(f for f in json.loads(result.output)["findings"] if f["code"] == "max-model-len-rejects")
    assert risk["source"] == f"{vllm}: {ENGINE_DOC}"
    assert risk["message"].startswith("max_model_len 8192 rejects the longest logged prompts")


def test_a_configmap_budget_past_the_pool(rendered, tmp_path):
    gateway = copy(rendered, tmp_path, "gateway.yaml")
    budget = json.loads((rendered / "recommendation.json").read_text())["block_budget"]["value"]
    text = gateway.read_text()
    assert text.count(f"    block_budget: {budget}\n") == 1
    gateway.write_text(text.replace(f"    block_budget: {budget}\n", "    block_budget: 40000\n"))
    result = check(rendered, rendered / "k8s" / "vllm.yaml", gateway, json_=True)
    assert result.exit_code == 1, result.output
    risk = next(f for f in json.loads(result.output)["findings"] if f["code"] == "pool-below-budget")
    assert risk["source"] == f"{gateway}: {GATEWAY_DOC}"
    assert risk["message"].startswith("block budget 40000 × 16 tokens = 640,000 tokens exceeds the KV pool")


def test_a_gpu_count_other_than_tp_times_pp(rendered, tmp_path):
    vllm = copy(rendered, tmp_path, "vllm.yaml")

    def two_gpus(doc: dict) -> None:
        if doc["kind"] == "Deployment":
            doc["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] = 2

    edit_documents(vllm, two_gpus)
    result = check(rendered, vllm, rendered / "k8s" / "gateway.yaml")
    assert result.exit_code == 1, result.output
    risk = next(line for line in result.output.splitlines() if line.startswith("RISK gpu-count-mismatch"))
    assert risk.endswith(f"[{vllm}: {ENGINE_DOC}]: resources.limits[nvidia.com/gpu] 2, but tensor_parallel_size 1 x "
                         "pipeline_parallel_size 1 needs 1 GPUs")


def test_several_gpus_without_a_memory_dev_shm(tmp_path):
    out = tmp_path / "deploy"
    made = CliRunner().invoke(cli, ["recommend", LOGS, *H100, "--tp", "2", "--out", str(out)])
    assert made.exit_code == 0, made.output
    vllm = out / "k8s" / "vllm.yaml"
    assert check(out, vllm).output.count("no-shm") == 0

    def no_shm(doc: dict) -> None:
        if doc["kind"] == "Deployment":
            spec = doc["spec"]["template"]["spec"]
            spec.pop("volumes")
            spec["containers"][0].pop("volumeMounts")

    edit_documents(vllm, no_shm)
    result = check(out, vllm)
    assert f"WARN no-shm [{vllm}: {ENGINE_DOC}]: /dev/shm is not a memory emptyDir, and 2 GPUs" in result.output


@pytest.mark.parametrize(("change", "error"), [
    (lambda d: d["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"].update({"nvidia.com/gpu": "two"}),
     "Deployment/kvtune-vllm: containers[0]: resources.limits[nvidia.com/gpu]: expected a whole number of GPUs, "
     "got 'two'"),
    (lambda d: d["spec"]["template"]["spec"]["containers"][0]["args"].extend(["--max-num-seqs", "many"]),
     "Deployment/kvtune-vllm: containers[0].args: --max-num-seqs: expected an integer, got 'many'"),
])
def test_a_bad_value_is_one_error_line(rendered, tmp_path, change, error):
    vllm = copy(rendered, tmp_path, "vllm.yaml")
    edit_documents(vllm, lambda d: change(d) if d["kind"] == "Deployment" else None)
    result = check(rendered, vllm)
    assert result.exit_code == 2, result.output
    assert result.output.strip().splitlines()[-1] == f"Error: {vllm}: {error}"


def test_files_holding_no_engine_or_more_than_one(rendered, tmp_path):
    both = tmp_path / "both.yaml"
    both.write_text((rendered / "k8s" / "vllm.yaml").read_text() + "---\n" + (rendered / "k8s" / "gateway.yaml").read_text())
    result = check(rendered, both)
    assert result.exit_code == 2
    assert "2 engines or gateways in one file" in result.output
    service = tmp_path / "service.yaml"
    service.write_text(yaml.safe_dump(list(yaml.safe_load_all((rendered / "k8s" / "vllm.yaml").read_text()))[1]))
    result = check(rendered, service)
    assert result.exit_code == 2
    assert "no vLLM Deployment and no ConfigMap holding gateway.yaml" in result.output


def _container(d: dict) -> dict:
    return d["spec"]["template"]["spec"]["containers"][0]


@pytest.mark.parametrize("change", [
    lambda d: _container(d).update(env=5),
    lambda d: _container(d).update(volumeMounts=7),
    lambda d: d["spec"]["template"]["spec"].update(volumes="x"),
    lambda d: d["spec"]["template"]["spec"].update(containers={}),
    lambda d: d.update(spec=[]),
    lambda d: _container(d).update(args=[True]),
    lambda d: _container(d).update(command=None),
    lambda d: _container(d)["resources"]["limits"].update({"nvidia.com/gpu": -1}),
    lambda d: d.update(kind=5),
])
def test_hostile_manifests_are_an_error_line_or_a_verdict_never_a_traceback(rendered, tmp_path, change):
    vllm = copy(rendered, tmp_path, "vllm.yaml")
    edit_documents(vllm, lambda d: change(d) if d.get("kind") == "Deployment" else None)
    result = CliRunner().invoke(cli, ["check", str(rendered / "recommendation.json"), "--deployed", str(vllm)])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.output
    assert result.exit_code in (0, 1, 2), result.output
    if result.exit_code == 2:
        assert result.output.startswith(f"Error: {vllm}"), result.output


def test_yaml_anchors_are_refused_as_in_every_file_kvtune_reads(rendered, tmp_path):
    vllm = copy(rendered, tmp_path, "vllm.yaml")
    text = vllm.read_text().replace("  labels: {", "  labels: &labels {", 1)
    vllm.write_text(text.replace("    matchLabels: {", "    matchLabels: *labels\n    x: {", 1))
    result = check(rendered, vllm)
    assert result.exit_code == 2
    assert result.output.startswith(f"Error: {vllm}:") and "unsupported YAML" in result.output


def test_a_deployment_written_as_vllms_own_guide_writes_it(rendered, tmp_path):
    """vLLM's Kubernetes guide runs `command: ["/bin/sh", "-c"]` with the whole `vllm serve …` line as
    one arg: read as that script."""
    vllm = copy(rendered, tmp_path, "vllm.yaml")

    def as_a_shell_line(doc: dict) -> None:
        if doc["kind"] == "Deployment":
            c = doc["spec"]["template"]["spec"]["containers"][0]
            args = [a.replace("0.92", "0.80") for a in c["args"]]
            c["command"], c["args"] = ["/bin/sh", "-c"], ["vllm serve " + " ".join(map(shlex.quote, args))]

    edit_documents(vllm, as_a_shell_line)
    result = check(rendered, vllm, rendered / "k8s" / "gateway.yaml")
    assert result.exit_code == 1, result.output
    assert "shrunk by gpu_memory_utilization 0.8 (at the recommended 0.92" in result.output


@pytest.mark.parametrize(("pods", "message"), [
    (3, "spec.replicas 3: 3 vLLM pods behind one Service, which the gateway sees as one upstream"),
    (0, "spec.replicas 0: no vLLM pod runs"),
])
def test_a_scaled_engine_deployment_is_one_upstream(rendered, tmp_path, pods, message):
    vllm = copy(rendered, tmp_path, "vllm.yaml")
    edit_documents(vllm, lambda d: d["spec"].update(replicas=pods) if d["kind"] == "Deployment" else None)
    result = check(rendered, vllm, rendered / "k8s" / "gateway.yaml")
    assert f"WARN pods-share-one-upstream [{vllm}: {ENGINE_DOC}]: {message}" in result.output
