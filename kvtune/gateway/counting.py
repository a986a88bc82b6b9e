"""Prompt token counts for admission: the prompt is part of every reservation, so it is counted
the way the engine will count it (chat template applied), not guessed.

Three counters share one interface, `await counter.count(body) -> PromptCount`:
  UpstreamTokenizeCounter  the engine's own POST /tokenize (vLLM applies the chat template)
  LocalTokenizerCounter    `tokenizers` + the model's jinja2 chat template, in process
  EstimateCounter          characters / chars_per_token + a margin, only when configured

Errors:
  PromptCountError         the prompt cannot be counted (upstream down, odd shape); retryable
   └── PromptRejectedError the engine refused the prompt itself (too long, malformed); not retryable
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from kvtune.errors import InputError
from kvtune.gateway import _json
from kvtune.gateway.upstream import UpstreamError
from kvtune.gateway_config import PromptCounting

# Request fields that change what the chat template renders (vLLM's /tokenize accepts them too).
CHAT_TEMPLATE_FIELDS = ("tools", "chat_template_kwargs", "add_generation_prompt", "continue_final_message")


class PromptCountError(Exception):
    """The prompt could not be counted; the request may succeed later."""


class PromptRejectedError(PromptCountError):
    """The engine's tokenizer refused the prompt (e.g. longer than the context); never retryable."""


@dataclass(frozen=True, slots=True)
class Prompt:
    """One prompt a request carries: chat messages, text, or already-tokenized ids."""

    messages: list | None = None
    text: str | None = None
    token_count: int | None = None
    template_args: dict | None = None


@dataclass(frozen=True, slots=True)
class PromptCount:
    tokens: tuple[int, ...]
    method: str
    exact: bool


def prompts_of(body: dict) -> list[Prompt]:
    """The prompts in an OpenAI-style body (chat `messages`, completions `prompt` in all four
    shapes, responses `input` + `instructions`); the same reading as the rendered nginx.conf."""
    template_args = {k: body[k] for k in CHAT_TEMPLATE_FIELDS if body.get(k) is not None}
    messages = body.get("messages")
    if isinstance(messages, list):
        return [Prompt(messages=messages, template_args=template_args)]
    prompt = body.get("prompt")
    if prompt is not None:
        if isinstance(prompt, str):
            return [Prompt(text=prompt)]
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            return [Prompt(token_count=len(prompt))]
        if isinstance(prompt, list):
            out = []
            for item in prompt:
                if isinstance(item, str):
                    out.append(Prompt(text=item))
                elif isinstance(item, list):
                    out.append(Prompt(token_count=len(item)))
            if out:
                return out
    inp = body.get("input")
    if inp is not None:
        instructions = body.get("instructions")
        if not isinstance(instructions, str):
            if isinstance(inp, str):
                return [Prompt(text=inp)]
            if isinstance(inp, list):
                return [Prompt(messages=inp, template_args=template_args)]
        else:
            items = [{"role": "system", "content": instructions}]
            items += [{"role": "user", "content": inp}] if isinstance(inp, str) else list(inp)
            return [Prompt(messages=items, template_args=template_args)]
    # Nothing recognisable as a prompt: charge the whole body as text, never zero.
    return [Prompt(text=_json.dumps_text(body))]


class EstimateCounter:
    """ceil(characters / chars_per_token) + margin per prompt: cheap, and never below the truth
    when chars_per_token is set at or under the model's worst case."""

    method = "estimate"

    def __init__(self, chars_per_token: float, margin_tokens: int) -> None:
        self.chars_per_token = chars_per_token
        self.margin_tokens = margin_tokens

    def estimate(self, prompt: Prompt) -> int:
        if prompt.token_count is not None:
            return prompt.token_count
        text = prompt.text if prompt.text is not None else _json.dumps_text(prompt.messages)
        return math.ceil(len(text) / self.chars_per_token) + self.margin_tokens

    async def count(self, body: dict) -> PromptCount:
        return PromptCount(tuple(self.estimate(p) for p in prompts_of(body)), self.method, False)


# vLLM refuses a /tokenize body without this Content-Type
_TOKENIZE_HEADERS = (("Content-Type", "application/json"),)


