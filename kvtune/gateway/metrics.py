"""Prometheus metrics for the gateway, on a registry of its own so several gateways (tests, or two
apps in one process) never collide. Gauges read the ledger at scrape time, so they cannot drift."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from kvtune.gateway.ledger import BlockLedger
from kvtune.gateway.refusals import Reason
from kvtune.gateway.statistical import StatisticalLedger

RETRY_AFTER_BUCKETS_S = (1, 2, 3, 5, 10, 20, 30, 60, 120, 300, 600)


class GatewayMetrics:
    def __init__(self, ledger: BlockLedger, waiting: Callable[[], int]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        Gauge("kvtune_gateway_budget_blocks", "KV blocks the gateway may reserve in total.",
              registry=r).set_function(lambda: ledger.budget_blocks)
        Gauge("kvtune_gateway_reserved_blocks", "KV blocks reserved by admitted requests now.",
              registry=r).set_function(lambda: ledger.reserved_blocks)
        Gauge("kvtune_gateway_inflight_requests", "Admitted requests not yet finished.",
              registry=r).set_function(lambda: ledger.inflight_requests)
        Gauge("kvtune_gateway_waiting_requests", "Requests waiting in the admission queue.",
              registry=r).set_function(waiting)
        if isinstance(ledger, StatisticalLedger):
            Gauge("kvtune_gateway_overflow_probability",
                  "Bound on P(the admitted requests' KV outgrows the budget) now (statistical policy).",
                  registry=r).set_function(ledger.overflow_probability)
        self.admitted = Counter("kvtune_gateway_admitted", "Requests admitted, by route.",
                                ["route"], registry=r)
        self.rejected = Counter("kvtune_gateway_rejected", "Requests refused, by route and reason.",
                                ["route", "reason"], registry=r)
        self.reserved_blocks = Counter("kvtune_gateway_reserved_blocks_granted",
                                       "KV blocks granted to admitted requests, by route.",
                                       ["route"], registry=r)
        self.retry_after = Histogram("kvtune_gateway_retry_after_seconds",
                                     "Retry-After values given with 429 answers.",
                                     buckets=RETRY_AFTER_BUCKETS_S, registry=r)
        self.queue_wait = Histogram("kvtune_gateway_queue_wait_seconds",
                                    "Time admitted requests spent in the wait queue.",
                                    buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60), registry=r)

        # labels() hashes and locks on every call; children are looked up once per label set
        self._admitted: dict[str, tuple] = {}
        self._rejected: dict[tuple[str, Reason], Counter] = {}

    def count_admitted(self, route: str, blocks: int) -> None:
        children = self._admitted.get(route)
        if children is None:
            children = self._admitted[route] = (self.admitted.labels(route), self.reserved_blocks.labels(route))
        children[0].inc()
        children[1].inc(blocks)

    def count_rejected(self, route: str, reason: Reason) -> None:
        child = self._rejected.get((route, reason))
        if child is None:
            child = self._rejected[(route, reason)] = self.rejected.labels(route, reason.value)
        child.inc()

    def exposition(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


__all__ = ["GatewayMetrics"]
