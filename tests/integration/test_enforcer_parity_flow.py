"""Flow control, one behaviour on two enforcers (issue 29): the queue of docs/guides/flow-control.md
in `kvtune gateway` (gateway.yaml `flow:`) and in the rendered nginx.conf (kvtune.flow in Lua),
both rendered from one recommendation and RenderOptions.flow, in front of the same fake vLLM.

Every case of the issue's "Done when": a request that cannot make its deadline is shed at arrival
(429 deadline_unreachable at once, Retry-After from the forecast); waiters are served in priority
order and earliest deadline first; a flooding tenant does not starve another; a lower band's
waiters never hold back a higher band's arrival; a waiter that times out or whose client leaves
holds nothing and is counted once; the ledger and /metrics report it per band and flow.

The budget is 100 blocks of 16 tokens; chat(1536) with the chat cap 64 reserves all 100, so one
such request holds the whole budget and its followers are served one at a time, in the order
the fake engine sees them."""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import time

import pytest
from enforcers import BUDGET, chat, in_thread, small_fake, small_rec, start_enforcer

from kvtune.domain.admission_policy import AdmissionPolicy
from kvtune.domain.flow_control import Band, FlowControl
from kvtune.gateway.config import AdminAccess, RefusalDetail
from kvtune.policy.recommendation import read_recommendation

pytestmark = pytest.mark.slow

# The chat route's measured lengths: 10 and 30 tokens, once each; at cap 64 a request admitted
# just now is expected to produce (10 + 30) / 2 = 20 tokens more.
CHAT_LENGTHS = ([10, 30], [1, 1])
WHOLE = 1536  # prompt words that, with the cap of 64, reserve the whole budget


@pytest.fixture
def upstream():
    with small_fake() as fake:
        yield fake


def _start(kind, tmp_path, upstream, flow: FlowControl, admission: AdmissionPolicy | None = None, **extra):
    rec = small_rec(upstream.port, chat_lengths=CHAT_LENGTHS)
    if admission is not None:
        rec = dataclasses.replace(rec, admission=admission)
    return start_enforcer(kind, rec, tmp_path / "nginx", nginx_worker_processes="2", flow=flow,
                          nginx_user="root" if os.geteuid() == 0 else None,
                          admin=AdminAccess(refusal_detail=RefusalDetail.LEDGER), **extra)


def _flow(token_time_s: float = 0.01, interactive_s: float = 5.0, batch_s: float = 10.0, **extra) -> FlowControl:
    return FlowControl(token_time_s=token_time_s, bands=(Band("interactive", interactive_s), Band("batch", batch_s)),
                       **extra)


@pytest.fixture(params=["python", "nginx"])
def kind(request):
    return request.param


def _hold_all(server, upstream):
    """One request holding the whole budget at the engine until upstream.release()."""
    upstream.hold()
    t, box = in_thread(server.request, "/v1/chat/completions", chat(WHOLE, x_mode="hold"))
    assert server.wait_ledger(BUDGET)["reserved"] == BUDGET
    return t, box


def _waiting(server, n: int, timeout: float = 10) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        ledger = server.ledger()
        if ledger["waiting"] == n or time.monotonic() > deadline:
            assert ledger["waiting"] == n, ledger
            return ledger
        time.sleep(0.02)


def _band(ledger: dict, name: str) -> dict:
    return next(b for b in ledger["flow"]["bands"] if b["name"] == name)


def _code(body: bytes) -> str:
    return json.loads(body)["error"]["code"]


