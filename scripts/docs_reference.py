"""The generated parts of the docs site: the CLI reference from the click commands themselves and
the Python API reference from kvtune.api's signatures and docstrings, so neither can go stale.

mkdocs.yml loads this file as a hook: a page holding `<!-- kvtune: cli-reference -->` or
`<!-- kvtune: api-reference -->` gets the generated Markdown in its place at build time.
tests/unit/test_docs.py calls the same functions.
"""

from __future__ import annotations

import inspect
from typing import Any

import click

import kvtune
from kvtune import api
from kvtune.cli import COMMANDS, cli
from kvtune.cli._vocabulary import help_sections

CLI_MARKER = "<!-- kvtune: cli-reference -->"
API_MARKER = "<!-- kvtune: api-reference -->"
HELP_WIDTH = 78  # click wraps help at min(terminal, 80) - 2 columns: what any terminal of 80 or more shows


def _context(command: click.Command, name: str, parent: click.Context | None = None) -> click.Context:
    return click.Context(command, info_name=name, parent=parent, terminal_width=HELP_WIDTH)


def command_help(name: str) -> str:
    """What `kvtune NAME --help` prints on a terminal of 80 columns or more."""
    group = _context(cli, "kvtune")
    command = cli.get_command(group, name)
    if command is None:
        raise LookupError(f"kvtune has no command {name!r}")
    return command.get_help(_context(command, name, group))


def visible_options(name: str) -> list[click.Option]:
    """The options `kvtune NAME --help` lists (hidden aliases left out), in its order."""
    command = cli.get_command(_context(cli, "kvtune"), name)
    assert command is not None
    return [p for p in command.params if isinstance(p, click.Option) and not p.hidden]


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _option_row(option: click.Option) -> str:
    names = ", ".join(f"`{n}`" for n in option.opts + option.secondary_opts)
    if option.is_flag:
        kind = "flag"
    else:
        kind = _cell(option.metavar or option.type.get_metavar(option, click.Context(click.Command("x"))) or
                     option.type.name.upper())
    return f"| {names} | {kind} | {_default(option.default)} | {_cell(option.help or '')} |"


def _default(value: Any) -> str:
    """A plain default as code; none, a computed one or click's unset marker as blank."""
    if isinstance(value, bool):
        return "on" if value else ""
    if isinstance(value, (str, int, float)):
        return f"`{_cell(str(value))}`" if str(value) else ""
    if isinstance(value, (tuple, list)) and all(isinstance(v, (str, int, float)) for v in value):
        return ", ".join(f"`{_cell(str(v))}`" for v in value)
    return ""


def cli_reference() -> str:
    """Markdown for every command: its summary, its --help verbatim and a table of its options, in
    --help's order with the section each is listed under."""
    parts = [f"kvtune {kvtune.__version__}: `kvtune --help` lists the commands below; each section is "
             "generated from the command itself when the site is built.\n",
             "```text\n" + cli.get_help(_context(cli, "kvtune")) + "\n```\n"]
    for name, (_, _, summary) in COMMANDS.items():
        parts.append(f"## `kvtune {name}`\n\n{summary}\n")
        parts.append("```text\n" + command_help(name) + "\n```\n")
        rows = [_option_row(option) + f" {title} |"
                for title, options in help_sections(name, visible_options(name)) for option in options]
        parts.append("| option | value | default | meaning | in --help |\n|---|---|---|---|---|\n" + "\n".join(rows) +
                     "\n")
    return "\n".join(parts)


def _signature(obj: Any) -> str:
    """The signature as source reads it: one parameter a line, annotations unquoted."""
    try:
        signature = inspect.signature(obj)
    except (TypeError, ValueError):
        return "(…)"
    params: list[str] = []
    star_done = False
    for param in signature.parameters.values():
        if param.kind is param.KEYWORD_ONLY and not star_done:
            params.append("*")
        if param.kind in (param.KEYWORD_ONLY, param.VAR_POSITIONAL):
            star_done = True
        stars = "*" if param.kind is param.VAR_POSITIONAL else "**" if param.kind is param.VAR_KEYWORD else ""
        text = stars + param.name
        if param.annotation is not param.empty:
            text += f": {_annotation(param.annotation)}"
        if param.default is not param.empty:
            text += f" = {param.default!r}" if param.annotation is not param.empty else f"={param.default!r}"
        params.append(text)
    returns = "" if signature.return_annotation is signature.empty else \
        f" -> {_annotation(signature.return_annotation)}"
    if not params:
        return f"(){returns}"
    return "(\n" + "".join(f"    {p},\n" for p in params) + f"){returns}"


def _annotation(annotation: Any) -> str:
    return annotation if isinstance(annotation, str) else inspect.formatannotation(annotation)


def api_reference() -> str:
    """Markdown for every name `kvtune` exports: its signature and its docstring."""
    parts = ["### `kvtune.api`\n", "```text\n" + inspect.cleandoc(api.__doc__ or "") + "\n```\n"]
    for name in kvtune.__all__:
        obj = getattr(kvtune, name)
        if name == "__version__":
            parts.append(f"### `kvtune.__version__`\n\nThe installed version, `{obj}`.\n")
            continue
        kind = "class" if inspect.isclass(obj) else "def"
        parts.append(f"### `kvtune.{name}`\n")
        signature = _signature(obj).removesuffix(" -> None") if kind == "class" else _signature(obj)
        parts.append(f"```python\n{kind} {name}{signature}\n```\n")
        doc = inspect.getdoc(obj) or ""
        parts.append("```text\n" + doc + "\n```\n" if doc else "")
    return "\n".join(parts)


def on_page_markdown(markdown: str, **_: Any) -> str:
    """mkdocs hook: put the generated references where their markers are."""
    if CLI_MARKER in markdown:
        markdown = markdown.replace(CLI_MARKER, cli_reference())
    if API_MARKER in markdown:
        markdown = markdown.replace(API_MARKER, api_reference())
    return markdown
