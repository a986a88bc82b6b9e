"""`kvtune recommend`: traffic + model + capacity → caps, KV budget, engine settings and deploy files."""

from __future__ import annotations

import json
import sys

import click

from kvtune import api
from kvtune.cli._vocabulary import SectionedCommand, quiet_option
from kvtune.cli.options import CapacityArgs, LogArgs, capacity_options, log_options
from kvtune.cli.policy_options import ObjectiveArgs, PolicyArgs, objective_options, policy_options
from kvtune.controls import escape_controls
from kvtune.engines import ENGINE_TITLES, engine_facts
from kvtune.errors import OptionError


def _gateway_tokenizer(given: str | None, candidates: tuple[str | None, ...]) -> str | None:
    """The model directory gateway.yaml counts prompts with (None: the upstream's /tokenize):
    the one given, else the first candidate that holds a tokenizer and a chat template."""
    from kvtune.deploy.render import local_chat_tokenizer  # jinja2: only once recommend runs

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


@click.command(cls=SectionedCommand, epilog=OBJECTIVE_HELP)
@quiet_option()
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
@click.option("--out", "out_dir", type=click.Path(), metavar="DIR",
              help="Write the deploy files into DIR (all of them, or none): the engine's launch files, the "
              "gateway configs, the reports, estimates.json/.yaml and, for vLLM, the Kubernetes manifests in "
              "DIR/k8s/.")
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
    from kvtune.cli._recommend_view import (
        search_progress,
        show_recommendation,
        show_upstream_budgets,
    )  # rich, jinja2 and the what-if table's words: only once recommend runs, not for --help

    files_given = capacity.capacity_files
    if replicas is None:
        replicas = max(1, len(files_given))
    elif len(files_given) > 1 and replicas != len(files_given):
        raise OptionError(f"{replicas} replicas, but {len(files_given)} --capacity files (one per replica): "
                          "give as many of each, or leave --replicas out", field="--replicas")
    if gateway_tokenizer == "upstream" and not engine_facts(capacity.engine).HAS_TOKENIZE:
        raise OptionError(f"{ENGINE_TITLES[capacity.engine]}'s server has no /tokenize to count with: leave "
                          "--gateway-tokenizer out (the served model's tokenizer, by its hub id) or give a model "
                          "directory", field="--gateway-tokenizer")
    counting_with = _gateway_tokenizer(gateway_tokenizer, (policy.served_model, policy.model, log.tokenizer))
    render_options = api.RenderOptions(replicas=replicas, nginx_replicas=nginx_replicas,
                                       health=api.HealthProbe(health_interval, health_timeout, health_path,
                                                              consecutive_failures=health_failures,
                                                              ejection_s=health_ejection,
                                                              max_ejection_s=health_max_ejection,
                                                              max_ejected_share=health_max_ejected_share))
    measured = capacity.measurement()
    deployment = capacity.deployment(policy.model, replicas)
    try:
        with search_progress(objective.objective is not None and sys.stderr.isatty()) as progress:
            rec = api.recommend(lambda: log.profile(logs), deployment,
                                   objective.with_flow(policy.as_policy(log.route_by, objective.bound())),
                                   objective.as_objective(),
                                   measured=measured, progress=progress)
    except api.InfeasibleObjectiveError as exc:
        _infeasible(exc, json_)
        return
    if rec.feasibility is not None and not rec.feasibility.fits:
        _refuse(rec, json_)
        return
    try:
        files = api.render(rec, options=render_options, gateway_tokenizer=counting_with,
                              k8s=api.K8sOptions(gateway_replicas=gateway_replicas))
    except api.RenderCheckError as exc:
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
        from kvtune.deploy.render import NGINX_ONE_ENGINE  # jinja2: only once recommend runs

        click.echo(f"Note: nginx.conf is not rendered for {replicas} replicas: {NGINX_ONE_ENGINE}", err=True)
    written = api.write_files(out_dir, files) if out_dir else []
    if json_:
        click.echo(json.dumps({"recommendation": rec.to_dict(), "files": files}, indent=2))
        return
    show_recommendation(rec, [str(p) for p in written])
    if nginx_replicas > 1 or replicas > 1:
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
        from kvtune.cli._recommend_view import show_what_if  # rich: only for the table

        show_what_if(exc.rows, exc.objective)
    click.echo(escape_controls(f"Error: {exc}"), err=True)
    click.get_current_context().exit(1)
