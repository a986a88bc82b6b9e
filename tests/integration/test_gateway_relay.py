"""Relay (kvtune.gateway.relay) when the client is gone at the worst moments: after the upstream's
status and headers arrived but before the gateway wrote its own (prepare fails), and between two
chunks. Real HTTP on loopback at both ends: an aiohttp server whose handler relays to the fake vLLM
through the gateway's own UpstreamClient; the client's leaving is its transport closing."""

from __future__ import annotations

import asyncio
import json

import aiohttp
from aiohttp import web
from fake_vllm import FakeVllm
from ledger_race import wait_for

from kvtune.gateway.relay import Relay
from kvtune.gateway.upstream import UpstreamClient

STREAM = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}],
          "x_chunks": 200, "x_delay": 0.02}


async def relay_for_a_client_that_left(fake: FakeVllm, leave: str) -> tuple[web.StreamResponse | BaseException,
                                                                             UpstreamClient]:
    """Runs one relayed request whose client leaves at `leave` ("before_prepare": its transport
    closed before the upstream is called, so the upstream answers and prepare() fails;
    "mid_stream": after the first token's chunk); returns
    what Relay.send returned (or raised) and the upstream client it used."""
    client = UpstreamClient(fake.url, read_timeout_s=10)
    outcome: asyncio.Future = asyncio.get_running_loop().create_future()
    relay = Relay(send_timeout_s=5)

    async def handler(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        if leave == "before_prepare":  # gone before anything is written back: prepare() meets a closed transport
            request.transport.close()  # type: ignore[union-attr]

        def progress(tokens: int) -> None:
            if leave == "mid_stream" and tokens >= 1 and request.transport is not None:
                request.transport.close()

        try:
            response = await relay.send(request, client, "POST", "/v1/chat/completions", body, {}, progress=progress)
        except BaseException as exc:  # what the handler would raise to aiohttp
            outcome.set_result(exc)
            raise
        outcome.set_result(response)
        return response

    app = web.Application()
    app.router.add_post("/v1/chat/completions", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        async with aiohttp.ClientSession() as session:
            try:
                async with session.post(f"http://127.0.0.1:{port}/v1/chat/completions", data=json.dumps(STREAM),
                                        headers={"Content-Type": "application/json"}) as resp:
                    await resp.read()
            except aiohttp.ClientError:
                pass  # the connection went, as the test made it
        return await asyncio.wait_for(outcome, 10), client
    finally:
        await runner.cleanup()


def test_a_client_gone_before_the_headers_are_written_closes_the_upstream_call_without_raising():
    async def run() -> None:
        with FakeVllm() as fake:
            result, client = await relay_for_a_client_that_left(fake, "before_prepare")
            assert isinstance(result, web.StreamResponse), result  # answered, never a traceback
            await wait_for(lambda: fake.cancelled == 1)  # the upstream call was cut (vLLM aborts it)
            assert fake.active == 0
            assert client._idle == []  # the unfinished connection was closed, not kept for reuse
            await client.close()

    asyncio.run(run())


def test_a_client_gone_between_two_chunks_closes_the_upstream_call_without_raising():
    async def run() -> None:
        with FakeVllm() as fake:
            result, client = await relay_for_a_client_that_left(fake, "mid_stream")
            assert isinstance(result, web.StreamResponse), result
            await wait_for(lambda: fake.cancelled == 1)
            assert fake.active == 0 and client._idle == []
            await client.close()

    asyncio.run(run())
