"""kvtune's admission inside a real LiteLLM proxy (kvtune.integrations.litellm), in front of the
fake vLLM (tests/support/fake_vllm.py), with kvtune's own gateway beside it on the same gateway.yaml.

What is held: what LiteLLM forwards is what was counted and capped (one case per way LiteLLM's
own parameter handling could carry a larger cap or more sequences past the hook); the hook refuses
what kvtune's gateway refuses, with the same status, reason and Retry-After (a shared parity
table); under concurrent load with streams cut by the engine and clients that leave, the ledger
never passes the budget (the hook's own peak, and the fake engine's independent tally of what the
forwarded bodies can grow to) and drains to 0; hostile bodies (test_gateway_fuzz's generators)
leave nothing held; with several engines a call goes where its blocks are held; two proxies share
one Redis ledger; gateway.yaml's queue holds a call inside the hook. A LiteLLM proxy takes ~20-30 s
to start on this 2-core host, so the module shares one for most tests and starts four more only
where gateway.yaml must differ (several engines, queue, two on Redis): ~3.5 min in all."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import random
import re
import time
from collections import Counter

import aiohttp
import pytest
import yaml
from enforcers import PyGateway, blocks, chat, words
from fake_vllm import FakeVllm
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from litellm_proxy import LitellmProxy, litellm_config

pytestmark = pytest.mark.slow
if importlib.util.find_spec("litellm") is None:  # not imported here: importing it outside the proxy fetches a cost map
    pytest.fail("the litellm extra is required for this test: pip install 'kvtune[litellm]'")

BUDGET, BLOCK, CONTEXT, CHAT_CAP, DEFAULT_CAP, TEAM_CAP = 100, 16, 2048, 64, 32, 24
EXAMPLES = int(os.environ.get("KVTUNE_FUZZ_EXAMPLES", "1500")) // 10


def gateway_doc(upstream: str) -> dict:
    return {
        "version": 1, "upstream": upstream, "block_size": BLOCK, "block_budget": BUDGET, "max_model_len": CONTEXT,
        "routes": [{"name": "team", "match": {"path": "/v1/chat/completions", "header": "X-Team", "value": "a"},
                    "max_new_tokens": TEAM_CAP},
                   {"name": "chat", "match": {"path": "/v1/chat/completions"}, "max_new_tokens": CHAT_CAP},
                   {"name": "default", "max_new_tokens": DEFAULT_CAP}],
    }


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """The fake engine, the LiteLLM proxy with the hook (models "m", and "m-default" whose
    deployment sets max_tokens and extra_body of its own), and kvtune's gateway, one gateway.yaml."""
    with FakeVllm(model="m", max_model_len=CONTEXT, itl_s=0.002) as fake:
        doc = gateway_doc(fake.url)
        config = litellm_config(fake.url, "m")
        config["model_list"].append({"model_name": "m-default", "litellm_params": {
            "model": "hosted_vllm/m", "api_base": f"{fake.url}/v1", "max_tokens": 1500,
            "extra_body": {"max_tokens": 1500, "n": 3}}})
        gateway = PyGateway(yaml.safe_dump({**doc, "listen": {"host": "127.0.0.1", "port": 0}})).start()
        try:
            with LitellmProxy(tmp_path_factory.mktemp("litellm"), doc, fake.url, config=config) as proxy:
                yield proxy, gateway, fake
        finally:
            gateway.stop()


def _last_forwarded(fake: FakeVllm) -> dict:
    return fake.engine_calls[-1].parsed


# ---------------------------------------------------------------- what LiteLLM forwards

