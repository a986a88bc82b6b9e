"""The bench client against the fake vLLM on loopback (tests/support/fake_vllm.py): SSE parsing, outcomes,
timings."""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import pytest
from fake_vllm import TEMPLATED, FakeVllm
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtune.bench.client import SSEDecoder, Target, build_body, parse_retry_after, send_request
from kvtune.domain.retry_policy import RetryPolicy
from kvtune.workload.requests import Outcome, RequestSpec

# ---------------------------------------------------------------------------------------------
# SSE decoding


def test_sse_events_split_mid_line_and_many_per_chunk():
    d = SSEDecoder()
    assert d.feed(b'data: {"a"') == []
    assert d.feed(b': 1}\n') == []
    assert d.feed(b'\ndata: {"b": 2}\n\ndata: [DO') == [b'{"a": 1}', b'{"b": 2}']
    assert d.feed(b'NE]\n\n') == [b"[DONE]"]


def test_sse_crlf_comments_multiline_and_no_space():
    d = SSEDecoder()
    stream = b": keep-alive\r\n\r\ndata:x\r\ndata: y\r\nevent: ignored\r\n\r\ndata: z\n\n"
    assert d.feed(stream) == [b"x\ny", b"z"]


def test_sse_close_flushes_an_event_without_its_blank_line():
    d = SSEDecoder()
    assert d.feed(b"data: last") == []
    assert d.close() == [b"last"]
    assert d.close() == []


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=200), max_size=12))
def test_sse_any_chunking_gives_the_same_events(cuts):
    events = [json.dumps({"i": i, "t": "x" * i}).encode() for i in range(5)] + [b"[DONE]"]
    stream = b"".join(b"data: " + e + (b"\r\n\r\n" if i % 2 else b"\n\n") for i, e in enumerate(events))
    points = sorted({min(c, len(stream)) for c in cuts})
    pieces = [stream[a:b] for a, b in zip([0, *points], [*points, len(stream)], strict=True)]
    d = SSEDecoder()
    got = [e for p in pieces for e in d.feed(p)] + d.close()
    assert got == events


def test_retry_after_forms():
    assert parse_retry_after("2", 1.0) == 2.0
    assert parse_retry_after("0.5", 1.0) == 0.5
    assert parse_retry_after(None, 1.5) == 1.5
    assert parse_retry_after("soon", 1.5) == 1.5
    assert parse_retry_after("Wed, 21 Oct 2015 07:28:00 GMT", 1.5) == 0.0  # in the past
    assert parse_retry_after("-3", 1.0) == 0.0


def test_body_forces_length_and_streams_usage():
    spec = RequestSpec(0, "r", 10, 7, "a b c")
    chat = json.loads(build_body(Target("http://x", "m", "chat"), spec))
    assert chat["max_tokens"] == 7 and chat["ignore_eos"] is True and chat["stream"] is True
    assert chat["stream_options"] == {"include_usage": True}
    assert chat["messages"] == [{"role": "user", "content": "a b c"}]
    plain = json.loads(build_body(Target("http://x", "m", "completions", ignore_eos=False), spec))
    assert plain["prompt"] == "a b c" and "ignore_eos" not in plain


def test_body_with_min_tokens_declares_no_max_tokens():
    spec = RequestSpec(0, "/r", 3, 7, "a b c")
    body = json.loads(build_body(Target("http://x", "m", "chat", length_control="min-tokens", eos_token_id=2), spec))
    assert body["min_tokens"] == 6 and body["logit_bias"] == {"2": 100}  # EOS is the 7th token
    assert "max_tokens" not in body and "ignore_eos" not in body  # ignore_eos would never stop
    one = json.loads(build_body(Target("http://x", "m", "completions", length_control="min-tokens",
                                       eos_token_id=9), RequestSpec(0, "/r", 3, 1, "a")))
    assert one["min_tokens"] == 0 and one["logit_bias"] == {"9": 100} and one["prompt"] == "a"
    with pytest.raises(ValueError):
        build_body(Target("http://x", "m", length_control="min-tokens"), spec)


# ---------------------------------------------------------------------------------------------
# Against the server


def spec(output_tokens: int = 5, index: int = 0) -> RequestSpec:
    return RequestSpec(index, "/r", 7, output_tokens, "one two three")


def fake(**steer) -> FakeVllm:
    """The fake with vLLM's chat template and BOS counted, as the bench reasons."""
    return FakeVllm(tokens=TEMPLATED, **steer)


NO_RETRY_POLICY_GIVEN = RetryPolicy()


