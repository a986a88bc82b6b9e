"""The gateway's prompt counts against a real vLLM on CPU: for every request shape the gateway
reads, the count it reserves for equals the prompt tokens the engine reports in `usage`. The
model's chat template uses the fields that reach a prompt besides the messages (documents,
reasoning_effort, tools, template kwargs), so a count that skipped one would differ here."""

from __future__ import annotations

import asyncio
import json
import urllib.request

import pytest

from kvtune.domain.route import Api
from kvtune.gateway.apis import read_request
from kvtune.gateway.counting import LocalTokenizerCounter, UpstreamTokenizeCounter
from kvtune.gateway.upstream import UpstreamClient

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ ' ' + message['role'] + ': ' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}{{ part['text'] + ' ' }}{% endfor %}{% endif %}"
    "{{ ' ' + eos_token }}{% endfor %}"
    "{% if documents %}{% for d in documents %}{{ ' doc: ' + d['text'] }}{% endfor %}{% endif %}"
    "{% if think %}{{ ' think' }}{% endif %}"
    "{% if reasoning_effort %}{{ ' effort ' + reasoning_effort }}{% endif %}"
    "{% if tools %}{% for t in tools %}{{ ' tool ' + t['function']['name'] }}{% endfor %}{% endif %}"
    "{% if add_generation_prompt %}{{ ' assistant:' }}{% endif %}"
)


@pytest.fixture(scope="module")
def engine(tmp_path_factory, vllm_factory, vllm_tokenizer):
    """The engine on a model with TEMPLATE, once with each tokenizer (the toy one and Mistral-7B's)."""
    from vllm_server import write_tiny_model

    model = write_tiny_model(tmp_path_factory.mktemp(f"gateway-live-{vllm_tokenizer}") / "model",
                             tokenizer=vllm_tokenizer, chat_template=TEMPLATE)
    return vllm_factory(model_dir=model, max_model_len=512, kv_cache_memory_bytes=2 * 1024**2), model


@pytest.fixture(scope="module")
def in_process(engine) -> LocalTokenizerCounter:
    """The gateway's in-process counter on the engine's model, loaded once per tokenizer as a
    gateway loads it once for all its requests."""
    return LocalTokenizerCounter.load(str(engine[1]))


def _post(url: str, path: str, body: dict) -> dict:
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        return json.loads(resp.read())


MESSAGES = [{"role": "system", "content": "the model"}, {"role": "user", "content": "hello world cache"}]
TOOLS = [{"type": "function", "function": {"name": "route", "parameters": {}}}]
CHATS = [
    {},
    {"add_generation_prompt": False},
    {"chat_template_kwargs": {"add_generation_prompt": False}},  # the request field wins
    {"chat_template_kwargs": {"think": True}},
    {"chat_template_kwargs": {"bos_token": ""}},
    {"documents": [{"text": "the cache block"}, {"text": "a token"}]},
    {"reasoning_effort": "low"},
    {"reasoning_effort": "low", "chat_template_kwargs": {"reasoning_effort": "high"}},
    {"tools": TOOLS, "tool_choice": "none"},
    {"continue_final_message": True, "add_generation_prompt": False},
]


def _count(api: Api, body: dict, *, url: str, local: LocalTokenizerCounter | None = None) -> int:
    """The gateway's count of `body`: the local tokenizer (asking the engine what it cannot
    count itself) or, without one, the engine's /tokenize; every connection closed after."""
    async def run() -> int:
        client = UpstreamClient(url)
        try:
            engine = UpstreamTokenizeCounter(client)
            counter = local.with_upstream(engine) if local is not None else engine
            counted = await counter.count(read_request(api, body).prompts, body.get("model"))
            return sum(counted.tokens)
        finally:
            await client.close()

    return asyncio.run(run())


