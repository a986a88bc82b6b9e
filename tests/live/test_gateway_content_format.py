"""vLLM 0.32 hands a chat template message content in one of two shapes, decided from the
template's syntax (renderers/hf.py _detect_content_format): "string" (a null content is "", text
parts are joined) or "openai" (a string becomes one {"type": "text"} part, a null content []).
The in-process counter renders with the shape the engine picks, so an assistant turn with
content null and tool_calls (which vLLM accepts) is counted, not refused, and a template that
loops over content parts counts what it renders. test_gateway_render_vllm checks the counts
against the live engine; here the detection itself is checked against vLLM's own function."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment

from kvtune.domain.route import Api
from kvtune.gateway.apis import read_request
from kvtune.gateway.content_format import ContentFormat, detect_content_format
from kvtune.gateway.counting import LocalTokenizerCounter

TEMPLATES = Path(__file__).parents[1] / "data" / "chat_templates"
REAL = {p.stem: p.read_text("utf-8") for p in sorted(TEMPLATES.glob("*.jinja"))}
# The shapes vLLM's walk tells apart: loops over a message's content (directly, through a
# filter, a slice, an alias of messages, a macro parameter), loops that only look like one.
SHAPES = {
    "direct": "{% for m in messages %}{% for p in m['content'] %}{{ p.text }}{% endfor %}{% endfor %}",
    "attribute": "{% for m in messages %}{% for p in m.content %}{{ p.text }}{% endfor %}{% endfor %}",
    "filtered": "{% for m in messages %}{% for p in m.content | list %}{{ p }}{% endfor %}{% endfor %}",
    "sliced alias": "{% set ms = messages[1:] %}{% for m in ms %}{% for p in m.content %}{{ p }}{% endfor %}{% endfor %}",
    "macro parameter": "{% macro t(c) %}{% for p in c %}{{ p }}{% endfor %}{% endmacro %}"
                       "{% for m in messages %}{{ t(m.content) }}{% endfor %}",
    "macro keyword": "{% macro t(c) %}{% for p in c %}{{ p }}{% endfor %}{% endmacro %}"
                     "{% for m in messages %}{{ t(c=m.content) }}{% endfor %}",
    "bare content": "{% for m in messages %}{% set content = m.content %}{% for p in content %}{{ p }}{% endfor %}"
                    "{% endfor %}",
    "string test only": "{% for m in messages %}{% if m.content is string %}{{ m.content }}{% endif %}{% endfor %}",
    "other key": "{% for m in messages %}{% for c in m.tool_calls %}{{ c }}{% endfor %}{% endfor %}",
    "not messages": "{% for m in other %}{% for p in m.content %}{{ p }}{% endfor %}{% endfor %}",
    "tuple target": "{% for a, b in messages %}{% for p in a.content %}{{ p }}{% endfor %}{% endfor %}",
    "does not parse": "{% for m in messages %}{{ m.content ",
}
CASES = {**REAL, **SHAPES}


def _ours(source: str) -> str:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    return detect_content_format(source, env).value


def test_the_real_templates_formats():
    """GLM-4.6 loops over content parts in its visible_text macro; the others read strings."""
    assert {name: _ours(source) for name, source in REAL.items()} == {
        "deepseek-r1-tools": "string", "glm-4.6": "openai", "gpt-oss-20b": "string",
        "qwen3-4b-thinking-2507": "string"}


@pytest.mark.vllm
def test_detection_is_vllms():
    """Every case through vLLM 0.32's own _detect_content_format (in its virtualenv; no engine)."""
    from vllm_server import venv_python

    script = ("import json, sys\nfrom vllm.renderers.hf import _detect_content_format\n"
              "cases = json.load(sys.stdin)\n"
              "print(json.dumps({k: _detect_content_format(v, default='string') for k, v in cases.items()}))\n")
    done = subprocess.run([str(venv_python()), "-c", script], input=json.dumps(CASES), capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    theirs = json.loads(done.stdout.strip().splitlines()[-1])
    assert {k: _ours(v) for k, v in CASES.items()} == theirs


CALL = {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}
TOOL_STEP = [{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": None, "tool_calls": [CALL]},
             {"role": "tool", "tool_call_id": "c1", "content": None}, {"role": "user", "content": "Thanks"}]


@pytest.mark.parametrize("name", sorted(REAL))
def test_a_null_content_is_counted_as_vllm_hands_it(model_dir, name):
    """Before: the DeepSeek-R1 and gpt-oss templates raised on the null content (`'x' in None`),
    a 400 the engine never gives; GLM's rendered the word "None"."""
    base = LocalTokenizerCounter.load(str(model_dir))
    counter = LocalTokenizerCounter(base.tokenizer, REAL[name], base.special_tokens)
    prompt = read_request(Api.CHAT, {"messages": TOOL_STEP}).prompts[0]
    text = counter.render(prompt)
    assert "None" not in text
    empty = [{**m, "content": "" if m["content"] is None else m["content"]} for m in TOOL_STEP]
    if counter.content_format is ContentFormat.STRING:  # null is "" there
        assert text == counter.render(read_request(Api.CHAT, {"messages": empty}).prompts[0])


def test_openai_format_hands_strings_as_one_text_part(model_dir):
    base = LocalTokenizerCounter.load(str(model_dir))
    template = ("{% for m in messages %}[{{ m.role }}]{% if m.content is string %}S:{{ m.content }}"
                "{% else %}{% for p in m.content %}P:{{ p.text }}{% endfor %}{% endif %}{{ '\\n' }}{% endfor %}")
    counter = LocalTokenizerCounter(base.tokenizer, template, base.special_tokens)
    assert counter.content_format is ContentFormat.OPENAI
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
                {"role": "assistant", "content": None, "tool_calls": [CALL]},
                {"role": "tool", "tool_call_id": "c1", "content": "t"}]
    # the tool message's parts are joined back into a string, as vLLM does for every format
    assert counter.render(read_request(Api.CHAT, {"messages": messages}).prompts[0]) == (
        "[system]P:s\n[user]P:u\n[assistant]\n[tool]S:t\n")
    final = read_request(Api.CHAT, {"messages": messages[:2], "continue_final_message": True,
                                    "add_generation_prompt": False}).prompts[0]
    assert counter.render(final) == "[system]P:s\n[user]P:u"
