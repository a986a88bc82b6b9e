"""TensorRT-LLM's capacity scheduler, one step at a time: GUARANTEED_NO_EVICT or MAX_UTILIZATION.

Read from NVIDIA/TensorRT-LLM (files of different commits, as stored):
  * `cpp/tensorrt_llm/batch_manager/capacityScheduler.cpp` (02a10fed) `GuaranteedNoEvictScheduler
    ::impl`: requests already generating are scheduled first and each takes its remaining blocks
    to completion off the free blocks (`NoEvictScheduledBlocksManager`, `scheduledBlocksManager.
    cpp`, ca64fd93); then pending requests in order while theirs fit — the first that does not
    fit stops scheduling (`break`); nobody is ever evicted.
  * `KVCacheManager::getRemainingBlocksToCompletion` (`kvCacheManager.cpp`, b35ac1b6):
    ceil(min(prompt + max_new_tokens, window) / tokens_per_block) − blocks held (no sink tokens,
    beam 1, one window).
  * `MaxUtilizationScheduler::operator()` (same file): requests in order are scheduled for the
    next step only (`getNeededBlocksOneStep`: the whole prompt's blocks for a first context chunk,
    0 for a later chunk, the block the next token crosses into while generating); when one does
    not fit, the last *started* request at or after it is paused (`schedulingRemoveSequence`: its
    blocks count as free) and the loop retries; with none started after it, scheduling stops.
    A paused request (`LlmRequest::pause`, via `pauseRequests.cpp` / py_executor
    `_pause_requests`) frees its blocks and keeps its place in the active list; its prompt
    becomes prompt + generated (recompute) and its max_new_tokens shrinks by as much.
  * `microBatchScheduler.cpp` (0a949d31): in capacity order, a generating request takes one token
    of --max_num_tokens; context requests share what is left first come first served, in chunks
    of tokens_per_block (chunked context), or whole (and the first that does not fit stops).
  * a context request allocates its whole prompt's blocks at its first chunk (`addSequence`);
    a generating one a block when its next token crosses into one (`addToken`).
Left out: block reuse across requests (no shared prefixes here; a paused request does not find
its blocks again), the overlap scheduler and its two-step lookahead, sliding windows and sink
tokens, LoRA pages, beams, draft tokens, disaggregated serving.
"""

from __future__ import annotations

import bisect
import heapq

import numpy as np

from kvtune.domain.engine_settings import EngineSettings
from kvtune.domain.step_time import StepTicks
from kvtune.sim.rules import CapacityPolicy, TrtllmRule
from kvtune.sim.scheduler import Batch, most_steps

_EMPTY = np.zeros(0, dtype=np.int64)
_sum, _min = np.add.reduce, np.minimum.reduce
_NEW, _CONTEXT, _GENERATING = 0, 1, 2  # a pending request not started, one mid-context, generating


