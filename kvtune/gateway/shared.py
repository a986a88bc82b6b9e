"""The gateway's side of the ledger every gateway replica shares (gateway.yaml `ledger.backend:
redis`, the store in kvtune.gateway.redis_ledger).

Each upstream keeps its local ledger (kvtune.gateway.pool) for the gate's fast, synchronous
decision, at its whole budget: this replica alone never holds more. A local grant is then
confirmed in Redis (`hold`: one atomic script, reserved + blocks <= the upstream's limit over
every replica; under the statistical policy, the Chernoff bound over every replica's held rows
within epsilon, kvtune.gateway.redis_statistical, and progress updates sent on); refused,
the local grant is given back and admission tries the next upstream,
then polls or answers 429 (kvtune.gateway.admission). `release` gives the shared reservation
back beside the local one, exactly once, without awaiting (the store's release_soon).

Redis not answering (LedgerUnavailableError): with ledger.on_error `reject` the request is
refused with 503 + Retry-After and nothing is admitted; with `local` it is admitted against a
static slice of each upstream's budget, budget // replicas_hint, held in this process only
(what the slice admitted is unknown to Redis once it is back: until those requests end, the
gateways together may hold up to one slice per replica more than the budget). While Redis is
known to be down (an error within the last RECHECK_S, not yet answered by the store's
heartbeat) requests do not wait on it again.

A lost lease (this process paused or cut off for longer than lease_s: the other replicas swept
its reservations): the store holds what this replica still runs again, in one script, each
with its limit and current rows (`_in_flight`), each only if it fits now; those that do not are
counted (/metrics kvtune_gateway_ledger_reregister_over_total) and retried every heartbeat.
"""

from __future__ import annotations

import itertools
import logging
import time
from typing import TYPE_CHECKING

from kvtune.domain.admission_policy import PolicyKind
from kvtune.errors import InputError, LedgerUnavailableError
from kvtune.gateway.config import GatewayConfig, OnLedgerError
from kvtune.gateway.engines import engine_identity, resolved_addresses
from kvtune.gateway.gate import ledger_for
from kvtune.gateway.ledger import BlockLedger, LedgerSnapshot, Reservation
from kvtune.gateway.redis_ledger import EngineName, InFlight, RedisLedger
from kvtune.gateway.redis_statistical import RedisStatisticalLedger, encode_rows
from kvtune.gateway.refusals import Reason, Rejection
from kvtune.gateway.statistical import StatisticalLedger

if TYPE_CHECKING:
    from kvtune.gateway.pool import Replica, UpstreamPool

log = logging.getLogger("kvtune.gateway")

#: After a Redis error, requests skip Redis for this long (the heartbeat notices it is back sooner).
RECHECK_S = 1.0
#: The ledger modes /metrics names (kvtune_gateway_ledger_mode{mode=...}).
MODES = ("memory", "redis", "local", "unavailable")