class UpstreamTokenizeCounter:
    """The engine's POST /tokenize: {"model", "prompt"} or {"model", "messages", ...} → {"count"}.
    One call per prompt (issued together) on the gateway's keep-alive connections to that
    upstream (an UpstreamClient); ids already tokenized are counted locally."""

    method = "upstream-tokenize"

    def __init__(self, client: Any, *, fallback: EstimateCounter | None = None) -> None:
        self.client = client
        self.fallback = fallback

    async def _one(self, model: Any, prompt: Prompt) -> tuple[int, bool]:
        if prompt.token_count is not None:
            return prompt.token_count, True
        payload: dict[str, Any] = {"model": model}
        if prompt.messages is not None:
            payload["messages"] = prompt.messages
            payload.update(prompt.template_args or {})
        else:
            payload["prompt"] = prompt.text
        try:
            resp = await self.client.request("POST", "/tokenize", _TOKENIZE_HEADERS, _json.dumps_bytes(payload))
            data = await resp.read_and_release()
            status = resp.status
        except UpstreamError as exc:
            if self.fallback is not None:
                return self.fallback.estimate(prompt), False
            raise PromptCountError(f"the upstream /tokenize failed: {exc}") from exc
        try:
            parsed = _json.loads(data)
        except ValueError:
            parsed = None
        if status == 200 and isinstance(parsed, dict) and isinstance(parsed.get("count"), int):
            return parsed["count"], True
        if status == 400:
            message = _error_message(parsed) or "the upstream tokenizer refused the prompt"
            raise PromptRejectedError(message)
        if self.fallback is not None:
            return self.fallback.estimate(prompt), False
        raise PromptCountError(f"the upstream /tokenize answered {status}")

    async def count(self, body: dict) -> PromptCount:
        import asyncio

        model = body.get("model")
        prompts = prompts_of(body)
        if len(prompts) == 1:
            results = [await self._one(model, prompts[0])]
        else:
            results = await asyncio.gather(*(self._one(model, p) for p in prompts))
        exact = all(e for _, e in results)
        return PromptCount(tuple(n for n, _ in results), self.method if exact else "estimate", exact)


def _error_message(parsed: Any) -> str | None:
    if isinstance(parsed, dict):
        err = parsed.get("error", parsed)
        if isinstance(err, dict) and isinstance(err.get("message"), str):
            return err["message"]
        if isinstance(parsed.get("message"), str):
            return parsed["message"]
    return None


def _special_token(value: Any) -> str | None:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


