"""Prometheus metrics for the gateway, on a registry of its own so several gateways (tests, or two
apps in one process) never collide. Gauges read the ledgers at scrape time, so they cannot drift:
the totals unlabelled (as before several upstreams), each upstream's own under
`kvtune_gateway_upstream_*{upstream="URL"}`."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from kvtune.domain.flow_control import WAIT_BUCKETS_S
from kvtune.gateway.flow import OTHER, FlowCounts, FlowGate
from kvtune.gateway.pool import Replica, UpstreamPool
from kvtune.gateway.refusals import Reason
from kvtune.gateway.shared import MODES
from kvtune.gateway.statistical import StatisticalLedger

if TYPE_CHECKING:
    from kvtune.gateway.ledger import LedgerSnapshot
    from kvtune.gateway.redis_ledger import RedisLedger
    from kvtune.gateway.shared import SharedLedger

RETRY_AFTER_BUCKETS_S = (1, 2, 3, 5, 10, 20, 30, 60, 120, 300, 600)


class GatewayMetrics:
    def __init__(self, ledger: UpstreamPool, waiting: Callable[[], int]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        Gauge("kvtune_gateway_budget_blocks", "KV blocks the gateway may reserve in total (its healthy upstreams').",
              registry=r).set_function(lambda: ledger.budget_blocks)
        Gauge("kvtune_gateway_reserved_blocks", "KV blocks reserved by admitted requests now.",
              registry=r).set_function(lambda: ledger.reserved_blocks)
        Gauge("kvtune_gateway_inflight_requests", "Admitted requests not yet finished.",
              registry=r).set_function(lambda: ledger.inflight_requests)
        Gauge("kvtune_gateway_waiting_requests", "Requests waiting in the admission queue.",
              registry=r).set_function(waiting)
        if ledger.statistical:
            Gauge("kvtune_gateway_overflow_probability",
                  "Bound on P(the admitted requests' KV outgrows the budget) now, the largest of the upstreams' "
                  "(statistical policy).", registry=r).set_function(ledger.overflow_probability)
        self._upstream_gauges(ledger.replicas)
        self.sent = Counter("kvtune_gateway_upstream_requests", "Admitted requests sent to each upstream.",
                            ["upstream"], registry=r)
        self.retried = Counter("kvtune_gateway_upstream_retried",
                               "Admitted requests that could not connect to this upstream and were admitted again "
                               "for another.", ["upstream"], registry=r)
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
        self._sent: dict[str, Counter] = {}
        self._shared_gauges: dict[str, Gauge] = {}  # with a shared ledger (add_ledger_gauges)

    def _upstream_gauges(self, replicas: tuple[Replica, ...]) -> None:
        r = self.registry
        gauges: list[tuple[str, str, Callable[[Replica], float]]] = [
            ("budget_blocks", "KV blocks this upstream's ledger may reserve.", lambda u: u.ledger.budget_blocks),
            ("reserved_blocks", "KV blocks reserved on this upstream now.", lambda u: u.ledger.reserved_blocks),
            ("inflight_requests", "Admitted requests held on this upstream now.",
             lambda u: u.ledger.inflight_requests),
            ("healthy", "1 while its health probe passes, 0 while it is taken out.",
             lambda u: 1.0 if u.healthy else 0.0),
            ("ejections", "Times this upstream was taken out (failed connect or health probe).",
             lambda u: u.ejections),
            ("ejected", "1 while passive health ejects this upstream (consecutive 5xx or failed connections).",
             lambda u: 1.0 if u.ejected else 0.0),
            ("passive_ejections", "Times passive health ejected this upstream (consecutive 5xx or failed "
             "connections).", lambda u: u.passive_ejections),
        ]
        if isinstance(replicas[0].ledger, StatisticalLedger):
            gauges.append(("overflow_probability", "Bound on P(this upstream's admitted KV outgrows its budget).",
                           _overflow_probability))
        for name, doc, read in gauges:
            gauge = Gauge(f"kvtune_gateway_upstream_{name}", doc, ["upstream"], registry=r)
            for replica in replicas:
                gauge.labels(replica.url).set_function(functools.partial(read, replica))

    def add_ledger_gauges(self, shared: SharedLedger | None) -> None:
        """kvtune_gateway_ledger_mode{mode}: 1 for the mode admission runs in now (memory; redis;
        local or unavailable while Redis does not answer), with the shared store's own counts."""
        r = self.registry
        mode = Gauge("kvtune_gateway_ledger_mode", "1 for how reservations are recorded now: memory (this process), "
                     "redis (shared), local (Redis unavailable: a static slice of each budget), unavailable "
                     "(Redis unavailable: 503).", ["mode"], registry=r)
        if shared is None:
            mode.labels("memory").set(1)
            return
        for name in MODES[1:]:
            mode.labels(name).set_function(functools.partial(_is_mode, shared, name))
        store = shared.store
        for name, doc, read in (
                ("available", "1 while the last call to the shared ledger (Redis) succeeded.",
                 lambda: 1.0 if store.available else 0.0),
                ("errors", "Calls to the shared ledger that failed or timed out (a counter).", lambda: store.errors),
                ("leases_lost", "Times this replica found its lease expired and its reservations reclaimed.",
                 lambda: store.leases_lost),
                ("reclaimed", "Reservations of expired gateway replicas this replica's calls reclaimed.",
                 lambda: store.reclaimed),
                ("pending_releases", "Releases queued until the shared ledger answers.",
                 lambda: store.pending_releases),
                ("local_admitted", "Requests admitted on the static local slice while Redis was unavailable "
                 "(a counter).", lambda: shared.local_admitted),
                ("unregistered", "In-flight requests the shared ledger does not count: they no longer fit when "
                 "this replica's lost lease was taken again (held again once they fit).",
                 lambda: store.unregistered)):
            Gauge(f"kvtune_gateway_ledger_{name}", doc, registry=r).set_function(read)
        r.register(_LeaseCounters(store))
        self._shared_gauges = {
            name: Gauge(f"kvtune_gateway_upstream_shared_{name}", doc, ["upstream"], registry=r)
            for name, doc in (
                ("reserved_blocks", "KV blocks reserved on this upstream by every gateway replica, read from the "
                 "shared ledger at scrape time (NaN while it does not answer)."),
                ("inflight_requests", "Requests held on this upstream by every gateway replica, read from the "
                 "shared ledger at scrape time (NaN while it does not answer)."),
                ("overflow_probability", "statistical: bound on P(the KV every gateway replica admitted to this "
                 "upstream outgrows its budget), computed by the shared ledger at scrape time (NaN while it does "
                 "not answer)."))
            if name != "overflow_probability" or isinstance(shared.pool.replicas[0].ledger, StatisticalLedger)}

    def set_shared(self, urls: Iterable[str], held: Mapping[str, LedgerSnapshot] | None) -> None:
        """The shared ledger's totals for each upstream, as just read from the store (None: it did
        not answer, and every shared gauge reads NaN rather than a stale figure)."""
        for url in urls:
            snap = held.get(url) if held is not None else None
            values = {"reserved_blocks": snap.reserved_blocks if snap else math.nan,
                      "inflight_requests": snap.inflight_requests if snap else math.nan,
                      "overflow_probability": (snap.overflow_probability if snap and snap.overflow_probability
                                               is not None else math.nan)}
            for name, gauge in self._shared_gauges.items():
                gauge.labels(url).set(values[name])

    def count_sent(self, upstream: str) -> None:
        child = self._sent.get(upstream)
        if child is None:
            child = self._sent[upstream] = self.sent.labels(upstream)
        child.inc()

    def count_retried(self, upstream: str) -> None:
        self.retried.labels(upstream).inc()

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

    def add_flow(self, gate: FlowGate) -> None:
        """kvtune_gateway_flow_*{band, flow}: the flow-control queue's counts, read at scrape time."""
        self.registry.register(_FlowCounters(gate))

    def exposition(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class _FlowCounters(Collector):
    """Per band and flow (the band's metrics_flows flows with the most traffic, the rest as
    `other`): waiting, admitted, shed at arrival, timed out, the wait (docs/guides/flow-control.md)."""

    def __init__(self, gate: FlowGate) -> None:
        self.gate = gate

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily | HistogramMetricFamily]:
        gate = self.gate
        waiting = GaugeMetricFamily("kvtune_gateway_flow_waiting", "Requests waiting in the flow-control queue.",
                                    labels=["band", "flow"])
        admitted = CounterMetricFamily("kvtune_gateway_flow_admitted", "Requests admitted, at once or after a wait.",
                                       labels=["band", "flow"])
        shed = CounterMetricFamily("kvtune_gateway_flow_shed", "Requests answered 429 at arrival.",
                                   labels=["band", "flow", "reason"])
        timed_out = CounterMetricFamily("kvtune_gateway_flow_timed_out",
                                        "Waiters whose band's deadline passed (429 queue_timeout).",
                                        labels=["band", "flow"])
        wait = HistogramMetricFamily("kvtune_gateway_flow_wait_seconds",
                                     "Time admitted requests waited (0 when admitted at once).",
                                     labels=["band", "flow"])
        kept = GaugeMetricFamily("kvtune_gateway_flow_kept_blocks",
                                 "Blocks a band's requests leave free for the bands above it (its reserve).",
                                 labels=["band"])
        for index, band in enumerate(gate.band_names):
            kept.add_metric([band], gate.kept_blocks(index))
            top, other = gate.top_flows(index)
            by_flow = gate.waiting_by_flow(index)
            named = {f.name for f in top}
            rows: list[tuple[str, FlowCounts, int]] = [(f.name, f.counts, by_flow.get(f.name, 0)) for f in top]
            rows.append((OTHER, other, sum(n for name, n in by_flow.items() if name not in named)))
            for name, counts, n in rows:
                labels = [band, name]
                waiting.add_metric(labels, n)
                admitted.add_metric(labels, counts.admitted)
                shed.add_metric([*labels, "deadline_unreachable"], counts.shed_deadline)
                shed.add_metric([*labels, "queue_full"], counts.shed_full)
                timed_out.add_metric(labels, counts.timed_out)
                buckets = counts.wait_buckets or [0] * (len(WAIT_BUCKETS_S) + 1)
                running, cumulative = 0, []
                for edge, count in zip([*map(str, WAIT_BUCKETS_S), "+Inf"], buckets, strict=True):
                    running += count
                    cumulative.append((edge, running))
                wait.add_metric(labels, cumulative, counts.wait_sum_s)
        yield from (waiting, admitted, shed, timed_out, wait, kept)


class _LeaseCounters(Collector):
    """The shared store's lease counters as Prometheus counters (read at scrape time)."""

    def __init__(self, store: RedisLedger) -> None:
        self.store = store

    def collect(self) -> Iterator[CounterMetricFamily]:
        store = self.store
        for name, doc, value in (
                ("lease_lost", "Times this replica found its lease expired (its reservations swept by another).",
                 store.leases_lost),
                ("reregistered", "In-flight requests held again in the shared ledger after a lost lease.",
                 store.reregistered),
                ("reregister_over", "In-flight requests that no longer fit when their lost lease was taken again "
                 "(they run on, uncounted until they fit).", store.reregister_over)):
            yield CounterMetricFamily(f"kvtune_gateway_ledger_{name}", doc, value=value)


def _is_mode(shared: SharedLedger, name: str) -> float:
    return 1.0 if shared.mode == name else 0.0


def _overflow_probability(replica: Replica) -> float:
    ledger = replica.ledger
    return ledger.overflow_probability() if isinstance(ledger, StatisticalLedger) else 0.0


__all__ = ["GatewayMetrics"]
