"""`kvtune recommend`: traffic + model + capacity → caps, KV budget, engine settings and deploy files."""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass

import click

from kvtune.cli.options import CapacityArgs, LogArgs, capacity_options, grouped, log_options
from kvtune.controls import escape_controls
from kvtune.engines import ENGINE_TITLES, engine_facts
from kvtune.errors import OptionError
from kvtune.policy.rules import CURRENT_VLLM_VERSION


@dataclass(frozen=True, slots=True)
class PolicyArgs:
    """The model and what the user decided about the policy, as `recommend` and `check` take them."""

    model: str | None  # None: the model the logs name (kvtune.model.sources.model_for_logged_id)
    served_model: str | None
    upstream: str
    vllm_version: str | None  # --engine-version's older name
    safety_fraction: float | None
    max_truncation: float | None
    route_header: str | None  # the request header that carries --route-by FIELD's group

    def recommendation(self, logs: tuple[str, ...], capacity: CapacityArgs, log: LogArgs,
                       objective: ObjectiveArgs | None = None, progress: Callable[[int, int], None] | None = None,
                       replica_files: tuple[str, ...] = (), urls: tuple[str, ...] = (), from_origin: bool = True):
        """The whole pipeline, as library calls: profile the logs, plan the capacity, apply the
        rules (or, with an objective, search the simulated what-if table). With several
        `replica_files` (one per engine replica, a file repeated for replicas measured once), the
        recommendation is the smallest replica's, searched on all of them, and each upstream gets
        its own budget and engine limits (kvtune.policy.replicas.per_replica; its URL from the
        file's origin with `from_origin`, else urls[i])."""
        import kvtune
        from kvtune.model.sources import check_logged_architecture, model_for_logged_id

        version = self.engine_version(capacity)
        capacity = dataclasses.replace(capacity, engine_version=version)
        profile = None
        if self.model is not None:  # the model and options are checked before the logs are read
            model = self.model
        else:
            profile = log.profile(logs)
            model = model_for_logged_id(log.logged_model(profile))
        plans = self._replica_plans(capacity, replica_files, model)
        primary = 0
        if plans:
            from kvtune.policy.replicas import smallest, with_replica_context

            primary = smallest([p.capacity for _, p in plans])
            plans = with_replica_context(plans)
            capacity = dataclasses.replace(capacity, capacity_files=(replica_files[primary],))
        wanted = objective.wanted(capacity) if objective is not None else {}
        bounds = {} if "objective" in wanted else wanted  # --slo alone: the rules' limits meet it
        wanted = wanted if "objective" in wanted else {}
        if profile is None:
            profile = log.profile(logs)
        vllm = capacity.engine == "vllm"
        plan = plans[primary][1] if plans else capacity.plan(model)
        if self.model is not None and self.served_model is None:  # the files would serve the logged id
            check_logged_architecture(log.logged_model(profile), plan.spec, self.model)
        if wanted and plans:
            wanted["replicas"] = plans
        given = {"engine": capacity.engine, "engine_version": None if vllm else version,
                 "safety_fraction": self.safety_fraction, "max_truncation": self.max_truncation,
                 "vllm_version": (version if vllm else None) or CURRENT_VLLM_VERSION, "upstream": self.upstream,
                 "route_by": log.route_by, "route_header": self.route_header, "served_model": self.served_model,
                 **bounds}
        rec = kvtune.recommend(profile, plan, progress=progress, **given, **wanted)
        if not plans:
            if rec.feasibility is not None and not rec.feasibility.fits:
                rec = dataclasses.replace(rec, feasibility=self._with_remedies(rec.feasibility, profile, plan,
                                                                              capacity, given, model))
            return rec
        from kvtune.errors import KvtuneError
        from kvtune.policy.replicas import check_replicas, per_replica

        own = None
        if not wanted:  # each replica's engine limits: the rules on its own capacity, once per file
            by_plan = {id(plan): rec}
            check_replicas([(f, p.capacity) for f, p in plans], rec)
            for f, p in plans:
                if id(p) in by_plan:
                    continue
                try:
                    by_plan[id(p)] = kvtune.recommend(profile, p, **given)
                except KvtuneError as exc:
                    if exc.path is None:
                        exc.path = f
                    raise
            own = [by_plan[id(p)] for _, p in plans]
        return per_replica(rec, [(f, p.capacity) for f, p in plans], urls, own=own, from_origin=from_origin)

    def _with_remedies(self, verdict, profile, plan, capacity: CapacityArgs, given: dict, model: str):
        """The verdict with its fix line: which of a max_model_len that fits, fp8 KV and the smallest
        larger --tp (up to 8 GPUs) would make the whole recommendation feasible, each tried by
        recommending again on the changed plan (the memory estimate: a measured pool is measured at
        the settings it was taken with, so the estimate needs --gpu or --gpu-memory)."""
        import kvtune
        from kvtune.errors import KvtuneError
        from kvtune.policy import feasibility

        remedies = []
        remedy = feasibility.max_model_len_remedy(verdict, plan.max_model_len_given)
        if remedy is not None:
            remedies.append(remedy)
        estimate = dataclasses.replace(capacity, kv_tokens=None, vllm_log=None, metrics_url=None, capacity_files=(),
                                       engine_log=None, num_gpu_blocks=None)
        measured = estimate != capacity
        tries = []
        if plan.kv.bytes_per_element >= 2:
            tries.append(("--kv-cache-dtype fp8", dataclasses.replace(estimate, kv_cache_dtype="fp8")))
        tries.extend((f"--tp {tp}", dataclasses.replace(estimate, tp=tp))
                     for tp in (2, 4, 8) if tp > capacity.tp and tp * capacity.pp <= 8)
        if capacity.gpu is None and capacity.gpu_memory is None and capacity.gpu_spec is None:
            tries = []  # nothing to estimate another pool with
        for option, changed in tries:
            try:
                other = kvtune.recommend(profile, changed.plan(model), **given)
            except KvtuneError:  # the model does not split that way, or the weights do not fit
                continue
            if other.feasibility is not None and other.feasibility.fits:
                remedies.append(feasibility.Remedy(option, True, other.capacity.num_blocks,
                                                   "by the estimate: measure it there" if measured else ""))
                if option.startswith("--tp"):
                    break  # the smallest tensor-parallel size that fits
        return dataclasses.replace(verdict, fix=feasibility.fix_line(remedies,
                                                                     fallback=feasibility.fallback_fix(verdict)))

    def _replica_plans(self, capacity: CapacityArgs, replica_files: tuple[str, ...], model: str) -> list:
        """(file, its plan) per replica, each file planned once; [] for one replica. Replicas of
        another model, engine, KV dtype or block size than the first are one line naming the file."""
        if len(replica_files) < 2:
            return []
        from kvtune.policy.replicas import check_same_deployment

        planned: dict = {}
        for f in replica_files:
            if f not in planned:
                planned[f] = dataclasses.replace(capacity, capacity_files=(f,)).plan(model)
        plans = [(f, planned[f]) for f in replica_files]
        check_same_deployment([(f, p.capacity) for f, p in plans])
        return plans

    def engine_version(self, capacity: CapacityArgs) -> str | None:
        """--engine-version, or --vllm-version (its alias); both given must agree."""
        if self.vllm_version is None:
            return capacity.engine_version
        if capacity.engine_version is not None and capacity.engine_version != self.vllm_version:
            raise OptionError(f"{self.vllm_version} disagrees with --engine-version {capacity.engine_version}; "
                              "give one of them (--vllm-version is its older name)", field="vllm_version")
        from kvtune.capacity.memory import memory_model

        memory_model(self.vllm_version, field="vllm_version")  # a bad value names the flag the user typed
        return self.vllm_version


