"""Prompt counting for admission: every request shape, the local tokenizer with its chat template,
the upstream's /tokenize (a real aiohttp server on loopback), and the configured estimate."""

from __future__ import annotations

import asyncio
import json

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from kvtune.errors import InputError
from kvtune.gateway.counting import (
    EstimateCounter, LocalTokenizerCounter, Prompt, PromptCountError, PromptRejectedError,
    UpstreamTokenizeCounter, make_counter, prompts_of,
)
from kvtune.gateway.upstream import UpstreamClient
from kvtune.gateway_config import PromptCounting

TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    "{% if tools %}<|tools|>{{ tools | tojson }}{% endif %}"
    "{% if think %}<|think|>{% endif %}"
)


@pytest.fixture
def model_dir(tmp_path):
    """A tiny word-level tokenizer with special tokens and a BOS post-processor, as vLLM test
    models are built: tokenizer.json + tokenizer_config.json with a chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers

    specials = ["<unk>", "<s>", "</s>", "<|user|>", "<|system|>", "<|assistant|>", "<|end|>",
                "<|tools|>", "<|think|>"]
    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(["hello world how are you today", "the quick brown fox"],
                            trainers.WordLevelTrainer(special_tokens=specials))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": {"content": "<s>"}, "eos_token": "</s>", "chat_template": TEMPLATE}))
    return tmp_path


# ---------------------------------------------------------------- request shapes

@pytest.mark.parametrize("body, expected", [
    ({"messages": [{"role": "user", "content": "hi"}]},
     [Prompt(messages=[{"role": "user", "content": "hi"}], template_args={})]),
    ({"messages": [], "tools": [{"x": 1}], "add_generation_prompt": False},
     [Prompt(messages=[], template_args={"tools": [{"x": 1}], "add_generation_prompt": False})]),
    ({"prompt": "a b"}, [Prompt(text="a b")]),
    ({"prompt": [1, 2, 3]}, [Prompt(token_count=3)]),
    ({"prompt": ["a", [5, 6]]}, [Prompt(text="a"), Prompt(token_count=2)]),
    ({"input": "q"}, [Prompt(text="q")]),
    ({"input": [{"role": "user", "content": "q"}]},
     [Prompt(messages=[{"role": "user", "content": "q"}], template_args={})]),
    ({"input": "q", "instructions": "be brief"},
     [Prompt(messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "q"}],
             template_args={})]),
])
def test_prompts_of_every_shape(body, expected):
    assert prompts_of(body) == expected


def test_unrecognised_body_is_charged_whole():
    [p] = prompts_of({"model": "m", "weird": "x" * 40})
    assert p.text is not None and "x" * 40 in p.text


# ---------------------------------------------------------------- local tokenizer

def test_local_counter_applies_the_chat_template(model_dir):
    counter = LocalTokenizerCounter.load(str(model_dir))
    body = {"messages": [{"role": "system", "content": "hello"}, {"role": "user", "content": "how are you"}]}
    counted = asyncio.run(counter.count(body))
    # <s> <|system|> hello <|end|> <|user|> how are you <|end|> <|assistant|>: 10, no second BOS
    assert counted.tokens == (10,) and counted.exact and counted.method == "tokenizer"
    no_gen = asyncio.run(counter.count({**body, "add_generation_prompt": False}))
    assert no_gen.tokens == (9,)
    kwargs = asyncio.run(counter.count({**body, "chat_template_kwargs": {"think": True}}))
    assert kwargs.tokens == (11,)
    tools = asyncio.run(counter.count({**body, "tools": [{"type": "function"}]}))
    assert tools.tokens[0] > 11


def test_chat_template_kwargs_are_merged_last_as_vllm_does(model_dir):
    counter = LocalTokenizerCounter.load(str(model_dir))
    body = {"messages": [{"role": "user", "content": "how are you"}]}
    plain = asyncio.run(counter.count(body)).tokens[0]
    # they override the request's own template fields and the special tokens
    no_gen = {"chat_template_kwargs": {"add_generation_prompt": False}}
    assert asyncio.run(counter.count({**body, **no_gen})).tokens == (plain - 1,)
    no_bos = {"chat_template_kwargs": {"bos_token": ""}}
    assert asyncio.run(counter.count({**body, **no_bos})).tokens == (plain - 1,)
    for bad in ({"messages": []}, ["think"]):
        with pytest.raises(PromptRejectedError, match="chat_template_kwargs"):
            asyncio.run(counter.count({**body, "chat_template_kwargs": bad}))


def test_local_counter_plain_prompts_get_bos(model_dir):
    counter = LocalTokenizerCounter.load(str(model_dir / "tokenizer.json"))
    counted = asyncio.run(counter.count({"prompt": ["the quick brown fox", [1, 2, 3, 4, 5, 6, 7]]}))
    assert counted.tokens == (5, 7)


def test_local_counter_large_prompt_counts_off_the_loop(model_dir):
    counter = LocalTokenizerCounter.load(str(model_dir))
    text = "hello " * 10_000
    assert asyncio.run(counter.count({"prompt": text})).tokens == (10_001,)


def test_local_counter_template_that_raises_rejects_the_prompt(model_dir):
    cfg = json.loads((model_dir / "tokenizer_config.json").read_text())
    cfg["chat_template"] = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}{% endif %}x"
    (model_dir / "tokenizer_config.json").write_text(json.dumps(cfg))
    counter = LocalTokenizerCounter.load(str(model_dir))
    with pytest.raises(PromptRejectedError, match="user first"):
        asyncio.run(counter.count({"messages": [{"role": "system", "content": "x"}]}))


def test_local_counter_without_a_template_fails_at_load(model_dir):
    (model_dir / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>"}))
    with pytest.raises(InputError, match="no chat template"):
        make_counter(PromptCounting(method="tokenizer", tokenizer=str(model_dir)))


def test_chat_template_jinja_file_is_used(model_dir):
    (model_dir / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>"}))
    (model_dir / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }} {% endfor %}")
    counter = LocalTokenizerCounter.load(str(model_dir))
    assert asyncio.run(counter.count({"messages": [{"role": "user", "content": "a b c"}]})).tokens == (3,)


# ---------------------------------------------------------------- estimate

def test_estimate_adds_its_margin():
    counter = make_counter(PromptCounting(method="estimate", chars_per_token=2.0, margin_tokens=10))
    counted = asyncio.run(counter.count({"prompt": ["abcde", [1, 2]]}))
    assert counted.tokens == (3 + 10, 2) and not counted.exact
    messages = [{"role": "user", "content": "x" * 100}]
    n = EstimateCounter(4.0, 5).estimate(Prompt(messages=messages))
    assert n == -(-len(json.dumps(messages, separators=(",", ":"))) // 4) + 5


# ---------------------------------------------------------------- upstream /tokenize

async def _with_tokenizer_server(handler, fn):
    app = web.Application()
    app.router.add_post("/tokenize", handler)
    server = TestServer(app)
    await server.start_server()
    client = UpstreamClient(str(server.make_url("/")))
    try:
        return await fn(client)
    finally:
        await client.close()
        await server.close()


def test_upstream_tokenize_sends_messages_and_prompts():
    seen = []

    async def tokenize(request):
        body = await request.json()
        seen.append(body)
        text = body.get("prompt") or " ".join(m["content"] for m in body["messages"])
        return web.json_response({"count": len(text.split()) + 3, "max_model_len": 512, "tokens": []})

    async def run(client):
        counter = UpstreamTokenizeCounter(client)
        chat = await counter.count({"model": "m", "messages": [{"role": "user", "content": "a b"}],
                                    "tools": [{"t": 1}], "max_tokens": 5})
        many = await counter.count({"model": "m", "prompt": ["a", "b c", [1, 2]]})
        return chat, many

    chat, many = asyncio.run(_with_tokenizer_server(tokenize, run))
    assert chat.tokens == (5,) and chat.exact and chat.method == "upstream-tokenize"
    assert many.tokens == (4, 5, 2)
    assert seen[0] == {"model": "m", "messages": [{"role": "user", "content": "a b"}], "tools": [{"t": 1}]}
    assert {"model": "m", "prompt": "b c"} in seen


def test_upstream_400_rejects_and_500_errors_or_falls_back():
    async def tokenize(request):
        body = await request.json()
        if body["prompt"] == "long":
            return web.json_response({"error": {"message": "This model's maximum context length is 512 tokens",
                                                 "type": "BadRequestError"}}, status=400)
        return web.json_response({"error": "down"}, status=500)

    async def run(client):
        with pytest.raises(PromptRejectedError, match="maximum context length"):
            await UpstreamTokenizeCounter(client).count({"prompt": "long"})
        with pytest.raises(PromptCountError, match="500"):
            await UpstreamTokenizeCounter(client).count({"prompt": "x y"})
        fallback = UpstreamTokenizeCounter(client, fallback=EstimateCounter(1.0, 7))
        return await fallback.count({"prompt": "x y"})

    counted = asyncio.run(_with_tokenizer_server(tokenize, run))
    assert counted.tokens == (3 + 7,) and not counted.exact and counted.method == "estimate"


def test_upstream_unreachable_is_a_count_error():
    async def run():
        counter = UpstreamTokenizeCounter(UpstreamClient("http://127.0.0.1:9"))
        with pytest.raises(PromptCountError, match="failed"):
            await counter.count({"prompt": "a"})

    asyncio.run(run())
