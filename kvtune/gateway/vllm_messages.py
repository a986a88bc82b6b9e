"""Chat messages as vLLM 0.32 hands them to the chat template: a count is only exact when it
renders what the engine renders, and vLLM reshapes the messages on the way.

Two steps, as vLLM takes them:
  rename_reasoning  ChatCompletionRequest._normalize_messages_before (chat only; /tokenize's
                    TokenizeChatRequest lacks it): a message's deprecated `reasoning_content`
                    becomes `reasoning` unless that is set, and is removed
  as_rendered       the request's rename, then renderers/chat_utils.py parse_chat_messages:
                    each message rebuilt from the keys vLLM keeps (role, content in the
                    template's content format - text parts joined by newlines, or each one
                    {"type": "text"} part; a null content "" or []: content_format -, an assistant's
                    tool_calls and reasoning - given to the template both as `reasoning` and as
                    `reasoning_content` -, a tool's tool_call_id, name, task, a developer's tools),
                    a tool message's text parts joined by newlines, and
                    _postprocess_messages: each tool call's `arguments` JSON string parsed into
                    the object the template renders (malformed, empty or not an object: {}),
                    and an empty tool_calls list dropped
  for_template      renderers/hf.py safe_apply_chat_template: a template that never names the
                    developer role gets developer messages as system ones (their tools dropped),
                    every system message merged into one at the front.
"""

from __future__ import annotations

import json
from typing import Any

from kvtune.gateway.content_format import ContentFormat


def rename_reasoning(messages: list) -> list:
    """The messages with `reasoning_content` renamed to `reasoning` as vLLM's chat request does
    (the same list when no message has one), for an engine call that does not rename them."""
    if not any(isinstance(m, dict) and "reasoning_content" in m for m in messages):
        return messages
    renamed = []
    for message in messages:
        if isinstance(message, dict) and "reasoning_content" in message:
            message = dict(message)
            value = message.pop("reasoning_content")
            if value is not None and message.get("reasoning") is None:
                message["reasoning"] = value
        renamed.append(message)
    return renamed


def as_rendered(messages: list, content_format: ContentFormat = ContentFormat.STRING) -> list[dict]:
    """The conversation vLLM's chat template sees for these request messages (content with parts
    that are not text passed as sent: see countable)."""
    return [_rendered(m, content_format) for m in rename_reasoning(messages)]


def for_template(messages: list[dict], chat_template: str) -> list[dict]:
    """`messages` (as_rendered) as vLLM hands them to this chat template."""
    if '"developer"' in chat_template or "'developer'" in chat_template:
        return messages
    if not any(m.get("role") == "developer" for m in messages):
        return messages
    converted = []
    for m in messages:
        if m.get("role") == "developer":
            m = {k: v for k, v in m.items() if k != "tools"}
            m["role"] = "system"
        converted.append(m)
    return _one_system_message(converted)


def _one_system_message(messages: list[dict]) -> list[dict]:
    """Every system message merged into one at the front (texts joined by a blank line), unless
    the only one is already first."""
    texts: list[str] = []
    others: list[dict] = []
    merge = False
    for i, m in enumerate(messages):
        if m.get("role") != "system":
            others.append(m)
            continue
        merge = merge or i > 0 or bool(texts)
        content = m.get("content", "")
        if isinstance(content, list):
            content = "\n".join(p["text"] if isinstance(p, dict) else p for p in content
                                 if (isinstance(p, dict) and "text" in p) or isinstance(p, str))
        if content:
            texts.append(content)
    if not merge:
        return messages
    return [{"role": "system", "content": "\n\n".join(texts)}, *others]


# Content parts vLLM reads as text (renderers/chat_utils.py TEXT_PART_TYPES) and the key each
# keeps its text under; a text or refusal part without one is skipped.
_TEXT_PARTS = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal",
               "thinking": "thinking"}
_SKIPPED_WITHOUT_TEXT = ("text", "refusal")
# Every key of vLLM's content part types (_KNOWN_CONTENT_PART_FIELDS): the others are passed on
# to an "openai" template beside the text.
_PART_FIELDS = frozenset({"audio_embeds", "audio_url", "closed", "data", "file", "image_embeds", "image_pil",
                          "image_url", "input_audio", "name", "prompt_cache_breakpoint", "refusal", "text",
                          "thinking", "type", "uuid", "video_embeds", "video_url"})
# Claude Code's attribution line, which vLLM drops from a system message's text
_BILLING_HEADER = "x-anthropic-billing-header"