@dataclass(frozen=True, slots=True)
class ObjectiveArgs:
    """`--objective` and the constraints and load it is searched under."""

    objective: str | None
    slo: str | None
    max_preemption_rate: float | None
    max_429_share: float | None
    rate: float | None
    concurrency: int | None
    requests: int
    seed: int
    compare_engines: bool = False

    def wanted(self, capacity: CapacityArgs) -> dict:
        """kvtune.recommend's objective keywords; {} without --objective (and then no other of these)."""
        if self.objective is None:
            given = [flag for flag, value in (("--max-preemption-rate", self.max_preemption_rate),
                                              ("--max-429-share", self.max_429_share), ("--rate", self.rate),
                                              ("--concurrency", self.concurrency),
                                              ("--compare-engines", self.compare_engines or None))
                     if value is not None]
            if given:
                raise OptionError("only applies with --objective throughput|goodput", field=given[0])
            if self.slo is None:
                return {}
            from kvtune.domain.slo import parse_slo

            slo = parse_slo(self.slo)
            if slo.tpot_ms is None and slo.ttft_ms is None:
                raise OptionError("without --objective, bounds max_num_seqs by tpot and ttft (the step-time "
                                  "model's); e2e needs --objective goodput, which simulates it", field="slo")
            return {"slo": slo}
        from kvtune.domain.slo import parse_slo

        return {"objective": self.objective, "slo": parse_slo(self.slo) if self.slo else None,
                "max_preemption_rate": self.max_preemption_rate, "max_429_share": self.max_429_share,
                "rate_rps": self.rate, "concurrency": self.concurrency, "requests": self.requests,
                "seed": self.seed, "compare_engines": self.compare_engines}


