"""Which shape of message content a chat template expects, decided as vLLM 0.32 decides it
(renderers/hf.py, _detect_content_format): the same request renders differently under the two,
so a count is only exact under the engine's choice.

  STRING  content is text: parts joined by newlines, a null content ""
  OPENAI  content is a list of {"type": "text", "text": ...} parts (a string becomes one part, a
          null content []), for a template that loops over a message's content

The rule, read from the template's syntax tree: the names bound to `messages` (and to anything
`{% set %}` from them), the loop variables over those, and then OPENAI when some loop iterates a
message's `content` (`m.content`, `m['content']`, through filters, tests or slices), iterates a
macro parameter that a call site passes a message's content, or iterates a bare `content` outside
any macro; STRING otherwise, and when the template does not parse or such a loop (or a `set`
from messages) binds a tuple, where vLLM's walk gives up.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator

from jinja2 import Environment, nodes
from jinja2.exceptions import TemplateError


class ContentFormat(enum.Enum):
    STRING = "string"
    OPENAI = "openai"


def detect_content_format(source: str, environment: Environment) -> ContentFormat:
    """The content format vLLM would detect for this template source."""
    try:
        tree = environment.parse(source)
        return ContentFormat.OPENAI if any(True for _ in _content_loops(tree)) else ContentFormat.STRING
    except (TemplateError, RecursionError, _Undecided):
        return ContentFormat.STRING


class _Undecided(Exception):
    """The walk met a binding it cannot follow (a tuple target)."""


def _name_of(target: nodes.Node) -> str:
    if not isinstance(target, nodes.Name):
        raise _Undecided
    return target.name


def _names(node: nodes.Node, name: str) -> bool:
    return isinstance(node, nodes.Name) and node.ctx == "load" and node.name == name


def _reads(node: nodes.Node, name: str, key: str | None = None) -> bool:
    """`node` reads variable `name` (or its item/attribute `key`), possibly through a filter,
    a test or a slice."""
    if isinstance(node, nodes.Filter):
        return node.node is not None and _reads(node.node, name, key)
    if isinstance(node, nodes.Test):
        return _reads(node.node, name, key)
    if isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Slice):
        return _reads(node.node, name, key)
    if key is None:
        return _names(node, name)
    if isinstance(node, nodes.Getitem):
        return _names(node.node, name) and isinstance(node.arg, nodes.Const) and node.arg.value == key
    if isinstance(node, nodes.Getattr):
        return _names(node.node, name) and node.attr == key
    return False


def _aliases(tree: nodes.Template, name: str) -> list[str]:
    """`name` and every variable `{% set %}` from it, transitively."""
    found = [name]
    queue = [name]
    while queue:
        current = queue.pop(0)
        for assign in tree.find_all(nodes.Assign):
            if _reads(assign.node, current):
                target = _name_of(assign.target)
                found.append(target)
                if target != current:
                    queue.append(target)
    return found


def _message_variables(tree: nodes.Template) -> list[str]:
    """The loop variables of every `{% for m in messages %}` (or an alias of messages)."""
    sources = _aliases(tree, "messages")
    return [_name_of(loop.target) for loop in tree.find_all(nodes.For) if any(_reads(loop.iter, s) for s in sources)]


def _content_loops(tree: nodes.Template) -> Iterator[nodes.For]:
    messages = _message_variables(tree)

    def is_content(node: nodes.Node) -> bool:
        return any(_reads(node, m, "content") for m in messages)

    in_macros: set[int] = set()
    macro_params: dict[int, set[str]] = {}  # loop -> the macro parameters given a message's content
    for macro in tree.find_all(nodes.Macro):
        names = [arg.name for arg in macro.args]
        given: set[str] = set()
        for call in tree.find_all(nodes.Call):
            if not (isinstance(call.node, nodes.Name) and call.node.name == macro.name):
                continue
            given.update(names[i] for i, arg in enumerate(call.args) if i < len(names) and is_content(arg))
            given.update(kw.key for kw in call.kwargs if kw.key in names and is_content(kw.value))
        for loop in macro.find_all(nodes.For):
            in_macros.add(id(loop))
            if given:
                macro_params[id(loop)] = given
    for loop in tree.find_all(nodes.For):
        if is_content(loop.iter) or (isinstance(loop.iter, nodes.Name) and (
                loop.iter.name in macro_params.get(id(loop), ())
                or (id(loop) not in in_macros and loop.iter.name == "content"))):
            _name_of(loop.target)
            yield loop


__all__ = ["ContentFormat", "detect_content_format"]
