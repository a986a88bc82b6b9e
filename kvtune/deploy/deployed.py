"""What is deployed, as one plain record per file: an engine's launch command (vLLM, SGLang,
TensorRT-LLM) or one of kvtune's gateway configs. `kvtune check` compares these records with a
recommendation; kvtune.deploy.read and the launch modules fill them.

Engine fields use kvtune's setting names (the recommendation's `settings`), whatever the engine
calls them: SGLang's --max-running-requests and TensorRT-LLM's --max_batch_size are both
`max_num_seqs`, so one checker judges every engine.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from kvtune.domain.admission_policy import AdmissionPolicy
from kvtune.domain.route import Route
from kvtune.gateway.config import HealthProbe


@dataclass(frozen=True, slots=True)
class DeployedUpstream:
    """One engine replica a gateway.yaml sends to, with its own budget."""

    url: str
    block_budget: int


class DeployedKind(enum.Enum):
    """What a deployed file is: an engine's command or one of the two gateways' configs."""

    VLLM = "vllm"  # a vllm serve command line or script
    SGLANG = "sglang"  # python -m sglang.launch_server, with the SGLANG_* environment it sets
    TRTLLM = "trtllm"  # trtllm-serve, with its --extra_llm_api_options YAML
    GATEWAY = "gateway"  # kvtune's gateway.yaml
    NGINX = "nginx"  # an nginx.conf kvtune rendered

    @property
    def is_engine(self) -> bool:
        return self not in (DeployedKind.GATEWAY, DeployedKind.NGINX)


@dataclass(frozen=True, slots=True)
class Deployed:
    """One deployed file. An engine fills the engine fields, a gateway the admission ones;
    None means the file does not set it (the engine's default applies)."""

    kind: DeployedKind
    source: str
    model: str | None = None
    block_size: int | None = None  # vLLM --block-size, SGLang --page-size, TensorRT-LLM tokens_per_block
    max_model_len: int | None = None
    # the engine
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    tensor_parallel_size: int | None = None
    pipeline_parallel_size: int | None = None
    kv_cache_dtype: str | None = None
    gpu_memory_utilization: float | None = None  # the engine's memory fraction, in its own sense
    kv_cache_memory_bytes: int | None = None
    kv_cache_tokens: int | None = None  # SGLang --max-total-tokens, TensorRT-LLM kv_cache_config.max_tokens
    max_new_tokens: int | None = None  # the server-wide output cap (vLLM's override, SGLang's limit)
    preemption_mode: str | None = None
    swap_space: float | None = None
    num_gpu_blocks_override: int | None = None
    flags: dict[str, Any] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)  # environment the script sets for the engine
    options: dict[str, Any] = field(default_factory=dict)  # engine settings beyond flags (TensorRT-LLM YAML)
    # a Kubernetes container (kvtune.deploy.k8s_read): the GPUs it asks for (resources.limits
    # nvidia.com/gpu), whether /dev/shm is a memory emptyDir, and how many pods run it; None: not
    # read from a manifest
    gpus: int | None = None
    shm_mounted: bool | None = None
    pods: int | None = None  # the workload's spec.replicas: pods behind one Service, one upstream
    # gateway / nginx
    upstream: str | None = None
    # one engine's budget: with several upstreams, the largest (what the simulator runs)
    block_budget: int | None = None
    # nginx.conf rendered with --nginx-replicas M: block_budget is one nginx's slice, M of them
    # stand in front of the engine (kvtune.deploy.slices)
    gateway_replicas: int = 1
    upstreams: tuple[DeployedUpstream, ...] = ()  # gateway.yaml's, each with its budget (one or more)
    routes: tuple[Route, ...] = ()
    admission: AdmissionPolicy | None = None  # the gateway's admission policy
    queue_max_waiting: int | None = None  # gateway.yaml's wait queue (nginx.conf has none)
    queue_timeout_s: float | None = None
    # how a gateway with several upstreams takes one out (probe and passive health); None: one upstream
    health: HealthProbe | None = None

    @property
    def is_gateway(self) -> bool:
        return not self.kind.is_engine

    @property
    def is_engine(self) -> bool:
        return self.kind.is_engine

    def route_for(self, path: str | None, model: str | None,
                  headers: Mapping[str, str] | None = None) -> Route | None:
        return next((r for r in self.routes if r.matches(path, model, headers)), None)

    def to_dict(self) -> dict:
        data = asdict(self)
        data["kind"] = self.kind.value
        # each route's output law stays out: gateway.yaml itself carries it, and it is long
        data["routes"] = [{"name": r.name, "path": r.match.path, "model": r.match.model,
                           "max_new_tokens": r.max_new_tokens, "path_prefix": r.match.path_prefix,
                           "header": r.match.header, "value": r.match.value} for r in self.routes]
        data["admission"] = None if self.admission is None else self.admission.to_dict()
        return data


__all__ = ["Deployed", "DeployedKind", "DeployedUpstream"]