class SharedLedger:
    """One gateway replica's use of the shared store: confirm, release, fall back, report."""

    def __init__(self, config: GatewayConfig, pool: UpstreamPool, *, store: RedisLedger | None = None) -> None:
        spec = config.ledger
        if spec.url is None:
            raise ValueError("a shared ledger needs ledger.url")
        self.spec = spec
        self.pool = pool
        # each upstream's name in the store: its engine_id or canonical URL, one per engine
        self.upstreams = config.upstreams
        self.identity = {r.index: engine_identity(u) for r, u in zip(pool.replicas, config.upstreams, strict=True)}
        self.statistical = config.admission.kind is PolicyKind.STATISTICAL
        if store is None:
            if self.statistical:
                store = RedisStatisticalLedger(spec.url, epsilon=config.admission.epsilon,
                                               key_prefix=spec.key_prefix, lease_s=spec.lease_s,
                                               op_timeout_s=spec.op_timeout_s, reclaim_grace_s=spec.reclaim_grace_s)
            else:
                store = RedisLedger(spec.url, key_prefix=spec.key_prefix, lease_s=spec.lease_s,
                                    op_timeout_s=spec.op_timeout_s, reclaim_grace_s=spec.reclaim_grace_s)
        self.store = store
        if self.statistical:
            for replica in pool.replicas:
                if isinstance(replica.ledger, StatisticalLedger):
                    replica.ledger.on_progress = self._progressed
                    replica.ledger.chernoff_only = True  # Redis bounds by Chernoff: no convolution here
        self.retry_after_s = config.retry_after_min_s
        # each upstream's static slice, for ledger.on_error: local
        self.slices: tuple[BlockLedger, ...] = tuple(
            ledger_for(config.admission, max(1, r.ledger.budget_blocks // spec.replicas_hint),
                       block_size=config.block_size, max_model_len=config.max_model_len)
            for r in pool.replicas)
        # local reservation -> (store id, its upstream), or the slice's reservation
        self._held: dict[Reservation, tuple[str, Replica] | Reservation] = {}
        store.in_flight = self._in_flight
        self._ids = itertools.count(1)
        self._failed_at: float | None = None
        self.local_admitted = 0  # reservations admitted on a slice while Redis was unavailable
        self._engines_registered = False  # each upstream's identity recorded in the store
        self._clash: str | None = None  # found after start (Redis was down then): nothing is admitted

    # ---------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        """Connect, register each engine's identity and record the budgets; Redis down now is not
        fatal (the store keeps trying). An upstream that reaches an engine the other replicas
        budget under another name is an InputError: one engine, one budget."""
        try:
            await self.store.start()
            await self._register_engines()
        except LedgerUnavailableError:
            self._failed_at = time.monotonic()

    async def _register_engines(self, *, started: bool = False) -> None:
        """Record every upstream's identity and addresses in the store, then its budget. A second
        name for an engine registered already is refused, nothing written: at start an
        InputError (the store closed); found later (Redis was down at start) logged once, and
        every request refused 503 from then on."""
        names = [EngineName(self.identity[r.index], u.url, await resolved_addresses(u.url))
                 for r, u in zip(self.pool.replicas, self.upstreams, strict=True)]
        clash = await self.store.register_engines(names)
        if clash is None:
            self._engines_registered = True
            await self.store.set_budgets({self.identity[r.index]: r.ledger.budget_blocks for r in self.pool.replicas},
                                         {self.identity[r.index]: r.ledger.limit_blocks for r in self.pool.replicas})
            return
        i = next(i for i, name in enumerate(names) if name.identity == clash.identity)
        given = f"engine_id {clash.identity}" if self.upstreams[i].engine_id else f"URL {self.upstreams[i].url}"
        error = InputError(f"{given} reaches {clash.address}, the engine the gateways sharing this ledger budget as "
                           f"{clash.registered} (first written {clash.registered_url}): a second name would be a "
                           "second budget; write the same URL in every replica's gateway.yaml, or give every "
                           "replica the same engine_id", field=f"upstreams[{i}]")
        if not started:
            await self.store.aclose(retire=True)
            raise error
        self._clash = str(error)
        log.error("nothing is admitted: %s", self._clash)

    async def _refuse_unregistered(self) -> None:
        """Before admitting: the upstreams' identities must be registered (Redis down at start:
        now), and not clash with another replica's."""
        if not self._engines_registered and self._clash is None and not self._down():
            try:
                await self._register_engines(started=True)
            except LedgerUnavailableError:
                self._failed_at = time.monotonic()
        if self._clash is not None:
            raise Rejection(503, Reason.LEDGER_UNAVAILABLE, f"this gateway is misconfigured: {self._clash}",
                            retry_after_s=self.retry_after_s)

    async def close(self) -> None:
        """Stop the heartbeat and give back whatever this replica still holds."""
        await self.store.aclose(retire=True)

    # ---------------------------------------------------------------- admission

    @property
    def mode(self) -> str:
        """redis while Redis answers; else local or unavailable, as ledger.on_error says."""
        if self.store.available:
            return "redis"
        return "local" if self.spec.on_error is OnLedgerError.LOCAL else "unavailable"

    def _down(self) -> bool:
        failed = self._failed_at
        return not self.store.available and failed is not None and time.monotonic() - failed < RECHECK_S

    async def hold(self, replica: Replica, reservation: Reservation) -> bool:
        """Confirm a local grant on `replica` in the shared store: True if held there (or, Redis
        unavailable under `local`, on the replica's slice); False refused, the caller gives the
        local grant back. Redis unavailable under `reject`: a 503 Rejection."""
        await self._refuse_unregistered()
        if not self._down():
            rid = str(next(self._ids))
            try:
                granted = await self._reserve(replica, rid, reservation)
            except LedgerUnavailableError:
                self._failed_at = time.monotonic()
            else:
                if granted:
                    self._held[reservation] = (rid, replica)
                return granted
        if self.spec.on_error is OnLedgerError.REJECT:
            raise Rejection(503, Reason.LEDGER_UNAVAILABLE,
                            "the gateways' shared KV ledger is unavailable: nothing is admitted that it cannot "
                            "record; retry later", retry_after_s=self.retry_after_s)
        got = self.slices[replica.index].try_reserve(reservation.blocks)
        if got is None:
            return False
        self._held[reservation] = got
        self.local_admitted += 1
        return True

    async def _reserve(self, replica: Replica, rid: str, reservation: Reservation) -> bool:
        """The store's reserve: the guaranteed rule on the limit, or (statistical) the Chernoff
        bound over the rows the local ledger holds for this reservation."""
        ledger, name = replica.ledger, self.identity[replica.index]
        held = ledger.held_rows(reservation) if isinstance(ledger, StatisticalLedger) else None
        if held is None or not isinstance(self.store, RedisStatisticalLedger):
            return await self.store.reserve(name, rid, reservation.blocks, ledger.limit_blocks)
        worst, log_mgf = held
        return await self.store.reserve_rows(name, rid, reservation.blocks, ledger.budget_blocks,
                                             worst, log_mgf)

    def _progressed(self, reservation: Reservation) -> None:
        """A local progress update re-held the reservation's rows: send them to the store too."""
        held_as = self._held.get(reservation)
        ledger = reservation.ledger
        if isinstance(held_as, tuple) and isinstance(ledger, StatisticalLedger) \
                and isinstance(self.store, RedisStatisticalLedger):
            held = ledger.held_rows(reservation)
            if held is not None:
                self.store.progress_soon(held_as[0], held[1])

    def _in_flight(self) -> list[InFlight]:
        """What this replica holds in the store, as the store holds it again after a lost lease:
        each with its limit and (statistical) its current rows, as its reserve sent them."""
        out = []
        for reservation, held_as in self._held.items():
            if not isinstance(held_as, tuple):
                continue  # held on a slice: Redis never counted it
            rid, replica = held_as
            ledger, name = replica.ledger, self.identity[replica.index]
            rows = ledger.held_rows(reservation) if isinstance(ledger, StatisticalLedger) else None
            if rows is None or not isinstance(self.store, RedisStatisticalLedger):
                out.append(InFlight(rid, name, reservation.blocks, ledger.limit_blocks))
            else:
                out.append(InFlight(rid, name, reservation.blocks, ledger.budget_blocks, rows[0],
                                    encode_rows(rows[1])))
        return out

    def release(self, reservation: Reservation) -> None:
        """Give back what `hold` took for this local reservation, once; never awaits."""
        held = self._held.pop(reservation, None)
        if isinstance(held, tuple):
            self.store.release_soon(held[0])
        elif held is not None:
            held.release()

    @property
    def held(self) -> int:
        """Reservations this replica holds in the store or on a slice now."""
        return len(self._held)

    # ---------------------------------------------------------------- reading

    async def snapshot(self) -> dict[str, LedgerSnapshot] | None:
        """Every upstream as the store counts it (all replicas together), by its URL here; None
        while unavailable."""
        if self._down():
            return None
        try:
            got = await self.store.snapshot()
        except LedgerUnavailableError:
            self._failed_at = time.monotonic()
            return None
        return {r.url: got[self.identity[r.index]] for r in self.pool.replicas if self.identity[r.index] in got}

    def describe(self) -> dict:
        """/kvtune/ledger's `ledger` member: no URL (it may hold a password)."""
        store = self.store
        return {"backend": "redis", "mode": self.mode, "available": store.available,
                "key_prefix": self.spec.key_prefix, "lease_s": self.spec.lease_s,
                "reclaim_grace_s": self.spec.reclaim_grace_s,
                "on_error": self.spec.on_error.value, "replicas_hint": self.spec.replicas_hint,
                "op_timeout_s": self.spec.op_timeout_s,
                "errors": store.errors, "leases_lost": store.leases_lost, "pending_releases": store.pending_releases,
                "reregistered": store.reregistered, "reregister_over": store.reregister_over,
                "unregistered": store.unregistered}


__all__ = ["SharedLedger", "MODES", "RECHECK_S"]