# (why, body, the cap every forwarded cap field must carry, the sequences forwarded)
BYPASSES = [
    ("no cap: the route's written", chat(3), CHAT_CAP, 1),
    ("a cap above the route's", chat(3, max_tokens=5000), CHAT_CAP, 1),
    ("max_completion_tokens alone, above the cap", chat(3, max_completion_tokens=900), CHAT_CAP, 1),
    ("the client's smaller cap kept in both fields", chat(3, max_tokens=9, max_completion_tokens=700), 9, 1),
    ("extra_body.max_tokens beside a small max_tokens (LiteLLM spreads extra_body over the top level: "
     "1000 is what the engine would read)", chat(3, max_tokens=5, extra_body={"max_tokens": 1000}), CHAT_CAP, 1),
    ("extra_body.max_completion_tokens", chat(3, extra_body={"max_completion_tokens": 1000}), CHAT_CAP, 1),
    ("min_tokens above the cap, at the top level (forwarded as an unknown member)",
     chat(3, min_tokens=500, ignore_eos=True), CHAT_CAP, 1),
    ("min_tokens above the cap in extra_body", chat(3, extra_body={"min_tokens": 500}), CHAT_CAP, 1),
    ("n in extra_body counts its sequences", chat(3, extra_body={"n": 2}), CHAT_CAP, 2),
    ("best_of at the top level counts its sequences", chat(3, best_of=3), CHAT_CAP, 3),
    ("the team route by its header", chat(3, max_tokens=500), TEAM_CAP, 1),
]


@pytest.mark.parametrize("why, body, cap, sequences", BYPASSES, ids=[b[0][:40] for b in BYPASSES])
def test_what_litellm_forwards_is_what_was_capped(stack, why, body, cap, sequences):
    proxy, _, fake = stack
    headers = {"X-Team": "a"} if "team" in why else None
    status, headers_back, answer = proxy.request("/v1/chat/completions", body, headers=headers)
    assert status == 200, answer[:300]
    assert headers_back.get("x-kvtune-max-tokens") == str(cap)
    sent = _last_forwarded(fake)
    assert "extra_body" not in sent
    caps = {k: sent[k] for k in ("max_tokens", "max_completion_tokens") if k in sent}
    assert caps and set(caps.values()) == {cap}, sent
    assert sent.get("min_tokens", 0) <= cap
    assert max(sent.get("n", 1), sent.get("best_of", 1)) == sequences
    assert proxy.wait_drained()["reserved"] == 0


def test_a_deployment_default_cannot_raise_the_cap_or_the_sequences(stack):
    """m-default's litellm_params set max_tokens 1500 and extra_body {max_tokens 1500, n 3}: the
    request is admitted and forwarded as the client sent it, capped (the deployment hook)."""
    proxy, _, fake = stack
    status, _, answer = proxy.request("/v1/chat/completions", {**chat(3), "model": "m-default"})
    assert status == 200, answer[:300]
    sent = _last_forwarded(fake)
    assert sent.get("max_tokens") == CHAT_CAP and sent.get("n", 1) == 1, sent


def test_thinking_is_counted_as_the_reasoning_effort_litellm_forwards(stack):
    proxy, _, fake = stack
    status, _, answer = proxy.request("/v1/chat/completions",
                                      chat(3, thinking={"type": "enabled", "budget_tokens": 100}))
    assert status == 200, answer[:300]
    sent = _last_forwarded(fake)
    assert "thinking" not in sent and sent["reasoning_effort"] == "minimal"
    counted = fake.tokenize_calls[-1]
    assert counted["chat_template_kwargs"]["reasoning_effort"] == "minimal", counted


@pytest.mark.parametrize("path, body", [
    ("/v1/responses", {"model": "m", "input": words(3), "max_output_tokens": 5000}),
    ("/v1/messages", {"model": "m", "max_tokens": 5000, "messages": [{"role": "user", "content": words(3)}]}),
])
def test_call_types_the_hook_cannot_count_are_refused_not_passed(stack, path, body):
    """LiteLLM serves more APIs than kvtune reads through it (responses, Anthropic messages, …):
    each reaches the engine rewritten as LiteLLM sees fit, so the hook refuses it (501) rather than
    let it through uncounted."""
    proxy, _, fake = stack
    before = len(fake.engine_calls)
    status, headers, answer = proxy.request(path, body)
    assert (status, headers.get("x-kvtune-refused")) == (501, "uncountable_endpoint"), answer[:300]
    assert len(fake.engine_calls) == before


# ---------------------------------------------------------------- parity with kvtune's gateway