def test_a_request_that_cannot_make_its_deadline_is_shed_at_arrival(kind, tmp_path, upstream):
    """The holder is expected to run 20 tokens x 0.25 s = 5 s more: an interactive request
    (deadline 2 s) is answered 429 at once with Retry-After 5; a batch one (30 s) waits."""
    server = _start(kind, tmp_path, upstream, _flow(token_time_s=0.25, interactive_s=2, batch_s=30))
    try:
        t, box = _hold_all(server, upstream)
        started = time.monotonic()
        status, headers, body = server.request("/v1/chat/completions", chat(1))
        assert time.monotonic() - started < 1.0  # at once, not after waiting in vain
        assert (status, _code(body), headers["Retry-After"]) == (429, "deadline_unreachable", "5")
        assert json.loads(body)["error"]["type"] == "rate_limit_error"
        waiter, answer = in_thread(server.request, "/v1/chat/completions", chat(1),
                                   "POST", 30, {"X-Kvtune-Priority": "batch"})
        ledger = _waiting(server, 1)
        assert _band(ledger, "interactive")["shed"] == 1 and _band(ledger, "batch")["waiting"] == 1
        time.sleep(0.05)  # it waits 50 ms at least
        upstream.release()
        t.join(10)
        waiter.join(10)
        assert box["result"][0] == 200 and answer["result"][0] == 200
        ledger = server.wait_drained()
        assert (ledger["reserved"], ledger["inflight"], ledger["waiting"]) == (0, 0, 0)
        zero = {"waiting": 0, "admitted": 0, "shed": 0, "timed_out": 0}
        assert ledger["flow"] == {"token_time_s": 0.25, "waiting": 0, "flows": 2, "bands": [
            {"name": "interactive", "deadline_s": 2, "reserve_blocks": 0, "kept_blocks": 0, "waiting": 0,
             "admitted": 1, "shed": 1, "timed_out": 0,
             "flows": [{"flow": "anonymous", "waiting": 0, "admitted": 1, "shed": 1, "timed_out": 0}], "other": zero},
            {"name": "batch", "deadline_s": 30, "reserve_blocks": 0, "kept_blocks": 0, "waiting": 0,
             "admitted": 1, "shed": 0, "timed_out": 0,
             "flows": [{"flow": "anonymous", "waiting": 0, "admitted": 1, "shed": 0, "timed_out": 0}], "other": zero}]}
        metrics = _metrics(server)
        assert metrics["kvtune_gateway_flow_shed_total", (("band", "interactive"), ("flow", "anonymous"),
                                                          ("reason", "deadline_unreachable"))] == 1
        assert metrics["kvtune_gateway_flow_shed_total", (("band", "interactive"), ("flow", "anonymous"),
                                                          ("reason", "queue_full"))] == 0
        assert metrics["kvtune_gateway_flow_admitted_total", (("band", "batch"), ("flow", "anonymous"))] == 1
        assert metrics["kvtune_gateway_flow_waiting", (("band", "batch"), ("flow", "anonymous"))] == 0
        assert metrics["kvtune_gateway_flow_wait_seconds_count", (("band", "batch"), ("flow", "anonymous"))] == 1
        # the batch request waited for the holder: more than 5 ms, within its 30 s
        assert metrics["kvtune_gateway_flow_wait_seconds_bucket", (("band", "batch"), ("flow", "anonymous"),
                                                                   ("le", "0.005"))] == 0
        assert metrics["kvtune_gateway_flow_wait_seconds_bucket", (("band", "batch"), ("flow", "anonymous"),
                                                                   ("le", "30.0"))] == 1
    finally:
        upstream.release()
        server.stop()


def _metrics(server) -> dict:
    """/metrics' kvtune_gateway_flow_* samples as {(name, sorted labels): value}, read with
    prometheus_client's own parser (nginx's text must parse as the Python gateway's does)."""
    from prometheus_client.parser import text_string_to_metric_families

    status, _, body = server.request("/metrics", method="GET")
    assert status == 200, body
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(body.decode())
            for s in family.samples if s.name.startswith("kvtune_gateway_flow_")}


def _marked(mark: str, **extra) -> dict:
    return chat(WHOLE, x_id=mark, **extra)


def _served_order(upstream, marks: set[str]) -> list[str]:
    return [b.get("x_id") for b in upstream.seen if b.get("x_id") in marks]


def test_higher_bands_first_then_earliest_deadline(kind, tmp_path, upstream):
    """Waiters arrive batch-1, interactive-1, batch-2, interactive-2, each needing the whole
    budget: once the holder ends they are served interactive-1, interactive-2, batch-1, batch-2."""
    server = _start(kind, tmp_path, upstream, _flow())
    try:
        t, box = _hold_all(server, upstream)
        threads = []
        for i, (mark, band) in enumerate([("b1", "batch"), ("i1", "interactive"), ("b2", "batch"),
                                          ("i2", "interactive")]):
            threads.append(in_thread(server.request, "/v1/chat/completions", _marked(mark), "POST", 30,
                                     {"X-Kvtune-Priority": band}))
            _waiting(server, i + 1)
        upstream.release()
        for thread, answer in threads:
            thread.join(20)
            assert answer["result"][0] == 200, answer["result"]
        t.join(10)
        assert _served_order(upstream, {"b1", "b2", "i1", "i2"}) == ["i1", "i2", "b1", "b2"]
        assert server.wait_drained()["reserved"] == 0
    finally:
        upstream.release()
        server.stop()


