"""Paged KV-cache block allocator with reference counts and automatic prefix caching.

Design after vLLM's PagedAttention block manager (Kwon et al., SOSP 2023) and vLLM v1's
prefix cache: a full block is identified by a chained hash of (parent block hash, the block's
token ids); blocks are shared through reference counts; a block whose count drops to zero goes
to the back of the free queue but keeps its hash, so a later request with the same prefix can
take it back until the block is reused for something else (LRU eviction from the front).
"""

from __future__ import annotations

from collections import OrderedDict

from engine.request import Request


class BlockManager:
    """Owns the mapping from requests to physical KV blocks.

    Allocation never raises on a full cache: it returns None and leaves everything as it was.
    Freeing is idempotent. Counters ``prefix_queries`` / ``prefix_hits`` count prompt tokens
    looked up and found in the prefix cache.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_keys: list[tuple | None] = [None] * num_blocks  # (hash, parent_hash, tokens)
        self.free_queue: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self.cached: dict[int, int] = {}  # block hash -> block id
        self.prefix_queries = 0
        self.prefix_hits = 0

    # ------------------------------------------------------------------ queries
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by live requests (0..1)."""
        return 1.0 - len(self.free_queue) / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _block_key(self, request: Request, index: int, parent_hash: int) -> tuple:
        bs = self.block_size
        tokens = tuple(request.token_at(i) for i in range(index * bs, (index + 1) * bs))
        return (hash((parent_hash, tokens)), parent_hash, tokens)

    def _hash_full_blocks(self, request: Request, num_tokens: int) -> list[int]:
        """Chained hashes of the request's first ``num_tokens // block_size`` blocks (memoised)."""
        n_full = num_tokens // self.block_size
        hashes = request.block_hashes
        while len(hashes) < n_full:
            parent = hashes[-1] if hashes else 0
            hashes.append(self._block_key(request, len(hashes), parent)[0])
        return hashes[:n_full]

    def find_cached_prefix(self, request: Request, count: bool = True) -> list[int]:
        """Blocks holding the longest cached prefix of the request's tokens.

        At least one token is always left to compute (the last one produces the logits).
        Updates the query/hit counters unless ``count`` is False (the scheduler counts a lookup
        only once the request is admitted, see :meth:`count_prefix_lookup`). Returns [] when
        prefix caching is off.
        """
        if not self.enable_prefix_caching:
            return []
        hashes = self._hash_full_blocks(request, request.num_tokens - 1)
        blocks = []
        for i, h in enumerate(hashes):
            block = self.cached.get(h)
            if block is None:
                break
            key = self.block_keys[block]
            parent = hashes[i - 1] if i else 0
            if key[1] != parent or key[2] != self._block_key(request, i, parent)[2]:
                break  # hash collision: not the same tokens
            blocks.append(block)
        if count:
            self.count_prefix_lookup(request, len(blocks))
        return blocks

    def count_prefix_lookup(self, request: Request, num_hit_blocks: int) -> None:
        """Add one lookup to the counters: the request's prompt tokens queried and found."""
        if self.enable_prefix_caching:
            self.prefix_queries += request.num_prompt_tokens
            self.prefix_hits += min(num_hit_blocks * self.block_size, request.num_prompt_tokens)

    # --------------------------------------------------------------- mutations
    def allocate_slots(
        self, request: Request, num_new_tokens: int, cached_blocks: list[int] | None = None
    ) -> list[int] | None:
        """Make the request's block table cover ``num_computed_tokens + num_new_tokens`` tokens.

        Args:
            request: its ``block_table`` is extended in place.
            num_new_tokens: tokens this step will compute.
            cached_blocks: on admission, prefix-cache hits from :meth:`find_cached_prefix`;
                they are taken (ref count + 1) and ``num_computed_tokens`` advances over them.

        Returns:
            The newly allocated block ids, or None when there are not enough free blocks
            (nothing is changed then).
        """
        cached_blocks = cached_blocks or []
        num_computed = request.num_computed_tokens + len(cached_blocks) * self.block_size
        have = len(request.block_table) + len(cached_blocks)
        need = self.blocks_needed(num_computed + num_new_tokens) - have
        reclaim = sum(1 for b in cached_blocks if self.ref_counts[b] == 0)
        if need > len(self.free_queue) - reclaim:
            return None
        for b in cached_blocks:
            if self.ref_counts[b] == 0:
                del self.free_queue[b]
            self.ref_counts[b] += 1
            request.block_table.append(b)
        if cached_blocks:
            request.num_computed_tokens = num_computed
            request.num_cached_tokens = min(num_computed, request.num_prompt_tokens)
        new_blocks = [self._pop_free() for _ in range(max(need, 0))]
        request.block_table.extend(new_blocks)
        return new_blocks

    def _pop_free(self) -> int:
        block, _ = self.free_queue.popitem(last=False)
        key = self.block_keys[block]
        if key is not None:  # evict its cached contents
            if self.cached.get(key[0]) == block:
                del self.cached[key[0]]
            self.block_keys[block] = None
        self.ref_counts[block] = 1
        return block

    def cache_full_blocks(self, request: Request) -> None:
        """Register the request's computed full blocks in the prefix cache (no-op when off).

        Only tokens known on the host count: a computed token still in flight (async
        scheduling) is hashed on a later call.
        """
        if not self.enable_prefix_caching:
            return
        hashes = self._hash_full_blocks(request, min(request.num_computed_tokens, request.num_tokens))
        for i, h in enumerate(hashes):
            block = request.block_table[i]
            if self.block_keys[block] is not None or h in self.cached:
                continue
            self.block_keys[block] = self._block_key(request, i, hashes[i - 1] if i else 0)
            self.cached[h] = block

    def free(self, request: Request) -> None:
        """Release the request's blocks (tail first, so a prefix outlives its suffix in the LRU).

        Idempotent: a request with an empty block table frees nothing.
        """
        for block in reversed(request.block_table):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self.free_queue[block] = None
        request.block_table = []
        request.block_hashes = []

    def check_integrity(self) -> None:
        """Assert the allocator's invariants (for tests).

        Raises:
            AssertionError: a free block with references, a referenced block in the free
                queue, a negative count, or a cache entry pointing at the wrong block.
        """
        for b, rc in enumerate(self.ref_counts):
            assert rc >= 0, f"block {b} has ref count {rc}"
            assert (rc == 0) == (b in self.free_queue), f"block {b}: ref {rc}, free={b in self.free_queue}"
        for h, b in self.cached.items():
            assert self.block_keys[b] is not None and self.block_keys[b][0] == h, f"cache entry {h} -> {b}"
