"""What a request asks of the engine, read by its endpoint's own field rules.

The engine reads one field per endpoint: `/v1/completions` runs `prompt` and ignores a stray
`messages`; chat runs `messages` and ignores `max_output_tokens`. Counting a request by any
other rule lets a client be charged for the empty chat while the engine runs a long prompt, or
lower its reservation with a cap the engine never reads. So each API below names where its
prompt is, which fields cap its output and which multiply its sequences, as vLLM 0.32's request
models do (`vllm/entrypoints/*/protocol.py`); a field the gateway cannot count (request-side
chat templates, prompt embeddings, stored conversations, images in a pair) refuses the request
rather than letting it through uncounted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from kvtune.domain.route import Api
from kvtune.gateway.body import BodyError
from kvtune.gateway.refusals import Reason

# n / best_of and the caps must be integers in [1, MAX_COUNT): a larger or odd number is a 400.
MAX_COUNT = 2**31
# Chat fields the chat template renders (vLLM's ChatCompletionRequest.build_chat_params), and
# the ones only an estimate counts (they reach the prompt through some templates or renderers).
TEMPLATE_FIELDS = ("tools", "documents", "chat_template_kwargs", "add_generation_prompt",
                   "continue_final_message", "reasoning_effort")
ESTIMATE_FIELDS = ("tool_choice", "response_format", "structured_outputs")


@dataclass(frozen=True, slots=True)
class Prompt:
    """One piece of input a request carries, in the form the engine will tokenize it."""

    messages: list | None = None  # chat messages, rendered by the chat template
    text: str | None = None  # plain text (special tokens added as vLLM adds them)
    token_count: int | None = None  # token ids the client already gave
    template_args: dict | None = None  # chat: TEMPLATE_FIELDS present (and ESTIMATE_FIELDS)
    anthropic: dict | None = None  # an Anthropic request, counted by the engine's count_tokens
    # messages whose rendered text the engine tokenizes with special tokens added, so a tokenizer
    # that adds BOS gives it twice: vLLM 0.32's Responses API (ResponsesRequest.build_tok_params
    # keeps TokenizeParams' add_special_tokens=True; chat completions sends False)
    add_special_tokens: bool = False


@dataclass(frozen=True, slots=True)
class Sequence:
    """One sequence the engine prefills: the sum of some prompts plus tokens it adds itself."""

    parts: tuple[int, ...]
    extra_tokens: int = 0


@dataclass(frozen=True, slots=True)
class CapField:
    """Where an output cap lives: a top-level key, or a key inside a top-level object."""

    key: str
    parent: str | None = None


@dataclass(frozen=True, slots=True)
class Reading:
    """A request read by one API's rules."""

    api: Api
    prompts: tuple[Prompt, ...]
    sequences: tuple[Sequence, ...]
    generates: bool
    caps: tuple[CapField, ...] = ()  # the fields this API reads its output cap from
    add_cap: CapField | None = None  # the field the gateway sets when the client gave none
    requested_cap: int | None = None  # the smallest cap the client asked for, if any
    copies: int = 1  # sequences generated per prompt (n, best_of, beams)
    min_tokens: CapField | None = None
    forced_tokens: int = 0  # output tokens the request forces at least (min_tokens)
    forces_cap: str | None = None  # the field that may keep it from ending before its cap, if any


@dataclass(frozen=True, slots=True)
class Request:
    """Every way the engine may read a body: one reading, or (SageMaker /invocations, which
    tries chat, then completions, then pooling) alternatives of which the largest is reserved."""

    readings: tuple[Reading, ...]
    prompts: tuple[Prompt, ...] = field(default=())  # all readings' prompts, counted once

    @property
    def generates(self) -> bool:
        return any(r.generates for r in self.readings)


def invalid(message: str) -> BodyError:
    return BodyError(Reason.INVALID_REQUEST, message)


def uncountable(message: str) -> BodyError:
    return BodyError(Reason.UNCOUNTABLE_REQUEST, f"the gateway cannot count {message}, so it cannot admit it")