# (case, path, body, status) each answered alike by the hook and kvtune's gateway: the status, the
# refusal's reason, and for an admitted call the cap it was admitted with (X-Kvtune-Max-Tokens)
PARITY = [
    ("admitted", "/v1/chat/completions", chat(10), 200),
    ("admitted with the client's smaller cap", "/v1/chat/completions", chat(10, max_completion_tokens=7), 200),
    ("admitted on the team route", "/v1/chat/completions", {**chat(10), "x_team": "a"}, 200),
    ("completions past the context", "/v1/completions", {"model": "m", "prompt": words(2100)}, 400),
    ("embeddings past the context", "/v1/embeddings", {"model": "m", "input": words(2100)}, 400),
    ("admitted completions", "/v1/completions", {"model": "m", "prompt": words(5), "max_tokens": 400}, 200),
    ("prompt past the context", "/v1/chat/completions", chat(2100), 400),
    ("never fits: n x blocks over the budget", "/v1/chat/completions", chat(10, n=30), 413),
    ("never fits through extra_body.n", "/v1/chat/completions", chat(10, extra_body={"n": 30}), 413),
    ("negative max_tokens", "/v1/chat/completions", chat(3, max_tokens=-1), 400),
    ("n of 0", "/v1/chat/completions", chat(3, n=0), 400),
    ("max_tokens not a number", "/v1/chat/completions", chat(3, max_tokens="x"), 400),
    ("messages not a list", "/v1/chat/completions", {"model": "m", "messages": "w w"}, 400),
    ("embeddings reserve their input", "/v1/embeddings", {"model": "m", "input": words(40)}, 200),
]


def _reason(status: int, headers: dict, answer: bytes) -> str | None:
    """The refusal's reason: the gateway's error code, the hook's X-Kvtune-Refused header."""
    if status < 400:
        return None
    if "x-kvtune-refused" in headers:
        return headers["x-kvtune-refused"]
    return json.loads(answer)["error"]["code"]


@pytest.mark.parametrize("case, path, body, status", PARITY, ids=[p[0] for p in PARITY])
def test_the_hook_refuses_what_kvtunes_gateway_refuses(stack, case, path, body, status):
    proxy, gateway, _ = stack
    body = dict(body)
    headers = {"X-Team": body.pop("x_team")} if "x_team" in body else None
    via_gateway = body if "extra_body" not in body else {**{k: v for k, v in body.items() if k != "extra_body"},
                                                         **body["extra_body"]}
    g_status, g_headers, g_answer = gateway.request(path, via_gateway, headers=headers)
    l_status, l_headers, l_answer = proxy.request(path, body, headers=headers)
    g_headers = {k.lower(): v for k, v in g_headers.items()}
    assert (g_status, l_status) == (status, status), (g_answer[:300], l_answer[:300])
    assert _reason(l_status, l_headers, l_answer) == _reason(g_status, g_headers, g_answer)
    assert l_headers.get("x-kvtune-max-tokens") == g_headers.get("x-kvtune-max-tokens")
    assert proxy.wait_drained()["reserved"] == 0


def test_a_full_budget_is_a_429_with_retry_after_through_litellm(stack):
    """A held stream keeps 79 blocks; a chat and a completions call needing 31 each: 429 with
    Retry-After and the gateway's message at the client on both LiteLLM endpoints (its
    /v1/completions drops the headers of any exception but its own ProxyException), as kvtune's
    gateway answers them; the stream's end gives the blocks back."""
    proxy, gateway, fake = stack
    hold = chat(1200, max_tokens=64, stream=True, x_mode="hold_stream")  # ceil(1264 / 16) = 79 blocks
    assert blocks(1200, 64) == 79

    async def run(base: str, headers: dict, ledger) -> tuple[int, dict, int]:
        async with aiohttp.ClientSession(headers=headers) as session:
            async with session.post(f"{base}/v1/chat/completions", json=hold) as held:
                await held.content.readline()
                while ledger()["reserved"] != 79:
                    await asyncio.sleep(0.02)
                answers = []
                for path, body in (("/v1/chat/completions", chat(420, max_tokens=64)),
                                   ("/v1/completions", {"model": "m", "prompt": words(420), "max_tokens": 64})):
                    async with session.post(f"{base}{path}", json=body) as refused:  # 31 blocks each
                        answers.append((refused.status, {k.lower(): v for k, v in refused.headers.items()},
                                        await refused.json(content_type=None)))
                fake.release()
                await held.read()
            fake.hold()
            return answers

    through_litellm = asyncio.run(run(proxy.url, proxy.headers, proxy.ledger))
    through_gateway = asyncio.run(run(f"http://127.0.0.1:{gateway.port}", {}, gateway.ledger))
    for (l_status, l_headers, l_body), (g_status, g_headers, g_body) in zip(through_litellm, through_gateway,
                                                                            strict=True):
        assert (l_status, g_status) == (429, 429)
        assert l_headers["x-kvtune-refused"] == g_body["error"]["code"] == "kv_budget_exhausted"
        assert int(l_headers["retry-after"]) >= 1 and int(g_headers["retry-after"]) >= 1
        assert l_body["error"]["message"] == g_body["error"]["message"] and l_body["error"]["type"] == "rate_limit_error"
    assert proxy.wait_drained()["reserved"] == 0


