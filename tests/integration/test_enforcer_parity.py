"""One behaviour, two enforcers: the same policy tests against `kvtune gateway` (Python, from the
rendered gateway.yaml) and the rendered nginx.conf on a real nginx with Lua, both rendered from
one recommendation and both in front of the same fake vLLM (tests/support/enforcers.py, tests/support/fake_vllm.py).

What is held the same: which paths are governed, refused or passed through; how each endpoint's
request is read (its prompt field, its cap fields, its sequences); clamping and reservation;
429/400/413; that only governed members of a body change on the way up; the bounds on a client
(head and body deadlines, head and body sizes, CONNECT/Upgrade); and a failed count."""

from __future__ import annotations

import dataclasses
import gzip
import http.client
import json
import os
import re
import socket
import threading
import time
import zlib

import pytest
from enforcers import (
    BUDGET,
    CHAT_CAP,
    COMPLETIONS_CAP,
    CUSTOM_CAP,
    DEFAULT_CAP,
    HOSTILE,
    HOSTILE_CAP,
    HOSTILE_MODEL,
    TEAM_A,
    TEAM_A_CAP,
    TEAM_B,
    TEAM_B_CAP,
    TEAM_B_CUSTOM_CAP,
    blocks,
    chat,
    in_thread,
    small_fake,
    small_rec,
    start_enforcer,
    team_rec,
    words,
)
from fake_vllm import DONE_EVENT, ROLE_EVENT

from kvtune.domain.admission_policy import AdmissionPolicy
from kvtune.gateway.config import Access, AdminAccess, ClientLimits, RefusalDetail
from kvtune.gateway.endpoints import DEFAULT_PASSTHROUGH, OPERATOR, UNCOUNTABLE

pytestmark = pytest.mark.slow

# Tight client bounds, so the limit tests finish in seconds.
LIMITS = ClientLimits(header_timeout_s=2.0, body_timeout_s=2.0, keepalive_timeout_s=4.0, send_timeout_s=3.0,
                      max_header_bytes=8192, max_header_line_bytes=4096, max_body_bytes=256 * 1024,
                      max_connections=64)


@pytest.fixture
def upstream():
    with small_fake() as fake:
        yield fake


def _start(kind: str, tmp_path, upstream, admission: AdmissionPolicy | None = None, *,
           chat_lengths: tuple[list[int], list[int]] | None = None, **extra):
    rec = small_rec(upstream.port, chat_lengths=chat_lengths)
    if admission is not None:
        rec = dataclasses.replace(rec, admission=admission)
    # the ledger's figures (X-Kvtune-Reserved-Blocks, blocks in 429/413) are what these tests
    # read: shown to their loopback client under admin.refusal_detail: ledger (default public)
    extra.setdefault("admin", AdminAccess(refusal_detail=RefusalDetail.LEDGER))
    return start_enforcer(kind, rec, tmp_path / "nginx", nginx_worker_processes="1",
                          limits=LIMITS, nginx_user="root" if os.geteuid() == 0 else None, **extra)


@pytest.fixture(params=["python", "nginx"])
def enforcer(request, tmp_path, upstream):
    server = _start(request.param, tmp_path, upstream)
    try:
        yield server
    finally:
        server.stop()


def _reserved(headers: dict) -> int:
    return int(headers["X-Kvtune-Reserved-Blocks"])


def _error(body: bytes) -> str:
    return json.loads(body)["error"]["code"]


def test_route_table_and_budget(enforcer):
    ledger = enforcer.ledger()
    assert ledger["routes"] == [HOSTILE, "/v1/chat/completions", "/v1/completions", "/v1/summarize", "default"]
    assert ledger["budget"] == BUDGET and ledger["reserved"] == 0
    assert {k: ledger[k] for k in ("policy", "factor", "epsilon", "limit", "overflow_probability")} == {
        "policy": "guaranteed", "factor": None, "epsilon": None, "limit": BUDGET, "overflow_probability": None}


# ---------------------------------------------------------------- routes on a request header

@pytest.fixture(params=["python", "nginx"])
def team_enforcer(request, tmp_path, upstream):
    server = start_enforcer(request.param, team_rec(upstream.port), tmp_path / "nginx", nginx_worker_processes="1",
                            limits=LIMITS, nginx_user="root" if os.geteuid() == 0 else None,
                            admin=AdminAccess(refusal_detail=RefusalDetail.LEDGER))
    try:
        yield server
    finally:
        server.stop()


@pytest.mark.parametrize("path, team, cap", [
    ("/v1/chat/completions", TEAM_A, TEAM_A_CAP),
    ("/v1/chat/completions", TEAM_B, TEAM_B_CAP),
    ("/v1/completions", TEAM_A, TEAM_A_CAP),              # rag-search's route names no path
    ("/v1/completions", TEAM_B, COMPLETIONS_CAP),         # support-chat's names chat: the path route
    ("/v1/summarize", TEAM_B, TEAM_B_CUSTOM_CAP),         # header and custom path together
    ("/v1/summarize", None, CUSTOM_CAP),
    ("/v1/chat/completions", None, CHAT_CAP),             # no header: the routes after the header ones
    ("/v1/responses", None, DEFAULT_CAP),                 # ... down to the catch-all, still capped
    ("/v1/responses", TEAM_A, TEAM_A_CAP),
    ("/v1/responses", "unknown-team", DEFAULT_CAP),       # a value no route names
    ("/v1/responses", "", DEFAULT_CAP),                   # an empty one
    ("/v1/responses", TEAM_A.upper(), DEFAULT_CAP),       # values are exact, case included
    ("/v1/responses", f"  {TEAM_A}  ", TEAM_A_CAP),       # the space around a header value is no part of it
    ("/v1/responses", TEAM_A + "x" * 3000, DEFAULT_CAP),  # a long value never matches (nor costs a regex)
    ("/v1/responses", f"{TEAM_A}, {TEAM_B}", DEFAULT_CAP),  # two values on one line match neither
])
def test_a_header_route_caps_its_group(team_enforcer, upstream, path, team, cap):
    body = {"/v1/chat/completions": chat(10, max_tokens=4000),
            "/v1/completions": {"model": "m", "prompt": words(10), "max_tokens": 4000},
            "/v1/summarize": {"model": "m", "prompt": words(10)},
            "/v1/responses": {"model": "m", "input": words(10), "max_output_tokens": 4000}}[path]
    status, headers, answer = team_enforcer.request(path, body, headers=None if team is None else {"X-Team": team})
    assert status == 200, answer
    assert headers["X-Kvtune-Max-Tokens"] == str(cap)
    assert _reserved(headers) == blocks(10, cap)
    assert team_enforcer.wait_ledger(0)["reserved"] == 0


def test_the_header_name_is_case_insensitive(team_enforcer, upstream):
    for name in ("x-team", "X-TEAM", "x-TeAm"):
        status, headers, _ = team_enforcer.request("/v1/chat/completions", chat(10), headers={name: TEAM_B})
        assert status == 200 and upstream.seen[-1]["max_tokens"] == TEAM_B_CAP, name


def test_the_route_header_counts_after_many_other_headers(team_enforcer, upstream):
    """Past the 100 headers ngx.req.get_headers reads by default: the value, and a second copy, still count."""
    pad = {f"X-Pad-{i}": "x" for i in range(110)}  # aiohttp (the fake) takes at most 128
    status, headers, answer = team_enforcer.request("/v1/chat/completions", chat(10), headers={**pad, "X-Team": TEAM_B})
    assert status == 200, answer
    assert headers["X-Kvtune-Max-Tokens"] == str(TEAM_B_CAP)
    status, _, answer = team_enforcer.request("/v1/chat/completions", chat(10),
                                              headers={"x-team": TEAM_B, **pad, "X-Team": TEAM_A})
    assert (status, _error(answer)) == (400, "duplicate_route_header")


def test_header_routes_are_in_the_route_table(team_enforcer):
    assert team_enforcer.ledger()["routes"][:3] == [TEAM_A, TEAM_B, TEAM_B + " summarize"]


def _twice(port: int, path: str, first: str, second: str, value_a: str, value_b: str) -> tuple[int, str]:
    """A request carrying the route header on two lines (http.client would join a dict's)."""
    body = json.dumps(chat(10)).encode()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.putrequest("POST", path)
        conn.putheader("Content-Type", "application/json")
        conn.putheader(first, value_a)
        conn.putheader(second, value_b)
        conn.putheader("Content-Length", str(len(body)))
        conn.endheaders(body)
        resp = conn.getresponse()
        return resp.status, _error(resp.read()) if resp.status != 200 else ""
    finally:
        conn.close()


