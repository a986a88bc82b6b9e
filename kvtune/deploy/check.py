"""`kvtune check`: compare what is deployed with what the traffic needs, as findings.

Pure: it takes parsed deployed files (kvtune.deploy.read) and a Recommendation and returns
findings; a cap's truncation share is the route's exact Kaplan–Meier estimate, as when the
recommendation chose it. Severities:
    risk  the deployment will hurt under the logged traffic (uncapped output, a budget above the KV
          capacity or above the pool the engine's own flags leave, an engine that cannot hold one
          request at its max_model_len, preemptions, rejected prompts, truncation above the budget, a flag vLLM refuses,
          a simulated preemption rate or 429 share above the objective it was rendered for)
    warn  it drifted from the current recommendation, or works but wastes capacity
    info  context worth stating
Several files can be checked together (vllm-serve.sh + gateway.yaml): a gateway in front changes
which engine settings are risky, because then the gateway bounds KV reservations.

Given the model (`spec`, `weights`) and an estimated capacity, each engine file's pool is
recomputed from its own flags (kvtune.deploy.pool) and every gateway budget is held to that
pool: a file edited to --gpu-memory-utilization 0.80 leaves fewer blocks than the budget that
was computed at 0.92. A measured capacity is the pool as measured and wins over the flags.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvtune.capacity.reservation import reserved_blocks
from kvtune.deploy.launch import launcher
from kvtune.deploy.markers import K8S_FOLDER
from kvtune.deploy.markers import K8S_GATEWAY_FILE as GATEWAY_FILE
from kvtune.deploy.pool import POOL_FIELDS, deployed_capacity, enforce_eager
from kvtune.deploy.read import Deployed, DeployedKind, parse_deployed
from kvtune.deploy.slices import slice_blocks
from kvtune.domain.admission_policy import PolicyKind
from kvtune.domain.engine_settings import EngineSettings
from kvtune.domain.feasibility import Verdict
from kvtune.domain.recommendation import Recommendation, RouteRecommendation
from kvtune.domain.route import RouteMatch
from kvtune.domain.whatif import Policy
from kvtune.domain.whatif import PolicyKind as WhatIfKind
from kvtune.engines import ENGINE_TITLES, sglang, trtllm, vllm
from kvtune.errors import CapacityError, OptionError
from kvtune.gateway.config import HealthProbe
from kvtune.policy.feasibility import (
    ENGINE_REFUSES,
    ENGINE_SHORTENS,
    fix_line,
    max_model_len_remedy,
    verdict,
)
from kvtune.policy.replica_search import replica_queue, simulate_replicas, split_load
from kvtune.policy.search import Deployment, recommended_engine, route_caps, route_laws, simulate_deployment, violations
from kvtune.profile.routes import CensoredHistogram

if TYPE_CHECKING:
    from kvtune.capacity.plan import Capacity
    from kvtune.domain.whatif import Objective
    from kvtune.model import ModelSpec
    from kvtune.policy.search import Deployment
    from kvtune.weights import WeightsEstimate


class Severity(enum.Enum):
    """How much a finding matters, most first: a risk fails the check (exit 1)."""

    RISK = "risk"
    WARN = "warn"
    INFO = "info"


SEVERITIES = tuple(s.value for s in Severity)


@dataclass(frozen=True, slots=True)
class Finding:
    severity: Severity
    code: str
    message: str
    why: str
    source: str | None = None

    def to_dict(self) -> dict:
        return {"severity": self.severity.value, "code": self.code, "message": self.message, "why": self.why,
                "source": self.source}


@dataclass(frozen=True, slots=True)
class CheckResult:
    deployed: tuple[Deployed, ...]
    findings: tuple[Finding, ...]

    @property
    def passed(self) -> bool:
        """No risk findings: what CI gates on (exit 0 vs 1)."""
        return not any(f.severity is Severity.RISK for f in self.findings)

    def to_dict(self) -> dict:
        return {"deployed": {d.source: d.to_dict() for d in self.deployed},
                "findings": [f.to_dict() for f in self.findings], "passed": self.passed}


def lua_module_findings(source: str, found: Mapping[str, str | None], wanted: Mapping[str, str]) -> list[Finding]:
    """A deployed nginx.conf loads kvtune's Lua modules (`wanted`: lua/kvtune/NAME.lua -> text)
    from lua/ under nginx's prefix, which `recommend --out` writes beside it; `found`: what is
    beside the deployed file (None: absent). A warning, since nginx may run with another prefix:
    a module missing there, or one that differs from this kvtune's (another version's Lua may
    not read this nginx.conf's data)."""
    missing = [name for name in wanted if found.get(name) is None]
    changed = [name for name in wanted if found.get(name) is not None and found[name] != wanted[name]]
    out = []
    if missing:
        out.append(Finding(Severity.WARN, "lua-modules-missing",
                           f"{', '.join(missing)} not beside nginx.conf",
                           "nginx.conf's gateway is kvtune's Lua modules, loaded from lua/ under nginx's prefix "
                           "(nginx -p DIR): without them nginx does not start; copy the lua/ folder "
                           "`kvtune recommend --out` wrote beside nginx.conf", source))
    if changed:
        out.append(Finding(Severity.WARN, "lua-modules-differ",
                           f"{', '.join(changed)} beside nginx.conf differ from this kvtune's",
                           "the modules and nginx.conf's data are rendered together: Lua from another kvtune "
                           "version may read this nginx.conf's limits and routes differently", source))
    return out


def _blocks(tokens: int, block_size: int) -> int:
    return reserved_blocks(tokens, 0, block_size)


# flags that size the pool outright: unset when the recommendation sets none
_POOL_SIZE_FIELDS = frozenset({"kv_cache_memory_bytes", "num_gpu_blocks_override", "kv_cache_tokens"})


@dataclass(frozen=True, slots=True)
class _Pool:
    """The KV pool one engine file's flags leave (kvtune.deploy.pool), and the file."""

    engine: Deployed
    capacity: Capacity

    @property
    def usable_tokens(self) -> int:
        return self.capacity.usable_blocks * self.capacity.block_size


