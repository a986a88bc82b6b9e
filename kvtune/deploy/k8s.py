"""Kubernetes manifests from a recommendation: what `recommend --out` writes into k8s/.

    k8s/vllm.yaml      the vLLM Deployment and its Service (k8s/vllm-0.yaml, vllm-1.yaml, ... for
                       several engine replicas: the gateway keeps one budget per engine, so each
                       is its own Deployment with one pod and its own Service)
    k8s/gateway.yaml   kvtune's gateway: a ConfigMap holding gateway.yaml, a Deployment, a Service
    k8s/redis.yaml     with several gateway replicas, the Redis ledger they share (appendonly)

The container's args are vllm-serve.sh's, from the one flag builder (kvtune.deploy.launch.vllm),
with --host 0.0.0.0 so the Service reaches the pod; the ConfigMap's gateway.yaml is the
rendered gateway.yaml with each upstream the Service of its engine. Only vLLM is rendered: the
other engines' launch files stay scripts. Read back by kvtune.deploy.k8s_read.
"""

from __future__ import annotations

import dataclasses
import math
import os
import shlex
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from kvtune.deploy.filters import yaml_scalar
from kvtune.deploy.launch import Line
from kvtune.deploy.launch import vllm as vllm_launch
from kvtune.deploy.markers import K8S_FOLDER, K8S_GATEWAY_CONFIG_KEY, K8S_GATEWAY_FILE, K8S_GPU_RESOURCE
from kvtune.deploy.render import RenderOptions, make_environment, render_gateway_yaml
from kvtune.endpoint import parse_url
from kvtune.errors import OptionError
from kvtune.version import __version__

if TYPE_CHECKING:
    from kvtune.domain.recommendation import Recommendation

FOLDER = K8S_FOLDER
GATEWAY_FILE = K8S_GATEWAY_FILE
REDIS_FILE = f"{FOLDER}/redis.yaml"
GATEWAY_CONFIG_KEY = K8S_GATEWAY_CONFIG_KEY  # the ConfigMap's data key, mounted at /etc/kvtune/gateway.yaml
GPU_RESOURCE = K8S_GPU_RESOURCE
REDIS_URL = "redis://kvtune-redis:6379/0"
#: The most gateway replicas the Deployment runs.
MAX_GATEWAY_REPLICAS = 64

# /dev/shm: NCCL (tensor and pipeline parallel between the pod's GPUs) and vLLM's worker
# processes exchange through shared memory; a container's default /dev/shm is 64 MiB, too small.
SHM_PER_GPU_GIB = 1
SHM_MIN_GIB = 2
# The startup probe's allowance: 10 minutes, plus a minute per 10 GiB of weights to read.
STARTUP_BASE_S = 600
STARTUP_PER_10_GIB_S = 60
STARTUP_PERIOD_S = 10


@dataclass(frozen=True, slots=True)
class K8sOptions:
    """What the manifests need that a recommendation does not know: the namespace (None: the
    one kubectl applies to), the images, and how many gateway replicas run (above 1 they share
    the Redis ledger k8s/redis.yaml runs)."""

    namespace: str | None = None
    vllm_image: str | None = None  # None: vllm/vllm-openai at the recommendation's vLLM version
    gateway_image: str = f"kvtune:{__version__}"
    redis_image: str = "redis:7"
    gateway_replicas: int = 1


def vllm_files(rec: Recommendation, options: RenderOptions) -> list[str]:
    """The vLLM manifests' file names, one per engine replica."""
    replicas = max(options.replicas, len(rec.upstreams))
    return [f"{FOLDER}/vllm.yaml"] if replicas == 1 else [f"{FOLDER}/vllm-{i}.yaml" for i in range(replicas)]


def _engine_name(index: int, replicas: int) -> str:
    return "kvtune-vllm" if replicas == 1 else f"kvtune-vllm-{index}"


def _pod_flags(rec: Recommendation) -> list[Line]:
    """vllm-serve.sh's flags, listening on every interface of the pod, on the port its Service
    sends to."""
    out = []
    for line in vllm_launch.flags(rec):
        if line.name == "--host":
            line = Line("--host", "0.0.0.0", "kubernetes", "in a pod vLLM listens on every interface; its Service "
                        "reaches it")
        elif line.name == "--port":
            line = Line("--port", line.value, "kubernetes", "the port the Service sends to (the upstream's)")
        out.append(line)
    return out


