"""The pool of physical KV blocks: reference counts, an LRU free queue and the prefix-cache index.

Design after vLLM's PagedAttention block manager (Kwon et al., SOSP 2023) and vLLM v1's
``BlockPool``: a full block holding cached tokens is identified by a chained hash of (parent
block hash, the block's token ids); a block whose reference count drops to zero goes to the back
of the free queue but keeps its hash, so a later request with the same prefix can take it back
until the block is handed out for something else (LRU eviction from the front).

Only :class:`engine.core.kv_cache_manager.KVCacheManager` uses this class.
"""

from __future__ import annotations

from collections import OrderedDict

#: what identifies a cached block: (chained hash, parent hash, the block's token ids)
BlockKey = tuple[int, int, tuple[int, ...]]


class BlockPool:
    """``num_blocks`` blocks of ``block_size`` tokens.

    Args:
        num_blocks, block_size: the cache's geometry (both >= 1).

    Raises:
        ValueError: a non-positive size.
    """

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(
                f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}"
            )
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_counts = [0] * num_blocks
        self.block_keys: list[BlockKey | None] = [None] * num_blocks
        self.free_queue: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self.cached: dict[int, int] = {}  # block hash -> block id

    @property
    def num_free_blocks(self) -> int:
        """Blocks with no reference (cached or not)."""
        return len(self.free_queue)

    def cached_block(self, key: BlockKey) -> int | None:
        """The block holding exactly ``key``'s tokens after ``key``'s parent, or None.

        A hash match whose parent or tokens differ (a collision) is a miss.
        """
        block = self.cached.get(key[0])
        if block is None or self.block_keys[block] != key:
            return None
        return block

    def num_reclaimed(self, blocks: list[int]) -> int:
        """How many of these (cached) blocks sit in the free queue: taking them uses free blocks."""
        return sum(1 for b in blocks if self.ref_counts[b] == 0)

    def take(self, blocks: list[int]) -> None:
        """Add a reference to each of these blocks (prefix hits), out of the free queue if
        needed."""
        for b in blocks:
            if self.ref_counts[b] == 0:
                del self.free_queue[b]
            self.ref_counts[b] += 1

    def allocate(self, n: int) -> list[int]:
        """``n`` blocks from the front of the free queue, each with one reference; their cached
        contents (if any) are evicted.

        Raises:
            ValueError: fewer than ``n`` free blocks (callers check first).
        """
        if n > len(self.free_queue):
            raise ValueError(f"{n} blocks asked, {len(self.free_queue)} free")
        out = []
        for _ in range(n):
            block, _ = self.free_queue.popitem(last=False)
            key = self.block_keys[block]
            if key is not None:
                self.uncache(block)
            self.ref_counts[block] = 1
            out.append(block)
        return out

    def cache(self, block: int, key: BlockKey) -> None:
        """Register a block's contents in the prefix cache (no-op when the block already holds
        cached contents or another block holds the same)."""
        if self.block_keys[block] is not None or key[0] in self.cached:
            return
        self.block_keys[block] = key
        self.cached[key[0]] = block

    def uncache(self, block: int) -> None:
        """Forget a block's cached contents (no-op when it has none)."""
        key = self.block_keys[block]
        if key is None:
            return
        if self.cached.get(key[0]) == block:
            del self.cached[key[0]]
        self.block_keys[block] = None

    def release(self, blocks: list[int]) -> None:
        """Drop one reference of each block, in order; a block left without reference goes to
        the back of the free queue (so release a request's tail first: its prefix outlives it)."""
        for block in blocks:
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self.free_queue[block] = None

    def check_integrity(self) -> None:
        """Assert the pool's invariants (for tests).

        Raises:
            AssertionError: a free block with references, a referenced block in the free queue,
                a negative count, or a cache entry pointing at the wrong block.
        """
        for b, rc in enumerate(self.ref_counts):
            assert rc >= 0, f"block {b} has ref count {rc}"
            assert (rc == 0) == (b in self.free_queue), (
                f"block {b}: ref {rc}, free={b in self.free_queue}"
            )
        for h, b in self.cached.items():
            assert self.block_keys[b] is not None and self.block_keys[b][0] == h, (
                f"cache entry {h} -> {b}"
            )
