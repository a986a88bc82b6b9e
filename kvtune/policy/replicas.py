"""Several engine replicas, each measured (`recommend --capacity A --capacity B`): one budget each.

The recommendation itself (caps, max_model_len, the launch file) is made for the smallest
replica; each upstream then gets its own budget from its own capacity by the same rule and safety
fraction (rules.block_budget), and its own max_num_seqs and max_num_batched_tokens: the rules on
its own capacity, or with `--objective` what the search, which simulates every replica
(kvtune.policy.replica_search), found for it, with its figures.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from urllib.parse import urlsplit

from kvtune.capacity.plan import Capacity
from kvtune.domain.recommendation import Recommendation, UpstreamBudget
from kvtune.endpoint import parse_upstream
from kvtune.errors import CapacityError, KvtuneError, OptionError
from kvtune.planning import Plan
from kvtune.policy import rules


def smallest(capacities: Sequence[Capacity]) -> int:
    """The index of the replica with the fewest KV blocks (the first of equals)."""
    return min(range(len(capacities)), key=lambda i: capacities[i].num_blocks)


# what every replica behind one gateway must share: one model, one engine, one KV layout
_SAME = (("model", "served model"), ("engine", "engine"), ("kv_cache_dtype", "KV cache dtype"),
         ("block_size", "block size"))


def check_same_deployment(replicas: Sequence[tuple[str, Capacity]]) -> None:
    """CapacityError naming the first capacity file that measured another model, engine, KV dtype
    or block size than the first file: one gateway routes one model over replicas of one kind."""
    first_path, first = replicas[0]
    for path, capacity in replicas[1:]:
        for name, what in _SAME:
            a, b = _measured(first, name), _measured(capacity, name)
            if a is not None and b is not None and a != b:
                raise CapacityError(f"{what} {b!r}, but {first_path} measured {a!r}: every replica behind one "
                                    f"gateway serves the same model the same way; calibrate the replicas of this "
                                    "deployment", path=path)  # no field: the CLI would name its own flag


def _measured(capacity: Capacity, name: str) -> object:
    if name == "block_size":
        return capacity.block_size
    measured = capacity.measured
    return None if measured is None else getattr(measured, name, None)


def _origin_url(capacity: Capacity) -> str | None:
    """The server a capacity file says it was read from (`origin`, as `kvtune calibrate` writes
    it), as the gateway's upstream URL; None when it names no http(s) server (a log, by hand)."""
    origin = capacity.measured.origin if capacity.measured is not None else None
    if not origin:
        return None
    parts = urlsplit(origin)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        return None
    try:
        url = parse_upstream(f"{parts.scheme}://{parts.netloc}")
    except KvtuneError:
        return None
    return f"{url.scheme}://{url.host_port}"


def replica_context(capacity: Capacity) -> int:
    """The longest request a replica holds: its usable blocks, at most the max_model_len it was measured at."""
    context = (capacity.num_blocks - 1) * capacity.block_size
    if capacity.max_model_len is not None:
        context = min(context, capacity.max_model_len)
    return context


def with_replica_context(replicas: Sequence[tuple[str, Plan]]) -> list[tuple[str, Plan]]:
    """The replicas' plans, each told the longest context every replica holds (one launch file runs
    them all, so its max_model_len is at most that); a file given twice stays one plan."""
    held = min(replica_context(p.capacity) for _, p in replicas)
    limited = {id(p): dataclasses.replace(p, replica_context_tokens=held) for _, p in replicas}
    return [(f, limited[id(p)]) for f, p in replicas]