def _own_flags(rec: Recommendation, index: int) -> list[Line]:
    """A measured replica's own engine limits, after the shared flags (the last one wins), as
    vllm-serve.sh's header lists them (kvtune.deploy.launch.vllm.replica_lines)."""
    lines = vllm_launch.replica_lines(rec)
    if not lines:
        return []
    words = shlex.split(lines[index]["args"])
    pairs = list(zip(words[::2], words[1::2], strict=True))
    return [Line(name, value, "replica", "its own capacity") for name, value in pairs
            if name not in ("--host", "--port")]


def vllm_image(version: str) -> str:
    """vLLM's image for a release: its tags are v0.8.5, v0.11.0, so a minor version (0.33) is
    its first release (v0.33.0)."""
    parts = version.lstrip("v").split(".")
    return f"vllm/vllm-openai:v{'.'.join(parts if len(parts) > 2 else [*parts, '0'][:3])}"


def _shm(gpus: int) -> dict[str, str]:
    size = max(SHM_MIN_GIB, SHM_PER_GPU_GIB * gpus)
    return {"size": f"{size}Gi",
            "why": f"/dev/shm as memory, {size} GiB ({SHM_PER_GPU_GIB} GiB a GPU, at least {SHM_MIN_GIB}): NCCL "
                   "between the tensor/pipeline-parallel ranks and vLLM's worker processes share memory through it, "
                   "and a container's default 64 MiB fails them"}


def _startup(weights_bytes: int | None) -> dict[str, Any]:
    gib = (weights_bytes or 0) / 2**30
    allowance = STARTUP_BASE_S + STARTUP_PER_10_GIB_S * math.ceil(gib / 10)
    return {"period_s": STARTUP_PERIOD_S, "failures": math.ceil(allowance / STARTUP_PERIOD_S),
            "why": f"/health is polled for up to {allowance} s ({STARTUP_BASE_S} s, and {STARTUP_PER_10_GIB_S} s a "
                   "10 GiB of weights) before the pod is restarted; raise failureThreshold for a cold download"}


def _literal_block(text: str, indent: int) -> str:
    """`text` as a YAML literal block scalar indented by `indent`, or a quoted scalar when a block
    would not read back as the same text."""
    pad = " " * indent
    block = "|\n" + "".join(pad + line if line else "" for line in text.splitlines(keepends=True))
    if yaml.safe_load("k: " + block) == {"k": text}:
        return block.rstrip("\n")
    return yaml_scalar(text)


def _port(rec: Recommendation) -> int:
    return parse_url(rec.upstream, field="upstream", allow_prefix=False).port


