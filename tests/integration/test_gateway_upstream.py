"""The gateway's own HTTP/1.1 client against a scripted server on loopback: each way a body can
end (length, chunked, close), keep-alive reuse and when a connection must not be reused, 1xx
answers, malformed answers, timeouts, and aborting an unfinished request."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time

import pytest

from kvtune.errors import InputError
from kvtune.gateway.upstream import UpstreamClient, UpstreamError, UpstreamTimeoutError


class Scripted:
    """Reads one request at a time (head + Content-Length body) and plays the next answer: bytes
    to send, or a list of bytes to send, floats to sleep, None to close the connection and
    "eof" to wait for the client to close it."""

    def __init__(self, *answers: bytes | list) -> None:
        self.answers = list(answers)
        self.requests: list[bytes] = []
        self.connections = 0
        self.closed_by_peer = asyncio.Event()

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), 0)
                self.requests.append(head + await reader.readexactly(length))
                answer = self.answers.pop(0)
                for part in answer if isinstance(answer, list) else [answer]:
                    if part is None:
                        return
                    if part == "eof":
                        if await reader.read() == b"":
                            self.closed_by_peer.set()
                        return
                    if isinstance(part, float):
                        await asyncio.sleep(part)
                    else:
                        writer.write(part)
                        await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            self.closed_by_peer.set()
        finally:
            writer.close()


@contextlib.asynccontextmanager
async def serving(script: Scripted, prefix: str = "", **client_options):
    server = await asyncio.start_server(script.handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    client = UpstreamClient(f"http://127.0.0.1:{port}{prefix}", **client_options)
    try:
        yield client, port
    finally:
        await client.close()
        server.close()
        await server.wait_closed()


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 10))


OK = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"


async def _call(client: UpstreamClient, body: bytes = b'{"a":1}', method: str = "POST"):
    resp = await client.request(method, "/v1/x?q=1", [("Content-Type", "application/json")], body)
    return resp, await resp.read_and_release()


def test_content_length_answer_and_keep_alive_reuse():
    async def main():
        script = Scripted(OK, OK)
        async with serving(script, prefix="/base/") as (client, port):
            first, body = await _call(client)
            assert (first.status, first.reason, body) == (200, "OK", b"{}")
            assert first.headers["content-type"] == "application/json"
            await _call(client)
        assert script.connections == 1  # the second request reused the connection
        head = script.requests[0].decode()
        assert head.startswith("POST /base/v1/x?q=1 HTTP/1.1\r\n")
        assert f"Host: 127.0.0.1:{port}\r\n" in head and "Content-Length: 7\r\n" in head
        assert head.endswith('\r\n\r\n{"a":1}')

    run(main())


def test_chunked_answer_streams_chunk_by_chunk():
    async def main():
        head = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
        script = Scripted([head, b"5;ext=1\r\nhello\r\n", 0.2, b"6\r\n world\r\n0\r\nX-Trailer: t\r\n\r\n"], OK)
        async with serving(script) as (client, _):
            resp = await client.request("POST", "/s", [], b"")
            assert resp.content_length is None
            loop = asyncio.get_running_loop()
            chunks, times = [], []
            async for chunk in resp.iter_chunks():
                chunks.append(chunk)
                times.append(loop.time())
            resp.release()
            assert b"".join(chunks) == b"hello world" and times[-1] - times[0] > 0.15
            await _call(client)
        assert script.connections == 1

    run(main())


@pytest.mark.parametrize("answer", [
    b"HTTP/1.1 200 OK\r\n\r\nuntil the end",                        # no length: ends at close
    b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\nok",
    b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\nok",
])
def test_answers_that_end_the_connection_are_not_reused(answer):
    async def main():
        script = Scripted([answer, None], OK)
        async with serving(script) as (client, _):
            _, body = await _call(client)
            assert body in (b"until the end", b"ok")
            await _call(client)
        assert script.connections == 2

    run(main())


@pytest.mark.parametrize("loop_factory", ["asyncio", "uvloop"])  # the gateway runs on uvloop where installed
def test_bytes_after_an_answer_are_never_read_as_the_next_answer(loop_factory):
    """An upstream that sends more after a complete answer (here a whole second answer, 50 ms
    later): bytes the kernel holds when the connection is taken for the next /tokenize call were
    read as that call's answer ({"count":99}) whenever the event loop had not yet handed them
    over (a busy gateway, here one that blocks 0.15 s). A connection with unread bytes waiting
    is a framing surprise: it is closed, and the call goes on a new one."""
    late = b'HTTP/1.1 200 OK\r\nContent-Length: 12\r\n\r\n{"count":99}'
    right = b'HTTP/1.1 200 OK\r\nContent-Length: 11\r\n\r\n{"count":1}'

    connections = []

    def upstream(listener: socket.socket) -> None:  # in a thread: it runs while the loop is blocked
        while len(connections) < 2:
            try:
                conn, _ = listener.accept()
            except OSError:  # the test is over
                return
            connections.append(conn)
            with conn, contextlib.suppress(OSError):  # the client may reset a connection it drops
                for answer in ([OK, late], [right]) if len(connections) == 1 else ([right], [right]):
                    request = b""
                    while b'{"a":1}' not in request:
                        if not (data := conn.recv(65536)):
                            break
                        request += data
                    if not request:
                        break
                    for part in answer:
                        conn.sendall(part)
                        time.sleep(0.05)

    async def main():
        with socket.create_server(("127.0.0.1", 0)) as listener:
            thread = threading.Thread(target=upstream, args=(listener,), daemon=True)
            thread.start()
            client = UpstreamClient(f"http://127.0.0.1:{listener.getsockname()[1]}")
            try:
                assert (await _call(client))[1] == b"{}"
                time.sleep(0.2)  # the late answer is in the kernel; the loop has not run
                assert (await _call(client))[1] == b'{"count":1}'
            finally:
                await client.close()
            await asyncio.to_thread(thread.join, 5)  # the loop runs: uvloop closes sockets on its next turn
        assert len(connections) == 2

    factory = None if loop_factory == "asyncio" else pytest.importorskip("uvloop").new_event_loop
    with asyncio.Runner(loop_factory=factory) as runner:
        runner.run(asyncio.wait_for(main(), 10))


@pytest.mark.parametrize("answer", [
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nContent-Length: 100\r\n\r\n2\r\n{}\r\n0\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n",
])
def test_chunked_with_a_content_length_drops_the_length_and_the_connection(answer):
    """RFC 9112 §6.3: Transfer-Encoding overrides Content-Length, which a proxy must remove before
    forwarding; both at once may hide a smuggled answer, so the connection is not reused."""
    async def main():
        script = Scripted(answer, OK)
        async with serving(script) as (client, _):
            resp, body = await _call(client)
            assert body == b"{}" and resp.content_length is None and "Content-Length" not in resp.headers
            await _call(client)
        assert script.connections == 2

    run(main())


def test_interim_answers_are_skipped_and_bodiless_ones_have_none():
    async def main():
        script = Scripted([b"HTTP/1.1 100 Continue\r\n\r\n", OK],
                          b"HTTP/1.1 204 No Content\r\n\r\n",
                          b"HTTP/1.1 200 OK\r\nContent-Length: 99\r\n\r\n", OK)
        async with serving(script) as (client, _):
            resp, body = await _call(client)
            assert resp.status == 200 and body == b"{}"
            resp, body = await _call(client)
            assert resp.status == 204 and body == b""
            resp, body = await _call(client, method="HEAD")  # the length describes a GET's body
            assert resp.status == 200 and body == b"" and resp.content_length == 99
            await _call(client)
        assert script.connections == 1

    run(main())


@pytest.mark.parametrize("answer, message", [
    (b"SPDY/3 200 OK\r\n\r\n", "not an HTTP/1.x answer"),
    (b"HTTP/1.1 2000 OK\r\n\r\n", "not an HTTP/1.x answer"),
    (b"HTTP/1.1 200 OK\r\nContent-Length: 2, 3\r\n\r\n", "invalid Content-Length"),
    (b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n", "invalid Content-Length"),
    (b"HTTP/1.1 200 OK\r\nBad Header: x\r\n\r\n", "malformed header line"),
    (b"HTTP/1.1 200 OK\r\n folded: x\r\n\r\n", "malformed header line"),
])
def test_malformed_answers_are_upstream_errors(answer, message):
    async def main():
        async with serving(Scripted(answer)) as (client, _):
            with pytest.raises(UpstreamError, match=message):
                await _call(client)

    run(main())


@pytest.mark.parametrize("answer", [
    b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nshort",
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhel",
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
    b"HTTP/1.1 200",
])
def test_bodies_cut_short_are_upstream_errors(answer):
    async def main():
        async with serving(Scripted([answer, None])) as (client, _):
            with pytest.raises(UpstreamError):
                await _call(client)

    run(main())


def test_read_and_connect_failures():
    async def main():
        async with serving(Scripted([5.0]), read_timeout_s=0.2) as (client, _):
            with pytest.raises(UpstreamTimeoutError, match="0.2 s"):
                await _call(client)
        refused = UpstreamClient("http://127.0.0.1:9")
        with pytest.raises(UpstreamError, match="cannot connect"):
            await _call(refused)
        with pytest.raises(InputError, match="^upstream: must look like http://host:port, got 'ftp://127.0.0.1:9'$"):
            UpstreamClient("ftp://127.0.0.1:9")

    run(main())


def test_idle_connections_expire_and_dead_ones_are_not_used():
    async def main():
        script = Scripted(OK, [OK, None], OK)
        async with serving(script, keepalive_s=0.1) as (client, _):
            await _call(client)
            await asyncio.sleep(0.2)  # idle past keepalive_s: a fresh connection
            await _call(client)  # answered, then the server hangs up
            await asyncio.sleep(0.05)
            await _call(client)  # the connection it closed is not handed out again
        assert script.connections == 3

    run(main())


def test_closing_an_unfinished_answer_aborts_the_request_upstream():
    async def main():
        head = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
        script = Scripted([head, b"5\r\nhello\r\n", "eof"])
        async with serving(script) as (client, _):
            resp = await client.request("POST", "/s", [], b"")
            assert await resp.iter_chunks().__anext__() == b"hello"
            resp.release()  # unfinished: dropped, not kept
            await asyncio.wait_for(script.closed_by_peer.wait(), 2)
            assert client._idle == []

    run(main())