class _Checker:
    def __init__(self, deployed: Sequence[Deployed], rec: Recommendation, max_truncation: float | None,
                 spec: ModelSpec | None = None, weights: WeightsEstimate | None = None):
        self.deployed = tuple(deployed)
        self.rec = rec
        self.max_truncation = max_truncation
        self.findings: list[Finding] = []
        self.block_size = rec.capacity.block_size
        self.usable_blocks = rec.capacity.num_blocks - 1  # vLLM keeps one null block
        self.usable_tokens = self.usable_blocks * self.block_size
        self.budget = rec.budget_blocks
        self.settings = rec.settings
        self.gateways = [d for d in self.deployed if d.is_gateway]
        self.engines = [d for d in self.deployed if d.is_engine]
        self.risky: set[tuple[str, str]] = set()  # (source, field) already reported as risk
        self.spec, self.weights = spec, weights
        self.pools = self._engine_pools()
        # the gateway's budget is held to the smallest pool an engine file leaves (None: the recommendation's)
        self.pool = min(self.pools.values(), key=lambda p: p.usable_tokens, default=None)

    # ------------------------------------------------------------ the pool the deployed flags leave

    def _recompute(self, engine: Deployed) -> Capacity:
        assert self.spec is not None and self.weights is not None and self.rec.hardware.gpu_memory_bytes
        return deployed_capacity(engine, self.spec, self.weights, gpu=self.rec.hardware.gpu,
                                 gpu_memory_bytes=self.rec.hardware.gpu_memory_bytes,
                                 engine_version=self.rec.engine.version).capacity

    def _engine_pools(self) -> dict[str, _Pool]:
        """Each engine file's pool, recomputed from its flags, when the recommendation's capacity is
        an estimate (a measured one is the pool as measured and wins) and the model is known."""
        if self.rec.capacity.source != "estimate" or not self.rec.hardware.gpu_memory_bytes:
            return {}
        if self.spec is None or self.weights is None:
            return {}
        pools = {}
        for engine in self.engines:
            if engine.kind.value != self.rec.engine.name:
                continue  # reported as engine-mismatch: the recommendation's memory model is another engine's
            try:
                pools[engine.source] = _Pool(engine, self._recompute(engine))
            except CapacityError as exc:
                self.add(Severity.RISK, "no-kv-pool", f"the deployed flags leave no KV pool: {exc.message}",
                         f"{ENGINE_TITLES[engine.kind.value]} refuses to start without room for one block",
                         engine.source, "gpu_memory_utilization")
        return pools

    def _recommended_pool_value(self, name: str) -> Any:
        if name == "enforce_eager":
            return False
        if name in ("num_gpu_blocks_override",):
            return None
        return self._recommended(name)

    def _shrinking_flags(self, pool: _Pool) -> list[str]:
        """The deployed flags that, set back to the recommended value one at a time, would leave a
        larger pool: what shrank it, each with the blocks it costs."""
        engine = pool.engine
        out = []
        for name in POOL_FIELDS:
            want = self._recommended_pool_value(name)
            have = enforce_eager(engine) if name == "enforce_eager" else getattr(engine, name)
            if have is None or have == want or (want is None and name not in _POOL_SIZE_FIELDS):
                continue
            if name == "enforce_eager":
                flags = {k: v for k, v in engine.flags.items() if k != "enforce-eager"}
                restored = dataclasses.replace(engine, flags=flags)
            else:
                restored = dataclasses.replace(engine, **{name: want})
            try:
                blocks = self._recompute(restored).num_blocks
            except CapacityError:
                continue
            if blocks > pool.capacity.num_blocks:
                out.append(f"{name} {have} ({'unset' if want is None else f'at the recommended {want}'}: "
                           f"{blocks:,} blocks)")
        return out

    def check_pool(self, pool: _Pool) -> None:
        """The feasibility verdict's engine condition on the pool the deployed flags leave: vLLM
        refuses to start when one request at max_model_len does not fit it less its null block
        (SGLang and TensorRT-LLM start but serve a shorter context)."""
        c, engine = pool.capacity, pool.engine
        v = verdict(engine.kind.value, pool_blocks=c.num_blocks, block_size=c.block_size,
                    max_model_len=c.max_model_len)
        if v.fits:
            return
        need = _blocks(c.max_model_len, c.block_size)
        fits = v.longest_held_tokens // c.block_size * c.block_size
        self.add(Severity.RISK, "max-model-len-over-pool",
                 f"max_model_len {c.max_model_len:,} needs {need:,} blocks of {c.block_size} tokens, but the deployed "
                 f"flags leave a KV pool of {c.num_blocks:,} blocks ({fits:,} tokens hold one request)",
                 f"{v.why}; lower --max-model-len to at most {fits:,}, or give the pool more memory",
                 engine.source, "max_model_len")

    def add(self, severity: Severity, code: str, message: str, why: str, source: str | None,
            field: str | None = None) -> None:
        if severity is Severity.RISK and field:
            self.risky.add((source or "", field))
        self.findings.append(Finding(severity, code, message, why, source))

    # ------------------------------------------------------------ per-route caps

    def _route_caps(self, d: Deployed) -> list[tuple[RouteRecommendation, int | None]]:
        """(recommended route, the cap the deployment applies to its traffic or None if uncapped)."""
        out = []
        for route in self.rec.routes:
            match = route.match or RouteMatch()
            if d.is_gateway:
                hit = d.route_for(match.path, match.model, match.headers)
                out.append((route, hit.max_new_tokens if hit else None))
            else:
                out.append((route, d.max_new_tokens))
        return out

    def check_caps(self, d: Deployed) -> None:
        for route, cap in self._route_caps(d):
            name = route.route
            recommended = route.cap
            if cap is None:
                if d.is_gateway:
                    self.add(Severity.RISK, "uncapped-route",
                             f"route {name!r} matches no route in the gateway, so its output is not capped",
                             "a request without max_tokens may grow to the whole context: the gateway "
                             "cannot reserve for it and the KV budget no longer bounds memory",
                             d.source, f"route:{name}")
                continue
            # the same Kaplan–Meier estimate the recommendation chose its cap with
            lengths = CensoredHistogram.from_lengths(route.output_lengths)
            deployed_share = lengths.truncation_share(cap)
            recommended_share = lengths.truncation_share(recommended)
            budget = self.max_truncation if self.max_truncation is not None else recommended_share
            if cap < recommended and deployed_share > budget + 1e-9:
                self.add(Severity.RISK, "cap-truncates",
                         f"route {name!r}: cap {cap} cuts {deployed_share:.1%} of logged responses "
                         f"(budget {budget:.1%}; recommended cap {recommended} cuts {recommended_share:.1%})",
                         "a response stopped at its cap is lost or truncated output for the user; "
                         "raise the cap to the recommended value", d.source, f"cap:{name}")
            elif cap > recommended:
                extra = _blocks(cap - recommended, self.block_size)
                self.add(Severity.WARN, "cap-above-recommendation",
                         f"route {name!r}: cap {cap} is above the recommended {recommended}",
                         f"every request reserves up to {extra} more blocks than the traffic needs, "
                         "so fewer requests fit in the budget", d.source)
            elif cap < recommended:
                self.add(Severity.WARN, "cap-below-recommendation",
                         f"route {name!r}: cap {cap} is below the recommended {recommended} "
                         f"(cuts {deployed_share:.1%} of logged responses)",
                         "within the truncation budget, but it drifted from the recommendation", d.source)

    # ------------------------------------------------------------ context length

    def check_max_model_len(self, d: Deployed) -> None:
        """A prompt at or over max_model_len is rejected (400); prompt + cap over it is cut short
        (current vLLM clamps max_tokens to max_model_len − prompt)."""
        if d.max_model_len is None:
            return
        capper = self.gateways[0] if self.gateways and not d.is_gateway else d
        caps = {r.route: c for r, c in self._route_caps(capper)}
        rejected, cut = None, None
        for route in self.rec.routes:
            prompt_max = route.prompt_max
            cap = caps.get(route.route) or route.cap
            if prompt_max >= d.max_model_len and (rejected is None or prompt_max > rejected[1]):
                rejected = (route.route, prompt_max)
            elif prompt_max + cap > d.max_model_len and (cut is None or prompt_max + cap > cut[1]):
                cut = (route.route, prompt_max + cap, prompt_max, cap)
        recommended = self.rec.max_model_len
        if rejected:
            name, prompt_max = rejected
            self.add(Severity.RISK, "max-model-len-rejects",
                     f"max_model_len {d.max_model_len} rejects the longest logged prompts of route {name!r} "
                     f"({prompt_max} tokens)",
                     f"those requests fail with 400; raise max_model_len to {recommended}", d.source,
                     "max_model_len")
        elif cut:
            name, need, prompt_max, cap = cut
            self.add(Severity.WARN, "max-model-len-cuts-output",
                     f"max_model_len {d.max_model_len} < longest logged prompt + cap ({prompt_max} + {cap} = "
                     f"{need}) on route {name!r}",
                     f"vLLM clamps such a request's output to {d.max_model_len - prompt_max} tokens "
                     f"(older releases rejected it); recommended max_model_len is {recommended}",
                     d.source, None)

    # ------------------------------------------------------------ engine

    def check_engine(self, d: Deployed) -> None:
        engine = self.rec.engine
        served = self.rec.served_model or self.rec.model
        if d.model is not None and d.model not in (served, self.rec.model):
            self.add(Severity.WARN, "model-mismatch",
                     f"serves {d.model!r} but the recommendation is for {served!r}",
                     "KV per token, capacity and caps were computed for another model", d.source)
        if d.kind.value != engine.name:
            self.add(Severity.WARN, "engine-mismatch",
                     f"launches {ENGINE_TITLES[d.kind.value]} but the recommendation is for "
                     f"{ENGINE_TITLES[engine.name]}",
                     "each engine sizes its KV pool and admits requests its own way: recommend again with "
                     f"--engine {d.kind.value} to check its settings", d.source)
        if d.kind is DeployedKind.VLLM and engine.name == "vllm" and engine.v1:
            for flag in ("preemption-mode", "swap-space"):
                if flag in d.flags:
                    self.add(Severity.RISK, "invalid-flag",
                             f"--{flag} does not exist in vLLM {engine.version} (V1 engine)",
                             "vLLM refuses to start on an unknown flag; V1 preempts by recompute only",
                             d.source, flag.replace("-", "_"))
        if d.gpus is not None:
            self.check_k8s_resources(d)
        if d.kind is DeployedKind.TRTLLM:
            self.check_trtllm_cap(d)
        else:
            self.check_backstop(d)
        if d.kind is DeployedKind.SGLANG:
            self.check_sglang_estimate(d)
        self.check_preemption(d)

    def check_k8s_resources(self, d: Deployed) -> None:
        """A Kubernetes container (kvtune.deploy.k8s_read) asks for one GPU per rank: vLLM starts
        tensor_parallel_size × pipeline_parallel_size workers, one on each GPU it sees, and fails
        with fewer; more are paid for and idle. Several ranks talk through /dev/shm (NCCL). The
        gateway keeps one budget per upstream, so one Deployment is one engine: one pod."""
        assert d.gpus is not None
        tp, pp = d.tensor_parallel_size or 1, d.pipeline_parallel_size or 1
        if d.gpus != tp * pp:
            self.add(Severity.RISK, "gpu-count-mismatch",
                     f"resources.limits[nvidia.com/gpu] {d.gpus}, but tensor_parallel_size {tp} x "
                     f"pipeline_parallel_size {pp} needs {tp * pp} GPUs",
                     "vLLM runs one worker per GPU of the pod: with fewer it does not start, with more the rest "
                     f"idle; ask for {tp * pp}", d.source, "gpus")
        if d.pods == 0:
            self.add(Severity.WARN, "pods-share-one-upstream",
                     "spec.replicas 0: no vLLM pod runs, and the gateway's upstream refuses every request",
                     "scale the Deployment to 1", d.source)
        elif d.pods is not None and d.pods > 1:
            self.add(Severity.WARN, "pods-share-one-upstream",
                     f"spec.replicas {d.pods}: {d.pods} vLLM pods behind one Service, which the gateway sees as one "
                     "upstream with one engine's budget",
                     "the gateway reserves per engine: pods behind one Service share one budget, so each is filled to "
                     "a fraction of its KV; render one Deployment per engine with recommend --replicas N "
                     "(k8s/vllm-0.yaml, …)", d.source)
        if tp * pp > 1 and not d.shm_mounted:
            self.add(Severity.WARN, "no-shm",
                     f"/dev/shm is not a memory emptyDir, and {tp * pp} GPUs' ranks exchange through it",
                     "NCCL and vLLM's workers share memory in /dev/shm; a container's default 64 MiB fails them "
                     "at start or under load: mount an emptyDir with medium: Memory there", d.source)

    def check_backstop(self, d: Deployed) -> None:
        """vLLM's --override-generation-config or SGLang's SGLANG_MAX_NEW_TOKENS_LIMIT caps what
        reaches the engine past the gateway."""
        where = ("--override-generation-config max_new_tokens" if d.kind is DeployedKind.VLLM
                 else f"{sglang.ENV_MAX_NEW_TOKENS_LIMIT}")
        if d.max_new_tokens is not None:
            return
        if self.gateways:
            self.add(Severity.WARN, "no-backstop-cap", f"no {where}: only the gateway caps output",
                     "a request that reaches the engine without passing the gateway may generate up to the "
                     "whole context", d.source, None)
        else:
            self.add(Severity.RISK, "no-output-cap", f"no cap on output: neither {where} nor a gateway config",
                     "chat and responses requests without max_tokens default to the context length − prompt, "
                     "so each may hold KV for the whole context", d.source, "max_new_tokens")

    def check_trtllm_cap(self, d: Deployed) -> None:
        """TensorRT-LLM has no server-wide cap, and GUARANTEED_NO_EVICT reserves the whole window for
        a request without max_tokens: without a gateway writing each route's cap, every such request
        holds max_seq_len of KV from its first step."""
        if self.gateways:
            return
        window = d.max_model_len or self.rec.concurrency.context_tokens
        self.add(Severity.RISK, "no-output-cap",
                 "no cap on output: TensorRT-LLM has no server-wide one and no gateway config is checked",
                 f"a request without max_tokens reserves --max_seq_len ({window:,}) − prompt tokens under "
                 "GUARANTEED_NO_EVICT, so few run at once; put kvtune's gateway in front (it writes each route's "
                 "cap into the request) and pass it with another --deployed", d.source, "max_new_tokens")

    def check_sglang_estimate(self, d: Deployed) -> None:
        """Under the guaranteed policy SGLang's estimate must charge the full remaining cap: a ratio
        pinned at 1 and a CLIP at least the largest route cap."""
        if self.rec.admission.kind is not PolicyKind.GUARANTEED:
            return
        init = d.options.get("init_new_token_ratio")
        floor = d.options.get("min_new_token_ratio_factor")
        init = sglang.INIT_NEW_TOKEN_RATIO if init is None else init
        floor = sglang.MIN_NEW_TOKEN_RATIO_FACTOR if floor is None else floor
        clip = d.options.get("clip_max_new_tokens_estimation") or sglang.CLIP_MAX_NEW_TOKENS_ESTIMATION
        largest = max(r.cap for r in self.rec.routes)
        if min(init * (d.options.get("schedule_conservativeness") or 1.0), 1.0) < 1.0 or floor < 1.0:
            self.add(Severity.WARN, "estimate-not-pinned",
                     f"SGLang's new_token_ratio starts at {min(init, 1.0):g} and decays to {floor:g} of it",
                     "it admits on a guess of each running request's remaining output and retracts (recomputes) "
                     f"requests when the guess was short; {sglang.ENV_INIT_NEW_TOKEN_RATIO}=1 and "
                     f"{sglang.ENV_MIN_NEW_TOKEN_RATIO_FACTOR}=1 make it reserve what the gateway reserves",
                     d.source)
        if clip < largest:
            self.add(Severity.WARN, "estimate-clipped",
                     f"{sglang.ENV_CLIP_MAX_NEW_TOKENS_ESTIMATION} {clip} is below the largest route cap {largest}",
                     "SGLang charges at most CLIP tokens of a request's remaining output, so it admits more than "
                     "the gateway reserved for and retracts when those requests run long", d.source)

    def check_preemption(self, d: Deployed) -> None:
        """Without a gateway, vLLM admits up to max_num_seqs sequences that each grow to prompt + cap
        (SGLang the same on a decaying estimate, TensorRT-LLM under MAX_UTILIZATION); TensorRT-LLM's
        GUARANTEED_NO_EVICT reserves first and never evicts."""
        if d.kind is DeployedKind.TRTLLM and (d.options.get("capacity_scheduler_policy")
                                              or trtllm.GUARANTEED_NO_EVICT) == trtllm.GUARANTEED_NO_EVICT:
            return
        if d.kind is DeployedKind.SGLANG and (d.options.get("init_new_token_ratio") or 0) >= 1 \
                and (d.options.get("min_new_token_ratio_factor") or 0) >= 1:
            return  # the estimate is the full remaining cap: SGLang queues instead of retracting
        context = d.max_model_len or self.rec.concurrency.context_tokens
        block_size = d.block_size or launcher(d.kind.value).DEFAULT_BLOCK_SIZE
        gpu_bytes = self.rec.hardware.gpu_memory_bytes or 0
        if d.kind is DeployedKind.VLLM:
            default_seqs = vllm.default_batch_limits(gpu_bytes, self.rec.hardware.gpu)[1]
        elif d.kind is DeployedKind.TRTLLM:
            default_seqs = trtllm.MAX_BATCH_SIZE
        else:
            default_seqs = sglang.DEFAULT_MAX_RUNNING_REQUESTS
        seqs = d.max_num_seqs or default_seqs
        prompt_max = max(r.prompt_max for r in self.rec.routes)
        cap = d.max_new_tokens or context
        per_seq_tokens = _blocks(min(context, prompt_max + cap), block_size) * block_size
        total = seqs * per_seq_tokens
        own = self.pools.get(d.source)
        usable_tokens = self.usable_tokens if own is None else own.usable_tokens
        if total <= usable_tokens:
            return
        message = (f"max_num_seqs {seqs}{'' if d.max_num_seqs else ' (default)'} × {per_seq_tokens} tokens "
                   f"per sequence (longest prompt {prompt_max} + cap {cap}) = {total:,} tokens > KV capacity "
                   f"{usable_tokens:,} tokens")
        if self.gateways:
            self.add(Severity.INFO, "engine-bounded-by-gateway", message,
                     "the gateway's block budget, not max_num_seqs, bounds what is reserved", d.source)
        else:
            self.add(Severity.RISK, "preemption-risk", message,
                     f"{ENGINE_TITLES[d.kind.value]} does not reserve KV for output: when blocks run out it "
                     "preempts (retracts, pauses) and recomputes running requests. Put kvtune's gateway "
                     "(gateway.yaml or nginx.conf) in front and pass it with another --deployed",
                     d.source, "max_num_seqs")

    # ------------------------------------------------------------ gateway

    def _budgets(self, d: Deployed) -> list[tuple[str, str, int, int, int, _Pool | None]]:
        """(field, what the message calls it, budget, usable blocks, recommended budget, the
        recomputed pool it is held to or None) for each
        engine the gateway sends to: one engine's budget each (a gateway.yaml with several upstreams
        holds one per upstream), held to that replica's own capacity where the recommendation
        measured each (rec.upstreams, matched by URL, else by position), else to the one capacity:
        the pool the deployed engine's flags leave when one was recomputed (usable blocks then
        counted in the recommendation's block size), else the recommendation's."""
        assert d.block_budget is not None
        pool = self.pool
        usable = self.usable_blocks if pool is None else pool.usable_tokens // self.block_size
        if len(d.upstreams) <= 1 and d.gateway_replicas > 1:
            m = d.gateway_replicas  # every nginx replica's slice together, against the one engine
            return [("block_budget", f"{m} nginx replicas x slice {d.block_budget} = block budget",
                     d.block_budget * m, usable, slice_blocks(self.budget, m) * m, pool)]
        if len(d.upstreams) <= 1:
            return [("block_budget", "block budget", d.block_budget, usable, self.budget, pool)]
        measured = {u.url: u for u in self.rec.upstreams}
        out = []
        for i, u in enumerate(d.upstreams):
            own = measured.get(u.url.rstrip("/"))
            if own is None and len(self.rec.upstreams) == len(d.upstreams):
                own = self.rec.upstreams[i]
            held, recommended, held_to = ((usable, self.budget, pool) if own is None
                                          else (own.usable_blocks, own.block_budget, None))
            m = d.gateway_replicas  # 1 but for nginx.conf's --nginx-replicas: every slice together
            called = f"upstream {u.url}: block budget" if m == 1 else \
                f"upstream {u.url}: {m} nginx replicas x slice {u.block_budget} = block budget"
            out.append((f"upstreams[{i}].block_budget", called, u.block_budget * m, held,
                        slice_blocks(recommended, m) * m, held_to))
        return out

    def _check_budget(self, d: Deployed, field: str, called: str, budget: int, block_size: int,
                      usable_blocks: int, recommended: int, pool: _Pool | None = None) -> None:
        """One engine's budget against its KV capacity and the recommended budget. Against a pool
        recomputed from the engine's flags, a budget above the pool itself is a risk
        (pool-below-budget: the gateway admits reservations the engine cannot hold), and one above
        safety fraction × the pool a warning, as against the recommendation's own pool."""
        budget_tokens = budget * block_size
        usable_tokens = usable_blocks * self.block_size
        if pool is not None:
            self._check_budget_against_pool(d, field, called, budget, block_size, pool)
            return
        if budget_tokens > usable_tokens:
            self.add(Severity.RISK, "budget-over-capacity",
                     f"{called} {budget} × {block_size} tokens = {budget_tokens:,} tokens exceeds "
                     f"the KV capacity of {usable_tokens:,} tokens ({usable_blocks} blocks)",
                     "the gateway admits more reservations than the engine can hold: preemptions or OOM "
                     f"under load; use the recommended budget {recommended}", d.source, field)
        elif budget_tokens > recommended * self.block_size:
            self.add(Severity.WARN, "budget-above-safety",
                     f"{called} {budget} is above the recommended {recommended} "
                     f"(safety fraction {self.rec.safety_fraction.value})",
                     "it fits the estimated capacity but leaves less margin for prompt-count drift "
                     "and capacity error", d.source, None)

    def _check_budget_against_pool(self, d: Deployed, field: str, called: str, budget: int, block_size: int,
                                   pool: _Pool) -> None:
        c = pool.capacity
        budget_tokens = budget * block_size
        recommended = self.rec.capacity.num_blocks
        safety = self.rec.safety_fraction.value
        assert isinstance(safety, (int, float))
        if budget_tokens > pool.usable_tokens:
            shrunk = self._shrinking_flags(pool)
            by = ("; shrunk by " + ", ".join(shrunk)) if shrunk else ""
            self.add(Severity.RISK, "pool-below-budget",
                     f"{called} {budget} × {block_size} tokens = {budget_tokens:,} tokens exceeds the KV pool "
                     f"{pool.engine.source}'s flags leave: {c.num_blocks:,} blocks × {c.block_size} tokens "
                     f"({pool.usable_tokens:,} usable tokens; the recommendation's pool was {recommended:,} "
                     f"blocks){by}",
                     "the gateway admits reservations the engine cannot hold: preemptions under load; deploy the "
                     f"recommended flags, or lower the budget to at most floor(usable × {safety:g}) = "
                     f"{int(pool.usable_tokens * safety) // block_size} blocks", d.source, field)
        elif budget_tokens > safety * pool.usable_tokens:
            self.add(Severity.WARN, "budget-above-safety",
                     f"{called} {budget} is above safety fraction {safety:g} × the {pool.usable_tokens:,}-token pool "
                     f"{pool.engine.source}'s flags leave ({c.num_blocks:,} blocks × {c.block_size} tokens)",
                     "it fits the pool those flags leave but with less margin for prompt-count drift and capacity "
                     "error", d.source, None)

    def check_gateway(self, d: Deployed) -> None:
        assert d.block_budget is not None and d.block_size is not None
        for field, called, budget, usable, recommended, pool in self._budgets(d):
            self._check_budget(d, field, called, budget, d.block_size, usable, recommended, pool)
        engine_block = next((e.block_size for e in self.engines if e.block_size), None) or self.block_size
        if d.block_size < engine_block:
            self.add(Severity.RISK, "block-size-mismatch",
                     f"the gateway counts {d.block_size}-token blocks but the engine allocates "
                     f"{engine_block}-token blocks",
                     "reservations round up to smaller blocks than the engine uses, so they under-count "
                     "what each request occupies", d.source, "block_size")
        elif d.block_size > engine_block:
            self.add(Severity.WARN, "block-size-mismatch",
                     f"the gateway counts {d.block_size}-token blocks, the engine {engine_block}",
                     "reservations round up more than needed, which wastes a little budget", d.source, None)
        if d.route_for("/v1/__any__", "__any__") is None:
            self.add(Severity.WARN, "no-catch-all-route",
                     "no route matches every request: requests on other paths or models are not capped",
                     "a final route without match (kvtune renders one named 'default') caps everything "
                     "else at the backstop", d.source, None)
        for engine in self.engines:
            if engine.max_model_len and d.max_model_len and d.max_model_len > engine.max_model_len:
                self.add(Severity.WARN, "max-model-len-differs",
                         f"gateway max_model_len {d.max_model_len} > engine max_model_len {engine.max_model_len}",
                         "the gateway admits prompts the engine then rejects", d.source, None)
        if len(d.upstreams) > 1 and d.health is not None:
            self.check_passive_health(d, d.health)
        if len(d.upstreams) > 1:
            self.add(Severity.INFO, "gateway-budget",
                     f"{d.kind.value} budgets {', '.join(str(u.block_budget) for u in d.upstreams)} blocks of "
                     f"{d.block_size} tokens on {len(d.upstreams)} upstreams; {len(d.routes)} routes",
                     "reservations on each upstream are bounded by its own budget", d.source)
        else:
            self.add(Severity.INFO, "gateway-budget",
                     f"{d.kind.value} budget {d.block_budget} blocks of {d.block_size} tokens; "
                     f"{len(d.routes)} routes", "reservations are bounded by this budget", d.source)

    def check_passive_health(self, d: Deployed, health: HealthProbe) -> None:
        """A replica that passes /health but answers 5xx frees its blocks at once, so "most free"
        sends it nearly everything: without passive health it takes most of the traffic."""
        if health.consecutive_failures == 0:
            self.add(Severity.WARN, "no-passive-health",
                     f"{d.kind.value} never ejects an upstream that answers 5xx while its /health passes "
                     "(health.consecutive_failures is 0, or the file predates passive health)",
                     "a replica answering 500 to every generation frees its blocks at once and wins "
                     "'most free': it gets nearly all requests; render again with kvtune recommend "
                     "(--health-failures, default 5)", d.source, "health.consecutive_failures")
            return
        self.add(Severity.INFO, "passive-health",
                 f"{d.kind.value} ejects an upstream after {health.consecutive_failures} consecutive 5xx or "
                 f"failed connections, for {health.ejection_s:g} s doubled per ejection in a row up to "
                 f"{health.max_ejection_s:g} s; at most {health.max_ejected_share:g} of the upstreams at once",
                 "an upstream that fails every request is skipped whatever its /health says", d.source)

    # ------------------------------------------------------------ drift

    def check_drift(self, d: Deployed) -> None:
        if d.is_engine and d.kind.value != self.rec.engine.name:
            return  # reported as engine-mismatch: its settings mean other things
        if d.is_engine and d.kind is not DeployedKind.VLLM:
            settings = launcher(d.kind.value).deployed_settings(d)
            pairs = [(name, have, unset, self._recommended(name)) for name, (have, unset) in settings.items()]
        elif d.is_engine:
            defaults = {"tensor_parallel_size": 1, "pipeline_parallel_size": 1, "kv_cache_dtype": "auto",
                        "block_size": vllm.BLOCK_SIZE}
            fields = ["tensor_parallel_size", "pipeline_parallel_size", "max_model_len", "max_num_seqs",
                      "max_num_batched_tokens", "gpu_memory_utilization", "kv_cache_memory_bytes",
                      "kv_cache_dtype", "block_size"]
            pairs = [(f, getattr(d, f) if getattr(d, f) is not None else defaults.get(f),
                      getattr(d, f) is None, self._recommended(f)) for f in fields]
            pairs.append(("max_new_tokens_backstop", d.max_new_tokens, d.max_new_tokens is None,
                          self.rec.backstop))
        else:
            pairs = [(field, budget, False, recommended) for field, _, budget, _, recommended, _ in self._budgets(d)]
            pairs += [("block_size", d.block_size, False, self.block_size),
                     ("max_model_len", d.max_model_len, False, self.rec.max_model_len)]
        for name, have, unset, want in pairs:
            if want is None or (d.source, name) in self.risky:
                continue
            if name == "max_new_tokens_backstop" and unset:
                continue  # reported as no-output-cap / no-backstop-cap
            same = have == want if not isinstance(want, float) else (
                isinstance(have, (int, float)) and math.isclose(have, want, rel_tol=1e-6))
            if same:
                continue
            shown = "not set (engine default)" if unset and have is None else (
                f"{have} (engine default)" if unset else str(have))
            decision = self.settings.get(name)
            rule = decision.reason if decision is not None else ""
            self.add(Severity.WARN, "drift", f"{name}: deployed {shown}, recommended {want}",
                     rule or "differs from the current recommendation", d.source)

    def _recommended(self, name: str) -> Any:
        decision = self.settings.get(name)
        return None if decision is None else decision.value

    # ------------------------------------------------------------ the objective it was rendered for

    def check_objective(self) -> None:
        """A recommendation searched for an objective (`recommend --objective`) carries it: the
        deployed engine and gateway are simulated on its traffic and load, as the what-if table
        was, and a preemption rate, 429 share or share of answers cut by the caps above its limits
        is a risk."""
        objective = self.rec.objective
        if objective is None:
            return

        try:
            replicas = self._replica_deployments(objective)
            if replicas is None:
                predicted = simulate_deployment(objective, self._deployment(objective))
            else:
                predicted = simulate_replicas(objective, *replicas)[0]
        except OptionError as exc:
            self.add(Severity.RISK, "objective-unsimulated", f"the deployment cannot run: {exc.message}",
                     "vLLM refuses an engine whose context does not fit its KV pool",
                     self._objective_source(), None)
            return
        figures = (f"{predicted.output_tokens_per_s:,.1f} output tokens/s, {predicted.preemption_rate:.1%} of requests "
                   f"preempted, {predicted.share_429:.1%} answered 429, {predicted.truncation_share:.1%} of answers "
                   f"cut by the caps at {objective.load.label} "
                   f"({objective.requests:,} simulated requests, {objective.seeds_label})")
        broken = violations(objective, predicted)
        source = self._objective_source()
        if broken:
            self.add(Severity.RISK, "objective-missed",
                     f"simulated {'; '.join(v.text for v in broken)}: {figures}",
                     "the deployment breaks the objective it was rendered for (`recommend --objective`); "
                     "deploy the recommended files or recommend again for this configuration", source, None)
        else:
            self.add(Severity.INFO, "objective-met", f"simulated {figures}",
                     "within the objective it was rendered for", source)

    def _replica_deployments(self, objective: Objective) -> tuple | None:
        """A recommendation searched over several replicas, checked against a gateway with as
        many upstreams: (each replica's objective, its deployment, the split), as the search
        simulated them (kvtune.policy.replica_search), each upstream on its own replica's pool and
        step time with its deployed budget and the engine limits recommended for it; None otherwise."""
        gateway = self._replica_gateway(objective)
        if gateway is None:
            return None
        import dataclasses

        base = self._deployment(objective, gateway)
        split = split_load(objective, [r.basis.engine.num_blocks - 1 for r in objective.replicas])
        recommended = {u.capacity_file: u for u in self.rec.upstreams}
        objectives, deployments = [], []
        for i, (replica, upstream) in enumerate(zip(objective.replicas, gateway.upstreams, strict=True)):
            own = recommended.get(replica.capacity_file)
            pool = replica.basis.engine
            engine = EngineSettings(
                num_blocks=pool.num_blocks, block_size=base.engine.block_size,
                max_num_seqs=own.max_num_seqs if own is not None and own.max_num_seqs else base.engine.max_num_seqs,
                max_num_batched_tokens=(own.max_num_batched_tokens if own is not None and own.max_num_batched_tokens
                                        else base.engine.max_num_batched_tokens),
                max_model_len=base.engine.max_model_len, enable_prefix_caching=pool.enable_prefix_caching)
            objectives.append(dataclasses.replace(objective, basis=replica.basis, replicas=()))
            deployments.append(dataclasses.replace(base, engine=engine, budget_blocks=upstream.block_budget,
                                                   queue_max_waiting=replica_queue(base.queue_max_waiting,
                                                                                   split.shares[i])))
        return objectives, deployments, split

    def _replica_gateway(self, objective: Objective) -> Deployed | None:
        """The gateway whose upstreams are the objective's replicas, gateway.yaml first (an
        nginx.conf under --nginx-replicas holds one nginx's slices); None without replicas."""
        if not objective.replicas:
            return None
        matching = [g for g in self.gateways if len(g.upstreams) == len(objective.replicas)]
        return next((g for g in matching if g.kind is DeployedKind.GATEWAY), matching[0] if matching else None)

    def _objective_source(self) -> str | None:
        objective = self.rec.objective
        gateway = self._replica_gateway(objective) if objective is not None else None
        if gateway is None and self.gateways:
            gateway = self.gateways[0]
        return (gateway or self.deployed[0]).source

    def _deployment(self, objective: Objective, gateway: Deployed | None = None) -> Deployment:
        """The deployed files as the simulator sees them (kvtune.policy.search.Deployment): the
        engine's flags over vLLM's defaults on the measured pool (the recommended engine when no
        engine file is checked), and the gateway's (default: the first) budget, route caps, output
        laws and wait queue; without a
        gateway, straight to vLLM capped by its backstop."""
        base = objective.basis.engine
        engine_file = self.engines[0] if self.engines else None
        if engine_file is None:
            engine = recommended_engine(self.rec, objective.basis)
        else:
            e = engine_file
            engine = EngineSettings(
                num_blocks=e.num_gpu_blocks_override or base.num_blocks, block_size=e.block_size or base.block_size,
                max_num_seqs=e.max_num_seqs or base.max_num_seqs,
                max_num_batched_tokens=e.max_num_batched_tokens or base.max_num_batched_tokens,
                max_model_len=e.max_model_len or base.max_model_len, enable_prefix_caching=base.enable_prefix_caching)
        if gateway is None and self.gateways:
            gateway = self.gateways[0]
        if gateway is not None:
            policy = Policy.of(gateway.admission or self.rec.admission)
            return Deployment(engine, route_caps(gateway.routes, self.rec.routes), policy, gateway.block_budget,
                              route_laws(gateway.routes, self.rec.routes), gateway.queue_max_waiting or 0,
                              30.0 if gateway.queue_timeout_s is None else gateway.queue_timeout_s)
        backstop = engine_file.max_new_tokens if engine_file is not None else None
        return Deployment(engine, {r.route: backstop for r in self.rec.routes}, Policy(WhatIfKind.DIRECT), None)

    def check_feasibility(self) -> None:
        """Each failed condition of the feasibility verdict (kvtune.policy.feasibility) is a risk: the
        recommendation's own, and each deployed engine's max_model_len against the recommendation's
        pool where it is measured (a pool recomputed from the deployed flags is held to the same
        verdict in check_pool)."""
        base = self.rec.feasibility
        if base is None:
            return
        seen: set[str] = set()
        verdicts: list[tuple[str | None, Verdict]] = [(None, base)]
        for d in self.engines:
            if d.source in self.pools:
                continue  # its own pool, recomputed from its flags, is held to the verdict in check_pool
            if d.max_model_len is not None and d.max_model_len != base.max_model_len:
                v = verdict(base.engine, pool_blocks=base.pool_blocks, block_size=base.block_size,
                            max_model_len=d.max_model_len, longest_request_tokens=base.longest_request_tokens)
                remedy = max_model_len_remedy(v, d.max_model_len)
                verdicts.append((d.source, v if remedy is None else
                                 dataclasses.replace(v, fix=fix_line([remedy], fallback=""))))
        for source, v in verdicts:
            for reason in v.reasons:
                if reason.text in seen:
                    continue
                seen.add(reason.text)
                fix = f"; {v.fix}" if v.fix else ""
                self.add(Severity.RISK, reason.code, reason.text,
                         f"the deployment cannot serve the logged traffic{fix}", source,
                         "max_model_len" if reason.code in (ENGINE_REFUSES, ENGINE_SHORTENS) else None)

    def run(self) -> CheckResult:
        self.check_feasibility()
        for pool in self.pools.values():
            self.check_pool(pool)
        for d in self.deployed:
            if d.is_engine:
                self.check_engine(d)
            else:
                self.check_gateway(d)
        self.check_objective()
        for d in self.deployed:
            # caps: a gateway's per-route caps govern when present; the engine's backstop otherwise
            if d.is_gateway or not self.gateways:
                self.check_caps(d)
            self.check_max_model_len(d)
        for d in self.deployed:
            self.check_drift(d)
        order = {s: i for i, s in enumerate(Severity)}
        findings = sorted(self.findings, key=lambda f: order[f.severity])
        return CheckResult(self.deployed, tuple(findings))


