"""Prompt counting for admission: every request shape, the local tokenizer with its chat template,
the upstream's /tokenize (the fake vLLM on loopback, tests/support/fake_vllm.py), and the configured estimate."""

from __future__ import annotations

import asyncio
import json

import pytest
from fake_vllm import FakeVllm, Tokens

from kvtune.domain.route import Api
from kvtune.errors import InputError
from kvtune.gateway.apis import Prompt, read_request
from kvtune.gateway.body import BodyError
from kvtune.gateway.config import CountingMethod, PromptCounting
from kvtune.gateway.counting import (
    TOKENIZE_CONCURRENCY,
    EstimateCounter,
    LocalTokenizerCounter,
    PromptCountError,
    PromptCountInvalidError,
    PromptRejectedError,
    UpstreamTokenizeCounter,
    make_counter,
    tokenize_payload,
)
from kvtune.gateway.upstream import UpstreamClient


def count(counter, body: dict, api: Api | None = None):
    """Count a body as the gateway does: read by its endpoint's rules, then counted."""
    if api is None:
        api = Api.CHAT if "messages" in body else Api.COMPLETIONS if "prompt" in body else Api.RESPONSES
    asked = read_request(api, body)
    return asyncio.run(counter.count(asked.prompts, body.get("model")))


# ---------------------------------------------------------------- local tokenizer

def test_local_counter_applies_the_chat_template(model_dir):
    counter = LocalTokenizerCounter.load(str(model_dir))
    body = {"messages": [{"role": "system", "content": "hello"}, {"role": "user", "content": "how are you"}]}
    counted = count(counter, body)
    # <s> <|system|> hello <|end|> <|user|> how are you <|end|> <|assistant|>: 10, no second BOS
    assert counted.tokens == (10,) and counted.exact and counted.method is CountingMethod.TOKENIZER
    no_gen = count(counter, {**body, "add_generation_prompt": False})
    assert no_gen.tokens == (9,)
    kwargs = count(counter, {**body, "chat_template_kwargs": {"think": True}})
    assert kwargs.tokens == (11,)
    tools = count(counter, {**body, "tools": [{"type": "function"}]})
    assert tools.tokens[0] > 11


def test_responses_prompts_get_the_second_bos_vllm_adds(model_dir):
    """vLLM 0.32 tokenizes a Responses prompt with special tokens added, so a tokenizer whose
    post-processor adds BOS (this one, Llama's, Mistral's) puts a second <s> after the template's;
    test_gateway_live shows it on the engine with Mistral's tokenizer. Chat gets no second BOS."""
    counter = LocalTokenizerCounter.load(str(model_dir))
    messages = [{"role": "system", "content": "hello"}, {"role": "user", "content": "how are you"}]
    assert count(counter, {"messages": messages}).tokens == (10,)
    assert count(counter, {"instructions": "hello", "input": "how are you"}).tokens == (11,)
    assert tokenize_payload("m", read_request(Api.RESPONSES, {"input": "a"}).prompts[0])[1] == {
        "model": "m", "messages": [{"role": "user", "content": "a"}], "add_special_tokens": True}
    assert "add_special_tokens" not in tokenize_payload("m", read_request(Api.CHAT, {"messages": messages}).prompts[0])[1]


FIELDS_TEMPLATE = (
    "{% for m in messages %}[{{ m.role }}"
    "{% if m.reasoning_content is defined %} think={{ m.reasoning_content }}{% endif %}"
    "{% if m.reasoning is defined %} reasoning={{ m.reasoning }}{% endif %}"
    "{% for c in m.tool_calls or [] %} call={{ c.function.arguments | tojson }}{% endfor %}"
    "{% if m.extra is defined %} extra={{ m.extra }}{% endif %}"
    "{% if m.name is defined %} name={{ m.name }}{% endif %}] {{ m.content }}\n{% endfor %}"
)


