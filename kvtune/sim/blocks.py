"""The KV block pool: how many blocks are free, and which cached blocks eviction reaches first.

vLLM's `BlockPool` (v1/core/block_pool.py) keeps one free queue. Blocks freed without a hash
(the partial last block of a request, or every block when prefix caching is off) go to the
front, LIFO; blocks with a hash (full blocks) go to the tail in the order given, which
`single_type_kv_cache_manager.free` makes the request's blocks in reverse, so its tail block is
evicted first. New blocks are popped from the front, evicting whatever hash a popped block had.
A cached block still counts as free. Block 0 is the null block, never handed out.

The simulator's requests share no prompt prefix, so the only useful hit is a preempted request
finding its own blocks again. That needs only the queue's shape, not block ids: an anonymous run
at the front, then segments in FIFO order, each either anonymous hashed blocks (finished
requests) or the still-cached blocks of one preempted request. Eviction eats a segment from its
front, i.e. from the request's last block backwards, so what remains is always a prefix — the
hit it gets on resume.
"""

from __future__ import annotations

from collections import deque


class BlockPool:
    """Free-block count and free-queue order, enough to answer prefix-cache hits for resumed requests."""

    __slots__ = ("usable", "free", "caching", "_front", "_segments", "_cached")

    def __init__(self, num_blocks: int, *, caching: bool) -> None:
        self.usable = num_blocks - 1  # the null block is taken out at start
        self.free = self.usable
        self.caching = caching
        self._front = self.usable  # anonymous free blocks at the head of the queue
        self._segments: deque[list[int]] = deque()  # [owner or −1, count]; count 0 = touched/evicted
        self._cached: dict[int, list[int]] = {}  # owner -> its live segment

    @property
    def used(self) -> int:
        return self.usable - self.free

    def take(self, n: int) -> None:
        """Pop `n` blocks from the front of the free queue, evicting cached blocks if it gets there."""
        if n > self.free:
            raise RuntimeError(f"block pool underflow: {n} blocks asked, {self.free} free")  # a bug
        self.free -= n
        from_front = min(n, self._front)
        self._front -= from_front
        n -= from_front
        segments = self._segments
        while n:
            seg = segments[0]
            eaten = min(n, seg[1])
            seg[1] -= eaten
            n -= eaten
            if seg[1] == 0:
                segments.popleft()
                if seg[0] >= 0:
                    self._cached.pop(seg[0], None)

    def give_back(self, held: int, hashed: int, owner: int = -1) -> None:
        """Free a request's `held` blocks, of which the first `hashed` are full (hashed) blocks.

        `owner` >= 0 keeps them findable (a preempted request); −1 for a finished request."""
        self.free += held
        if not self.caching:
            self._front += held
            return
        self._front += held - hashed
        if hashed == 0:
            return
        segments = self._segments
        if owner < 0 and segments and segments[-1][0] < 0:
            segments[-1][1] += hashed  # consecutive anonymous runs behave as one
            return
        seg = [owner, hashed]
        segments.append(seg)
        if owner >= 0:
            self._cached[owner] = seg

    def cached(self, owner: int) -> int:
        """How many of `owner`'s leading blocks are still cached (its prefix-cache hit, in blocks)."""
        seg = self._cached.get(owner)
        return seg[1] if seg is not None else 0

    def touch(self, owner: int, blocks: int) -> None:
        """Take `owner`'s first `blocks` cached blocks out of the free queue (a hit being used)."""
        seg = self._cached.pop(owner)
        # the hit is the front of the request's blocks, i.e. the tail of its segment; whatever is
        # left can never be hit again (the chain is broken), so it stays as anonymous hashed blocks
        seg[1] -= blocks
        seg[0] = -1
        self.free -= blocks

    def forget(self, owner: int) -> None:
        """`owner` will never look its blocks up again (it finished): they stay, anonymous."""
        seg = self._cached.pop(owner, None)
        if seg is not None:
            seg[0] = -1


__all__ = ["BlockPool"]