def count_field(key: str, value: Any) -> int:
    """A positive integer field (max_tokens, n, ...) or a 400: bools, NaN, infinities, 1e400,
    fractions, negatives and values past 2**31 are all refused."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _bad_count(key)
    if isinstance(value, float) and (not math.isfinite(value) or not value.is_integer()):
        raise _bad_count(key)
    if not 1 <= value < MAX_COUNT:
        raise _bad_count(key)
    return int(value)


_BAD_COUNT = {"n": Reason.INVALID_N, "best_of": Reason.INVALID_BEST_OF}


def _bad_count(key: str) -> BodyError:
    return BodyError(_BAD_COUNT.get(key, Reason.INVALID_MAX_TOKENS), f"{key} must be a positive integer")


# ---------------------------------------------------------------- the readers


def read_request(api: Api, doc: dict, *, pair_tokens: int = 0) -> Request:
    """Every reading of `doc` under `api`, or BodyError (a 400) when it cannot be counted."""
    if api is Api.INVOCATIONS:
        readings = _invocations(doc, pair_tokens)
    else:
        readings = [_READERS[api](doc, pair_tokens)]
    # One prompt list for all readings: each reading's parts are shifted past the ones before.
    prompts: list[Prompt] = []
    shifted = []
    for r in readings:
        offset = len(prompts)
        prompts.extend(r.prompts)
        shifted.append(_shift(r, offset))
    return Request(tuple(shifted), tuple(prompts))


def _shift(r: Reading, offset: int) -> Reading:
    if offset == 0:
        return r
    sequences = tuple(Sequence(tuple(p + offset for p in s.parts), s.extra_tokens) for s in r.sequences)
    return Reading(r.api, r.prompts, sequences, r.generates, r.caps, r.add_cap, r.requested_cap,
                   r.copies, r.min_tokens, r.forced_tokens, r.forces_cap)


def _invocations(doc: dict, pair_tokens: int) -> list[Reading]:
    readings = []
    if isinstance(doc.get("messages"), list):
        readings.append(_chat(doc, pair_tokens))
    if doc.get("prompt") is not None:
        readings.append(_completions(doc, pair_tokens))
    if not readings:
        if doc.get("input") is None and doc.get("messages") is None:
            raise invalid("the request has neither messages, prompt nor input")
        readings.append(_embed(doc, pair_tokens))
    return readings


def _caps(doc: dict, fields: tuple[CapField, ...]) -> int | None:
    requested = None
    for f in fields:
        holder = doc if f.parent is None else doc.get(f.parent)
        value = holder.get(f.key) if isinstance(holder, dict) else None
        if value is not None:
            n = count_field(f.key, value)
            requested = n if requested is None else min(requested, n)
    return requested


def _copies(doc: dict, keys: tuple[str, ...], holder: dict | None = None) -> int:
    holder = doc if holder is None else holder
    copies = 1
    for key in keys:
        value = holder.get(key)
        if value is not None:
            copies = max(copies, count_field(key, value))
    return copies


#: Sampling fields that can keep a sequence from ever sampling its end-of-sequence token, so its
#: length is no longer the route's: ignore_eos; logit_bias (the gateway does not know the model's
#: EOS ids, and a bias up on any other token pushes EOS down as surely as one against it);
#: bad_words and allowed_token_ids (either can ban EOS). stop and stop_token_ids only add ways
#: to end: vLLM 0.32 keeps EOS beside them (SamplingParams.update_from_generation_config).
FORCING_FIELDS = ("ignore_eos", "logit_bias", "bad_words", "allowed_token_ids")
#: The ones vLLM 0.32's ResponsesRequest reads (it has no min_tokens).
RESPONSES_FORCING_FIELDS = ("ignore_eos", "logit_bias")


def forcing(holder: dict, fields: tuple[str, ...] = FORCING_FIELDS, *,
            min_tokens: bool = True) -> tuple[int, str | None]:
    """What a request's sampling fields force its length to: the tokens it generates at least
    (min_tokens), and the field, if any, that may hold it to its cap. Read loosely, as the engine
    might coerce it: a min_tokens that is not a plain number forces the cap."""
    forced = 0
    least = holder.get("min_tokens") if min_tokens else None
    if least is not None:
        if isinstance(least, bool) or not isinstance(least, (int, float)) or not math.isfinite(least):
            return 0, "min_tokens"
        forced = max(0, min(math.ceil(least), MAX_COUNT))
    for key in fields:
        value = holder.get(key)
        if value is not None and value is not False and value != 0 and value != {} and value != []:
            return forced, key
    return forced, None


def _refuse_present(doc: dict, fields: dict[str, str]) -> None:
    for key, what in fields.items():
        if doc.get(key) is not None:
            raise uncountable(what)


def _template_args(doc: dict) -> dict:
    args = {k: doc[k] for k in (*TEMPLATE_FIELDS, *ESTIMATE_FIELDS) if doc.get(k) is not None}
    kwargs = args.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise invalid("chat_template_kwargs must be an object")
    if kwargs and "messages" in kwargs:
        raise invalid("chat_template_kwargs cannot replace the messages")
    return args


def _add_special_tokens(doc: dict) -> bool:
    """A chat request's add_special_tokens (vLLM's default False): true puts the tokenizer's
    start token(s) before the rendered chat, so the count must add them too."""
    value = doc.get("add_special_tokens")
    if value is not None and not isinstance(value, bool):
        raise invalid("add_special_tokens must be true or false")
    return value is True


def _messages(value: Any, where: str) -> list:
    if not isinstance(value, list) or not all(isinstance(m, dict) for m in value):
        raise invalid(f"{where} must be a list of message objects")
    return value


_CHAT_REFUSED = {"chat_template": "a chat template sent with the request",
                 "mm_payload": "a multimodal payload", "prompt_embeds": "prompt embeddings"}
CHAT_CAPS = (CapField("max_tokens"), CapField("max_completion_tokens"))


def _chat(doc: dict, pair_tokens: int = 0) -> Reading:
    _refuse_present(doc, _CHAT_REFUSED)
    prompt = Prompt(messages=_messages(doc.get("messages"), "messages"), template_args=_template_args(doc),
                    add_special_tokens=_add_special_tokens(doc))
    return Reading(Api.CHAT, (prompt,), (Sequence((0,)),), True, CHAT_CAPS, CapField("max_tokens"),
                   _caps(doc, CHAT_CAPS), _copies(doc, ("n",)), CapField("min_tokens"), *forcing(doc))


def _chat_batch(doc: dict, pair_tokens: int = 0) -> Reading:
    _refuse_present(doc, _CHAT_REFUSED)
    conversations = doc.get("messages")
    if not isinstance(conversations, list) or not conversations:
        raise invalid("messages must be a non-empty list of conversations")
    args = _template_args(doc)
    special = _add_special_tokens(doc)
    prompts = tuple(Prompt(messages=_messages(c, "messages[i]"), template_args=args, add_special_tokens=special)
                    for c in conversations)
    return Reading(Api.CHAT_BATCH, prompts, tuple(Sequence((i,)) for i in range(len(prompts))), True,
                   CHAT_CAPS, CapField("max_tokens"), _caps(doc, CHAT_CAPS), _copies(doc, ("n",)),
                   CapField("min_tokens"), *forcing(doc))


_COMPLETION_REFUSED = {"prompt_embeds": "prompt embeddings", "mm_payload": "a multimodal payload"}
COMPLETION_CAPS = (CapField("max_tokens"),)


def _completion_prompts(value: Any, where: str = "prompt") -> list[Prompt]:
    """vLLM's four prompt shapes: text, a list of texts, token ids, a list of token-id lists."""
    if isinstance(value, str):
        return [Prompt(text=value)]
    if not isinstance(value, list) or not value:
        raise invalid(f"{where} must be text, token ids, or a non-empty list of either")
    if all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        return [Prompt(token_count=len(value))]
    out = []
    for item in value:
        if isinstance(item, str):
            out.append(Prompt(text=item))
        elif isinstance(item, list) and item and all(isinstance(t, int) and not isinstance(t, bool) for t in item):
            out.append(Prompt(token_count=len(item)))
        else:
            raise invalid(f"{where} must be text, token ids, or a non-empty list of either")
    return out


