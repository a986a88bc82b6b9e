"""Prompt token counts for admission: the prompt is part of every reservation, so it is counted
the way the engine will count it (chat template applied), not guessed.

Three counters share one interface, `await counter.count(prompts, model) -> PromptCount`, over
the prompts that kvtune.gateway.apis read from a request:
  UpstreamTokenizeCounter  the engine's own POST /tokenize and /v1/messages/count_tokens
  LocalTokenizerCounter    `tokenizers` + the model's jinja2 chat template, in process (the
                           engine counts what it cannot render exactly)
  EstimateCounter          characters / chars_per_token + a margin, only when configured

Errors:
  PromptCountError             the prompt cannot be counted now (upstream down); retryable
   ├── PromptRejectedError     the engine refused the prompt itself (too long, malformed)
   └── PromptCountInvalidError the engine answered a count that is not one (a bad gateway)
"""

from __future__ import annotations

import asyncio
import copy
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol

from kvtune.errors import InputError
from kvtune.gateway import _json
from kvtune.gateway.apis import Prompt
from kvtune.gateway.config import CountingMethod, PromptCounting
from kvtune.gateway.content_format import ContentFormat, detect_content_format
from kvtune.gateway.upstream import UpstreamError
from kvtune.gateway.vllm_messages import as_rendered, countable, for_template, rename_reasoning
from kvtune.ingest.tokenize import chat_template_of, hub_file, load_tokenizer, read_chat_template


class PromptCountError(Exception):
    """The prompt could not be counted now (the upstream is down or busy); the request may
    succeed later."""


class PromptRejectedError(PromptCountError):
    """The engine's tokenizer refused the prompt (e.g. longer than the context); never retryable."""


class PromptCountInvalidError(PromptCountError):
    """The upstream answered a count that is not one (negative, not a number): a bad gateway."""


@dataclass(frozen=True, slots=True)
class PromptCount:
    tokens: tuple[int, ...]
    method: CountingMethod  # how they were counted: an estimate stands in when the engine fails
    exact: bool


class PromptCounter(Protocol):
    """What admission asks of a counter: every prompt's tokens, for the request's model."""

    async def count(self, prompts: Sequence[Prompt], model: str | None = None) -> PromptCount: ...


def _estimate_text(prompt: Prompt) -> str:
    """Everything of a prompt that can reach the rendered text: messages, tools, documents,
    schemas, template arguments, an Anthropic request's system and tools."""
    if prompt.text is not None:
        return prompt.text
    if prompt.anthropic is not None:
        return _json.dumps_text(prompt.anthropic)
    return _json.dumps_text([prompt.messages, prompt.template_args or {}])


class EstimateCounter:
    """ceil(characters / chars_per_token) + margin per prompt: cheap, and never below the truth
    when chars_per_token is set at or under the model's worst case. Every part of the request
    that can reach the prompt is measured (tools, documents, schemas, template arguments)."""

    method = CountingMethod.ESTIMATE

    def __init__(self, chars_per_token: float, margin_tokens: int) -> None:
        self.chars_per_token = chars_per_token
        self.margin_tokens = margin_tokens

    def estimate(self, prompt: Prompt) -> int:
        if prompt.token_count is not None:
            return prompt.token_count
        return math.ceil(len(_estimate_text(prompt)) / self.chars_per_token) + self.margin_tokens

    async def count(self, prompts: Sequence[Prompt], model: Any = None) -> PromptCount:
        return PromptCount(tuple(self.estimate(p) for p in prompts), self.method, False)


# vLLM refuses a /tokenize body without this Content-Type
_JSON_HEADERS = (("Content-Type", "application/json"),)
# At most this many /tokenize calls at once for one request (a batch of prompts), so one request
# cannot open a thousand upstream calls.
TOKENIZE_CONCURRENCY = 4


def tokenize_payload(model: Any, prompt: Prompt) -> tuple[str, dict]:
    """The engine call that counts `prompt` exactly, as (path, body). Chat fields that
    /tokenize does not take (documents, reasoning_effort) travel in chat_template_kwargs,
    where vLLM 0.32 renders them the same way (checked on the live engine); the messages go
    with `reasoning_content` renamed as the chat request renames it and /tokenize does not."""
    if prompt.anthropic is not None:
        return "/v1/messages/count_tokens", prompt.anthropic
    if prompt.messages is None:
        return "/tokenize", {"model": model, "prompt": prompt.text}
    args = prompt.template_args or {}
    payload: dict[str, Any] = {"model": model, "messages": rename_reasoning(prompt.messages)}
    for key in ("tools", "add_generation_prompt", "continue_final_message"):
        if args.get(key) is not None:
            payload[key] = args[key]
    kwargs = _template_kwargs(args)
    if kwargs:
        payload["chat_template_kwargs"] = kwargs
    if prompt.add_special_tokens:
        payload["add_special_tokens"] = True
    return "/tokenize", payload