@pytest.mark.parametrize("first, second, value_a, value_b", [
    ("X-Team", "X-Team", TEAM_B, TEAM_A),       # two groups: which one holds is not for the client to pick
    ("X-Team", "x-team", TEAM_A, TEAM_A),       # the same one twice, in two spellings of the name
    ("x-team", "X-Team", "", TEAM_A),           # an empty one beside a real one
])
def test_a_route_header_sent_twice_is_refused(team_enforcer, upstream, first, second, value_a, value_b):
    assert _twice(team_enforcer.port, "/v1/chat/completions", first, second, value_a, value_b) == (
        400, "duplicate_route_header")
    assert upstream.seen == [] and team_enforcer.ledger()["reserved"] == 0


# ---------------------------------------------------------------- caps, by each endpoint's own fields

@pytest.mark.parametrize("path, body, field, expected", [
    ("/v1/chat/completions", chat(10), "max_tokens", CHAT_CAP),                      # absent: set
    ("/v1/chat/completions", chat(10, max_tokens=5000), "max_tokens", CHAT_CAP),     # larger: clamped
    ("/v1/chat/completions", chat(10, max_tokens=10), "max_tokens", 10),             # smaller: kept
    ("/v1/chat/completions", chat(10, max_completion_tokens=9000), "max_completion_tokens", CHAT_CAP),
    ("/v1/completions", {"model": "m", "prompt": words(10), "max_tokens": 9000}, "max_tokens", COMPLETIONS_CAP),
    ("/v1/responses", {"model": "m", "input": words(10), "max_output_tokens": 70}, "max_output_tokens", 70),
    ("/v1/responses", {"model": "m", "input": words(10)}, "max_output_tokens", DEFAULT_CAP),
])
def test_each_endpoint_is_capped_in_its_own_fields(enforcer, upstream, path, body, field, expected):
    status, headers, _ = enforcer.request(path, body)
    assert status == 200
    assert upstream.seen[-1][field] == expected
    assert headers["X-Kvtune-Max-Tokens"] == str(expected)
    assert enforcer.wait_ledger(0)["reserved"] == 0


def test_a_cap_field_the_endpoint_does_not_read_neither_lowers_nor_replaces_its_cap(enforcer, upstream):
    """Chat ignores max_output_tokens: a client sending max_output_tokens=1 to chat must still be
    reserved (and capped) at the route's cap, with max_tokens set, and the stray field untouched."""
    status, headers, _ = enforcer.request("/v1/chat/completions", chat(10, max_output_tokens=1))
    assert status == 200
    seen = upstream.seen[-1]
    assert seen["max_tokens"] == CHAT_CAP and seen["max_output_tokens"] == 1
    assert _reserved(headers) == blocks(10, CHAT_CAP)


def test_every_present_cap_field_gets_the_cap_and_the_rest_is_untouched(enforcer, upstream):
    body = chat(10, max_completion_tokens=9000, max_tokens=None, stop=[], n=1, temperature=0.5)
    assert enforcer.request("/v1/chat/completions", body)[0] == 200
    seen = upstream.seen[-1]
    assert seen["max_completion_tokens"] == CHAT_CAP and seen["max_tokens"] == CHAT_CAP
    assert seen["stop"] == [] and seen["n"] == 1 and seen["temperature"] == 0.5
    assert seen["messages"] == body["messages"]


@pytest.mark.parametrize("extra, max_tokens, min_tokens", [
    ({"max_tokens": 5000, "min_tokens": 100}, CHAT_CAP, CHAT_CAP),   # above the clamped cap: comes down
    ({"min_tokens": 5000}, CHAT_CAP, CHAT_CAP),                      # no max_tokens: the route's cap is set
    ({"max_tokens": 10, "min_tokens": 20}, 10, 10),                  # the client's own cap is the limit too
    ({"max_tokens": 5000, "min_tokens": CHAT_CAP}, CHAT_CAP, CHAT_CAP),  # equal is allowed
    ({"max_tokens": 5000, "min_tokens": 70.5}, CHAT_CAP, CHAT_CAP),
    ({"max_tokens": 5000, "min_tokens": 5}, CHAT_CAP, 5),            # below: untouched
    ({"max_tokens": 5000, "min_tokens": "lots"}, CHAT_CAP, "lots"),  # not a number: vLLM's to judge
])
def test_min_tokens_above_the_cap_comes_down_to_it(enforcer, upstream, extra, max_tokens, min_tokens):
    """vLLM answers 400 to min_tokens > max_tokens: clamping the cap must not create one."""
    status, headers, _ = enforcer.request("/v1/chat/completions", chat(10, **extra))
    assert status == 200
    seen = upstream.seen[-1]
    assert (seen["max_tokens"], seen["min_tokens"]) == (max_tokens, min_tokens)
    assert headers["X-Kvtune-Max-Tokens"] == str(max_tokens)
    assert enforcer.wait_ledger(0)["reserved"] == 0


def test_model_route_path_route_and_custom_path(enforcer, upstream):
    body = chat(10, max_tokens=999)
    body["model"] = HOSTILE_MODEL
    status, headers, _ = enforcer.request("/v1/chat/completions", body)
    assert status == 200 and upstream.seen[-1]["max_tokens"] == HOSTILE_CAP
    assert _reserved(headers) == blocks(10, HOSTILE_CAP)
    status, headers, _ = enforcer.request("/v1/completions", {"model": "m", "prompt": words(5), "max_tokens": 4000})
    assert status == 200 and upstream.seen[-1]["max_tokens"] == COMPLETIONS_CAP
    assert _reserved(headers) == blocks(5, COMPLETIONS_CAP)
    # /v1/summarize is no vLLM endpoint (api: any): every prompt field it carries is charged
    body = {"model": "m", "prompt": words(20), "messages": [{"role": "user", "content": words(30)}]}
    status, headers, _ = enforcer.request("/v1/summarize", body)
    assert status == 200 and upstream.paths[-1] == "/v1/summarize"
    assert upstream.seen[-1]["max_tokens"] == CUSTOM_CAP
    assert _reserved(headers) == blocks(20 + 30, CUSTOM_CAP)


@pytest.mark.parametrize("path, extra, sequences", [
    ("/v1/chat/completions", {"n": 3}, 3),
    ("/v1/chat/completions", {"n": 1}, 1),
    ("/v1/chat/completions", {"best_of": 4, "n": 2}, 2),   # chat has no best_of: only n counts
    ("/v1/completions", {"best_of": 4, "n": 2}, 4),
])
def test_n_and_best_of_multiply_the_reservation(enforcer, path, extra, sequences):
    if path == "/v1/completions":
        body, cap = {"model": "m", "prompt": words(40), **extra}, COMPLETIONS_CAP
    else:
        body, cap = chat(40, **extra), CHAT_CAP
    status, headers, _ = enforcer.request(path, body)
    assert status == 200
    assert _reserved(headers) == blocks(40, cap, sequences)


# ---------------------------------------------------------------- the prompt: each endpoint's own field

@pytest.mark.parametrize("path, body, prompt, cap", [
    # completions runs `prompt`: a stray empty `messages` must not make it the empty chat
    ("/v1/completions", {"model": "m", "prompt": words(500), "messages": []}, 500, COMPLETIONS_CAP),
    # chat runs `messages`: a stray `prompt` is not its prompt
    ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": words(7)}],
                              "prompt": words(900)}, 7, CHAT_CAP),
    # responses runs `input` (and `instructions`): a stray empty `messages` changes nothing
    ("/v1/responses", {"model": "m", "input": words(400), "messages": []}, 400, DEFAULT_CAP),
    ("/v1/responses", {"model": "m", "input": words(30), "instructions": words(20)}, 50, DEFAULT_CAP),
    ("/v1/responses", {"model": "m", "input": [{"role": "user", "content": [
        {"type": "input_text", "text": words(25)}]}]}, 25, DEFAULT_CAP),
    ("/v1/completions", {"model": "m", "prompt": [words(30), words(40)]}, (30, 40), COMPLETIONS_CAP),
    ("/v1/completions", {"model": "m", "prompt": [[1, 2, 3], list(range(50))]}, (3, 50), COMPLETIONS_CAP),
])
def test_the_prompt_is_the_field_the_engine_reads(enforcer, upstream, path, body, prompt, cap):
    status, headers, raw = enforcer.request(path, body)
    assert status == 200, raw
    prompts = prompt if isinstance(prompt, tuple) else (prompt,)
    assert _reserved(headers) == sum(blocks(p, cap) for p in prompts)
    assert enforcer.wait_ledger(0)["reserved"] == 0