class TrtllmScheduler:
    """One simulated TensorRT-LLM executor: generating requests as columns in arrival order,
    pending requests (new, mid-context, paused) as a list in arrival order, free blocks."""

    def __init__(self, settings: EngineSettings, rule: TrtllmRule, prompt_tokens: np.ndarray,
                 end_tokens: np.ndarray, max_new_tokens: np.ndarray) -> None:
        self.settings, self.rule = settings, rule
        self.tpb = rule.tokens_per_block
        # the pool in TensorRT-LLM's blocks; rounded up where rounding down would not hold one
        # max_seq_len sequence (TensorRT-LLM would not start: the simulator keeps serving)
        self.usable = max(settings.usable_blocks * settings.block_size // self.tpb,
                          -(-settings.max_model_len // self.tpb))
        self.free = self.usable
        self.max_batch = settings.max_num_seqs
        self.max_tokens = settings.max_num_batched_tokens
        self.maxutil = rule.capacity_policy is CapacityPolicy.MAX_UTILIZATION
        # chunks are whole blocks (chunkUnitSize), unless a block exceeds --max_num_tokens
        self._unit = self.tpb if self.max_tokens >= self.tpb else 1
        n = len(prompt_tokens)
        self.prompt_all = prompt_tokens
        self.end_all = end_tokens
        # the blocks a request holds at completion: ceil(min(prompt + max_new_tokens, window) / tpb)
        self.total_blocks = (np.minimum(prompt_tokens + max_new_tokens, settings.max_model_len)
                             + self.tpb - 1) // self.tpb
        self.ntok_all = prompt_tokens.copy()
        self.comp_all = np.zeros(n, dtype=np.int64)  # context tokens computed in the current context phase
        self.held_all = np.zeros(n, dtype=np.int64)
        self.state_all = np.zeros(n, dtype=np.int8)
        self.order_all = np.zeros(n, dtype=np.int64)  # place in the active list
        self.preemptions = np.zeros(n, dtype=np.int64)  # pauses
        self._added = 0
        self._mid: set[int] = set()  # pending requests mid-context (started: their blocks are allocated)
        self.pending: list[tuple[int, int]] = []  # (order, request), sorted
        cap = self.max_batch + 1
        self._cols = np.zeros((5, cap), dtype=np.int64)
        self.rid, self.ntok, self.held, self.end, self.order = self._cols
        self.n = 0
        self.waiting = self.pending  # what the event loop counts as waiting
        self._gen = 0  # generating requests scheduled this step: the first _gen columns
        self._ctx: list[tuple[int, int, int]] = []  # (request, computed before, chunk) this step
        self.used_after_alloc = 0
        self.used_peak = 0
        self.running_peak = 0
        self.steady = False
        self.sampled = 0

    def idle(self) -> bool:
        return self.n == 0 and not self.pending

    def add(self, request: int) -> None:
        self.order_all[request] = self._added
        self.pending.append((self._added, request))
        self._added += 1
        if self.steady and len(self.pending) == 1:
            self._update_steady()  # a new head of the pending requests

    def _blocks(self, tokens: np.ndarray | int):
        return (tokens + self.tpb - 1) // self.tpb

    # --- one step ---------------------------------------------------------------------------

    def schedule(self) -> Batch:
        paused: list[int] = []
        contexts = self._capacity_maxutil(paused) if self.maxutil else self._capacity_no_evict()
        budget = self.max_tokens
        gen = min(self.n, budget)  # micro batch: a generating request takes one token
        budget -= gen
        chunks = self._micro_batch_contexts(contexts, budget)
        admitted: list[int] = []
        for r, _, _ in chunks:
            if self.state_all[r] == _NEW:  # addSequence: the whole (current) prompt's blocks
                blocks = int(self._blocks(int(self.ntok_all[r])))
                self.free -= blocks
                self.held_all[r] = blocks
                self.state_all[r] = _CONTEXT
                self._mid.add(r)
                admitted.append(r)
        need = self._blocks(self.ntok[:gen]) - self.held[:gen]
        total_need = int(_sum(need)) if gen else 0
        self.held[:gen] += need
        self.free -= total_need
        if self.free < 0:
            raise RuntimeError(f"TensorRT-LLM block pool underflow: {self.free}")  # a bug
        self._gen, self._ctx = gen, chunks
        self._note_peaks()
        tokens = gen + sum(c for _, _, c in chunks)
        attention2 = (int(_sum(2 * self.ntok[:gen] - 1)) if gen else 0) + sum(c * (2 * p + c) for _, p, c in chunks)
        kv_read = (int(_sum(self.ntok[:gen])) if gen else 0) + sum(p + c for _, p, c in chunks)
        return Batch(gen, gen, admitted, paused, tokens, attention2, gen + len(chunks), kv_read)

    def _remaining(self, r: int) -> int:
        return max(int(self.total_blocks[r]) - int(self.held_all[r]), 0)

    def _capacity_no_evict(self) -> list[int]:
        """GuaranteedNoEvictScheduler: generating requests first, then pending ones while they fit."""
        k = self.n
        avail = self.free
        if k:
            avail -= int(_sum(np.maximum(self.total_blocks[self.rid[:k]] - self.held[:k], 0)))
        count = min(k, self.max_batch)
        out = []
        for _, r in self.pending:
            if count >= self.max_batch:
                break
            need = self._remaining(r)
            if need > avail:
                break
            avail -= need
            count += 1
            out.append(r)
        return out

    def _one_step(self, r: int) -> int:
        """getNeededBlocksOneStep of a pending request: a first chunk's prompt blocks, else 0."""
        return int(self._blocks(int(self.ntok_all[r]))) if self.state_all[r] == _NEW else 0

    def _capacity_maxutil(self, paused: list[int]) -> list[int]:
        """MaxUtilizationScheduler: schedule for the next step, pause the last started on overflow."""
        k = self.n
        gen_need = self._blocks(self.ntok[:k]) - self.held[:k]
        last_order = int(self.order[k - 1]) if k else -1
        if (not self.pending or self.pending[0][0] > last_order) and k <= self.max_batch \
                and int(_sum(gen_need)) <= self.free:
            # every generating request fits and comes first: only the pending ones are in question
            scheduled_blocks, count, out = int(_sum(gen_need)) if k else 0, k, []
            for _, r in self.pending:
                need = self._one_step(r)
                if count >= self.max_batch or scheduled_blocks + need > self.free:
                    if self.state_all[r] == _NEW:
                        break  # nothing started after it (mid-context requests come first)
                    return self._capacity_maxutil_slow(paused)
                count += 1
                scheduled_blocks += need
                out.append(r)
            return out
        return self._capacity_maxutil_slow(paused)

    def _capacity_maxutil_slow(self, paused: list[int]) -> list[int]:
        """The scheduler's loop as written, over the active list in order (generating and pending
        requests merged by their place in it); a victim is the started request (generating, or
        mid-context) latest in the list at or after the one that does not fit."""
        k = self.n
        running = list(zip(self.order[:k].tolist(), self.rid[:k].tolist(), strict=True))
        position = {r: i for i, (_, r) in enumerate(running)}
        started = sorted(running + [(int(self.order_all[r]), r) for r in self._mid])
        free = self.free
        scheduled: list[int] = []
        blocks = 0
        end = self._added  # requests at or after this place are out of the loop (paused)
        active = heapq.merge(running, self.pending)
        cur = next(active, None)
        while cur is not None and cur[0] < end:
            order, r = cur
            if r in position:
                i = position[r]
                need = int(self._blocks(int(self.ntok[i]))) - int(self.held[i])
            else:
                need = self._one_step(r)
            if len(scheduled) < self.max_batch and blocks + need <= free:
                scheduled.append(r)
                blocks += need
                cur = next(active, None)
                continue
            if not started or started[-1][0] < order:
                break  # nothing started at or after it: scheduling stops
            end, victim = started.pop()
            free += int(self.held[position[victim]]) if victim in position else int(self.held_all[victim])
            paused.append(victim)
        for victim in paused:
            self._pause(victim)
        return [r for r in scheduled if r not in position]

    def _position(self, r: int) -> int:
        return int(np.flatnonzero(self.rid[:self.n] == r)[0])

    def _held(self, r: int) -> int:
        if self.state_all[r] == _GENERATING:
            return int(self.held[self._position(r)])
        return int(self.held_all[r])

    def _pause(self, r: int) -> None:
        """LlmRequest::pause: blocks freed, prompt := prompt + generated, back among the pending."""
        if self.state_all[r] == _GENERATING:
            pos = self._position(r)
            self.free += int(self.held[pos])
            self.ntok_all[r] = self.ntok[pos]
            keep = np.ones(self.n, dtype=bool)
            keep[pos] = False
            m = self.n - 1
            self._cols[:, :m] = self._cols[:, :self.n][:, keep]
            self.n = m
        else:
            self.free += int(self.held_all[r])
            self.pending.remove((int(self.order_all[r]), r))
            self._mid.discard(r)
        self.held_all[r] = 0
        self.comp_all[r] = 0
        self.state_all[r] = _NEW
        self.preemptions[r] += 1
        bisect.insort(self.pending, (int(self.order_all[r]), r))

    def _micro_batch_contexts(self, contexts: list[int], budget: int) -> list[tuple[int, int, int]]:
        """(request, computed before, chunk) of the context requests the micro batch takes."""
        out = []
        for r in contexts:
            comp = int(self.comp_all[r])
            left = int(self.ntok_all[r]) - comp
            if not self.rule.enable_chunked_context:
                if left > budget:
                    break
                chunk = left
            else:
                chunk = left if left <= budget else budget // self._unit * self._unit
                if chunk <= 0:
                    break
            budget -= chunk
            out.append((r, comp, chunk))
        return out

    def batch_order(self, batch: Batch) -> tuple[list[int], list[int]]:
        gen = self._gen
        return (self.rid[:gen].tolist() + [r for r, _, _ in self._ctx],
                [1] * gen + [c for _, _, c in self._ctx])

    def _note_peaks(self) -> None:
        used = self.usable - self.free
        self.used_after_alloc = used
        if used > self.used_peak:
            self.used_peak = used
        running = self.n + len(self._ctx)
        if running > self.running_peak:
            self.running_peak = running

    # --- after the step ---------------------------------------------------------------------

    def complete(self) -> tuple[np.ndarray, np.ndarray]:
        gen = self._gen
        self.ntok[:gen] += 1
        finished = list(self.rid[:gen][self.ntok[:gen] >= self.end[:gen]].tolist()) if gen else []
        if finished:
            self._finish(self.ntok[:self.n] >= self.end[:self.n])
        first: list[int] = []
        joined: list[int] = []
        completed = 0
        for r, comp, chunk in self._ctx:
            comp += chunk
            self.comp_all[r] = comp
            fill = int(self.ntok_all[r])
            if comp < fill:
                continue
            if fill == int(self.prompt_all[r]):
                first.append(r)
            fill += 1
            completed += 1
            self._mid.discard(r)
            self.ntok_all[r] = fill
            self.pending.remove((int(self.order_all[r]), r))
            if fill >= int(self.end_all[r]):
                self.free += int(self.held_all[r])
                self.held_all[r] = 0
                finished.append(r)
                continue
            joined.append(r)
        for r in joined:  # generating now: into the columns, in active-list order
            self.state_all[r] = _GENERATING
            k = self.n
            order = int(self.order_all[r])
            pos = int(np.searchsorted(self.order[:k], order))
            self._cols[:, pos + 1:k + 1] = self._cols[:, pos:k]
            self.rid[pos], self.ntok[pos], self.held[pos] = r, self.ntok_all[r], self.held_all[r]
            self.end[pos], self.order[pos] = self.end_all[r], order
            self.n = k + 1
        self.sampled = gen + completed
        self._ctx = []
        self._gen = 0
        self._update_steady()
        return np.array(first, dtype=np.int64), np.array(finished, dtype=np.int64)

    def _finish(self, done: np.ndarray) -> None:
        k = self.n
        pos = np.flatnonzero(done)
        finished = self.rid[pos]
        self.free += int(_sum(self.held[pos]))
        self.ntok_all[finished] = self.ntok[pos]
        self.state_all[finished] = _NEW  # done: never looked at again
        m = k - len(pos)
        self._cols[:, :m] = self._cols[:, :k][:, ~done]
        self.n = m

    def _update_steady(self) -> None:
        k = self.n
        if not k or k > self.max_tokens or k > self.max_batch:
            self.steady = False
            return
        if not self.pending:
            self.steady = True
            return
        order, r = self.pending[0]
        if self.maxutil and order < int(self.order[k - 1]):
            self.steady = False  # it comes before a generating request: it could pause one
        elif k >= self.max_batch or k >= self.max_tokens:
            self.steady = True  # no room in the batch, or no tokens left for a context
        elif self.state_all[r] != _NEW:
            self.steady = False
        elif self.maxutil:
            nxt = int(_sum(self._blocks(self.ntok[:k]) - self.held[:k]))
            self.steady = self._one_step(r) > self.free - nxt
        else:
            avail = self.free - int(_sum(np.maximum(self.total_blocks[self.rid[:k]] - self.held[:k], 0)))
            self.steady = self._remaining(r) > avail

    # --- runs of identical decode steps -----------------------------------------------------

    def decode_run(self, ticks: StepTicks, window: int | None,
                   max_steps: int | None = None) -> tuple[int, int, int, np.ndarray]:
        """Take k generation steps at once while no pending request can start (GUARANTEED_NO_EVICT:
        the blocks left after every running request's remaining blocks stay the same until one
        finishes; MAX_UTILIZATION: the free blocks only shrink) and, for MAX_UTILIZATION, every
        step's blocks are free; up to the first finish."""
        k = self.n
        if not self.steady or not k:
            return 0, 0, 0, _EMPTY
        ntok, held = self.ntok[:k], self.held[:k]
        last = int(_min(self.end[:k] - ntok))
        ctx = int(_sum(ntok)) - k
        steps = last if window is None else min(last, ticks.decode_steps_before(k, ctx, window))
        if max_steps is not None and max_steps < steps:
            steps = max_steps

        def need(s: int) -> int:
            return int(_sum(np.maximum(self._blocks(ntok + (s - 1)) - held, 0)))

        if steps > 0 and need(steps) > self.free:
            steps = most_steps(lambda n: need(n) <= self.free, steps)
        if steps <= 0:
            return 0, 0, 0, _EMPTY
        self.free -= need(steps)
        self.held[:k] = np.maximum(self._blocks(ntok + (steps - 1)), held)
        self.ntok[:k] += steps
        self._note_peaks()
        finished = _EMPTY
        if steps == last:
            done = self.ntok[:k] >= self.end[:k]
            finished = self.rid[:k][done].copy()
            self._finish(done)
        self._update_steady()
        return steps, ticks.decode_run(k, ctx, steps), ctx, finished


__all__ = ["TrtllmScheduler"]
