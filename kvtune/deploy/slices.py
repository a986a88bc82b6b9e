"""Static slices of one engine's block budget for several nginx replicas (`--nginx-replicas M`).

nginx.conf keeps its ledger in one nginx's shared memory (lua_shared_dict), which no other nginx
on another machine can see. M nginx replicas in front of one engine therefore each hold a fixed
slice, floor(budget / M) blocks: the slices never add up to more than the budget, at two costs
stated in the rendered header: a request bigger than a slice is refused (413) although it fits the
whole budget, and a slice idle on one nginx cannot be used by another. gateway.yaml with a Redis
ledger shares one exact budget instead.
"""

from __future__ import annotations

from kvtune.errors import OptionError

#: The most nginx replicas one engine's budget is sliced for.
MAX_NGINX_REPLICAS = 256


def slice_blocks(budget_blocks: int, nginx_replicas: int) -> int:
    """One nginx's share of the budget: floor(budget / M), so M shares never exceed it."""
    if not 1 <= nginx_replicas <= MAX_NGINX_REPLICAS:
        raise OptionError(f"must be from 1 to {MAX_NGINX_REPLICAS}, got {nginx_replicas}", field="--nginx-replicas")
    return budget_blocks // nginx_replicas


def blocks_for_context(max_model_len: int, block_size: int) -> int:
    """The blocks one request of the whole context reserves: ceil(max_model_len / block_size)."""
    return -(-max_model_len // block_size)


def check_slice(budget_blocks: int, nginx_replicas: int, *, max_model_len: int, block_size: int) -> int:
    """The slice, refused when it cannot hold one request of max_model_len tokens: such an nginx
    would answer 413 to requests the engine serves, a config that is useless without saying so."""
    share = slice_blocks(budget_blocks, nginx_replicas)
    need = blocks_for_context(max_model_len, block_size)
    if share < need:
        most = max(1, budget_blocks // need)
        raise OptionError(f"{nginx_replicas} nginx replicas leave each {share} of the budget's {budget_blocks} "
                          f"blocks, below the {need} blocks one request of max_model_len {max_model_len} "
                          f"reserves: use at most {most} nginx replicas, or gateway.yaml with a Redis ledger "
                          "(one shared budget)", field="--nginx-replicas")
    return share


__all__ = ["slice_blocks", "check_slice", "blocks_for_context", "MAX_NGINX_REPLICAS"]