@pytest.mark.parametrize("extra", CHATS, ids=lambda e: json.dumps(e)[:60])
def test_chat_counts_equal_the_engines(engine, in_process, extra):
    server, _ = engine
    body = {"model": server.model, "messages": MESSAGES, "max_tokens": 1, **extra}
    truth = _post(server.url, "/v1/chat/completions", body)["usage"]["prompt_tokens"]
    assert _count(Api.CHAT, body, url=server.url, local=in_process) == truth
    assert _count(Api.CHAT, body, url=server.url) == truth


@pytest.mark.parametrize("prompt", ["hello world the", ["hello world", "the a of model"], [5, 6, 7, 8]])
def test_completion_counts_equal_the_engines(engine, in_process, prompt):
    server, _ = engine
    body = {"model": server.model, "prompt": prompt, "max_tokens": 1}
    truth = _post(server.url, "/v1/completions", body)["usage"]["prompt_tokens"]
    assert _count(Api.COMPLETIONS, body, url=server.url, local=in_process) == truth
    assert _count(Api.COMPLETIONS, body, url=server.url) == truth


@pytest.mark.parametrize("body", [
    {"input": "hello world", "instructions": "the model"},
    {"input": [{"role": "user", "content": [{"type": "input_text", "text": "hello world"}]}]},
    {"input": [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "world"},
               {"role": "user", "content": "the cache"}]},
])
def test_responses_counts_equal_the_engines(engine, in_process, body):
    server, _ = engine
    body = {"model": server.model, "max_output_tokens": 1, **body}
    truth = _post(server.url, "/v1/responses", body)["usage"]["input_tokens"]
    assert _count(Api.RESPONSES, body, url=server.url, local=in_process) == truth
    assert _count(Api.RESPONSES, body, url=server.url) == truth


def test_anthropic_counts_equal_the_engines(engine, in_process):
    server, _ = engine
    body = {"model": server.model, "max_tokens": 1, "system": "the model",
            "messages": [{"role": "user", "content": "hello world"}]}
    truth = _post(server.url, "/v1/messages", body)["usage"]["input_tokens"]
    assert _count(Api.MESSAGES, body, url=server.url, local=in_process) == truth


def test_the_gateway_reserves_what_the_engine_uses(engine, tmp_path):
    """The Python gateway in front of the live engine: its reservation is the engine's own
    prompt count plus the cap, in blocks, and the cap reaches the engine."""
    import yaml
    from enforcers import PyGateway

    server, model = engine
    config = {"version": 1, "upstream": server.url, "block_size": server.block_size,
              "block_budget": server.num_blocks - 1, "max_model_len": server.max_model_len,
              "listen": {"port": 0}, "prompt_tokens": {"method": "tokenizer", "tokenizer": str(model)},
              "admin": {"refusal_detail": "ledger"},
              "routes": [{"name": "all", "max_new_tokens": 8}]}
    gateway = PyGateway(yaml.safe_dump(config)).start()
    try:
        for path, body, usage in [
            ("/v1/chat/completions", {"model": server.model, "messages": MESSAGES,
                                      "documents": [{"text": "the cache"}], "max_tokens": 500}, "prompt_tokens"),
            ("/v1/completions", {"model": server.model, "prompt": "hello world", "messages": [],
                                 "max_tokens": 500}, "prompt_tokens"),
            ("/v1/responses", {"model": server.model, "input": "hello world", "instructions": "the model",
                               "messages": []}, "input_tokens"),
        ]:
            status, headers, raw = gateway.request(path, body, timeout=120)
            assert status == 200, raw
            answer = json.loads(raw)
            prompt = answer["usage"][usage]
            assert int(headers["X-Kvtune-Max-Tokens"]) == 8
            assert int(headers["X-Kvtune-Reserved-Blocks"]) == -(-(prompt + 8) // server.block_size)
            output = answer["usage"].get("completion_tokens", answer["usage"].get("output_tokens"))
            assert output <= 8
    finally:
        gateway.stop()
