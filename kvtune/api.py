"""kvtune's Python API: the pipeline `kvtune recommend` runs, one call per stage.

    logs ──profile_logs──▶ Profile ─┐
    model + GPUs ──plan──▶ Plan ────┴─recommend──▶ Recommendation ──render──▶ files ──write_files
                                                      │
    deployed files ───────────────────────────────check──▶ CheckResult (what `kvtune check` gates on)

Each stage takes and returns typed objects; `load_profile` and `load_recommendation` read the
saved ones back strictly. Errors are `kvtune.errors.KvtuneError` subclasses naming the file and
the field. The CLI commands are thin calls of these functions.

>>> import kvtune
>>> profile = kvtune.profile_logs(["sample_logs/"])
>>> plan = kvtune.plan("llama-3.1-8b", gpu="H100-80GB")
>>> rec = kvtune.recommend(profile, plan)
>>> files = kvtune.render(rec)
>>> sorted(files)[:3]
['gateway.yaml', 'nginx.conf', 'recommendation.json']
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from kvtune.domain.slo import Slo
from kvtune.errors import KvtuneError, OptionError
from kvtune.planning import Plan, measured_capacity, plan
from kvtune.profile import MAX_ROUTES as DEFAULT_MAX_ROUTES

if TYPE_CHECKING:
    from kvtune.deploy.check import CheckResult
    from kvtune.deploy.read import Deployed
    from kvtune.deploy.render import RenderOptions
    from kvtune.policy.recommendation import Recommendation
    from kvtune.profile.routes import Profile



class RenderCheckError(KvtuneError):
    """Rendered files that would fail `kvtune check` against the recommendation they came from."""

    def __init__(self, result: CheckResult) -> None:
        first = next(iter(result.findings))
        super().__init__(f"the rendered {first.source} would fail `kvtune check`: {first.code}: {first.message}")
        self.result = result


def profile_logs(
    paths: Sequence[str | os.PathLike[str]],
    *,
    format: str | None = None,
    fields: Mapping[str, str] | None = None,
    route_by: str | None = None,
    tokenizer: str | None = None,
    on_error: str = "skip",
    strict: bool = False,
    assume_cap: int | None = None,
    max_routes: int | None = DEFAULT_MAX_ROUTES,
    progress: Callable | None = None,
    workers: int | None = 1,
    ray_address: str | None = None,
    exclude: Sequence[str] = (),
) -> Profile:
    """Per-route exact histograms of output and prompt tokens from log files, directories or
    globs (or one saved profile, which is loaded). `route_by` names a route by "path" (default),
    "model" or a source field; `max_routes` folds the rest into `*`. `workers` processes read
    the logs (None: one per 2 cores for a big input; call it under `if __name__ == "__main__":`,
    as multiprocessing needs), or Ray tasks at `ray_address` ("" a local cluster): the same
    profile either way. Files matching an `exclude` glob (relative path or base name) and files
    kvtune wrote are not read (`Profile.skipped_files`, `Profile.notes`); logs without one usable
    row raise InputError.

    >>> profile = kvtune.profile_logs(["sample_logs/"])
    >>> [(r.route, r.output.quantile(0.99).value_tokens) for r in profile.routes][:1]  # doctest: +SKIP
    [('/v1/chat/completions', 2474)]
    """
    from kvtune.ingest import IngestOptions, parse_on_error
    from kvtune.profile.logs import load_profile_or_logs

    options = IngestOptions(format=format, fields=dict(fields or {}), route_by=route_by, tokenizer=tokenizer,
                            on_error=parse_on_error(on_error), strict=strict, assume_cap=assume_cap,
                            exclude=tuple(exclude))
    return load_profile_or_logs([os.fspath(p) for p in paths], options, progress=progress, max_routes=max_routes,
                                workers=workers, ray_address=ray_address)


def load_profile(path: str | os.PathLike[str]) -> Profile:
    """A profile saved by `kvtune profile --save` (strict: a damaged file names its field).

    >>> profile = kvtune.load_profile("profile.json")          # doctest: +SKIP
    >>> profile.requests                                        # doctest: +SKIP
    12000
    """
    from kvtune.profile.build import load_profile as load

    return load(path)


def recommend(
    profile: Profile,
    plan: Plan,
    *,
    safety_fraction: float | None = None,
    max_truncation: float | None = None,
    vllm_version: str | None = None,
    upstream: str | None = None,
    route_by: str | None = None,
    route_header: str | None = None,
    served_model: str | None = None,
    engine: str | None = None,
    engine_version: str | None = None,
    objective: str | None = None,
    slo: Slo | None = None,
    max_preemption_rate: float | None = None,
    max_429_share: float | None = None,
    rate_rps: float | None = None,
    concurrency: int | None = None,
    requests: int | None = None,
    seed: int = 0,
    progress: Callable[[int, int], None] | None = None,
    compare_engines: bool = False,
    replicas: Sequence[tuple[str, Plan]] = (),
) -> Recommendation:
    """Caps per route, a KV block budget and vLLM settings from the traffic and the plan; every
    number says which rule produced it. `route_by` must be what the profile's routes were named by;
    with a log field, `route_header` names the request header that carries each group to the
    gateway (without it, more than one group is an OptionError: no gateway could enforce their caps).
    The profile's rows must name one model (or none; kvtune.profile.logged_model), which the files
    then serve unless `served_model` says otherwise.
    `rec.feasibility` says whether the deployment can serve the logged traffic at all
    (kvtune.policy.feasibility); an infeasible one is returned, not raised: the CLI refuses it.

    With `objective` ("throughput" or "goodput", which needs `slo`), as `recommend --objective`:
    simulate each candidate (cap level × budget × policy) on the plan's measured capacity at the
    logged arrival rate (or `rate_rps` / `concurrency`), and return the best one within
    `max_preemption_rate`, `max_429_share` and `max_truncation` (the share of answers its caps
    cut; default what the tail cap rule cuts), its `what_if` table attached; `progress(done,
    total)` after each row. kvtune.policy.search.InfeasibleObjectiveError (with the table) when
    no candidate meets them. `compare_engines` adds reference rows on SGLang's and TensorRT-LLM's
    own admission rules (kvtune.policy.whatif.ENGINE_ROWS). With an objective, `replicas` lists
    every engine replica behind the gateway as (capacity file, its plan), `plan` being the
    smallest's: each row is simulated on all of them, each on its share of the load with its own
    budget and engine limits (kvtune.policy.replica_search); without one, the rules alone.

    >>> rec = kvtune.recommend(profile, kvtune.plan("llama-3.1-8b", gpu="H100-80GB"), max_truncation=0.01)
    >>> rec.block_budget.value, rec.routes[0].max_new_tokens.rule      # doctest: +SKIP
    (25884, 'cap-max-truncation')
    >>> plan = kvtune.plan("tiny", measured=kvtune.measured_capacity(capacity_file="capacity.json"))  # doctest: +SKIP
    >>> rec = kvtune.recommend(profile, plan, objective="throughput", max_preemption_rate=0)  # doctest: +SKIP
    >>> rec.chosen.label, rec.chosen.predicted.output_tokens_per_s   # doctest: +SKIP
    ('guaranteed, caps p99, safety 1', 152.3)
    """
    from kvtune.policy.recommend import DEFAULT_UPSTREAM, RecommendOptions
    from kvtune.policy.recommend import recommend as apply_rules
    from kvtune.policy.rules import CURRENT_VLLM_VERSION
    from kvtune.profile.logged_model import one_logged_model

    engine = plan.engine if engine is None else engine
    # the release the plan's memory model assumed, unless the caller names one
    release = plan.report.engine_version if engine_version is None else engine_version
    options = RecommendOptions(
        safety_fraction=safety_fraction, max_truncation=max_truncation,
        vllm_version=(release if engine == "vllm" else CURRENT_VLLM_VERSION) if vllm_version is None
        else vllm_version,
        upstream=DEFAULT_UPSTREAM if upstream is None else upstream,
        route_by="path" if route_by is None else route_by, route_header=route_header, served_model=served_model,
        logged_model=one_logged_model(profile.models, profile.log_model),
        engine=engine, engine_version=release if engine != "vllm" else engine_version,
        slo=slo if objective is None else None,  # with an objective, the simulation judges it (goodput)
    )
    if options.engine != plan.engine:
        raise OptionError(f"the plan follows {plan.engine}'s memory model and defaults; plan it with "
                          f"engine={options.engine!r} too", field="engine")
    searched = {"max_preemption_rate": max_preemption_rate, "max_429_share": max_429_share,
                "rate_rps": rate_rps, "concurrency": concurrency, "requests": requests,
                "compare_engines": compare_engines or None}
    if objective is None:
        given = next((k for k, v in searched.items() if v is not None), None)
        if given is not None:
            raise OptionError("only applies with an objective (throughput or goodput)", field=given)
        return apply_rules(profile, plan, options)
    from kvtune.policy.search import DEFAULT_REQUESTS, ObjectiveSpec, recommend_for_objective
    from kvtune.policy.whatif import ENGINE_ROWS, GOALS, Goal

    if objective not in GOALS:
        raise OptionError(f"{objective!r} is not one of {', '.join(GOALS)}", field="objective")
    spec = ObjectiveSpec(Goal(objective), slo, max_preemption_rate, max_429_share, rate_rps, concurrency,
                         DEFAULT_REQUESTS if requests is None else requests, seed,
                         compare_engines=compare_engines, max_truncation=max_truncation)
    if len(replicas) > 1:
        from kvtune.policy.replica_search import replicas_for, search_replicas
        from kvtune.policy.replicas import check_replicas, with_replica_context
        from kvtune.policy.search import SearchGrid

        primary = next((i for i, (_, p) in enumerate(replicas) if p is plan), None)
        if primary is None:
            raise OptionError("plan must be one of the replicas' plans (the smallest's)", field="replicas")
        replicas = with_replica_context(replicas)
        plan = replicas[primary][1]
        by_rules = apply_rules(profile, plan, options)
        check_replicas([(f, p.capacity) for f, p in replicas], by_rules)  # each error naming its file
        if by_rules.feasibility is not None and not by_rules.feasibility.fits:
            return by_rules  # no row of the grid can run: every row has this pool and max_model_len
        found = replicas_for(profile, replicas, spec)
        grid = SearchGrid(engines=tuple(ENGINE_ROWS)) if compare_engines else None
        return search_replicas(profile, primary, found, options, grid=grid, progress=progress)
    by_rules = apply_rules(profile, plan, options)
    if by_rules.feasibility is not None and not by_rules.feasibility.fits:
        return by_rules  # no row of the grid can run: every row has this pool and max_model_len
    return recommend_for_objective(profile, plan, options, spec, progress=progress)


def render(rec: Recommendation, *, options: RenderOptions | None = None, gateway_tokenizer: str | None = None,
           targets: Sequence[str] | None = None, check: bool = True) -> dict[str, str]:
    """The deploy files as name → text (vllm-serve.sh, gateway.yaml, nginx.conf,
    recommendation.json, report.html, report.md). `gateway_tokenizer` is a model directory the
    gateway counts prompts with in process (default: the upstream's /tokenize). With `check`,
    the files are first held to `kvtune check` against `rec`: RenderCheckError if they fail.

    >>> files = kvtune.render(rec, targets=["vllm-serve.sh"])
    >>> files["vllm-serve.sh"].splitlines()[-1]                         # doctest: +SKIP
    'exec vllm serve meta-llama/Llama-3.1-8B-Instruct ... "$@"'
    """
    import dataclasses

    from kvtune.deploy.render import RenderOptions, render_files

    options = options or RenderOptions()
    if gateway_tokenizer is not None:
        options = dataclasses.replace(options, gateway_tokenizer=gateway_tokenizer)
    files = render_files(rec, targets=targets, options=options)
    if check:
        from kvtune.deploy.check import check_rendered

        result = check_rendered(files, rec)
        if not result.passed:
            raise RenderCheckError(result)
    return files


def write_files(out_dir: str | os.PathLike[str], files: Mapping[str, str]) -> list[Path]:
    """Write the files into out_dir all or nothing (every target checked first, then replaced
    together; a failed rename puts the previous files back).

    >>> kvtune.write_files("deploy/", kvtune.render(rec))               # doctest: +SKIP
    [PosixPath('deploy/gateway.yaml'), ...]
    """
    from kvtune.deploy.render import write_files as write

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
    from kvtune.deploy.check import lua_module_findings
    from kvtune.deploy.read import DeployedKind, load_deployed
    from kvtune.deploy.render import lua_modules

    files = [load_deployed(p) for p in deployed]
    result = _check_loaded(rec, files, max_truncation)
    beside = [f for p, d in zip(deployed, files, strict=True) if d.kind is DeployedKind.NGINX
              for f in lua_module_findings(d.source, _lua_beside(Path(p).parent), lua_modules())]
    return dataclasses.replace(result, findings=(*result.findings, *beside)) if beside else result


def _lua_beside(folder: Path) -> dict[str, str | None]:
    """The Lua modules nginx.conf loads, as found in `folder` (None: absent or unreadable)."""
    from kvtune.deploy.render import lua_modules

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
    from kvtune.deploy.check import Finding, Severity, check_deployment
    from kvtune.model import resolve_model
    from kvtune.weights import weights_for

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


def load_recommendation(path: str | os.PathLike[str]) -> Recommendation:
    """A recommendation.json written by `kvtune recommend --out`, read back strictly: a missing
    or mistyped field is an InputError naming the file and the field's path.

    >>> rec = kvtune.load_recommendation("deploy/recommendation.json")  # doctest: +SKIP
    >>> rec.settings["max_model_len"].value                             # doctest: +SKIP
    131072
    """
    from kvtune.policy.recommendation import load_recommendation as load

    return load(path)


__all__ = [
    "profile_logs", "load_profile", "plan", "measured_capacity", "recommend", "render", "write_files",
    "check", "load_recommendation", "RenderCheckError", "Plan",
]