def _completions(doc: dict, pair_tokens: int = 0) -> Reading:
    _refuse_present(doc, _COMPLETION_REFUSED)
    if doc.get("prompt") is None:
        raise invalid("prompt is required")
    prompts = _completion_prompts(doc["prompt"])
    sequences = [Sequence((i,)) for i in range(len(prompts))]
    suffix = doc.get("suffix")
    if suffix is not None:  # vLLM refuses it today; counted, should a release accept it
        if not isinstance(suffix, str):
            raise invalid("suffix must be text")
        prompts.append(Prompt(text=suffix))
        sequences = [Sequence((*s.parts, len(prompts) - 1)) for s in sequences]
    return Reading(Api.COMPLETIONS, tuple(prompts), tuple(sequences), True, COMPLETION_CAPS,
                   CapField("max_tokens"), _caps(doc, COMPLETION_CAPS), _copies(doc, ("n", "best_of")),
                   CapField("min_tokens"), *forcing(doc))


_RESPONSES_REFUSED = {"previous_response_id": "a conversation stored on the server (previous_response_id)",
                      "conversation": "a conversation stored on the server",
                      "prompt": "a prompt template stored on the server"}
RESPONSES_CAPS = (CapField("max_output_tokens"),)
_TEXT_PARTS = frozenset({"input_text", "output_text", "text"})