def render_manifests(rec: Recommendation, options: RenderOptions | None = None,
                     k8s: K8sOptions | None = None) -> dict[str, str]:
    """k8s/NAME.yaml -> text (multi-document YAML) for a vLLM recommendation; {} for another engine."""
    options = options or RenderOptions()
    k8s = k8s or K8sOptions()
    if rec.engine.name != vllm_launch.ENGINE:
        if k8s.gateway_replicas != 1:
            raise OptionError("only a vLLM recommendation is rendered as Kubernetes manifests, whose gateway "
                              "Deployment this sizes", field="--gateway-replicas")
        return {}
    if not 1 <= k8s.gateway_replicas <= MAX_GATEWAY_REPLICAS:
        raise OptionError(f"must be from 1 to {MAX_GATEWAY_REPLICAS}, got {k8s.gateway_replicas}",
                          field="gateway_replicas")
    env = make_environment()
    port = _port(rec)
    names = vllm_files(rec, options)
    replicas = len(names)
    gpus = rec.hardware.gpus
    weights = rec.capacity.weights_bytes
    common = {
        "rec": rec, "kvtune_version": __version__, "served_model": rec.served_model or rec.model,
        "namespace": k8s.namespace, "gpus": gpus, "port": port, "flags": _pod_flags(rec),
        "vllm_image": k8s.vllm_image or vllm_image(rec.engine.version),
        "shm": _shm(gpus), "startup": _startup(weights),
        "weights_title": "an unknown size" if weights is None else f"{weights / 2**30:,.1f} GiB",
    }
    files: dict[str, str] = {}
    engines = []
    for i, name in enumerate(names):
        engine = {"name": _engine_name(i, replicas), "index": i, "replicas": replicas,
                  "own": _own_flags(rec, i), "capacity_file": rec.upstreams[i].capacity_file if rec.upstreams else "",
                  "labels": {"app.kubernetes.io/name": _engine_name(i, replicas),
                             "app.kubernetes.io/component": "engine", "app.kubernetes.io/part-of": "kvtune"}}
        engines.append(engine)
        files[name] = env.get_template("k8s-vllm.yaml.j2").render({**common, "engine": engine})
    # in a pod the gateway listens on every interface, and counts with vLLM's /tokenize (a
    # tokenizer directory on this machine is not in the pod)
    gateway_options = dataclasses.replace(options, listen_host="0.0.0.0", gateway_tokenizer=None)
    urls = [f"http://{e['name']}:{port}" for e in engines]
    config = render_gateway_yaml(rec, gateway_options, urls)
    if k8s.gateway_replicas > 1:
        config += _ledger_block(k8s.gateway_replicas)
    labels = {"app.kubernetes.io/name": "kvtune-gateway", "app.kubernetes.io/component": "gateway",
              "app.kubernetes.io/part-of": "kvtune"}
    files[GATEWAY_FILE] = env.get_template("k8s-gateway.yaml.j2").render({
        **common, "engines": engines, "labels": labels, "gateway_yaml": _literal_block(config, 4),
        "gateway_image": k8s.gateway_image, "gateway_replicas": k8s.gateway_replicas,
        "listen_port": gateway_options.listen_port})
    if k8s.gateway_replicas > 1:
        files[REDIS_FILE] = env.get_template("k8s-redis.yaml.j2").render({
            **common, "gateway_replicas": k8s.gateway_replicas, "redis_image": k8s.redis_image,
            "labels": {"app.kubernetes.io/name": "kvtune-redis", "app.kubernetes.io/component": "ledger",
                       "app.kubernetes.io/part-of": "kvtune"}})
    return files


def stale_manifests(out_dir: str | os.PathLike[str], files: Mapping[str, str]) -> list[Path]:
    """Manifests kvtune rendered into out_dir/k8s/ earlier that this set of files would leave
    behind (vllm-0.yaml after --replicas 2, then one replica; redis.yaml after one gateway
    replica): `kubectl apply -f k8s/` would deploy them beside the new ones."""
    folder = Path(out_dir) / FOLDER
    if not folder.is_dir():
        return []
    stale = []
    for path in sorted(folder.glob("*.yaml")):
        if f"{FOLDER}/{path.name}" in files or not path.is_file() or path.is_symlink():
            continue
        try:
            with path.open(encoding="utf-8") as f:
                first = f.readline()
        except (OSError, UnicodeDecodeError):
            continue
        if first.startswith("# Rendered by kvtune"):
            stale.append(path)
    return stale


def _ledger_block(gateway_replicas: int) -> str:
    """gateway.yaml's `ledger`: the Redis every gateway replica shares (k8s/redis.yaml's Service)."""
    return (f"# {gateway_replicas} gateway replicas share one ledger in Redis (k8s/redis.yaml), so together they\n"
            "# admit one budget per engine; Redis not answering: 503 + Retry-After (on_error: reject).\n"
            "ledger:\n"
            "  backend: redis\n"
            f"  url: {REDIS_URL}\n"
            "  key_prefix: kvtune\n"
            "  lease_s: 10\n"
            "  on_error: reject\n")


__all__ = ["K8sOptions", "render_manifests", "stale_manifests", "vllm_image", "vllm_files", "FOLDER", "GATEWAY_FILE",
           "REDIS_FILE", "GATEWAY_CONFIG_KEY", "GPU_RESOURCE", "MAX_GATEWAY_REPLICAS"]
