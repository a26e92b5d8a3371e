"""The KV cache manager: the one owner of every request's KV blocks and of the prefix cache.

Interface after vLLM v1's ``KVCacheManager`` (``vllm/v1/core/kv_cache_manager.py``): a pure
lookup of the cached prefix (:meth:`get_computed_blocks`), an allocation that returns the new
blocks or None and registers the full blocks in the prefix cache itself
(:meth:`allocate_slots`), and :meth:`free`. The request's progress (``num_computed_tokens``) is
the scheduler's; this class only reads it.

Prefix caching (automatic, as in vLLM): a full block is identified by a chained hash of its
parent's hash and its token ids (:mod:`engine.core.block_pool`). Blocks are registered when
they are allocated for the step that fills them, so a request admitted later in the same step
can already share them: each layer stores the whole step's keys/values before any attention
reads them. A block stays in the cache only once its tokens are computed: blocks of a request
freed before its step advanced ``num_computed_tokens`` over them (a step that failed) are
forgotten.
"""

from __future__ import annotations

from engine.core.block_pool import BlockKey, BlockPool
from engine.core.request import Request


class KVCacheManager:
    """Request id -> physical KV block ids, over a :class:`BlockPool`.

    Allocation never raises on a full cache: it returns None and leaves everything as it was.
    Freeing is idempotent. Counters ``prefix_queries`` / ``prefix_hits`` count prompt tokens
    looked up and found in the prefix cache, once per admission.

    Args:
        num_blocks, block_size: the cache's geometry.
        enable_prefix_caching: share full blocks between requests with the same prefix.

    Raises:
        ValueError: a non-positive size.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.pool = BlockPool(num_blocks, block_size)
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._blocks: dict[str, list[int]] = {}  # request id -> its block table
        self._hashes: dict[
            str, list[int]
        ] = {}  # request id -> chained hashes of its full blocks (memo)
        self._num_registered: dict[
            str, int
        ] = {}  # request id -> leading blocks already looked at for caching
        self.prefix_queries = 0
        self.prefix_hits = 0

    # ------------------------------------------------------------------ queries
    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by live requests (0..1)."""
        return 1.0 - self.pool.num_free_blocks / self.pool.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks that hold ``num_tokens`` tokens."""
        return -(-num_tokens // self.block_size)

    def get_block_ids(self, request_id: str) -> list[int]:
        """A copy of the request's block table (physical block ids in order; [] when it has
        none)."""
        return list(self._blocks.get(request_id, ()))

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """The longest cached prefix of the request's tokens: (its blocks, its tokens).

        A pure lookup: changes no reference count and no counter. At least one token is always
        left to compute (the last one produces the logits). ([], 0) when prefix caching is off,
        and for a request that scores its prompt (``Request.scores_prompt``: every prompt
        position must run through the model to give its log-probability), as vLLM skips the
        lookup for prompt-logprob requests; such a request's own blocks are still registered, so
        later requests share them.
        """
        if not self.enable_prefix_caching or request.scores_prompt:
            return [], 0
        blocks = []
        for i in range(self._num_full(request, request.num_tokens - 1)):
            block = self.pool.cached_block(self._key(request, i))
            if block is None:
                break
            blocks.append(block)
        return blocks, len(blocks) * self.block_size

    # --------------------------------------------------------------- mutations
    def allocate_slots(
        self, request: Request, num_new_tokens: int, new_computed_blocks: list[int] | None = None
    ) -> list[int] | None:
        """Make the request's blocks cover ``num_computed_tokens + num_new_tokens`` tokens, plus
        the prefix hits of an admission.

        Args:
            request: its ``num_computed_tokens`` is read, not changed.
            num_new_tokens: tokens the next step computes (after the hit tokens).
            new_computed_blocks: on admission (also with no hit: ``[]``), the blocks from
                :meth:`get_computed_blocks`; they are taken (ref count + 1) and the lookup is
                counted in ``prefix_queries`` / ``prefix_hits`` (not for a request that scores
                its prompt: it made no lookup). None for a running request.

        Returns:
            The newly allocated block ids (hits excluded), or None when there are not enough
            free blocks (nothing is changed then). Full blocks of tokens known on the host are
            registered in the prefix cache.
        """
        blocks = self._blocks.get(request.request_id)
        if new_computed_blocks is None and blocks is not None:  # a running request (every step)
            end = request.num_computed_tokens + num_new_tokens
            need = -(-end // self.block_size) - len(blocks)
            if need <= 0:  # its blocks already cover the step: the common decode case
                if self.enable_prefix_caching:
                    self._register(request, min(end, request.num_tokens))
                return []
        hits = new_computed_blocks or []
        if blocks is None:
            blocks = []
        num_computed = request.num_computed_tokens + len(hits) * self.block_size
        need = max(0, self.blocks_needed(num_computed + num_new_tokens) - len(blocks) - len(hits))
        if need > self.pool.num_free_blocks - self.pool.num_reclaimed(hits):
            return None
        if (
            new_computed_blocks is not None
            and self.enable_prefix_caching
            and not request.scores_prompt
        ):
            self.prefix_queries += request.num_prompt_tokens
            self.prefix_hits += min(len(hits) * self.block_size, request.num_prompt_tokens)
        self.pool.take(hits)
        new_blocks = self.pool.allocate(need)
        blocks = self._blocks.setdefault(request.request_id, blocks)
        blocks += hits
        blocks += new_blocks
        if self.enable_prefix_caching:
            self._register(request, min(num_computed + num_new_tokens, request.num_tokens))
        return new_blocks

    def free(self, request: Request) -> None:
        """Release the request's blocks (tail first, so a prefix outlives its suffix in the LRU)
        and forget its hashes. Call it before resetting the request's progress (preemption):
        blocks past ``num_computed_tokens`` leave the prefix cache, their contents unconfirmed.

        Idempotent: a request without blocks frees nothing.
        """
        rid = request.request_id
        blocks = self._blocks.pop(rid, [])
        computed = request.num_computed_tokens // self.block_size
        for block in blocks[computed:]:  # this request's own blocks (hits are computed tokens)
            self.pool.uncache(block)
        self.pool.release(blocks[::-1])
        self._hashes.pop(rid, None)
        self._num_registered.pop(rid, None)

    # ---------------------------------------------------------------- hashing
    def _num_full(self, request: Request, num_tokens: int) -> int:
        """Full blocks in the first ``num_tokens`` tokens, with their hashes memoised."""
        n_full = num_tokens // self.block_size
        hashes = self._hashes.setdefault(request.request_id, [])
        while len(hashes) < n_full:
            hashes.append(self._make_key(request, len(hashes), hashes[-1] if hashes else 0)[0])
        return n_full

    def _make_key(self, request: Request, index: int, parent: int) -> BlockKey:
        bs = self.block_size
        tokens = tuple(request.token_slice(index * bs, (index + 1) * bs))
        return hash((parent, tokens)), parent, tokens

    def _key(self, request: Request, index: int) -> BlockKey:
        hashes = self._hashes[request.request_id]
        return self._make_key(request, index, hashes[index - 1] if index else 0)

    def _register(self, request: Request, num_tokens: int) -> None:
        """Register the request's full blocks among its first ``num_tokens`` tokens."""
        rid = request.request_id
        start = self._num_registered.get(rid, 0)
        n_full = self._num_full(request, num_tokens)
        blocks = self._blocks[rid]
        for i in range(start, n_full):
            self.pool.cache(blocks[i], self._key(request, i))
        self._num_registered[rid] = max(start, n_full)

    def check_integrity(self, requests: list[Request] | None = None) -> None:
        """Assert the invariants (for tests): the pool's, every block referenced by exactly the
        requests holding it, and each given request's blocks covering its computed tokens.

        Raises:
            AssertionError: a broken invariant.
        """
        self.pool.check_integrity()
        refs = [0] * self.pool.num_blocks
        for blocks in self._blocks.values():
            for b in blocks:
                refs[b] += 1
        assert refs == self.pool.ref_counts, "reference counts differ from the requests' blocks"
        for req in requests or []:
            have = len(self._blocks.get(req.request_id, ())) * self.block_size
            assert have >= req.num_computed_tokens, (
                f"{req.request_id}: {have} slots < {req.num_computed_tokens}"
            )
