"""A server's URL, and the one way kvtune reads a page from a server.

Every URL that names a server passes `url_problem`, so each is refused in the same words: the
ones kvtune reads (`calibrate URL`, `--metrics-url`, `bench URL`), the upstreams the gateway
forwards to (gateway.yaml, `--upstream`) and the upstream rendered into nginx.conf. The shape is
http(s)://host[:port][/path prefix] with no user, password, query or fragment: a credential in
a URL would be written into capacity files and error lines, and a query would be dropped.

`server_root` finds the server from its root or one of its pages (/metrics, /v1, /v1/models).
`get` is the bounded GET every server read goes through: a timeout, a size cap, and each
failure one EndpointError line naming the URL.
"""

from __future__ import annotations

import asyncio
import ipaddress
import re
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from kvtune.errors import EndpointError, InputError
from kvtune.masking import redact
from kvtune.userfiles import brief

MAX_PORT = 65535
# Pages of an OpenAI-compatible server whose URL names the server too.
SERVER_PAGES = ("/metrics", "/v1/models", "/v1")

_HOST_LABEL = re.compile(r"(?!-)[A-Za-z0-9_-]{1,63}(?<!-)")
_URL_PATH = re.compile(r"(/[A-Za-z0-9._~!$&'()*+,;=:@%-]*)*")
_CHUNK_BYTES = 64 * 1024


def host_problem(host: str) -> str | None:
    """Why `host` is not an IP address or a hostname to listen on or connect to, or None."""
    try:
        ipaddress.ip_address(host)
        return None
    except ValueError:
        pass
    labels = host[:-1].split(".") if host.endswith(".") else host.split(".")
    if len(host) > 253 or not all(_HOST_LABEL.fullmatch(label) for label in labels):
        return f"expected a hostname or IP address such as 127.0.0.1, 0.0.0.0 or ::1, got {brief(host)}"
    return None


def url_problem(url: str) -> str | None:
    """Why `url` is not http(s)://host[:port][/path prefix] (no user, query or fragment), or None."""
    shape = f"must look like http://host:port, got {brief(redact(url))}"
    try:
        parts = urlsplit(url)
    except ValueError:  # e.g. an unclosed [ around an IPv6 address
        return shape
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return shape
    try:
        port = parts.port
    except ValueError:
        port = 0
    if port == 0:
        return f"the port must be a number from 1 to {MAX_PORT}, got {brief(redact(url))}"
    if parts.username is not None or parts.password is not None:
        return f"a user or password in the URL is not supported, got {brief(redact(url))}"
    if parts.query or parts.fragment or url.endswith(("?", "#")):
        return f"a query or fragment in the URL is not supported, got {brief(redact(url))}"
    if not _URL_PATH.fullmatch(parts.path):
        return f"the path may hold only URL characters (no spaces or control characters), got {brief(redact(url))}"
    return host_problem(parts.hostname)


@dataclass(frozen=True, slots=True)
class ServerUrl:
    """A server's address: scheme, host, port and the path prefix it answers under."""

    scheme: str
    host: str  # a hostname or IP address; an IPv6 address without brackets
    port: int  # the one written, else the scheme's default
    prefix: str = ""  # no trailing slash; "" at the root

    @property
    def _host(self) -> str:
        return f"[{self.host}]" if ":" in self.host else self.host

    @property
    def host_port(self) -> str:
        return f"{self._host}:{self.port}"

    @property
    def netloc(self) -> str:
        """host[:port] as a Host header or URL writes it: the port only when it is not the default."""
        return self._host if self.port == _default_port(self.scheme) else self.host_port

    @property
    def root(self) -> str:
        return f"{self.scheme}://{self.netloc}{self.prefix}"


def _default_port(scheme: str) -> int:
    return 443 if scheme == "https" else 80


def parse_url(url: str, *, field: str | None = None, allow_prefix: bool = True) -> ServerUrl:
    """A server URL as its parts, or an InputError saying what is wrong with it."""
    problem = url_problem(url)
    if problem is None and not allow_prefix and urlsplit(url).path not in ("", "/"):
        problem = f"must look like http://host:port, got {brief(redact(url))}"
    if problem is not None:
        raise InputError(problem, field=field)
    parts = urlsplit(url)
    assert parts.hostname is not None  # url_problem checked it
    return ServerUrl(parts.scheme, parts.hostname, parts.port or _default_port(parts.scheme),
                     parts.path.rstrip("/"))


def server_root(url: str, *, field: str | None = None) -> str:
    """The server's base URL (no trailing slash) from its root, its /metrics, /v1 or /v1/models URL."""
    server = parse_url(url.strip(), field=field)
    for page in SERVER_PAGES:
        if server.prefix.endswith(page):
            return f"{server.scheme}://{server.netloc}{server.prefix.removesuffix(page)}"
    return server.root


@dataclass(frozen=True, slots=True)
class Page:
    """One answer to a GET: its status and whole body."""

    url: str
    status: int
    reason: str
    body: bytes

    @property
    def text(self) -> str:
        return self.body.decode("utf-8", errors="replace")


async def get(session: Any, url: str, *, timeout_s: float, max_bytes: int, accept: str = "*/*",
              field: str | None = None) -> Page:
    """GET `url` over `session` (aiohttp): the answer whatever its status, or an EndpointError
    when there is none in `timeout_s`, the server cannot be reached, or the body exceeds `max_bytes`."""
    import aiohttp

    try:
        async with asyncio.timeout(timeout_s):
            async with session.get(url, headers={"Accept": accept}, allow_redirects=True) as response:
                body = bytearray()
                async for chunk in response.content.iter_chunked(_CHUNK_BYTES):
                    body += chunk
                    if len(body) > max_bytes:
                        raise EndpointError(f"response larger than {max_bytes:,} bytes", path=url, field=field)
                return Page(url, response.status, response.reason or "", bytes(body))
    except TimeoutError:
        raise EndpointError("no complete answer within the timeout", path=url, field=field) from None
    except aiohttp.ClientConnectorError as exc:
        reason = exc.os_error.strerror or exc.os_error
        raise EndpointError(f"cannot reach: {reason}", path=url, field=field) from None
    except (aiohttp.ClientError, OSError) as exc:
        raise EndpointError(f"cannot reach: {exc}", path=url, field=field) from None


async def get_ok(session: Any, url: str, *, timeout_s: float, max_bytes: int, accept: str = "*/*",
                 field: str | None = None) -> bytes:
    """The body of a 200 answer to GET `url`; any other status is an EndpointError too."""
    page = await get(session, url, timeout_s=timeout_s, max_bytes=max_bytes, accept=accept, field=field)
    if page.status != 200:
        raise EndpointError(f"HTTP {page.status} {page.reason}".strip(), path=url, field=field)
    return page.body


def parse_upstream(url: str) -> ServerUrl:
    """http(s)://host[:port][/]: the upstream is interpolated into nginx.conf and the vllm serve
    command, so anything else (a path, a user, a query) is refused by parse_url's one rule."""
    return parse_url(url, field="upstream", allow_prefix=False)


__all__ = ["MAX_PORT", "ServerUrl", "Page", "host_problem", "url_problem", "parse_url", "parse_upstream",
           "server_root", "get",
           "get_ok"]
