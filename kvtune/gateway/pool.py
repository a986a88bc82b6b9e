"""Several engine replicas behind one gateway, each with its own KV block budget and ledger.

Each upstream of gateway.yaml (`upstreams:`, or the single `upstream:`) is a Replica: its URL,
its ledger of the gateway's admission policy (guaranteed, overcommit or statistical, over its own
budget) and whether it is healthy. The UpstreamPool stands where one ledger stood: the admission
gate (kvtune.gateway.gate) asks it to reserve, and it places the reservation on one replica:
  * routing: among the healthy replicas, the reservation is tried on the one with the most free
    budget (limit − reserved, times its weight), ties going to the fewest in flight, then the
    next; it fits nowhere: the gate queues it or answers 429, with the Retry-After of the
    replica expected to free room first;
  * a reservation is held on its replica's ledger, which `replica_of` names, and released there
    once (Reservation.release), waking the gate's waiters, who may land on any replica;
  * sticky (gateway.yaml `sticky`, off by default): a request with a key (the body's `user`, or
    a header) is tried first on the replica its key hashes to among the healthy ones (prefix-cache
    affinity), when nobody waits, then as above;
  * health (kvtune.gateway.proxy): a failed connect, or a periodic GET /health answered other
    than 200, takes a replica out, and its budget with it; a 200 brings it back and wakes the
    gate;
  * passive health (outlier detection, gateway.yaml `health.consecutive_failures`): every answer
    is an outcome (`record`): a 5xx or a failed connection adds to the replica's run of failures,
    anything else ends it; a run of consecutive_failures ejects the replica for a while that
    doubles with each ejection in a row (HealthProbe.ejection_for_s), whatever /health says. The
    caller brings it back (`readmit`) when that while is over; the pool keeps no clock. At most
    max_ejected_share of the replicas (one at least) are ejected at once, and never the last
    one routed to. When no replica is healthy, all are routed to as if they were (a request then fails
    with the upstream's own error, as with one upstream, instead of waiting for a budget that no
    longer counts). With a single upstream nothing is probed or taken out: there is nowhere else
    to send.

The pool never builds a ledger itself: `make_ledger(upstream)` (default `local_ledger`, in
memory) returns each replica's BlockLedger. The ledger several gateway replicas share (gateway.yaml
`ledger.backend: redis`, kvtune.gateway.shared) keeps these local ledgers for the gate's decision
and confirms each grant in Redis (kvtune.gateway.admission).

Pure and synchronous, like the ledgers: no aiohttp, no clock of its own.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Callable, Sequence

from kvtune.domain.demand import Demand
from kvtune.gateway.config import GatewayConfig, GatewayUpstream
from kvtune.gateway.gate import ledger_for
from kvtune.gateway.ledger import BlockLedger, LedgerSnapshot, Reservation
from kvtune.gateway.statistical import StatisticalLedger

#: Builds one upstream's ledger: the in-memory one (local_ledger), or a shared store's.
LedgerFactory = Callable[[GatewayConfig, GatewayUpstream], BlockLedger]


def local_ledger(config: GatewayConfig, upstream: GatewayUpstream) -> BlockLedger:
    """The upstream's ledger of the config's policy, in this process's memory."""
    return ledger_for(config.admission, upstream.block_budget, block_size=config.block_size,
                      max_model_len=config.max_model_len)


class Replica:
    """One upstream: its URL and weight, its ledger, whether requests are routed to it."""

    __slots__ = ("url", "weight", "ledger", "index", "healthy", "ejections", "why", "failures", "ejected",
                 "passive_ejections", "ejected_in_a_row", "ejection_s")

    def __init__(self, upstream: GatewayUpstream, ledger: BlockLedger, index: int) -> None:
        self.url = upstream.url
        self.weight = upstream.weight
        self.ledger = ledger
        self.index = index
        self.healthy = True
        self.ejections = 0  # times it was taken out
        self.why = ""  # why it was last taken out
        self.failures = 0  # consecutive 5xx or failed connections (passive health)
        self.ejected = False  # ejected by passive health, until readmitted
        self.passive_ejections = 0  # times ejected by passive health
        self.ejected_in_a_row = 0  # ejections with no success between them: the back-off's exponent
        self.ejection_s = 0.0  # how long its last passive ejection lasts

    @property
    def routed(self) -> bool:
        """In the routing set: healthy by its probe and not ejected by passive health."""
        return self.healthy and not self.ejected

    @property
    def score(self) -> float:
        """Free budget, times the weight: the most goes first."""
        return (self.ledger.limit_blocks - self.ledger.reserved_blocks) * self.weight


