"""What stands between clients and the engine: nothing, or kvtune's gateway ledger.

The simulator calls an `Admission` when a request arrives (or retries), when one finishes, and
at its deadlines; the admission answers admit, queue, retry later (429 + Retry-After) or refuse.
`LedgerAdmission` runs the live gateway's own admission gate (kvtune.gateway.gate: the ledger,
the reservation and cap rules, the FIFO, Retry-After) in simulated time (the ledger's clock is
injected), so the policy simulated is the policy deployed.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from kvtune.domain.admission_policy import GUARANTEED, AdmissionPolicy
from kvtune.domain.demand import Demand
from kvtune.domain.flow_control import FlowControl
from kvtune.domain.output_law import OutputLaw
from kvtune.gateway.flow import ANONYMOUS, FlowGate
from kvtune.gateway.gate import AdmissionGate, Turned, ledger_for, route_cap, sequence_blocks
from kvtune.gateway.ledger import Reservation
from kvtune.gateway.overflow import next_mark
from kvtune.gateway.statistical import StatisticalLedger


class VerdictKind(enum.Enum):
    ADMIT = "admit"  # goes to the engine now
    QUEUE = "queue"  # held by the admission; `finish`/`poll` release it later
    RETRY = "retry"  # 429 with Retry-After: the client waits and sends it again
    REFUSE = "refuse"  # can never be admitted (413): the client gives up


@dataclass(frozen=True, slots=True)
class Verdict:
    kind: VerdictKind
    retry_after_s: float = 0.0


ADMIT = Verdict(VerdictKind.ADMIT)
QUEUED = Verdict(VerdictKind.QUEUE)


@dataclass(slots=True)
class Wakeup:
    """What changed in the admission's queue: requests now admitted, requests now answered 429."""

    admitted: list[int] = field(default_factory=list)
    rejected: list[tuple[int, float]] = field(default_factory=list)  # (request, Retry-After seconds)


class Admission(Protocol):
    """The admission hook the simulator calls, all in simulated seconds. One that conditions on
    progress (`conditions_on_progress`) is told, at admission and then whenever a request reaches
    the count `progress` last returned, how many tokens the request has generated."""

    conditions_on_progress: bool

    def arrive(self, request: int, prompt_tokens: int, max_tokens: int | None, now_s: float) -> Verdict: ...

    def finish(self, request: int, now_s: float) -> Wakeup | None: ...

    def poll(self, now_s: float) -> Wakeup | None: ...

    def next_deadline_s(self) -> float | None: ...

    def progress(self, request: int, generated_tokens: int, now_s: float) -> int | None: ...


class DirectAdmission:
    """Straight to vLLM: everything is admitted, nothing is held."""

    conditions_on_progress = False

    def arrive(self, request: int, prompt_tokens: int, max_tokens: int | None, now_s: float) -> Verdict:
        return ADMIT

    def finish(self, request: int, now_s: float) -> Wakeup | None:
        return None

    def poll(self, now_s: float) -> Wakeup | None:
        return None

    def next_deadline_s(self) -> float | None:
        return None

    def progress(self, request: int, generated_tokens: int, now_s: float) -> int | None:
        return None


#: Events of a chat completion stream before its first token (the role); the live gateway's
#: relay counts events and reports events − 3 tokens (kvtune.gateway.relay.events_seen_tokens,
#: not imported: it would bring aiohttp into the simulator; a test pins the two together).
STREAM_EVENTS_BEFORE_TOKENS = 1
STREAM_EVENTS_WITHOUT_TOKENS = 3


def streamed_tokens_seen(generated_tokens: int) -> int:
    """What the live gateway reports once a streamed chat completion has generated this many
    tokens: vLLM sends the role event, then one event per engine step carrying that step's token
    (the simulator decodes one token per step), and the relay reports events − 3."""
    return max(0, STREAM_EVENTS_BEFORE_TOKENS + generated_tokens - STREAM_EVENTS_WITHOUT_TOKENS)