def test_local_counter_renders_the_messages_vllm_renders(model_dir):
    """vLLM 0.32 renames reasoning_content to reasoning and gives the template both, parses each
    tool call's arguments string into an object, drops an empty tool_calls list and every key it
    does not keep, and joins a tool message's text parts (test_gateway_render_vllm checks the
    counts on the engine)."""
    base = LocalTokenizerCounter.load(str(model_dir))
    counter = LocalTokenizerCounter(base.tokenizer, FIELDS_TEMPLATE, base.special_tokens)
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"city":"Paris"}'}}
    messages = [
        {"role": "assistant", "content": "a", "reasoning_content": "why"},
        {"role": "assistant", "content": "b", "reasoning": "kept", "reasoning_content": "lost"},
        {"role": "assistant", "content": "c", "tool_calls": [call, {**call, "function": {"name": "f", "arguments": "{bad"}}]},
        {"role": "assistant", "content": "d", "tool_calls": [], "extra": "dropped"},
        {"role": "tool", "tool_call_id": "c", "content": [{"type": "text", "text": "x"}, {"type": "text", "text": "y"}]},
        {"role": "user", "content": "e", "name": "bob", "reasoning_content": "users have none"},
    ]
    prompt = read_request(Api.CHAT, {"messages": messages}).prompts[0]
    assert counter.render(prompt) == (
        "[assistant think=why reasoning=why] a\n"
        "[assistant think=kept reasoning=kept] b\n"
        '[assistant call={"city": "Paris"} call={}] c\n'
        "[assistant] d\n"
        "[tool] x\ny\n"
        "[user name=bob] e\n"
    )
    assert messages[0] == {"role": "assistant", "content": "a", "reasoning_content": "why"}  # the request is untouched
    assert counter.counts_here(prompt)


def test_developer_messages_become_one_leading_system_message_for_a_template_without_them(model_dir):
    """vLLM 0.32 (renderers/hf.py safe_apply_chat_template) gives a template that never names the
    developer role its developer messages as system ones, all system messages merged up front."""
    base = LocalTokenizerCounter.load(str(model_dir))
    counter = LocalTokenizerCounter(base.tokenizer, FIELDS_TEMPLATE, base.special_tokens)
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
                {"role": "developer", "content": "d", "tools": [{"type": "function"}]}]
    prompt = read_request(Api.CHAT, {"messages": messages}).prompts[0]
    assert counter.render(prompt) == "[system] s\n\nd\n[user] u\n"
    aware = LocalTokenizerCounter(base.tokenizer, FIELDS_TEMPLATE + "{# 'developer' #}", base.special_tokens)
    assert aware.render(prompt) == "[system] s\n[user] u\n[developer] d\n"


def test_chat_add_special_tokens_is_counted_and_forwarded(model_dir):
    """A chat request may ask vLLM to add the tokenizer's special tokens before the rendered chat
    (a BOS here, before the template's own); the count adds them and /tokenize is asked so."""
    counter = LocalTokenizerCounter.load(str(model_dir))
    body = {"messages": [{"role": "user", "content": "how are you"}]}
    plain = count(counter, body).tokens[0]
    assert count(counter, {**body, "add_special_tokens": True}).tokens == (plain + 1,)
    assert count(counter, {**body, "add_special_tokens": False}).tokens == (plain,)
    prompt = read_request(Api.CHAT, {**body, "add_special_tokens": True}).prompts[0]
    assert tokenize_payload("m", prompt)[1]["add_special_tokens"] is True
    with pytest.raises(BodyError, match="add_special_tokens must be true or false"):
        read_request(Api.CHAT, {**body, "add_special_tokens": "true"})


def test_template_fields_override_chat_template_kwargs_as_vllm_032_does(model_dir):
    """vLLM 0.32 builds the template's kwargs as chat_template_kwargs | the request's own fields
    that are set (ChatCompletionRequest.build_chat_params; test_gateway_live checks it on the
    engine): add_generation_prompt (default true) wins over a kwarg of that name, while a kwarg
    that is no request field (bos_token) replaces the special token."""
    counter = LocalTokenizerCounter.load(str(model_dir))
    body = {"messages": [{"role": "user", "content": "how are you"}]}
    plain = count(counter, body).tokens[0]
    no_gen = {"chat_template_kwargs": {"add_generation_prompt": False}}
    assert count(counter, {**body, **no_gen}).tokens == (plain,)
    no_bos = {"chat_template_kwargs": {"bos_token": ""}}
    assert count(counter, {**body, **no_bos}).tokens == (plain - 1,)
    for bad in ({"messages": []}, ["think"]):
        with pytest.raises(BodyError, match="chat_template_kwargs"):
            count(counter, {**body, "chat_template_kwargs": bad})