def _responses(doc: dict, pair_tokens: int = 0) -> Reading:
    """vLLM builds chat messages from a Responses request (openai/responses/utils.py
    construct_input_messages): instructions as the system message, then the input. Message
    items of text are read the same way; other items (tool calls, reasoning, files) are not."""
    _refuse_present(doc, _RESPONSES_REFUSED)
    messages: list[dict] = []
    instructions = doc.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise invalid("instructions must be text")
        if instructions:
            messages.append({"role": "system", "content": instructions})
    inp = doc.get("input")
    if isinstance(inp, str):
        messages.append({"role": "user", "content": inp})
    elif isinstance(inp, list):
        for i, item in enumerate(inp):
            messages.append(_response_item(item, i))
    else:
        raise invalid("input must be text or a list of input items")
    args = {k: v for k, v in _template_args(doc).items() if k != "tools"}
    tools = doc.get("tools")
    if tools:
        args["tools"] = _response_tools(tools)
    prompt = Prompt(messages=messages, template_args=args, add_special_tokens=True)
    forced, forces_cap = forcing(doc, RESPONSES_FORCING_FIELDS, min_tokens=False)
    return Reading(Api.RESPONSES, (prompt,), (Sequence((0,)),), True, RESPONSES_CAPS,
                   CapField("max_output_tokens"), _caps(doc, RESPONSES_CAPS), forced_tokens=forced,
                   forces_cap=forces_cap)


def _response_item(item: Any, i: int) -> dict:
    if not isinstance(item, dict) or item.get("type", "message") != "message" or "role" not in item:
        kind = item.get("type") if isinstance(item, dict) else type(item).__name__
        raise uncountable(f"input[{i}] of type {str(kind)[:40]!r} (only message items are counted)")
    content = item.get("content")
    if isinstance(content, str):
        return {"role": item["role"], "content": content}
    if isinstance(content, list):
        parts = []
        for part in content:
            if (not isinstance(part, dict) or part.get("type") not in _TEXT_PARTS
                    or not isinstance(part.get("text"), str)):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise uncountable(f"input[{i}] content of type {str(kind)[:40]!r}")
            parts.append({"type": "text", "text": part["text"]})
        return {"role": item["role"], "content": parts}
    raise invalid(f"input[{i}].content must be text or a list of parts")


def _response_tools(tools: Any) -> list:
    """Responses function tools in the chat shape vLLM converts them to."""
    if not isinstance(tools, list):
        raise invalid("tools must be a list")
    out = []
    for tool in tools:
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else type(tool).__name__
            raise uncountable(f"a tool of type {str(kind)[:40]!r}")
        function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool}
        out.append({"type": "function", "function": function})
    return out