class UpstreamPool:
    """Every replica's ledger behind the one interface the admission gate reserves through
    (try_reserve, never_fits, retry_after_s), with the totals /kvtune/ledger and /metrics show."""

    def __init__(self, config: GatewayConfig, make_ledger: LedgerFactory = local_ledger) -> None:
        self.health = config.health
        self.replicas = tuple(Replica(u, make_ledger(config, u), i) for i, u in enumerate(config.upstreams))
        self._by_ledger = {id(r.ledger): r for r in self.replicas}
        self._by_url = {r.url: r for r in self.replicas}
        self._turn = itertools.count()
        # called when a replica comes back (the gate's waiters may fit now)
        self.on_capacity: Callable[[], None] | None = None

    # ---------------------------------------------------------------- which replicas

    @property
    def checked(self) -> bool:
        """Whether replicas are taken out and brought back at all (more than one)."""
        return len(self.replicas) > 1

    def routable(self) -> Sequence[Replica]:
        """The healthy replicas not ejected; every one when none is."""
        if len(self.replicas) == 1:
            return self.replicas
        healthy = [r for r in self.replicas if r.routed]
        return healthy or self.replicas

    def usable(self) -> Sequence[Replica]:
        """The replicas in service (healthy by their probe, not ejected by passive health), none
        when every one is down: what the budget totals count (the routing still tries every one
        then, but no budget of theirs is there to admit against)."""
        if len(self.replicas) == 1:
            return self.replicas
        return [r for r in self.replicas if r.routed]

    def replica(self, url: str) -> Replica:
        return self._by_url[url]

    def replica_of(self, reservation: Reservation) -> Replica:
        """The replica a reservation is held on."""
        return self._by_ledger[id(reservation.ledger)]

    def next_url(self) -> str:
        """A routable replica in turn: where a prompt is counted, an untouched request forwarded."""
        if len(self.replicas) == 1:
            return self.replicas[0].url
        routable = self.routable()
        return routable[next(self._turn) % len(routable)].url

    def affine(self, key: str) -> Replica:
        """The routable replica a sticky key belongs to (rendezvous hashing: the highest hash of
        key and URL), so a key moves only when its replica goes out or another comes back."""
        return max(self.routable(), key=lambda r: _rank(key, r.url))

    def others_healthy(self, replica: Replica) -> bool:
        """Whether another replica than this one is routed to: somewhere to retry."""
        return any(r.routed and r is not replica for r in self.replicas)

    def mark_down(self, replica: Replica, why: str) -> bool:
        """Take the replica out (a failed connect or probe); True when it was in."""
        if not self.checked or not replica.healthy:
            return False
        replica.healthy = False
        replica.ejections += 1
        replica.why = why
        return True

    def mark_up(self, replica: Replica) -> bool:
        """Bring it back (a probe answered 200); True when it was out. The gate is woken."""
        if replica.healthy:
            return False
        replica.healthy = True
        if self.on_capacity is not None:
            self.on_capacity()
        return True

    def record(self, replica: Replica, failed: bool) -> float | None:
        """One answer's outcome on `replica` (failed: a 5xx or a failed connection). Returns how
        many seconds it is ejected for when this outcome ejects it, else None."""
        if not failed:
            replica.failures = 0
            if not replica.ejected:
                replica.ejected_in_a_row = 0
            return None
        if replica.ejected:
            return None  # a straggler sent before the ejection: its next run starts after it
        replica.failures += 1
        limit = self.health.consecutive_failures
        if not self.checked or limit == 0 or replica.failures < limit:
            return None
        ejected = sum(1 for r in self.replicas if r.ejected)
        others_routed = any(r.routed for r in self.replicas if r is not replica)
        if not others_routed or not self.health.may_eject(len(self.replicas), ejected):
            return None  # the last one routed to, or the share is reached: it stays
        replica.failures = 0
        replica.ejected = True
        replica.passive_ejections += 1
        replica.ejected_in_a_row += 1
        replica.ejection_s = self.health.ejection_for_s(replica.ejected_in_a_row)
        return replica.ejection_s

    def readmit(self, replica: Replica) -> bool:
        """Its ejection is over: routed to again (if healthy), the gate woken; True when it was out."""
        if not replica.ejected:
            return False
        replica.ejected = False
        if self.on_capacity is not None:
            self.on_capacity()
        return True

    # ---------------------------------------------------------------- what the gate asks

    def try_reserve(self, blocks: int, demand: Demand | None = None, keep_blocks: int = 0) -> Reservation | None:
        """Hold `blocks` on the routable replica with the most free budget where they fit (each
        leaving `keep_blocks` of its own free: flow control's reserve)."""
        if len(self.replicas) == 1:
            return self.replicas[0].ledger.try_reserve(blocks, demand, keep_blocks)
        order = sorted(self.routable(), key=lambda r: (-r.score, r.ledger.inflight_requests, r.index))
        for replica in order:
            reservation = replica.ledger.try_reserve(blocks, demand, keep_blocks)
            if reservation is not None:
                return reservation
        return None

    def never_fits(self, blocks: int, demand: Demand | None = None) -> bool:
        """No replica could ever hold it, however empty (413)."""
        return all(r.ledger.never_fits(blocks, demand) for r in self.replicas)

    def retry_after_s(self, blocks: int, *, min_s: int, max_s: int) -> int:
        """The shortest Retry-After among the routable replicas that could ever hold it."""
        fit = [r for r in self.routable() if not r.ledger.never_fits(blocks)] or self.routable()
        return min(r.ledger.retry_after_s(blocks, min_s=min_s, max_s=max_s) for r in fit)

    # ---------------------------------------------------------------- totals

    @property
    def reserved_blocks(self) -> int:
        """Held on every replica, taken out or not (they are released where they are held)."""
        return sum(r.ledger.reserved_blocks for r in self.replicas)

    @property
    def inflight_requests(self) -> int:
        return sum(r.ledger.inflight_requests for r in self.replicas)

    @property
    def budget_blocks(self) -> int:
        """The usable budget: the healthy replicas' (0 with every one down, not all of theirs)."""
        return sum(r.ledger.budget_blocks for r in self.usable())

    @property
    def limit_blocks(self) -> int:
        return sum(r.ledger.limit_blocks for r in self.usable())

    @property
    def free_blocks(self) -> int:
        return sum(r.ledger.free_blocks for r in self.routable())

    @property
    def largest(self) -> BlockLedger:
        """The ledger of the replica with the largest budget: what a 413 is measured against."""
        return max((r.ledger for r in self.replicas), key=lambda ledger: ledger.limit_blocks)

    def overflow_probability(self) -> float:
        """Statistical: the largest bound among the usable replicas (0 for the other policies)."""
        return max((r.ledger.overflow_probability() for r in self.usable()
                    if isinstance(r.ledger, StatisticalLedger)), default=0.0)

    @property
    def statistical(self) -> bool:
        return isinstance(self.replicas[0].ledger, StatisticalLedger)

    def snapshot(self) -> LedgerSnapshot:
        snaps = [r.ledger.snapshot() for r in self.replicas]
        usable = {id(r) for r in self.usable()}
        live = [s for r, s in zip(self.replicas, snaps, strict=True) if id(r) in usable]
        probability = (max((s.overflow_probability or 0.0) for s in live)
                       if self.statistical else None)
        return LedgerSnapshot(sum(s.budget_blocks for s in live), sum(s.reserved_blocks for s in snaps),
                              sum(s.inflight_requests for s in snaps),
                              sum(s.release_rate_blocks_per_s for s in snaps),
                              sum(s.limit_blocks for s in live), probability)


def _rank(key: str, url: str) -> int:
    digest = hashlib.blake2b(f"{url}\0{key}".encode("utf-8", "surrogateescape"), digest_size=8).digest()
    return int.from_bytes(digest, "big")


__all__ = ["UpstreamPool", "Replica", "LedgerFactory", "local_ledger"]