def _template_kwargs(args: dict) -> dict:
    """chat_template_kwargs as vLLM's chat request builds them (ChatCompletionRequest.
    build_chat_params): the client's kwargs, overridden by documents and reasoning_effort when
    set (None and "auto" leave a kwarg alone), and enable_thinking from reasoning_effort."""
    kwargs = dict(args.get("chat_template_kwargs") or {})
    effort = args.get("reasoning_effort")
    extra = {"documents": args.get("documents"), "reasoning_effort": effort}
    if effort is not None and "enable_thinking" not in kwargs:
        extra["enable_thinking"] = effort != "none"
    kwargs.update({k: v for k, v in extra.items() if v is not None and v != "auto"})
    return kwargs


class UpstreamTokenizeCounter:
    """The engine's own count: POST /tokenize ({"model", "prompt"} or {"model", "messages",
    ...} -> {"count"}) and, for Anthropic requests, /v1/messages/count_tokens. One call per
    prompt, at most TOKENIZE_CONCURRENCY at once, on the gateway's keep-alive connections to that
    upstream (an UpstreamClient); token ids are counted locally."""

    method = CountingMethod.UPSTREAM_TOKENIZE

    def __init__(self, client: Any, *, fallback: EstimateCounter | None = None) -> None:
        self.client = client
        self.fallback = fallback

    async def one(self, model: Any, prompt: Prompt) -> tuple[int, bool]:
        """(tokens, exact) for one prompt; exact is False when the configured estimate stood in."""
        if prompt.token_count is not None:
            return prompt.token_count, True
        path, payload = tokenize_payload(model, prompt)
        try:
            resp = await self.client.request("POST", path, _JSON_HEADERS, _json.dumps_bytes(payload))
            data = await resp.read_and_release()
            status = resp.status
        except UpstreamError as exc:
            if self.fallback is not None:
                return self.fallback.estimate(prompt), False
            raise PromptCountError(f"the upstream {path} failed: {exc}") from exc
        try:
            parsed = _json.loads(data)
        except (ValueError, UnicodeDecodeError):
            parsed = None
        if status == 200:
            key = "input_tokens" if prompt.anthropic is not None else "count"
            count = parsed.get(key) if isinstance(parsed, dict) else None
            if isinstance(count, int) and not isinstance(count, bool) and count >= 0:
                return count, True
            raise PromptCountInvalidError(f"the upstream {path} answered no count: {_short(data)}")
        if status == 400:
            message = _error_message(parsed) or "the upstream tokenizer refused the prompt"
            raise PromptRejectedError(message)
        if self.fallback is not None:
            return self.fallback.estimate(prompt), False
        raise PromptCountError(f"the upstream {path} answered {status}")

    async def count(self, prompts: Sequence[Prompt], model: Any = None) -> PromptCount:
        if len(prompts) == 1:
            results = [await self.one(model, prompts[0])]
        else:
            gate = asyncio.Semaphore(TOKENIZE_CONCURRENCY)

            async def bounded(prompt: Prompt) -> tuple[int, bool]:
                async with gate:
                    return await self.one(model, prompt)

            results = await asyncio.gather(*(bounded(p) for p in prompts))
        exact = all(e for _, e in results)
        return PromptCount(tuple(n for n, _ in results), self.method if exact else CountingMethod.ESTIMATE, exact)


def _short(data: bytes) -> str:
    text = data[:80].decode("utf-8", "replace")
    return repr(text + ("…" if len(data) > 80 else ""))


def _error_message(parsed: Any) -> str | None:
    if isinstance(parsed, dict):
        err = parsed.get("error", parsed)
        if isinstance(err, dict) and isinstance(err.get("message"), str):
            return err["message"][:500]
        if isinstance(parsed.get("message"), str):
            return parsed["message"][:500]
    return None


def _special_token(value: Any) -> str | None:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