def test_a_flooding_tenant_does_not_take_the_whole_budget(kind, tmp_path, upstream):
    """Six waiters of tenant A, then two of tenant B, each needing the whole budget: fair sharing
    serves A, B, A, B, then the rest of A (start tags on reserved blocks), not A six times first."""
    server = _start(kind, tmp_path, upstream, _flow())
    try:
        t, box = _hold_all(server, upstream)
        threads = []
        marks = [("a1", "A"), ("a2", "A"), ("a3", "A"), ("a4", "A"), ("a5", "A"), ("a6", "A"), ("b1", "B"), ("b2", "B")]
        for i, (mark, tenant) in enumerate(marks):
            threads.append(in_thread(server.request, "/v1/chat/completions", _marked(mark), "POST", 30,
                                     {"X-Kvtune-Flow": tenant}))
            _waiting(server, i + 1)
        ledger = server.ledger()
        flows = {f["flow"]: f["waiting"] for f in _band(ledger, "interactive")["flows"]}
        assert flows == {"A": 6, "B": 2, "anonymous": 0}
        upstream.release()
        for thread, answer in threads:
            thread.join(30)
            assert answer["result"][0] == 200, answer["result"]
        t.join(10)
        assert _served_order(upstream, {m for m, _ in marks}) == ["a1", "b1", "a2", "b2", "a3", "a4", "a5", "a6"]
        ledger = server.wait_drained()
        flows = {f["flow"]: (f["admitted"], f["waiting"]) for f in _band(ledger, "interactive")["flows"]}
        assert flows == {"A": (6, 0), "B": (2, 0), "anonymous": (1, 0)}
    finally:
        upstream.release()
        server.stop()


def test_lower_band_waiters_never_hold_back_a_higher_bands_arrival(kind, tmp_path, upstream):
    """Half the budget held, a batch request for all of it waiting: a small interactive request
    is admitted at once, a small batch one waits its turn behind the big one (nobody overtakes)."""
    server = _start(kind, tmp_path, upstream, _flow())
    try:
        upstream.hold()
        half, half_box = in_thread(server.request, "/v1/chat/completions", chat(736, x_mode="hold"))  # 50 blocks
        server.wait_ledger(50)
        big, big_box = in_thread(server.request, "/v1/chat/completions", _marked("big"), "POST", 30,
                                 {"X-Kvtune-Priority": "batch"})
        _waiting(server, 1)
        status, _, body = server.request("/v1/chat/completions", chat(10, x_id="interactive"))
        assert status == 200, body
        small, small_box = in_thread(server.request, "/v1/chat/completions", chat(10, x_id="small"), "POST", 30,
                                     {"X-Kvtune-Priority": "batch"})
        _waiting(server, 2)
        upstream.release()
        for thread in (half, big, small):
            thread.join(20)
        assert half_box["result"][0] == big_box["result"][0] == small_box["result"][0] == 200
        assert _served_order(upstream, {"interactive", "big", "small"}) == ["interactive", "big", "small"]
        assert server.wait_drained()["reserved"] == 0
    finally:
        upstream.release()
        server.stop()


