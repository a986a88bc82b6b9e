"""The engine settings that change scheduling (pool size, block size, batch limits): the simulator
runs them, policy's search and what-if choose them, deploy's check reads them from a launch file,
so they live on the floor."""

from __future__ import annotations

from dataclasses import dataclass

from kvtune.errors import OptionError

__all__ = ["EngineSettings"]


@dataclass(frozen=True, slots=True)
class EngineSettings:
    """The engine settings that change scheduling; num_blocks counts the null block, as vLLM reports it.

    `reserve_full_sequence`: a waiting request is admitted only when its whole current sequence fits
    in the free blocks (vLLM's `scheduler_reserve_full_isl`, the default from 0.19); False: when the
    blocks of the chunk it computes this step fit (earlier releases), which over-admits long
    prompts under chunked prefill and preempts them chunks later (kvtune.engines.vllm)."""

    num_blocks: int
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    enable_prefix_caching: bool = True
    long_prefill_token_threshold: int = 0
    reserve_full_sequence: bool = True

    def __post_init__(self) -> None:
        for name in ("num_blocks", "block_size", "max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            if getattr(self, name) < 1:
                raise OptionError(f"must be at least 1, got {getattr(self, name)}", field=name)
        if self.long_prefill_token_threshold < 0:
            raise OptionError(f"must be ≥ 0, got {self.long_prefill_token_threshold}",
                              field="long_prefill_token_threshold")
        if -(-self.max_model_len // self.block_size) > self.usable_blocks:
            raise OptionError(f"{self.max_model_len:,} tokens need {-(-self.max_model_len // self.block_size):,} "
                              f"blocks but only {self.usable_blocks:,} are usable: vLLM refuses to start",
                              field="max_model_len")

    @property
    def usable_blocks(self) -> int:
        return self.num_blocks - 1
