"""The statistical policy's rule: how likely the admitted requests' KV is to outgrow the budget.

Each admitted sequence i holds ceil((prompt_i + tokens_i(t)) / block_size) blocks while it runs
and none once it has ended; its final length L_i is unknown but follows its route's measured
output distribution, truncated at its cap (mass above the cap sits at the cap), and conditioned on
the tokens it has already streamed. Lengths are independent across sequences.

A bound on the *final* blocks alone, P(sum_i ceil((p_i + L_i) / B) > C), ignores that requests
ending early give their blocks back, and admits little more than the worst case. This module
bounds the *peak* of usage over the coming decode steps instead, assuming every running sequence
gains one token a step (the engine decodes them in one batch):

  * steps are cut into doubling intervals [0, 1), [1, 2), [2, 4), ... up to max_model_len;
  * within interval [a, b) sequence i holds at most X_i = ceil((p_i + min(s_i + b, L_i)) / B)
    blocks if it is still running at step a (L_i - s_i > a), else 0 (s_i: tokens streamed);
  * the peak exceeds C only if some interval's sum of X_i does, so by the union bound
      P(peak > C) <= min( P(sum final blocks > C),  sum over intervals P(sum X_i > C) ).

Each tail P(S > C) is computed exactly, by convolving the sequences' small integer supports
truncated at C + 1, when that is cheap (EXACT_WORK); otherwise it is bounded by Chernoff,
P(S >= C + 1) <= min over theta of exp(sum_i log E[exp(theta X_i)] - theta (C + 1)), on a fixed
grid of theta, which is never below the true tail. No normal approximation is used anywhere.
When the worst case of every sequence fits (sum of ceil((p_i + cap_i) / B) <= C), the probability
is exactly 0, so epsilon = 0 admits exactly what the guaranteed policy admits.

The state is incremental: each held sequence keeps its log-moment rows, and the ledger keeps
their sum, so an admission costs one new sequence's rows, not a pass over everyone held.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from kvtune.domain.output_law import OutputLaw

#: The Chernoff grid, in 1/blocks: 2^-12 .. 2^2 in steps of 2^0.5.
THETAS = tuple(2.0 ** (k / 2) for k in range(-24, 5))

#: Above this many multiply-adds per evaluation the tails are bounded, not convolved.
EXACT_WORK = 2_000_000

#: Streamed-token counts at which a running sequence's law is conditioned again (16, 32, 64, ...):
#: each update costs one sequence's rows, so a long answer costs log2(length) updates.
FIRST_MARK = 16


def next_mark(tokens: int) -> int:
    """The first conditioning mark above `tokens` (16, 32, 64, ...)."""
    mark = FIRST_MARK
    while mark <= tokens:
        mark *= 2
    return mark


def last_mark(tokens: int) -> int:
    """The largest mark at or below `tokens`, or 0 below the first."""
    if tokens < FIRST_MARK:
        return 0
    mark = FIRST_MARK
    while mark * 2 <= tokens:
        mark *= 2
    return mark


def interval_edges(max_model_len: int) -> tuple[tuple[int, int], ...]:
    """The doubling step intervals [a, b) covering every step a sequence can still run."""
    edges = [(0, 1)]
    b = 1
    while b < max_model_len:
        edges.append((b, 2 * b))
        b *= 2
    return tuple(edges)


@dataclass(frozen=True, slots=True)
class SequenceRows:
    """One held sequence as the bound sees it: per row (each interval, then the final blocks) its
    possible block counts with their probabilities, and the row's log-moments on THETAS."""

    values: np.ndarray  # (rows, support) int64 block counts, 0 = ended before the interval
    probs: np.ndarray  # (support,) probabilities, shared by every row
    log_mgf: np.ndarray  # (rows, len(THETAS))
    worst: int  # ceil((prompt + cap) / block_size): what the guaranteed policy reserves


_THETA = np.asarray(THETAS)


#: How many sequences' rows are kept: a queued request is re-tried at every release and a held
#: one at every progress mark, with the same arguments each time (the simulator's rows and seeds
#: replay the same requests), so its rows are computed once, not on each try.
ROWS_CACHE = 8192


def sequence_rows(prompt: int, cap: int, law: OutputLaw, streamed: int, *, block_size: int,
                  edges: Sequence[tuple[int, int]]) -> SequenceRows:
    """The rows of one sequence of `prompt` tokens capped at `cap`, `streamed` tokens in (shared,
    read-only arrays: equal arguments give the same object)."""
    return _sequence_rows(prompt, cap, law, streamed, block_size, tuple(edges))


