"""`recommend --out` renders k8s/ (kvtune.deploy.k8s): every document valid against the Kubernetes
API schemas (kubernetes-validate bundles them offline; the version is pinned below), the vLLM
container's args exactly vllm-serve.sh's (the one flag builder) but --host 0.0.0.0, GPUs
tp × pp, /health probes, a memory /dev/shm, the gateway's ConfigMap holding the rendered
gateway.yaml with each upstream its engine's Service, and the Redis ledger for several gateway
replicas."""

from __future__ import annotations

import copy
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from click.testing import CliRunner

from kvtune.cli import cli
from kvtune.deploy.launch.vllm import command_args
from kvtune.gateway.config import LedgerBackend, parse_gateway_config

REPO = Path(__file__).resolve().parents[2]
LOGS = str(REPO / "sample_logs")
# The Kubernetes release the manifests are held to (the oldest still supported upstream when written).
KUBERNETES_VERSION = "1.33.0"


def recommend(out: Path, *args: str) -> Path:
    made = CliRunner().invoke(cli, ["recommend", LOGS, "--out", str(out), *args], catch_exceptions=False)
    assert made.exit_code == 0, made.output
    return out


def documents(path: Path) -> list[dict]:
    return list(yaml.safe_load_all(path.read_text()))


def by_kind(path: Path, kind: str) -> dict:
    return next(d for d in documents(path) if d["kind"] == kind)


def container(doc: dict) -> dict:
    return doc["spec"]["template"]["spec"]["containers"][0]


@pytest.fixture(scope="module")
def one(tmp_path_factory) -> Path:
    return recommend(tmp_path_factory.mktemp("one"), "--model", "llama-3.1-8b", "--gpu", "H100-80GB")


@pytest.fixture(scope="module")
def scaled(tmp_path_factory) -> Path:
    """Two engine replicas at TP 4, three gateway replicas."""
    return recommend(tmp_path_factory.mktemp("scaled"), "--model", "llama-3.1-8b", "--gpu", "H100-80GB", "--tp", "4",
                     "--replicas", "2", "--gateway-replicas", "3")


def test_every_document_validates_against_the_kubernetes_schemas(one, scaled):
    names = {p.relative_to(d).as_posix() for d in (one, scaled) for p in (d / "k8s").iterdir()}
    assert names == {"k8s/vllm.yaml", "k8s/gateway.yaml", "k8s/vllm-0.yaml", "k8s/vllm-1.yaml", "k8s/redis.yaml"}
    kinds = []
    for folder in (one, scaled):
        for path in sorted((folder / "k8s").iterdir()):
            for doc in documents(path):
                kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
                kinds.append(doc["kind"])
    assert kinds.count("Deployment") == 2 + 4 and kinds.count("Service") == 6 and kinds.count("ConfigMap") == 2


def test_the_schema_check_fails_on_a_broken_document(one):
    """The validation above can fail: a misspelt field or a GPU count that is no quantity is refused."""
    deployment = by_kind(one / "k8s" / "vllm.yaml", "Deployment")
    misspelt = copy.deepcopy(deployment)
    container(misspelt)["resource"] = container(misspelt).pop("resources")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(misspelt, KUBERNETES_VERSION, strict=True)
    gpus = copy.deepcopy(deployment)
    container(gpus)["resources"]["limits"]["nvidia.com/gpu"] = ["two"]
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(gpus, KUBERNETES_VERSION, strict=True)


def test_the_container_runs_vllm_serve_sh_args_listening_on_the_pod(one):
    """The same flags in the same order as vllm-serve.sh's `vllm serve` line, --host 0.0.0.0."""
    script = command_args((one / "vllm-serve.sh").read_text(), "vllm-serve.sh")
    assert script is not None and script[0] == "<serve>" and script[-1] == "$@"
    expected = script[1:-1]
    expected[expected.index("--host") + 1] = "0.0.0.0"
    vllm = container(by_kind(one / "k8s" / "vllm.yaml", "Deployment"))
    assert vllm["command"] == ["vllm", "serve"]
    assert vllm["args"] == expected
    assert vllm["image"] == "vllm/vllm-openai:v0.33.0"  # vLLM's tags: v0.11.0, v0.8.5
    assert vllm["ports"] == [{"name": "http", "containerPort": 8000}]


