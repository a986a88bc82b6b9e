"""Kubernetes manifests read back for `kvtune check`: a vLLM Deployment's container (its command
and args read by the vLLM launch module, as vllm-serve.sh is, its GPUs and environment), or the
ConfigMap holding a gateway.yaml (read as gateway.yaml is). Each becomes one
kvtune.deploy.deployed.Deployed whose source names the file and the document
(`k8s/vllm.yaml: Deployment/kvtune-vllm`), so a finding says where to edit.
"""

from __future__ import annotations

import dataclasses
import re
import shlex
from typing import Any

from kvtune.deploy.command_line import MAX_INTEGER
from kvtune.deploy.deployed import Deployed
from kvtune.deploy.launch import vllm as vllm_launch
from kvtune.deploy.markers import K8S_GATEWAY_CONFIG_KEY as GATEWAY_CONFIG_KEY
from kvtune.deploy.markers import K8S_GPU_RESOURCE as GPU_RESOURCE
from kvtune.errors import InputError
from kvtune.userfiles import brief, parse_yaml_documents

_KIND = re.compile(r"^kind:\s*\S", re.M)
_API_VERSION = re.compile(r"^apiVersion:\s*\S", re.M)


def looks_like_manifests(text: str) -> bool:
    """Kubernetes YAML: a document with apiVersion and kind at its top level."""
    return bool(_KIND.search(text) and _API_VERSION.search(text))


def _documents(text: str, source: str) -> list[dict]:
    """The stream's documents, read strictly (kvtune.userfiles: no anchors, aliases or YAML 1.1
    numbers); empty ones (a trailing `---`) skipped."""
    docs = [d for d in parse_yaml_documents(text, path=source) if d is not None]
    for i, doc in enumerate(docs):
        if not isinstance(doc, dict) or not isinstance(doc.get("kind"), str):
            raise InputError("expected a Kubernetes object with a kind", path=source, field=f"document {i + 1}")
    return docs


def _list(value: Any) -> list:
    """A field that should be a list, or [] (what the schema would refuse is not kvtune's to judge)."""
    return value if isinstance(value, list) else []


def _name(doc: dict) -> str:
    meta = doc.get("metadata")
    name = meta.get("name") if isinstance(meta, dict) else None
    return f"{doc['kind']}/{name if isinstance(name, str) else '?'}"


def _containers(doc: dict, where: str, source: str) -> list[dict]:
    spec: Any = doc
    for key in ("spec", "template", "spec"):
        spec = spec.get(key) if isinstance(spec, dict) else None
    containers = spec.get("containers") if isinstance(spec, dict) else None
    if not isinstance(containers, list) or not all(isinstance(c, dict) for c in containers):
        raise InputError("expected a list of containers", path=source, field=f"{where}: spec.template.spec.containers")
    return containers


def _words(container: dict, where: str, source: str) -> list[str]:
    words = []
    for key in ("command", "args"):
        value = container.get(key, [])
        if not isinstance(value, list) or not all(isinstance(w, str | int | float) and not isinstance(w, bool)
                                                  for w in value):
            raise InputError("expected a list of strings", path=source, field=f"{where}: {key}")
        words += [str(w) for w in value]
    if not container.get("command") and isinstance(container.get("image"), str):
        words.insert(0, container["image"])  # the image's entrypoint (vllm/vllm-openai: vllm serve)
    return words


def _gpus(container: dict, where: str, source: str) -> int | None:
    resources = container.get("resources")
    limits = resources.get("limits") if isinstance(resources, dict) else None
    value = limits.get(GPU_RESOURCE) if isinstance(limits, dict) else None
    if value is None:
        return None
    field = f"{where}: resources.limits[{GPU_RESOURCE}]"
    if isinstance(value, bool) or not re.fullmatch(r"\d{1,16}", str(value).strip()):
        raise InputError(f"expected a whole number of GPUs, got {brief(value)}", path=source, field=field)
    count = int(str(value))
    if count > MAX_INTEGER:
        raise InputError(f"must be at most {MAX_INTEGER}, got {count}", path=source, field=field)
    return count