def test_content_parts_and_anthropic_requests_are_counted_by_the_engine(model_dir):
    """Parts that are not text (an image: the engine's placeholder and its processor) and
    Anthropic requests, which vLLM converts itself, are asked of the engine (exactly), not a guess;
    text parts are counted here (test_text_parts_are_counted_here)."""
    fake = FakeVllm(tokens=Tokens(chat=16))  # a chat costs 16 tokens more than its words

    async def run(client):
        local = LocalTokenizerCounter.load(str(model_dir)).with_upstream(UpstreamTokenizeCounter(client))
        parts = read_request(Api.CHAT, {"messages": [
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}]})
        mixed = read_request(Api.COMPLETIONS, {"prompt": ["hello world", [1, 2]]})
        anthropic = read_request(Api.MESSAGES, {"model": "m", "max_tokens": 5, "system": "be brief",
                                                "messages": [{"role": "user", "content": "hi"}]})
        return (await local.count(parts.prompts), await local.count(mixed.prompts),
                await local.count(anthropic.prompts, "m"))

    parts, mixed, anthropic = asyncio.run(_counted_by(fake, run))
    assert parts.tokens == (16 + 0,) and parts.exact  # the fake counts the image as no word
    seen = [(c.path, c.parsed) for c in fake.count_calls]
    assert mixed.tokens == (3, 2) and [p for p, _ in seen].count("/tokenize") == 1  # text counted here
    assert anthropic.tokens == (16 + 2 + 1,)  # the engine's: "be brief" and "hi", not the local template's
    assert seen[-1] == ("/v1/messages/count_tokens", {"model": "m", "system": "be brief",
                                                      "messages": [{"role": "user", "content": "hi"}]})


def test_local_counter_without_an_engine_refuses_what_it_cannot_count(model_dir):
    counter = LocalTokenizerCounter.load(str(model_dir))
    with pytest.raises(PromptCountError, match="engine's own count"):
        count(counter, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]})


def test_text_parts_are_counted_here(model_dir):
    """vLLM joins a message's text parts (text, input_text, output_text, refusal, thinking; a
    text part without text or with an empty one skipped) by newlines for a template that reads strings, and drops
    Claude Code's attribution line from a system message: counted in process, no engine needed
    (before: every list content was the engine's to count, a 503 without one)."""
    counter = LocalTokenizerCounter.load(str(model_dir))
    parts = [{"type": "text", "text": "hello"}, "there", {"type": "refusal", "refusal": "no"}, {"type": "text"},
             {"type": "text", "text": ""}, {"type": "input_text", "text": "how", "cache_control": {"type": "ephemeral"}}]
    system = [{"type": "text", "text": "x-anthropic-billing-header: cch=1\nbe brief"}]
    prompt = read_request(Api.CHAT, {"messages": [{"role": "system", "content": system},
                                                  {"role": "user", "content": parts}]}).prompts[0]
    assert counter.render(prompt) == "<s><|system|>be brief<|end|><|user|>hello\nthere\nno\nhow<|end|><|assistant|>"
    assert count(counter, {"messages": [{"role": "user", "content": parts}]}).exact


def test_local_counter_plain_prompts_get_bos(model_dir):
    counter = LocalTokenizerCounter.load(str(model_dir / "tokenizer.json"))
    counted = count(counter, {"prompt": ["the quick brown fox", [1, 2, 3, 4, 5, 6, 7]]})
    assert counted.tokens == (5, 7)


def test_local_counter_large_prompt_counts_off_the_loop(model_dir):
    counter = LocalTokenizerCounter.load(str(model_dir))
    text = "hello " * 10_000
    assert count(counter, {"prompt": text}).tokens == (10_001,)


def test_local_counter_template_that_raises_rejects_the_prompt(model_dir):
    cfg = json.loads((model_dir / "tokenizer_config.json").read_text())
    cfg["chat_template"] = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}{% endif %}x"
    (model_dir / "tokenizer_config.json").write_text(json.dumps(cfg))
    counter = LocalTokenizerCounter.load(str(model_dir))
    with pytest.raises(PromptRejectedError, match="user first"):
        count(counter, {"messages": [{"role": "system", "content": "x"}]})