def test_a_call_id_the_client_repeats_neither_replaces_nor_releases_the_hold(stack):
    """LiteLLM takes litellm_call_id from the client's x-litellm-call-id header. A second call
    under the id of a stream in flight is refused (400), and its failure does not give back the
    stream's blocks: the ledger still holds them until the stream ends."""
    proxy, _, fake = stack
    same = {"x-litellm-call-id": "kvtune-same-id"}
    hold = chat(1200, max_tokens=64, stream=True, x_mode="hold_stream")  # 79 blocks

    async def run() -> tuple[int, str | None, int]:
        async with aiohttp.ClientSession(headers={**proxy.headers, **same}) as session:
            async with session.post(f"{proxy.url}/v1/chat/completions", json=hold) as held:
                await held.content.readline()
                async with session.post(f"{proxy.url}/v1/chat/completions", json=chat(3)) as second:
                    answer = (second.status, second.headers.get("X-Kvtune-Refused"))
                reserved = proxy.ledger()["reserved"]
                fake.release()
                await held.read()
        fake.hold()
        return *answer, reserved

    assert asyncio.run(run()) == (400, "invalid_request", 79)
    assert proxy.wait_drained()["reserved"] == 0


# ---------------------------------------------------------------- the ledger under load

LOAD_REQUESTS, LOAD_CONCURRENCY = 160, 24


async def _one(session: aiohttp.ClientSession, base: str, rng: random.Random, tally: Counter,
               refused: Counter | None = None, retries: int = 0) -> None:
    """One request of a random kind; every answer is counted in `tally` as `kind:status`. Refused
    with 429, it is sent again up to `retries` times after a pause of 50-250 ms, as a client that
    backs off would."""
    kind = rng.choice(["whole", "stream", "stream", "cut", "error_mid_stream", "abort", "abort_whole", "500"])
    body = chat(rng.randint(5, 400), max_tokens=rng.choice([None, 20, 64, 4000]), stream=kind not in
                ("whole", "abort_whole", "500"), x_delay=0.004)
    if body["max_tokens"] is None:
        del body["max_tokens"]
    if kind in ("cut", "error_mid_stream"):
        body["x_mode"] = "die" if kind == "cut" else kind
    elif kind == "500":
        body["x_mode"] = "500"
    pauses = [0.05 + 0.2 * rng.random() for _ in range(retries)]
    try:
        async with asyncio.timeout(30):
            while True:
                async with session.post(f"{base}/v1/chat/completions", json=body) as response:
                    tally[f"{kind}:{response.status}"] += 1
                    if refused is not None and response.status >= 400:
                        refused[f"{response.status} {response.headers.get('X-Kvtune-Refused')}"] += 1
                    if response.status == 429 and pauses:
                        await response.read()
                        await asyncio.sleep(pauses.pop())
                        continue
                    if kind == "abort" and response.status == 200:
                        await response.content.readline()
                        response.close()  # the client leaves mid-stream
                        return
                    if kind == "abort_whole":
                        return  # leaves before reading the answer
                    await response.read()
                    return
    except (aiohttp.ClientError, TimeoutError) as exc:
        tally[f"{kind}:{type(exc).__name__}"] += 1