async def one(server: FakeVllm, *, endpoint="chat", timeout_s=10.0, retry=NO_RETRY_POLICY_GIVEN, output_tokens=5):
    async with server, aiohttp.ClientSession() as session:
        return await send_request(session, Target(server.url, "fake", endpoint), spec(output_tokens),
                                  timeout_s=timeout_s, retry=retry)


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
@pytest.mark.parametrize("mode", ["plain", "split_lines", "batch_events"])
def test_stream_ok_counts_tokens_from_usage(endpoint, mode):
    server = fake(split_lines=mode == "split_lines", batch_events=mode == "batch_events")
    r = asyncio.run(one(server, endpoint=endpoint, output_tokens=6))
    assert r.outcome is Outcome.OK and r.status == 200
    assert r.output_tokens == 6 and r.finish_reason == "length"
    assert r.prompt_tokens == (2 + 2 + 3 if endpoint == "chat" else 1 + 3)
    assert r.text_chunks == 6 and len(r.itl_ms) == 5
    assert r.ttft_ms is not None and r.e2e_ms >= r.ttft_ms


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_tokens_without_text_still_give_a_ttft(endpoint):
    """A random-weight model can emit tokens that decode to nothing; the server then sends only the
    finishing chunk, which is the first sign of output (seen on the live CPU vLLM: 23 of 24 TTFTs)."""
    r = asyncio.run(one(fake(silent_tokens=True, ttft_s=0.05), endpoint=endpoint, output_tokens=1))
    assert r.outcome is Outcome.OK and r.output_tokens == 1
    assert r.ttft_ms is not None and r.ttft_ms >= 40 and r.text_chunks == 0 and r.itl_ms == []


def test_missing_usage_leaves_output_tokens_unknown():
    r = asyncio.run(one(fake(no_usage=True)))
    assert r.outcome is Outcome.OK and r.output_tokens is None and r.tpot_ms is None


def test_error_event_mid_stream():
    r = asyncio.run(one(fake(script=["error_mid_stream"]), output_tokens=8))
    assert r.outcome is Outcome.STREAM_ERROR and r.error == "engine died"


def test_server_drops_connection_mid_stream():
    r = asyncio.run(one(fake(script=["die"]), output_tokens=8))
    assert r.outcome is Outcome.DISCONNECT


@pytest.mark.parametrize("status,kind", [("429", Outcome.HTTP_429), ("503", Outcome.HTTP_503),
                                         ("500", Outcome.HTTP_5XX), ("400", Outcome.HTTP_4XX)])
def test_error_statuses_by_kind(status, kind):
    r = asyncio.run(one(fake(script=[status])))
    assert r.outcome is kind and r.status == int(status) and r.attempts == 1
    assert r.error == f"status {status}" or status == "429"


def test_timeout():
    t = time.perf_counter()
    r = asyncio.run(one(fake(script=["hold_stream"]), timeout_s=0.3))
    assert r.outcome is Outcome.TIMEOUT
    assert 0.25 < time.perf_counter() - t < 3


def test_connection_refused():
    async def go():
        async with fake() as server:
            pass  # closed again: nothing listens on that port now
        async with aiohttp.ClientSession() as session:
            return await send_request(session, Target(server.url, "fake"), spec(), timeout_s=5)

    assert asyncio.run(go()).outcome is Outcome.CONNECT


def test_429_retried_after_retry_after():
    server = fake(script=["429", "429"], retry_after="0.2")
    t = time.perf_counter()
    r = asyncio.run(one(server, retry=RetryPolicy(enabled=True, max_retries=3)))
    assert r.outcome is Outcome.OK and r.attempts == 3 and len(server.engine_calls) == 3
    assert r.retry_wait_s == pytest.approx(0.4)
    assert time.perf_counter() - t >= 0.4
    assert r.ttft_ms >= 400  # timed from the first send: what the user waited


def test_429_without_retry_is_counted_once():
    server = fake(script=["429"])
    r = asyncio.run(one(server))
    assert r.outcome is Outcome.HTTP_429 and r.attempts == 1 and len(server.engine_calls) == 1


def test_429_retries_are_bounded():
    server = fake(script=["429"] * 10, retry_after="0")
    r = asyncio.run(one(server, retry=RetryPolicy(enabled=True, max_retries=2)))
    assert r.outcome is Outcome.HTTP_429 and r.attempts == 3 and len(server.engine_calls) == 3


def test_timings_match_known_server_delays():
    r = asyncio.run(one(fake(ttft_s=0.2, itl_s=0.05), output_tokens=6))
    assert r.ttft_ms == pytest.approx(200, abs=40)
    assert len(r.itl_ms) == 5 and all(x == pytest.approx(50, abs=25) for x in r.itl_ms)
    assert sum(r.itl_ms) == pytest.approx(250, abs=40)
    assert r.tpot_ms == pytest.approx(50, abs=10)
    assert r.e2e_ms == pytest.approx(450, abs=60)


def test_cancellation_records_the_request_then_propagates():
    seen = []

    async def go():
        async with fake(script=["hold_stream"]) as server, aiohttp.ClientSession() as session:
            task = asyncio.create_task(send_request(session, Target(server.url, "fake"), spec(), timeout_s=30,
                                                    on_done=seen.append))
            await asyncio.sleep(0.2)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

    asyncio.run(go())
    assert len(seen) == 1 and seen[0].outcome is Outcome.CANCELLED and seen[0].status == 200
