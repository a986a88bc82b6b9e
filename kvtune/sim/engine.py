"""The event loop: arrivals and retries through the admission, engine steps, finishes.

Why it is fast: between events the engine often repeats itself. When every running request is
decoding, all fit the token budget and the waiting head cannot be admitted, the next steps are
identical but for one more token of context each; the loop then jumps k steps at once, k being
the first of: a request finishing, the free blocks no longer covering the block boundaries the
requests cross (computed per request in closed form), the next arrival/retry/deadline. The time
of k steps is an arithmetic series (kvtune.domain.step_time.StepTicks.decode_run). `fast=False` takes every step
one at a time through the same scheduler: the reference the fast path is tested against.

An admission that conditions on progress (the statistical ledger) says after how many generated
tokens it wants to hear about each admitted request again; those counts are events too: a run
stops at the step where the first running request reaches its count, the admission is told, and
the loop goes on. Other admissions ask for nothing, and the loop does not look.

Time: a step starts when the previous one ends (synchronous scheduling, as vLLM on CPU);
requests that arrived by then are seen by that step. An idle engine waits for the next event.

With a `FrontEndModel` the API server sits between the clients and the engine
(kvtune.sim.frontend, one processor its requests and its output handler share): an admitted
request reaches the engine when its ingress work is done, and a token reaches its client when the
output handler has streamed the tokens before it; a request's first token and finish are when its
client gets them, and the gateway releases its reservation (and a closed-loop client sends again)
then. When these happen depends on what arrives later, so the server's events are taken in time
order with the others: those inside a step before its tokens are emitted, and a run of decode
steps is taken in one piece only while no request is in ingress. Without one, tokens reach clients
when the step ends.

Arrivals are the workload's own times (open loop), or with `ClosedLoop` C clients that each send
their next request `think_s` after the previous one ended (finished, refused, or out of
retries), as `kvtune bench --concurrency C` does; the workload's arrival times are then ignored.
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvtune.domain.engine_settings import EngineSettings
from kvtune.domain.retry_policy import RetryPolicy
from kvtune.domain.step_time import TICKS_PER_S, FrontEndModel, StepTimeModel
from kvtune.errors import OptionError
from kvtune.sim.admission import Admission, DirectAdmission, VerdictKind, Wakeup
from kvtune.sim.frontend import INGRESS, Delivery, FrontEnd
from kvtune.sim.requests import SimRequest, Workload
from kvtune.sim.results import OUTCOMES, Decision, RequestColumns, SimResult, StepSeries
from kvtune.sim.rules import EngineRule, SGLangRule, TrtllmRule
from kvtune.sim.scheduler import Scheduler
from kvtune.sim.sglang import SGLangScheduler
from kvtune.sim.trtllm import TrtllmScheduler

# Clients retry a 429 as `kvtune bench --retry` does: up to RetryPolicy.max_retries times,
# waiting Retry-After capped at max_wait_s.
CLIENT_RETRY = RetryPolicy(enabled=True)

_OK, _429, _REJECTED, _NOT_SENT = (OUTCOMES.index(o) for o in OUTCOMES)
_NO_MARK = np.iinfo(np.int64).max // 2  # a request the admission wants to hear nothing more about


@dataclass(frozen=True, slots=True)
class ClosedLoop:
    """C clients, each sending the next request `think_s` after its previous one ended; no
    client sends at or after `duration_s` (None: until the workload is used up)."""

    concurrency: int
    think_s: float = 0.0
    duration_s: float | None = None

    def __post_init__(self) -> None:
        if self.concurrency < 1:
            raise OptionError(f"must be at least 1, got {self.concurrency}", field="concurrency")
        if not (math.isfinite(self.think_s) and self.think_s >= 0):
            raise OptionError(f"must be a finite number ≥ 0, got {self.think_s}", field="think_s")


def simulate(
    workload: Workload | Sequence[SimRequest],
    settings: EngineSettings,
    timing: StepTimeModel,
    *,
    admission: Admission | None = None,
    retry: RetryPolicy = CLIENT_RETRY,
    fast: bool = True,
    record_steps: bool = False,
    record_decisions: bool = False,
    closed_loop: ClosedLoop | None = None,
    frontend: FrontEndModel | None = None,
    engine: EngineRule = None,
) -> SimResult:
    """Serve `workload` on a simulated engine behind `admission` (default: direct) and, with
    `frontend`, behind the API server (kvtune.sim.frontend); `engine` picks the scheduling rule
    (kvtune.sim.rules; None: vLLM V1)."""
    wall0 = time.perf_counter()
    wl = workload if isinstance(workload, Workload) else Workload.from_requests(workload)
    run = _Run(wl, settings, timing, admission or DirectAdmission(), retry, record_steps, record_decisions,
               closed_loop, frontend, engine)
    run.loop(fast)
    return run.result(time.perf_counter() - wall0)


class _Run:
    """One simulation's mutable state; `loop` drives it, `result` freezes it."""

    def __init__(self, wl: Workload, settings: EngineSettings, timing: StepTimeModel, admission: Admission,
                 retry: RetryPolicy, record_steps: bool, record_decisions: bool,
                 closed_loop: ClosedLoop | None = None, frontend: FrontEndModel | None = None,
                 engine: EngineRule = None) -> None:
        n = len(wl)
        self.fe = None if frontend is None else FrontEnd(frontend)
        self.delivered_at = 0
        self.wl, self.settings, self.admission, self.retry = wl, settings, admission, retry
        self.direct = type(admission) is DirectAdmission  # no deadlines, no queue: skip asking
        # prompt + generated tokens at which each request's progress is reported next
        self.marks = np.full(n, _NO_MARK, dtype=np.int64) if admission.conditions_on_progress else None
        self.ticks = timing.ticks()
        prompt = wl.prompt_tokens.astype(np.int64)
        end = np.minimum(prompt + wl.output_tokens, settings.max_model_len)
        self.sched = _scheduler(engine, settings, prompt, end, wl.max_tokens.astype(np.int64))
        self.prompt = prompt.tolist()
        self.caps = [None if c < 0 else c for c in wl.max_tokens.tolist()]
        self.too_long = (prompt + 1 > settings.max_model_len).tolist()  # vLLM answers 400
        self.arrival = wl.arrival_s.tolist()
        self.closed = closed_loop
        self.order = [] if closed_loop else np.argsort(wl.arrival_s, kind="stable").tolist()
        self.next_arrival = -1
        self.arrival_tick: int | None = None
        self._advance_arrivals()
        self.retries_heap: list[tuple[int, int]] = []  # (tick, request): retries, closed-loop sends
        self.first_scheduled = np.full(n, np.nan)
        self.first_token = np.full(n, np.nan)
        self.finish = np.full(n, np.nan)
        self.retries = np.zeros(n, dtype=np.int64)
        self.retry_wait = np.zeros(n)
        self.outcome = np.zeros(n, dtype=np.int8)
        self.arrival_out = wl.arrival_s.copy()
        self.sent = n
        if closed_loop is not None:
            self.arrival_out[:] = np.nan
            self.outcome[:] = _NOT_SENT
            self.sent = 0
            self.think = round(closed_loop.think_s * TICKS_PER_S)
            self.send_until = (None if closed_loop.duration_s is None
                               else math.ceil(closed_loop.duration_s * TICKS_PER_S))
            for _ in range(min(closed_loop.concurrency, n)):
                self._send_next(0)
        self.t = 0
        self.num_steps = 0
        self.events = 0
        self.waiting_peak = 0
        self.steps: list[tuple[float, int, int, int, int, int]] | None = [] if record_steps else None
        self.decisions: list[Decision] | None = [] if record_decisions else None
        self.refused_at = 0

    # --- events before a step -----------------------------------------------------------------

    def _advance_arrivals(self) -> None:
        self.next_arrival += 1
        self.arrival_tick = (math.ceil(self.arrival[self.order[self.next_arrival]] * TICKS_PER_S)
                             if self.next_arrival < len(self.order) else None)

    def _deadline_tick(self) -> int | None:
        if self.direct:
            return None
        deadline = self.admission.next_deadline_s()
        return None if deadline is None else math.ceil(deadline * TICKS_PER_S)

    def _next_event(self, engine: bool = False) -> int | None:
        """The next event's tick; `engine`: only those that can change what the engine does (tokens
        reaching clients do not, unless a gateway or a closed-loop client waits for them)."""
        nxt = self.arrival_tick
        if self.retries_heap and (nxt is None or self.retries_heap[0][0] < nxt):
            nxt = self.retries_heap[0][0]
        e = None if self.fe is None else self.fe.next_tick(not engine or not self.direct or self.closed is not None)
        if e is not None and (nxt is None or e < nxt):
            nxt = e
        deadline = self._deadline_tick()
        if deadline is not None and (nxt is None or deadline < nxt):
            nxt = deadline
        return nxt

    def _deliver_due(self, until: int | None = None) -> None:
        """Take every event due by `until` (default: now) in time order."""
        t = self.t if until is None else until
        fe = self.fe
        while True:
            a = self.arrival_tick
            r = self.retries_heap[0][0] if self.retries_heap else None
            e = None if fe is None else fe.next_tick()
            d = self._deadline_tick()
            if (a is not None and a <= t and (r is None or a <= r) and (e is None or a <= e)
                    and (d is None or a <= d)):
                request = self.order[self.next_arrival]
                self._advance_arrivals()
                self._attempt(request, a)
            elif r is not None and r <= t and (e is None or r <= e) and (d is None or r <= d):
                _, request = heapq.heappop(self.retries_heap)
                self._attempt(request, r)
            elif e is not None and e <= t and (d is None or e <= d):
                assert fe is not None
                tick, kind, what = fe.pop()
                if kind == INGRESS:
                    assert isinstance(what, int)
                    self._admit(what, tick)
                else:
                    assert isinstance(what, Delivery)
                    if len(what.first):
                        self.first_token[what.first] = tick / TICKS_PER_S
                    self._finished(what.finished, tick)
            elif d is not None and d <= t:
                deadline_s = self.admission.next_deadline_s() or 0.0
                self._wakeup(self.admission.poll(max(d / TICKS_PER_S, deadline_s)), d)
            else:
                return

    def _attempt(self, request: int, tick: int) -> None:
        self.events += 1
        if self.too_long[request]:
            self._end(request, _REJECTED, tick)
            return
        verdict = self.admission.arrive(request, self.prompt[request], self.caps[request], tick / TICKS_PER_S)
        if verdict.kind is VerdictKind.ADMIT:
            self._to_engine(request, tick)
        elif verdict.kind is VerdictKind.RETRY:
            self._retry(request, verdict.retry_after_s, tick)
        elif verdict.kind is VerdictKind.REFUSE:
            self._end(request, _REJECTED, tick)

    def _admit(self, request: int, tick: int) -> None:
        self.sched.add(request)
        if self.marks is not None:
            self._report(request, int(self.sched.ntok_all[request]) - self.prompt[request], tick)

    def _report(self, request: int, generated: int, tick: int) -> None:
        """Tell the admission how far `request` has got; note when it wants to hear again."""
        assert self.marks is not None
        again = self.admission.progress(request, generated, tick / TICKS_PER_S)
        self.marks[request] = _NO_MARK if again is None else self.prompt[request] + again

    def _progress(self) -> None:
        """Report every running request that has reached its mark (after a step or a run)."""
        sched = self.sched
        k = sched.n
        if not k:
            return
        assert self.marks is not None
        rid, ntok = sched.rid[:k], sched.ntok[:k]
        for pos in np.flatnonzero(ntok >= self.marks[rid]).tolist():
            request = int(rid[pos])
            self._report(request, int(ntok[pos]) - self.prompt[request], self.t)

    def _retry(self, request: int, retry_after_s: float, tick: int) -> None:
        policy = self.retry
        if not policy.enabled or self.retries[request] >= policy.max_retries:
            self._end(request, _429, tick)
            return
        self.retries[request] += 1
        wait_s = min(retry_after_s, policy.max_wait_s)
        self.retry_wait[request] += wait_s
        heapq.heappush(self.retries_heap, (tick + round(wait_s * TICKS_PER_S), request))

    def _end(self, request: int, outcome: int, tick: int) -> None:
        self.outcome[request] = outcome
        self.finish[request] = tick / TICKS_PER_S
        self.refused_at = max(self.refused_at, tick)
        if self.closed is not None:
            self._send_next(tick)

    def _send_next(self, tick: int) -> None:
        """Closed loop: the client whose request ended at `tick` sends the next one."""
        if self.sent >= len(self.arrival_out) or (self.send_until is not None and tick >= self.send_until):
            return
        request = self.sent
        self.sent += 1
        at = tick + self.think
        self.arrival_out[request] = at / TICKS_PER_S
        self.outcome[request] = _OK
        heapq.heappush(self.retries_heap, (at, request))

    def _wakeup(self, wakeup: Wakeup | None, tick: int) -> None:
        if wakeup is None:
            return
        for request in wakeup.admitted:
            self._to_engine(request, tick)
        for request, retry_after_s in wakeup.rejected:
            self._retry(request, retry_after_s, tick)

    def _to_engine(self, request: int, tick: int) -> None:
        """An admitted request: to the engine now, or once the API server has processed it."""
        if self.fe is None:
            self._admit(request, tick)
        else:
            self.fe.ingress(tick, request)

    def _finished(self, finished: np.ndarray, out: int) -> None:
        """Requests whose clients have the last token at tick `out`."""
        if not len(finished):
            return
        self.finish[finished] = out / TICKS_PER_S
        self.delivered_at = max(self.delivered_at, out)
        for request in finished.tolist():
            self._delivered(request, out)

    def _delivered(self, request: int, tick: int) -> None:
        self._wakeup(self.admission.finish(request, tick / TICKS_PER_S), tick)
        if self.closed is not None:
            self._send_next(tick)

    # --- the loop -------------------------------------------------------------------------------

    def loop(self, fast: bool) -> None:
        sched, ticks = self.sched, self.ticks
        while True:
            self._deliver_due()
            if sched.idle():
                nxt = self._next_event()
                if nxt is None:
                    return
                self.t = max(self.t, nxt)
                continue
            waiting = len(sched.waiting)
            if waiting > self.waiting_peak:
                self.waiting_peak = waiting
            if fast and sched.steady and self._decode_run(waiting):
                continue
            start = self.t
            batch = sched.schedule()
            order = sched.batch_order(batch) if self.decisions is not None else None
            self.t += ticks.step(batch.total_tokens, batch.attention2, batch.size, batch.kv_read)
            self.num_steps += 1
            self.events += 1
            for request in batch.admitted:
                if math.isnan(self.first_scheduled[request]):
                    self.first_scheduled[request] = start / TICKS_PER_S
            first, finished = sched.complete()
            sampled = sched.sampled
            if self.fe is not None:  # the server's events during the step come before its tokens
                self._deliver_due(self.t - 1)
            elif len(first):
                self.first_token[first] = self.t / TICKS_PER_S
            if self.steps is not None:
                self.steps.append((start / TICKS_PER_S, 1, batch.total_tokens, sched.n + len(finished), waiting,
                                   sched.used_after_alloc))
            if self.decisions is not None and order is not None:
                self.decisions.append(Decision(start / TICKS_PER_S, tuple(zip(*order, strict=True)),
                                               tuple(sorted(batch.preempted)), tuple(sorted(finished.tolist()))))
            if self.marks is not None:
                self._progress()
            if self.fe is None:
                self._finished(finished, self.t)
            else:
                self.fe.emit(self.t, sampled, first, finished)

    def _decode_run(self, waiting: int) -> bool:
        """Jump over identical decode steps; False when not even one can be taken this way."""
        sched, ticks, fe = self.sched, self.ticks, self.fe
        nxt = self._next_event(engine=True)
        batch = sched.n
        order = sched.rid[:batch].tolist() if self.decisions is not None else []
        until = None
        if self.marks is not None and batch:  # stop where the first running request reaches its mark
            until = int((self.marks[sched.rid[:batch]] - sched.ntok[:batch]).min())
        k, elapsed, ctx, finished = sched.decode_run(ticks, None if nxt is None else nxt - self.t, until)
        if k == 0:
            return False
        start = self.t
        self.t += elapsed
        self.num_steps += k
        self.events += 1
        if self.steps is not None:
            self.steps.append((start / TICKS_PER_S, k, batch, batch, waiting, sched.used_after_alloc))
        if self.decisions is not None:
            step = ticks.decode_first(batch, ctx)
            growth = ticks.decode_growth(batch)
            scheduled = tuple((r, 1) for r in order)
            for j in range(k):
                at = start + j * step + growth * (j * (j - 1) // 2)
                done = tuple(sorted(finished.tolist())) if j == k - 1 else ()
                self.decisions.append(Decision(at / TICKS_PER_S, scheduled, (), done))
        if fe is not None:  # all but the last step end before the next event; the last may not
            if k > 1 and fe.in_ingress:  # the server's share changes with its streaming: step by step
                step, growth, end = ticks.decode_first(batch, ctx), ticks.decode_growth(batch), start
                for j in range(k - 1):
                    end += step + growth * j
                    fe.emit(end, batch)
            elif k > 1:
                fe.emit_run(start, start + ticks.decode_first(batch, ctx), start + ticks.decode_run(batch, ctx, k - 1),
                            batch, k - 1)
            if nxt is not None and nxt < self.t:  # deliveries alone can wait where they change nothing
                self._deliver_due(self.t - 1)
        if self.marks is not None:
            self._progress()
        if fe is None:
            self._finished(finished, self.t)
        else:
            fe.emit(self.t, batch, finished=finished)
        return True

    def result(self, wall_s: float) -> SimResult:
        sched = self.sched
        requests = RequestColumns(self.arrival_out, self.first_scheduled, self.first_token, self.finish,
                                  sched.ntok_all - sched.prompt_all, sched.preemptions.copy(), self.retries,
                                  self.outcome, self.retry_wait)
        steps = None
        if self.steps is not None:
            table = np.array(self.steps, dtype=np.float64).reshape(-1, 6)
            counts = table[:, 1:].astype(np.int64)
            steps = StepSeries(table[:, 0], counts[:, 0], counts[:, 1], counts[:, 2], counts[:, 3], counts[:, 4])
        admission_peak = int(getattr(self.admission, "queue_peak", 0))
        return SimResult(requests, steps, tuple(self.decisions) if self.decisions is not None else None,
                         max(self.t, self.refused_at, self.delivered_at) / TICKS_PER_S, self.num_steps,
                         int(sched.preemptions.sum()),
                         sched.usable, sched.used_peak, sched.running_peak, self.waiting_peak,
                         admission_peak, self.events, wall_s)


def _scheduler(rule: EngineRule, settings: EngineSettings, prompt: np.ndarray, end: np.ndarray,
               caps: np.ndarray):
    """The engine's scheduler. SGLang and TensorRT-LLM reserve for the max_tokens a request
    carries; without one SGLang takes context − prompt − 1 (`init_req_max_new_tokens`),
    TensorRT-LLM max_seq_len − prompt (`_deduce_max_tokens`), and neither lets it pass the
    context; it is never below the tokens the simulated request generates."""
    if rule is None:
        return Scheduler(settings, prompt, end)
    limit = settings.max_model_len - prompt - (1 if isinstance(rule, SGLangRule) else 0)
    max_new = np.maximum(np.where(caps >= 0, np.minimum(caps, limit), limit), end - prompt)
    if isinstance(rule, SGLangRule):
        return SGLangScheduler(settings, rule, prompt, end, max_new)
    assert isinstance(rule, TrtllmRule)

    return TrtllmScheduler(settings, rule, prompt, end, max_new)


__all__ = ["simulate", "CLIENT_RETRY", "ClosedLoop"]