@pytest.mark.quiet  # its share of 200s is a wall-clock claim (timeouts under a loaded host: 29 of 160 at load ~5)
def test_the_ledger_holds_exactly_under_load_with_aborts_and_cut_streams(stack):
    """160 requests of every kind, 24 at a time, on a 100-block budget: refused ones back off and
    retry (up to 8 times), so the share admitted is the budget's turnover, not how fast a host
    answers 429s (27 of 160 admitted without retries in CI on 13cf8f4, on a host faster than this
    one: its 429s came back sooner, each slot tried more often while the same long requests held
    the budget). The ledger ends at exactly 0 and never passed the budget."""
    proxy, _, fake = stack
    fake.peak_running_blocks = fake.running_blocks
    rng = random.Random(30)
    tally: Counter = Counter()
    peaks: list[int] = []

    async def run() -> None:
        limit = asyncio.Semaphore(LOAD_CONCURRENCY)
        connector = aiohttp.TCPConnector(limit=LOAD_CONCURRENCY * 2)
        async with aiohttp.ClientSession(headers=proxy.headers, connector=connector) as session:
            async def bounded() -> None:
                async with limit:
                    await _one(session, proxy.url, rng, tally, retries=8)

            async def sample() -> None:
                while True:
                    peaks.append(proxy.ledger()["reserved"])
                    await asyncio.sleep(0.1)

            sampler = asyncio.create_task(sample())
            async with asyncio.TaskGroup() as group:
                for _ in range(LOAD_REQUESTS):
                    group.create_task(bounded())
            sampler.cancel()

    asyncio.run(run())
    ledger = proxy.wait_drained(30)
    metrics = proxy.metrics()
    peak = int(float(re.search(r"^kvtune_gateway_reserved_blocks_peak (\S+)$", metrics, re.M).group(1)))
    print(f"\nLiteLLM hook under load: {LOAD_REQUESTS} requests, {sorted(tally.items())}; peak reserved {peak} "
          f"of {BUDGET} (sampled {max(peaks, default=0)}), engine tally peak {fake.peak_running_blocks}; final "
          f"reserved {ledger['reserved']}, inflight {ledger['inflight']}")
    assert ledger["reserved"] == 0 and ledger["inflight"] == 0, ledger
    assert peak <= BUDGET and fake.peak_running_blocks <= BUDGET
    assert sum(n for k, n in tally.items() if k.endswith(":429")) > 0  # the budget was full at times
    assert sum(n for k, n in tally.items() if k.endswith(":200")) > LOAD_REQUESTS // 5


# ---------------------------------------------------------------- hostile bodies

