"""The rendered nginx.conf's health ejection with several engine replicas, on a real nginx with Lua
in front of two fake vLLMs on loopback (tests/support/fake_vllm.py): one worker probes GET /health on
every replica from a Lua timer; a replica that is stopped, answers 503 or answers too late is
taken out with its budget (its ledger entry healthy: false) and comes back on a 200; a failed
connect when proxying takes it out at once; with every replica out a governed request answers 503
with Retry-After, not 429. As kvtune gateway's pool does (test_gateway_upstreams.py)."""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from enforcers import Nginx, chat, small_fake, small_rec, start_enforcer
from fake_vllm import FakeVllm

from kvtune.gateway.admin import EVERY_UPSTREAM_DOWN
from kvtune.gateway.config import HealthProbe
from kvtune.policy.recommendation import read_recommendation

DEFAULT = HealthProbe()  # gateway.yaml's: every 1 s, within 1 s
FAST = HealthProbe(interval_s=0.2, timeout_s=0.2)
# for a test whose claim is what an answer said: on a loaded host the fake may take longer than
# 0.2 s to answer, and "no answer within 0.2 s" would take the upstream out first
PATIENT = HealthProbe(interval_s=0.2, timeout_s=2.0)


@contextmanager
def nginx_over(a: FakeVllm, b: FakeVllm, prefix: Path, health: HealthProbe = DEFAULT, *, workers: str = "2",
               host: str | None = None) -> Iterator[Nginx]:
    """nginx.conf rendered for a (60 blocks) and b (90 blocks: the most free, so first while in),
    by their URLs or as `host`:port, running until the block ends."""
    doc = json.loads(small_rec(a.port).to_json())
    urls = [f.url if host is None else f"http://{host}:{f.port}" for f in (a, b)]
    doc["upstreams"] = [{"url": urls[0], "block_budget": 60, "num_blocks": 70, "capacity_file": "a.json"},
                        {"url": urls[1], "block_budget": 90, "num_blocks": 100, "capacity_file": "b.json"}]
    rec = read_recommendation(doc, path="rec")
    server = start_enforcer("nginx", rec, prefix, nginx_worker_processes=workers, health=health,
                            nginx_user="root" if os.geteuid() == 0 else None)
    try:
        yield server
    finally:
        server.stop()


def on_fake(fake: FakeVllm, step: Callable) -> None:
    """Stop or start a fake run by `with` on its own loop: stopped, its port refuses; started
    again, it listens on the same port."""
    asyncio.run_coroutine_threadsafe(step(), fake._loop).result(15)


def wait_health(server: Nginx, healthy: list[bool], timeout: float = 5.0) -> tuple[float, dict]:
    """Seconds until the ledger's upstreams show `healthy`, and that ledger."""
    start = time.monotonic()
    while True:
        ledger = server.ledger()
        if [u["healthy"] for u in ledger["upstreams"]] == healthy:
            return time.monotonic() - start, ledger
        assert time.monotonic() - start < timeout, ledger
        time.sleep(0.02)


def test_a_stopped_upstream_is_taken_out_within_2s_and_used_again_once_it_is_back(tmp_path):
    # the default probe: every 1 s
    with small_fake() as a, small_fake() as b, nginx_over(a, b, tmp_path / "nginx") as server:
        assert "every 1.0 s" in server.conf.read_text() and "deadline of 1.0 s" in server.conf.read_text()
        ledger = server.ledger()
        assert [u["healthy"] for u in ledger["upstreams"]] == [True, True] and ledger["budget"] == 150
        assert server.request("/v1/chat/completions", chat(10))[0] == 200
        assert (len(a.engine_calls), len(b.engine_calls)) == (0, 1)  # b has the most free
        on_fake(b, b._stop)
        took, ledger = wait_health(server, [True, False])
        assert took < 2.0
        down = ledger["upstreams"][1]
        assert down["ejections"] == 1 and "GET /health failed: cannot connect" in down["why"]
        assert ledger["budget"] == 60 and ledger["limit"] == 60  # its budget went out with it
        for _ in range(5):
            status, headers, body = server.request("/v1/chat/completions", chat(10))
            assert status == 200, body
        assert (len(a.engine_calls), len(b.engine_calls)) == (5, 1)
        on_fake(b, b._start)
        took, ledger = wait_health(server, [True, True])
        assert took < 2.0 and ledger["budget"] == 150 and ledger["upstreams"][1]["why"] is None
        assert server.request("/v1/chat/completions", chat(10))[0] == 200
        assert (len(a.engine_calls), len(b.engine_calls)) == (5, 2)  # b again
        assert server.wait_drained()["inflight"] == 0
        assert "upstream " + b.url + " taken out" in server.error_log() and " is back" in server.error_log()


def test_an_upstream_answering_health_503_is_out_until_it_answers_200(tmp_path):
    with small_fake() as a, small_fake() as b, nginx_over(a, b, tmp_path / "nginx", PATIENT) as server:
        b.health_status = 503
        _, ledger = wait_health(server, [True, False], timeout=2)
        assert ledger["upstreams"][1]["why"] == "GET /health answered 503"
        for _ in range(3):
            assert server.request("/v1/chat/completions", chat(10))[0] == 200
        assert (len(a.engine_calls), len(b.engine_calls)) == (3, 0)
        b.health_status = 200
        wait_health(server, [True, True], timeout=2)
        assert server.request("/v1/chat/completions", chat(10))[0] == 200
        assert len(b.engine_calls) == 1
        calls = b.health_calls
        time.sleep(0.5)
        assert 1 <= b.health_calls - calls <= 4  # one worker probes, every 0.2 s