def test_gpus_probes_and_shared_memory(one, scaled):
    small = by_kind(one / "k8s" / "vllm.yaml", "Deployment")
    large = by_kind(scaled / "k8s" / "vllm-1.yaml", "Deployment")
    assert container(small)["resources"] == {"limits": {"nvidia.com/gpu": 1}}
    assert container(large)["resources"] == {"limits": {"nvidia.com/gpu": 4}}  # --tp 4
    for doc, shm in ((small, "2Gi"), (large, "4Gi")):
        c = container(doc)
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert c[probe]["httpGet"] == {"path": "/health", "port": "http"}
        assert {"name": "dshm", "mountPath": "/dev/shm"} in c["volumeMounts"]
        assert {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": shm}} in \
            doc["spec"]["template"]["spec"]["volumes"]
    # the start-up allowance: 600 s and 60 s a 10 GiB of weights (Llama-3.1-8B: 15 GiB)
    assert container(small)["startupProbe"]["failureThreshold"] * container(small)["startupProbe"]["periodSeconds"] \
        == 720
    env = container(small)["env"]
    assert env == [{"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf-token", "key": "token",
                                                                         "optional": True}}}]


def test_the_configmap_holds_the_rendered_gateway_yaml_pointed_at_the_services(one):
    rendered = yaml.safe_load((one / "gateway.yaml").read_text())
    config_map = by_kind(one / "k8s" / "gateway.yaml", "ConfigMap")
    in_pod = yaml.safe_load(config_map["data"]["gateway.yaml"])
    assert in_pod["upstream"] == "http://kvtune-vllm:8000" and in_pod["listen"]["host"] == "0.0.0.0"
    for key in ("upstream", "listen"):
        rendered.pop(key), in_pod.pop(key)
    assert in_pod == rendered  # budget, routes, caps, admission, limits: the same file
    gateway = container(by_kind(one / "k8s" / "gateway.yaml", "Deployment"))
    assert gateway["command"] == ["kvtune", "gateway", "--config", "/etc/kvtune/gateway.yaml"]
    assert gateway["readinessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    assert by_kind(one / "k8s" / "gateway.yaml", "Service")["spec"]["ports"][0]["port"] == 8080
    assert not (one / "k8s" / "redis.yaml").exists()  # one gateway replica: its ledger is in memory


def test_replicas_get_a_service_each_and_gateways_share_redis(scaled):
    config = by_kind(scaled / "k8s" / "gateway.yaml", "ConfigMap")["data"]["gateway.yaml"]
    parsed = parse_gateway_config(yaml.safe_load(config), path="k8s/gateway.yaml")
    assert [u.url for u in parsed.upstreams] == ["http://kvtune-vllm-0:8000", "http://kvtune-vllm-1:8000"]
    rendered = parse_gateway_config(yaml.safe_load((scaled / "gateway.yaml").read_text()), path="gateway.yaml")
    assert [u.block_budget for u in parsed.upstreams] == [u.block_budget for u in rendered.upstreams]
    assert parsed.ledger.backend is LedgerBackend.REDIS and parsed.ledger.url == "redis://kvtune-redis:6379/0"
    assert by_kind(scaled / "k8s" / "gateway.yaml", "Deployment")["spec"]["replicas"] == 3
    for i in (0, 1):
        assert by_kind(scaled / "k8s" / f"vllm-{i}.yaml", "Service")["metadata"]["name"] == f"kvtune-vllm-{i}"
    redis = by_kind(scaled / "k8s" / "redis.yaml", "Deployment")
    assert container(redis)["args"][:2] == ["--appendonly", "yes"]
    assert by_kind(scaled / "k8s" / "redis.yaml", "Service")["spec"]["ports"][0]["port"] == 6379


def test_other_engines_get_no_manifests(tmp_path):
    out = recommend(tmp_path, "--model", "llama-3.1-8b", "--gpu", "H100-80GB", "--engine", "sglang")
    assert not (out / "k8s").exists() and (out / "estimates.json").is_file()
    refused = CliRunner().invoke(cli, ["recommend", LOGS, "--model", "llama-3.1-8b", "--gpu", "H100-80GB", "--engine",
                                       "sglang", "--gateway-replicas", "2", "--out", str(tmp_path / "refused")])
    assert refused.exit_code == 2 and not (tmp_path / "refused").exists()
    assert refused.output.strip() == ("Error: --gateway-replicas: only a vLLM recommendation is rendered as "
                                      "Kubernetes manifests, whose gateway Deployment this sizes")


def test_recommend_gates_the_manifests_it_renders(tmp_path):
    """recommend's own check (check_rendered) reads the manifests back: a rendered Deployment whose
    args drifted from the recommendation would be refused, not written."""
    import kvtune
    from kvtune.deploy.check import check_rendered

    out = recommend(tmp_path, "--model", "llama-3.1-8b", "--gpu", "H100-80GB")
    rec = kvtune.load_recommendation(out / "recommendation.json")
    files = kvtune.render(rec, check=False)
    assert check_rendered(files, rec).passed
    files["k8s/vllm.yaml"] = files["k8s/vllm.yaml"].replace('- "--max-num-seqs"\n            - "1752"',
                                                            '- "--max-num-seqs"\n            - "999"')
    result = check_rendered(files, rec)
    assert not result.passed
    assert [(f.code, f.source) for f in result.findings] == [
        ("drift", "k8s/vllm.yaml: Deployment/kvtune-vllm: containers[0].args")]


def test_measured_replicas_keep_their_own_budgets_and_limits(tmp_path):
    """--capacity per replica: each Deployment's args end with its own engine limits (vllm-serve.sh's
    header lists them; the last of a repeated flag wins), and the ConfigMap keeps each budget."""
    import json

    files = []
    for name, blocks in (("a.json", 2000), ("b.json", 3001)):
        path = tmp_path / name
        path.write_text(json.dumps({"source": "metrics", "num_blocks": blocks, "block_size": 16,
                                    "kv_cache_tokens": blocks * 16, "max_model_len": 8192}))
        files += ["--capacity", str(path)]
    logs = REPO / "tests" / "data" / "logs" / "kvtune.jsonl"  # prompts that fit the replicas' 8,192-token context
    made = CliRunner().invoke(cli, ["recommend", str(logs), "--model", "llama-3.1-8b", "--gpu", "H100-80GB", *files,
                                    "--out", str(tmp_path / "deploy")], catch_exceptions=False)
    assert made.exit_code == 0, made.output
    out = tmp_path / "deploy"
    config = yaml.safe_load(by_kind(out / "k8s" / "gateway.yaml", "ConfigMap")["data"]["gateway.yaml"])
    assert config["upstreams"] == [{"url": "http://kvtune-vllm-0:8000", "block_budget": 1799},
                                   {"url": "http://kvtune-vllm-1:8000", "block_budget": 2700}]
    header = [line for line in (out / "vllm-serve.sh").read_text().splitlines() if "./vllm-serve.sh --host" in line]
    owns = [line.split("./vllm-serve.sh ", 1)[1].split()[4:] for line in header]  # after --host H --port P
    assert owns == [[], ["--max-num-seqs", "32"]]  # the larger replica runs more sequences
    for i, own in enumerate(owns):
        args = container(by_kind(out / "k8s" / f"vllm-{i}.yaml", "Deployment"))["args"]
        assert args[len(args) - len(own):] == own and args[len(args) - len(own) - 2] == "--override-generation-config"
        for doc in documents(out / "k8s" / f"vllm-{i}.yaml"):
            kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_a_manifest_an_earlier_run_left_is_refused_not_left_behind(tmp_path):
    """--replicas 2 wrote k8s/vllm-0.yaml and vllm-1.yaml; one replica next into the same folder
    would leave them for `kubectl apply -f k8s/` to deploy: refused, nothing written."""
    args = ["recommend", LOGS, "--model", "llama-3.1-8b", "--gpu", "H100-80GB", "--out", str(tmp_path)]
    recommend(tmp_path, "--model", "llama-3.1-8b", "--gpu", "H100-80GB", "--replicas", "2")
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    again = CliRunner().invoke(cli, args)
    assert again.exit_code == 2
    assert again.output.startswith(f"Error: --out: {tmp_path / 'k8s' / 'vllm-0.yaml'} is a manifest an earlier "
                                   "recommend rendered and this one would not")
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before
    (tmp_path / "k8s" / "vllm-0.yaml").unlink()
    (tmp_path / "k8s" / "vllm-1.yaml").unlink()
    (tmp_path / "k8s" / "notes.yaml").write_text("# mine\n")  # not kvtune's: left alone
    assert CliRunner().invoke(cli, args).exit_code == 0
    assert sorted(p.name for p in (tmp_path / "k8s").iterdir()) == ["gateway.yaml", "notes.yaml", "vllm.yaml"]


def test_hostile_names_from_logs_stay_data():
    """Route names and a model id from the logs (quotes, $(…), newlines, NUL, Jinja, U+2028) reach the
    manifests only through their escaping: every document still validates, the ConfigMap's
    gateway.yaml reads back to the same routes, and the container's model is the logged one."""
    from test_render import NASTY, hostile_rec

    from kvtune.deploy.k8s import render_manifests

    rec = hostile_rec()
    files = render_manifests(rec)
    for text in files.values():
        for doc in yaml.safe_load_all(text):
            kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
    config_map = next(d for d in yaml.safe_load_all(files["k8s/gateway.yaml"]) if d["kind"] == "ConfigMap")
    config = parse_gateway_config(yaml.safe_load(config_map["data"]["gateway.yaml"]), path="k8s/gateway.yaml")
    assert [r.name for r in config.routes[:-1]] == NASTY
    deployment = next(d for d in yaml.safe_load_all(files["k8s/vllm.yaml"]) if d["kind"] == "Deployment")
    assert container(deployment)["args"][0] == rec.served_model
