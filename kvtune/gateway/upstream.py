"""The gateway's own HTTP/1.1 client for the calls it makes with a body in hand: governed generation
requests and /tokenize. Keep-alive connections to one upstream, the request sent in one write,
and a small response reader for Content-Length, chunked and close-delimited bodies.

Why not aiohttp's ClientSession: on loopback against an instant upstream its request path was
more than half of the gateway's CPU per request (~0.3 of ~0.55 ms, benchmarks/gateway_bench.py);
this client costs a few tens of microseconds. Pass-through traffic (streamed request bodies,
anything the gateway does not govern) still goes through aiohttp.

Errors:
  UpstreamError                    no usable answer: cannot connect, connection broken, not HTTP/1.x
   ├── UpstreamConnectError        no connection could be opened: nothing of the request was sent
   │    └── UpstreamConnectTimeoutError   (also an UpstreamTimeoutError) connecting took too long
   └── UpstreamTimeoutError        connecting, or waiting for the next bytes, took longer than allowed
"""

from __future__ import annotations

import asyncio
import re
import select
import socket
import ssl as ssl_module
from collections.abc import AsyncIterator, Iterable
from typing import Any

from multidict import CIMultiDict

from kvtune.endpoint import parse_url

_MAX_HEAD_BYTES = 64 * 1024
_MAX_CHUNK_LINE_BYTES = 4 * 1024
# Reading from the upstream pauses while this much is buffered and unread (a slow client
# downstream), and resumes below the low mark: the gateway never holds a whole stream.
_HIGH_WATER_BYTES = 256 * 1024
_LOW_WATER_BYTES = 64 * 1024
_HEX = re.compile(rb"[0-9A-Fa-f]{1,16}")
_TOKEN = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")  # a header name (RFC 9110 §5.6.2)

_NONE, _LENGTH, _CHUNKED, _CLOSE = range(4)  # how a response body ends


class UpstreamError(Exception):
    """The upstream gave no usable answer: connect failure, broken connection, malformed HTTP."""


class UpstreamTimeoutError(UpstreamError):
    """Connecting, or waiting for the upstream's next bytes, took longer than the timeout."""


class UpstreamConnectError(UpstreamError):
    """No connection to the upstream could be opened: nothing of the request was sent, so it may
    go to another upstream."""


class UpstreamConnectTimeoutError(UpstreamConnectError, UpstreamTimeoutError):
    """Connecting to the upstream took longer than the connect timeout (nothing was sent)."""