def test_documents_and_reasoning_effort_reach_the_count(enforcer, upstream):
    """/tokenize takes neither: the gateway sends them as chat_template_kwargs, which the
    engine renders the same way, so a prompt hidden in documents is still charged."""
    body = chat(5, documents=[{"text": words(300)}], reasoning_effort="low")
    status, headers, _ = enforcer.request("/v1/chat/completions", body)
    assert status == 200
    assert _reserved(headers) == blocks(305, CHAT_CAP)
    kwargs = upstream.tokenize_calls[-1]["chat_template_kwargs"]
    assert kwargs["documents"] == [{"text": words(300)}] and kwargs["reasoning_effort"] == "low"


def test_tokenize_gets_the_messages_as_vllms_chat_request_renames_them(enforcer, upstream):
    """vLLM's chat request renames reasoning_content to reasoning (unless that is set) before the
    template; its /tokenize does not, so both enforcers send the renamed messages, and a chat's
    add_special_tokens (issue 26, item 1)."""
    messages = [{"role": "user", "content": words(3)},
                {"role": "assistant", "content": words(2), "reasoning_content": words(40)},
                {"role": "assistant", "content": words(2), "reasoning": "kept", "reasoning_content": words(40)},
                {"role": "assistant", "content": words(2), "reasoning": None, "reasoning_content": words(4)},
                {"role": "user", "content": words(1), "name": "bob"}]
    body = {"model": "m", "messages": messages, "add_special_tokens": True}
    status, _, raw = enforcer.request("/v1/chat/completions", body)
    assert status == 200, raw
    call = upstream.tokenize_calls[-1]
    assert call["messages"] == [messages[0], {"role": "assistant", "content": words(2), "reasoning": words(40)},
                                {"role": "assistant", "content": words(2), "reasoning": "kept"},
                                {"role": "assistant", "content": words(2), "reasoning": words(4)}, messages[4]]
    assert call["add_special_tokens"] is True


@pytest.mark.parametrize("body", [
    {"model": "m", "input": 5},
    {"model": "m", "input": words(5), "previous_response_id": "resp_1"},
    {"model": "m", "input": [{"type": "function_call_output", "call_id": "c", "output": words(900)}]},
    {"model": "m", "input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
])
def test_responses_the_gateway_cannot_count_are_refused(enforcer, upstream, body):
    status, headers, raw = enforcer.request("/v1/responses", body)
    assert status == 400 and _error(raw) in ("invalid_request", "uncountable_request")
    assert upstream.seen == [] and enforcer.ledger()["reserved"] == 0


# ---------------------------------------------------------------- the other generating endpoints

def test_sagemaker_invocations_are_governed(enforcer, upstream):
    """vLLM's /invocations runs a chat or a completions request: the larger reading is reserved."""
    status, headers, raw = enforcer.request("/invocations", {"model": "m", "prompt": words(30), "max_tokens": 1_000_000,
                                                             "n": 64})
    assert status == 413 and _error(raw) == "kv_reservation_exceeds_budget"
    status, headers, _ = enforcer.request("/invocations", {"model": "m", "prompt": words(30), "max_tokens": 1_000_000})
    assert status == 200 and upstream.seen[-1]["max_tokens"] == DEFAULT_CAP
    assert _reserved(headers) == blocks(30, DEFAULT_CAP)
    body = {"model": "m", "messages": [{"role": "user", "content": words(10)}], "prompt": words(200)}
    status, headers, _ = enforcer.request("/invocations", body)
    assert status == 200 and _reserved(headers) == blocks(200, DEFAULT_CAP)


def test_anthropic_messages_are_counted_by_the_engine_and_capped(enforcer, upstream):
    body = {"model": "m", "max_tokens": 4000, "system": words(12),
            "messages": [{"role": "user", "content": words(20)}]}
    status, headers, _ = enforcer.request("/v1/messages", body)
    assert status == 200
    assert upstream.seen[-1]["max_tokens"] == DEFAULT_CAP
    assert _reserved(headers) == blocks(32, DEFAULT_CAP)
    assert "messages" in upstream.tokenize_calls[-1] and upstream.tokenize_calls[-1]["system"] == words(12)


def test_token_in_token_out_generate_is_capped_inside_sampling_params(enforcer, upstream):
    body = {"model": "m", "token_ids": list(range(100)), "sampling_params": {"max_tokens": 5000, "n": 2}}
    status, headers, _ = enforcer.request("/inference/v1/generate", body)
    assert status == 200
    assert upstream.seen[-1]["sampling_params"] == {"max_tokens": DEFAULT_CAP, "n": 2}
    assert _reserved(headers) == blocks(100, DEFAULT_CAP, 2)
    status, headers, _ = enforcer.request("/inference/v1/generate", {"token_ids": [1, 2], "sampling_params": {}})
    assert status == 200 and upstream.seen[-1]["sampling_params"] == {"max_tokens": DEFAULT_CAP}


def test_chat_batch_reserves_every_conversation(enforcer, upstream):
    body = {"model": "m", "messages": [[{"role": "user", "content": words(10)}],
                                       [{"role": "user", "content": words(50)}]]}
    status, headers, _ = enforcer.request("/v1/chat/completions/batch", body)
    assert status == 200
    assert _reserved(headers) == blocks(10, DEFAULT_CAP) + blocks(50, DEFAULT_CAP)


@pytest.mark.parametrize("path, body, expected", [
    ("/v1/embeddings", {"model": "m", "input": words(40)}, blocks(40, 0)),
    ("/v1/embeddings", {"model": "m", "input": [words(20), words(30)]}, blocks(20, 0) + blocks(30, 0)),
    ("/pooling", {"model": "m", "input": [1, 2, 3]}, 1),
    ("/classify", {"model": "m", "input": words(17)}, blocks(17, 0)),
    ("/v1/rerank", {"model": "m", "query": words(10), "documents": [words(5), words(300)]},
     blocks(10 + 5 + 128, 0) + blocks(10 + 300 + 128, 0)),
    ("/score", {"model": "m", "text_1": words(4), "text_2": [words(6), words(8)]},
     blocks(4 + 6 + 128, 0) + blocks(4 + 8 + 128, 0)),
])
def test_pooling_endpoints_reserve_their_input(enforcer, upstream, path, body, expected):
    status, headers, raw = enforcer.request(path, body)
    assert status == 200, raw
    assert _reserved(headers) == expected and "X-Kvtune-Max-Tokens" not in headers
    assert upstream.raw[-1] == json.dumps(body).encode()  # nothing to cap: forwarded as sent
    assert enforcer.wait_ledger(0)["reserved"] == 0


# ---------------------------------------------------------------- no ungoverned path

@pytest.mark.parametrize("path", sorted(OPERATOR))
def test_operator_endpoints_are_never_reachable(enforcer, upstream, path):
    for method in ("POST", "GET"):
        status, _, raw = enforcer.request(path, {"level": 1} if method == "POST" else None, method=method)
        assert status == 404 and _error(raw) == "not_found"
    assert upstream.reached() == []


@pytest.mark.parametrize("path", sorted(UNCOUNTABLE))
def test_generating_endpoints_the_gateway_cannot_count_are_refused(enforcer, upstream, path):
    status, _, raw = enforcer.request(path, {"model": "m", "max_tokens": 1_000_000, "n": 64})
    assert status == 501 and _error(raw) == "uncountable_endpoint"
    assert upstream.reached() == []


@pytest.mark.parametrize("path, method", [
    ("/v1/files", "POST"), ("/v1/fine_tuning/jobs", "GET"), ("/metrics/x", "GET"), ("/", "GET"),
    ("/v1/chat/completions/", "POST"), ("/V1/chat/completions", "POST"), ("/ping", "GET"),
])
def test_unknown_paths_are_refused(enforcer, upstream, path, method):
    status, _, raw = enforcer.request(path, chat(5) if method == "POST" else None, method=method)
    assert status == 404 and _error(raw) == "not_found"
    assert upstream.reached() == []


def _direct_get(port: int, target: str) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", target)
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def test_the_passthrough_allow_list_reaches_the_upstream_untouched(enforcer, upstream):
    paths = [p for p in DEFAULT_PASSTHROUGH if p not in ("/tokenize", "/v1/messages/count_tokens")]
    through = [enforcer.request(path + "?q=1", method="GET") for path in paths]
    assert [c.path for c in upstream.other] == [p + "?q=1" for p in paths]
    # the client gets what the upstream answers, status included (its echo is a 207)
    for path, (status, _, body) in zip(paths, through, strict=True):
        assert (status, body) == _direct_get(upstream.port, path + "?q=1"), path
    assert (207, b"echo") in [(status, body) for status, _, body in through]
    assert enforcer.ledger()["reserved"] == 0


@pytest.mark.parametrize("target", [
    "/v1/chat%2Fcompletions", "/v1/chat%2fcompletions", "/v1//chat/completions", "/v1/./chat/completions",
    "/v1/x/../chat/completions", "/v1/chat/completions/.", "/v1/%63hat/completions", "/v1/chat/completions%00",
    "/sleep%3F", "/%2e%2e/sleep",
])
def test_paths_that_mean_two_things_are_refused(enforcer, upstream, target):
    """An upstream may decode or normalise a path the gateway let pass as something else."""
    status, _, raw = enforcer.request(target, chat(5))
    assert status in (400, 404)  # nginx refuses some of these itself, with its own page
    if raw.startswith(b"{"):
        assert _error(raw) in ("invalid_path", "not_found")
    assert upstream.reached() == []


def test_governed_paths_take_post_only(enforcer, upstream):
    status, headers, _ = enforcer.request("/v1/chat/completions", method="GET")
    assert status == 405
    assert upstream.reached() == []


def test_connect_and_upgrade_are_refused(enforcer, upstream):
    answer = enforcer.raw(b"CONNECT 127.0.0.1:22 HTTP/1.1\r\nHost: 127.0.0.1:22\r\n\r\n")
    assert answer.split(b" ", 2)[1] in (b"400", b"404", b"405")
    payload = json.dumps(chat(5)).encode()
    answer = enforcer.raw(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\n"
                          b"Upgrade: websocket\r\nContent-Type: application/json\r\n"
                          + f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
    assert answer.startswith(b"HTTP/1.1 400")
    assert upstream.reached() == []


# ---------------------------------------------------------------- bad input is a 400, never a 500

BAD_NUMBERS = [float("nan"), float("inf"), float("-inf"), 1e400, 2.5, -1, 0, True, False, "7", [7], {"n": 7},
               2**31, 2**70]


def _dumps(body: dict) -> bytes:
    """JSON as a hostile client writes it: NaN and Infinity literals included."""
    return json.dumps(body, allow_nan=True).encode()


@pytest.mark.parametrize("value", BAD_NUMBERS, ids=repr)
@pytest.mark.parametrize("path, field", [
    ("/v1/chat/completions", "max_tokens"), ("/v1/chat/completions", "max_completion_tokens"),
    ("/v1/chat/completions", "n"), ("/v1/completions", "best_of"), ("/v1/responses", "max_output_tokens"),
])
def test_bad_numbers_in_governed_fields_are_400(enforcer, upstream, path, field, value):
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]} if path.endswith("chat/completions") \
        else {"model": "m", "prompt": "hi"} if path == "/v1/completions" else {"model": "m", "input": "hi"}
    raw = _dumps({**body, field: value})
    if value == 1e400:
        raw = raw.replace(b"Infinity", b"1e400")
    status, headers, answer = enforcer.request(path, raw)
    assert status == 400 and "Retry-After" not in headers
    assert _error(answer) in ("invalid_max_tokens", f"invalid_{field}", "invalid_json")
    assert upstream.seen == [] and enforcer.ledger()["reserved"] == 0


