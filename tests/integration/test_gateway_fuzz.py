"""Hostile requests against both enforcers (the Python gateway and the rendered nginx.conf), as
hypothesis writes them: any method and path, bodies that are real requests with fields replaced
by other JSON, huge numbers, NaN, deep nesting, lone surrogates, repeated keys, truncated or
random bytes; and the classes issue 26 found: messages carrying reasoning_content/reasoning,
tool calls whose arguments are JSON strings (valid, malformed, nested, not objects), null
content, fields that force the output length (min_tokens, ignore_eos, logit_bias, stop ids),
add_special_tokens, and routes chosen by a request header (X-Team: absent, either team, empty,
both as a list, near misses, too long). Whatever arrives, the answer is never a 500 of the gateway's own, the ledger
drains back to zero, and nginx logs no Lua error. KVTUNE_FUZZ_EXAMPLES raises the count."""

from __future__ import annotations

import json
import os
import time

import pytest
from enforcers import TEAM_A, TEAM_B, TEAM_HEADER, small_fake, start_enforcer, team_rec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtune.gateway.config import AdminAccess, ClientLimits, RefusalDetail

pytestmark = pytest.mark.slow
EXAMPLES = int(os.environ.get("KVTUNE_FUZZ_EXAMPLES", "1500"))

PATHS = ["/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages", "/invocations",
         "/inference/v1/generate", "/v1/chat/completions/batch", "/v1/embeddings", "/v1/rerank", "/score",
         "/v1/summarize", "/tokenize", "/v1/models", "/sleep", "/v1/audio/transcriptions", "/v1/x",
         "/v1/chat%2Fcompletions", "/v1//completions", "/"]
FIELDS = ["model", "messages", "prompt", "input", "instructions", "max_tokens", "max_completion_tokens",
          "max_output_tokens", "min_tokens", "n", "best_of", "tools", "documents", "chat_template_kwargs",
          "add_generation_prompt", "continue_final_message", "reasoning_effort", "token_ids", "sampling_params",
          "query", "documents", "text_1", "text_2", "system", "suffix", "stream", "use_beam_search",
          "ignore_eos", "logit_bias", "stop_token_ids", "stop", "bad_words", "allowed_token_ids", "add_special_tokens",
          "reasoning", "reasoning_content", "tool_calls", "arguments"]

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-2**70, 2**70), st.sampled_from([0, 1, 2**31, 2**31 - 1, 2**63]),
    st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=40),
    st.sampled_from(["\ud800", "\udfff", "a\u0000b", "😀", "w " * 50]),
)
values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=5), st.dictionaries(st.sampled_from(FIELDS + ["role", "content", "type", "text"]),
                                                 inner, max_size=5)), max_leaves=20)