class _Connection(asyncio.Protocol):
    """One keep-alive TCP connection: bytes received wait in `buffer` until a reader takes them."""

    def __init__(self, loop: asyncio.AbstractEventLoop, idle: list[_Connection]) -> None:
        self._loop = loop
        self._idle = idle  # the pool's idle list, to leave it when the upstream hangs up
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.eof = False
        self.error: BaseException | None = None
        self.idle_since = 0.0
        self._waiter: asyncio.Future | None = None
        self._drain: asyncio.Future | None = None
        self._reading_paused = False

    # ---------------------------------------------------------------- asyncio.Protocol

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        sock = transport.get_extra_info("socket")
        if sock is not None:
            try:  # one write per request; never wait for an ACK before sending it
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except (OSError, AttributeError):
                pass

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        if len(self.buffer) > _HIGH_WATER_BYTES and not self._reading_paused:
            self._reading_paused = True
            if self.transport is not None:
                self.transport.pause_reading()
        self._wake()

    def eof_received(self) -> bool:
        self.eof = True
        self._wake()
        return False  # close our side too

    def connection_lost(self, exc: BaseException | None) -> None:
        self.eof = True
        self.error = exc
        self._wake()
        if self._drain is not None and not self._drain.done():
            self._drain.set_result(None)
        if self in self._idle:
            self._idle.remove(self)

    def pause_writing(self) -> None:
        self._drain = self._loop.create_future()

    def resume_writing(self) -> None:
        if self._drain is not None and not self._drain.done():
            self._drain.set_result(None)
        self._drain = None

    # ---------------------------------------------------------------- for the reader

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    @property
    def reusable(self) -> bool:
        return not self.eof and not self.buffer and self.transport is not None and not self.transport.is_closing()

    def unread_bytes_waiting(self) -> bool:
        """Whether the kernel holds bytes (or the upstream's FIN) this idle connection has not been
        handed yet: the event loop delivers them on its next turn, after a request sent now, which
        would then read them as its own answer. As urllib3 and httpcore check before reuse."""
        sock = self.transport.get_extra_info("socket") if self.transport is not None else None
        if sock is None:
            return False
        poller = select.poll()
        poller.register(sock.fileno(), select.POLLIN)
        return bool(poller.poll(0))

    async def write(self, data: bytes) -> None:
        if self.transport is None:
            raise UpstreamError("the upstream connection is not open")
        self.transport.write(data)
        if self._drain is not None:
            await self._drain

    async def wait(self, timeout_s: float | None) -> None:
        """Until more bytes arrive or the upstream closes; UpstreamTimeoutError after timeout_s."""
        if self.eof:
            return
        if self._reading_paused and self.transport is not None:
            self._reading_paused = False
            self.transport.resume_reading()
        waiter = self._waiter = self._loop.create_future()
        timer = None
        if timeout_s is not None:
            timer = self._loop.call_later(timeout_s, _expire, waiter, timeout_s)
        try:
            await waiter
        finally:
            self._waiter = None
            if timer is not None:
                timer.cancel()

    def take(self, n: int) -> bytes:
        data = bytes(self.buffer[:n])
        del self.buffer[:n]
        if self._reading_paused and len(self.buffer) < _LOW_WATER_BYTES and self.transport is not None:
            self._reading_paused = False
            self.transport.resume_reading()
        return data

    def close(self) -> None:
        """Drop the connection: an unfinished request is aborted upstream (vLLM cancels it).
        The FIN leaves now, not on the loop's next turn (asyncio closes the socket there), so
        the upstream sees the abort before any request admitted with the blocks it gives back."""
        self.eof = True
        transport = self.transport
        if transport is not None and not transport.is_closing():
            sock = transport.get_extra_info("socket")
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except (OSError, TypeError, AttributeError):
                pass  # uvloop refuses shutdown() (TypeError) but closes the fd at once itself
            transport.close()
        if self in self._idle:
            self._idle.remove(self)


def _expire(waiter: asyncio.Future, timeout_s: float) -> None:
    if not waiter.done():
        waiter.set_exception(UpstreamTimeoutError(f"no answer from the upstream within {timeout_s:g} s"))