class LocalTokenizerCounter:
    """The model's tokenizer.json and chat template, in process: the same count the engine makes,
    without a round trip. Chat text is encoded without special tokens (the template holds them);
    plain prompts with them, as vLLM does."""

    method = "tokenizer"

    # Prompts longer than this are encoded in a worker thread so the event loop keeps serving.
    INLINE_CHARS = 16_384

    def __init__(self, tokenizer: Any, chat_template: str | None, special_tokens: dict[str, str | None]) -> None:
        self.tokenizer = tokenizer
        self.special_tokens = special_tokens
        self.template = _compile_template(chat_template) if chat_template else None
        # What every render starts from: the template's globals (a ChainMap that jinja would
        # flatten on every render, most of a short render's time) and the special tokens.
        self._base_vars = {**self.template.globals, **special_tokens} if self.template else {}
        self._encode = tokenizer.encode

    @classmethod
    def load(cls, spec: str) -> LocalTokenizerCounter:
        """From a tokenizer.json, a model directory, or a hub id (tokenizer_config.json beside it
        supplies the chat template and bos/eos tokens)."""
        from kvtune.ingest.tokenize import chat_template_of, load_tokenizer, read_chat_template

        try:
            tokenizer = load_tokenizer(spec)
        except InputError as exc:  # name the gateway.yaml key, not the profile command's option
            raise InputError(exc.message, path=exc.path, field="prompt_tokens.tokenizer") from exc
        path = Path(spec).expanduser()
        folder = path if path.is_dir() else path.parent if path.is_file() else None
        if folder is not None:
            config, template = read_chat_template(folder)
        else:
            try:
                from huggingface_hub import hf_hub_download

                config = json.loads(Path(hf_hub_download(spec, "tokenizer_config.json")).read_text("utf-8"))
            except Exception as exc:
                raise InputError(f"cannot fetch tokenizer_config.json for {spec!r} ({type(exc).__name__})",
                                 field="prompt_tokens.tokenizer") from exc
            template = chat_template_of(config)
        if template is None:
            raise InputError("the tokenizer has no chat template (tokenizer_config.json chat_template or "
                             "chat_template.jinja); use method upstream-tokenize", path=spec,
                             field="prompt_tokens.tokenizer")
        specials = {k: _special_token(config.get(k)) for k in ("bos_token", "eos_token", "pad_token", "unk_token")}
        return cls(tokenizer, template, specials)

    def render(self, prompt: Prompt) -> str:
        """The chat template applied as vLLM applies it: the special tokens, the messages, the
        request's template fields, then chat_template_kwargs over all of them (vLLM merges them
        last; only `messages` cannot be replaced, a repeated argument in transformers)."""
        template = self.template
        if template is None:
            raise PromptCountError("no chat template to render messages with")
        context = self._base_vars.copy()
        context["messages"] = prompt.messages
        context["add_generation_prompt"] = True
        extra = None
        if prompt.template_args:
            for key, value in prompt.template_args.items():
                if key == "chat_template_kwargs":
                    extra = value
                else:
                    context[key] = value
        if extra:
            if not isinstance(extra, dict):
                raise PromptRejectedError("chat_template_kwargs must be an object")
            if "messages" in extra:
                raise PromptRejectedError("chat_template_kwargs cannot replace the messages")
            context.update(extra)
        try:
            # Template.render(**context) minus its per-call copy of the globals (shared=True
            # hands `context`, which already holds them, to the template as is)
            return "".join(template.root_render_func(template.new_context(context, shared=True)))
        except Exception as exc:  # a template raising on a bad conversation, via raise_exception
            raise PromptRejectedError(f"the chat template refused the messages: {exc}") from exc

    def _count_sync(self, prompts: list[Prompt]) -> tuple[int, ...]:
        encode = self._encode
        out = []
        for p in prompts:
            if p.token_count is not None:
                out.append(p.token_count)
            elif p.messages is not None:
                out.append(len(encode(self.render(p), add_special_tokens=False)))
            else:
                out.append(len(encode(p.text, add_special_tokens=True)))
        return tuple(out)

    async def count(self, body: dict) -> PromptCount:
        import asyncio

        prompts = prompts_of(body)
        size = sum(_chars(p) for p in prompts)
        if size <= self.INLINE_CHARS:
            tokens = self._count_sync(prompts)
        else:
            tokens = await asyncio.to_thread(self._count_sync, prompts)
        return PromptCount(tokens, self.method, True)


def _chars(prompt: Prompt) -> int:
    """About how many characters a prompt holds (to decide whether to encode it off the loop)."""
    if prompt.text is not None:
        return len(prompt.text)
    size = 0
    for message in prompt.messages or ():
        content = message.get("content") if isinstance(message, dict) else message
        size += len(content) if isinstance(content, str) else len(str(content))
    return size


def _compile_template(source: str) -> Any:
    """A sandboxed jinja2 template with the helpers HF chat templates expect."""
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    def tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
               separators: Any = None, sort_keys: bool = False) -> str:
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except TemplateError as exc:
        raise InputError(f"the chat template does not compile: {exc}", field="prompt_tokens.tokenizer") from exc


def make_counter(counting: PromptCounting, *, client: Any = None) -> Any:
    """The counter a gateway.yaml asks for. An estimate configured beside upstream-tokenize is
    its fallback when /tokenize fails; without one, a failure is an error, never a guess."""
    estimate = None
    if counting.chars_per_token is not None:
        estimate = EstimateCounter(counting.chars_per_token, counting.margin_tokens)
    if counting.method == "estimate":
        return estimate
    if counting.method == "tokenizer":
        return LocalTokenizerCounter.load(counting.tokenizer)
    if client is None:
        raise ValueError("upstream-tokenize needs the upstream's client (kvtune.gateway.upstream.UpstreamClient)")
    return UpstreamTokenizeCounter(client, fallback=estimate)


__all__ = [
    "Prompt", "PromptCount", "prompts_of", "EstimateCounter", "UpstreamTokenizeCounter",
    "LocalTokenizerCounter", "PromptCountError", "PromptRejectedError", "make_counter",
]
