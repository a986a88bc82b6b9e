"""Server URLs (one rule, one wording) and the bounded GET, over real loopback HTTP."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from fake_vllm import FakeVllm

from kvtune.endpoint import ServerUrl, get, get_ok, parse_url, server_root
from kvtune.errors import EndpointError, InputError


@pytest.mark.parametrize(("url", "root"), [
    ("http://127.0.0.1:8000", "http://127.0.0.1:8000"),
    ("http://127.0.0.1:8000/", "http://127.0.0.1:8000"),
    ("  http://127.0.0.1:8000/  ", "http://127.0.0.1:8000"),
    ("http://127.0.0.1:8000/metrics", "http://127.0.0.1:8000"),
    ("http://127.0.0.1:8000/metrics/", "http://127.0.0.1:8000"),
    ("https://llm.example/vllm/metrics", "https://llm.example/vllm"),
    ("http://h:1/v1", "http://h:1"),
    ("http://h:1/v1/", "http://h:1"),
    ("http://h:1/v1/models", "http://h:1"),
    ("http://h:1/api/v1", "http://h:1/api"),
    ("http://h:80/metrics", "http://h"),
    ("http://[::1]:8000/v1", "http://[::1]:8000"),
])
def test_server_root(url, root):
    assert server_root(url) == root


@pytest.mark.parametrize(("url", "message"), [
    ("127.0.0.1:8000", "URL: must look like http://host:port, got '127.0.0.1:8000'"),
    ("ftp://h/metrics", "URL: must look like http://host:port, got 'ftp://h/metrics'"),
    ("http://", "URL: must look like http://host:port, got 'http://'"),
    ("http://h:0", "URL: the port must be a number from 1 to 65535, got 'http://h:0'"),
    ("http://h:99999/metrics", "URL: the port must be a number from 1 to 65535, got 'http://h:99999/metrics'"),
    ("http://u:p@h:1", "URL: a user or password in the URL is not supported, got 'http://u:***@h:1'"),
    ("http://h:1/metrics?x=1", "URL: a query or fragment in the URL is not supported, got 'http://h:1/metrics?x=1'"),
    ("http://a b:1", "URL: expected a hostname or IP address such as 127.0.0.1, 0.0.0.0 or ::1, got 'a b'"),
])
def test_a_url_that_names_no_server_is_one_input_error(url, message):
    with pytest.raises(InputError) as info:
        server_root(url, field="URL")
    assert str(info.value) == message


def test_parse_url_parts():
    assert parse_url("https://Vllm.Internal") == ServerUrl("https", "vllm.internal", 443)
    v6 = parse_url("http://[::1]:9000/prefix/")
    assert (v6.host, v6.port, v6.prefix, v6.host_port, v6.netloc) == ("::1", 9000, "/prefix", "[::1]:9000", "[::1]:9000")
    assert parse_url("http://h:80").netloc == "h" and parse_url("http://h:80").host_port == "h:80"


def test_a_prefix_can_be_refused():
    assert parse_url("http://h:1/", allow_prefix=False).prefix == ""
    with pytest.raises(InputError) as info:
        parse_url("http://h:1/v1", field="upstream", allow_prefix=False)
    assert str(info.value) == "upstream: must look like http://host:port, got 'http://h:1/v1'"


async def _get(url: str, **kwargs):
    async with aiohttp.ClientSession() as session:
        return await get(session, url, **{"timeout_s": 5, "max_bytes": 100, **kwargs})


def test_get_returns_any_status_and_get_ok_only_200():
    with FakeVllm(routes={"/a": (200, "text/plain", b"hello"), "/b": (503, "text/plain", b"busy")}, routes_only=True) as fake:
        base = fake.url
        ok, busy = asyncio.run(_get(f"{base}/a")), asyncio.run(_get(f"{base}/b"))

        async def only_ok():
            async with aiohttp.ClientSession() as session:
                return await get_ok(session, f"{base}/b", timeout_s=5, max_bytes=100, field="URL")

        with pytest.raises(EndpointError) as info:
            asyncio.run(only_ok())
    assert (ok.status, ok.text, busy.status, busy.body) == (200, "hello", 503, b"busy")
    assert str(info.value) == f"{base}/b: URL: HTTP 503 Service Unavailable"


def test_get_is_bounded_in_size_and_time():
    with FakeVllm(routes={"/big": (200, "text/plain", b"x" * 101)}, routes_only=True) as fake:
        base = fake.url
        with pytest.raises(EndpointError) as info:
            asyncio.run(_get(f"{base}/big"))
    assert str(info.value) == f"{base}/big: response larger than 100 bytes"
    with FakeVllm(routes={"/slow": (200, "text/plain", b"x")}, routes_only=True, delay_s=2.0) as fake:
        base = fake.url
        with pytest.raises(EndpointError) as info:
            asyncio.run(_get(f"{base}/slow", timeout_s=0.3))
    assert str(info.value) == f"{base}/slow: no complete answer within the timeout"


def test_get_from_nowhere():
    with FakeVllm(routes={}, routes_only=True) as fake:
        base = fake.url
        # closed again: its port refuses
    with pytest.raises(EndpointError) as info:
        asyncio.run(_get(f"{base}/metrics", field="--metrics-url"))
    assert str(info.value).startswith(f"{base}/metrics: --metrics-url: cannot reach: ")