def test_a_batch_request_is_refused_the_reserve_while_an_interactive_one_is_admitted_into_it(kind, tmp_path,
                                                                                            upstream):
    """Trunk reservation (The reserve): interactive keeps 30 of the 100 blocks from batch. With 50
    held, a batch request of 30 (it would leave 20 free) waits; an interactive one of 50 is admitted
    at once, to the last block; when it ends the batch one still waits (50 + 30 would leave 20), and
    is served once the holder ends. The ledger and /metrics show the reserve; every reservation is
    given back once."""
    flow = FlowControl(token_time_s=0.01, bands=(Band("interactive", 5.0, reserve_blocks=30), Band("batch", 10.0)))
    server = _start(kind, tmp_path, upstream, flow)
    try:
        upstream.hold()
        half, half_box = in_thread(server.request, "/v1/chat/completions", chat(736, x_mode="hold"))  # 50 blocks
        server.wait_ledger(50)
        batch, batch_box = in_thread(server.request, "/v1/chat/completions", chat(416, x_id="batch"), "POST", 30,
                                     {"X-Kvtune-Priority": "batch"})  # 30 blocks
        ledger = _waiting(server, 1)
        assert ledger["reserved"] == 50
        assert [(b["reserve_blocks"], b["kept_blocks"]) for b in ledger["flow"]["bands"]] == [(30, 0), (0, 30)]
        status, _, body = server.request("/v1/chat/completions", chat(736, x_id="interactive"))  # 50: all that is left
        assert status == 200, body
        time.sleep(0.3)  # a release and a few of nginx's wake timers later: still waiting
        ledger = _waiting(server, 1)
        assert ledger["reserved"] == 50 and _served_order(upstream, {"batch", "interactive"}) == ["interactive"]
        metrics = _metrics(server)
        assert metrics["kvtune_gateway_flow_kept_blocks", (("band", "batch"),)] == 30
        assert metrics["kvtune_gateway_flow_kept_blocks", (("band", "interactive"),)] == 0
        upstream.release()
        for thread in (half, batch):
            thread.join(20)
        assert half_box["result"][0] == batch_box["result"][0] == 200
        assert _served_order(upstream, {"batch", "interactive"}) == ["interactive", "batch"]
        ledger = server.wait_drained()
        assert (ledger["reserved"], ledger["inflight"], ledger["waiting"]) == (0, 0, 0)
        assert [(b["admitted"], b["shed"], b["timed_out"]) for b in ledger["flow"]["bands"]] == [(2, 0, 0), (1, 0, 0)]
    finally:
        upstream.release()
        server.stop()


def test_a_waiter_that_times_out_holds_nothing_and_is_counted_once(kind, tmp_path, upstream):
    """Deadline 1 s, forecast 0.2 s: it waits, the holder does not end, 429 queue_timeout after
    about a second; nothing of it stays in the ledger, and the engine never sees it."""
    server = _start(kind, tmp_path, upstream, _flow(interactive_s=1.0))
    try:
        t, box = _hold_all(server, upstream)
        started = time.monotonic()
        status, headers, body = server.request("/v1/chat/completions", chat(5, x_id="late"))
        waited = time.monotonic() - started
        assert (status, _code(body)) == (429, "queue_timeout")
        assert 0.9 <= waited < 3.0, waited
        assert 1 <= int(headers["Retry-After"]) <= 60
        ledger = server.ledger()
        assert (ledger["reserved"], ledger["waiting"]) == (BUDGET, 0)
        assert _band(ledger, "interactive")["timed_out"] == 1
        upstream.release()
        t.join(10)
        assert box["result"][0] == 200
        ledger = server.wait_drained()
        assert (ledger["reserved"], ledger["inflight"]) == (0, 0)
        assert _band(ledger, "interactive")["timed_out"] == 1
        assert _served_order(upstream, {"late"}) == []
    finally:
        upstream.release()
        server.stop()


def test_a_waiter_whose_client_leaves_is_taken_out_and_never_forwarded(kind, tmp_path, upstream):
    server = _start(kind, tmp_path, upstream, _flow(interactive_s=30.0))
    try:
        t, box = _hold_all(server, upstream)
        payload = json.dumps(chat(5, x_id="gone")).encode()
        sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     + f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
        _waiting(server, 1)
        sock.close()
        ledger = _waiting(server, 0, timeout=5)  # well before its 30 s deadline
        assert ledger["reserved"] == BUDGET
        band = _band(ledger, "interactive")
        assert (band["timed_out"], band["shed"]) == (0, 0)  # a client gone is counted nowhere
        assert _band(ledger, "batch")["flows"] == []  # a list, empty, in both
        upstream.release()
        t.join(10)
        ledger = server.wait_drained()
        assert (ledger["reserved"], ledger["inflight"], ledger["waiting"]) == (0, 0, 0)
        assert server.request("/v1/chat/completions", chat(5))[0] == 200
        assert _served_order(upstream, {"gone"}) == []
    finally:
        upstream.release()
        server.stop()