MESSAGES_CAPS = (CapField("max_tokens"),)
_ANTHROPIC_PROMPT_FIELDS = ("model", "messages", "system", "tools", "tool_choice", "thinking",
                            "output_config", "chat_template_kwargs")


def _anthropic(doc: dict, pair_tokens: int = 0) -> Reading:
    _refuse_present(doc, {"mm_payload": "a multimodal payload"})
    _messages(doc.get("messages"), "messages")
    prompt = Prompt(anthropic={k: doc[k] for k in _ANTHROPIC_PROMPT_FIELDS if doc.get(k) is not None})
    return Reading(Api.MESSAGES, (prompt,), (Sequence((0,)),), True, MESSAGES_CAPS, CapField("max_tokens"),
                   _caps(doc, MESSAGES_CAPS))


TOKENS_CAPS = (CapField("max_tokens", "sampling_params"),)


def _tokens(doc: dict, pair_tokens: int = 0) -> Reading:
    _refuse_present(doc, {"features": "multimodal features", "content_parts": "multimodal content parts"})
    ids = doc.get("token_ids")
    if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise invalid("token_ids must be a non-empty list of token ids")
    params = doc.get("sampling_params")
    if not isinstance(params, dict):
        raise invalid("sampling_params must be an object")
    return Reading(Api.TOKENS, (Prompt(token_count=len(ids)),), (Sequence((0,)),), True, TOKENS_CAPS,
                   TOKENS_CAPS[0], _caps(doc, TOKENS_CAPS), _copies(doc, ("n", "best_of"), params),
                   CapField("min_tokens", "sampling_params"), *forcing(params))


ANY_CAPS = (CapField("max_tokens"), CapField("max_completion_tokens"), CapField("max_output_tokens"))


def _any(doc: dict, pair_tokens: int = 0) -> Reading:
    """A route whose upstream API kvtune cannot know: every prompt field the body carries is
    charged, all in one sequence, and every cap alias is clamped."""
    prompts: list[Prompt] = []
    if doc.get("messages") is not None:
        prompts += _chat(doc).prompts
    if doc.get("prompt") is not None:
        prompts += _completion_prompts(doc["prompt"])
    if doc.get("input") is not None or doc.get("instructions") is not None:
        if doc.get("input") is None:
            raise invalid("instructions come with an input")
        prompts += _responses(doc).prompts
    if not prompts:
        raise invalid("the request carries no prompt (messages, prompt or input)")
    return Reading(Api.ANY, tuple(prompts), (Sequence(tuple(range(len(prompts)))),), True, ANY_CAPS,
                   CapField("max_tokens"), _caps(doc, ANY_CAPS), _copies(doc, ("n", "best_of")),
                   CapField("min_tokens"), *forcing(doc))


# ---------------------------------------------------------------- pooling (no output)


def _embed(doc: dict, pair_tokens: int = 0) -> Reading:
    """/v1/embeddings, /pooling, /classify: `messages` (one conversation or a batch of them) or
    `input` (text, texts, token ids, lists of token ids, or chat messages)."""
    _refuse_present(doc, {**_CHAT_REFUSED, "data": "a plugin's input data"})
    source = doc.get("messages") if doc.get("messages") is not None else doc.get("input")
    if source is None:
        raise invalid("input is required")
    args = _template_args(doc)
    if isinstance(source, list) and source and all(isinstance(m, dict) for m in source):
        prompts = [Prompt(messages=source, template_args=args)]
    elif isinstance(source, list) and source and all(isinstance(c, list) and c and all(isinstance(m, dict) for m in c)
                                                     for c in source):
        prompts = [Prompt(messages=c, template_args=args) for c in source]
    else:
        prompts = _completion_prompts(source, "input")
    return Reading(Api.EMBED, tuple(prompts), tuple(Sequence((i,)) for i in range(len(prompts))), False)