def test_an_upstream_that_answers_health_too_late_is_taken_out(tmp_path):
    with small_fake() as a, small_fake() as b, nginx_over(a, b, tmp_path / "nginx", FAST) as server:
        b.delay_s = 1.0  # accepts, answers nothing within 0.2 s
        _, ledger = wait_health(server, [True, False], timeout=2)
        assert ledger["upstreams"][1]["why"] == "GET /health gave no answer within 0.2 s"
        b.delay_s = 0.0
        wait_health(server, [True, True], timeout=3)


def test_with_every_upstream_out_a_governed_request_answers_503_with_retry_after(tmp_path):
    with small_fake() as a, small_fake() as b, nginx_over(a, b, tmp_path / "nginx", FAST) as server:
        a.health_status = b.health_status = 503  # both still serve: only health says no
        _, ledger = wait_health(server, [False, False], timeout=2)
        assert (ledger["budget"], ledger["limit"], ledger["reserved"]) == (0, 0, 0)
        assert ledger["budget_note"] == EVERY_UPSTREAM_DOWN  # the Python gateway's words
        for _ in range(3):
            status, headers, body = server.request("/v1/chat/completions", chat(10))
            assert status == 503 and int(headers["Retry-After"]) >= 1, body
            error = json.loads(body)["error"]
            assert (error["code"], error["type"]) == ("no_healthy_upstream", "server_error")
            assert error["message"].startswith("every upstream is taken out")
        assert (len(a.engine_calls), len(b.engine_calls), len(a.count_calls), len(b.count_calls)) == (0, 0, 0, 0)
        assert server.ledger()["reserved"] == 0
        # stopped too: the same answer
        on_fake(a, a._stop)
        on_fake(b, b._stop)
        status, headers, body = server.request("/v1/chat/completions", chat(10))
        assert status == 503 and "Retry-After" in headers
        assert json.loads(body)["error"]["code"] == "no_healthy_upstream"
        on_fake(a, a._start)
        a.health_status = 200
        wait_health(server, [True, False], timeout=2)
        assert server.request("/v1/chat/completions", chat(10))[0] == 200
        assert len(a.engine_calls) == 1


@pytest.mark.parametrize("workers", ["1", "2"])
def test_a_refused_connection_when_proxying_takes_the_upstream_out_at_once(tmp_path, workers):
    # probes an hour apart: only the request itself finds b gone
    with small_fake() as a, small_fake() as b, nginx_over(a, b, tmp_path / "nginx", HealthProbe(interval_s=3600),
                                                          workers=workers) as server:
        on_fake(b, b._stop)
        status, _, body = server.request("/v1/chat/completions", chat(10))
        assert status == 502, body  # held on b, nginx could not connect: nothing was sent
        _, ledger = wait_health(server, [True, False], timeout=2)  # in the log phase, after the answer
        ledger = server.wait_ledger(0)
        assert "cannot connect to the upstream (nginx answered 502)" in ledger["upstreams"][1]["why"]
        assert [u["reserved"] for u in ledger["upstreams"]] == [0, 0] and ledger["inflight"] == 0
        for _ in range(3):
            assert server.request("/v1/chat/completions", chat(10))[0] == 200
        assert len(a.engine_calls) == 3


def test_upstreams_named_by_host_name_are_probed_at_the_addresses_the_name_resolves_to(tmp_path):
    with small_fake() as a, small_fake() as b, nginx_over(a, b, tmp_path / "nginx", PATIENT, workers="1",
                                                          host="localhost") as server:
        b.health_status = 503
        _, ledger = wait_health(server, [True, False], timeout=2)
        assert ledger["upstreams"][1]["why"] == "GET /health answered 503"
        assert a.health_calls >= 1 and a.other[-1].headers["Host"] == f"localhost:{a.port}"
        assert server.request("/v1/chat/completions", chat(10))[0] == 200 and len(a.engine_calls) == 1


def test_one_upstream_is_never_probed_and_the_probe_options_are_checked(tmp_path):
    import subprocess

    from recs import rec_dict

    from kvtune.deploy.render import RenderOptions, render_files
    from kvtune.errors import OptionError

    rec = read_recommendation(rec_dict())
    one = render_files(rec, targets=["nginx.conf"])["nginx.conf"]
    # every worker starts the refusal log's timer; only several upstreams start the probe's
    assert 'require("kvtune_gateway").watch_health()' not in one and "health = {" not in one
    assert 'require("kvtune_gateway").watch_refusals()' in one
    # https engines named by host name, a probe of its own: rendered alike in gateway.yaml
    doc = {**rec_dict(), "upstream": "https://localhost:8443"}
    probe = HealthProbe(interval_s=0.5, timeout_s=0.25, path="/ping")
    files = render_files(read_recommendation(doc), targets=["nginx.conf", "gateway.yaml"],
                         options=RenderOptions(replicas=2, health=probe, listen_port=18080))
    conf = files["nginx.conf"]
    assert "GET /ping every 0.5 s" in conf and "one deadline of 0.25 s" in conf
    assert 'path = "/ping", https = true' in conf and "init_worker_by_lua_block" in conf
    assert "health:\n  interval_s: 0.5\n  timeout_s: 0.25\n  path: \"/ping\"" in files["gateway.yaml"]
    server = Nginx(tmp_path, conf, 0)
    result = subprocess.run(server.args("-t"), capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr  # init_by_lua resolved localhost
    for bad, field in [(HealthProbe(interval_s=0.01), "health"), (HealthProbe(path="/a/../b"), "health.path")]:
        with pytest.raises(OptionError) as caught:
            render_files(rec, targets=["nginx.conf"], options=RenderOptions(replicas=2, health=bad))
        assert caught.value.field == field
