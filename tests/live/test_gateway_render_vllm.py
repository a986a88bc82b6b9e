"""The gateway counts what vLLM renders, not what the client sent: vLLM 0.32 renames an
assistant's `reasoning_content` to `reasoning` (and gives the template both), parses each tool
call's `arguments` string into an object, joins a tool message's text parts, drops empty
tool_calls and every key it does not know, turns developer messages into one leading system
message for a template that never names that role, and honours `add_special_tokens` on chat. For each
message field vLLM's chat request accepts, the gateway's count (in process, and through the
engine's /tokenize, which does not rename; and nginx's, through /tokenize) must equal the engine's own `usage.prompt_tokens`
for a max_tokens=1 request, with Mistral-7B's real tokenizer and the real chat templates of the
families that render these fields (tests/data/chat_templates, sources in tests/data/SOURCES.md):
vLLM's DeepSeek-R1 tool template, Qwen3's, GLM-4.6's (which vLLM feeds content as a list of text
parts: its "openai" content format) and gpt-oss's harmony template; and a template that renders
reasoning and arguments as Qwen3's does in every turn (Qwen3's own drops them before the last
user turn). Where vLLM refuses a conversation (a template's raise_exception) there is no count
to match: it answers 400 and the reservation goes back."""

from __future__ import annotations

import asyncio
import json
import os
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtune.domain.route import Api
from kvtune.gateway.apis import read_request
from kvtune.gateway.counting import LocalTokenizerCounter, PromptRejectedError, UpstreamTokenizeCounter
from kvtune.gateway.upstream import UpstreamClient
from kvtune.policy.recommendation import read_recommendation

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

