"""Request intake: what a request is before anything is counted, and its body read within bounds.

Every request path is classified first (kvtune.gateway.endpoints): a generation endpoint is
governed, a pooling endpoint reserves its input, a path on the passthrough allow-list is
forwarded untouched, and everything else is refused. What is refused before any body (CONNECT,
a head over its cap, Upgrade, a path that is not plain, a method or encoding a governed path does
not take) is a Rejection here. The body is read whole within the size cap and the between-reads
timeout; a gzip or deflate body is decoded as it arrives, the cap applying to what it decodes to.
"""

from __future__ import annotations

import asyncio
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestPayloadError

from kvtune.domain.route import Route
from kvtune.gateway.config import ClientLimits, GatewayConfig, StickyBy
from kvtune.gateway.endpoints import Endpoint, PathClass, canonical_path, classify
from kvtune.gateway.flow import ANONYMOUS, flow_of
from kvtune.gateway.refusals import Reason, Rejection

# Request encodings the gateway decodes (zlib); others are refused on governed paths (415).
_DECODED_ENCODINGS = frozenset({"", "identity", "gzip", "deflate"})


@dataclass(frozen=True, slots=True)
class Incoming:
    """A request the gateway will serve: its canonical path, the path's class and, for a route's
    own literal path, that route. `raw_path` is the target as the client sent it."""

    path: str
    endpoint: Endpoint
    route: Route | None
    raw_path: str
    sticky_header: str | None = None  # the value of gateway.yaml's sticky.header, when it keeps by one
    # The values of the headers routes match on (lower-case names; absent or empty ones left out)
    route_headers: Mapping[str, str] = field(default_factory=dict)
    # flow control (gateway.yaml `flow:`): the band header's value, and the flow (its header's value
    # or the API key's hash, never the key)
    priority: str | None = None
    flow: str = ANONYMOUS

    def target(self, path: str) -> str:
        """`path` with the query string of the original request target, untouched."""
        return with_query(path, self.raw_path)


class Intake:
    """Classifies requests and reads their bodies under one gateway.yaml's routes and limits."""

    def __init__(self, config: GatewayConfig) -> None:
        self.limits: ClientLimits = config.limits
        self._config = config
        self._route_paths = config.route_paths()
        self._route_headers = config.route_headers
        self._passthrough = frozenset(config.passthrough)
        sticky = config.sticky
        self._sticky_header = sticky.header if sticky is not None and sticky.by is StickyBy.HEADER else None

    def classify(self, request: web.Request) -> Incoming:
        """The request's path and class, or a Rejection for what is refused before any body."""
        if request.method in ("CONNECT", "TRACE"):
            raise Rejection(405, Reason.METHOD_NOT_ALLOWED, f"{request.method} is not served", close=True)
        if _head_bytes(request) > self.limits.max_header_bytes:
            raise Rejection(431, Reason.HEADER_TOO_LARGE, f"request heads are limited to "
                            f"{self.limits.max_header_bytes} bytes", close=True)
        if "Upgrade" in request.headers:
            raise Rejection(400, Reason.UPGRADE_REFUSED, "the gateway does not switch protocols", close=True)
        raw_path = request.raw_path
        path = canonical_path(raw_path)
        if path is None:
            raise Rejection(400, Reason.INVALID_PATH, "the request path must be plain (no percent-escapes, "
                            "'//', '.' or '..' segments)")
        first = self._route_paths.get(path)
        if first is not None:
            endpoint = Endpoint(PathClass.GENERATE, first.api)
        else:
            endpoint = classify(path, self._passthrough)
        kind = endpoint.path_class
        if kind in (PathClass.GENERATE, PathClass.POOL):
            if request.method != "POST":
                raise Rejection(405, Reason.METHOD_NOT_ALLOWED, f"{path} takes POST", allow="POST")
            encoding = request.headers.get("Content-Encoding", "").strip().lower()
            if encoding not in _DECODED_ENCODINGS:
                raise Rejection(415, Reason.UNSUPPORTED_ENCODING, "request bodies may be gzip or deflate encoded",
                                close=True)
        elif kind is PathClass.UNCOUNTABLE:
            raise Rejection(501, Reason.UNCOUNTABLE_ENDPOINT, f"{path} is not served through this gateway: "
                            f"{endpoint.reason}")
        elif kind is not PathClass.PASSTHROUGH:
            raise Rejection(404, Reason.NOT_FOUND, f"{path} is not served through this gateway")
        groups = self._groups(request) if kind is PathClass.GENERATE else {}
        route = self._config.path_route(path, groups) if first is not None else None
        key = request.headers.get(self._sticky_header) if self._sticky_header is not None else None
        flow = self._config.flow
        if flow is None or kind not in (PathClass.GENERATE, PathClass.POOL):
            return Incoming(path, endpoint, route, raw_path, key or None, groups)
        headers = request.headers
        return Incoming(path, endpoint, route, raw_path, key or None, groups, headers.get(flow.band_header),
                        flow_of(headers.get(flow.flow_header), headers.get("Authorization")))

    def _groups(self, request: web.Request) -> dict[str, str]:
        """The headers routes match on; one sent twice is refused, since the two enforcers (and the
        layer in front that sets it) could each take a different one of them."""
        out = {}
        for name in self._route_headers:
            values = request.headers.getall(name, [])
            if len(values) > 1:
                raise Rejection(400, Reason.DUPLICATE_ROUTE_HEADER, f"the {name} header is sent "
                                f"{len(values)} times: routes match on its one value")
            if values and values[0]:
                out[name] = values[0]
        return out

    async def read_body(self, request: web.Request, *, decode: bool = True) -> bytes:
        """The whole request body within the size cap, the between-reads timeout and the whole-body
        deadline; a gzip or deflate body is decoded (`decode`), the cap applying to what it decodes to."""
        limits = self.limits
        loop = asyncio.get_running_loop()
        deadline = loop.time() + limits.body_deadline_s
        cap = limits.max_body_bytes
        if request.content_length is not None and request.content_length > cap:
            raise Rejection(413, Reason.BODY_TOO_LARGE, f"request bodies are limited to {cap} bytes", close=True)
        encoding = request.headers.get("Content-Encoding", "").strip().lower()
        decoder = _Decoder(encoding, cap) if decode and encoding in ("gzip", "deflate") else None
        chunks: list[bytes] = []
        size = received = 0
        content = request.content
        while True:
            try:
                async with asyncio.timeout_at(min(deadline, loop.time() + limits.body_timeout_s)):
                    chunk = await content.readany()
                received += len(chunk)  # what came over the wire is bounded too, decoded or not
                if received > cap:
                    raise Rejection(413, Reason.BODY_TOO_LARGE, f"request bodies are limited to {cap} bytes",
                                    close=True)
            except TimeoutError:
                why = (f"the request body did not arrive within {limits.body_deadline_s:g} s"
                       if loop.time() >= deadline else f"no request body bytes for {limits.body_timeout_s:g} s")
                raise Rejection(408, Reason.BODY_TIMEOUT, why, close=True) from None
            except (web.HTTPException, RequestPayloadError, HttpProcessingError, ValueError, OSError) as exc:
                raise Rejection(400, Reason.INVALID_BODY, f"the request body could not be read ({type(exc).__name__})",
                                close=True) from None
            if decoder is not None:
                chunk = decoder.feed(chunk) if chunk else decoder.finish()
                if not chunk and not decoder.done:
                    continue
            if not chunk:
                return b"".join(chunks)
            size += len(chunk)
            if size > cap:
                raise Rejection(413, Reason.BODY_TOO_LARGE, f"request bodies are limited to {cap} bytes", close=True)
            chunks.append(chunk)