@functools.lru_cache(maxsize=ROWS_CACHE)
def _sequence_rows(prompt: int, cap: int, law: OutputLaw, streamed: int, block_size: int,
                   edges: tuple[tuple[int, int], ...]) -> SequenceRows:
    lengths, probs = law.conditioned(cap, streamed)
    remaining = lengths - streamed  # steps until it ends (> 0 unless it ends now)
    starts = np.asarray([a for a, _ in edges], dtype=np.int64)[:, None]
    ends = np.asarray([b for _, b in edges], dtype=np.int64)[:, None]
    reach = np.minimum(streamed + ends, lengths[None, :])
    interval = np.where(remaining[None, :] > starts, -(-(prompt + reach) // block_size), 0)
    final = -(-(prompt + lengths) // block_size)
    values = np.vstack([interval, final[None, :]]).astype(np.int64)
    with np.errstate(divide="ignore"):
        logp = np.log(probs)
    exponent = _THETA[None, :, None] * values[:, None, :] + logp[None, None, :]
    top = exponent.max(axis=2, keepdims=True)
    log_mgf = (top[..., 0] + np.log(np.exp(exponent - top).sum(axis=2)))
    worst = -(-(prompt + cap) // block_size)
    for array in (values, probs, log_mgf):
        array.setflags(write=False)  # cached: a caller that wrote to one would change every other's
    return SequenceRows(values, probs, log_mgf, int(worst))


def chernoff_tail(log_mgf_sum: np.ndarray, capacity: int) -> np.ndarray:
    """Per row, min over THETAS of exp(sum log-MGF - theta (capacity + 1)), at most 1."""
    exponent = (log_mgf_sum - _THETA[None, :] * (capacity + 1)).min(axis=1)
    return np.minimum(1.0, np.exp(np.minimum(exponent, 0.0)))


def row_distribution(held: Iterable[SequenceRows], row: int, capacity: int) -> np.ndarray:
    """The exact distribution of one row's sum over `held`, sums above `capacity` lumped at
    capacity + 1 (length capacity + 2)."""
    size = capacity + 2
    dist = np.zeros(size)
    dist[0] = 1.0
    for seq in held:
        dist = convolve_clipped(dist, seq.values[row], seq.probs, capacity)
    return dist


def rows_distribution(held: Sequence[SequenceRows], rows: int, capacity: int) -> np.ndarray:
    """Every row's exact distribution at once (shape (rows, capacity + 2), sums above capacity
    lumped at capacity + 1), by multiplying the sequences' discrete Fourier transforms: P(sum <= C)
    depends only on values <= C, and a transform longer than the largest possible sum has no
    wrap-around, so the low part is the exact convolution up to float rounding (~1e-15)."""
    size = capacity + 2
    if not held:
        out = np.zeros((rows, size))
        out[:, 0] = 1.0
        return out
    top = capacity + 1
    longest = sum(int(min(s.values.max(), top)) for s in held)
    n = 1 << max(longest + 1, top).bit_length()  # no wrap-around, and every value <= capacity + 1 fits
    pmfs = np.zeros((len(held), rows, n))
    row_index = np.arange(rows)[:, None]
    for i, s in enumerate(held):
        np.add.at(pmfs[i], (np.broadcast_to(row_index, s.values.shape), np.minimum(s.values, top)),
                  np.broadcast_to(s.probs, s.values.shape))
    spectrum = np.prod(np.fft.rfft(pmfs, axis=2), axis=0)
    full = np.fft.irfft(spectrum, n=n, axis=1)
    out = np.empty((rows, size))
    out[:, :top] = np.maximum(full[:, :top], 0.0)
    out[:, top] = np.maximum(0.0, 1.0 - out[:, :top].sum(axis=1))
    return out


def convolve_clipped(dist: np.ndarray, values: np.ndarray, probs: np.ndarray, capacity: int) -> np.ndarray:
    """dist convolved with one sequence's (values, probs), sums above capacity lumped at capacity + 1."""
    size = capacity + 2
    pmf = np.bincount(np.minimum(values, capacity + 1), weights=probs, minlength=1)
    full = np.convolve(dist, pmf)
    out = full[:size].copy()
    out[size - 1] += full[size:].sum()
    return out


def exact_units(worst: int, capacity: int) -> int:
    """One sequence's share of a convolution's cost: the length of its clipped support."""
    return min(worst, capacity + 1) + 1


def exact_is_cheap(units: int, capacity: int, rows: int) -> bool:
    """Whether convolving every row over sequences of `units` (summed exact_units) costs at most
    EXACT_WORK multiply-adds."""
    return (capacity + 2) * rows * units <= EXACT_WORK


def combine(tails: np.ndarray) -> float:
    """min(P(final > C), sum over intervals P(interval peak > C)), at most 1."""
    return float(min(1.0, tails[-1], tails[:-1].sum()))


__all__ = ["SequenceRows", "THETAS", "EXACT_WORK", "FIRST_MARK", "chernoff_tail", "combine", "convolve_clipped",
           "exact_is_cheap", "exact_units", "interval_edges", "last_mark", "next_mark", "row_distribution",
           "rows_distribution", "sequence_rows"]
