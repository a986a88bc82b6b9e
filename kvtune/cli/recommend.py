"""`kvtune recommend`: traffic + model + capacity → caps, KV budget, engine settings and deploy files."""

from __future__ import annotations

import json
from dataclasses import dataclass

import click

from kvtune.cli.options import CapacityArgs, LogArgs, capacity_options, grouped, log_options
from kvtune.errors import OptionError
from kvtune.policy.rules import CURRENT_VLLM_VERSION


@dataclass(frozen=True, slots=True)
class PolicyArgs:
    """The model and what the user decided about the policy, as `recommend` and `check` take them."""

    model: str
    served_model: str | None
    upstream: str
    vllm_version: str
    safety_fraction: float | None
    max_truncation: float | None

    def recommendation(self, logs: tuple[str, ...], capacity: CapacityArgs, log: LogArgs):
        """The whole pipeline, as library calls: profile the logs, plan the capacity, apply the rules."""
        import kvtune

        profile = log.profile(logs)
        return kvtune.recommend(profile, capacity.plan(self.model), safety_fraction=self.safety_fraction,
                                max_truncation=self.max_truncation, vllm_version=self.vllm_version,
                                upstream=self.upstream, route_by=log.route_by, served_model=self.served_model)


policy_options = grouped("policy", PolicyArgs, [
    click.option("--model", "-m", "model", required=True,
                 help="config.json, model directory, preset name or hub id."),
    click.option("--served-model", help="What `vllm serve` loads (hub id or path).  [default: the model's hub id]"),
    click.option("--upstream", default="http://127.0.0.1:8000", show_default=True,
                 help="The vLLM the gateway configs point at."),
    click.option("--vllm-version", default=CURRENT_VLLM_VERSION, show_default=True,
                 help="Target vLLM release; 0.6 … 0.7 are V0-era (swap and --preemption-mode)."),
    click.option("--safety-fraction", type=float,
                 help="Share of usable KV blocks the gateway may reserve.  [default: 0.9]"),
    click.option("--max-truncation", type=float,
                 help="Pick the smallest cap whose expected truncation share is ≤ F (e.g. 0.01) instead of p95/p99."),
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


@click.command()
@click.argument("logs", nargs=-1, required=True)
@policy_options
@capacity_options
@log_options
@click.option("--gateway-tokenizer", metavar="DIR|upstream",
              help="Model directory (tokenizer.json + chat template) gateway.yaml counts prompts with, in "
                   "process; `upstream` counts with vLLM's /tokenize instead (one more round trip per "
                   "request).  [default: the --served-model, --model or --tokenizer directory that holds "
                   "both, else upstream]")
@click.option("--out", "out_dir", type=click.Path(), help="Write the deploy files into DIR (all of them, or none).")
@click.option("--json", "json_", is_flag=True, help="Print the recommendation and rendered files as one JSON object.")
def recommend(logs: tuple[str, ...], policy: PolicyArgs, capacity: CapacityArgs, log: LogArgs,
              gateway_tokenizer: str | None, out_dir: str | None, json_: bool) -> None:
    """Recommend output caps, a KV block budget and vLLM settings from real traffic.

    LOGS are log files, directories or globs (any format `kvtune profile` reads), or one
    profile saved with `kvtune profile --save`. Every number comes with the rule behind it.
    Before writing, the rendered files are held to `kvtune check`; exit 1 and nothing written
    if one would fail it.

    \b
    Example:
        kvtune recommend sample_logs/ --model llama-3.1-8b --gpu H100-80GB --out deploy/
    """
    import kvtune

    counting_with = _gateway_tokenizer(gateway_tokenizer, (policy.served_model, policy.model, log.tokenizer))
    rec = policy.recommendation(logs, capacity, log)
    try:
        files = kvtune.render(rec, gateway_tokenizer=counting_with)
    except kvtune.RenderCheckError as exc:
        for f in exc.result.findings:
            click.echo(f"Error: the rendered {f.source} would fail `kvtune check`: {f.code}: {f.message}", err=True)
        click.echo("Error: nothing was written; this is a kvtune bug or a hostile log: please report it", err=True)
        click.get_current_context().exit(1)
    written = kvtune.write_files(out_dir, files) if out_dir else []
    if json_:
        click.echo(json.dumps({"recommendation": rec.to_dict(), "files": files}, indent=2))
        return
    from kvtune.cli._recommend_view import show_recommendation

    show_recommendation(rec, [str(p) for p in written])