DATA = Path(__file__).parents[1] / "data" / "chat_templates"
# Qwen3-8B's assistant turn (HF Qwen/Qwen3-8B tokenizer_config.json) reads `reasoning_content`
# when it is a string and renders `arguments` as given when text, else through tojson; this
# template keeps exactly those two rules around a plain turn layout.
QWEN3_STYLE = (
    "{% for message in messages %}{{ '<|im_start|>' + message.role + '\\n' }}"
    "{% if message.role == 'assistant' and message.reasoning_content is string %}"
    "{{ '<think>\\n' + message.reasoning_content + '\\n</think>\\n\\n' }}{% endif %}"
    "{% if message.content is string %}{{ message.content }}{% endif %}"
    "{% if message.tool_calls %}{% for call in message.tool_calls %}"
    "{{ '\\n<tool_call>\\n{\"name\": \"' + call.function.name + '\", \"arguments\": ' }}"
    "{% if call.function.arguments is string %}{{ call.function.arguments }}"
    "{% else %}{{ call.function.arguments | tojson }}{% endif %}{{ '}\\n</tool_call>' }}"
    "{% endfor %}{% endif %}"
    "{% if message.name is defined %}{{ ' (' + message.name + ')' }}{% endif %}"
    "{% if message.thinking is defined %}{{ message.thinking }}{% endif %}"
    "{{ '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
TEMPLATES = {"qwen3-style": QWEN3_STYLE,
             **{name: (DATA / f"{name}.jinja").read_text("utf-8")
                for name in ("deepseek-r1-tools", "qwen3-4b-thinking-2507", "glm-4.6", "gpt-oss-20b")}}

THOUGHT = " ".join(["the user wants the weather in Paris so I call the tool with the city"] * 12)
ARGS = json.dumps({"city": "Paris", "units": "metric", "days": [1, 2, 3], "detail": {"hourly": True}},
                  separators=(",", ":"))
CALL = {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": ARGS}}
USER = {"role": "user", "content": "What is the weather in Paris?"}
# Each a conversation ending in a user turn; the name says which field vLLM reshapes.
CONVERSATIONS = {
    "plain": [USER],
    "reasoning_content": [USER, {"role": "assistant", "content": "It is sunny.", "reasoning_content": THOUGHT},
                          {"role": "user", "content": "And tomorrow?"}],
    "reasoning": [USER, {"role": "assistant", "content": "It is sunny.", "reasoning": THOUGHT},
                  {"role": "user", "content": "And tomorrow?"}],
    "both, reasoning wins": [USER, {"role": "assistant", "content": "It is sunny.", "reasoning": "short",
                                    "reasoning_content": THOUGHT}, {"role": "user", "content": "And tomorrow?"}],
    "arguments string": [USER, {"role": "assistant", "content": "", "tool_calls": [CALL, CALL]},
                         {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 degrees"},
                         {"role": "user", "content": "Thanks, and Rome?"}],
    "arguments malformed": [USER, {"role": "assistant", "content": "", "tool_calls": [
                                {**CALL, "function": {"name": "weather", "arguments": "{\"city\": Par"}}]},
                            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}, USER],
    "arguments empty": [USER, {"role": "assistant", "content": "", "tool_calls": [
                            {**CALL, "function": {"name": "weather", "arguments": ""}}]},
                        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}, USER],
    "empty tool_calls": [USER, {"role": "assistant", "content": "It is sunny.", "tool_calls": []}, USER],
    "tool text parts": [USER, {"role": "assistant", "content": "", "tool_calls": [CALL]},
                        {"role": "tool", "tool_call_id": "call_1",
                         "content": [{"type": "text", "text": "sunny"}, {"type": "text", "text": "21 degrees"}]},
                        USER],
    "name": [{"role": "user", "content": "What is the weather in Paris?", "name": "alice"}],
    "developer": [{"role": "developer", "content": "Answer briefly, in one sentence."}, USER],
    "developer after user": [{"role": "system", "content": "You are terse."}, USER,
                             {"role": "developer", "content": "Answer in French from now on."},
                             {"role": "user", "content": "And Rome?"}],
    "unknown key dropped": [USER, {"role": "assistant", "content": "It is sunny.", "thinking": THOUGHT}, USER],
    # an agent's step after the last user turn, where the real templates render the reasoning
    "tool step, reasoning_content": [USER, {"role": "assistant", "content": "", "reasoning_content": THOUGHT,
                                            "tool_calls": [CALL]},
                                     {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 degrees"}],
    "tool step, reasoning": [USER, {"role": "assistant", "content": None, "reasoning": THOUGHT, "tool_calls": [CALL]},
                             {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 degrees"}],
    "tool step, content null": [USER, {"role": "assistant", "content": None, "tool_calls": [CALL, CALL]},
                                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
                                {"role": "tool", "tool_call_id": "call_1", "content": None}],
    "tool step, content absent": [USER, {"role": "assistant", "tool_calls": [CALL]},
                                  {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}],
    "assistant content null": [USER, {"role": "assistant", "content": None}, USER],
    "text parts": [{"role": "system", "content": [{"type": "text", "text": "You are terse."}]},
                   {"role": "user", "content": [{"type": "text", "text": "What is the weather"},
                                                {"type": "text", "text": "in Paris?"}]}],
    "part kinds": [{"role": "system", "content": [{"type": "text", "text": "x-anthropic-billing-header: cch=1\nBe terse."}]},
                   {"role": "user", "content": [{"type": "text", "text": "What"}, {"type": "input_text", "text": "is it"},
                                                {"type": "text", "text": "like", "cache_control": {"type": "ephemeral"}}]},
                   {"role": "assistant", "content": [{"type": "refusal", "refusal": "I cannot say."},
                                                     {"type": "thinking", "thinking": "hmm"}]}, USER],
    "assistant text parts": [USER, {"role": "assistant", "content": [{"type": "text", "text": "It is sunny."}],
                                    "reasoning_content": THOUGHT, "tool_calls": [CALL]},
                             {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}],
}
REQUESTS = [(name, {}) for name in CONVERSATIONS] + [
    ("plain", {"add_special_tokens": True}),
    ("reasoning_content", {"add_special_tokens": True}),
]


@pytest.fixture(scope="module", params=sorted(TEMPLATES))
def engine(request, tmp_path_factory, vllm_factory):
    """vLLM on the tiny model with Mistral-7B's tokenizer, serving one of TEMPLATES (written into
    tokenizer_config.json, which the in-process counter reads, and passed as --chat-template)."""
    from vllm_server import write_tiny_model

    model = write_tiny_model(tmp_path_factory.mktemp(f"render-{request.param}") / "model", tokenizer="mistral-v1",
                             chat_template=TEMPLATES[request.param])
    template = model / "chat_template.jinja"
    template.write_text(TEMPLATES[request.param], "utf-8")
    server = vllm_factory(model_dir=model, max_model_len=2048, kv_cache_memory_bytes=4 * 1024**2,
                          extra_args=("--chat-template", str(template)))
    return server, model


@pytest.fixture(scope="module")
def in_process(engine) -> LocalTokenizerCounter:
    """The gateway's in-process counter on the engine's model and template, loaded once per
    template as a gateway loads it once for all its requests (a load of Mistral-7B's tokenizer
    costs ~0.3 s of CPU, which 120 tests paid each)."""
    return LocalTokenizerCounter.load(str(engine[1]))


def _usage(url: str, body: dict) -> int:
    req = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.loads(resp.read())["usage"]["prompt_tokens"]


def _count(body: dict, url: str, local: LocalTokenizerCounter | None) -> int:
    async def run() -> int:
        client = UpstreamClient(url)
        try:
            engine = UpstreamTokenizeCounter(client)
            counter = local.with_upstream(engine) if local is not None else engine
            counted = await counter.count(read_request(Api.CHAT, body).prompts, body.get("model"))
            return sum(counted.tokens)
        finally:
            await client.close()

    return asyncio.run(run())


def _usage_or_refusal(url: str, body: dict) -> int | None:
    """vLLM's usage.prompt_tokens, or None when it refuses the conversation (400)."""
    try:
        return _usage(url, body)
    except urllib.error.HTTPError as exc:
        if exc.code != 400:
            raise
        return None


def _count_or_refusal(body: dict, url: str, local: LocalTokenizerCounter | None) -> int | str:
    try:
        return _count(body, url, local)
    except PromptRejectedError:
        return "refused"


@pytest.mark.parametrize("name,extra", REQUESTS, ids=[f"{n}{'+special' if e else ''}" for n, e in REQUESTS])
def test_the_count_is_what_vllm_renders(engine, in_process, name, extra):
    server, _ = engine
    body = {"model": server.model, "messages": CONVERSATIONS[name], "max_tokens": 1, **extra}
    truth = _usage_or_refusal(server.url, json.loads(json.dumps(body)))
    counts = {"tokenizer": _count_or_refusal(json.loads(json.dumps(body)), server.url, in_process),
              "upstream-tokenize": _count_or_refusal(json.loads(json.dumps(body)), server.url, None)}
    if truth is None:  # the engine refuses it (a template's raise_exception, a null tool content):
        return  # whatever is counted, the engine answers 400 and the reservation goes back
    assert counts == {"tokenizer": truth, "upstream-tokenize": truth}, f"{counts} against vLLM's {truth}"


@pytest.fixture(scope="module")
def nginx(engine, tmp_path_factory):
    """nginx.conf in front of the engine, counting through its /tokenize, with blocks of one token
    so the reservation it reports is the prompt count plus the cap of 1."""
    from enforcers import start_enforcer
    from recs import make_rec_dict

    from kvtune.gateway.config import AdminAccess, RefusalDetail

    server, _ = engine
    doc = make_rec_dict(budget=100_000, num_blocks=100_001, block_size=1, routes=[("/v1/chat/completions", 1, 0.0)])
    doc["upstream"] = server.url
    doc["settings"]["max_model_len"]["value"] = server.max_model_len
    # the reservation is read from X-Kvtune-Reserved-Blocks, which only admin.refusal_detail: ledger
    # shows (to a loopback client, as the ledger)
    gateway = start_enforcer("nginx", read_recommendation(doc, path="render test"), tmp_path_factory.mktemp("nginx"),
                             admin=AdminAccess(refusal_detail=RefusalDetail.LEDGER))
    try:
        yield server, gateway
    finally:
        gateway.stop()


@pytest.mark.parametrize("name,extra", REQUESTS, ids=[f"{n}{'+special' if e else ''}" for n, e in REQUESTS])
def test_nginx_counts_what_vllm_renders(nginx, name, extra):
    server, gateway = nginx
    body = {"model": server.model, "messages": CONVERSATIONS[name], "max_tokens": 1, **extra}
    truth = _usage_or_refusal(server.url, body)
    status, headers, data = gateway.request("/v1/chat/completions", body, timeout=120)
    if truth is None:  # the engine's /tokenize refuses it as its chat does: no reservation made
        assert status == 400, data
        return
    assert status == 200, data
    reserved = int(headers["X-Kvtune-Reserved-Blocks"])
    assert reserved == truth + 1, f"nginx reserved {reserved} one-token blocks for vLLM's {truth} + a cap of 1"


def _preemptions(url: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=30) as resp:
        text = resp.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:num_preemptions_total"))


@pytest.mark.parametrize("engine", ["qwen3-style"], indirect=True)  # the template that renders reasoning
def test_sixteen_reasoning_chats_under_guaranteed_never_preempt(engine):
    """The issue's load: 16 concurrent chats whose history carries a long reasoning_content,
    through the Python gateway counting with the engine's /tokenize under `guaranteed`. Counted
    without the reasoning, each was charged a fraction of its blocks and vLLM preempted; counted
    as rendered, the gateway admits what fits and the engine never preempts."""
    import concurrent.futures

    import yaml
    from enforcers import PyGateway

    server, _ = engine
    cap = 1024  # outputs that grow after admission, so an engine holding too many must preempt
    body = {"model": server.model, "max_tokens": cap, "messages": [
        USER, {"role": "assistant", "content": "It is sunny.", "reasoning_content": THOUGHT},
        {"role": "user", "content": "And tomorrow?"}]}
    prompt = _usage(server.url, {**body, "max_tokens": 1})
    per_request = -(-(prompt + cap) // server.block_size)
    assert 16 * per_request > server.num_blocks  # the load cannot all run at once
    config = {"version": 1, "upstream": server.url, "block_size": server.block_size,
              "block_budget": server.num_blocks - 1, "max_model_len": server.max_model_len,
              "listen": {"port": 0}, "prompt_tokens": {"method": "upstream-tokenize"},
              "admission": {"policy": "guaranteed"}, "routes": [{"name": "all", "max_new_tokens": cap}],
              "admin": {"refusal_detail": "ledger"}}  # X-Kvtune-Reserved-Blocks on each admitted answer
    gateway = PyGateway(yaml.safe_dump(config)).start()
    before = _preemptions(server.url)
    try:
        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            answers = list(pool.map(lambda _: gateway.request("/v1/chat/completions", body, timeout=600), range(16)))
    finally:
        gateway.stop()
    admitted = [int(h["X-Kvtune-Reserved-Blocks"]) for status, h, _ in answers if status == 200]
    preempted = _preemptions(server.url) - before
    figures = f"{preempted:g} preemptions; {len(admitted)} of 16 admitted, reserving {admitted} of {per_request} blocks"
    assert preempted == 0, figures
    assert admitted and all(n >= per_request for n in admitted), figures
    assert {status for status, _, _ in answers} <= {200, 429}, figures


# --- the same differential, over conversations hypothesis writes -------------------------------

_texts = st.sampled_from(["", "It is sunny.", "w " * 40, "Paris\nRome", "<think>inner</think>after", THOUGHT])
_arguments = st.sampled_from([ARGS, '{"city": "Paris"}', '{"a":{"b":{"c":[{"d":1,"e":"x y"}]}}}', '{"city": Par',
                              "", "[]", "42", '{"days": [1, 2, 3], "units": "metric"}'])
_calls = st.lists(st.builds(lambda name, args: {"id": "call_1", "type": "function",
                                                "function": {"name": name, "arguments": args}},
                            st.sampled_from(["weather", "search_web"]), _arguments), min_size=1, max_size=3)
_contents = st.one_of(st.none(), _texts, st.lists(st.builds(lambda t: {"type": "text", "text": t}, _texts),
                                                  min_size=1, max_size=2))


@st.composite
def _conversations(draw) -> list[dict]:
    """A user turn, then turns whose every field vLLM's chat request accepts for its role."""
    out: list[dict] = [{"role": "user", "content": draw(_texts) or "Hi"}]
    for _ in range(draw(st.integers(0, 4))):
        role = draw(st.sampled_from(["user", "assistant", "assistant", "tool", "system", "developer"]))
        message: dict = {"role": role, "content": draw(_contents)}
        if role == "assistant":
            for key in draw(st.sets(st.sampled_from(["reasoning", "reasoning_content", "tool_calls", "name"]))):
                message[key] = draw(_calls) if key == "tool_calls" else draw(_texts)
        elif role == "tool":
            message["tool_call_id"] = "call_1"
        elif role in ("user", "system") and draw(st.booleans()):
            message["name"] = "alice"
        if role != "assistant" and message["content"] is None:
            message["content"] = draw(_texts)
        out.append(message)
    return out


_requests = st.fixed_dictionaries({"messages": _conversations()},
                                  optional={"add_special_tokens": st.booleans(),
                                            "add_generation_prompt": st.booleans()})


def test_hypothesis_conversations_count_what_vllm_renders(engine, in_process):
    """For every conversation vLLM accepts, both counters equal its usage.prompt_tokens: never
    fewer (an engine over its budget), never more (a refusal the engine would not make). 30
    conversations per template (KVTUNE_FUZZ_EXAMPLES raises it), about 10 s each on two cores."""
    server, _ = engine
    local = in_process
    accepted: list[int] = []

    @settings(max_examples=int(os.environ.get("KVTUNE_FUZZ_EXAMPLES", "30")), deadline=None,
              derandomize="KVTUNE_FUZZ_RANDOM" not in os.environ,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(request=_requests)
    def one(request):
        body = {"model": server.model, "max_tokens": 1, **request}
        truth = _usage_or_refusal(server.url, json.loads(json.dumps(body)))
        if truth is None:  # a conversation the template refuses: no count to match
            return
        counts = {"tokenizer": _count_or_refusal(json.loads(json.dumps(body)), server.url, local),
                  "upstream-tokenize": _count_or_refusal(json.loads(json.dumps(body)), server.url, None)}
        assert counts == {"tokenizer": truth, "upstream-tokenize": truth}, f"{counts} against vLLM's {truth}"
        accepted.append(truth)

    one()
    assert len(accepted) >= 10, f"vLLM accepted only {len(accepted)} conversations: the property says little"