class _NotText(Exception):
    """A content part that is not text (an image, a file): only the engine renders it."""


def _text_parts(content: Any, role: Any) -> list[tuple[str, dict]]:
    """A message's content as vLLM parses it (_parse_chat_message_content): (text, the part's
    other keys) for each text part; _NotText when a part is anything else."""
    if content is None:
        parts: list = []
    elif isinstance(content, str):
        parts = [{"type": "text", "text": content}]
    elif isinstance(content, list):
        parts = content
    else:
        raise _NotText
    texts: list[tuple[str, dict]] = []
    for part in parts:
        text: Any
        if isinstance(part, str):
            text, extra = part, {}
        elif isinstance(part, dict) and "uuid" not in part and part.get("type") in _TEXT_PARTS:
            text = part.get(_TEXT_PARTS[part["type"]])
            if text is None and part["type"] in _SKIPPED_WITHOUT_TEXT:
                continue
            extra = {k: v for k, v in part.items() if k not in _PART_FIELDS}
        else:
            raise _NotText
        if not isinstance(text, str):
            raise _NotText
        if role == "system" and text.startswith(_BILLING_HEADER):
            text = text.partition("\n")[2]
            if not text:
                continue
        texts.append((text, extra))
    return texts


def _content(content: Any, role: Any, content_format: ContentFormat) -> Any:
    """A message's content as vLLM hands it to a template of this format: its non-empty text
    parts joined by newlines (a null content ""), or for a template that reads parts, each as a text part (a
    string one part, a null content []). Content with parts that are not text is left as sent:
    the engine counts it."""
    try:
        texts = _text_parts(content, role)
    except _NotText:
        return content
    if content_format is ContentFormat.STRING:  # an empty part is dropped, not joined (no extra newline)
        return "\n".join(text for text, _ in texts if text)
    return [{"type": "text", "text": text, **extra} for text, extra in texts]


def countable(messages: list) -> bool:
    """True when every message's content is text (a string, null, or text parts): what this
    module renders exactly as vLLM does."""
    for message in messages:
        try:
            _text_parts(message.get("content") if isinstance(message, dict) else None, None)
        except _NotText:
            return False
    return True


def _rendered(message: dict, content_format: ContentFormat) -> dict:
    role = message.get("role")
    out: dict[str, Any] = {"role": role, "content": _content(message.get("content"), role, content_format)}
    if role == "assistant":
        tool_calls = message.get("tool_calls")
        if tool_calls is not None:
            if isinstance(tool_calls, list) and not tool_calls:
                pass  # dropped, so the template takes its plain-assistant path
            elif isinstance(tool_calls, list):
                out["tool_calls"] = [_tool_call(c) for c in tool_calls]
            else:
                out["tool_calls"] = tool_calls
        reasoning = message.get("reasoning")
        if reasoning is not None:
            out["reasoning"] = reasoning
            out["reasoning_content"] = reasoning
    elif role == "tool":
        if "tool_call_id" in message:
            out["tool_call_id"] = message["tool_call_id"]
        out["content"] = _tool_text(out["content"])
    if isinstance(message.get("name"), str):
        out["name"] = message["name"]
    if isinstance(message.get("task"), str):
        out["task"] = message["task"]
    if role == "developer":
        out["tools"] = message.get("tools")
    return out


def _tool_text(content: Any) -> Any:
    """A tool message's content given as text parts, joined as vLLM joins them."""
    if not isinstance(content, list):
        return content
    if any(isinstance(p, dict) and p.get("type") != "text" for p in content):
        return content
    texts = [p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text"]
    return "\n".join(texts) if texts else ""


def _tool_call(call: Any) -> Any:
    """A tool call whose `arguments` is the object vLLM parses it into."""
    if not isinstance(call, dict):
        return call  # vLLM refuses it (400); the template or the engine says so
    function = call.get("function")
    if not isinstance(function, dict):
        return call
    return {**call, "function": {**function, "arguments": _arguments(function.get("arguments"))}}


def _arguments(value: Any) -> dict:
    if not value:
        return {}
    if isinstance(value, dict):
        return value
    parsed: Any = value
    if isinstance(value, str):
        try:
            parsed = json.loads(value)
        except (ValueError, RecursionError):
            return {}
    return parsed if isinstance(parsed, dict) else {}


__all__ = ["ContentFormat", "rename_reasoning", "as_rendered", "for_template", "countable"]
