"""`kvtune check`: gate deployed configs against the traffic in CI (exit 1 on risk findings)."""

from __future__ import annotations

import json

import click

from kvtune.cli.options import CapacityArgs, LogArgs, capacity_options, log_options
from kvtune.cli.recommend import PolicyArgs, policy_options
from kvtune.deploy.check import Severity
from kvtune.errors import InputError
from kvtune.userfiles import brief

_STYLE = {Severity.RISK: ("RISK", "red"), Severity.WARN: ("WARN", "yellow"), Severity.INFO: ("info", "blue")}


def _saved_recommendation(paths: tuple[str, ...]):
    """A recommendation.json written by `kvtune recommend --out` instead of logs (read back
    strictly), or None."""
    from kvtune.policy.recommendation import load_recommendation, looks_like_recommendation

    if len(paths) != 1 or not paths[0].endswith(".json") or not looks_like_recommendation(paths[0]):
        return None
    return load_recommendation(paths[0])


@click.command()
@click.argument("logs", nargs=-1, required=True)
@click.option("--deployed", "deployed_paths", multiple=True, required=True, type=click.Path(), metavar="FILE",
              help="A vllm serve command line or script, a gateway.yaml, or an nginx.conf rendered by "
                   "kvtune. Repeat to check an engine and its gateway together.")
@policy_options
@capacity_options
@log_options
@click.option("--json", "json_", is_flag=True, help="Print {deployed, findings, passed, notes} as JSON (notes: the "
              "recommendation's, first the files its logs did not read).")
def check(logs: tuple[str, ...], policy: PolicyArgs, capacity: CapacityArgs, log: LogArgs,
          deployed_paths: tuple[str, ...], json_: bool) -> None:
    """Check deployed configs against real traffic: exit 1 on risk, 0 when fine.

    LOGS are the logs (or a saved profile) the recommendation is computed from, or a
    recommendation.json written by `kvtune recommend --out`. Findings cover uncapped output,
    caps that truncate more than the budget, KV reservations beyond capacity (on an estimated
    capacity, the pool the engine file's own flags leave), max_model_len that rejects logged
    prompts or does not fit that pool, and drift from the current recommendation.

    \b
    Example:
        kvtune check sample_logs/ --model llama-3.1-8b --gpu H100-80GB \\
            --deployed deploy/vllm-serve.sh --deployed deploy/gateway.yaml
    """
    import kvtune

    rec = _saved_recommendation(logs)
    if rec is None:
        rec = policy.recommendation(logs, capacity, log)
    elif policy.model not in (rec.model, rec.served_model):
        raise InputError(f"the recommendation is for {brief(rec.model)}, not {brief(policy.model)}", path=logs[0],
                         field="model")
    result = kvtune.check(rec, deployed_paths, max_truncation=policy.max_truncation)
    deployed = result.deployed

    if json_:
        click.echo(json.dumps({**result.to_dict(), "notes": list(rec.notes)}, indent=2))
    else:
        for finding in result.findings:
            label, color = _STYLE[finding.severity]
            where = f" [{finding.source}]" if finding.source and len(deployed) > 1 else ""
            click.echo(f"{click.style(label, fg=color, bold=True)} {finding.code}{where}: {finding.message}")
            click.echo(f"     why: {finding.why}")
        risks = sum(f.severity is Severity.RISK for f in result.findings)
        warns = sum(f.severity is Severity.WARN for f in result.findings)
        verdict = "passed" if result.passed else "FAILED"
        click.echo(f"{verdict}: {risks} risk, {warns} warning(s) in {', '.join(deployed_paths)}")
    if not result.passed:
        click.get_current_context().exit(1)