class LocalTokenizerCounter:
    """The model's tokenizer.json and chat template, in process: the same count the engine makes,
    without a round trip. Chat text is encoded without special tokens (the template holds them);
    plain prompts with them, as vLLM does. What it cannot render as the engine would (message
    content given as parts, which vLLM reshapes by the template's content format; Anthropic
    requests, which vLLM converts first) is counted by the engine itself through `upstream`."""

    method = CountingMethod.TOKENIZER

    # Prompts longer than this are encoded in a worker thread so the event loop keeps serving.
    INLINE_CHARS = 16_384

    def __init__(self, tokenizer: Any, chat_template: str | None, special_tokens: dict[str, str | None],
                 *, upstream: UpstreamTokenizeCounter | None = None) -> None:
        self.tokenizer = tokenizer
        self.special_tokens = special_tokens
        self.upstream = upstream
        self.template_source = chat_template or ""
        self.template = _compile_template(chat_template) if chat_template else None
        # vLLM hands a template that loops over a message's content parts, not strings
        self.content_format = (detect_content_format(chat_template, self.template.environment)
                               if self.template is not None and chat_template else ContentFormat.STRING)
        # What every render starts from: the template's globals (a ChainMap that jinja would
        # flatten on every render, most of a short render's time) and the special tokens.
        self._base_vars = {**self.template.globals, **special_tokens} if self.template else {}
        self._encode = tokenizer.encode

    @classmethod
    def load(cls, spec: str, *, upstream: UpstreamTokenizeCounter | None = None) -> LocalTokenizerCounter:
        """From a tokenizer.json, a model directory, or a hub id (tokenizer_config.json beside it
        supplies the chat template and bos/eos tokens)."""
        try:
            tokenizer = load_tokenizer(spec)
        except InputError as exc:  # name the gateway.yaml key, not the profile command's option
            raise InputError(exc.message.replace("set tokenizer:", "set prompt_tokens.tokenizer:"), path=exc.path,
                             field="prompt_tokens.tokenizer") from exc
        path = Path(spec).expanduser()
        folder = path if path.is_dir() else path.parent if path.is_file() else None
        if folder is not None:
            config, template = read_chat_template(folder)
        else:
            try:
                config = json.loads(Path(hub_file(spec, "tokenizer_config.json")).read_text("utf-8"))
            except InputError as exc:
                raise InputError(exc.message, field="prompt_tokens.tokenizer") from exc
            except (OSError, ValueError) as exc:
                raise InputError(f"cannot read tokenizer_config.json for {spec!r} ({type(exc).__name__})",
                                 field="prompt_tokens.tokenizer") from exc
            template = chat_template_of(config)
        if template is None:
            raise InputError("the tokenizer has no chat template (tokenizer_config.json chat_template or "
                             "chat_template.jinja); use method upstream-tokenize", path=spec,
                             field="prompt_tokens.tokenizer")
        specials = {k: _special_token(config.get(k)) for k in ("bos_token", "eos_token", "pad_token", "unk_token")}
        return cls(tokenizer, template, specials, upstream=upstream)

    def render(self, prompt: Prompt) -> str:
        """The chat template applied as vLLM 0.32 applies it (checked on the live engine): the
        special tokens, then chat_template_kwargs (which may replace them), then the request's
        own template fields wherever they are set (add_generation_prompt, default true, wins over
        a kwarg of that name), then the messages (as vLLM reshapes them: vllm_messages) and tools."""
        template = self.template
        if template is None:
            raise PromptCountError("no chat template to render messages with")
        args = prompt.template_args or {}
        context = self._base_vars.copy()
        context.update(_template_kwargs(args))
        context["add_generation_prompt"] = args.get("add_generation_prompt", True)
        context["continue_final_message"] = args.get("continue_final_message", False)
        messages = for_template(as_rendered(prompt.messages or [], self.content_format), self.template_source)
        context["messages"] = messages
        if args.get("tools") is not None:
            context["tools"] = args["tools"]
        try:
            # Template.render(**context) minus its per-call copy of the globals (shared=True
            # hands `context`, which already holds them, to the template as is)
            text = "".join(template.root_render_func(template.new_context(context, shared=True)))
        except Exception as exc:  # a template raising on a bad conversation, via raise_exception
            raise PromptRejectedError(f"the chat template refused the messages: {_clip(exc)}") from exc
        if context["continue_final_message"]:
            text = _open_final_message(text, messages)
        return text

    def with_upstream(self, upstream: UpstreamTokenizeCounter | None) -> LocalTokenizerCounter:
        """The same tokenizer, asking `upstream` for what it cannot count itself."""
        twin = copy.copy(self)
        twin.upstream = upstream
        return twin

    @staticmethod
    def counts_here(prompt: Prompt) -> bool:
        """True when this process counts the prompt exactly as the engine would."""
        if prompt.anthropic is not None:
            return False
        if prompt.messages is None:
            return True
        return countable(prompt.messages)

    def _count_sync(self, prompts: Sequence[Prompt]) -> list[int | None]:
        encode = self._encode
        out: list[int | None] = []
        for p in prompts:
            if p.token_count is not None:
                out.append(p.token_count)
            elif not self.counts_here(p):
                out.append(None)
            elif p.messages is not None:
                out.append(len(encode(self.render(p), add_special_tokens=p.add_special_tokens)))
            else:
                out.append(len(encode(p.text, add_special_tokens=True)))
        return out

    async def count(self, prompts: Sequence[Prompt], model: Any = None) -> PromptCount:
        size = sum(_chars(p) for p in prompts)
        if size <= self.INLINE_CHARS:
            tokens = self._count_sync(prompts)
        else:
            tokens = await asyncio.to_thread(self._count_sync, prompts)
        missing = [p for p, n in zip(prompts, tokens, strict=True) if n is None]
        if not missing:
            return PromptCount(tuple(n for n in tokens if n is not None), self.method, True)
        if self.upstream is None:
            raise PromptCountError("the prompt needs the engine's own count (content parts or an "
                                   "Anthropic request) and no upstream is configured")
        counted = iter((await self.upstream.count(missing, model)).tokens)
        return PromptCount(tuple(n if n is not None else next(counted) for n in tokens), self.method, True)


