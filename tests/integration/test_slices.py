"""The static slice arithmetic of --nginx-replicas (kvtune.deploy.slices)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvtune.deploy.slices import MAX_NGINX_REPLICAS, blocks_for_context, check_slice, slice_blocks
from kvtune.errors import OptionError
from kvtune.gateway.config import AdminAccess, RefusalDetail
from kvtune.policy.recommendation import read_recommendation


@given(st.integers(0, 10**12), st.integers(1, MAX_NGINX_REPLICAS))
def test_slices_never_add_up_to_more_than_the_budget_and_waste_less_than_one_each(budget, m):
    share = slice_blocks(budget, m)
    assert share * m <= budget < (share + 1) * m


@given(st.integers(1, 10**9), st.integers(1, 64), st.integers(1, 10**6), st.integers(1, MAX_NGINX_REPLICAS))
def test_a_slice_is_accepted_exactly_when_it_holds_one_whole_context_request(budget, block_size, context, m):
    need = -(-context // block_size)
    assert blocks_for_context(context, block_size) == need and (need - 1) * block_size < context <= need * block_size
    if budget // m >= need:
        assert check_slice(budget, m, max_model_len=context, block_size=block_size) == budget // m
    else:
        with pytest.raises(OptionError) as caught:
            check_slice(budget, m, max_model_len=context, block_size=block_size)
        assert caught.value.field == "--nginx-replicas"
        most = max(1, budget // need)
        assert f"use at most {most} nginx replicas" in str(caught.value)


@pytest.mark.parametrize("m", [0, MAX_NGINX_REPLICAS + 1])
def test_nginx_replicas_out_of_range_is_refused(m):
    with pytest.raises(OptionError, match=f"must be from 1 to {MAX_NGINX_REPLICAS}, got {m}"):
        slice_blocks(100, m)


# ---------------------------------------------------------------- nginx.conf with --nginx-replicas

def _rec(budget: int = 26999):
    import json as json_

    from recs import rec_dict


    doc = rec_dict()
    doc["block_budget"]["value"] = budget
    return read_recommendation(json_.loads(json_.dumps(doc)), path="recommendation.json")


def test_three_nginx_replicas_render_a_third_each_with_the_trade_off_in_the_header_and_check_reads_it_back():
    from kvtune.deploy.check import Severity, check_deployment
    from kvtune.deploy.read import parse_deployed
    from kvtune.deploy.render import RenderOptions, render_files

    rec = _rec()
    one = render_files(rec, targets=["nginx.conf"])["nginx.conf"]
    text = render_files(rec, targets=["nginx.conf"], options=RenderOptions(nginx_replicas=3))["nginx.conf"]
    assert "nginx_replicas" not in one and "1/3" not in one
    assert "# this nginx holds 1/3 of the engine's budget: 3 nginx replicas (--nginx-replicas) each hold" in text
    assert "floor(26999 / 3) = 8999 blocks" in text and "(3 x 8999 = 26997 <= 26999)" in text
    assert "a request bigger than a slice is refused (413) even though" in text
    assert "idle slices on one nginx cannot be used by another" in text and "Redis ledger" in text
    assert "block_budget = 8999," in text and "admit_limit = 8999," in text and "nginx_replicas = 3," in text
    d = parse_deployed(text, source="nginx.conf")
    assert (d.block_budget, d.gateway_replicas) == (8999, 3)
    assert parse_deployed(one, source="nginx.conf").gateway_replicas == 1
    result = check_deployment([d], rec)
    assert [f.code for f in result.findings if f.severity is not Severity.INFO] == []
    # slices edited up so that 3 of them pass the engine's capacity: held to it, per upstream
    over = parse_deployed(text.replace("block_budget = 8999,", "block_budget = 12000,"), source="nginx.conf")
    risks = [f for f in check_deployment([over], rec).findings if f.severity is Severity.RISK]
    assert [f.code for f in risks] == ["budget-over-capacity"]
    assert "3 nginx replicas x slice 12000 = block budget 36000" in risks[0].message


def test_a_slice_below_one_whole_context_request_is_refused_naming_the_option():
    from kvtune.deploy.render import RenderOptions, render_files

    rec = _rec()
    need = -(-rec.max_model_len // rec.capacity.block_size)
    most = rec.budget_blocks // need
    render_files(rec, targets=["nginx.conf"], options=RenderOptions(nginx_replicas=most))
    with pytest.raises(OptionError) as caught:
        render_files(rec, targets=["nginx.conf"], options=RenderOptions(nginx_replicas=most + 1))
    assert caught.value.field == "--nginx-replicas" and f"use at most {most} nginx replicas" in str(caught.value)


def test_real_nginx_holds_only_its_slice_and_refuses_what_is_bigger_than_it(tmp_path):
    import json as json_
    import os

    from enforcers import chat, small_fake, small_rec, start_enforcer, words


    with small_fake() as fake:
        doc = json_.loads(small_rec(fake.port).to_json())
        doc["block_budget"]["value"], doc["capacity"]["num_blocks"] = 400, 450
        rec = read_recommendation(doc, path="rec")
        server = start_enforcer("nginx", rec, tmp_path / "nginx", nginx_replicas=3, nginx_worker_processes="1",
                                nginx_user="root" if os.geteuid() == 0 else None,
                                admin=AdminAccess(refusal_detail=RefusalDetail.LEDGER))
        try:
            ledger = server.ledger()
            assert (ledger["budget"], ledger["limit"], ledger["reserved"]) == (133, 133, 0)
            assert server.request("/v1/chat/completions", chat(10))[0] == 200
            # 2 x ceil((1000 + 64) / 16) = 134 blocks: over the slice of 133, within the engine's 400
            status, _, body = server.request("/v1/chat/completions", {"model": "m", "n": 2, "messages": [
                {"role": "user", "content": words(1000)}]})
            assert status == 413, body
            assert b"the whole budget is 133" in body
            assert server.wait_ledger(0)["reserved"] == 0
        finally:
            server.stop()


def test_real_nginx_spreads_by_free_budget_over_two_engines_and_releases_once_where_reserved(tmp_path):
    import json as json_
    import os
    import socket
    import time
    from concurrent.futures import ThreadPoolExecutor

    from enforcers import chat, small_fake, small_rec, start_enforcer


    with small_fake() as a, small_fake() as b, ThreadPoolExecutor(24) as pool:
        doc = json_.loads(small_rec(a.port).to_json())
        doc["upstreams"] = [{"url": a.url.rstrip("/"), "block_budget": 60, "num_blocks": 70, "capacity_file": "a.json"},
                            {"url": b.url.rstrip("/"), "block_budget": 30, "num_blocks": 40, "capacity_file": "b.json"}]
        rec = read_recommendation(doc, path="rec")
        server = start_enforcer("nginx", rec, tmp_path / "nginx", nginx_worker_processes="2",
                                nginx_user="root" if os.geteuid() == 0 else None)
        try:
            def held(i: int):
                return pool.submit(server.request, "/v1/chat/completions", chat(10, x_mode="hold"), timeout=20)

            pending = []
            for i in range(8):  # 5 blocks each; one at a time so the order is the ledger's
                pending.append(held(i))
                server.wait_ledger(5 * (i + 1))
            ups = server.ledger()["upstreams"]
            # free 60 vs 30: six go to a; at 30 each the tie goes to b (fewer in flight); then a again
            assert [(u["budget"], u["reserved"], u["inflight"]) for u in ups] == [(60, 35, 7), (30, 5, 1)]
            # the ledger reserves before nginx proxies: the engines see each request a moment later
            deadline = time.monotonic() + 10
            while (a.active, b.active) != (7, 1) and time.monotonic() < deadline:
                time.sleep(0.02)
            assert (a.active, b.active) == (7, 1)
            for i in range(8, 18):
                pending.append(held(i))
                server.wait_ledger(5 * (i + 1))
            status, headers, _ = server.request("/v1/chat/completions", chat(10))
            assert status == 429 and int(headers["Retry-After"]) >= 1
            ledger = server.ledger()
            assert [u["reserved"] for u in ledger["upstreams"]] == [60, 30] and ledger["reserved"] == 90
            a.release()
            b.release()
            assert [f.result()[0] for f in pending] == [200] * 18
            assert server.wait_drained()["inflight"] == 0
            # an upstream 500, and a client gone while its request is held: each released once
            assert server.request("/v1/chat/completions", chat(10, x_mode="500"))[0] == 500
            assert [u["reserved"] for u in server.wait_drained()["upstreams"]] == [0, 0]
            a.hold()
            b.hold()
            body = json_.dumps(chat(10, x_mode="hold")).encode()
            with socket.create_connection(("127.0.0.1", server.port), timeout=5) as conn:
                conn.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                             b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
                server.wait_ledger(5)
            ledger = server.wait_drained()
            assert ledger["inflight"] == 0 and [u["inflight"] for u in ledger["upstreams"]] == [0, 0]
            assert [u["reserved"] for u in ledger["upstreams"]] == [0, 0]
        finally:
            a.release()
            b.release()
            server.stop()


def test_two_measured_engines_sliced_for_three_nginx_render_each_slice_and_check_holds_each_to_its_own():
    from recs import rec_dict

    from kvtune.deploy.check import Severity, check_deployment
    from kvtune.deploy.read import parse_deployed
    from kvtune.deploy.render import RenderOptions, render_files

    upstreams = [{"url": "http://10.0.0.7:8000", "block_budget": 26999, "num_blocks": 30000, "capacity_file": "a.json"},
                 {"url": "http://10.0.0.8:8000", "block_budget": 40499, "num_blocks": 45000, "capacity_file": "b.json"}]
    rec = read_recommendation({**rec_dict(), "upstreams": upstreams}, path="recommendation.json")
    text = render_files(rec, targets=["nginx.conf"], options=RenderOptions(nginx_replicas=3))["nginx.conf"]
    assert "#   http://10.0.0.7:8000: budget 8999 blocks (a.json), this nginx's slice of floor(26999 / 3)" in text
    assert "#   http://10.0.0.8:8000: budget 13499 blocks (b.json), this nginx's slice of floor(40499 / 3)" in text
    assert "# this nginx holds 1/3 of each engine's budget: 3 nginx replicas" in text and "Redis ledger" in text
    d = parse_deployed(text, source="nginx.conf")
    assert [(u.url, u.block_budget) for u in d.upstreams] == [("http://10.0.0.7:8000", 8999),
                                                              ("http://10.0.0.8:8000", 13499)]
    assert d.gateway_replicas == 3
    assert [f.code for f in check_deployment([d], rec).findings if f.severity is not Severity.INFO] == []
    # b's slice edited up to 3 x 16000 = 48000 blocks, past its 45000: a risk on b alone
    over = parse_deployed(text.replace("block_budget = 13499,", "block_budget = 16000,"), source="nginx.conf")
    risks = [f for f in check_deployment([over], rec).findings if f.severity is Severity.RISK]
    assert [f.code for f in risks] == ["budget-over-capacity"] and "upstream http://10.0.0.8:8000" in risks[0].message
    assert "3 nginx replicas x slice 16000 = block budget 48000" in risks[0].message