@pytest.mark.parametrize("raw, code", [
    (b"{not json", "invalid_json"),
    (b"[1, 2]", "invalid_json"),
    (b'"text"', "invalid_json"),
    (b'{"model": "m", "messages": [{"role": "user", "content": "\\ud800"}]}', "invalid_unicode"),
    (b'{"model": "\\udfff", "messages": [{"role": "user", "content": "hi"}]}', "invalid_unicode"),
    (b'{"model": "m", "messages": [{"role": "user", "content": "\xff\xfe"}]}', "invalid_json"),
    (b'\xef\xbb\xbf{"model": "m", "messages": []}', "invalid_json"),
    (b'{"model": "m", "temperature": NaN, "messages": []}', "invalid_json"),
    (b'{"model": "m", "messages": [], "messages": [{"role": "user", "content": "x"}]}', "duplicate_key"),
    (b'{"model": "m", "max_tokens": 1, "max_tokens": 900000, "messages": []}', "duplicate_key"),
    (b'{"model": "m", "messages": ' + b"[" * 5000 + b"]" * 5000 + b"}", "invalid_json"),
    (b'{"model": "m", "messages": "hi"}', "invalid_request"),
    (b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "add_special_tokens": "yes"}',
     "invalid_request"),
    (b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "add_special_tokens": 1}', "invalid_request"),
    (b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "chat_template": "{{ x }}"}',
     "uncountable_request"),
])
def test_malformed_requests_are_400(enforcer, upstream, raw, code):
    status, headers, answer = enforcer.request("/v1/chat/completions", raw)
    assert status == 400 and "Retry-After" not in headers
    assert _error(answer) == code
    assert upstream.seen == [] and enforcer.ledger()["reserved"] == 0


def test_escaped_pairs_and_escaped_backslashes_are_text(enforcer, upstream):
    """A surrogate pair is one character, and an escaped backslash before 'ud800' is no escape."""
    raw = b'{"model": "m", "messages": [{"role": "user", "content": "\\ud83d\\ude00 \\\\ud800"}]}'
    assert enforcer.request("/v1/chat/completions", raw)[0] == 200


# ---------------------------------------------------------------- what is forwarded

def test_only_the_governed_members_change_on_the_way_up(enforcer, upstream):
    raw = (b'{ "model" : "m",\n  "seed": 1180591620717411303424, "temperature": 1.10,'
           b' "logit_bias": {"15": -1e2}, "stop": [],"extra": {}, "text": "caf\\u00e9 \\" \\/",'
           b' "messages": [ {"role":"user","content":"a b c"} ],  "max_tokens": 9000 , "min_tokens": 9000 }')
    status, _, _ = enforcer.request("/v1/chat/completions", raw)
    assert status == 200
    expected = raw.replace(b'"max_tokens": 9000', b'"max_tokens": 64').replace(b'"min_tokens": 9000',
                                                                               b'"min_tokens": 64')
    assert upstream.raw[-1] == expected


def test_a_cap_is_added_without_touching_the_rest(enforcer, upstream):
    raw = b'{"model":"m","seed":1180591620717411303424,"messages":[{"role":"user","content":"x"}]}'
    assert enforcer.request("/v1/chat/completions", raw)[0] == 200
    forwarded = upstream.raw[-1]
    assert json.loads(forwarded)["max_tokens"] == CHAT_CAP
    assert forwarded.replace(b'"max_tokens":64,', b"") == raw


def test_a_gzip_body_is_counted_decoded_and_forwarded_decoded(enforcer, upstream):
    body = json.dumps(chat(200)).encode()
    status, headers, _ = enforcer.request("/v1/chat/completions", gzip.compress(body),
                                          headers={"Content-Encoding": "gzip"})
    assert status == 200
    assert _reserved(headers) == blocks(200, CHAT_CAP)
    assert "Content-Encoding" not in upstream.headers[-1]
    assert json.loads(upstream.raw[-1])["messages"] == chat(200)["messages"]


def _raw_deflate(data: bytes) -> bytes:
    z = zlib.compressobj(wbits=-15)
    return z.compress(data) + z.flush()


@pytest.mark.parametrize("encoding, encode", [
    ("gzip", gzip.compress), ("deflate", zlib.compress), ("deflate", _raw_deflate),
    ("gzip", lambda data: gzip.compress(data[:20]) + gzip.compress(data[20:])),  # two members
])
def test_gzip_and_deflate_in_every_form_are_decoded(enforcer, upstream, encoding, encode):
    body = json.dumps(chat(40)).encode()
    status, headers, _ = enforcer.request("/v1/chat/completions", encode(body), headers={"Content-Encoding": encoding})
    assert status == 200 and _reserved(headers) == blocks(40, CHAT_CAP)