base_bodies = st.sampled_from([
    {"model": "m", "messages": [{"role": "user", "content": "w w w"}]},
    {"model": "m", "prompt": "w w w"},
    {"model": "m", "input": "w w"},
    {"model": "m", "max_tokens": 10, "messages": [{"role": "user", "content": "w"}], "system": "w"},
    {"model": "m", "token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 5}},
    {"model": "m", "query": "w", "documents": ["w w"]},
    {"model": "m", "messages": [[{"role": "user", "content": "w"}]]},
])
# Tool-call arguments as clients send them: JSON text (compact, spaced, nested, malformed, not an
# object, huge numbers), an object already, or something else entirely.
arguments = st.one_of(
    st.sampled_from(['{"city":"Paris"}', '{"city": "Paris", "days": [1, 2, 3]}', '{"a":{"b":{"c":[{"d":1}]}}}',
                     '{"city": Par', "", "[]", "42", "null", '"text"', '{"n": 1e400}', '{"a":' * 50 + "1" + "}" * 50]),
    st.dictionaries(st.text(max_size=8), values, max_size=3), values)
tool_calls = st.lists(st.fixed_dictionaries(
    {"id": st.text(max_size=8), "type": st.sampled_from(["function", "function", "x"]),
     "function": st.fixed_dictionaries({"name": st.text(max_size=12), "arguments": arguments})}), max_size=3)
reasoning = st.one_of(st.none(), st.text(max_size=60), st.sampled_from(["w " * 200]), values)
contents = st.one_of(st.none(), st.text(max_size=40), st.lists(st.fixed_dictionaries(
    {"type": st.sampled_from(["text", "text", "refusal", "image_url"]), "text": st.text(max_size=20)}), max_size=3))


@st.composite
def messages(draw) -> list:
    """A conversation with the fields vLLM reshapes before its chat template renders them."""
    out = []
    for _ in range(draw(st.integers(1, 5))):
        role = draw(st.sampled_from(["user", "assistant", "assistant", "tool", "system", "developer"]))
        message = {"role": role, "content": draw(contents)}
        if role == "assistant":
            for key in draw(st.sets(st.sampled_from(["reasoning", "reasoning_content", "tool_calls", "name"]))):
                message[key] = draw(tool_calls) if key == "tool_calls" else draw(reasoning)
        elif role == "tool":
            message["tool_call_id"] = draw(st.text(max_size=8))
        if draw(st.integers(0, 9)) == 0:
            del message["content"]
        out.append(message)
    return out


forcing = st.fixed_dictionaries({}, optional={
    "min_tokens": st.one_of(st.integers(-5, 5000), values), "ignore_eos": st.one_of(st.booleans(), values),
    "logit_bias": st.one_of(st.dictionaries(st.sampled_from(["2", "0", "-1", "99999", "x"]),
                                            st.one_of(st.integers(-100, 100), values), max_size=3), values),
    "stop_token_ids": st.one_of(st.lists(st.integers(-1, 70000), max_size=3), values),
    "add_special_tokens": st.one_of(st.booleans(), values),
    "max_tokens": st.one_of(st.integers(-1, 5000), values)})


@st.composite
def bodies(draw) -> bytes:
    kind = draw(st.integers(0, 11))
    if kind == 0:
        return draw(st.binary(max_size=200))
    doc = dict(draw(base_bodies))
    if kind >= 10:  # a chat as an agent sends it, forcing its length or not
        doc = {"model": "m", "messages": draw(messages()), **draw(forcing)}
    for _ in range(draw(st.integers(0, 4))):
        doc[draw(st.sampled_from(FIELDS))] = draw(values)
    raw = json.dumps(doc, ensure_ascii=draw(st.booleans()), allow_nan=True).encode("utf-8", "surrogatepass")
    if kind == 1:
        return raw[: draw(st.integers(0, len(raw)))]
    if kind == 2:
        depth = draw(st.sampled_from([10, 500, 1023, 1025, 3000]))
        return b'{"model": "m", "messages": ' + b"[" * depth + b"]" * depth + b"}"
    if kind == 3 and raw.startswith(b"{"):
        key = draw(st.sampled_from(["max_tokens", "messages", "prompt", "n"]))
        return b'{"' + key.encode() + b'": 1, ' + raw[1:]
    if kind == 4:
        return raw.replace(b"1", b"1e400", 1).replace(b"3", b"NaN", 1)
    return raw


def both_enforcers(tmp_path_factory, **options):
    """The Python gateway and nginx in front of one small fake engine, the team recommendation's
    gateway under the fuzz suite's client limits and `options`; yields ({kind: server}, upstream)."""
    limits = ClientLimits(max_body_bytes=256 * 1024, header_timeout_s=5, body_timeout_s=5)
    options = {"limits": limits, "nginx_user": "root" if os.geteuid() == 0 else None, **options}
    servers = {}
    with small_fake() as upstream:
        rec = team_rec(upstream.port)
        try:
            for kind in ("python", "nginx"):
                servers[kind] = start_enforcer(kind, rec, tmp_path_factory.mktemp("nginx"), **options)
            yield servers, upstream
        finally:
            for server in servers.values():
                server.stop()


@pytest.fixture(scope="module")
def enforcers(tmp_path_factory):
    # X-Kvtune-Reserved-Blocks on each admitted answer, which the parity property reads
    yield from both_enforcers(tmp_path_factory, nginx_worker_processes="1",
                              admin=AdminAccess(refusal_detail=RefusalDetail.LEDGER))


# quiet: each of its 1,500 requests is on a new connection that the gateway closes unanswered when no
# request head arrives within client_header_timeout (5 s, the suite's client limits: a bound this test
# keeps). Beside CI's loaded tiers (the run on b243f4b: 28.9 s, against 8.5 s alone) nginx closed one
# POST /score with an empty body unanswered, and answered it when Hypothesis sent it again: most
# likely the test's own client, starved between connecting and sending, as the first run of that day
# starved vLLM's API server for 9 s.
@pytest.mark.quiet
@pytest.mark.parametrize("kind", ["python", "nginx"])
def test_hostile_requests_never_get_a_500_and_never_leak_blocks(enforcers, kind):
    servers, upstream = enforcers
    server = servers[kind]

    @settings(max_examples=EXAMPLES, deadline=None, derandomize="KVTUNE_FUZZ_RANDOM" not in os.environ,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(path=st.sampled_from(PATHS), method=st.sampled_from(["POST"] * 6 + ["GET", "PUT", "DELETE"]),
           body=bodies(), team=st.sampled_from([None, None, TEAM_A, TEAM_B, "", TEAM_A.upper(), TEAM_A + " ",
                                                 f"{TEAM_A}, {TEAM_B}", "x" * 300]))
    def one(path, method, body, team):
        headers = {} if team is None else {TEAM_HEADER: team}
        status, _, answer = server.request(path, body if method != "GET" else None, method=method, headers=headers)
        if status >= 500:
            # only the answers a gateway owes an unreachable or confused engine, never its own crash
            assert status in (501, 502, 503, 504), (status, answer[:300])
        assert 100 <= status < 600

    one()
    assert server.wait_ledger(0)["reserved"] == 0
    assert server.ledger()["inflight"] == 0
    if kind == "nginx":
        log = server.error_log()
        assert "runtime error" not in log and "lua entry thread aborted" not in log, log[-2000:]


def test_both_enforcers_read_the_new_classes_alike(enforcers):
    """The parser differential over issue 26's classes: a chat with reshaped messages, forced
    lengths, add_special_tokens and a route header is answered with the same status by both
    enforcers, and where admitted, with the same reservation and the same cap (both count through
    the fake engine's /tokenize, so a message field one of them drops shows as fewer blocks)."""
    servers, _ = enforcers
    statuses: list[int] = []

    @settings(max_examples=max(EXAMPLES // 10, 50), deadline=None,
              derandomize="KVTUNE_FUZZ_RANDOM" not in os.environ,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(doc=st.builds(lambda m, f: {"model": "m", "messages": m, **f}, messages(), forcing),
           team=st.sampled_from([None, TEAM_A, TEAM_B]))
    def one(doc, team):
        headers = {} if team is None else {TEAM_HEADER: team}
        seen = {}
        for kind, server in servers.items():
            status, answer_headers, _ = server.request("/v1/chat/completions", doc, headers=headers)
            seen[kind] = (status, answer_headers.get("X-Kvtune-Reserved-Blocks"),
                          answer_headers.get("X-Kvtune-Max-Tokens"))
        assert seen["python"] == seen["nginx"], (seen, doc)
        statuses.append(seen["python"][0])

    one()
    assert statuses.count(200) >= len(statuses) // 5, sorted(statuses)  # most of them reach the engine
    for server in servers.values():
        assert server.wait_ledger(0)["reserved"] == 0


# ---------------------------------------------------------------- flow control under load (issue 29)

FLOW_NAMES = ["A", "B", "C", "", " A ", "x" * 129, "é", "a\tb"]
BAND_NAMES = ["interactive", "batch", "Batch", "", "unknown", " batch "]
AUTHS = [None, "Bearer k1", "Bearer k2", "bearer  k3 ", "Basic x", "Bearer"]


@pytest.fixture(scope="module")
def flow_enforcers(tmp_path_factory):
    """Both enforcers with flow control: a tight queue (2 waiters a flow, 6 flow states, 12 in
    all), deadlines of 0.3 s and 1 s and 10 ms a token (an admitted chat is expected to hold its
    blocks for about half a second), so a burst of requests is admitted, queued, shed at arrival
    and full all at once."""
    from kvtune.domain.flow_control import Band, FlowControl

    flow = FlowControl(token_time_s=0.01, bands=(Band("interactive", 0.3), Band("batch", 1.0)),
                       weights={"A": 3.0}, max_waiting=12, max_waiting_per_flow=2, max_flows=6, metrics_flows=3)
    yield from both_enforcers(tmp_path_factory, nginx_worker_processes="2", flow=flow)


def _abandoned(server, path: str, body: bytes, headers: dict) -> None:
    """Send the request and go away before any answer (it may be waiting in the queue)."""
    import socket

    head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock:
        sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{head}"
                     f"Content-Length: {len(body)}\r\n\r\n".encode() + body)


@pytest.mark.parametrize("kind", ["python", "nginx"])
def test_flow_control_under_bursts_never_leaks_a_block_or_a_waiter(flow_enforcers, kind):
    """Bursts of 10 concurrent requests, each with any band, flow and API key header (valid,
    unknown, empty, too long, not ASCII), of any size (up to 92 of the 100 blocks, held for up
    to 80 ms by the engine), some abandoned while they wait: every answer is an admission or a
    refusal of the gateway's own (never a 500), and after each burst nothing is held, in flight
    or waiting; nginx logs no Lua error."""
    from concurrent.futures import ThreadPoolExecutor

    servers, upstream = flow_enforcers
    server = servers[kind]
    one_request = st.fixed_dictionaries({
        "words": st.sampled_from([1, 400, 700, 1400, 1400]), "delay": st.sampled_from([None, 0.002, 0.005]),
        "band": st.sampled_from([None, *BAND_NAMES]), "flow": st.sampled_from([None, *FLOW_NAMES]),
        "auth": st.sampled_from(AUTHS), "abandon": st.booleans(), "stream": st.booleans(),
        "body": st.one_of(st.none(), bodies())})
    seen: set[int] = set()

    @settings(max_examples=max(EXAMPLES // 50, 20), deadline=None,
              derandomize="KVTUNE_FUZZ_RANDOM" not in os.environ,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(burst=st.lists(one_request, min_size=6, max_size=10))
    def one(burst):
        def send(r: dict) -> int:
            headers = {}
            if r["band"] is not None:
                headers["X-Kvtune-Priority"] = r["band"]
            if r["flow"] is not None:
                headers["X-Kvtune-Flow"] = r["flow"].encode("utf-8").decode("latin-1")
            if r["auth"] is not None:
                headers["Authorization"] = r["auth"]
            if r["body"] is not None:
                body = r["body"]
            else:
                doc = {"model": "m", "messages": [{"role": "user", "content": " ".join(["w"] * r["words"])}],
                       "stream": r["stream"], "x_chunks": 16}
                if r["delay"] is not None:
                    doc["x_delay"] = r["delay"]
                body = json.dumps(doc).encode()
            if r["abandon"]:
                _abandoned(server, "/v1/chat/completions", body, headers)
                return 0
            status, _, answer = server.request("/v1/chat/completions", body, headers=headers, timeout=20)
            if status >= 500:
                assert status in (502, 503, 504), (status, answer[:300])
            return status

        with ThreadPoolExecutor(len(burst)) as pool:
            seen.update(pool.map(send, burst))
        drained = server.wait_drained(timeout=15)
        assert (drained["reserved"], drained["inflight"]) == (0, 0), drained
        deadline = time.monotonic() + 5
        while server.ledger()["waiting"] and time.monotonic() < deadline:
            time.sleep(0.02)
        assert server.ledger()["waiting"] == 0

    one()
    assert 200 in seen, seen
    # Whether a burst above filled the queue depends on how fast this host sends it (in CI on a
    # loaded host no burst did: no 429, in a full run of the ci-lean branch). A full queue is made here whatever the
    # timing: one request holds 92 of the 100 blocks at the engine until every other answer is in,
    # so none of three more of flow A, batch band, can be admitted: each is refused with 429 (shed
    # at arrival, the flow's 2 places full, or its 1 s deadline passed in the queue), and once the
    # holder is released nothing stays held or waiting.
    chat = {"model": "m", "messages": [{"role": "user", "content": " ".join(["w"] * 1400)}], "x_chunks": 16}
    with ThreadPoolExecutor(4) as pool:
        holder = pool.submit(server.request, "/v1/chat/completions", json.dumps({**chat, "x_mode": "hold"}).encode(),
                             timeout=30)
        deadline = time.monotonic() + 10
        while server.ledger()["reserved"] == 0:
            assert time.monotonic() < deadline, "the holder was never admitted"
            time.sleep(0.01)
        flow_a = {"X-Kvtune-Priority": "batch", "X-Kvtune-Flow": "A"}
        blocked = [pool.submit(server.request, "/v1/chat/completions", json.dumps(chat).encode(), headers=flow_a,
                               timeout=20) for _ in range(3)]
        statuses = [f.result()[0] for f in blocked]
        upstream.release()
        assert holder.result()[0] == 200
    upstream.hold()
    assert statuses == [429] * 3, statuses
    seen.update(statuses)
    drained = server.wait_drained(timeout=15)
    assert (drained["reserved"], drained["inflight"], server.ledger()["waiting"]) == (0, 0, 0), drained
    assert {200, 429} <= seen, seen
    flow = server.ledger()["flow"]
    assert sum(b["admitted"] for b in flow["bands"]) > 0
    assert flow["flows"] <= 6 and flow["waiting"] == 0
    if kind == "nginx":
        log = server.error_log()
        assert "runtime error" not in log and "lua entry thread aborted" not in log, log[-2000:]