def test_hostile_bodies_leave_nothing_held(stack):
    """test_gateway_fuzz's bodies through LiteLLM: whatever LiteLLM and the hook answer, nothing
    stays held, and the hook never fails with an exception of its own (the proxy logs none)."""
    from test_gateway_fuzz import bodies

    proxy, _, _ = stack
    statuses: Counter = Counter()
    log_from = len(proxy.log_text())

    @settings(max_examples=EXAMPLES, deadline=None, derandomize="KVTUNE_FUZZ_RANDOM" not in os.environ,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(path=st.sampled_from(["/v1/chat/completions", "/v1/completions", "/v1/embeddings"]), body=bodies())
    def one(path, body):
        status, _, _ = proxy.request(path, body)
        statuses[status] += 1

    one()
    ledger = proxy.wait_drained()
    assert ledger["reserved"] == 0 and ledger["inflight"] == 0, (ledger, statuses)
    raised = _raised_in_kvtune(proxy.log_text()[log_from:])
    assert not raised, raised[:3]


def _raised_in_kvtune(log: str) -> list[str]:
    """The exceptions of the log's tracebacks whose innermost frame is kvtune's own code (an
    exception that only passes through the hook's stream wrapper is the engine's or LiteLLM's)."""
    out, last_file = [], None
    for line in log.splitlines():
        if line.startswith('  File "'):
            last_file = line
        elif last_file is not None and line and not line.startswith(" "):
            if "/kvtune/" in last_file:
                out.append(f"{last_file.strip()}: {line}")
            last_file = None
    return out


# ---------------------------------------------------------------- several engines

def test_with_several_engines_each_call_goes_where_its_blocks_are_held(tmp_path):
    """gateway.yaml lists two engines of 50 blocks; LiteLLM's model_list names only the first.
    Two held streams of 30 blocks each: the second is reserved on the second engine (the first
    has 20 left), and the hook sends it there (api_base), not where LiteLLM's deployment points."""
    with FakeVllm(model="m", max_model_len=CONTEXT) as first, FakeVllm(model="m", max_model_len=CONTEXT) as second:
        doc = gateway_doc(first.url)
        del doc["upstream"], doc["block_budget"]
        doc["upstreams"] = [{"url": first.url, "block_budget": 50}, {"url": second.url, "block_budget": 50}]
        held = chat(400, max_tokens=64, stream=True, x_mode="hold_stream")  # ceil(464 / 16) = 29 blocks

        async def run(proxy: LitellmProxy) -> list[dict]:
            async with aiohttp.ClientSession(headers=proxy.headers) as session:
                streams = []
                for _ in range(2):
                    streams.append(await session.post(f"{proxy.url}/v1/chat/completions", json=held))
                    await streams[-1].content.readline()
                ledger = proxy.ledger()
                for fake in (first, second):
                    fake.release()
                for stream in streams:
                    await stream.read()
                    stream.release()
                return ledger["upstreams"]

        with LitellmProxy(tmp_path, doc, first.url) as proxy:
            upstreams = asyncio.run(run(proxy))
            assert [u["reserved"] for u in upstreams] == [29, 29]
            assert len(first.engine_calls) == 1 and len(second.engine_calls) == 1
            assert proxy.wait_drained()["reserved"] == 0


# ---------------------------------------------------------------- routes by the key's team

def test_a_route_on_x_litellm_team_matches_the_keys_team_never_a_client_header(monkeypatch):
    """LiteLLM's own key record (UserAPIKeyAuth) carries the team: a route header named
    x-litellm-team matches its team_alias (else team_id); the same header sent by a client does not."""
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    from litellm.proxy._types import UserAPIKeyAuth

    from kvtune.gateway.config import parse_gateway_config
    from kvtune.integrations.litellm import KvtuneAdmission

    doc = gateway_doc("http://127.0.0.1:9")
    doc["routes"].insert(0, {"name": "rag", "match": {"header": "x-litellm-team", "value": "rag"},
                             "max_new_tokens": 40})
    hook = KvtuneAdmission(parse_gateway_config(doc))

    def route(key: UserAPIKeyAuth, headers: dict) -> str:
        incoming = hook.incoming("/v1/chat/completions", {"proxy_server_request": {"headers": headers}}, key)
        return hook.config.route_for(incoming.path, "m", incoming.route_headers).name

    assert route(UserAPIKeyAuth(team_alias="rag"), {}) == "rag"
    assert route(UserAPIKeyAuth(team_id="rag"), {}) == "rag"
    assert route(UserAPIKeyAuth(team_id="other"), {"x-litellm-team": "rag"}) == "chat"
    assert route(UserAPIKeyAuth(), {"X-LiteLLM-Team": "rag"}) == "chat"
    assert route(UserAPIKeyAuth(), {"X-Team": "a"}) == "team"  # a plain header route, as in the gateway


# ---------------------------------------------------------------- LiteLLM replicas on one Redis ledger

def test_two_litellm_proxies_share_one_budget_through_the_redis_ledger(tmp_path, redis_server):
    """Two LiteLLM proxies, each with the hook on gateway.yaml `ledger: {backend: redis}`, in front
    of one engine: load through both at once never holds more than the budget there (the fake
    engine's own tally of the forwarded bodies), and both drain to 0."""
    with FakeVllm(model="m", max_model_len=CONTEXT, itl_s=0.002) as fake:
        doc = {**gateway_doc(fake.url), "ledger": {"backend": "redis", "url": redis_server.url,
                                                   "key_prefix": "kvtune-litellm-test"}}
        proxies = [LitellmProxy(tmp_path / f"p{i}", doc, fake.url).launch() for i in range(2)]
        try:
            for proxy in proxies:
                proxy.wait_ready()
            tally: Counter = Counter()
            refused: Counter = Counter()
            rng = random.Random(2)

            async def run() -> None:
                limit = asyncio.Semaphore(LOAD_CONCURRENCY)
                async with aiohttp.ClientSession(headers=proxies[0].headers) as session:
                    async def bounded(proxy: LitellmProxy) -> None:
                        async with limit:
                            await _one(session, proxy.url, rng, tally, refused)

                    async with asyncio.TaskGroup() as group:
                        for i in range(LOAD_REQUESTS):
                            group.create_task(bounded(proxies[i % 2]))

            asyncio.run(run())
            ledgers = [proxy.wait_drained(30) for proxy in proxies]
        finally:
            for proxy in proxies:
                proxy.stop()
    print(f"\ntwo LiteLLM proxies on one Redis ledger: {LOAD_REQUESTS} requests, {sorted(tally.items())}; "
          f"refused {sorted(refused.items())}; engine tally peak {fake.peak_running_blocks} of {BUDGET}; final "
          f"{[(x['reserved'], x['inflight']) for x in ledgers]}")
    assert all(x["ledger"]["mode"] == "redis" for x in ledgers), ledgers
    assert all(x["reserved"] == 0 and x["inflight"] == 0 for x in ledgers), ledgers
    assert fake.peak_running_blocks <= BUDGET
    assert sum(n for k, n in tally.items() if k.endswith(":429")) > 0
    # a 503 of the hook's is only a Redis call past op_timeout_s on a loaded host: a refusal, never an admission
    assert {k for k in refused if k.startswith("503")} <= {"503 ledger_unavailable"}, refused


# ---------------------------------------------------------------- the flow-control queue

def test_with_a_queue_a_full_budget_holds_the_call_until_blocks_are_released(tmp_path):
    """gateway.yaml `queue`: a call that finds the budget full waits in kvtune's FIFO inside the
    hook and is admitted when the held stream ends, instead of a 429."""
    with FakeVllm(model="m", max_model_len=CONTEXT) as fake:
        doc = {**gateway_doc(fake.url), "queue": {"max_waiting": 4, "timeout_s": 20}}
        hold = chat(1200, max_tokens=64, stream=True, x_mode="hold_stream")  # 79 blocks

        async def run(proxy: LitellmProxy) -> tuple[int, int]:
            async with aiohttp.ClientSession(headers=proxy.headers) as session:
                async with session.post(f"{proxy.url}/v1/chat/completions", json=hold) as held:
                    await held.content.readline()
                    waiter = asyncio.create_task(session.post(f"{proxy.url}/v1/chat/completions",
                                                              json=chat(420, max_tokens=64)))  # 31 blocks
                    while proxy.ledger()["waiting"] != 1:
                        await asyncio.sleep(0.05)
                    fake.release()
                    await held.read()
                response = await waiter
                status = response.status
                response.release()
                return status, proxy.ledger()["waiting"]

        with LitellmProxy(tmp_path, doc, fake.url) as proxy:
            status, waiting = asyncio.run(run(proxy))
            assert (status, waiting) == (200, 0)
            assert "waiting" in proxy.metrics() and proxy.wait_drained()["reserved"] == 0
            assert re.search(r"^kvtune_gateway_queue_wait_seconds_count 1\.0$", proxy.metrics(), re.M)


# ---------------------------------------------------------------- flow control

def test_flow_control_holds_a_batch_call_and_serves_it_when_blocks_free(tmp_path):
    """gateway.yaml `flow:` (the flow-control queue: bands, fair shares, deadlines) runs inside the
    hook as in the gateway: with the budget held by a stream, a batch-band call (the band header,
    read from the request LiteLLM received) waits and is admitted when the stream ends, and
    /kvtune/ledger reports the queue under `flow`."""
    with FakeVllm(model="m", max_model_len=CONTEXT) as fake:
        doc = {**gateway_doc(fake.url), "flow": {"token_time_s": 0.01, "bands": [
            {"name": "interactive", "deadline_s": 2}, {"name": "batch", "deadline_s": 30}]}}
        hold = chat(1200, max_tokens=64, stream=True, x_mode="hold_stream")  # 79 blocks

        async def run(proxy: LitellmProxy) -> tuple[int, dict]:
            async with aiohttp.ClientSession(headers=proxy.headers) as session:
                async with session.post(f"{proxy.url}/v1/chat/completions", json=hold) as held:
                    await held.content.readline()
                    waiter = asyncio.create_task(session.post(
                        f"{proxy.url}/v1/chat/completions", json=chat(420, max_tokens=64),
                        headers={"x-kvtune-priority": "batch"}))  # 31 blocks
                    while proxy.ledger()["waiting"] != 1:
                        await asyncio.sleep(0.05)
                    flow = proxy.ledger()["flow"]
                    fake.release()
                    await held.read()
                response = await waiter
                status = response.status
                response.release()
                return status, flow

        with LitellmProxy(tmp_path, doc, fake.url) as proxy:
            status, flow = asyncio.run(run(proxy))
            assert status == 200, flow
            assert flow, flow
            assert proxy.wait_drained()["reserved"] == 0
            assert "kvtune_gateway_flow_" in proxy.metrics()


def test_a_streams_chunks_are_told_to_the_flow_forecast_as_the_gateways_events_are(monkeypatch):
    """The hook's stream iterator tells each chunk to the reservation as the gateway's relay tells
    each event (at least one token a chunk, the first three aside): the flow-control forecast for a
    call that does not fit shortens by token_time_s for each token the stream is known to have
    reached, and the stream's end gives its blocks back once. The hook is driven directly, without a
    proxy: what is tested is what it does with the chunks LiteLLM hands it."""
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    from litellm.proxy._types import UserAPIKeyAuth

    from kvtune.gateway.config import parse_gateway_config
    from kvtune.gateway.flow import ANONYMOUS
    from kvtune.gateway.relay import EVENTS_WITHOUT_TOKENS
    from kvtune.integrations.litellm import KvtuneAdmission

    tau, chunks = 10.0, 13  # a token time long enough that time since admission adds nothing
    with FakeVllm(model="m", max_model_len=CONTEXT) as fake:
        doc = {**gateway_doc(fake.url), "listen": {"host": "127.0.0.1", "port": 0},
               "flow": {"token_time_s": tau, "bands": [{"name": "interactive", "deadline_s": 1000}]}}
        hook = KvtuneAdmission(parse_gateway_config(doc))
        gate = hook.flow_gate
        assert gate is not None

        async def run() -> tuple[list[float], int, int]:
            data = {**chat(1200, max_tokens=CHAT_CAP, stream=True), "litellm_call_id": "c1", "metadata": {},
                    "proxy_server_request": {"headers": {}}}
            await hook.async_pre_call_hook(UserAPIKeyAuth(), None, data, "acompletion")
            assert hook.pool.reserved_blocks == blocks(1200, CHAT_CAP)  # 80 of 100: 50 more do not fit

            def forecast() -> float:
                return gate.forecast_s(50, 0, ANONYMOUS, time.monotonic())

            async def stream():
                for _ in range(chunks):
                    yield {"choices": [{"delta": {"content": "w"}}]}

            seen = [forecast()]
            async for _ in hook.async_post_call_streaming_iterator_hook(UserAPIKeyAuth(), stream(), data):
                seen.append(forecast())
            held, reserved = hook.held, hook.pool.reserved_blocks
            await hook.close()
            return seen, held, reserved

        seen, held, reserved = asyncio.run(run())
    told = [max(0, n - EVENTS_WITHOUT_TOKENS) for n in range(chunks + 1)]  # tokens known once n chunks passed
    assert seen == pytest.approx([(CHAT_CAP - t) * tau for t in told], abs=1e-6), seen
    assert seen[-1] < seen[0]
    assert (held, reserved) == (0, 0)