@pytest.mark.parametrize("data", [
    gzip.compress(json.dumps(chat(5)).encode()) + b"trailing garbage",
    gzip.compress(json.dumps(chat(5)).encode())[:-6],
    b"\x1f\x8b\x08\x00 not a gzip stream",
    zlib.compress(json.dumps(chat(5)).encode()) + b"x",
    zlib.compress(json.dumps(chat(5)).encode())[:-3],
], ids=["gzip-trailing", "gzip-cut", "not-gzip", "deflate-trailing", "deflate-cut"])
def test_a_broken_compressed_body_is_400(enforcer, upstream, data):
    encoding = "gzip" if data[:2] == b"\x1f\x8b" else "deflate"
    status, _, raw = enforcer.request("/v1/chat/completions", data, headers={"Content-Encoding": encoding})
    assert status == 400 and _error(raw) == "invalid_body"
    assert upstream.reached() == []


def test_a_gzip_bomb_stops_at_the_body_cap(enforcer, upstream):
    bomb = gzip.compress(b'{"model": "m", "pad": "' + b"x" * (40 * LIMITS.max_body_bytes) + b'"}')
    assert len(bomb) < LIMITS.max_body_bytes
    status, _, raw = enforcer.request("/v1/chat/completions", bomb, headers={"Content-Encoding": "gzip"})
    assert status == 413 and _error(raw) == "body_too_large"
    assert upstream.reached() == []


@pytest.mark.parametrize("encoding", ["compress", "br", "zstd", "gzip, gzip"])
def test_an_unknown_body_encoding_is_415(enforcer, upstream, encoding):
    status, _, raw = enforcer.request("/v1/chat/completions", b"xyz", headers={"Content-Encoding": encoding})
    assert status == 415 and _error(raw) == "unsupported_encoding"
    assert upstream.reached() == []


# ---------------------------------------------------------------- admission

def test_full_budget_answers_429_with_retry_after_then_releases(enforcer, upstream):
    upstream.hold()
    # 1536 prompt + 64 cap = 1600 tokens = 100 blocks: the whole budget
    t, box = in_thread(enforcer.request, "/v1/chat/completions", chat(1536, x_mode="hold"))
    assert enforcer.wait_ledger(100)["reserved"] == 100
    status, headers, body = enforcer.request("/v1/chat/completions", chat(1))
    assert status == 429
    assert int(headers["Retry-After"]) >= 1
    error = json.loads(body)["error"]
    assert error["code"] == "kv_budget_exhausted" and error["type"] == "rate_limit_error"
    assert error["message"]
    assert enforcer.ledger()["reserved"] == 100
    upstream.release()
    t.join(10)
    assert box["result"][0] == 200
    assert enforcer.wait_ledger(0)["reserved"] == 0
    assert enforcer.request("/v1/chat/completions", chat(1))[0] == 200

    # Retry-After follows the release rate (100 blocks just released, averaged over 30 s): a
    # request that needs more blocks is told to wait longer.
    upstream.hold()
    t, box = in_thread(enforcer.request, "/v1/chat/completions", chat(1536, x_mode="hold"))
    enforcer.wait_ledger(100)
    small = enforcer.request("/v1/chat/completions", chat(1))
    large = enforcer.request("/v1/chat/completions", chat(1000))
    upstream.release()
    t.join(10)
    assert small[0] == large[0] == 429
    assert 1 <= int(small[1]["Retry-After"]) < int(large[1]["Retry-After"]) <= 60
    assert enforcer.wait_ledger(0)["reserved"] == 0


# Refusals do not leak the ledger (issue 26 item 6): by default (admin.refusal_detail: public) a
# 429 or 413 says its reason and Retry-After only, and no answer carries X-Kvtune-Reserved-Blocks;
# under refusal_detail: ledger the figures go to clients admin.ledger lets read the ledger.
TOKEN_ENV, TOKEN = "KVTUNE_TEST_LEDGER_TOKEN", "s3cret-ledger"


@pytest.mark.parametrize("kind", ["python", "nginx"])
def test_refusals_tell_the_public_the_reason_only(kind, tmp_path, upstream):
    server = _start(kind, tmp_path, upstream, admin=AdminAccess())  # the default: public
    try:
        status, headers, body = server.request("/v1/chat/completions", chat(1))
        assert status == 200 and "X-Kvtune-Reserved-Blocks" not in headers
        assert headers["X-Kvtune-Max-Tokens"] == str(CHAT_CAP)
        status, headers, body = server.request("/v1/chat/completions", chat(1560))  # 102 blocks > 100
        error = json.loads(body)["error"]
        assert status == 413 and error["code"] == "kv_reservation_exceeds_budget"
        assert error["message"] == ("this request needs more KV blocks than this deployment can ever hold: "
                                    "it can never be admitted")
        upstream.hold()
        t, box = in_thread(server.request, "/v1/chat/completions", chat(1536, x_mode="hold"))
        assert server.wait_ledger(100)["reserved"] == 100  # the ledger itself: loopback, as before
        status, headers, body = server.request("/v1/chat/completions", chat(1))
        error = json.loads(body)["error"]
        assert status == 429 and int(headers["Retry-After"]) >= 1 and "X-Kvtune-Reserved-Blocks" not in headers
        assert (error["code"], error["message"]) == ("kv_budget_exhausted", "KV budget full; retry later")
        upstream.release()
        t.join(10)
        assert box["result"][0] == 200 and "X-Kvtune-Reserved-Blocks" not in box["result"][1]
    finally:
        upstream.release()
        server.stop()


@pytest.mark.parametrize("kind", ["python", "nginx"])
def test_refusal_detail_goes_to_the_ledgers_readers_only(kind, tmp_path, upstream, monkeypatch):
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    admin = AdminAccess(ledger=Access.TOKEN, token_env=TOKEN_ENV, refusal_detail=RefusalDetail.LEDGER)
    server = _start(kind, tmp_path, upstream, admin=admin)
    reader = {"Authorization": f"Bearer {TOKEN}"}
    try:
        for headers, detailed in (({}, False), ({"Authorization": "Bearer wrong-token"}, False), (reader, True)):
            status, answer, body = server.request("/v1/chat/completions", chat(1), headers=headers)
            assert status == 200
            assert answer.get("X-Kvtune-Reserved-Blocks") == (str(blocks(1 + 4, CHAT_CAP)) if detailed else None)
            status, answer, body = server.request("/v1/chat/completions", chat(1560), headers=headers)
            message = json.loads(body)["error"]["message"]
            assert status == 413
            assert message == ("this request needs 102 KV blocks but the whole budget is 100: it can never be "
                               "admitted" if detailed else "this request needs more KV blocks than this "
                               "deployment can ever hold: it can never be admitted"), (headers, message)
    finally:
        server.stop()


def test_streams_pass_through_and_client_abort_releases(enforcer, upstream):
    upstream.hold()
    sock = socket.create_connection(("127.0.0.1", enforcer.port), timeout=10)
    payload = json.dumps(chat(100, stream=True, x_mode="hold_stream")).encode()
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 + f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
    received = b""
    while ROLE_EVENT not in received:  # the first event arrives while the upstream still holds
        chunk = sock.recv(4096)
        assert chunk, received
        received += chunk
    assert received.startswith(b"HTTP/1.1 200")
    assert enforcer.ledger()["reserved"] == blocks(100, CHAT_CAP)
    sock.close()  # the client goes away mid-stream
    assert enforcer.wait_ledger(0)["reserved"] == 0
    upstream.release()

    status, _, body = enforcer.request("/v1/chat/completions", chat(5, stream=True, x_chunks=3))
    # the role, 3 tokens, usage and [DONE], whole and in order
    assert status == 200 and body.count(b"data:") == 6 and body.startswith(ROLE_EVENT)
    assert body.endswith(DONE_EVENT)
    assert enforcer.wait_ledger(0)["reserved"] == 0


def test_requests_that_can_never_fit_are_rejected_at_once(enforcer, upstream):
    status, headers, body = enforcer.request("/v1/chat/completions", chat(3000))
    assert status == 400 and "Retry-After" not in headers
    assert _error(body) == "context_length_exceeded"
    # 5 × ceil((500 + 64) / 16) = 180 blocks > the 100-block budget
    status, headers, body = enforcer.request("/v1/chat/completions", chat(500, n=5))
    assert status == 413 and "Retry-After" not in headers
    assert _error(body) == "kv_reservation_exceeds_budget"
    assert upstream.seen == []
    assert enforcer.ledger()["reserved"] == 0


