"""`kvtune check`: gate deployed configs against the traffic in CI (exit 1 on risk findings)."""

from __future__ import annotations

import json

import click
from click.core import ParameterSource

from kvtune import api
from kvtune.cli._vocabulary import SectionedCommand, quiet_option
from kvtune.cli.options import CapacityArgs, LogArgs, capacity_options, log_options, parse_count
from kvtune.cli.policy_options import PolicyArgs, policy_options
from kvtune.controls import escape_controls
from kvtune.domain.slo import parse_slo
from kvtune.errors import OptionError
from kvtune.gpu_spec import read_gpu_spec
from kvtune.hardware import find_gpu, parse_memory_size
from kvtune.userfiles import brief


def _saved_recommendation(paths: tuple[str, ...]):
    """A recommendation.json written by `kvtune recommend --out` instead of logs (read back
    strictly), or None."""
    from kvtune.policy.recommendation import looks_like_recommendation  # numpy: only once check runs

    if len(paths) != 1 or not paths[0].endswith(".json") or not looks_like_recommendation(paths[0]):
        return None
    return api.load_recommendation(paths[0])


def _file_contradictions(rec, path: str, policy: PolicyArgs, capacity: CapacityArgs) -> None:
    """check RECOMMENDATION.json reads the deployment (model, GPU, engine, tp/pp, release, block size,
    KV dtype, lengths, utilization, upstream, safety fraction) from the file: an option typed on
    the command line that says otherwise is one error line naming it, not silently overridden nor
    obeyed. Options the file has no value for (a measured capacity) would change what the file
    already decided."""
    ctx = click.get_current_context()

    def typed(name: str) -> bool:
        return ctx.get_parameter_source(name) in (ParameterSource.COMMANDLINE, ParameterSource.ENVIRONMENT)

    def setting(name: str):
        decision = rec.settings.get(name)
        return None if decision is None else decision.value

    hw = rec.hardware
    compared = {
        "model": lambda: (policy.model, rec.model, policy.model in (rec.model, rec.served_model)),
        "served_model": lambda: (policy.served_model, rec.served_model, None),
        "upstream": lambda: (policy.upstream, rec.upstream, None),
        "safety_fraction": lambda: (policy.safety_fraction, rec.safety_fraction.value, None),
        "gpu": lambda: (find_gpu(capacity.gpu or "", field="--gpu").name, hw.gpu, None),
        "gpu_spec": lambda: (read_gpu_spec(capacity.gpu_spec or "").name, hw.gpu, None),
        "gpu_memory": lambda: (parse_memory_size(capacity.gpu_memory or "", field="--gpu-memory"),
                               hw.gpu_memory_bytes, None),
        "tp": lambda: (capacity.tp, hw.tensor_parallel_size, None),
        "pp": lambda: (capacity.pp, hw.pipeline_parallel_size, None),
        "engine": lambda: (capacity.engine, rec.engine.name, None),
        "engine_version": lambda: (capacity.engine_version, rec.engine.version, None),
        "vllm_version": lambda: (policy.vllm_version, rec.engine.version, None),
        "block_size": lambda: (capacity.block_size, setting("block_size"), None),
        "kv_cache_dtype": lambda: (capacity.kv_cache_dtype, setting("kv_cache_dtype"), None),
        "max_model_len": lambda: (parse_count(capacity.max_model_len, "--max-model-len"), setting("max_model_len"),
                                  None),
        "max_num_batched_tokens": lambda: (parse_count(capacity.max_num_batched_tokens, "--max-num-batched-tokens"),
                                           setting("max_num_batched_tokens"), None),
        "gpu_memory_utilization": lambda: (capacity.gpu_memory_utilization, setting("gpu_memory_utilization"), None),
    }
    for name, values in compared.items():
        if not typed(name):
            continue
        given, in_file, agrees = values()
        if agrees if agrees is not None else given == in_file:
            continue
        option = "--" + name.replace("_", "-")
        raise OptionError(f"{_shown(given)} contradicts the recommendation's {_shown(in_file)}: check reads the "
                          f"deployment from {brief(path)}; leave {option} out, or recommend again with it",
                          field=option)
    for name in ("kv_tokens", "num_gpu_blocks", "vllm_log", "metrics_url", "capacity_files", "engine_log",
                 "enforce_eager"):
        if typed(name):
            option = "--capacity" if name == "capacity_files" else "--" + name.replace("_", "-")
            raise OptionError(f"the recommendation already holds its capacity ({rec.capacity.source}); "
                              f"recommend again with {option} to check against it", field=option)