class LedgerAdmission:
    """The gateway's admission (kvtune.gateway.gate, the code `kvtune gateway` runs) in simulated
    time: reserve sequence_blocks(prompt, cap) from the ledger's budget for the request's whole
    life, wait in the FIFO when the queue allows it, else 429 with the ledger's Retry-After.

    `route_max_new_tokens` is the cap of the route the requests match (gateway.yaml); the cap is
    the smaller of it and the request's max_tokens. Without a route, an unset max_tokens reserves
    max_model_len − prompt, as vLLM would let it grow. `output_law` is that route's output law
    (the statistical policy's bet), or `request_laws` one per request (requests of several routes);
    `request_caps` likewise each request's own route cap (routes on a request header, one per group).

    Progress: every simulated request streams, and the statistical ledger hears what the live
    gateway would report (streamed_tokens_seen: SSE events − 3, a little below the tokens
    generated), at its marks 16, 32, 64, ... of reported tokens. The live gateway does not wake
    its queue on progress, so neither does this.

    With `flow` (gateway.yaml `flow:`), the queue is the flow-control one (kvtune.gateway.flow):
    request i waits in band `request_bands[i]` (else `band`) and flow `request_flows[i]`."""

    def __init__(self, budget_blocks: int, *, block_size: int, max_model_len: int, retry_after_min_s: int = 1,
                 retry_after_max_s: int = 60, queue_max_waiting: int = 0, queue_timeout_s: float = 30.0,
                 route_max_new_tokens: int | None = None, policy: AdmissionPolicy = GUARANTEED,
                 output_law: OutputLaw | None = None,
                 request_laws: Sequence[OutputLaw | None] | None = None,
                 request_caps: Sequence[int | None] | None = None, flow: FlowControl | None = None,
                 band: int = 0, request_bands: Sequence[int] | None = None,
                 request_flows: Sequence[str] | None = None) -> None:
        self._now_s = 0.0
        self.policy = policy
        self.output_law = output_law
        self.request_laws = request_laws
        self.ledger = ledger_for(policy, budget_blocks, block_size=block_size, max_model_len=max_model_len,
                                 clock=lambda: self._now_s)
        self.gate: AdmissionGate[int] | FlowGate[int]
        if flow is None:
            self.gate = AdmissionGate(self.ledger, max_waiting=queue_max_waiting, timeout_s=queue_timeout_s,
                                      retry_after_min_s=retry_after_min_s, retry_after_max_s=retry_after_max_s)
        else:
            self.gate = FlowGate(self.ledger, flow, retry_after_min_s=retry_after_min_s,
                                 retry_after_max_s=retry_after_max_s, clock=lambda: self._now_s)
        self.band = band
        self.request_bands = request_bands
        self.request_flows = request_flows
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.route_max_new_tokens = route_max_new_tokens
        self.request_caps = request_caps
        self._held: dict[int, Reservation] = {}
        self.conditions_on_progress = isinstance(self.ledger, StatisticalLedger) and self.ledger.epsilon > 0

    def cap(self, prompt_tokens: int, max_tokens: int | None, request: int | None = None) -> int:
        """The output cap the gateway reserves for (and writes into the forwarded request)."""
        route_max = self.route_max_new_tokens
        if self.request_caps is not None and request is not None:
            route_max = self.request_caps[request]
        if route_max is not None:
            return route_cap(route_max, (max_tokens,))
        return max_tokens if max_tokens is not None else max(self.max_model_len - prompt_tokens, 0)

    def blocks(self, prompt_tokens: int, max_tokens: int | None, request: int | None = None) -> int:
        """The reservation, as the gateway computes it for a one-sequence request."""
        grow = self.cap(prompt_tokens, max_tokens, request)
        return max(sequence_blocks((prompt_tokens,), grow, block_size=self.block_size,
                                   max_model_len=self.max_model_len), 1)

    def arrive(self, request: int, prompt_tokens: int, max_tokens: int | None, now_s: float) -> Verdict:
        self._now_s = now_s
        blocks = self.blocks(prompt_tokens, max_tokens, request)
        law = self.output_law if self.request_laws is None else self.request_laws[request]
        demand = Demand((min(prompt_tokens, self.max_model_len),), self.cap(prompt_tokens, max_tokens, request), law)
        if self.gate.never_fits(blocks, demand):
            return Verdict(VerdictKind.REFUSE)
        gate = self.gate
        if isinstance(gate, FlowGate):
            band = self.band if self.request_bands is None else self.request_bands[request]
            flow = ANONYMOUS if self.request_flows is None else self.request_flows[request]
            got = gate.offer(request, blocks, now_s, demand, band=band, flow=flow)
        else:
            got = gate.offer(request, blocks, now_s, demand)
        if got is None:
            return QUEUED
        if isinstance(got, Turned):
            return Verdict(VerdictKind.RETRY, float(got.retry_after_s))
        self._held[request] = got
        return ADMIT

    def finish(self, request: int, now_s: float) -> Wakeup | None:
        self._now_s = now_s
        granted = self.gate.release(self._held.pop(request))
        return self._granted(granted, Wakeup()) if granted else None

    def _granted(self, granted: Sequence[tuple[int, Reservation]], wakeup: Wakeup) -> Wakeup:
        for request, reservation in granted:
            self._held[request] = reservation
            wakeup.admitted.append(request)
        return wakeup

    def poll(self, now_s: float) -> Wakeup | None:
        self._now_s = now_s
        deadline = self.gate.next_deadline()
        if deadline is None or deadline > now_s:
            return None
        granted, turned = self.gate.expire(now_s)
        wakeup = self._granted(granted, Wakeup())
        wakeup.rejected.extend((request, float(t.retry_after_s)) for request, t in turned)
        return wakeup

    def next_deadline_s(self) -> float | None:
        return self.gate.next_deadline()

    def progress(self, request: int, generated_tokens: int, now_s: float) -> int | None:
        """Report `request`'s streamed tokens to its reservation; the generated count at which the
        report next changes what the ledger knows (the reported tokens' next mark)."""
        reservation = self._held.get(request)
        if reservation is None or not self.conditions_on_progress:
            return None
        self._now_s = now_s
        seen = streamed_tokens_seen(generated_tokens)
        reservation.progress(seen)
        if isinstance(self.gate, FlowGate):
            self.gate.progress(reservation, seen)
        return next_mark(seen) + STREAM_EVENTS_WITHOUT_TOKENS - STREAM_EVENTS_BEFORE_TOKENS

    @property
    def queue_peak(self) -> int:
        return self.gate.waiting_peak

    @property
    def reserved_blocks(self) -> int:
        return self.ledger.reserved_blocks


__all__ = ["Admission", "DirectAdmission", "LedgerAdmission", "Verdict", "VerdictKind", "Wakeup", "ADMIT"]