def _pods(doc: dict, source: str) -> int:
    """spec.replicas (1 when unset, as Kubernetes reads it)."""
    value = doc["spec"].get("replicas", 1)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_INTEGER:
        raise InputError(f"expected a whole number of pods, got {brief(value)}", path=source,
                         field=f"{_name(doc)}: spec.replicas")
    return value


def _env(container: dict) -> dict[str, str]:
    out = {}
    for item in _list(container.get("env")):
        if isinstance(item, dict) and isinstance(item.get("name"), str) and isinstance(item.get("value"), str):
            out[item["name"]] = item["value"]
    return out


def _shm_mounted(doc: dict, container: dict) -> bool:
    """Whether /dev/shm is a memory emptyDir (what NCCL between the pod's GPUs needs)."""
    spec = doc["spec"]["template"]["spec"]  # _containers found the containers there
    memory = {v.get("name") for v in _list(spec.get("volumes")) if isinstance(v, dict)
              and isinstance(v.get("emptyDir"), dict) and v["emptyDir"].get("medium") == "Memory"}
    return any(isinstance(m, dict) and m.get("mountPath") == "/dev/shm" and m.get("name") in memory
               for m in _list(container.get("volumeMounts")))


def _engine(doc: dict, source: str) -> Deployed | None:
    """The vLLM container of a Deployment (StatefulSet, Pod template), or None when it runs none."""
    where = f"{source}: {_name(doc)}"
    found = []
    for i, container in enumerate(_containers(doc, where, source)):
        here = f"{_name(doc)}: containers[{i}]"
        words = _words(container, here, source)
        # `command: ["/bin/sh", "-c"]`, `args: ["vllm serve MODEL ..."]` (vLLM's own Kubernetes guide): the script
        text = words[2] if len(words) == 3 and words[1] == "-c" and words[0].rsplit("/", 1)[-1] in _SHELLS \
            else shlex.join(words)
        if vllm_launch.recognise(text, source):
            found.append((container, here, text))
    if not found:
        return None
    if len(found) > 1:
        raise InputError("more than one vLLM container in one Deployment: kvtune checks one engine per document",
                         path=source, field=_name(doc))
    container, here, text = found[0]
    read = vllm_launch.read(text, f"{source}: {here}.args")
    return dataclasses.replace(read, gpus=_gpus(container, here, source), env=_env(container),
                               shm_mounted=_shm_mounted(doc, container), pods=_pods(doc, source))


def _gateway(doc: dict, source: str, parse_gateway: Any) -> Deployed | None:
    data = doc.get("data")
    if not isinstance(data, dict) or GATEWAY_CONFIG_KEY not in data:
        return None
    where = f"{source}: {_name(doc)}: data[{GATEWAY_CONFIG_KEY}]"
    text = data[GATEWAY_CONFIG_KEY]
    if not isinstance(text, str):
        raise InputError("expected gateway.yaml's text", path=source, field=f"{_name(doc)}: data[{GATEWAY_CONFIG_KEY}]")
    return parse_gateway(text, where)


_SHELLS = ("sh", "bash", "dash")
_WORKLOADS = ("Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job")


def read_manifests(text: str, source: str, parse_gateway: Any) -> Deployed:
    """The one engine or gateway a manifest file holds: a vLLM container in a workload, or a
    ConfigMap with gateway.yaml (`parse_gateway(text, source)` reads it). Another engine's
    Deployment or both in one file: an InputError saying to pass each on its own."""
    found = []
    for doc in _documents(text, source):
        if doc["kind"] in _WORKLOADS:
            engine = _engine(doc, source)
            if engine is not None:
                found.append(engine)
        elif doc["kind"] == "ConfigMap":
            gateway = _gateway(doc, source, parse_gateway)
            if gateway is not None:
                found.append(gateway)
    if not found:
        raise InputError("no vLLM Deployment and no ConfigMap holding gateway.yaml in these Kubernetes manifests",
                         path=source)
    if len(found) > 1:
        raise InputError(f"{len(found)} engines or gateways in one file ({', '.join(d.source for d in found)}): "
                         "give each document its own file and repeat --deployed", path=source)
    return found[0]


__all__ = ["looks_like_manifests", "read_manifests"]