def test_queue_bounds_answer_queue_full(kind, tmp_path, upstream):
    server = _start(kind, tmp_path, upstream, _flow(max_waiting_per_flow=1))
    try:
        t, box = _hold_all(server, upstream)
        first, first_box = in_thread(server.request, "/v1/chat/completions", chat(5), "POST", 30,
                                     {"X-Kvtune-Flow": "A"})
        _waiting(server, 1)
        status, headers, body = server.request("/v1/chat/completions", chat(5), headers={"X-Kvtune-Flow": "A"})
        assert (status, _code(body)) == (429, "queue_full") and int(headers["Retry-After"]) >= 1
        # another flow still has room
        other, other_box = in_thread(server.request, "/v1/chat/completions", chat(5), "POST", 30,
                                     {"X-Kvtune-Flow": "B"})
        _waiting(server, 2)
        upstream.release()
        for thread in (t, first, other):
            thread.join(20)
        assert first_box["result"][0] == other_box["result"][0] == 200
        ledger = server.wait_drained()
        flows = {f["flow"]: f["shed"] for f in _band(ledger, "interactive")["flows"]}
        assert flows["A"] == 1 and flows["B"] == 0
    finally:
        upstream.release()
        server.stop()


def test_a_heavier_flow_gets_its_weights_share(kind, tmp_path, upstream):
    """Tenant A of weight 3 and tenant B of weight 1 waiting, each request the whole budget: A is
    served three times for B's once (finish tags grow by blocks / weight)."""
    server = _start(kind, tmp_path, upstream, _flow(weights={"A": 3.0}))
    try:
        t, box = _hold_all(server, upstream)
        threads = []
        marks = [("a1", "A"), ("a2", "A"), ("a3", "A"), ("a4", "A"), ("b1", "B"), ("b2", "B")]
        for i, (mark, tenant) in enumerate(marks):
            threads.append(in_thread(server.request, "/v1/chat/completions", _marked(mark), "POST", 30,
                                     {"X-Kvtune-Flow": tenant}))
            _waiting(server, i + 1)
        upstream.release()
        for thread, answer in threads:
            thread.join(30)
            assert answer["result"][0] == 200, answer["result"]
        t.join(10)
        assert _served_order(upstream, {m for m, _ in marks}) == ["a1", "b1", "a2", "a3", "a4", "b2"]
        assert server.wait_drained()["reserved"] == 0
    finally:
        upstream.release()
        server.stop()


def test_with_two_engine_replicas_a_waiter_is_served_by_a_release_on_either(kind, tmp_path):
    """Replicas of 60 and 90 blocks, both held full: a waiter queues (the forecast reads both
    replicas' requests), is served on the one that releases, and every replica's ledger drains."""

    with small_fake() as a, small_fake() as b:
        doc = json.loads(small_rec(a.port, chat_lengths=CHAT_LENGTHS).to_json())
        doc["upstreams"] = [{"url": a.url, "block_budget": 60, "num_blocks": 70, "capacity_file": "a.json"},
                            {"url": b.url, "block_budget": 90, "num_blocks": 100, "capacity_file": "b.json"}]
        rec = read_recommendation(doc, path="rec")
        server = start_enforcer(kind, rec, tmp_path / "nginx", nginx_worker_processes="2", flow=_flow(),
                                nginx_user="root" if os.geteuid() == 0 else None)
        try:
            a.hold()
            b.hold()
            on_b, on_b_box = in_thread(server.request, "/v1/chat/completions", chat(1376, x_mode="hold"))  # 90
            server.wait_ledger(90)
            on_a, on_a_box = in_thread(server.request, "/v1/chat/completions", chat(896, x_mode="hold"))  # 60
            server.wait_ledger(150)
            waiter, answer = in_thread(server.request, "/v1/chat/completions", chat(5, x_id="waiter"), "POST", 30)
            ledger = _waiting(server, 1)
            assert [u["reserved"] for u in ledger["upstreams"]] == [60, 90]
            a.release()
            on_a.join(10)
            waiter.join(10)
            assert answer["result"][0] == 200 and on_a_box["result"][0] == 200
            assert [c.get("x_id") for c in a.seen][-1] == "waiter"
            b.release()
            on_b.join(10)
            ledger = server.wait_drained()
            assert [(u["reserved"], u["inflight"]) for u in ledger["upstreams"]] == [(0, 0), (0, 0)]
            assert (ledger["reserved"], ledger["waiting"]) == (0, 0)
        finally:
            a.release()
            b.release()
            server.stop()