def check_replicas(replicas: Sequence[tuple[str, Capacity]], rec: Recommendation) -> None:
    """check_replica for each, at the recommendation's max_model_len; when no length serves the logs
    (the verdict refuses it), at the longest logged request, so the replica that holds too little is named."""
    length = rec.max_model_len
    verdict = rec.feasibility
    if verdict is not None and not verdict.fits and verdict.longest_request_tokens is not None:
        length = -(-verdict.longest_request_tokens // verdict.block_size) * verdict.block_size
    for path, capacity in replicas:
        check_replica(path, capacity, block_size=rec.capacity.block_size, max_model_len=length)


def check_replica(path: str, capacity: Capacity, *, block_size: int, max_model_len: int) -> None:
    """CapacityError naming the replica's file when it cannot run the launch file every replica
    runs: another block size, or less context than its max_model_len."""
    if capacity.block_size != block_size:
        raise CapacityError(f"block size {capacity.block_size}, but the replicas' launch file runs "
                            f"{block_size}: calibrate every replica at one block size",
                            path=path, field="block_size")
    context = replica_context(capacity)
    if context < max_model_len:
        raise CapacityError(f"this replica holds {context:,} tokens of context, below the max_model_len "
                            f"{max_model_len:,} every replica runs at: give it more KV memory or lower "
                            "--max-model-len", path=path, field="max_model_len")


def per_replica(rec: Recommendation, replicas: Sequence[tuple[str, Capacity]], fallback_urls: Sequence[str], *,
                own: Sequence[Recommendation] | None = None, from_origin: bool = True) -> Recommendation:
    """`rec` (made for the smallest replica) with one UpstreamBudget per (capacity file, capacity),
    in order: its URL from the file's origin, else fallback_urls[i] (consecutive ports; always
    without `from_origin`, for one file measured once and deployed N times). Its engine limits
    are the search's part of the chosen row (`--objective`), else those of own[i], the rules on
    that replica's own plan, else none (every replica runs the launch file's)."""
    safety = rec.safety_fraction.value
    chosen = rec.chosen
    searched = chosen.replicas if chosen is not None else ()  # `--objective`: each replica's part of the row
    if isinstance(safety, bool) or not isinstance(safety, (int, float)):
        raise TypeError(f"safety fraction {safety!r} is not a number")
    if own is not None and len(own) != len(replicas):
        raise ValueError(f"{len(own)} recommendations for {len(replicas)} replicas")
    budgets = []
    for i, (path, capacity) in enumerate(replicas):
        check_replica(path, capacity, block_size=rec.capacity.block_size, max_model_len=rec.max_model_len)
        budget = rules.block_budget(capacity.num_blocks, safety).tokens
        if budget < 1:
            raise CapacityError(f"no KV blocks to budget: {capacity.num_blocks} block(s)", path=path,
                                field="num_blocks")
        url = (_origin_url(capacity) if from_origin else None) or fallback_urls[i]
        part = searched[i] if searched else None
        limits: tuple[int | None, int | None] = (None, None)
        if part is not None:
            if part.budget_blocks != budget:
                raise ValueError(f"replica {path}: searched budget {part.budget_blocks}, rules give {budget}")
            limits = (part.max_num_seqs, part.max_num_batched_tokens)
        elif own is not None:
            if own[i].budget_blocks != budget:
                raise ValueError(f"replica {path}: its own budget {own[i].budget_blocks}, rules give {budget}")
            limits = (own[i].setting("max_num_seqs").tokens, own[i].setting("max_num_batched_tokens").tokens)
        pool = capacity.measured.kv_cache_memory_bytes if capacity.measured is not None else None
        budgets.append(UpstreamBudget(url, budget, capacity.num_blocks, path, *limits,
                                      part.predicted if part is not None else None, pool))
    seen: dict[str, str] = {}
    for b in budgets:
        if b.url in seen:
            raise OptionError(f"{b.capacity_file} and {seen[b.url]} are both upstream {b.url}: give one "
                              "capacity file per engine replica", field="--capacity")
        seen[b.url] = b.capacity_file
    small = replicas[smallest([c for _, c in replicas])]
    if searched or own is not None:
        note = (f"{len(budgets)} engine replicas, each upstream's block_budget, max_num_seqs and "
                f"max_num_batched_tokens its own (upstreams in recommendation.json"
                f"{'' if searched else ', the rules on its own capacity'}); caps, admission and "
                f"max_model_len are the deployment's, vllm-serve.sh the smallest replica's ({small[0]}, "
                f"{small[1].num_blocks:,} blocks)")
    else:
        note = (f"{len(budgets)} engine replicas, each upstream's block_budget from its own capacity file; caps and "
                f"engine settings are the smallest replica's ({small[0]}, {small[1].num_blocks:,} blocks)")
    return dataclasses.replace(rec, upstreams=tuple(budgets), notes=(*rec.notes, note))


__all__ = ["per_replica", "smallest", "check_same_deployment", "check_replica", "check_replicas", "replica_context",
           "with_replica_context"]