class UpstreamResponse:
    """Status and headers of an answer; the body is read with `read()` or `iter_chunks()`.
    `release()` keeps the connection for the next request when the body was read to its end
    and the upstream allows it; `close()` drops it (an unfinished answer must be dropped)."""

    __slots__ = ("status", "reason", "headers", "content_length", "_conn", "_client", "_mode",
                 "_left", "_crlf", "_trailers", "_keep_alive", "_done")

    def __init__(self, client: UpstreamClient, conn: _Connection, status: int, reason: str,
                 headers: CIMultiDict, mode: int, length: int | None, keep_alive: bool) -> None:
        self.status, self.reason, self.headers = status, reason, headers
        self.content_length = length
        self._client, self._conn = client, conn
        self._mode, self._left, self._crlf, self._trailers = mode, length or 0, False, False
        self._keep_alive = keep_alive
        self._done = mode == _NONE or (mode == _LENGTH and length == 0)

    async def read(self) -> bytes:
        if self._mode == _LENGTH:  # the common case, in one piece when it is all there
            conn = self._conn
            while len(conn.buffer) < self._left and not conn.eof:
                await conn.wait(self._client.read_timeout_s)
            if len(conn.buffer) >= self._left:
                data, self._left, self._done = conn.take(self._left), 0, True
                return data
        return b"".join([chunk async for chunk in self.iter_chunks()])

    async def iter_chunks(self) -> AsyncIterator[bytes]:
        """The body's bytes as they arrive (chunked framing removed); UpstreamError when the
        upstream closes before the body is complete."""
        while True:
            chunk = await self._next()
            if chunk is None:
                return
            yield chunk

    async def _next(self) -> bytes | None:
        conn, timeout_s = self._conn, self._client.read_timeout_s
        while not self._done:
            buf = conn.buffer
            if self._mode == _LENGTH:
                if buf:
                    data = conn.take(min(len(buf), self._left))
                    self._left -= len(data)
                    self._done = self._left == 0
                    return data
            elif self._mode == _CLOSE:
                if buf:
                    return conn.take(len(buf))
                if conn.eof:
                    if conn.error is not None:
                        raise UpstreamError(f"the upstream connection broke: {conn.error!r}")
                    self._done = True
                    return None
            elif self._left:  # inside a chunk
                if buf:
                    data = conn.take(min(len(buf), self._left))
                    self._left -= len(data)
                    self._crlf = self._left == 0
                    return data
            elif self._crlf:  # the CRLF after a chunk's data
                if len(buf) >= 2:
                    if conn.take(2) != b"\r\n":
                        raise UpstreamError("malformed chunked body from the upstream")
                    self._crlf = False
                    continue
            else:  # a chunk-size line, or the trailer section after the last chunk
                end = buf.find(b"\r\n")
                if end >= 0:
                    line = conn.take(end + 2)[:-2]
                    if self._trailers:  # skip the trailer fields up to the empty line
                        self._done = line == b""
                        continue
                    size = line.split(b";", 1)[0].strip()
                    if not _HEX.fullmatch(size):
                        raise UpstreamError("malformed chunk size from the upstream")
                    self._left = int(size, 16)
                    if self._left == 0:
                        self._trailers = True  # the last chunk: trailers follow
                    continue
                if len(buf) > _MAX_CHUNK_LINE_BYTES:
                    raise UpstreamError("chunk-size line too long from the upstream")
            if conn.eof:
                raise UpstreamError("the upstream closed the connection before the body was complete")
            await conn.wait(timeout_s)
        return None

    async def read_and_release(self) -> bytes:
        """The whole body, then the connection back for the next request (dropped when reading
        fails part way, since an unfinished answer cannot be reused)."""
        try:
            data = await self.read()
        except BaseException:
            self.close()
            raise
        self.release()
        return data

    def release(self) -> None:
        if self._done and self._keep_alive:
            self._client._keep(self._conn)
        else:
            self._conn.close()

    def close(self) -> None:
        self._conn.close()