def _shown(value) -> str:
    """An option's or the file's value as the error line quotes it."""
    if value is None:
        return "none"
    if isinstance(value, str):
        return brief(value)
    return f"{value:,}" if isinstance(value, int) else str(value)


@click.command(cls=SectionedCommand)
@quiet_option()
@click.argument("logs", nargs=-1, required=True)
@click.option("--deployed", "deployed_paths", multiple=True, required=True, type=click.Path(), metavar="FILE",
              help="A vllm serve command line or script, a gateway.yaml, an nginx.conf rendered by "
                   "kvtune, or a Kubernetes manifest (a vLLM Deployment, a ConfigMap holding gateway.yaml). "
                   "Repeat to check an engine and its gateway together.")
@policy_options
@capacity_options
@log_options
@click.option("--slo", metavar="SPEC", help="The --slo tpot=…,ttft=… the files were recommended with: the "
              "recommendation checked against bounds max_num_seqs the same way.")
@click.option("--json", "json_", is_flag=True, help="Print {deployed, findings, passed, notes} as JSON (notes: the "
              "recommendation's, first the files its logs did not read).")
def check(logs: tuple[str, ...], policy: PolicyArgs, capacity: CapacityArgs, log: LogArgs,
          deployed_paths: tuple[str, ...], slo: str | None, json_: bool) -> None:
    """Check deployed configs against real traffic: exit 1 on risk, 0 when fine.

    LOGS are the logs (or a saved profile) the recommendation is computed from, or a
    recommendation.json written by `kvtune recommend --out`, which names the model, GPU and
    engine itself (an option that contradicts it is an error). Findings cover uncapped output,
    caps that truncate more than the budget, KV reservations beyond capacity (on an estimated
    capacity, the pool the engine file's own flags leave), max_model_len that rejects logged
    prompts or does not fit that pool, and drift from the current recommendation.

    \b
    Example:
        kvtune check sample_logs/ --model llama-3.1-8b --gpu H100-80GB \\
            --deployed deploy/vllm-serve.sh --deployed deploy/gateway.yaml
        kvtune check deploy/recommendation.json --deployed deploy/vllm-serve.sh
        kvtune check deploy/recommendation.json --deployed deploy/k8s/vllm.yaml \\
            --deployed deploy/k8s/gateway.yaml
    """
    rec = _saved_recommendation(logs)
    if rec is None:
        measured = capacity.measurement()
        deployment = capacity.deployment(policy.model)
        rec = api.recommend(lambda: log.profile(logs), deployment,
                               policy.as_policy(log.route_by, parse_slo(slo) if slo else None), measured=measured)
    else:
        if slo is not None:
            raise OptionError("a recommendation.json holds the limits its --slo bounded: check against it "
                              "without --slo", field="--slo")
        _file_contradictions(rec, logs[0], policy, capacity)
    result = api.check(rec, deployed_paths, max_truncation=policy.max_truncation)
    deployed = result.deployed

    if json_:
        click.echo(json.dumps({**result.to_dict(), "notes": list(rec.notes)}, indent=2))
    else:
        from kvtune.deploy.check import Severity  # loaded by api.check already: nothing more at start-up

        # a Kubernetes manifest's findings name the document they come from (k8s/vllm.yaml: Deployment/...)
        documents = any(d.source not in deployed_paths for d in deployed)
        style = {Severity.RISK: ("RISK", "red"), Severity.WARN: ("WARN", "yellow"), Severity.INFO: ("info", "blue")}
        for finding in result.findings:
            label, color = style[finding.severity]
            where = f" [{finding.source}]" if finding.source and (len(deployed) > 1 or documents) else ""
            detail = escape_controls(f"{finding.code}{where}: {finding.message}")
            click.echo(f"{click.style(label, fg=color, bold=True)} {detail}")
            click.echo(escape_controls(f"     why: {finding.why}"))
        risks = sum(f.severity is Severity.RISK for f in result.findings)
        warns = sum(f.severity is Severity.WARN for f in result.findings)
        verdict = "passed" if result.passed else "FAILED"
        click.echo(escape_controls(f"{verdict}: {risks} risk, {warns} warning(s) in {', '.join(deployed_paths)}"))
    if not result.passed:
        click.get_current_context().exit(1)
