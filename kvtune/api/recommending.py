"""The door to `kvtune recommend`: caps, a block budget and engine settings from the traffic
on a deployment (the rules, or the simulated search with an objective; one plan per replica),
and the deploy files rendered from them, held to `kvtune check`, written all or nothing."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from kvtune.capacity.memory import memory_model
from kvtune.domain.choices import GOALS, Objective, Policy
from kvtune.domain.deployment import Deployment, Measurement
from kvtune.domain.recommendation import Recommendation
from kvtune.domain.slo import Slo
from kvtune.domain.whatif import ENGINE_ROWS, Goal
from kvtune.engines.vllm import CURRENT_VERSION as CURRENT_VLLM_VERSION
from kvtune.errors import KvtuneError, OptionError
from kvtune.model.sources import check_logged_architecture, model_for_logged_id
from kvtune.planning import Plan, plan
from kvtune.policy import feasibility
from kvtune.policy.replicas import check_replicas, check_same_deployment, per_replica, smallest, with_replica_context
from kvtune.profile.logged_model import one_logged_model
from kvtune.profile.routes import Profile

if TYPE_CHECKING:
    from kvtune.deploy.check import CheckResult
    from kvtune.deploy.k8s import K8sOptions
    from kvtune.deploy.render import RenderOptions
    from kvtune.domain.feasibility import Verdict


class RenderCheckError(KvtuneError):
    """Rendered files that would fail `kvtune check` against the recommendation they came from."""

    def __init__(self, result: CheckResult) -> None:
        first = next(iter(result.findings))
        super().__init__(f"the rendered {first.source} would fail `kvtune check`: {first.code}: {first.message}")
        self.result = result


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