objective_options = grouped("objective", ObjectiveArgs, [
    click.option("--objective", type=click.Choice(["throughput", "goodput"]),
                 help="Search caps, budget and admission policy with the simulator for the most output tokens/s "
                      "(or goodput under --slo) within the constraints; show the what-if table.  [default: the "
                      "rules alone, no simulation]"),
    click.option("--slo", metavar="SPEC",
                 help="Latency objectives in ms, e.g. tpot=50,ttft=2000: max_num_seqs (and max_num_batched_tokens "
                      "for ttft) are bounded so the step-time model's predicted TPOT and TTFT meet them (refused, "
                      "exit 1, when no batch does); with --objective goodput, what a request must meet to count "
                      "(e2e too)."),
    click.option("--max-preemption-rate", type=float, metavar="R",
                 help="At most this share of requests preempted at least once; 0 allows only the guaranteed "
                      "policy.  [default: unconstrained]"),
    click.option("--max-429-share", type=float, metavar="S",
                 help="At most this share of requests answered 429 after their retries.  [default: unconstrained]"),
    click.option("--rate", type=float, metavar="RPS",
                 help="Simulate Poisson arrivals at RPS requests/s.  [default: the logs' mean arrival rate]"),
    click.option("--concurrency", type=int, metavar="N",
                 help="Simulate N closed-loop clients instead of an arrival rate."),
    click.option("--requests", type=int, default=1000, show_default=True, metavar="N",
                 help="Requests simulated per what-if row (at most 100,000)."),
    click.option("--seed", type=int, default=0, show_default=True,
                 help="Seed for lengths and arrivals: the requests `kvtune bench --seed` would send "
                      "(with --objective, each row is the mean of this seed and the next two)."),
    click.option("--compare-engines", is_flag=True,
                 help="Add reference rows for the same traffic on SGLang (as rendered, and its defaults) and "
                      "TensorRT-LLM (GUARANTEED_NO_EVICT, MAX_UTILIZATION), each simulated with its own "
                      "admission rule."),
])


policy_options = grouped("policy", PolicyArgs, [
    click.option("--model", "-m", "model",
                 help="config.json, model directory, preset name or hub id.  [default: the model the logs name, "
                      "when it is a preset's hub id (or its -Instruct/-Chat variant), a local model directory or "
                      "a hub id in the Hugging Face cache]"),
    click.option("--served-model", help="What the engine loads (hub id or path).  [default: the model the logs "
                 "name, else the model's hub id]"),
    click.option("--upstream", default="http://127.0.0.1:8000", show_default=True,
                 help="The engine server the gateway configs point at."),
    click.option("--vllm-version", metavar="TEXT", help="The older name of --engine-version."),
    click.option("--safety-fraction", type=float,
                 help="Share of usable KV blocks the gateway may reserve.  [default: 0.9]"),
    click.option("--max-truncation", type=float,
                 help="Pick the smallest cap whose expected truncation share is ≤ F (e.g. 0.01) instead of p95/p99; "
                      "with --objective, rows whose caps cut more answers are infeasible.  [default with "
                      "--objective: the share the p95/p99 tail rule cuts]"),
    click.option("--route-header", metavar="NAME",
                 help="With --route-by FIELD: the request header that carries the group at request time; the "
                      "gateways cap each group by its exact value (set it in a trusted layer in front: a client "
                      "that sets it picks its own cap). Without it, per-group caps are refused."),
])