def _open_final_message(text: str, messages: list | None) -> str:
    """The rendered chat cut right after the final message's content, as transformers'
    apply_chat_template does for continue_final_message (so the model continues that message
    instead of starting a new turn): the end-of-turn tokens after it are not in the prompt."""
    final = messages[-1].get("content") if messages else None
    if isinstance(final, list):  # as transformers reads it: the last part that has text
        final = next((p["text"] for p in reversed(final) if isinstance(p, dict) and "text" in p), None)
    if not isinstance(final, str):
        raise PromptRejectedError("continue_final_message needs a final message with text content")
    for needle in (final, final.strip()):
        at = text.rfind(needle) if needle else -1
        if at >= 0:
            return text[:at + len(needle)]
    raise PromptRejectedError("continue_final_message: the final message is not in the rendered chat")


def _clip(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text[:200] + ("…" if len(text) > 200 else "")


def _chars(prompt: Prompt) -> int:
    """About how many characters a prompt holds (to decide whether to encode it off the loop)."""
    if prompt.text is not None:
        return len(prompt.text)
    size = 0
    for message in prompt.messages or ():
        content = message.get("content") if isinstance(message, dict) else message
        size += len(content) if isinstance(content, str) else 0
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


def make_counter(counting: PromptCounting, *, client: Any = None,
                 local: LocalTokenizerCounter | None = None) -> Any:
    """The counter a gateway.yaml asks for, for the upstream behind `client`. An estimate
    configured beside an exact method is its fallback when the engine's count fails; without
    one, a failure is an error, never a guess. `local` is a tokenizer already loaded."""
    estimate = None
    if counting.chars_per_token is not None:
        estimate = EstimateCounter(counting.chars_per_token, counting.margin_tokens)
    if counting.method is CountingMethod.ESTIMATE:
        return estimate
    engine = UpstreamTokenizeCounter(client, fallback=estimate) if client is not None else None
    if counting.method is CountingMethod.TOKENIZER:
        if local is None:
            if counting.tokenizer is None:  # the config reader requires one with this method
                raise ValueError("method 'tokenizer' needs prompt_tokens.tokenizer")
            local = LocalTokenizerCounter.load(counting.tokenizer)
        return local.with_upstream(engine)
    if engine is None:
        raise ValueError("upstream-tokenize needs the upstream's client (kvtune.gateway.upstream.UpstreamClient)")
    return engine


__all__ = [
    "PromptCount", "EstimateCounter", "UpstreamTokenizeCounter", "LocalTokenizerCounter",
    "PromptCountError", "PromptRejectedError", "PromptCountInvalidError", "make_counter",
    "tokenize_payload", "TOKENIZE_CONCURRENCY",
]
