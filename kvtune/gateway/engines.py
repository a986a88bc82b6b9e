"""Which engine an upstream is: the one name the shared ledger budgets it under.

Gateway replicas write their upstream URLs by hand, and one engine has many spellings
(`http://127.0.0.1:8000`, `…:8000/`, `HTTP://127.0.0.1:8000`, `http://localhost:8000`). Keyed by
the spelling, each would get a whole budget of its own in Redis. So the ledger keys an engine by
its identity: the `engine_id` gateway.yaml gives it (every replica must give the same), else its
canonical URL (scheme and host lowercased, the port always written, no trailing slash; a user or
password is refused when the file is read). Spellings that differ beyond that (another hostname
for the same address) cannot be told apart by their text: each replica registers the addresses
its upstream resolves to, and one that reaches an address registered under another identity is
refused at start (kvtune.gateway.redis_ledger's register_engines).
"""

from __future__ import annotations

import asyncio
import socket

from kvtune.endpoint import parse_url
from kvtune.gateway.config import GatewayUpstream


def canonical_url(url: str) -> str:
    """The URL in one form: lowercase scheme and host, the port written even when it is the
    scheme's default, the path prefix without its trailing slash."""
    server = parse_url(url)
    host = server.host.lower()
    host = f"[{host}]" if ":" in host else host
    return f"{server.scheme.lower()}://{host}:{server.port}{server.prefix}"


def engine_identity(upstream: GatewayUpstream) -> str:
    """The name the shared ledger keeps this upstream's budget under."""
    return upstream.engine_id or canonical_url(upstream.url)


async def resolved_addresses(url: str) -> tuple[str, ...]:
    """Every address:port the URL's host resolves to now, with the URL's path prefix (engines
    behind one router under different prefixes are different engines); none if it does not
    resolve: the identity alone then decides."""
    server = parse_url(url)
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(server.host, server.port, type=socket.SOCK_STREAM)
    except OSError:
        return ()
    out = []
    for family, *_, address in infos:
        ip = str(address[0]).split("%")[0]
        host = f"[{ip}]" if family == socket.AF_INET6 else ip
        out.append(f"{host}:{server.port}{server.prefix}")
    return tuple(sorted(set(out)))


__all__ = ["canonical_url", "engine_identity", "resolved_addresses"]
