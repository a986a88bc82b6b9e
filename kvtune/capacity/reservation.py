"""The reservation rule, in one place: a request can grow to prompt + max_tokens, so whoever admits
it (the gateway, an estimate of what fits) reserves ceil((prompt + max_tokens) / block_size)
blocks for its whole life. vLLM itself allocates on demand and preempts when blocks run out;
the reservation is what never preempts.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from kvtune.errors import OptionError


@dataclass(frozen=True, slots=True)
class RequestShape:
    """One kind of request: its prompt and the output cap (max_tokens) it is admitted with."""

    prompt_tokens: int
    max_tokens: int

    def __post_init__(self) -> None:
        if self.prompt_tokens < 1:
            raise OptionError(f"must be at least 1, got {self.prompt_tokens}", field="prompt_tokens")
        if self.max_tokens < 1:
            raise OptionError(f"must be at least 1, got {self.max_tokens}", field="max_tokens")


@dataclass(frozen=True, slots=True)
class RequestFit:
    """How many requests of one shape fit at once when each reserves its worst case."""

    prompt_tokens: int
    max_tokens: int
    reserved_tokens: int  # prompt + max_tokens, clamped to max_model_len as vLLM clamps max_tokens
    reserved_blocks: int
    max_concurrent: int
    note: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "max_tokens": self.max_tokens,
            "reserved_tokens": self.reserved_tokens,
            "reserved_blocks": self.reserved_blocks,
            "max_concurrent": self.max_concurrent,
            "note": self.note,
        }


def reserved_blocks(prompt_tokens, max_tokens: int, block_size: int):
    """Blocks a request can grow into: ceil((prompt + max_tokens) / block_size).

    `prompt_tokens` may be an int or a numpy array of prompt lengths (one result per prompt)."""
    return -(-(prompt_tokens + max_tokens) // block_size)


def request_reserved_blocks(sequence_prompts: Iterable[int], grow: int, block_size: int, copies: int = 1) -> int:
    """A request that carries several sequences (a batch of prompts, an n-way sample) reserves
    each one's prompt + grow in whole blocks, `copies` times over (n / best_of)."""
    return copies * sum(reserved_blocks(p, grow, block_size) for p in sequence_prompts)


def fit_request(
    shape: RequestShape,
    *,
    usable_blocks: int,
    block_size: int,
    max_model_len: int,
    state_blocks_per_sequence: int = 0,
) -> RequestFit:
    """Reserve prompt + cap (+ per-sequence state blocks) and count how many such requests fit."""
    p, m = shape.prompt_tokens, shape.max_tokens
    if p >= max_model_len:
        return RequestFit(p, m, p, reserved_blocks(p, 0, block_size), 0,
                          f"prompt {p:,} ≥ max_model_len {max_model_len:,}: vLLM rejects it (HTTP 400)")
    note = None
    reserved_tokens = p + m
    if reserved_tokens > max_model_len:
        reserved_tokens = max_model_len
        note = f"max_tokens clamped to max_model_len − prompt = {max_model_len - p:,}, as vLLM does"
    blocks = reserved_blocks(reserved_tokens, 0, block_size) + state_blocks_per_sequence
    if blocks > usable_blocks:
        return RequestFit(p, m, reserved_tokens, blocks, 0,
                          f"does not fit: needs {blocks:,} blocks, only {usable_blocks:,} usable")
    return RequestFit(p, m, reserved_tokens, blocks, usable_blocks // blocks, note)



__all__ = ["RequestShape", "RequestFit", "reserved_blocks", "request_reserved_blocks", "fit_request"]
