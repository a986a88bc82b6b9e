"""SGLang's scheduler, one step at a time: admission on an estimate, retraction when it was wrong.

Read from sgl-project/sglang (files of different commits, as stored):
  * `python/sglang/srt/managers/schedule_policy.py` (00550cd1) `PrefillAdder`: each running
    request reserves `min(max_new − out, CLIP) × new_token_ratio` (`_get_running_request_total_
    token_offset`); a waiting request is admitted when `extend + min(max_new − out, CLIP) + page`
    is below the free (+ evictable) tokens left after those reservations (`_select_prefill_
    admission` → `PrefillBudget.check_prefill`), and then reserves `ceil(extend) + page +
    min(max_new, CLIP)` (`_update_prefill_budget` → `PrefillBudget.reserve`,
    `mem_cache/prefill_budget.py`, 036da265); a prompt longer than the chunk budget is chunked and
    reserves no output; `budget_state` stops the pass (NO_TOKEN) once nothing is left, or at the
    chunk / --max-prefill-tokens budget (OTHER).
  * `get_new_batch_prefill` (`managers/scheduler.py`): FCFS over the waiting queue, stopping at the
    first request that is refused; NO_TOKEN or --max-running-requests sets `batch_is_full`, and no
    prefill is tried again until the running batch shrinks (a finish or a retraction).
  * `get_next_batch_to_run`: a step is a prefill batch when one can be formed, else one decode
    step of every running request (no mixed chunks: --enable-mixed-chunk is off by default).
  * `update_running_batch` / `ScheduleBatch.check_decode_mem` / `retract_decode`
    (`managers/schedule_batch.py`, fd3907ee): a decode step needs one token (one page when the
    sequence crosses a page) per request; when they are not free, requests are retracted in the
    "length" order — sorted by (output tokens, −prompt tokens) descending and popped from the end,
    so the fewest generated, then the longest prompt, go first; at least one, never the last —
    until the rest fit; the ratio becomes min(1, (Σ out + RETRACT_DECODE_STEPS · n) / (Σ max_new
    + 1)) over those kept; retracted requests join the back of the waiting queue and recompute
    prompt + output. Otherwise the ratio decays (`NewTokenRatioTracker.decay_step`,
    `scheduler_components/new_token_ratio_tracker.py`, 1a882c5c): linearly from
    min(0.7 × conservativeness, 1) to start × 0.14 over 600 steps; an idle scheduler resets it
    (`self_check_during_idle`).
The same code paths checked in the sglang 0.5.23 wheel (the release kvtune renders for):
`PrefillAdder.add_one_req` (total_tokens = extend + min(max_new − out, CLIP) + page),
`ScheduleBatch.retract_decode` / `_get_decode_retraction_order` (the "length" key),
`NewTokenRatioTracker.estimate_new_token_ratio_after_retract`, `Scheduler.update_running_batch`
(decay_step when no retraction; batch_is_full cleared when the batch shrinks) and
`_add_request_to_queue` (retracted requests appended to the waiting queue).
Left out: the radix cache (requests share no prefix here; a retracted request does not find its
prompt again), the overlap scheduler's one-step lag (and 0.5.23's deferral of a retraction when requests
finish in flight), priorities and other schedule policies,
ignore_eos requests (ratio 1.0), hybrid/SWA pools, abort of a last request that cannot fit.

Tokens are counted in the pool's tokens; `held` is what a request has allocated (whole pages).
"""

from __future__ import annotations

from collections import deque

import numpy as np

from kvtune.domain.engine_settings import EngineSettings
from kvtune.domain.step_time import StepTicks
from kvtune.sim.rules import SGLangRule
from kvtune.sim.scheduler import Batch, most_steps

_EMPTY = np.zeros(0, dtype=np.int64)
_sum, _min = np.add.reduce, np.minimum.reduce