def test_a_huge_batch_is_refused_without_counting_it(enforcer, upstream):
    """2,000 prompts can never fit 100 blocks: refused before a single /tokenize call."""
    status, _, body = enforcer.request("/v1/completions", {"model": "m", "prompt": [f"p{i}" for i in range(2000)]})
    assert status == 413 and _error(body) == "kv_reservation_exceeds_budget"
    assert upstream.tokenize_calls == [] and upstream.seen == []


def test_concurrent_requests_never_exceed_the_budget(enforcer, upstream):
    """12 requests of 17 blocks against 100: some admitted, the rest 429, ledger back to zero."""
    upstream.hold()
    peak = {"reserved": 0}
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak["reserved"] = max(peak["reserved"], enforcer.ledger()["reserved"])
            time.sleep(0.01)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    threads = [in_thread(enforcer.request, "/v1/chat/completions", chat(200, x_mode="hold")) for _ in range(12)]
    deadline = time.monotonic() + 10
    while sum("result" in box for _, box in threads) < 7 and time.monotonic() < deadline:
        time.sleep(0.02)  # 5 × 17 = 85 blocks fit; the other 7 answer 429 at once
    upstream.release()
    for t, _ in threads:
        t.join(15)
    done.set()
    sampler.join(5)
    statuses = sorted(box["result"][0] for _, box in threads)
    assert statuses == [200] * 5 + [429] * 7
    assert peak["reserved"] <= 100
    assert enforcer.wait_ledger(0)["reserved"] == 0


@pytest.fixture(params=["python", "nginx"])
def overcommitted(request, tmp_path, upstream):
    """Either enforcer with admission {policy: overcommit, factor: 2}: reservations against 200 blocks."""
    server = _start(request.param, tmp_path, upstream, admission=AdmissionPolicy.overcommit(2))
    try:
        yield server
    finally:
        server.stop()


def test_overcommit_admits_up_to_k_times_the_budget_then_429s(overcommitted, upstream):
    ledger = overcommitted.ledger()
    assert {k: ledger[k] for k in ("policy", "factor", "epsilon", "limit", "budget", "overflow_probability")} == {
        "policy": "overcommit", "factor": 2.0, "epsilon": None, "limit": 2 * BUDGET, "budget": BUDGET,
        "overflow_probability": None}
    upstream.hold()
    # 1536 prompt + 64 cap = 100 blocks each: two fit 2 x 100, the third does not
    held = [in_thread(overcommitted.request, "/v1/chat/completions", chat(1536, x_mode="hold")) for _ in range(2)]
    assert overcommitted.wait_ledger(200)["reserved"] == 200
    status, headers, body = overcommitted.request("/v1/chat/completions", chat(1536))
    assert status == 429 and int(headers["Retry-After"]) >= 1
    error = json.loads(body)["error"]
    assert error["code"] == "kv_budget_exhausted" and "200 of 200 reserved" in error["message"]
    upstream.release()
    for t, box in held:
        t.join(10)
        assert box["result"][0] == 200
    assert overcommitted.wait_ledger(0)["reserved"] == 0


def test_overcommit_413s_only_what_exceeds_k_times_the_budget(overcommitted, upstream):
    """413 is measured against k x the budget, the limit reservations are held against: a
    180-block request fits an empty 2 x 100 ledger (guaranteed answers it 413), 300 never does."""
    status, headers, _ = overcommitted.request("/v1/chat/completions", chat(500, n=5))
    assert status == 200 and _reserved(headers) == 180
    status, headers, body = overcommitted.request("/v1/chat/completions", chat(1536, n=3))
    assert status == 413 and "Retry-After" not in headers
    error = json.loads(body)["error"]
    assert error["code"] == "kv_reservation_exceeds_budget"
    assert error["message"] == ("this request needs 300 KV blocks but the overcommit limit is 200 (2 x the "
                                "budget 100): it can never be admitted")
    assert overcommitted.wait_ledger(0)["reserved"] == 0


def test_a_failed_count_is_503_never_a_guess(enforcer, upstream):
    """An admission decision is never made on an estimate the config did not ask for."""
    upstream.tokenize_status = 500
    status, headers, body = enforcer.request("/v1/chat/completions", chat(30))
    assert status == 503 and int(headers["Retry-After"]) >= 1
    assert _error(body) == "prompt_count_unavailable"
    assert upstream.seen == [] and enforcer.ledger()["reserved"] == 0


def test_a_count_that_is_no_count_is_502(enforcer, upstream):
    upstream.tokenize_answer = {"count": -5}
    status, _, body = enforcer.request("/v1/chat/completions", chat(30))
    assert status == 502 and _error(body) == "prompt_count_invalid"
    assert upstream.seen == [] and enforcer.ledger()["reserved"] == 0


@pytest.mark.parametrize("kind", ["python", "nginx"])
def test_a_configured_estimate_stands_in_for_a_failed_count(kind, tmp_path, upstream):
    server = _start(kind, tmp_path, upstream, estimate_chars_per_token=3.0, estimate_margin_tokens=64)
    try:
        upstream.tokenize_status = 500
        status, headers, _ = server.request("/v1/chat/completions", chat(30))
        assert status == 200
        # never below the true count: 30 words + the margin
        assert _reserved(headers) >= blocks(30 + 64, CHAT_CAP)
        assert server.wait_ledger(0)["reserved"] == 0
    finally:
        server.stop()


# ---------------------------------------------------------------- bounded clients

def _closed_within(sock: socket.socket, seconds: float) -> tuple[bool, bytes]:
    sock.settimeout(seconds)
    data = b""
    try:
        while True:
            chunk = sock.recv(4096)
            if not chunk:
                return True, data
            data += chunk
    except TimeoutError:
        return False, data
    except ConnectionResetError:
        return True, data


def test_a_head_sent_byte_by_byte_is_cut_at_the_header_timeout(enforcer, upstream):
    sock = socket.create_connection(("127.0.0.1", enforcer.port))
    started = time.monotonic()
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 200
    try:
        for b in head:
            sock.sendall(bytes([b]))
            time.sleep(0.02)
            if time.monotonic() - started > LIMITS.header_timeout_s + 2:
                break
        closed, _ = _closed_within(sock, LIMITS.header_timeout_s + 2)
    except (BrokenPipeError, ConnectionResetError):
        closed = True
    finally:
        sock.close()
    assert closed and time.monotonic() - started < LIMITS.header_timeout_s + 4
    assert upstream.reached() == []


def test_a_body_that_stops_coming_is_cut_at_the_body_timeout(enforcer, upstream):
    sock = socket.create_connection(("127.0.0.1", enforcer.port))
    try:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000\r\n\r\n{\"model\":")
        started = time.monotonic()
        closed, data = _closed_within(sock, LIMITS.body_timeout_s + 3)
    finally:
        sock.close()
    assert closed and time.monotonic() - started < LIMITS.body_timeout_s + 3
    assert data == b"" or data.split(b" ", 2)[1] == b"408"
    assert upstream.reached() == [] and enforcer.ledger()["reserved"] == 0


def test_a_never_ending_chunked_body_is_cut_at_the_size_cap(enforcer, upstream):
    sock = socket.create_connection(("127.0.0.1", enforcer.port), timeout=20)
    try:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n")
        chunk = b"4000\r\n" + b"a" * 0x4000 + b"\r\n"
        sent = 0
        try:
            while sent < 4 * LIMITS.max_body_bytes:
                sock.sendall(chunk)
                sent += 0x4000
        except (BrokenPipeError, ConnectionResetError):
            pass
        closed, data = _closed_within(sock, 10)
    finally:
        sock.close()
    assert closed and (data == b"" or data.split(b" ", 2)[1] == b"413")
    assert upstream.reached() == []


def test_a_body_over_the_cap_is_413(enforcer, upstream):
    status, _, body = enforcer.request("/v1/chat/completions", chat(10, pad="x" * (LIMITS.max_body_bytes + 1)))
    assert status == 413
    assert upstream.reached() == []


