"""One vocabulary on the command line (docs/reference/conventions.md holds the table): the words
every command shares — MODEL or -m/--model, --save FILE, -q/--quiet — old spellings kept as hidden
aliases for one release, and `--help` of the long commands in sections.

Each piece is a decorator over a command's declaration, so a command body keeps its parameters.
The sections are one table here read by a small click.Command subclass rather than the
click-option-group library, whose `optgroup.option` would redeclare every option, where the
shared groups (log_options, capacity_options) sit in different sections in different commands.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable, Iterable
from typing import Any

import click


def deprecation_line(old: str, new: str) -> str:
    """What an old spelling prints on stderr, once per run."""
    return f"Warning: {old} is deprecated; use {new} (removed in the next release)"


def _given(value: Any) -> bool:
    return value is not None and value != () and value is not False


def warn_if_given(old: str, new: str) -> Callable[[click.Context, click.Parameter, Any], Any]:
    """A click callback that prints the deprecation line when the old spelling was used."""
    def callback(ctx: click.Context, param: click.Parameter, value: Any) -> Any:
        if _given(value):
            click.echo(deprecation_line(old, new), err=True)
        return value

    return callback


def renamed(old: str, new: str, dest: str, **option: Any) -> Callable:
    """A hidden option spelled `old` that feeds `dest`, the parameter of the option now spelled
    `new`: a script using the old spelling gets what it got, and one deprecation line."""
    hidden_name = "old_" + old.lstrip("-").replace("-", "_")

    def decorate(f: Callable) -> Callable:
        @functools.wraps(f)
        def command(**kwargs: Any) -> Any:
            value = kwargs.pop(hidden_name)
            if _given(value):
                if _given(kwargs.get(dest)):
                    raise click.UsageError(f"give {new} once ({old} is its old spelling), not both")
                kwargs[dest] = value
            return f(**kwargs)

        return click.option(old, hidden_name, hidden=True, callback=warn_if_given(old, new), **option)(command)

    return decorate


QUIET_HELP = "No human summary on stdout (--json, files written, warnings and errors still are)."


def quiet_option(passed: bool = False) -> Callable:
    """-q/--quiet: the command's human output on stdout goes nowhere; --json still prints, and
    errors still print (the group writes them after the command has returned). `passed`: the
    command also takes `quiet` itself (profile: no progress bar)."""
    def decorate(f: Callable) -> Callable:
        @functools.wraps(f)
        def command(**kwargs: Any) -> Any:
            quiet = kwargs["quiet"] if passed else kwargs.pop("quiet")
            if not quiet or kwargs.get("json_"):
                return f(**kwargs)
            with open(os.devnull, "w", encoding="utf-8") as sink, contextlib.redirect_stdout(sink):
                return f(**kwargs)

        return click.option("-q", "--quiet", is_flag=True, help=QUIET_HELP)(command)

    return decorate


def model_argument(what: str) -> Callable:
    """MODEL as the first argument or as -m/--model, as every other command takes it; one of them."""
    def decorate(f: Callable) -> Callable:
        @functools.wraps(f)
        def command(**kwargs: Any) -> Any:
            option = kwargs.pop("model_option")
            if (kwargs["model"] is None) == (option is None):
                raise click.UsageError("give the model once: as MODEL or as -m/--model" if option is not None
                                       else "Missing argument 'MODEL' (or -m/--model).")
            kwargs["model"] = kwargs["model"] if option is None else option
            return f(**kwargs)

        command = click.option("-m", "--model", "model_option", metavar="MODEL",
                               help=f"{what} (instead of the MODEL argument).")(command)
        return click.argument("model", required=False)(command)

    return decorate


# --help sections of the long commands: section -> parameter names, in the order shown; _LOG and
# _DEPLOYMENT stand for every option of `log_options` and `capacity_options` (cli/options.py, read
# only when help is formatted: `kvtune kv` need not import it).
_LOG, _DEPLOYMENT = "<log_options>", "<capacity_options>"
_OUTPUT = ("out_dir", "out_path", "save_path", "out", "json_", "requests_log", "progress", "quiet")
HELP_SECTIONS: dict[str, dict[str, tuple[str, ...]]] = {
    "recommend": {
        "Inputs": (_LOG,),
        "Deployment": ("model", "served_model", "upstream", "vllm_version", _DEPLOYMENT, "route_header",
                       "gateway_tokenizer", "replicas", "nginx_replicas", "gateway_replicas", "health_interval",
                       "health_timeout", "health_path", "health_failures", "health_ejection",
                       "health_max_ejection", "health_max_ejected_share"),
        "Policy": ("safety_fraction", "max_truncation", "objective", "slo", "max_preemption_rate",
                   "max_429_share", "flow_control", "rate", "concurrency", "requests", "seed", "compare_engines"),
        "Output": _OUTPUT,
    },
    "check": {
        "Inputs": ("deployed_paths", _LOG),
        "Deployment": ("model", "served_model", "upstream", "vllm_version", _DEPLOYMENT, "route_header"),
        "Policy": ("safety_fraction", "max_truncation", "slo"),
        "Output": _OUTPUT,
    },
    "simulate": {
        "Inputs": ("profile_path", "routes", _LOG),
        "Deployment": ("model", "gpu", "gpu_spec", "tp", "pp", "engine_name", "engine_version", "capacity_path",
                       "kv_tokens", "num_gpu_blocks", "max_model_len", "kv_cache_dtype", "gpu_memory_utilization",
                       "max_num_seqs", "max_num_batched_tokens", "gateway_path", "endpoint", "route_header"),
        "Load": ("rate", "burstiness", "concurrency", "replay", "speedup", "max_requests", "duration_s", "seed"),
        "Policy": ("slo",),
        "Output": _OUTPUT,
    },
    "bench": {
        "Inputs": ("profile_path", "routes", _LOG),
        "Requests": ("model", "old_model", "endpoint", "timeout_s", "retry", "max_retries", "ignore_eos",
                     "length_control", "eos_token_id", "api_key", "max_connections", "metrics_url",
                     "scrape_interval"),
        "Load": ("rate", "burstiness", "concurrency", "replay", "speedup", "max_requests", "duration_s", "seed"),
        "Policy": ("slo", "slo_attainment", "expect_path"),
        "Output": _OUTPUT,
    },
    "capacity": {
        "Deployment": ("model_option", _DEPLOYMENT),
        "Request shapes": ("prompt_tokens", "max_tokens"),
        "Output": _OUTPUT,
    },
    "profile": {
        "Inputs": (_LOG, "merge", "trace_max_is_cap"),
        "Output": _OUTPUT,
    },
}
OTHER = "Other options"


def help_sections(command: str, params: Iterable[click.Parameter]) -> list[tuple[str, list[click.Parameter]]]:
    """The command's options by section, in HELP_SECTIONS' order; one not listed is under OTHER."""
    sections = {title: _expanded(names) for title, names in HELP_SECTIONS.get(command, {}).items()}
    other = OTHER if sections else "Options"  # a short command keeps click's one list
    placed: dict[str, list[click.Parameter]] = {title: [] for title in (*sections, other)}
    for param in params:
        if not isinstance(param, click.Option):
            continue
        is_help = "--help" in param.opts
        title = next((t for t, names in sections.items() if param.name in names),
                     list(sections)[-1] if is_help and sections else other)
        placed[title].append(param)
    for title, names in sections.items():
        placed[title].sort(key=lambda p: names.index(p.name) if p.name in names else len(names))
    # decorated last, -q would come first: shown with the output options, before --help
    placed[other].sort(key=lambda p: (p.name == "quiet") + 2 * ("--help" in p.opts))
    return [(title, found) for title, found in placed.items() if found]


def _expanded(names: tuple[str, ...]) -> tuple[str, ...]:
    """The names with _LOG and _DEPLOYMENT replaced by their groups' parameter names."""
    from kvtune.cli.options import CapacityArgs, LogArgs  # start-up time: see _LOG

    groups = {_LOG: tuple(LogArgs.__dataclass_fields__), _DEPLOYMENT: tuple(CapacityArgs.__dataclass_fields__)}
    return tuple(name for given in names for name in groups.get(given, (given,)))


class SectionedCommand(click.Command):
    """A click command whose --help lists its options in sections (click has none built in)."""

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        sections = [(title, [record for p in params if (record := p.get_help_record(ctx)) is not None])
                    for title, params in help_sections(self.name or "", self.get_params(ctx))]
        # one column width for every section, as click's single list would have (at most its 30)
        width = min(30, max((len(term) for _, rows in sections for term, _ in rows), default=0))
        for title, rows in sections:
            if rows:
                with formatter.section(title):
                    formatter.write_dl([(term.ljust(width), text) for term, text in rows])


__all__ = ["HELP_SECTIONS", "QUIET_HELP", "SectionedCommand", "deprecation_line", "help_sections",
           "model_argument", "quiet_option", "renamed", "warn_if_given"]
