"""Client connections bounded the way nginx bounds them, on top of aiohttp's server.

aiohttp closes an idle keep-alive connection and limits one header line, but a public proxy
needs more: a deadline for each request head from its first byte (a client that sends a header
a byte a minute holds a connection forever otherwise: slowloris), a cap on a head's total size,
and a cap on open connections. `GuardedRequestHandler` adds them to aiohttp's per-connection
protocol; `listen` serves an AppRunner's server through it. Body and send timeouts are the
handler's (kvtune.gateway.intake and relay), since only it knows when a body is being read or a
response written.
"""

from __future__ import annotations

import asyncio
import socket
from typing import Any

from aiohttp import web, web_protocol
from aiohttp.http_exceptions import HttpProcessingError

from kvtune.gateway.config import ClientLimits

_TIMEOUT = b"HTTP/1.1 408 Request Timeout\r\nConnection: close\r\nContent-Length: 0\r\n\r\n"
_TOO_LARGE = b"HTTP/1.1 431 Request Header Fields Too Large\r\nConnection: close\r\nContent-Length: 0\r\n\r\n"


class ConnectionGuard:
    """Shared by every connection of one listener: the limits and how many are open."""

    def __init__(self, limits: ClientLimits) -> None:
        self.limits = limits
        self.open = 0
        self.refused = 0  # connections closed at once because `max_connections` were open
        self.head_timeouts = 0
        self.heads_too_large = 0


class GuardedRequestHandler(web_protocol.RequestHandler):
    """aiohttp's connection protocol plus a head deadline, a head size cap and a connection cap.

    A request head is being read when bytes arrive while the handler waits for a request (or,
    for a new connection, from the moment it opens); the deadline runs until aiohttp has parsed
    a whole head. Between requests aiohttp's keep-alive timeout applies."""

    def __init__(self, manager: web.Server, guard: ConnectionGuard, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self._guard = guard
        self._refused = False
        self._head_timer: asyncio.TimerHandle | None = None
        self._head_bytes = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        guard = self._guard
        if guard.open >= guard.limits.max_connections:
            self._refused = True
            guard.refused += 1
            if isinstance(transport, asyncio.Transport):
                transport.abort()  # no FIN handshake for a connection over the limit
            else:
                transport.close()
            return
        guard.open += 1
        super().connection_made(transport)
        self._arm_head()

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._refused:
            return
        self._guard.open -= 1
        self._disarm_head()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        waiting = self._waiter is not None and not self._waiter.done()
        if self._head_timer is None and waiting and not self._messages:
            self._arm_head()
        super().data_received(data)
        if self._head_timer is None:
            return
        if self._messages:  # a whole head has been parsed
            self._disarm_head()
            return
        self._head_bytes += len(data)
        if self._head_bytes > self._guard.limits.max_header_bytes:
            self._guard.heads_too_large += 1
            self._refuse(_TOO_LARGE)

    def _arm_head(self) -> None:
        self._head_bytes = 0
        self._head_timer = self._loop.call_later(self._guard.limits.header_timeout_s, self._head_expired)

    def _disarm_head(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_expired(self) -> None:
        self._head_timer = None
        if not self._messages and not self._request_in_progress:
            self._guard.head_timeouts += 1
            self._refuse(_TIMEOUT)

    def log_exception(self, *args: Any, **kwargs: Any) -> None:
        """A request aiohttp could not parse (a malformed head, chunking that lies) is the client's
        fault: one warning line. Anything else is a bug and keeps its traceback."""
        exc = kwargs.get("exc_info")
        if isinstance(exc, HttpProcessingError):
            peer = args[1] if len(args) > 1 else "?"
            message = " ".join(str(getattr(exc, "message", exc)).split())[:200]
            self.logger.warning("malformed request from %s: %s", peer, message)
            return
        super().log_exception(*args, **kwargs)

    def _refuse(self, answer: bytes) -> None:
        self._disarm_head()
        transport = self.transport
        if transport is not None and not transport.is_closing():
            transport.write(answer)
        self.force_close()


async def listen(runner: web.AppRunner, host: str, port: int, limits: ClientLimits,
                 *, backlog: int = 1024) -> tuple[asyncio.Server, ConnectionGuard]:
    """Serve `runner`'s application on host:port through GuardedRequestHandler. The returned
    server is closed by the caller before runner.cleanup()."""
    server = runner.server
    if server is None:
        raise RuntimeError("call runner.setup() first")
    guard = ConnectionGuard(limits)
    loop = asyncio.get_running_loop()
    options = {
        "loop": loop,
        "keepalive_timeout": limits.keepalive_timeout_s,
        "max_line_size": limits.max_header_line_bytes,
        "max_field_size": limits.max_header_line_bytes,
        "lingering_time": min(10.0, limits.body_timeout_s),
        "access_log": None,
        "auto_decompress": False,  # the gateway decodes governed bodies itself, bounded (intake._Decoder)
    }

    def protocol() -> GuardedRequestHandler:
        return GuardedRequestHandler(server, guard, **options)

    if host == "::":
        # One dual-stack socket for IPv6 and IPv4 (asyncio would make it IPv6-only): local IPv4
        # clients then arrive as ::ffff:127.0.0.1, which the admin checks count as loopback.
        sock = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(("::", port))
        except OSError:
            sock.close()
            raise
        listener = await loop.create_server(protocol, sock=sock, backlog=backlog)
    else:
        listener = await loop.create_server(protocol, host, port, backlog=backlog, reuse_address=True)
    return listener, guard


__all__ = ["ConnectionGuard", "GuardedRequestHandler", "listen"]