def _gateway_tokenizer(given: str | None, candidates: tuple[str | None, ...]) -> str | None:
    """The model directory gateway.yaml counts prompts with (None: the upstream's /tokenize):
    the one given, else the first candidate that holds a tokenizer and a chat template."""
    from kvtune.deploy.render import local_chat_tokenizer

    if given == "upstream":
        return None
    if given is not None:
        found = local_chat_tokenizer(given)
        if found is None:
            raise OptionError(f"{given!r} is not a local model directory with tokenizer.json and a chat "
                              "template (tokenizer_config.json chat_template or chat_template.jinja); "
                              "pass --gateway-tokenizer upstream to count with vLLM's /tokenize",
                              field="--gateway-tokenizer")
        return found
    return next(filter(None, map(local_chat_tokenizer, candidates)), None)


OBJECTIVE_HELP = """\b
With --objective, every row of the what-if table is one configuration simulated on the
logged traffic (`kvtune simulate`'s engine and the gateway's own admission code), the mean
of seeds --seed, +1, +2: direct to vLLM with today's defaults (a reference), then the
guaranteed policy at each cap level (tail rule, p90, p95, p99, p99.9) × budget (safety 0.8,
0.9, 1.0), then statistical ε=0.001/0.01/0.05 and overcommit ×1.25/1.5/2/3 at each cap level
(guaranteed only with --max-preemption-rate 0), then the whole-context reservation (a
reference). The row with the most output tokens/s (goodput) within the constraints is
rendered, its admission policy in gateway.yaml (and nginx.conf).
recommendation.json then carries `objective` and `what_if`, and `kvtune check` on it
simulates the deployed files against that objective. With one --capacity FILE per engine
replica (or --replicas N and one FILE for all), every row is simulated on all of them (each
on its share of the load, in proportion to its KV blocks, with its own budget and engine
limits): the table shows the deployment's totals, and each replica's own figures follow it.

\b
Exit codes: 0 done, 1 no configuration meets the objective (the table is shown, nothing is
written) or the rendered files would fail `kvtune check`, 2 bad input.
"""


@click.command(epilog=OBJECTIVE_HELP)
@click.argument("logs", nargs=-1, required=True)
@policy_options
@capacity_options
@log_options
@objective_options
@click.option("--gateway-tokenizer", metavar="DIR|upstream",
              help="Model directory (tokenizer.json + chat template) gateway.yaml counts prompts with, in "
                   "process; `upstream` counts with vLLM's /tokenize instead (one more round trip per "
                   "request).  [default: the --served-model, --model or --tokenizer directory that holds "
                   "both, else upstream; for TensorRT-LLM, which has no /tokenize, the served model's hub id, "
                   "which `kvtune gateway` loads from the Hugging Face cache at start]")
@click.option("--replicas", type=click.IntRange(min=1), metavar="N",
              help="N engine replicas behind gateway.yaml, each with the recommended budget (one engine's): "
                   "--upstream's port and the N-1 ports after it, one engine per port (edit gateway.yaml's "
                   "upstreams: for replicas on other hosts); with one --capacity FILE, N replicas of it, as if "
                   "FILE were given N times. With one --capacity FILE per replica, each upstream's budget, "
                   "max_num_seqs and max_num_batched_tokens are its own (its URL the file's origin), and with "
                   "--objective each replica is simulated on its share of the logged load (the whole "
                   "deployment's). nginx.conf holds each upstream's "
                   "budget under its own key (not for admission: statistical).  "
                   "[default: the --capacity files' count, else 1]")
@click.option("--nginx-replicas", type=click.IntRange(min=1), default=1, show_default=True, metavar="M",
              help="M nginx replicas in front of the engine: nginx.conf's ledger (a lua_shared_dict) cannot be "
                   "shared across machines, so each nginx holds a static slice, floor(budget / M) blocks, stated "
                   "in its header. A request bigger than a slice is refused (413) and idle slices cannot be "
                   "lent; gateway.yaml with a Redis ledger shares one exact budget instead.")
@click.option("--health-interval", type=click.FloatRange(min=0.05), default=1.0, show_default=True, metavar="S",
              help="With several replicas: both gateways ask each one GET --health-path every S seconds and take "
                   "it out (its budget with it) until it answers 200.")
@click.option("--health-timeout", type=click.FloatRange(min=0.01), default=1.0, show_default=True, metavar="S",
              help="An answer to the health probe later than S seconds counts as a failure.")