class _Decoder:
    """A gzip or deflate request body decoded as it arrives, never past `cap` + 1 bytes of
    output however small the input (a decompression bomb stops at the cap, not in memory).
    gzip may hold several members one after another (RFC 1952); anything after the last one,
    or a stream that stops early, is not a body."""

    def __init__(self, encoding: str, cap: int) -> None:
        self._encoding, self._cap, self._out = encoding, cap, 0
        self._z: Any = None
        self.done = False

    def feed(self, data: bytes) -> bytes:
        pieces = []
        while data:
            if self._z is None or (self._z.eof and self._encoding == "gzip"):
                # deflate should be zlib-wrapped (RFC 9110), but raw deflate is common: sniff it
                wbits = 31 if self._encoding == "gzip" else 15 if data[0] & 0x0F == 8 else -15
                self._z = zlib.decompressobj(wbits)
            elif self._z.eof:
                raise Rejection(400, Reason.INVALID_BODY, f"bytes after the end of the {self._encoding} stream",
                                close=True)
            try:
                out = self._z.decompress(data, self._cap + 1 - self._out)
            except zlib.error:
                raise Rejection(400, Reason.INVALID_BODY, f"the request body is not valid {self._encoding}",
                                close=True) from None
            self._out += len(out)
            pieces.append(out)
            if self._z.unconsumed_tail:  # more output than the cap allows
                raise Rejection(413, Reason.BODY_TOO_LARGE, f"request bodies are limited to {self._cap} bytes",
                                close=True)
            data = self._z.unused_data
        return b"".join(pieces)

    def finish(self) -> bytes:
        self.done = True
        if self._z is None or not self._z.eof:
            raise Rejection(400, Reason.INVALID_BODY, f"the {self._encoding} body ends early", close=True)
        return b""


def _head_bytes(request: web.Request) -> int:
    """The size of the request head as it came: request line and every field line."""
    size = len(request.method) + len(request.raw_path) + 13  # " ", " HTTP/1.1\r\n"
    for name, value in request.raw_headers:
        size += len(name) + len(value) + 4
    return size


def with_query(path: str, raw_path: str) -> str:
    """`path` with the query string of the original request target, untouched."""
    _, sep, query = raw_path.partition("?")
    return f"{path}?{query}" if sep else path


__all__ = ["Intake", "Incoming", "with_query"]