# Risks that come from the traffic and the model, not from how a file was written: the
# recommendation itself carries them (a logged prompt longer than the model's context), so a
# rendered file that shows them still says what the recommendation says.
INHERENT_RISKS = frozenset({"max-model-len-rejects"})


def check_rendered(files: Mapping[str, str], rec: Recommendation) -> CheckResult:
    """`kvtune recommend`'s own gate on what it is about to write: the engine script with each
    gateway config it rendered, checked as `kvtune check` would check them deployed. A file
    that drifts from the recommendation, or carries a risk the recommendation does not (a route
    shadowed by another, a cap below the recommended one), is a rendering fault: `passed` is
    False and nothing should be written."""
    def sibling(name: str) -> str:
        named = name.rsplit("/", 1)[-1]
        if named not in files:
            raise KeyError(f"{name} was not rendered")
        return files[named]

    script = launcher(rec.engine.name).SCRIPT
    engine = [parse_deployed(files[n], source=n, read_sibling=sibling) for n in (script,) if n in files]
    gateways = [parse_deployed(files[n], source=n) for n in ("gateway.yaml", "nginx.conf") if n in files]
    results = [check_deployment([*engine, g], rec) for g in gateways] or [check_deployment(engine, rec)]
    results += _rendered_manifests(files, rec)
    faults = []
    for f in dict.fromkeys(f for r in results for f in r.findings):
        if f.code == "drift" or (f.severity is Severity.RISK and f.code not in INHERENT_RISKS):
            faults.append(Finding(Severity.RISK, f.code, f.message, f.why, f.source))
    return CheckResult((*engine, *gateways), tuple(faults))