def test_a_head_over_the_cap_is_refused(enforcer, upstream):
    many = {f"X-Pad-{i}": "v" * 1000 for i in range(12)}  # 12 KB of fields > the 8 KB head cap
    status, _, _ = enforcer.request("/v1/chat/completions", chat(5), headers=many)
    assert status in (400, 431)
    long_line = {"X-Long": "v" * (LIMITS.max_header_line_bytes + 10)}
    status, _, _ = enforcer.request("/v1/chat/completions", chat(5), headers=long_line)
    assert status in (400, 431)
    assert upstream.reached() == []
    assert enforcer.request("/v1/chat/completions", chat(5))[0] == 200  # and it still serves


def test_many_idle_connections_do_not_stop_it_serving(enforcer, upstream):
    socks = []
    try:
        for _ in range(LIMITS.max_connections + 16):
            try:
                socks.append(socket.create_connection(("127.0.0.1", enforcer.port), timeout=2))
            except OSError:
                break
        for s in socks[: LIMITS.max_connections // 2]:
            s.close()
        time.sleep(0.2)
        assert enforcer.request("/v1/chat/completions", chat(5))[0] == 200
    finally:
        for s in socks:
            s.close()


def _one_keepalive_exchange(sock: socket.socket) -> bytes:
    """Send one small chat request on a kept-alive connection and read its whole answer."""
    body = json.dumps(chat(5)).encode()
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(4096)
    head, _, rest = data.partition(b"\r\n\r\n")
    length = int(re.search(rb"(?i)content-length: *(\d+)", head).group(1))
    while len(rest) < length:
        rest += sock.recv(4096)
    return head


def test_an_idle_kept_alive_connection_is_closed_at_the_keepalive_timeout(enforcer, upstream):
    sock = socket.create_connection(("127.0.0.1", enforcer.port), timeout=5)
    try:
        head = _one_keepalive_exchange(sock)
        assert head.startswith(b"HTTP/1.1 200") and b"connection: close" not in head.lower()
        idle_from = time.monotonic()
        still_open, _ = _closed_within(sock, LIMITS.keepalive_timeout_s / 2)
        assert not still_open  # kept alive for a while: the timeout is not zero
        closed, data = _closed_within(sock, LIMITS.keepalive_timeout_s + 3)
    finally:
        sock.close()
    assert closed and data == b""
    assert LIMITS.keepalive_timeout_s / 2 <= time.monotonic() - idle_from < LIMITS.keepalive_timeout_s + 3


# ---------------------------------------------------------------- statistical admission

# The chat route's measured output lengths: most answers are short, 5 % reach the cap (64).
CHAT_LENGTHS = ([4, 8, 24, 64], [50, 30, 15, 5])
EPSILON = 0.01


def _start_statistical(kind: str, tmp_path, upstream, epsilon: float = EPSILON):
    return _start(kind, tmp_path, upstream, AdmissionPolicy.statistical(epsilon), chat_lengths=CHAT_LENGTHS)


@pytest.fixture(params=["python", "nginx"])
def statistical(request, tmp_path, upstream):
    """Either enforcer with admission {policy: statistical, epsilon: 0.01} and CHAT_LENGTHS."""
    server = _start_statistical(request.param, tmp_path, upstream)
    try:
        yield server
    finally:
        server.stop()


def _oracle(epsilon: float = EPSILON):
    """The Python StatisticalLedger with the chat route's law, as gateway.yaml renders it."""
    from kvtune.domain.demand import Demand
    from kvtune.gateway.statistical import StatisticalLedger
    from kvtune.policy.route_table import route_output_law

    rec = small_rec(0, chat_lengths=CHAT_LENGTHS)
    law = route_output_law(next(r for r in rec.routes if r.cap == CHAT_CAP))
    ledger = StatisticalLedger(BUDGET, epsilon=epsilon, block_size=16, max_model_len=2048)
    return ledger, lambda prompt: Demand((prompt,), CHAT_CAP, law)


def _close(a: float, b: float) -> bool:
    # Python convolves by FFT (exact up to ~1e-15 of rounding), the Lua directly: 1e-9 relative,
    # or 1e-12 absolute for probabilities next to 0
    return abs(a - b) <= max(1e-9 * max(abs(a), abs(b)), 1e-12)


def _held_one_by_one(server, upstream, prompts: list[int], **extra) -> tuple[list[int], list[float]]:
    """Send chat(prompt) for each prompt, one after another, each held by the upstream once
    admitted; the statuses in order and the ledger's overflow_probability after each."""
    statuses, probabilities, threads = [], [], []
    reserved = server.ledger()["reserved"]
    for prompt in prompts:
        t, box = in_thread(server.request, "/v1/chat/completions", chat(prompt, x_mode="hold", **extra))
        threads.append((t, box))
        want = reserved + blocks(prompt, CHAT_CAP)
        deadline = time.monotonic() + 10
        while "result" not in box and server.ledger()["reserved"] != want and time.monotonic() < deadline:
            time.sleep(0.02)
        if "result" in box:
            statuses.append(box["result"][0])
        else:
            statuses.append(200)
            reserved = want
        probabilities.append(server.ledger()["overflow_probability"])
    return statuses, probabilities


def test_statistical_ledger_shows_policy_epsilon_and_probability(statistical):
    ledger = statistical.ledger()
    assert {k: ledger[k] for k in ("policy", "factor", "epsilon", "limit", "overflow_probability", "budget")} == {
        "policy": "statistical", "factor": None, "epsilon": EPSILON, "limit": None, "overflow_probability": 0.0,
        "budget": BUDGET}


def test_statistical_admits_more_than_guaranteed_and_both_enforcers_agree(tmp_path, upstream):
    """chat(200) holds 17 blocks at worst: guaranteed admits 5 of 100 blocks, statistical 7 (their
    answers are mostly short), the 8th and 9th answer 429; both enforcers give the same answers
    and the same overflow probability as the Python ledger computes, to 1e-9."""
    ledger, demand = _oracle()
    expected_statuses, expected = [], []
    for _ in range(9):
        admitted = ledger.try_reserve(blocks(200, CHAT_CAP), demand(200)) is not None
        expected_statuses.append(200 if admitted else 429)
        expected.append(ledger.overflow_probability())
    assert expected_statuses == [200] * 7 + [429] * 2 and 0 < expected[-1] <= EPSILON
    seen = {}
    for kind in ("python", "nginx"):
        server = _start_statistical(kind, tmp_path / kind, upstream)
        try:
            upstream.hold()
            statuses, probabilities = _held_one_by_one(server, upstream, [200] * 9)
            ledger_now = server.ledger()
            assert ledger_now["reserved"] == 7 * blocks(200, CHAT_CAP) > BUDGET  # worst cases past the budget
            upstream.release()
            assert server.wait_ledger(0)["reserved"] == 0
            assert server.ledger()["overflow_probability"] == 0.0
            seen[kind] = (statuses, probabilities)
        finally:
            upstream.release()
            server.stop()
    for kind, (statuses, probabilities) in seen.items():
        assert statuses == expected_statuses, kind
        assert all(_close(a, b) for a, b in zip(probabilities, expected, strict=True)), (kind, probabilities, expected)


# A request that forces its length is priced at what it forces (issue 26 item 2): a field that may
# keep it from ending is priced at its cap (guaranteed's 5 of 9), min_tokens conditions the law
# (length >= 20 leaves the 24 and 64 bins), and stop / stop_token_ids only add ways to end (vLLM
# keeps EOS beside them), so the histogram still prices them (statistical's 7).
FORCING_CASES = {  # the fields sent, and how many of 9 chat(200) are admitted
    "ignore_eos": ({"ignore_eos": True}, 5),
    "logit_bias": ({"logit_bias": {"2": -100}}, 5),
    "logit_bias_up": ({"logit_bias": {"1000": 100}}, 5),
    "bad_words": ({"bad_words": ["</s>"]}, 5),
    "allowed_token_ids": ({"allowed_token_ids": [5, 6, 7]}, 5),
    "min_tokens_past_the_histogram": ({"min_tokens": 48}, 5),
    "min_tokens_string": ({"min_tokens": "30"}, 5),
    "min_tokens_20": ({"min_tokens": 20}, 6),
    "stop_token_ids": ({"stop_token_ids": [7], "stop": ["w3"], "ignore_eos": False, "logit_bias": {}}, 7),
}


@pytest.mark.parametrize("case", list(FORCING_CASES))
@pytest.mark.parametrize("kind", ["python", "nginx"])
def test_statistical_prices_a_forced_length_at_what_it_forces(kind, case, tmp_path, upstream):
    extra, admitted = FORCING_CASES[case]
    server = _start_statistical(kind, tmp_path, upstream)
    try:
        upstream.hold()
        statuses, _ = _held_one_by_one(server, upstream, [200] * 9, **extra)
        assert statuses == [200] * admitted + [429] * (9 - admitted)
    finally:
        upstream.release()
        server.stop()


def test_min_tokens_conditions_the_law_between_guaranteed_and_the_histogram():
    """The oracle of the cases above: min_tokens 20 on CHAT_LENGTHS keeps the 24 and 64 bins (6
    admitted), 48 only the cap's bin (guaranteed's 5); the plain law admits 7."""
    from kvtune.domain.demand import Demand

    plain = _oracle()[1](0).law
    counts = {}
    for name, law in (("plain", plain), ("min20", plain.at_least(20)), ("min48", plain.at_least(48)),
                      ("cap", None)):
        ledger = _oracle()[0]
        counts[name] = sum(ledger.try_reserve(blocks(200, CHAT_CAP), Demand((200,), CHAT_CAP, law)) is not None
                           for _ in range(9))
    assert counts == {"plain": 7, "min20": 6, "min48": 5, "cap": 5}
    assert plain.at_least(65) is None


@pytest.mark.parametrize("kind", ["python", "nginx"])
def test_statistical_epsilon_0_is_guaranteed(kind, tmp_path, upstream):
    """At epsilon 0 the same 9 requests get guaranteed's answers: 5 admitted, then 429."""
    server = _start_statistical(kind, tmp_path, upstream, epsilon=0.0)
    try:
        upstream.hold()
        statuses, probabilities = _held_one_by_one(server, upstream, [200] * 9)
        assert statuses == [200] * 5 + [429] * 4
        assert probabilities == [0.0] * 9
        status, headers, body = server.request("/v1/chat/completions", chat(1560))  # 102 blocks > 100
        assert status == 413 and _error(body) == "kv_reservation_exceeds_budget"
    finally:
        upstream.release()
        server.stop()


def test_statistical_413s_a_request_whose_own_probability_exceeds_epsilon(statistical, upstream):
    """chat(1560) holds 102 blocks at worst, more than the budget: alone it overflows only if its
    answer is long (5 %), which is above epsilon 1 %: it can never be admitted."""
    ledger, demand = _oracle()
    assert ledger.never_fits(blocks(1560, CHAT_CAP), demand(1560))
    assert not ledger.never_fits(blocks(1500, CHAT_CAP), demand(1500))
    status, headers, body = statistical.request("/v1/chat/completions", chat(1560))
    assert status == 413 and "Retry-After" not in headers
    error = json.loads(body)["error"]
    assert error["code"] == "kv_reservation_exceeds_budget"
    assert error["message"] == ("this request needs 102 KV blocks but the whole budget is 100: it can never "
                                "be admitted")
    assert upstream.seen == []
    assert statistical.request("/v1/chat/completions", chat(1500))[0] == 200  # 98 blocks: fits alone
    assert statistical.wait_ledger(0)["reserved"] == 0


def _stream_until(server, prompt: int, tokens: int, hold_after: int | None):
    """A streamed chat(prompt) whose upstream sends `hold_after` token events (None: only the
    first event) and then waits; returns the socket once the client has read them."""
    payload = json.dumps(chat(prompt, stream=True, x_mode="hold_stream", x_chunks=tokens,
                              **({"x_hold_after": hold_after} if hold_after is not None else {}))).encode()
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 + f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
    want = f' w{hold_after - 1}"'.encode() if hold_after else b'"role"'
    received = b""
    while want not in received:
        chunk = sock.recv(65536)
        assert chunk, received
        received += chunk
    return sock


@pytest.mark.parametrize("streamed", [None, 20])
def test_statistical_conditions_on_streamed_tokens_in_both_enforcers(streamed, tmp_path, upstream):
    """A = chat(750) streams; B = chat(750) arrives. While A has streamed nothing, its answer is
    probably short and B is admitted; once A has streamed 20 tokens (past the mark at 16: 4 and 8
    are ruled out), it is more likely long and B is refused. Both enforcers, and the ledger
    probability after A's tokens, the same as the Python ledger's."""
    ledger, demand = _oracle()
    held = ledger.try_reserve(blocks(750, CHAT_CAP), demand(750))
    assert held is not None
    if streamed:
        held.progress(streamed - 2)  # events past the role event; the usage and [DONE] not yet
    expected_probability = ledger.overflow_probability()
    expected = 200 if ledger.try_reserve(blocks(750, CHAT_CAP), demand(750)) is not None else 429
    assert expected == (429 if streamed else 200)
    for kind in ("python", "nginx"):
        server = _start_statistical(kind, tmp_path / kind, upstream)
        try:
            upstream.hold()
            sock = _stream_until(server, 750, CHAT_CAP, streamed)
            assert _close(server.ledger()["overflow_probability"], expected_probability) or (
                server.ledger()["overflow_probability"] == expected_probability == 0.0), kind
            status, _, body = server.request("/v1/chat/completions", chat(750))
            assert status == expected, (kind, body)
            upstream.release()
            sock.settimeout(10)
            while sock.recv(65536):
                pass
            sock.close()
            assert server.wait_ledger(0)["reserved"] == 0
            assert server.ledger()["overflow_probability"] == 0.0
        finally:
            upstream.release()
            server.stop()


def test_statistical_releases_once_on_abort_and_upstream_death(statistical, upstream):
    upstream.hold()
    sock = _stream_until(statistical, 100, CHAT_CAP, 20)
    assert statistical.ledger()["reserved"] == blocks(100, CHAT_CAP)
    sock.close()  # the client goes away mid-stream
    assert statistical.wait_ledger(0)["reserved"] == 0
    upstream.release()
    with pytest.raises(http.client.IncompleteRead):  # the upstream dies half-way: so does the answer
        statistical.request("/v1/chat/completions", chat(5, stream=True, x_mode="die", x_chunks=40))
    assert statistical.wait_ledger(0)["reserved"] == 0
    assert statistical.request("/v1/chat/completions", chat(5, x_mode="500"))[0] == 500
    ledger = statistical.wait_ledger(0)
    assert ledger["reserved"] == 0 and ledger["inflight"] == 0 and ledger["overflow_probability"] == 0.0


def test_statistical_nginx_counts_the_old_workers_reservations_after_a_reload(tmp_path, upstream):
    """The held sequences live in the one worker's memory; after `nginx -s reload` the new worker
    starts without them while the old one drains. It counts what the shared dict says the old one
    still holds at its worst case, so it admits nothing the old reservations leave no room for."""
    import signal

    server = _start_statistical("nginx", tmp_path, upstream)
    try:
        upstream.hold()
        statuses, _ = _held_one_by_one(server, upstream, [200] * 7)
        assert statuses == [200] * 7 and server.ledger()["reserved"] == 7 * blocks(200, CHAT_CAP)
        server.proc.send_signal(signal.SIGHUP)  # reload: a new worker, the old one drains
        time.sleep(1.5)  # the new worker answers from here on (the held requests' clients wait 10 s)
        ledger = server.ledger()
        assert ledger["reserved"] == 7 * blocks(200, CHAT_CAP) and ledger["overflow_probability"] == 1.0
        status, headers, body = server.request("/v1/chat/completions", chat(200))
        assert status == 429 and _error(body) == "kv_budget_exhausted", body
        upstream.release()
        assert server.wait_ledger(0)["reserved"] == 0
        assert server.request("/v1/chat/completions", chat(200))[0] == 200
        assert server.ledger()["overflow_probability"] == 0.0
    finally:
        upstream.release()
        server.stop()


@pytest.mark.parametrize("kind", ["python", "nginx"])
def test_statistical_admits_a_request_past_the_budget_whose_own_probability_is_within_epsilon(kind, tmp_path,
                                                                                                upstream):
    """At epsilon 0.1 the same chat(1560) (102 blocks at worst, 413 under guaranteed) overflows
    alone with probability 5 % only: admitted, and alone it fills the ledger past the budget."""
    ledger, demand = _oracle(0.1)
    assert not ledger.never_fits(blocks(1560, CHAT_CAP), demand(1560))
    server = _start_statistical(kind, tmp_path, upstream, epsilon=0.1)
    try:
        status, headers, _ = server.request("/v1/chat/completions", chat(1560))
        assert status == 200 and _reserved(headers) == 102
        assert server.wait_ledger(0)["reserved"] == 0
    finally:
        server.stop()