@click.option("--health-path", default="/health", show_default=True, metavar="PATH",
              help="The path the health probe asks (vLLM and SGLang answer /health).")
@click.option("--health-failures", type=click.IntRange(min=0, max=1_000_000), default=5, show_default=True,
              metavar="N", help="Passive health, with several replicas: both gateways eject a replica whose last N "
                                "answers were 5xx (or failed connections), whatever its /health says; 0: off.")
@click.option("--health-ejection", type=click.FloatRange(min=0.01, max=86_400), default=2.0, show_default=True,
              metavar="S", help="A passive ejection lasts S seconds, doubled at each ejection in a row.")
@click.option("--health-max-ejection", type=click.FloatRange(min=0.01, max=86_400), default=60.0, show_default=True,
              metavar="S", help="The longest a passive ejection lasts.")
@click.option("--health-max-ejected-share", type=click.FloatRange(min=0.0, max=1.0), default=0.5, show_default=True,
              metavar="F", help="At most this share of the replicas (one at least, never the last) ejected at once.")
@click.option("--gateway-replicas", type=click.IntRange(1, 64), default=1, show_default=True, metavar="N",
              help="Gateway replicas in k8s/gateway.yaml's Deployment; above 1 they share the Redis ledger "
                   "k8s/redis.yaml runs (vLLM only: the Kubernetes manifests).")
@click.option("--out", "out_dir", type=click.Path(), help="Write the deploy files into DIR (all of them, or none): "
              "the engine's launch files, the gateway configs, the reports, estimates.json/.yaml and, for vLLM, "
              "the Kubernetes manifests in DIR/k8s/.")