def _rendered_manifests(files: Mapping[str, str], rec: Recommendation) -> list[CheckResult]:
    """The rendered Kubernetes manifests (kvtune.deploy.k8s), checked as deployed: each vLLM
    Deployment with the gateway's ConfigMap. Measured replicas carry their own engine limits
    after the shared flags, which differ from the recommendation's by design: their gateway is
    checked alone."""
    if GATEWAY_FILE not in files:
        return []
    gateway = parse_deployed(files[GATEWAY_FILE], source=GATEWAY_FILE)
    engines = [n for n in files if n.startswith(f"{K8S_FOLDER}/vllm")]
    if rec.upstreams:
        return [check_deployment([gateway], rec)]
    return [check_deployment([parse_deployed(files[n], source=n), gateway], rec) for n in engines]


def check_deployment(deployed: Sequence[Deployed], rec: Recommendation, *,
                     max_truncation: float | None = None, spec: ModelSpec | None = None,
                     weights: WeightsEstimate | None = None) -> CheckResult:
    """Findings for deployed files (checked together) against a recommendation. With the model's
    `spec` and `weights`, an estimated capacity is recomputed from each engine file's flags and
    the gateway budgets are held to that pool (kvtune.deploy.pool)."""
    if not deployed:
        raise ValueError("nothing to check")
    return _Checker(deployed, rec, max_truncation, spec, weights).run()


__all__ = ["Severity", "Finding", "CheckResult", "check_deployment", "check_rendered", "INHERENT_RISKS", "SEVERITIES"]