class SGLangScheduler:
    """The state of one simulated SGLang server: running columns, waiting deque, free tokens, ratio."""

    def __init__(self, settings: EngineSettings, rule: SGLangRule, prompt_tokens: np.ndarray,
                 end_tokens: np.ndarray, max_new_tokens: np.ndarray) -> None:
        self.settings, self.rule = settings, rule
        self.page = rule.page_size
        # max_total_num_tokens, whole pages (at least one max_model_len sequence's)
        pool = settings.usable_blocks * settings.block_size
        self.usable = max(pool // self.page * self.page, -(-settings.max_model_len // self.page) * self.page)
        self.free = self.usable
        self.max_running = settings.max_num_seqs
        self.chunk_size = settings.max_num_batched_tokens  # --chunked-prefill-size
        self.ratio = rule.init_ratio
        self.batch_is_full = False
        self.waiting: deque[int] = deque()
        self.prompt_all = prompt_tokens
        self.end_all = end_tokens
        self.maxnew_all = max_new_tokens  # the max_new_tokens SGLang holds for each request
        self.ntok_all = prompt_tokens.copy()
        self.preemptions = np.zeros(len(prompt_tokens), dtype=np.int64)  # retractions
        cap = self.max_running + 1
        self._cols = np.zeros((6, cap), dtype=np.int64)
        self.rid, self.ntok, self.held, self.prompt, self.end, self.maxnew = self._cols
        self.n = 0
        # the request being prefilled in chunks: [request, tokens computed, tokens held] or None
        self.chunked: list[int] | None = None
        self._prefill: list[tuple[int, int, int, int]] = []  # the prefill batch being run
        self._decoding = False
        self.used_after_alloc = 0
        self.used_peak = 0
        self.running_peak = 0
        self.steady = False
        self.sampled = 0

    # --- queries ----------------------------------------------------------------------------

    def idle(self) -> bool:
        if self.n == 0 and self.chunked is None and not self.waiting:
            self.ratio = self.rule.init_ratio  # self_check_during_idle: the tracker resets
            self.batch_is_full = False
            return True
        return False

    def add(self, request: int) -> None:
        self.waiting.append(request)
        if not self.batch_is_full:
            self.steady = False  # the next step tries a prefill

    def _ceil(self, tokens: int) -> int:
        return -(-tokens // self.page) * self.page

    # --- one step ---------------------------------------------------------------------------

    def schedule(self) -> Batch:
        admitted: list[int] = []
        prefill = self._form_prefill(admitted)
        if prefill:
            self._prefill, self._decoding = prefill, False
            total = attention2 = kv_read = 0
            for _, comp, ext, _ in prefill:
                total += ext
                attention2 += ext * (2 * comp + ext)
                kv_read += comp + ext
            self._note_peaks()
            return Batch(0, 0, admitted, [], total, attention2, len(prefill), kv_read)
        self._prefill = []
        retracted: list[int] = []
        if self.n:
            self._decode_memory(retracted)
        k = self.n
        self._decoding = k > 0
        need = self._decode_need(k)
        total_need = int(_sum(need)) if k else 0
        self.held[:k] += need
        self.free -= total_need
        self._note_peaks()
        ctx = self.ntok[:k] - 1
        return Batch(k, k, [], retracted, k, int(_sum(2 * ctx + 1)) if k else 0, k,
                     int(_sum(self.ntok[:k])) if k else 0)

    def _decode_need(self, k: int) -> np.ndarray:
        """Tokens each running request allocates for its next decode (a page when it crosses one)."""
        ntok = self.ntok[:k]
        if self.page == 1:
            return ntok - self.held[:k]
        return (ntok + self.page - 1) // self.page * self.page - self.held[:k]

    def _decode_memory(self, retracted: list[int]) -> None:
        """check_decode_mem; when it fails, retract_decode; else the ratio decays one step."""
        if int(_sum(self._decode_need(self.n))) <= self.free:
            self.ratio = max(self.ratio - self.rule.ratio_decay, self.rule.min_ratio)
            return
        k = self.n
        out = (self.ntok[:k] - self.prompt[:k]).tolist()
        prompt = self.prompt[:k].tolist()
        # sorted(key=(out, −prompt), reverse=True) is stable: ties keep batch order
        order = sorted(range(k), key=lambda i: (out[i], -prompt[i]), reverse=True)
        keep = np.ones(k, dtype=bool)
        first = True
        while first or int(_sum(self._decode_need(k)[keep])) > self.free:
            if len(order) == 1:
                break
            first = False
            i = order.pop()
            keep[i] = False
            r = int(self.rid[i])
            self.free += int(self.held[i])
            self.ntok_all[r] = self.ntok[i]
            self.preemptions[r] += 1
            self.waiting.append(r)
            retracted.append(r)
        m = int(keep.sum())
        self._cols[:, :m] = self._cols[:, :k][:, keep]
        self.n = m
        decoded = int(_sum(self.ntok[:m] - self.prompt[:m]))
        self.ratio = min(1.0, (decoded + self.rule.retract_decode_steps * m) / (int(_sum(self.maxnew[:m])) + 1))
        self.batch_is_full = False

    def _form_prefill(self, admitted: list[int]) -> list[tuple[int, int, int, int]]:
        """get_new_batch_prefill with a PrefillAdder: (request, computed before, extend, held
        after) of each request in the prefill batch, its pages allocated."""
        if (self.batch_is_full or not self.waiting) and self.chunked is None:
            return []
        if self.n >= self.max_running and self.chunked is None:
            self.batch_is_full = True
            return []
        rule, page, clip = self.rule, self.page, self.rule.clip_max_new_tokens
        k = self.n
        generated = self.ntok[:k] - self.prompt[:k]
        total_offset = float(_sum(np.minimum(self.maxnew[:k] - generated, clip))) * self.ratio if k else 0.0
        current_offset = 0
        rem_input = rule.max_prefill_tokens
        rem_chunk = self.chunk_size
        out: list[tuple[int, int, int, int]] = []
        free0 = self.free  # allocator.available_size() when the adder is made; pages are taken after
        stalled = None  # the chunked request, when its next chunk cannot be allocated this step
        chunking = False  # a new request started its chunked prefill in this pass

        if self.chunked is not None:  # add_chunked_req: the next chunk of the request being prefilled
            r, comp, held = self.chunked
            left = int(self.ntok_all[r]) - comp
            avail = min(rem_chunk, int(free0 - total_offset))
            if avail <= 0:
                avail = rem_chunk  # "single-pool continuation must make progress to release its KV"
            ext = min(left, avail)
            if self._ceil(comp + ext) - held > self.free:  # what the pool has (the simulator's guard)
                ext = max((held + self.free) // page * page - comp, 0)
            if ext > 0:
                reserve = 0 if ext < left else min(int(self.maxnew_all[r]), clip)
                ceiled = self._ceil(ext)
                total_offset += ceiled + page + reserve
                current_offset += ceiled + page
                rem_input -= ceiled
                rem_chunk -= ceiled
                after = self._ceil(comp + ext)
                self.free -= after - held
                out.append((r, comp, ext, after))
            else:
                stalled = self.chunked

        if rem_input > 0 and rem_chunk > 0:
            waiting = self.waiting
            while waiting:
                if k + len(out) >= self.max_running:
                    self.batch_is_full = True
                    break
                r = waiting[0]
                fill = int(self.ntok_all[r])
                maxnew = int(self.maxnew_all[r])
                total = fill + min(max(maxnew - (fill - int(self.prompt_all[r])), 0), clip) + page
                if not total < free0 - total_offset and (k or out or stalled is not None):
                    self.batch_is_full = True  # PrefillBudget.check_prefill refused it: NO_TOKEN
                    break
                # (an empty server takes the head even when the check refuses it, so that a
                # request whose estimate exceeds the whole pool cannot stall the simulation)
                ext, reserve = fill, min(maxnew, clip)
                if self._ceil(fill) > rem_chunk:  # chunked prefill: the first chunk, no output reserved
                    if stalled is not None or chunking:
                        break  # one chunked request at a time
                    ext = rem_chunk // page * page
                    if ext <= 0:
                        break
                    reserve = 0
                ceiled = self._ceil(ext)
                if ceiled > self.free:
                    break  # the simulator's guard: SGLang would run out of pages here
                total_offset += ceiled + page + reserve
                current_offset += ceiled + page
                rem_input -= ceiled
                rem_chunk -= ceiled
                waiting.popleft()
                self.free -= ceiled
                out.append((r, 0, ext, ceiled))
                admitted.append(r)
                chunking = chunking or ext < fill
                if free0 - total_offset <= 0 or free0 - current_offset <= 0:
                    self.batch_is_full = True  # budget_state: NO_TOKEN
                    break
                if rem_input <= 0 or rem_chunk <= 0:  # budget_state: OTHER
                    break
        self.chunked = stalled  # complete() records a request still chunking after this step
        return out

    def batch_order(self, batch: Batch) -> tuple[list[int], list[int]]:
        """(request ids, tokens) of the step just scheduled; call between `schedule` and `complete`."""
        if self._prefill:
            return [e[0] for e in self._prefill], [e[2] for e in self._prefill]
        k = self.n
        return self.rid[:k].tolist(), [1] * k

    def _note_peaks(self) -> None:
        used = self.usable - self.free
        self.used_after_alloc = used
        if used > self.used_peak:
            self.used_peak = used
        running = self.n + len(self._prefill) + (self.chunked is not None)
        if running > self.running_peak:
            self.running_peak = running

    # --- after the step ---------------------------------------------------------------------

    def complete(self) -> tuple[np.ndarray, np.ndarray]:
        """The step ran: prefilled requests sample their first token and join the running batch,
        or decoding requests each sample one. Returns (first-token ids, finished ids)."""
        first: list[int] = []
        if self._prefill:
            done: list[int] = []
            joined = 0
            for r, comp, ext, held in self._prefill:
                fill = int(self.ntok_all[r])
                if comp + ext < fill:  # a chunk: the request goes on being prefilled
                    self.chunked = [r, comp + ext, held]
                    continue
                if fill == int(self.prompt_all[r]):
                    first.append(r)
                fill += 1
                self.ntok_all[r] = fill
                joined += 1
                if fill >= int(self.end_all[r]):
                    self.free += held
                    done.append(r)
                    continue
                j = self.n
                self.rid[j], self.ntok[j], self.held[j] = r, fill, held
                self.prompt[j], self.end[j], self.maxnew[j] = self.prompt_all[r], self.end_all[r], self.maxnew_all[r]
                self.n = j + 1
            self._prefill = []
            self.sampled = joined
            if done:
                self.batch_is_full = False
            self.steady = False
            return np.array(first, dtype=np.int64), np.array(done, dtype=np.int64)
        k = self.n
        if not self._decoding or not k:
            self.sampled = 0
            return _EMPTY, _EMPTY
        self.ntok[:k] += 1
        self.sampled = k
        finished = self._finish(self.ntok[:k] >= self.end[:k])
        self._decoding = False
        self._update_steady()
        return _EMPTY, finished

    def _finish(self, done: np.ndarray) -> np.ndarray:
        if not done.any():
            return _EMPTY
        k = self.n
        pos = np.flatnonzero(done)
        finished = self.rid[pos]
        self.free += int(_sum(self.held[pos]))
        self.ntok_all[finished] = self.ntok[pos]
        m = k - len(pos)
        self._cols[:, :m] = self._cols[:, :k][:, ~done]
        self.n = m
        self.batch_is_full = False
        return finished

    def _update_steady(self) -> None:
        # the next steps are decode steps until something changes: nothing to prefill
        self.steady = self.n > 0 and self.chunked is None and (self.batch_is_full or not self.waiting)

    # --- runs of identical decode steps -----------------------------------------------------

    def decode_run(self, ticks: StepTicks, window: int | None,
                   max_steps: int | None = None) -> tuple[int, int, int, np.ndarray]:
        """Take k decode steps at once while no prefill is tried (batch_is_full, or nothing
        waits), every step's tokens are free (no retraction) and nobody finishes before the
        last; the ratio decays k steps. Returns (steps, ticks, context sum at the start, finished)."""
        k = self.n
        if not self.steady or not k:
            return 0, 0, 0, _EMPTY
        ntok, held = self.ntok[:k], self.held[:k]
        last = int(_min(self.end[:k] - ntok))
        ctx = int(_sum(ntok)) - k
        steps = last if window is None else min(last, ticks.decode_steps_before(k, ctx, window))
        if max_steps is not None and max_steps < steps:
            steps = max_steps
        page = self.page

        def need(s: int) -> int:  # tokens the next s decode steps allocate
            return int(_sum(np.maximum((ntok + (s - 1) + page - 1) // page * page - held, 0)))

        if steps > 0 and need(steps) > self.free:
            steps = most_steps(lambda n: need(n) <= self.free, steps)
        if steps <= 0:
            return 0, 0, 0, _EMPTY
        total = need(steps)
        self.held[:k] = np.maximum((ntok + (steps - 1) + page - 1) // page * page, held)
        self.free -= total
        self.ntok[:k] += steps
        rule = self.rule
        self.ratio = max(self.ratio - steps * rule.ratio_decay, rule.min_ratio)
        self._note_peaks()
        finished = self._finish(self.ntok[:k] >= self.end[:k]) if steps == last else _EMPTY
        self._update_steady()
        return steps, ticks.decode_run(k, ctx, steps), ctx, finished


__all__ = ["SGLangScheduler"]