def test_local_counter_without_a_template_fails_at_load(model_dir):
    (model_dir / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>"}))
    with pytest.raises(InputError, match="no chat template"):
        make_counter(PromptCounting(method=CountingMethod.TOKENIZER, tokenizer=str(model_dir)))


def test_chat_template_jinja_file_is_used(model_dir):
    (model_dir / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>"}))
    (model_dir / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }} {% endfor %}")
    counter = LocalTokenizerCounter.load(str(model_dir))
    assert count(counter, {"messages": [{"role": "user", "content": "a b c"}]}).tokens == (3,)


# ---------------------------------------------------------------- estimate

def test_estimate_adds_its_margin():
    counter = make_counter(PromptCounting(method=CountingMethod.ESTIMATE, chars_per_token=2.0, margin_tokens=10))
    counted = count(counter, {"prompt": ["abcde", [1, 2]]})
    assert counted.tokens == (3 + 10, 2) and not counted.exact
    messages = [{"role": "user", "content": "x" * 100}]
    n = EstimateCounter(4.0, 5).estimate(Prompt(messages=messages, template_args={}))
    assert n == -(-len(json.dumps([messages, {}], separators=(",", ":"))) // 4) + 5


@pytest.mark.parametrize("extra", [
    {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"x": "y" * 400}}}]},
    {"tool_choice": {"type": "function", "function": {"name": "f" * 400}}},
    {"response_format": {"type": "json_schema", "json_schema": {"schema": {"d": "z" * 400}}}},
    {"documents": [{"text": "w" * 400}]},
    {"chat_template_kwargs": {"extra": "v" * 400}},
])
def test_estimate_counts_every_part_of_the_rendered_prompt(extra):
    """Tools, tool_choice, schemas and documents can all reach the prompt: an estimate that
    skipped them would let a client hide most of its prompt there."""
    counter = EstimateCounter(4.0, 0)
    body = {"messages": [{"role": "user", "content": "hi"}]}
    assert count(counter, {**body, **extra}).tokens[0] >= count(counter, body).tokens[0] + 100


# ---------------------------------------------------------------- upstream /tokenize

async def _counted_by(fake: FakeVllm, fn):
    """fn(client) against the fake vLLM's /tokenize, on this loop."""
    async with fake:
        client = UpstreamClient(fake.url + "/")
        try:
            return await fn(client)
        finally:
            await client.close()


def test_upstream_tokenize_sends_messages_and_prompts():
    fake = FakeVllm(tokens=Tokens(prompt=3, chat=3))  # words + 3, chat or raw

    async def run(client):
        counter = UpstreamTokenizeCounter(client)
        chat = read_request(Api.CHAT, {"model": "m", "messages": [{"role": "user", "content": "a b"}],
                                       "tools": [{"t": 1}], "max_tokens": 5, "documents": [{"text": "d"}],
                                       "reasoning_effort": "low"})
        many = read_request(Api.COMPLETIONS, {"model": "m", "prompt": ["a", "b c", [1, 2]]})
        return await counter.count(chat.prompts, "m"), await counter.count(many.prompts, "m")

    chat, many = asyncio.run(_counted_by(fake, run))
    assert chat.tokens == (2 + 1 + 3,) and chat.exact and chat.method is CountingMethod.UPSTREAM_TOKENIZE  # the document too
    assert many.tokens == (4, 5, 2)
    # /tokenize takes neither documents nor reasoning_effort: they travel as template kwargs
    seen = fake.tokenize_calls
    assert seen[0] == {"model": "m", "messages": [{"role": "user", "content": "a b"}], "tools": [{"t": 1}],
                       "chat_template_kwargs": {"documents": [{"text": "d"}], "reasoning_effort": "low",
                                                "enable_thinking": True}}
    assert {"model": "m", "prompt": "b c"} in seen