def test_under_the_statistical_policy_a_refused_request_waits_its_turn(kind, tmp_path, upstream):
    """admission: statistical with flow control: the holder's 96 prompt blocks and its law leave no
    room a bound of 0.01 accepts for a 100-word chat, which waits (nothing is free while the worst
    cases fill the budget, and the holder is expected to end within 0.2 s) and is served when the
    holder ends."""
    server = _start(kind, tmp_path, upstream, _flow(), AdmissionPolicy.statistical(0.01))
    try:
        t, box = _hold_all(server, upstream)
        waiter, answer = in_thread(server.request, "/v1/chat/completions", chat(100, x_id="after"), "POST", 30)
        ledger = _waiting(server, 1)
        assert ledger["policy"] == "statistical" and ledger["reserved"] == BUDGET
        upstream.release()
        t.join(10)
        waiter.join(10)
        assert box["result"][0] == answer["result"][0] == 200
        ledger = server.wait_drained()
        assert (ledger["reserved"], ledger["inflight"], ledger["waiting"]) == (0, 0, 0)
        assert _band(ledger, "interactive")["admitted"] == 2
    finally:
        upstream.release()
        server.stop()


@pytest.fixture(scope="module", params=["python", "nginx"])
def shared(request, tmp_path_factory):
    """One enforcer per kind for the header cases (the chat route in the default band, completions
    in batch), read by the difference each request makes to the ledger's counts."""
    with small_fake() as fake:
        server = _start(request.param, tmp_path_factory.mktemp("flow"), fake, _flow(),
                        route_bands={"/v1/completions": "batch"})
        try:
            yield server
        finally:
            server.stop()


def _admitted(server) -> dict[tuple[str, str], int]:
    return {(b["name"], f["flow"]): f["admitted"] for b in server.ledger()["flow"]["bands"] for f in b["flows"]}


def _one_more(server, path: str, headers: dict) -> set[tuple[str, str]]:
    """The (band, flow) whose admitted count one request of `path` raised."""
    before = _admitted(server)
    body = chat(5) if path == "/v1/chat/completions" else {"model": "m", "prompt": "w w w"}
    assert server.request(path, body, headers=headers)[0] == 200
    after = _admitted(server)
    return {key for key, n in after.items() if n != before.get(key, 0)}


@pytest.mark.parametrize("path, priority, band", [
    ("/v1/chat/completions", None, "interactive"),       # the default band
    ("/v1/chat/completions", "batch", "batch"),
    ("/v1/chat/completions", " batch\t", "batch"),        # spaces and tabs around it stripped
    ("/v1/chat/completions", "Batch", "interactive"),     # names are exact: unknown, so the route's
    ("/v1/chat/completions", "", "interactive"),
    ("/v1/completions", None, "batch"),                   # the route's band
    ("/v1/completions", "interactive", "interactive"),    # the header names one: it wins
    ("/v1/completions", "bulk", "batch"),                 # an unknown value: the route's
])
def test_the_band_is_the_headers_else_the_routes_else_the_default(shared, path, priority, band):
    headers = {} if priority is None else {"X-Kvtune-Priority": priority}
    assert _one_more(shared, path, headers) == {(band, "anonymous")}


@pytest.mark.parametrize("value, flow", [
    ("tenant-a", "tenant-a"),
    ("  tenant-a\t", "tenant-a"),                 # stripped
    ("t" * 128, "t" * 128),
    ("t" * 129, "anonymous"),                     # too long
    ("a\tb", "anonymous"),                        # a tab inside is no printable ASCII
    ("é".encode().decode("latin-1"), "anonymous"),  # nor is UTF-8
    ("", "anonymous"),
])
def test_the_flow_headers_value_names_the_flow_when_it_is_printable_ascii(shared, value, flow):
    assert _one_more(shared, "/v1/chat/completions", {"X-Kvtune-Flow": value}) == {("interactive", flow)}


@pytest.mark.parametrize("authorization, flow", [
    ("Bearer sk-tenant-one", "key-"),
    ("bearer   sk-tenant-one  ", "key-"),   # the scheme in any case, the token stripped
    ("Basic dXNlcjpwYXNz", "anonymous"),
    ("Bearer", "anonymous"),
    (None, "anonymous"),
])
def test_a_flow_without_its_header_is_the_api_keys_hash(shared, authorization, flow):
    import hashlib

    if flow == "key-":
        flow = "key-" + hashlib.sha1(b"sk-tenant-one").hexdigest()[:16]
    headers = {} if authorization is None else {"Authorization": authorization}
    assert _one_more(shared, "/v1/chat/completions", headers) == {("interactive", flow)}
    assert "sk-tenant-one" not in json.dumps(shared.ledger())
