"""The gateway's own endpoints: /healthz, /metrics (Prometheus) and /kvtune/ledger (the same JSON
as the rendered nginx.conf's), and who may read them (gateway.yaml `admin`): loopback clients
only, clients with `Authorization: Bearer $token_env`, or anyone (metrics only).
"""

from __future__ import annotations

import dataclasses
import hmac
import os
from collections.abc import Callable
from typing import Any

from aiohttp import web

from kvtune.domain.admission_policy import AdmissionPolicy, PolicyKind
from kvtune.errors import InputError
from kvtune.gateway.config import Access, AdminAccess, GatewayConfig, RefusalDetail
from kvtune.gateway.flow import FlowGate
from kvtune.gateway.metrics import GatewayMetrics
from kvtune.gateway.pool import UpstreamPool
from kvtune.gateway.shared import SharedLedger

_LOOPBACK = frozenset({"127.0.0.1", "::1", "::ffff:127.0.0.1"})


class Admin:
    """The admin endpoints over one gateway's ledger and metrics. `rejected` and `waiting` are
    read at each request (the gateway's refusal count, the admission queue's length)."""

    def __init__(self, config: GatewayConfig, ledger: UpstreamPool, metrics: GatewayMetrics, *,
                 rejected: Callable[[], int], waiting: Callable[[], int],
                 shared: SharedLedger | None = None, flow: FlowGate | None = None) -> None:
        self.access: AdminAccess = config.admin
        self.ledger = ledger
        self.metrics = metrics
        self._rejected = rejected
        self._waiting = waiting
        self._shared = shared
        self._flow = flow  # the flow-control queue, whose counts /kvtune/ledger shows under `flow`
        self._routes = [r.name for r in config.routes]
        self._policy = config.admission
        self._token: bytes | None = None
        if self.access.token_env is not None:
            token = os.environ.get(self.access.token_env, "")
            if not token:
                raise InputError(f"the environment variable {self.access.token_env} holds no token",
                                 field="admin.token_env")
            self._token = f"Bearer {token}".encode()

    def allowed(self, request: web.Request, access: Access) -> bool:
        """Whether `request` may read an admin endpoint with this access setting."""
        if access is Access.PUBLIC:
            return True
        if access is Access.LOOPBACK:
            return request.remote in _LOOPBACK
        given = request.headers.get("Authorization", "").encode("utf-8", "surrogateescape")
        return self._token is not None and hmac.compare_digest(given, self._token)

    def shows_detail(self, request: web.Request) -> bool:
        """Whether refusals and admissions may tell this client the ledger's figures: only under
        admin.refusal_detail: ledger, to a client admin.ledger lets read the ledger."""
        return self.access.refusal_detail is RefusalDetail.LEDGER and self.allowed(request, self.access.ledger)

    async def healthz(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def metrics_endpoint(self, request: web.Request) -> web.Response:
        """The gateway's Prometheus metrics (budget, reserved and in-flight blocks, admissions and
        refusals by route and reason; with the redis ledger each upstream's totals over every
        replica, read from the store at scrape time); who may read them is admin.metrics."""
        if not self.allowed(request, self.access.metrics):
            raise web.HTTPForbidden()
        if self._shared is not None:  # every replica's totals, read from the store now
            self.metrics.set_shared([u.url for u in self.ledger.replicas], await self._shared.snapshot())
        payload, content_type = self.metrics.exposition()
        return web.Response(body=payload, headers={"Content-Type": content_type})

    async def ledger_endpoint(self, request: web.Request) -> web.Response:
        """The same JSON as the rendered nginx.conf's /kvtune/ledger, plus `upstreams`: each one's
        url, budget, reserved, inflight, healthy (its probe), ejected, passive_ejections and
        ejection_s (passive health: ejected now, how many times, for how long the last time); the
        totals count the routed upstreams' budgets (0 with every one down, which budget_note then
        says), and what is held on all of them; who may read it is admin.ledger. With the redis
        ledger, each upstream's reserved and inflight are every gateway replica's together, read
        from the store (this replica's own while it is unavailable), and `ledger` says how."""
        if not self.allowed(request, self.access.ledger):
            raise web.HTTPForbidden()
        snap = self.ledger.snapshot()
        upstreams: list[dict[str, Any]] = [
            {"url": u.url, "budget": u.ledger.budget_blocks, "reserved": u.ledger.reserved_blocks,
             "inflight": u.ledger.inflight_requests, "healthy": u.healthy, "ejected": u.ejected,
             "passive_ejections": u.passive_ejections, "ejection_s": u.ejection_s} for u in self.ledger.replicas]
        extra = {}
        if self._shared is not None:
            shared = await self._shared.snapshot()
            for item, replica in zip(upstreams, self.ledger.replicas, strict=True):
                held = shared.get(replica.url) if shared is not None else None
                item["shared"] = held is not None
                if held is not None:
                    item["reserved"], item["inflight"] = held.reserved_blocks, held.inflight_requests
                    if held.overflow_probability is not None:  # statistical: the bound over every replica
                        item["overflow_probability"] = held.overflow_probability
            if shared is not None:
                shared_p = [held.overflow_probability for held in shared.values()
                            if held.overflow_probability is not None]
                snap = dataclasses.replace(snap, reserved_blocks=sum(int(u["reserved"]) for u in upstreams),
                                           inflight_requests=sum(int(u["inflight"]) for u in upstreams),
                                           overflow_probability=max(shared_p) if shared_p else
                                           snap.overflow_probability)
            extra["ledger"] = self._shared.describe()
        every_down = self.ledger.checked and not self.ledger.usable()
        return web.json_response({
            "reserved": snap.reserved_blocks, "budget": snap.budget_blocks, "inflight": snap.inflight_requests,
            "budget_note": EVERY_UPSTREAM_DOWN if every_down else None,
            "rejected": self._rejected(), "waiting": self._waiting(),
            "release_rate_blocks_per_s": snap.release_rate_blocks_per_s,
            "routes": self._routes,
            **ledger_policy(self._policy, snap.limit_blocks, snap.overflow_probability),
            "upstreams": upstreams,
            **extra,
            **({"flow": self._flow.report()} if self._flow is not None else {}),
        })

    def add_routes(self, router: web.UrlDispatcher) -> None:
        router.add_get("/healthz", self.healthz)
        router.add_get("/metrics", self.metrics_endpoint)
        router.add_get("/kvtune/ledger", self.ledger_endpoint)


# /kvtune/ledger's budget_note when the usable budget is 0 because no upstream is healthy (the
# rendered nginx.conf says the same).
EVERY_UPSTREAM_DOWN = ("every upstream is down (health check failed or connection refused): "
                       "no budget is usable until one answers its health check with 200")


def ledger_policy(policy: AdmissionPolicy, limit_blocks: int, overflow_probability: float | None) -> dict:
    """/kvtune/ledger's policy members, the same in both enforcers: the policy, its factor and
    epsilon (null where they do not apply), what reservations are held against (null for
    statistical, which is bound by probability) and the current overflow probability (statistical)."""
    statistical = policy.kind is PolicyKind.STATISTICAL
    return {
        "policy": policy.name,
        "factor": policy.factor if policy.kind is PolicyKind.OVERCOMMIT else None,
        "epsilon": policy.epsilon if statistical else None,
        "limit": None if statistical else limit_blocks,
        "overflow_probability": overflow_probability if statistical else None,
    }


__all__ = ["Admin", "EVERY_UPSTREAM_DOWN", "ledger_policy"]