@click.option("--json", "json_", is_flag=True, help="Print the recommendation and rendered files as one JSON object.")
def recommend(logs: tuple[str, ...], policy: PolicyArgs, capacity: CapacityArgs, log: LogArgs,
              objective: ObjectiveArgs, gateway_tokenizer: str | None, replicas: int | None, nginx_replicas: int,
              health_interval: float, health_timeout: float, health_path: str, health_failures: int,
              health_ejection: float, health_max_ejection: float, health_max_ejected_share: float,
              gateway_replicas: int, out_dir: str | None, json_: bool) -> None:
    """Recommend output caps, a KV block budget and engine settings from real traffic.

    LOGS are log files, directories or globs (any format `kvtune profile` reads), or one
    profile saved with `kvtune profile --save`. Every number comes with the rule behind it.
    Before writing, the rendered files are held to `kvtune check`; exit 1 and nothing written
    if one would fail it.

    \b
    Example:
        kvtune recommend sample_logs/ --model llama-3.1-8b --gpu H100-80GB --out deploy/
        kvtune recommend sample_logs/ --model llama-3.1-8b --gpu H100-80GB --engine sglang --out deploy/
        kvtune recommend sample_logs/ --model llama-3.1-8b --gpu H100-80GB --slo tpot=50 --out deploy/
        kvtune recommend sample_logs/ --model llama-3.1-8b --gpu L4 --capacity capacity.json \\
            --objective throughput --max-preemption-rate 0.01 --max-429-share 0.01 --out deploy/
    """
    import kvtune
    from kvtune.cli._recommend_view import search_progress
    from kvtune.deploy.k8s import K8sOptions
    from kvtune.deploy.render import NGINX_ONE_ENGINE, RenderOptions, replica_upstreams

    files_given = capacity.capacity_files
    if replicas is None:
        replicas = max(1, len(files_given))
    elif len(files_given) > 1 and replicas != len(files_given):
        raise OptionError(f"{replicas} replicas, but {len(files_given)} --capacity files (one per replica): "
                          "give as many of each, or leave --replicas out", field="--replicas")
    fallback_urls = [policy.upstream]
    if replicas > 1:  # ports in range, before any work
        fallback_urls = replica_upstreams(policy.upstream, replicas, field="--replicas")
    if gateway_tokenizer == "upstream" and not engine_facts(capacity.engine).HAS_TOKENIZE:
        raise OptionError(f"{ENGINE_TITLES[capacity.engine]}'s server has no /tokenize to count with: leave "
                          "--gateway-tokenizer out (the served model's tokenizer, by its hub id) or give a model "
                          "directory", field="--gateway-tokenizer")
    counting_with = _gateway_tokenizer(gateway_tokenizer, (policy.served_model, policy.model, log.tokenizer))
    from kvtune.policy.search import InfeasibleObjectiveError

    # one capacity file for N replicas: N identical replicas, each at its share of the load (the logs
    # are the whole deployment's traffic), on the ports from --upstream's (one origin cannot be N servers)
    replica_files = files_given if len(files_given) > 1 else files_given * replicas if replicas > 1 else ()
    from kvtune.gateway.config import HealthProbe

    render_options = RenderOptions(replicas=replicas, nginx_replicas=nginx_replicas,
                                   health=HealthProbe(health_interval, health_timeout, health_path,
                                                      consecutive_failures=health_failures,
                                                      ejection_s=health_ejection,
                                                      max_ejection_s=health_max_ejection,
                                                      max_ejected_share=health_max_ejected_share))
    try:
        with search_progress(objective.objective is not None and sys.stderr.isatty()) as progress:
            rec = policy.recommendation(logs, capacity, log, objective, progress, replica_files, tuple(fallback_urls),
                                        from_origin=len(files_given) > 1)
    except InfeasibleObjectiveError as exc:
        _infeasible(exc, json_)
        return
    if rec.feasibility is not None and not rec.feasibility.fits:
        _refuse(rec, json_)
        return
    try:
        files = kvtune.render(rec, options=render_options, gateway_tokenizer=counting_with,
                              k8s=K8sOptions(gateway_replicas=gateway_replicas))
    except kvtune.RenderCheckError as exc:
        for f in exc.result.findings:
            line = f"Error: the rendered {f.source} would fail `kvtune check`: {f.code}: {f.message}"
            click.echo(escape_controls(line), err=True)
        click.echo("Error: nothing was written; this is a kvtune bug or a hostile log: please report it", err=True)
        click.get_current_context().exit(1)
    if "nginx.conf" not in files and not engine_facts(rec.engine.name).HAS_TOKENIZE:
        click.echo(f"Note: nginx.conf is not rendered for {ENGINE_TITLES[rec.engine.name]}: its server has no "
                   "/tokenize and nginx cannot run a tokenizer (gateway.yaml counts with "
                   f"{counting_with or rec.served_model or rec.model} in process; nginx.conf only with an "
                   "estimate)", err=True)
    if replicas > 1 and "nginx.conf" not in files and rec.admission.kind.value == "statistical":
        click.echo(f"Note: nginx.conf is not rendered for {replicas} replicas: {NGINX_ONE_ENGINE}", err=True)
    written = kvtune.write_files(out_dir, files) if out_dir else []
    if json_:
        click.echo(json.dumps({"recommendation": rec.to_dict(), "files": files}, indent=2))
        return
    from kvtune.cli._recommend_view import show_recommendation

    show_recommendation(rec, [str(p) for p in written])
    if nginx_replicas > 1 or replicas > 1:
        from kvtune.cli._recommend_view import show_upstream_budgets

        show_upstream_budgets(rec, render_options)


def _refuse(rec, json_: bool) -> None:
    """The deployment cannot run the logged traffic: nothing rendered or written, the reasons and
    one line that would fix it on stderr (the verdict in --json too), exit 1."""
    verdict = rec.feasibility
    if json_:
        click.echo(json.dumps({"recommendation": rec.to_dict(), "files": {}, "error": verdict.why}, indent=2))
    click.echo(escape_controls(f"Error: this deployment cannot serve the logged traffic: {verdict.why}"), err=True)
    click.echo(escape_controls(f"Fix: {verdict.fix}"), err=True)
    click.echo("Nothing was written.", err=True)
    click.get_current_context().exit(1)


def _infeasible(exc, json_: bool) -> None:
    """No row meets the objective: the table anyway (stdout), the reason on stderr, exit 1."""
    if json_:
        objective = {k: v for k, v in exc.objective.to_dict().items() if k != "traffic"}
        click.echo(json.dumps({"recommendation": None, "objective": objective,
                               "what_if": [r.to_dict() for r in exc.rows], "error": str(exc)}, indent=2))
    else:
        from kvtune.cli._recommend_view import show_what_if

        show_what_if(exc.rows, exc.objective)
    click.echo(escape_controls(f"Error: {exc}"), err=True)
    click.get_current_context().exit(1)
