"""kvtune's Python API: the pipeline `kvtune recommend` runs, one call per stage.

    logs ──profile_logs──▶ Profile ───────┐
    Deployment (model, GPUs, engine) ──────┴─recommend──▶ Recommendation ──render──▶ files ──write_files
      └──plan──▶ Plan (its KV capacity: what `kvtune capacity` shows)
                                                      │
    deployed files ───────────────────────────────check──▶ CheckResult (what `kvtune check` gates on)

    Profile or LogReplay + Deployment + SimulatedServer + Load ──simulate──▶ Simulation (`kvtune simulate`)
    Profile or LogReplay + BenchTarget + Load + Expectations ──benchmark──▶ results (`kvtune bench`)
    a running engine or its startup log ──calibrate──▶ MeasuredCapacity (`kvtune calibrate`)
    Deployment ──capacity_fit──▶ CapacityFit (`kvtune capacity`); ──kv_bytes──▶ KvBytes (`kvtune kv`)
    gateway.yaml ──gateway_config──▶ GatewayConfig (what `kvtune gateway` serves)

Each stage takes and returns typed objects; `load_profile` and `load_recommendation` read the
saved ones back strictly. Errors are `kvtune.errors.KvtuneError` subclasses naming the file and
the field. The deployment, policy and objective are values of the floor (kvtune.domain), passed
whole. This module is the CLI's only door: each command turns its options into those values,
makes one call here, and renders what comes back (`kvtune kv` and `kvtune profile` call their
stage themselves, since this module loads what they need not: numpy, tempfile).

>>> import kvtune
>>> profile = kvtune.profile_logs(["sample_logs/"])
>>> deployment = kvtune.Deployment("llama-3.1-8b", gpu="H100-80GB")
>>> rec = kvtune.recommend(profile, deployment)
>>> files = kvtune.render(rec)
>>> sorted(files)[:3]
['gateway.yaml', 'nginx.conf', 'recommendation.json']
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvtune import kv
from kvtune.capacity.engine_logs import calibrate_engine
from kvtune.capacity.measured import MeasuredCapacity
from kvtune.capacity.measured import calibrate as calibrate_vllm
from kvtune.capacity.memory import memory_model
from kvtune.capacity.plan import CapacityReport
from kvtune.capacity.reservation import RequestShape
from kvtune.deploy.read import Deployed, DeployedKind, load_deployed
from kvtune.domain.bench_target import BenchTarget, Expectations
from kvtune.domain.choices import GOALS, Objective, Policy
from kvtune.domain.deployment import Deployment, Measurement
from kvtune.domain.load_shape import Load, LoadShape
from kvtune.domain.log_reading import LogReading, LogReplay
from kvtune.domain.recommendation import Recommendation
from kvtune.domain.simulated_server import SimulatedServer
from kvtune.domain.slo import Slo
from kvtune.domain.whatif import ENGINE_ROWS, Goal
from kvtune.endpoint import host_problem, server_root, url_problem
from kvtune.engines.vllm import CURRENT_VERSION as CURRENT_VLLM_VERSION
from kvtune.errors import InputError, KvtuneError, OptionError
from kvtune.gateway.config import GatewayConfig, load_gateway_config
from kvtune.ingest import options_for
from kvtune.ingest.tokenize import load_tokenizer
from kvtune.model import resolve_model
from kvtune.model.sources import check_logged_architecture, model_for_logged_id
from kvtune.planning import Plan, measured_capacity, plan
from kvtune.policy import feasibility
from kvtune.policy.recommendation import load_recommendation as load_recommendation_file
from kvtune.policy.replicas import check_replicas, check_same_deployment, per_replica, smallest, with_replica_context
from kvtune.profile.build import is_saved_profile
from kvtune.profile.build import load_profile as load_saved_profile
from kvtune.profile.logged_model import one_logged_model
from kvtune.profile.logs import load_profile_or_logs
from kvtune.profile.routes import Profile, fold_routes
from kvtune.userfiles import brief
from kvtune.weights import weights_for
from kvtune.workload.draw import PromptSynth, Workload, replay_rows, select_routes

if TYPE_CHECKING:
    from kvtune.bench.run import BenchRecorder
    from kvtune.bench.timing import TimingProgress
    from kvtune.deploy.check import CheckResult
    from kvtune.deploy.k8s import K8sOptions
    from kvtune.deploy.render import RenderOptions
    from kvtune.domain.feasibility import Verdict
    from kvtune.kv import KvBytes
    from kvtune.simulation import Simulation

class RenderCheckError(KvtuneError):
    """Rendered files that would fail `kvtune check` against the recommendation they came from."""

    def __init__(self, result: CheckResult) -> None:
        first = next(iter(result.findings))
        super().__init__(f"the rendered {first.source} would fail `kvtune check`: {first.code}: {first.message}")
        self.result = result


def profile_logs(
    paths: Sequence[str | os.PathLike[str]],
    reading: LogReading | None = None,
    *,
    progress: Callable | None = None,
    workers: int | None = 1,
    ray_address: str | None = None,
) -> Profile:
    """Per-route exact histograms of output and prompt tokens from log files, directories or
    globs (or one saved profile, which is loaded), read as `reading` says (kvtune.LogReading:
    format, field mapping, what names a route, bad rows, routes folded past `max_routes`, files
    excluded). `workers` processes read the logs (None: one per 2 cores for a big input; call
    it under `if __name__ == "__main__":`, as multiprocessing needs), or Ray tasks at
    `ray_address` ("" a local cluster): the same profile either way. Files matching an `exclude`
    glob (relative path or base name) and files kvtune wrote are not read
    (`Profile.skipped_files`, `Profile.notes`); logs without one usable row raise InputError.

    >>> profile = kvtune.profile_logs(["sample_logs/"], kvtune.LogReading(route_by="model"))
    >>> [(r.route, r.output.quantile(0.99).value_tokens) for r in profile.routes][:1]  # doctest: +SKIP
    [('meta-llama/Llama-3.1-8B-Instruct', 2474)]
    """
    r = reading or LogReading()
    return load_profile_or_logs([os.fspath(p) for p in paths], options_for(r), progress=progress,
                                max_routes=r.max_routes, workers=workers, ray_address=ray_address)




def load_profile(path: str | os.PathLike[str], *, max_routes: int | None = None) -> Profile:
    """A profile saved by `kvtune profile --save` (strict: a damaged file names its field), its
    routes beyond `max_routes` (the least busy) folded into `*` (None: as saved).

    >>> profile = kvtune.load_profile("profile.json")          # doctest: +SKIP
    >>> profile.requests                                        # doctest: +SKIP
    12000
    """
    return fold_routes(load_saved_profile(path), max_routes)


def recommend(
    profile: Profile | Callable[[], Profile],
    deployment: Deployment | Plan,
    policy: Policy | None = None,
    objective: Objective | None = None,
    *,
    measured: Measurement | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> Recommendation:
    """Caps per route, a KV block budget and engine settings from the traffic on a deployment;
    every number says which rule produced it. What `kvtune recommend` computes, replicas included.

    `profile` may be a function that reads it: it is called once the options are checked (and
    first when `deployment.model` is None: the model the logs name, kvtune.model.sources).
    `deployment` is planned (kvtune.planning.plan) on its `measured` capacity, or is a Plan
    already made. The profile's rows must name one model (or none), which the files then serve
    unless `policy.served_model` says otherwise. `rec.feasibility` says whether the deployment
    can serve the logged traffic at all (kvtune.policy.feasibility); an infeasible one is
    returned with the fix line that would make it feasible, not raised: the CLI refuses it.

    With `objective` (goal "throughput", or "goodput" under its `slo`), simulate each candidate
    (cap level × budget × policy) on the measured capacity at the logged arrival rate (or the
    objective's `rate_rps` / `concurrency`), and return the best one within its
    `max_preemption_rate`, `max_429_share` and the policy's `max_truncation`, its `what_if`
    table attached; `progress(done, total)` after each row. kvtune.policy.search.
    InfeasibleObjectiveError (with the table) when no candidate meets them.

    Several `measured.capacity_files` (one per engine replica; or one file and
    `deployment.replicas` N: N replicas of it) plan each replica: the recommendation is the
    smallest's, each upstream gets its own budget and engine limits (kvtune.policy.replicas),
    and an objective simulates every row on all of them, each on its share of the load.

    >>> d = kvtune.Deployment("llama-3.1-8b", gpu="H100-80GB")
    >>> rec = kvtune.recommend(profile, d, kvtune.Policy(max_truncation=0.01))
    >>> rec.block_budget.value, rec.routes[0].max_new_tokens.rule      # doctest: +SKIP
    (25884, 'cap-max-truncation')
    >>> measured = kvtune.Measurement(capacity_files=("capacity.json",))
    >>> rec = kvtune.recommend(profile, kvtune.Deployment("tiny"), objective=kvtune.Objective(
    ...     "throughput", max_preemption_rate=0), measured=measured)  # doctest: +SKIP
    >>> rec.chosen.label, rec.chosen.predicted.output_tokens_per_s   # doctest: +SKIP
    ('guaranteed, caps p99, safety 1', 152.3)
    """
    policy, measured = policy or Policy(), measured or Measurement()
    if isinstance(deployment, Plan):
        if measured.given:
            raise OptionError("a Plan already holds its capacity: give a Deployment to plan on `measured`",
                              field="measured")
        _check_objective(objective, policy)
        release = deployment.report.engine_version
        vllm = deployment.engine == "vllm"
        return _rules_or_search(_read(profile), deployment, policy, objective, progress, (
            policy.vllm_version or (release if vllm else CURRENT_VLLM_VERSION), None if vllm else release))
    urls = _upstreams(deployment, policy, measured)
    deployment = dataclasses.replace(deployment, engine_version=_engine_version(deployment, policy))
    given_model = deployment.model is not None
    # the model and options are checked before the logs are read, unless the logs name the model
    loaded: Profile | None = None if given_model else _read(profile)
    if loaded is not None:
        deployment = dataclasses.replace(deployment, model=model_for_logged_id(_logged(loaded)))
    plans = _replica_plans(deployment, measured)
    _check_objective(objective, policy)
    profiled = _read(profile) if loaded is None else loaded
    primary = smallest([p.capacity for _, p in plans]) if plans else 0
    plans = with_replica_context(plans) if plans else []
    plan_ = plans[primary][1] if plans else plan(deployment, measured=measured)
    assert deployment.model is not None
    if given_model and policy.served_model is None:  # the files would serve the logged id
        check_logged_architecture(_logged(profiled), plan_.spec, deployment.model)
    version = deployment.engine_version
    releases = ((version or CURRENT_VLLM_VERSION, None) if deployment.engine == "vllm"
                else (CURRENT_VLLM_VERSION, version or plan_.report.engine_version))
    rec = _rules_or_search(profiled, plan_, policy, objective, progress, releases, plans)
    if not plans:
        if rec.feasibility is not None and not rec.feasibility.fits:
            rec = dataclasses.replace(rec, feasibility=_with_remedies(rec.feasibility, profiled, (plan_, deployment),
                                                                      policy, releases, measured.given))
        return rec
    searched = objective is not None and objective.goal is not None
    own = None if searched else _own_limits(profiled, plans, (plan_, rec), policy, releases)
    return per_replica(rec, [(f, p.capacity) for f, p in plans], urls, own=own,
                       from_origin=len(measured.capacity_files) > 1)


def _own_limits(profile: Profile, plans: list[tuple[str, Plan]], primary: tuple[Plan, Recommendation],
                policy: Policy, releases: tuple[str, str | None]) -> list[Recommendation]:
    """Each replica's engine limits without a search: the rules on its own plan, once per file
    (`primary`: the smallest's plan and its recommendation); an error names the replica's file."""
    rec = primary[1]
    check_replicas([(f, p.capacity) for f, p in plans], rec)
    by_plan = {id(primary[0]): rec}
    for f, p in plans:
        if id(p) not in by_plan:
            try:
                by_plan[id(p)] = _rules_or_search(profile, p, policy, None, None, releases)
            except KvtuneError as exc:
                if exc.path is None:
                    exc.path = f
                raise
    return [by_plan[id(p)] for _, p in plans]


def _read(profile: Profile | Callable[[], Profile]) -> Profile:
    return profile() if callable(profile) else profile


def _logged(profile: Profile) -> str | None:
    """The one model the profile's rows name (None: none names one)."""
    return one_logged_model(profile.models, profile.log_model)


def _engine_version(deployment: Deployment, policy: Policy) -> str | None:
    """The deployment's engine_version, or the policy's vllm_version (its older name); both given must agree."""
    if policy.vllm_version is None:
        return deployment.engine_version
    if deployment.engine_version is not None and deployment.engine_version != policy.vllm_version:
        raise OptionError(f"{policy.vllm_version} disagrees with `engine_version` {deployment.engine_version}; "
                          "give one of them (`vllm_version` is its older name)", field="vllm_version")
    memory_model(policy.vllm_version, field="vllm_version")  # a bad value names the field the user gave
    return policy.vllm_version


def _upstreams(deployment: Deployment, policy: Policy, measured: Measurement) -> list[str]:
    """The gateway's engine URLs when the capacity files do not name them: the policy's upstream,
    and for N replicas its port and the N-1 after it (checked before any work)."""
    files = len(measured.capacity_files)
    if files > 1 and deployment.replicas not in (1, files):
        raise OptionError(f"{deployment.replicas} replicas, but {files} capacity files (one per replica)",
                          field="replicas")
    if deployment.replicas > 1:
        from kvtune.deploy.render import replica_upstreams  # jinja2: only for several replicas

        return replica_upstreams(policy.upstream, deployment.replicas, field="replicas")
    return [policy.upstream]


def _replica_plans(deployment: Deployment, measured: Measurement) -> list[tuple[str, Plan]]:
    """(file, its plan) per engine replica, each file planned once; [] for one replica. Several
    files are one replica each; one file and `deployment.replicas` N, N replicas of it. Replicas
    of another model, engine, KV dtype or block size than the first are one line naming the file."""
    files, n = measured.capacity_files, deployment.replicas
    replica_files = files if len(files) > 1 and n == len(files) else files * n if len(files) == 1 and n > 1 else ()
    if len(replica_files) < 2:
        return []
    planned: dict[str, Plan] = {}
    for f in replica_files:
        if f not in planned:
            planned[f] = plan(deployment, measured=dataclasses.replace(measured, capacity_files=(f,)))
    plans = [(f, planned[f]) for f in replica_files]
    check_same_deployment([(f, p.capacity) for f, p in plans])
    return plans


def _check_objective(objective: Objective | None, policy: Policy) -> None:
    """The search's options only with a goal; an SLO without one bounds the rules by TPOT/TTFT."""
    if objective is None or objective.goal is None:
        searched = () if objective is None else (
            ("max_preemption_rate", objective.max_preemption_rate), ("max_429_share", objective.max_429_share),
            ("rate", objective.rate_rps), ("concurrency", objective.concurrency),
            ("compare_engines", objective.compare_engines or None), ("requests", objective.requests),
            ("slo", objective.slo))
        given = next((k for k, v in searched if v is not None), None)
        if given is not None:
            raise OptionError("only applies with `objective` throughput|goodput", field=given)
        if policy.slo is not None and policy.slo.tpot_ms is None and policy.slo.ttft_ms is None:
            raise OptionError("without --objective, bounds max_num_seqs by tpot and ttft (the step-time model's); "
                              "e2e needs --objective goodput, which simulates it", field="slo")
    elif objective.goal not in GOALS:
        raise OptionError(f"{objective.goal!r} is not one of {', '.join(GOALS)}", field="objective")


def _flow_slo(policy: Policy, objective: Objective | None) -> Slo | None:
    """The SLO flow control's bands take their deadlines from (policy.flow_control), else None."""
    if not policy.flow_control:
        return None
    slo = policy.slo or (objective.slo if objective is not None else None)
    if slo is None or slo.ttft_ms is None:
        raise OptionError("flow control takes its interactive band's deadline from the SLO's ttft",
                          field="flow_control")
    return slo


def _rules_or_search(profile: Profile, plan: Plan, policy: Policy, objective: Objective | None,
                     progress: Callable[[int, int], None] | None, releases: tuple[str, str | None],
                     replicas: Sequence[tuple[str, Plan]] = ()) -> Recommendation:
    """The rules on one plan, or with a goal the simulated search (on every replica's plan, `plan`
    being the smallest's). `releases`: (the vLLM release the rules assume, the engine's release)."""
    from kvtune.policy.recommend import RecommendOptions  # logging (silicon data): only to recommend
    from kvtune.policy.recommend import recommend as apply_rules  # logging: only to recommend

    searching = objective is not None and objective.goal is not None
    vllm_version, engine_version = releases
    options = RecommendOptions(
        safety_fraction=policy.safety_fraction, max_truncation=policy.max_truncation,
        vllm_version=vllm_version,
        upstream=policy.upstream, route_by="path" if policy.route_by is None else policy.route_by,
        route_header=policy.route_header, served_model=policy.served_model,
        logged_model=_logged(profile), engine=plan.engine, engine_version=engine_version,
        slo=None if searching else policy.slo,  # with an objective, the simulation judges it (goodput)
        flow_control=_flow_slo(policy, objective),
    )
    if not searching:
        return apply_rules(profile, plan, options)
    assert objective is not None and objective.goal is not None
    from kvtune.policy.search import (
        DEFAULT_REQUESTS,
        ObjectiveSpec,
        SearchGrid,
        recommend_for_objective,
    )  # logging (silicon data): only for a search

    spec = ObjectiveSpec(Goal(objective.goal), objective.slo, objective.max_preemption_rate,
                         objective.max_429_share, objective.rate_rps, objective.concurrency,
                         DEFAULT_REQUESTS if objective.requests is None else objective.requests, objective.seed,
                         compare_engines=objective.compare_engines, max_truncation=policy.max_truncation)
    by_rules = apply_rules(profile, plan, options)
    if replicas:
        check_replicas([(f, p.capacity) for f, p in replicas], by_rules)  # each error naming its file
    if by_rules.feasibility is not None and not by_rules.feasibility.fits:
        return by_rules  # no row of the grid can run: every row has this pool and max_model_len
    if not replicas:
        return recommend_for_objective(profile, plan, options, spec, progress=progress)
    from kvtune.policy.replica_search import replicas_for, search_replicas  # logging: only for a search

    primary = next(i for i, (_, p) in enumerate(replicas) if p is plan)
    grid = SearchGrid(engines=tuple(ENGINE_ROWS)) if objective.compare_engines else None
    return search_replicas(profile, primary, replicas_for(profile, replicas, spec), options, grid=grid,
                           progress=progress)


def _with_remedies(verdict: Verdict, profile: Profile, planned: tuple[Plan, Deployment], policy: Policy,
                   releases: tuple[str, str | None], measured: bool) -> Verdict:
    """The verdict with its fix line: which of a max_model_len that fits, fp8 KV and the smallest
    larger tp (up to 8 GPUs) would make the whole recommendation feasible, each tried by
    recommending again on the changed deployment (the memory estimate: a measured pool is measured
    at the settings it was taken with, so the estimate needs a GPU or its memory)."""
    plan_, deployment = planned
    remedies = []
    remedy = feasibility.max_model_len_remedy(verdict, plan_.max_model_len_given)
    if remedy is not None:
        remedies.append(remedy)
    tries = []
    if plan_.kv.bytes_per_element >= 2:
        tries.append(("--kv-cache-dtype fp8", dataclasses.replace(deployment, kv_cache_dtype="fp8")))
    tries.extend((f"--tp {tp}", dataclasses.replace(deployment, tp=tp))
                 for tp in (2, 4, 8) if tp > deployment.tp and tp * deployment.pp <= 8)
    if deployment.gpu is None and deployment.gpu_memory is None and deployment.gpu_spec is None:
        tries = []  # nothing to estimate another pool with
    for option, changed in tries:
        try:
            other = _rules_or_search(profile, plan(changed), policy, None, None, releases)
        except KvtuneError:  # the model does not split that way, or the weights do not fit
            continue
        if other.feasibility is not None and other.feasibility.fits:
            remedies.append(feasibility.Remedy(option, True, other.capacity.num_blocks,
                                               "by the estimate: measure it there" if measured else ""))
            if option.startswith("--tp"):
                break  # the smallest tensor-parallel size that fits
    return dataclasses.replace(verdict, fix=feasibility.fix_line(remedies, fallback=feasibility.fallback_fix(verdict)))


def render(rec: Recommendation, *, options: RenderOptions | None = None, gateway_tokenizer: str | None = None,
           targets: Sequence[str] | None = None, check: bool = True, k8s: K8sOptions | None = None
           ) -> dict[str, str]:
    """The deploy files as name → text (vllm-serve.sh, gateway.yaml, nginx.conf,
    recommendation.json, report.html, report.md, estimates.json/.yaml and, for vLLM, the
    Kubernetes manifests k8s/*.yaml with `k8s`'s images and gateway replicas). `gateway_tokenizer`
    is a model directory the gateway counts prompts with in process (default: the upstream's
    /tokenize). With `check`, the files are first held to `kvtune check` against `rec`:
    RenderCheckError if they fail.

    >>> files = kvtune.render(rec, targets=["vllm-serve.sh"])
    >>> files["vllm-serve.sh"].splitlines()[-1]                         # doctest: +SKIP
    'exec vllm serve meta-llama/Llama-3.1-8B-Instruct ... "$@"'
    """
    from kvtune.deploy.render import RenderOptions, render_files  # jinja2: only to render

    options = options or RenderOptions()
    if gateway_tokenizer is not None:
        options = dataclasses.replace(options, gateway_tokenizer=gateway_tokenizer)
    files = render_files(rec, targets=targets, options=options)
    if targets is None:
        files.update(_exported_files(rec, options, k8s))
    if check:
        from kvtune.deploy.check import check_rendered  # logging: only to check

        result = check_rendered(files, rec)
        if not result.passed:
            raise RenderCheckError(result)
    return files


def _exported_files(rec: Recommendation, options: RenderOptions, k8s: K8sOptions | None) -> dict[str, str]:
    """What recommend writes for other tools: estimates.json/.yaml (kvtune.deploy.estimates) and
    the Kubernetes manifests (kvtune.deploy.k8s)."""
    from kvtune.deploy.estimates import estimate_files  # jinja2, yaml: only to render
    from kvtune.deploy.k8s import render_manifests  # jinja2, yaml: only to render

    return {**estimate_files(rec, options), **render_manifests(rec, options, k8s)}


def write_files(out_dir: str | os.PathLike[str], files: Mapping[str, str]) -> list[Path]:
    """Write the files into out_dir all or nothing (every target checked first, then replaced
    together; a failed rename puts the previous files back). A manifest kvtune rendered into
    out_dir/k8s/ earlier that these files leave behind is refused (OptionError), since applying
    the folder would deploy it too.

    >>> kvtune.write_files("deploy/", kvtune.render(rec))               # doctest: +SKIP
    [PosixPath('deploy/gateway.yaml'), ...]
    """
    from kvtune.deploy.k8s import stale_manifests  # jinja2, yaml: only to write deploy files
    from kvtune.deploy.render import write_files as write  # jinja2: only to write deploy files

    stale = stale_manifests(out_dir, files)
    if stale:
        raise OptionError(f"{stale[0]} is a manifest an earlier recommend rendered and this one would not: "
                          "`kubectl apply -f k8s/` would deploy it beside the new ones; remove it (or the k8s/ "
                          "folder) or write to another --out", field="--out")
    return write(out_dir, files)


def check(rec: Recommendation, deployed: Sequence[str | os.PathLike[str]], *,
          max_truncation: float | None = None) -> CheckResult:
    """Deployed files (a vllm serve command or script, gateway.yaml, nginx.conf) judged together
    against the recommendation: `result.passed` is False on a risk. An estimated capacity is
    recomputed from each engine file's flags (the recommendation's model resolved again), and
    the gateway budgets are held to that pool.

    >>> result = kvtune.check(rec, ["deploy/vllm-serve.sh", "deploy/gateway.yaml"])
    >>> result.passed, [f.code for f in result.findings]                # doctest: +SKIP
    (True, [])
    """
    from kvtune.deploy.check import lua_module_findings  # logging: only to check
    from kvtune.deploy.render import lua_modules  # jinja2: only to check

    files = [load_deployed(p) for p in deployed]
    result = _check_loaded(rec, files, max_truncation)
    beside = [f for p, d in zip(deployed, files, strict=True) if d.kind is DeployedKind.NGINX
              for f in lua_module_findings(d.source, _lua_beside(Path(p).parent), lua_modules())]
    return dataclasses.replace(result, findings=(*result.findings, *beside)) if beside else result


def _lua_beside(folder: Path) -> dict[str, str | None]:
    """The Lua modules nginx.conf loads, as found in `folder` (None: absent or unreadable)."""
    from kvtune.deploy.render import lua_modules  # jinja2: only to check

    found: dict[str, str | None] = {}
    for name in lua_modules():
        try:
            found[name] = (folder / name).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            found[name] = None
    return found


def _check_loaded(rec: Recommendation, files: list[Deployed], max_truncation: float | None) -> CheckResult:
    """check's findings for loaded files: the pool recomputed from an engine file's flags where
    the recommendation's capacity was an estimate."""
    from kvtune.deploy.check import Finding, Severity, check_deployment  # logging: only to check

    engines = [d for d in files if d.is_engine]
    if rec.capacity.source != "estimate" or not engines:
        return check_deployment(files, rec, max_truncation=max_truncation)
    try:
        spec = resolve_model(rec.model)
    except KvtuneError as exc:
        result = check_deployment(files, rec, max_truncation=max_truncation)
        unresolved = Finding(Severity.INFO, "pool-not-recomputed",
                             f"the KV pool was not recomputed from the engine's flags: {exc.message}",
                             "budgets are held to the recommendation's estimated pool", engines[0].source)
        return dataclasses.replace(result, findings=(*result.findings, unresolved))
    return check_deployment(files, rec, max_truncation=max_truncation, spec=spec, weights=weights_for(spec))


def load_recommendation(path: str | os.PathLike[str], *, field: str | None = None) -> Recommendation:
    """A recommendation.json written by `kvtune recommend --out`, read back strictly: a missing
    or mistyped field is an InputError naming the file and the field's path (after `field`, the
    option it came in, when given).

    >>> rec = kvtune.load_recommendation("deploy/recommendation.json")  # doctest: +SKIP
    >>> rec.settings["max_model_len"].value                             # doctest: +SKIP
    131072
    """
    return load_recommendation_file(path, field=field)


def simulate(
    workload: Profile | Callable[[], Profile] | LogReplay,
    deployment: Deployment,
    server: SimulatedServer | None = None,
    load: Load | None = None,
    slo: Slo | None = None,
    *,
    measured: Measurement | None = None,
    routes: Sequence[str] = (),
    on_note: Callable[[str], None] | None = None,
) -> Simulation:
    """Throughput, latency, preemptions and 429s of the traffic on a deployment: what `kvtune
    simulate` predicts (kvtune.sim: the engine's scheduler step by step, the gateway's own
    admission in front with `server.gateway`).

    `workload` is a profile (or a function reading one: called once the engine is set up), whose
    `routes` the requests are drawn from, or a LogReplay of logs sent at their own timestamps.
    The pool is `server.capacity_file`'s, else kvtune's estimate for the deployment's model on
    its GPU (vLLM's; another engine's is given: `measured` kv_tokens or num_gpu_blocks); the step
    time is the file's calibrated `timing`, else silicon data or the roofline for the model and
    GPU. Without a rate or concurrency in `load`, the logs' mean arrival rate; `on_note` hears
    what the run should tell (a load taken by default, files the replay left out).

    >>> sim = kvtune.simulate(profile, kvtune.Deployment("llama-3.1-8b", gpu="H100-80GB"),
    ...                       load=kvtune.Load(rate_rps=3, max_requests=200))   # doctest: +SKIP
    >>> sim.report["throughput"]["output_tokens_per_s"]                    # doctest: +SKIP
    412.7
    """
    from kvtune.simulation import run_simulate  # logging (silicon data): only for a simulation

    return run_simulate(workload, deployment, server or SimulatedServer(), load or Load(), slo,
                        measured=measured, routes=routes, on_note=on_note)


async def benchmark(
    workload: Profile | Callable[[], Profile] | LogReplay,
    target: BenchTarget,
    load: Load,
    expectations: Expectations | None = None,
    *,
    routes: Sequence[str] = (),
    recorder: BenchRecorder | None = None,
    on_note: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Replay the traffic against a live OpenAI-compatible server, scrape its /metrics, judge:
    what `kvtune bench` runs, as its results JSON (`kvtune bench --help` lists the fields;
    `notes` last: the files the logs' reading left out).

    `workload` is a profile (or a function reading one: called once the options are checked)
    whose `routes` the requests are drawn from, or a LogReplay of logs sent at their own
    timestamps. `recorder` keeps each result as it arrives (an interrupted run keeps what it saw)
    and streams it to a requests log or a progress view; `on_note` hears the replay's notes.
    The verdict (`report["verdict"]`, None without `expectations`) fails on an SLO missed or a
    server that contradicts the recommendation.

    >>> target, load = kvtune.BenchTarget("http://127.0.0.1:8000"), kvtune.Load(rate_rps=5, max_requests=100)
    >>> report = asyncio.run(kvtune.benchmark(profile, target, load))   # doctest: +SKIP
    >>> report["requests"]["completed"]                                 # doctest: +SKIP
    100
    """
    from kvtune.bench.run import BenchConfig, run_bench  # orjson, aiohttp: only for a live run

    judged = expectations or Expectations()
    base_url = server_root(target.url, field="URL")
    expect = load_recommendation(judged.expect, field="--expect") if judged.expect else None
    replay = isinstance(workload, LogReplay)
    if replay:
        load = dataclasses.replace(load, replay=True)
    load.check(from_logs=replay)
    target.check()
    tokenizer = load_tokenizer(target.tokenizer) if target.tokenizer else None
    notes: list[str]  # on the files the logs' reading left out; the report's notes
    build: Callable[[PromptSynth], Workload]
    if isinstance(workload, LogReplay):
        rows, stamps, notes = replay_rows(workload.logs, options_for(workload.reading), workload.routes)
        for line in notes:
            (on_note or (lambda _: None))(line)
        shape = LoadShape.replay(stamps, load.speedup)

        def build(synth: PromptSynth) -> Workload:
            return Workload.from_rows(rows, synth, load.seed)
    else:
        profile = _read(workload)
        notes = profile.notes
        for r in select_routes(profile, routes):  # fail on bad routes or an empty profile before connecting
            if r.prompt.total == 0:
                raise InputError(f"route {brief(r.route)} logs no prompt lengths; a benchmark needs them",
                                 field="--route")
        shape = load.shape()

        def build(synth: PromptSynth) -> Workload:
            return Workload.from_profile(profile, routes, synth, load.seed)

    config = BenchConfig(
        base_url=base_url, load=shape, max_requests=load.max_requests, duration_s=load.duration_s,
        endpoint=target.endpoint, model=target.model, ignore_eos=target.ignore_eos,
        length_control=target.length_control, eos_token_id=target.eos_token_id, timeout_s=target.timeout_s,
        retry=target.retry, slo=judged.slo, metrics_url=target.metrics_url, scrape_interval_s=target.scrape_interval_s,
        max_connections=target.max_connections, seed=load.seed, api_key=target.api_key, expect=expect,
        slo_attainment=judged.slo_attainment,
    )
    report = await run_bench(config, build, tokenizer=tokenizer, recorder=recorder)
    return {**report, "notes": notes}


def kv_bytes(deployment: Deployment) -> KvBytes:
    """KV-cache bytes per token of the deployment's model, by layer kind, under its tp and pp, in
    its KV dtype: what `kvtune kv` shows (that command calls kvtune.kv itself: it starts without
    the library this module loads).

    >>> kvtune.kv_bytes(kvtune.Deployment("llama-3.1-70b", tp=4, kv_cache_dtype="fp8")).kv_bytes_per_token
    163840
    """
    if deployment.model is None:
        raise OptionError("name the model (a preset, config.json, model directory or hub id)", field="model")
    return kv.kv_bytes(resolve_model(deployment.model), kv_cache_dtype=deployment.kv_cache_dtype or "auto",
                       tp=deployment.tp, pp=deployment.pp)


@dataclass(frozen=True, slots=True)
class CapacityFit:
    """What `kvtune capacity` reports: the plan's capacity report, and whether one request at
    max_model_len (and one of each asked shape) fits the pool (`verdict.fits`, `verdict.why`)."""

    report: CapacityReport
    verdict: Verdict

    def to_dict(self) -> dict[str, Any]:
        """`kvtune capacity --json`: the report around a capacity file's fields (a `--capacity FILE`
        for simulate and recommend), and the verdict."""
        doc = self.report.to_dict()
        record = {k: v for k, v in self.report.capacity_file().to_dict().items() if k not in doc}
        return {**doc, **record, "fits": self.verdict.fits, "why": self.verdict.why}


def capacity_fit(deployment: Deployment, measured: Measurement | None = None,
             shapes: Sequence[RequestShape] = ()) -> CapacityFit:
    """How many tokens, blocks and requests of `shapes` fit on the deployment (its `measured`
    capacity, else the memory estimate), and whether it can serve one request at max_model_len.

    >>> fit = kvtune.capacity_fit(kvtune.Deployment("llama-3.1-8b", gpu="H100-80GB"))
    >>> fit.verdict.fits, fit.report.capacity.block_size
    (True, 16)
    """
    report = plan(deployment, measured=measured or Measurement(), shapes=tuple(shapes)).report
    return CapacityFit(report, feasibility.capacity_verdict(report.engine, report.capacity))


async def calibrate(
    url: str | None,
    engine: str = "vllm",
    *,
    engine_log: str | None = None,
    timeout_s: float = 10.0,
    timing: bool = False,
    timing_budget_s: float | None = None,
    max_num_batched_tokens: int | None = None,
    progress: TimingProgress | None = None,
) -> MeasuredCapacity:
    """The KV capacity a running engine really has (vLLM's /v1/models and /metrics, SGLang's
    /server_info, or a startup log `engine_log`, cross-checked against the server when both are
    given): what `kvtune calibrate` saves for `--capacity FILE`. With `timing` (vLLM only) it
    also sends bounded sweeps of requests for `timing_budget_s` (default 300) and fits the step
    time simulate uses; `progress` hears each sweep.

    >>> measured = asyncio.run(kvtune.calibrate("http://127.0.0.1:8000"))   # doctest: +SKIP
    >>> measured.num_blocks, measured.block_size                            # doctest: +SKIP
    (27153, 16)
    """
    if engine != "vllm":
        if timing:
            raise OptionError("measures vLLM only; leave --engine at vllm", field="timing")
        _refuse_timing_options(timing_budget_s, max_num_batched_tokens)
        return await calibrate_engine(engine, url, engine_log=engine_log, timeout_s=timeout_s)
    if timing:
        if url is None:
            raise OptionError("needs the server's URL: it sends requests to measure step times", field="timing")
        from kvtune.bench.timing import calibrate_timing  # orjson, logging: only for the sweeps

        budget = {} if timing_budget_s is None else {"budget_s": timing_budget_s}
        return await calibrate_timing(url, vllm_log=engine_log, timeout_s=timeout_s, **budget,
                                      max_num_batched_tokens=max_num_batched_tokens, progress=progress)
    _refuse_timing_options(timing_budget_s, max_num_batched_tokens)
    return await calibrate_vllm(url, vllm_log=engine_log, timeout_s=timeout_s)


def _refuse_timing_options(timing_budget_s: float | None, max_num_batched_tokens: int | None) -> None:
    for name, value in (("timing_budget_s", timing_budget_s), ("max_num_batched_tokens", max_num_batched_tokens)):
        if value is not None:
            raise OptionError("only applies with --timing", field=name)


def gateway_config(path: str | Path, *, upstream: str | None = None, host: str | None = None,
                   port: int | None = None) -> GatewayConfig:
    """gateway.yaml read strictly, with the address to listen on and (for one upstream) its URL
    overridden: the config `kvtune gateway` serves (kvtune.gateway.proxy.serve runs it).

    >>> config = kvtune.gateway_config("deploy/gateway.yaml", port=8080)   # doctest: +SKIP
    >>> config.block_budget, config.port                                  # doctest: +SKIP
    (25884, 8080)
    """
    config = load_gateway_config(path)
    for field, problem in (("upstream", upstream is not None and url_problem(upstream)),
                           ("host", host is not None and host_problem(host))):
        if problem:
            raise InputError(problem, field=field)
    upstreams = config.upstreams
    if upstream is not None:
        if len(upstreams) > 1:
            raise InputError(f"{os.fspath(path)} names {len(upstreams)} upstreams, each with its own budget: "
                             "edit its upstreams: instead", field="upstream")
        upstreams = (dataclasses.replace(upstreams[0], url=upstream),)
    return dataclasses.replace(config, upstreams=upstreams, host=host or config.host,
                               port=config.port if port is None else port)


__all__ = [
    "profile_logs", "load_profile", "plan", "measured_capacity", "recommend", "render", "write_files",
    "check", "load_recommendation", "RenderCheckError", "Plan", "Deployment", "Measurement", "Policy", "Objective",
    "Slo", "LogReading", "simulate", "SimulatedServer", "Load", "LogReplay", "benchmark", "BenchTarget",
    "Expectations", "kv_bytes", "capacity_fit", "CapacityFit", "calibrate", "gateway_config",
    "is_saved_profile",
]