def _texts(value: Any, where: str) -> list[str]:
    """One side of a score pair: text or a list of texts (multimodal parts are not counted)."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict) and isinstance(value.get("text"), str) and len(value) <= 2:
        return [value["text"]]
    if isinstance(value, list) and value:
        out = []
        for item in value:
            out += _texts(item, where) if not isinstance(item, list) else _bad_texts(where)
        return out
    return _bad_texts(where)


def _bad_texts(where: str) -> list[str]:
    raise uncountable(f"{where} unless it is text or a list of texts")


def _pairs(left: list[str], right: list[str], pair_tokens: int, api: Api,
           extra: tuple[str, ...] | list[str] = ()) -> Reading:
    """vLLM pairs one left text with every right one, or left and right one by one."""
    if len(left) != 1 and len(left) != len(right):
        raise invalid("give one query or as many as there are documents")
    prompts = [Prompt(text=t) for t in (*left, *right, *extra)]
    tail = tuple(range(len(left) + len(right), len(prompts)))
    sequences = []
    for j in range(len(right)):
        i = 0 if len(left) == 1 else j
        sequences.append(Sequence((i, len(left) + j, *tail), pair_tokens))
    return Reading(api, tuple(prompts), tuple(sequences), False)


_SCORE_SIDES = (("data_1", "data_2"), ("text_1", "text_2"), ("queries", "documents"), ("queries", "items"))


def _score(doc: dict, pair_tokens: int = 0) -> Reading:
    for a, b in _SCORE_SIDES:
        if doc.get(a) is not None and doc.get(b) is not None:
            return _pairs(_texts(doc[a], a), _texts(doc[b], b), pair_tokens, Api.SCORE, _instruction(doc))
    raise invalid("a score request needs data_1/data_2, text_1/text_2 or queries/documents")


def _rerank(doc: dict, pair_tokens: int = 0) -> Reading:
    if doc.get("query") is None or doc.get("documents") is None:
        raise invalid("a rerank request needs query and documents")
    return _pairs(_texts(doc["query"], "query"), _texts(doc["documents"], "documents"), pair_tokens,
                  Api.RERANK, _instruction(doc))


def _instruction(doc: dict) -> list[str]:
    value = doc.get("instruction")
    if value is None:
        return []
    if not isinstance(value, str):
        raise invalid("instruction must be text")
    return [value]


def _cohere_embed(doc: dict, pair_tokens: int = 0) -> Reading:
    if doc.get("images") is not None:
        raise uncountable("images")
    texts: list[str] = []
    if doc.get("texts") is not None:
        texts += _texts(doc["texts"], "texts")
    inputs = doc.get("inputs")
    if inputs is not None and not isinstance(inputs, list):
        raise invalid("inputs must be a list")
    for i, item in enumerate(inputs or []):
        parts = item.get("content") if isinstance(item, dict) else None
        if not isinstance(parts, list) or not all(isinstance(p, dict) and p.get("type") == "text"
                                                  and isinstance(p.get("text"), str) for p in parts):
            raise uncountable(f"inputs[{i}] unless all its content is text")
        texts.append("".join(p["text"] for p in parts))
    if not texts:
        raise invalid("texts or inputs are required")
    return Reading(Api.COHERE_EMBED, tuple(Prompt(text=t) for t in texts),
                   tuple(Sequence((i,)) for i in range(len(texts))), False)


_READERS = {
    Api.CHAT: _chat, Api.CHAT_BATCH: _chat_batch, Api.COMPLETIONS: _completions, Api.RESPONSES: _responses,
    Api.MESSAGES: _anthropic, Api.TOKENS: _tokens, Api.ANY: _any,
    Api.EMBED: _embed, Api.SCORE: _score, Api.RERANK: _rerank, Api.COHERE_EMBED: _cohere_embed,
}

__all__ = ["Prompt", "Sequence", "CapField", "Reading", "Request", "read_request", "count_field", "forcing",
           "FORCING_FIELDS", "RESPONSES_FORCING_FIELDS",
           "TEMPLATE_FIELDS", "ESTIMATE_FIELDS", "MAX_COUNT"]