def test_a_batch_opens_a_bounded_number_of_tokenize_calls():
    """2,000 prompts in one request: never more than TOKENIZE_CONCURRENCY calls at once."""
    fake = FakeVllm(delay_s=0.001)

    async def run(client):
        asked = read_request(Api.COMPLETIONS, {"prompt": [f"p{i}" for i in range(2000)]})
        return await UpstreamTokenizeCounter(client).count(asked.prompts, "m")

    counted = asyncio.run(_counted_by(fake, run))
    assert counted.tokens == (1,) * 2000
    assert len(fake.tokenize_calls) == 2000
    assert fake.tokenize_peak <= TOKENIZE_CONCURRENCY


@pytest.mark.parametrize("answer", [{"count": -3}, {"count": "12"}, {"count": True}, {"tokens": []}, [5]])
def test_upstream_count_that_is_no_count_is_invalid(answer):
    fake = FakeVllm()
    fake.tokenize_answer = answer

    async def run(client):
        with pytest.raises(PromptCountInvalidError):
            await UpstreamTokenizeCounter(client).count((Prompt(text="x"),), "m")

    asyncio.run(_counted_by(fake, run))


def test_upstream_400_rejects_and_500_errors_or_falls_back():
    fake = FakeVllm()

    async def run(client):
        fake.tokenize_status = 400
        fake.tokenize_answer = {"error": {"message": "This model's maximum context length is 512 tokens",
                                          "type": "BadRequestError"}}
        with pytest.raises(PromptRejectedError, match="maximum context length"):
            await UpstreamTokenizeCounter(client).count((Prompt(text="long"),))
        fake.tokenize_status, fake.tokenize_answer = 500, {"error": "down"}
        with pytest.raises(PromptCountError, match="500"):
            await UpstreamTokenizeCounter(client).count((Prompt(text="x y"),))
        fallback = UpstreamTokenizeCounter(client, fallback=EstimateCounter(1.0, 7))
        return await fallback.count((Prompt(text="x y"),))

    counted = asyncio.run(_counted_by(fake, run))
    assert counted.tokens == (3 + 7,) and not counted.exact and counted.method is CountingMethod.ESTIMATE


def test_upstream_unreachable_is_a_count_error():
    async def run():
        counter = UpstreamTokenizeCounter(UpstreamClient("http://127.0.0.1:9"))
        with pytest.raises(PromptCountError, match="failed"):
            await counter.count((Prompt(text="a"),))

    asyncio.run(run())


# What each API's sampling fields force a request's length to (issue 26 item 2): min_tokens read
# where the endpoint reads it, the fields that can keep EOS from being sampled where vLLM 0.32's
# request model reads them (Responses: ignore_eos and logit_bias only; no min_tokens).
@pytest.mark.parametrize("api, body, forced, field", [
    (Api.CHAT, {"messages": [], "min_tokens": 448}, 448, None),
    (Api.CHAT, {"messages": [], "ignore_eos": True}, 0, "ignore_eos"),
    (Api.CHAT, {"messages": [], "ignore_eos": False, "logit_bias": {}, "stop_token_ids": [2], "stop": ["x"]}, 0, None),
    (Api.CHAT, {"messages": [], "min_tokens": "448"}, 0, "min_tokens"),
    (Api.CHAT_BATCH, {"messages": [[]], "bad_words": ["</s>"]}, 0, "bad_words"),
    (Api.COMPLETIONS, {"prompt": "a", "min_tokens": 20, "allowed_token_ids": [1]}, 20, "allowed_token_ids"),
    (Api.COMPLETIONS, {"prompt": "a", "logit_bias": {"7": 5}}, 0, "logit_bias"),
    (Api.TOKENS, {"token_ids": [1], "sampling_params": {"min_tokens": 9, "ignore_eos": 1}}, 9, "ignore_eos"),
    (Api.TOKENS, {"token_ids": [1], "ignore_eos": True, "sampling_params": {}}, 0, None),  # not where it reads
    (Api.RESPONSES, {"input": "a", "ignore_eos": True}, 0, "ignore_eos"),
    (Api.RESPONSES, {"input": "a", "min_tokens": 30, "bad_words": ["x"]}, 0, None),  # fields it does not read
    (Api.ANY, {"prompt": "a", "min_tokens": 5}, 5, None),
])
def test_each_api_reads_what_forces_its_length(api, body, forced, field):
    reading = read_request(api, body).readings[0]
    assert (reading.forced_tokens, reading.forces_cap) == (forced, field)
