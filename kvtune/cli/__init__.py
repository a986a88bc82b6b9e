"""The `kvtune` command group: one module per command, loaded only when that command runs.

The group is also the one place where a KvtuneError becomes an error line and exit code 2.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import re

# kvtune does no linear algebra: OpenBLAS's thread pool would only add ~50 ms to numpy's import
# (and idle threads). Set before anything imports numpy; a value the user set wins.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import click

from kvtune.errors import KvtuneError
from kvtune.version import __version__

# command name -> (module under kvtune.cli, attribute, one-line help shown by `kvtune --help`)
COMMANDS: dict[str, tuple[str, str, str]] = {
    "kv": ("kv", "kv", "KV-cache bytes per token for a model, by layer kind, TP and PP."),
    "capacity": ("capacity", "capacity", "How many tokens, blocks and requests fit on given GPUs."),
    "profile": ("profile", "profile", "Per-route output and prompt length distributions from logs."),
    "recommend": ("recommend", "recommend", "Caps, KV budget and engine settings from traffic; renders deploy files."),
    "calibrate": ("calibrate", "calibrate",
                  "Read the real KV capacity of a running vLLM (/v1/models, /metrics) into a file."),
    "check": ("check", "check", "Gate a deployed vllm/gateway/nginx config against traffic (exit 1 on risk)."),
    "bench": ("bench", "bench",
              "Replay profiled traffic against a live server, scrape /metrics, judge (exit 1 on fail)."),
    "simulate": ("simulate", "simulate",
                 "Predict throughput, latency, preemptions and 429s of traffic on a vLLM configuration."),
    "gateway": ("gateway", "gateway",
                "Run the admission gateway: reserve KV per request, 429 + Retry-After when full."),
}


class KvtuneGroup(click.Group):
    """A click group whose commands import lazily and whose user errors exit 2 in one line."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return [name for name in COMMANDS if self._module_exists(name)]

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name not in COMMANDS or not self._module_exists(name):
            return None
        module_name, attr, _ = COMMANDS[name]
        module = importlib.import_module(f"kvtune.cli.{module_name}")
        return getattr(module, attr)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        rows = [(name, COMMANDS[name][2]) for name in self.list_commands(ctx)]
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except KvtuneError as exc:
            from kvtune.controls import escape_controls  # its pattern compiles only for an error line

            name = ctx.invoked_subcommand
            command = self.get_command(ctx, name) if name else None
            if command is not None:
                _name_the_flags(exc, command)
            click.echo(escape_controls(f"Error: {exc}"), err=True)
            ctx.exit(2)

    @staticmethod
    def _module_exists(name: str) -> bool:
        return importlib.util.find_spec(f"kvtune.cli.{COMMANDS[name][0]}") is not None


def _name_the_flags(exc: KvtuneError, command: click.Command) -> None:
    """The library says what is wrong in its own parameter names (gpu_memory, or `gpu` quoted
    when the name is also a word); on the command line the user fixes it with a flag
    (--gpu-memory, --gpu), so the error names the flag."""
    flags = {p.name: max(p.opts, key=len) for p in command.params if isinstance(p, click.Option) and p.name}
    flags.update({p.name: p.human_readable_name for p in command.params
                  if isinstance(p, click.Argument) and p.name})
    if exc.field in flags:
        exc.field = flags[exc.field]
    for name, flag in flags.items():
        exc.message = exc.message.replace(f"`{name}`", flag)
        if "_" in name and name in exc.message:
            exc.message = re.sub(rf"\b{re.escape(name)}\b", flag, exc.message)


@click.group(cls=KvtuneGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="kvtune")
def cli() -> None:
    """Size KV cache, output caps and admission for self-hosted LLM serving.

    \b
    Example:
        kvtune capacity llama-3.1-8b --gpu H100-80GB --prompt-tokens 2000 --max-tokens 512
    """


def main() -> None:
    cli(prog_name="kvtune")


if __name__ == "__main__":  # pragma: no cover
    main()