class UpstreamClient:
    """Keep-alive HTTP/1.1 connections to one upstream base URL (http or https, with or without
    a path prefix). Idle connections are reused newest first and dropped after keepalive_s."""

    def __init__(self, base_url: str, *, connect_timeout_s: float | None = 10.0,
                 read_timeout_s: float | None = 600.0, keepalive_s: float = 4.0) -> None:
        url = parse_url(base_url, field="upstream")
        self.host, self.port = url.host, url.port
        self._ssl = ssl_module.create_default_context() if url.scheme == "https" else None
        self._prefix = url.prefix
        self._host_line = f"Host: {url.netloc}\r\n"
        self.connect_timeout_s = connect_timeout_s
        self.read_timeout_s = read_timeout_s
        self.keepalive_s = keepalive_s
        self._idle: list[_Connection] = []
        self._closed = False

    async def request(self, method: str, target: str, headers: Iterable[tuple[str, str]],
                      body: bytes) -> UpstreamResponse:
        """Send `method target` with `headers` (no Host or Content-Length: they are set here) and
        `body`; return once the answer's status and headers have arrived."""
        lines = [f"{method} {self._prefix}{target} HTTP/1.1\r\n", self._host_line]
        lines += [f"{name}: {value}\r\n" for name, value in headers]
        lines.append(f"Content-Length: {len(body)}\r\n\r\n")
        head = "".join(lines).encode("utf-8", "surrogateescape")
        conn = await self._connection()
        try:
            await conn.write(head + body if len(body) < 65536 else head)
            if len(body) >= 65536:
                await conn.write(body)
            return await self._response(conn, method)
        except BaseException:
            conn.close()
            raise

    async def _connection(self) -> _Connection:
        if self._closed:
            raise UpstreamError("the upstream client is closed")
        loop = asyncio.get_running_loop()
        now = loop.time()
        idle = self._idle
        while idle:
            conn = idle.pop()
            if conn.reusable and now - conn.idle_since < self.keepalive_s and not conn.unread_bytes_waiting():
                return conn
            conn.close()  # bytes after the end of the last answer: a framing surprise
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                _, conn = await loop.create_connection(
                    lambda: _Connection(loop, idle), self.host, self.port, ssl=self._ssl)
        except TimeoutError as exc:
            raise UpstreamConnectTimeoutError(
                f"connecting to the upstream took over {self.connect_timeout_s:g} s") from exc
        except OSError as exc:
            raise UpstreamConnectError(f"cannot connect to the upstream: {exc.strerror or exc}") from exc
        return conn

    async def _response(self, conn: _Connection, method: str) -> UpstreamResponse:
        while True:
            end = conn.buffer.find(b"\r\n\r\n")
            while end < 0:
                if len(conn.buffer) > _MAX_HEAD_BYTES:
                    raise UpstreamError("response head over 64 KiB from the upstream")
                if conn.eof:
                    raise UpstreamError("the upstream closed the connection without answering")
                await conn.wait(self.read_timeout_s)
                end = conn.buffer.find(b"\r\n\r\n")
            head = conn.take(end + 4).decode("utf-8", "surrogateescape")
            status_line, *fields = head[:-4].split("\r\n")
            version, _, rest = status_line.partition(" ")
            code, _, reason = rest.partition(" ")
            if version not in ("HTTP/1.1", "HTTP/1.0") or len(code) != 3 or not code.isdigit():
                raise UpstreamError(f"not an HTTP/1.x answer from the upstream: {status_line[:80]!r}")
            status = int(code)
            pairs = []
            for field in fields:
                name, sep, value = field.partition(":")
                if not sep or not _TOKEN.fullmatch(name):
                    raise UpstreamError(f"malformed header line from the upstream: {field[:80]!r}")
                pairs.append((name, value.strip(" \t")))
            headers = CIMultiDict(pairs)
            if 100 <= status < 200:
                if status == 101:
                    raise UpstreamError("the upstream switched protocols; only HTTP/1.x is proxied here")
                continue  # 100 Continue, 103 Early Hints: the real answer follows
            break
        length = None
        if "Content-Length" in headers:
            values = {v.strip() for v in ",".join(headers.getall("Content-Length")).split(",")}
            if len(values) != 1 or not next(iter(values)).isdigit():
                raise UpstreamError(f"invalid Content-Length from the upstream: {sorted(values)}")
            length = int(values.pop())
        surprise = False  # framing that may smuggle a second answer: this connection is not reused
        if method == "HEAD" or status in (204, 304):
            mode = _NONE
        elif "Transfer-Encoding" in headers:
            codings = ",".join(headers.getall("Transfer-Encoding")).lower()
            mode, length = (_CHUNKED if codings.rstrip(" \t,").endswith("chunked") else _CLOSE), None
            if "Content-Length" in headers:  # RFC 9112 §6.3: the coding wins; the length is not forwarded
                del headers["Content-Length"]
                surprise = True
        elif length is not None:
            mode = _LENGTH
        else:
            mode = _CLOSE
        tokens = ",".join(headers.getall("Connection", ())).lower()
        keep_alive = version == "HTTP/1.1" and mode != _CLOSE and "close" not in tokens and not surprise
        return UpstreamResponse(self, conn, status, reason, headers, mode, length, keep_alive)

    def _keep(self, conn: _Connection) -> None:
        if self._closed or not conn.reusable:
            conn.close()
            return
        conn.idle_since = asyncio.get_running_loop().time()
        self._idle.append(conn)

    async def close(self) -> None:
        """Close idle connections; those in use close when their response is released."""
        self._closed = True
        while self._idle:
            self._idle.pop().close()


__all__ = ["UpstreamClient", "UpstreamResponse", "UpstreamError", "UpstreamTimeoutError", "UpstreamConnectError",
           "UpstreamConnectTimeoutError"]
