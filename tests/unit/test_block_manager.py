"""BlockManager: allocation, reference counts, freeing and automatic prefix caching.

Every test calls ``check_integrity`` after each operation. The randomized test at the end
drives the allocator the way the scheduler does (admit with prefix hits, grow, finish, abort,
preempt) against an independent model of the expected state: the LRU order of the free queue,
the prefix cache keyed by the whole token prefix, reference counts, and the tokens physically
written into each block (a prefix hit must hand out blocks holding exactly the request's
tokens, and a step must never write into a block another request shares).
"""

from __future__ import annotations

import random

import pytest

from engine.block_manager import BlockManager
from engine.request import Request, SamplingParams


def make_req(rid: str, tokens: list[int], output: list[int] | None = None) -> Request:
    req = Request(rid, list(tokens), SamplingParams(), max_len=1 << 20)
    if output:
        req.output_token_ids = list(output)
    return req


def compute(bm: BlockManager, req: Request, n: int) -> None:
    """What the engine does after a step: the n tokens are now in the cache."""
    req.num_computed_tokens += n
    assert req.num_computed_tokens <= req.num_tokens
    assert len(req.block_table) * bm.block_size >= req.num_computed_tokens
    bm.cache_full_blocks(req)
    bm.check_integrity()


def admit(bm: BlockManager, req: Request, n: int | None = None) -> list[int] | None:
    """Admission as the scheduler does it: prefix lookup, then allocate the remaining tokens."""
    cached = bm.find_cached_prefix(req)
    remaining = req.num_tokens - len(cached) * bm.block_size
    new = bm.allocate_slots(req, remaining if n is None else min(n, remaining), cached)
    bm.check_integrity()
    return new


def run_prompt(bm: BlockManager, req: Request) -> None:
    """Admit and compute the whole prompt in one step."""
    assert admit(bm, req) is not None
    compute(bm, req, req.num_tokens - req.num_computed_tokens)


def snapshot(bm: BlockManager, *reqs: Request):
    return (
        list(bm.ref_counts), list(bm.free_queue), dict(bm.cached), list(bm.block_keys),
        bm.prefix_queries, bm.prefix_hits,
        [(list(r.block_table), r.num_computed_tokens, r.num_cached_tokens) for r in reqs],
    )


def rand_tokens(rng: random.Random, n: int, vocab: int = 1000) -> list[int]:
    return [rng.randrange(vocab) for _ in range(n)]


# --------------------------------------------------------------------------- basic allocation
def test_allocate_append_free():
    rng = random.Random(1)
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    req = make_req("a", rand_tokens(rng, 10))
    new = bm.allocate_slots(req, 10)
    bm.check_integrity()
    assert new == req.block_table and len(new) == 3 and len(set(new)) == 3
    assert all(bm.ref_counts[b] == 1 for b in new)
    assert bm.num_free_blocks == 5 and bm.usage == pytest.approx(3 / 8)
    compute(bm, req, 10)
    # decode: tokens 11 and 12 fit in the third block, token 13 needs a fourth
    for expect_new in (0, 0, 1, 0):
        req.output_token_ids.append(rng.randrange(1000))
        before = list(req.block_table)
        new = bm.allocate_slots(req, 1)
        bm.check_integrity()
        assert len(new) == expect_new
        assert req.block_table == before + new
        compute(bm, req, 1)
    assert len(req.block_table) == 4 == bm.blocks_needed(req.num_tokens)
    assert bm.num_free_blocks == 4
    # a chunk of several tokens
    req.output_token_ids.extend(rand_tokens(rng, 6))
    new = bm.allocate_slots(req, 6)
    assert len(new) == bm.blocks_needed(req.num_tokens) - 4 == 1
    bm.free(req)
    bm.check_integrity()
    assert req.block_table == []
    assert bm.num_free_blocks == 8 and bm.usage == 0.0
    assert all(rc == 0 for rc in bm.ref_counts)


def test_blocks_are_distinct_across_requests_and_constructor_validates():
    rng = random.Random(2)
    bm = BlockManager(num_blocks=16, block_size=8)
    reqs = [make_req(f"r{i}", rand_tokens(rng, rng.randint(1, 30))) for i in range(5)]
    for r in reqs:
        assert bm.allocate_slots(r, r.num_tokens) is not None
        bm.check_integrity()
    owned = [b for r in reqs for b in r.block_table]
    assert len(owned) == len(set(owned)) == sum(bm.blocks_needed(r.num_tokens) for r in reqs)
    assert bm.num_free_blocks == 16 - len(owned)
    with pytest.raises(ValueError):
        BlockManager(0, 16)
    with pytest.raises(ValueError):
        BlockManager(4, 0)


def test_allocate_returns_none_and_changes_nothing_when_full():
    rng = random.Random(3)
    bm = BlockManager(num_blocks=6, block_size=4)
    a = make_req("a", rand_tokens(rng, 12))  # 3 blocks, cached after compute
    run_prompt(bm, a)
    b = make_req("b", rand_tokens(rng, 7))  # 2 blocks
    run_prompt(bm, b)
    assert bm.num_free_blocks == 1

    # a new request needing 2 blocks: None, nothing touched (not even a partial allocation)
    c = make_req("c", rand_tokens(rng, 5))
    snap = snapshot(bm, a, b, c)
    assert bm.allocate_slots(c, 5) is None
    assert snapshot(bm, a, b, c) == snap
    bm.check_integrity()

    # a running request growing past the cache
    b.output_token_ids.extend(rand_tokens(rng, 10))
    snap = snapshot(bm, a, b, c)
    assert bm.allocate_slots(b, 10) is None
    assert snapshot(bm, a, b, c) == snap
    assert bm.allocate_slots(b, 5) is not None  # 12 tokens: 3 blocks, the one free block
    bm.check_integrity()
    assert bm.num_free_blocks == 0
    assert bm.allocate_slots(c, 1) is None  # completely full: still no exception
    bm.check_integrity()

    # with prefix hits that sit in the free queue (ref 0): they are reclaimed only on success
    bm.free(a)
    bm.free(b)
    bm.check_integrity()
    d = make_req("d", a.prompt_token_ids + rand_tokens(rng, 30))  # 3 hits + 8 more blocks > 6
    cached = bm.find_cached_prefix(d)
    assert len(cached) == 3
    snap = snapshot(bm, d)
    assert bm.allocate_slots(d, d.num_tokens - 12, cached) is None
    assert snapshot(bm, d) == snap
    assert all(blk in bm.free_queue for blk in cached)
    bm.check_integrity()
    # 3 hits + 3 new blocks = all 6: fits exactly although the hits are counted as free
    e = make_req("e", a.prompt_token_ids + rand_tokens(rng, 12))
    cached = bm.find_cached_prefix(e)
    assert len(cached) == 3
    new = bm.allocate_slots(e, e.num_tokens - 12, cached)
    bm.check_integrity()
    assert new is not None and len(new) == 3 and not set(new) & set(cached)
    assert e.block_table == cached + new and bm.num_free_blocks == 0
    assert e.num_computed_tokens == 12


def test_free_is_idempotent():
    rng = random.Random(4)
    bm = BlockManager(num_blocks=8, block_size=4)
    a = make_req("a", rand_tokens(rng, 9))
    b = make_req("b", rand_tokens(rng, 5))
    run_prompt(bm, a)
    run_prompt(bm, b)
    bm.free(a)
    bm.check_integrity()
    snap = snapshot(bm, a, b)
    bm.free(a)
    bm.free(a)
    bm.check_integrity()
    assert snapshot(bm, a, b) == snap
    assert all(bm.ref_counts[blk] == 1 for blk in b.block_table)  # b untouched
    bm.free(make_req("never", [1, 2, 3]))  # never allocated
    bm.check_integrity()
    assert snapshot(bm, a, b) == snap
    bm.free(b)
    assert bm.num_free_blocks == 8


# --------------------------------------------------------------------------- prefix caching
def test_ref_counts_shared_through_prefix_hits():
    rng = random.Random(5)
    bm = BlockManager(num_blocks=16, block_size=4)
    prefix = rand_tokens(rng, 8)
    a = make_req("a", prefix + rand_tokens(rng, 3))
    run_prompt(bm, a)
    b = make_req("b", prefix + rand_tokens(rng, 6))
    c = make_req("c", prefix + rand_tokens(rng, 1))
    run_prompt(bm, b)
    run_prompt(bm, c)
    shared = a.block_table[:2]
    assert b.block_table[:2] == shared and c.block_table[:2] == shared
    assert b.num_cached_tokens == c.num_cached_tokens == 8
    assert [bm.ref_counts[blk] for blk in shared] == [3, 3]
    assert len({a.block_table[2], b.block_table[2], c.block_table[2]}) == 3  # own tails
    used = {blk for r in (a, b, c) for blk in r.block_table}
    assert bm.num_free_blocks == 16 - len(used)
    bm.free(a)
    bm.check_integrity()
    assert [bm.ref_counts[blk] for blk in shared] == [2, 2]
    assert not any(blk in bm.free_queue for blk in shared)
    bm.free(c)
    bm.free(b)
    bm.check_integrity()
    assert all(rc == 0 for rc in bm.ref_counts) and bm.num_free_blocks == 16
    # the shared blocks stay in the cache after their last user left
    d = make_req("d", prefix + [7])
    assert bm.find_cached_prefix(d) == shared


def test_chained_hashes_same_block_after_different_prefix_does_not_hit():
    rng = random.Random(6)
    bm = BlockManager(num_blocks=32, block_size=4)
    p1, p2, x, y = (rand_tokens(rng, 4) for _ in range(4))
    a = make_req("a", p1 + x + y + [5])
    run_prompt(bm, a)
    # same second and third blocks, different first block: no hit at all
    b = make_req("b", p2 + x + y + [5])
    assert bm.find_cached_prefix(b) == []
    # the block x at a different position (after x itself): no hit beyond p1
    c = make_req("c", p1 + y + x + [5])
    assert bm.find_cached_prefix(c) == a.block_table[:1]
    # the first block alone as block 0 hits; its content elsewhere does not
    d = make_req("d", x + y + [5])
    assert bm.find_cached_prefix(d) == []
    e = make_req("e", p1 + x + [9, 9, 9, 9, 9])
    assert bm.find_cached_prefix(e) == a.block_table[:2]
    # one token differing inside a block stops the match there
    f = make_req("f", p1 + x[:3] + [(x[3] + 1) % 1000] + y + [5])
    assert bm.find_cached_prefix(f) == a.block_table[:1]
    bm.check_integrity()
    # b computed and cached: a has block x after p1, b after p2, both cached separately
    run_prompt(bm, b)
    assert not set(a.block_table) & set(b.block_table)
    g = make_req("g", p2 + x + [1])
    assert bm.find_cached_prefix(g) == b.block_table[:2]


def test_prompt_exact_multiple_of_block_size_leaves_one_token():
    rng = random.Random(7)
    bs = 4
    bm = BlockManager(num_blocks=32, block_size=bs)
    prompt = rand_tokens(rng, 3 * bs)
    a = make_req("a", prompt)
    run_prompt(bm, a)
    assert len(bm.cached) == 3
    b = make_req("b", prompt)  # identical prompt, all three blocks cached
    cached = bm.find_cached_prefix(b)
    assert cached == a.block_table[:2], "the last block must be recomputed to produce logits"
    new = bm.allocate_slots(b, b.num_tokens - 2 * bs, cached)
    bm.check_integrity()
    assert len(new) == 1 and b.num_computed_tokens == 2 * bs
    assert b.num_tokens - b.num_computed_tokens == bs >= 1
    compute(bm, b, bs)
    # a one-block prompt: nothing can be taken from the cache
    c = make_req("c", prompt[:bs])
    assert bm.find_cached_prefix(c) == []
    # one token more than the cached blocks: all of them hit
    d = make_req("d", prompt + [1])
    assert bm.find_cached_prefix(d) == a.block_table[:3]
    # a single-token prompt
    assert bm.find_cached_prefix(make_req("e", prompt[:1])) == []


def test_freed_cached_blocks_reused_in_lru_order_until_evicted():
    rng = random.Random(8)
    bs = 4
    bm = BlockManager(num_blocks=8, block_size=bs)
    a = make_req("a", rand_tokens(rng, 2 * bs + 1))  # blocks a0 a1 + partial
    b = make_req("b", rand_tokens(rng, 2 * bs + 1))
    run_prompt(bm, a)
    run_prompt(bm, b)
    a_blocks, b_blocks = list(a.block_table), list(b.block_table)
    bm.free(a)  # freed first: evicted first; within a request the tail goes first
    bm.free(b)
    bm.check_integrity()
    never_used = [blk for blk in range(8) if blk not in a_blocks + b_blocks]
    expected_order = never_used + a_blocks[::-1] + b_blocks[::-1]
    assert list(bm.free_queue) == expected_order

    # a hit takes blocks back out of the free queue: they are not evicted afterwards
    a2 = make_req("a2", a.prompt_token_ids[: 2 * bs] + [3])
    assert bm.find_cached_prefix(a2) == a_blocks[:2]
    run_prompt(bm, a2)
    assert a2.block_table[:2] == a_blocks[:2]
    assert a2.block_table[2] == never_used[0]  # fresh blocks come from the front
    a2_blocks = list(a2.block_table)
    bm.free(a2)  # a2's blocks go to the back (most recently used), tail first
    bm.check_integrity()
    assert list(bm.free_queue)[-3:] == a2_blocks[::-1]
    order = list(bm.free_queue)
    assert order == (never_used[1:] + [a_blocks[2]] + b_blocks[::-1]
                     + [never_used[0], a_blocks[1], a_blocks[0]])

    # allocate 4 blocks: evicts the never used one, a's old tail, b's tail and b1
    filler = make_req("f", rand_tokens(rng, 4 * bs))
    new = bm.allocate_slots(filler, 4 * bs)
    bm.check_integrity()
    assert new == order[:4]
    # b's prefix: b0 survived, b1 evicted -> only one block hits
    b_again = make_req("b2", b.prompt_token_ids)
    assert bm.find_cached_prefix(b_again) == b_blocks[:1]
    # a's prefix (recently used through a2) still fully cached
    assert bm.find_cached_prefix(make_req("a3", a.prompt_token_ids)) == a_blocks[:2]
    # evict everything: nothing hits any more
    bm.free(filler)
    g = make_req("g", rand_tokens(rng, 8 * bs))
    assert bm.allocate_slots(g, 8 * bs) is not None
    bm.check_integrity()
    assert bm.cached == {}
    bm.free(g)
    assert bm.find_cached_prefix(make_req("a4", a.prompt_token_ids)) == []
    assert bm.find_cached_prefix(make_req("b3", b.prompt_token_ids)) == []
    bm.check_integrity()


def test_evicted_block_reused_for_other_content_does_not_hit_old_prefix():
    rng = random.Random(9)
    bm = BlockManager(num_blocks=3, block_size=4)
    old = make_req("old", rand_tokens(rng, 9))
    run_prompt(bm, old)
    old_blocks = list(old.block_table)
    bm.free(old)
    assert len(bm.cached) == 2
    new = make_req("new", rand_tokens(rng, 9))
    run_prompt(bm, new)  # takes all three blocks, now holding other tokens
    bm.check_integrity()
    assert sorted(new.block_table) == sorted(old_blocks)
    assert len(bm.cached) == 2 and set(bm.cached.values()) == set(new.block_table[:2])
    assert bm.find_cached_prefix(make_req("o2", old.prompt_token_ids)) == []
    assert bm.find_cached_prefix(make_req("n2", new.prompt_token_ids)) == new.block_table[:2]


def test_prefix_counters():
    rng = random.Random(10)
    bs = 4
    bm = BlockManager(num_blocks=32, block_size=bs)
    prefix = rand_tokens(rng, 3 * bs)
    a = make_req("a", prefix + [1, 2])
    run_prompt(bm, a)
    assert (bm.prefix_queries, bm.prefix_hits) == (14, 0)
    b = make_req("b", prefix + [3])  # 3 full blocks hit
    run_prompt(bm, b)
    assert (bm.prefix_queries, bm.prefix_hits) == (14 + 13, 12)
    c = make_req("c", prefix)  # exact multiple: only 2 blocks may hit
    run_prompt(bm, c)
    assert (bm.prefix_queries, bm.prefix_hits) == (14 + 13 + 12, 12 + 8)
    d = make_req("d", prefix[:5] + [999, 998, 997, 996])
    run_prompt(bm, d)
    assert (bm.prefix_queries, bm.prefix_hits) == (14 + 13 + 12 + 9, 12 + 8 + 4)
    for r in (a, b, c, d):
        bm.free(r)
    bm.check_integrity()
    assert bm.num_free_blocks == 32

    off = BlockManager(num_blocks=8, block_size=bs, enable_prefix_caching=False)
    e = make_req("e", prefix + [1])
    run_prompt(off, e)
    off.free(e)
    f = make_req("f", prefix + [1])
    assert off.find_cached_prefix(f) == []
    assert (off.prefix_queries, off.prefix_hits) == (0, 0)
    assert off.cached == {} and all(k is None for k in off.block_keys)
    off.check_integrity()


def test_num_cached_tokens_counts_prompt_tokens_of_a_preempted_request():
    """A preempted request re-admitted with outputs in the cache reports at most its prompt."""
    rng = random.Random(11)
    bs = 4
    bm = BlockManager(num_blocks=16, block_size=bs)
    req = make_req("r", rand_tokens(rng, 6))
    run_prompt(bm, req)
    for _ in range(10):  # decode 10 tokens
        req.output_token_ids.append(rng.randrange(1000))
        assert bm.allocate_slots(req, 1) is not None
        compute(bm, req, 1)
    # preempt (recompute): free everything, start over; the cache still holds 3 full blocks
    bm.free(req)
    req.num_computed_tokens = 0
    assert req.num_tokens == 16
    cached = bm.find_cached_prefix(req)
    assert len(cached) == 3
    assert bm.allocate_slots(req, req.num_tokens - 3 * bs, cached) is not None
    bm.check_integrity()
    assert req.num_computed_tokens == 12
    assert req.num_cached_tokens == 6, "num_cached_tokens counts prompt tokens found in the cache"
    bm.free(req)


# --------------------------------------------------------------------------- randomized model
class Model:
    """Independent model of the allocator: LRU free list, prefix cache keyed by token prefixes."""

    def __init__(self, num_blocks: int, block_size: int, caching: bool):
        self.bs = block_size
        self.caching = caching
        self.free = list(range(num_blocks))  # front = evicted first
        self.content: dict[int, tuple] = {}  # block -> token prefix it is cached under
        self.cache: dict[tuple, int] = {}  # token prefix -> block
        self.phys = [[None] * block_size for _ in range(num_blocks)]  # tokens written (KV)
        self.tables: dict[str, list[int]] = {}
        self.queries = self.hits = 0

    def refs(self, num_blocks: int) -> list[int]:
        rc = [0] * num_blocks
        for t in self.tables.values():
            for b in t:
                rc[b] += 1
        return rc

    def lookup(self, req: Request) -> list[int]:
        if not self.caching:
            return []
        toks = req.all_token_ids
        out = []
        for i in range((req.num_tokens - 1) // self.bs):
            b = self.cache.get(tuple(toks[: (i + 1) * self.bs]))
            if b is None:
                break
            out.append(b)
        self.queries += req.num_prompt_tokens
        self.hits += min(len(out) * self.bs, req.num_prompt_tokens)
        return out

    def allocate(self, req: Request, computed: int, n: int, hits: list[int]) -> list[int] | None:
        table = self.tables.get(req.request_id, [])
        have = len(table) + len(hits)
        need = max(0, -(-(computed + n) // self.bs) - have)
        rc = self.refs(len(self.phys))
        reclaim = sum(1 for b in hits if rc[b] == 0)
        if need > len(self.free) - reclaim:
            return None
        for b in hits:
            if b in self.free:
                self.free.remove(b)
        new = self.free[:need]
        del self.free[:need]
        for b in new:
            key = self.content.pop(b, None)
            if key is not None and self.cache.get(key) == b:
                del self.cache[key]
            self.phys[b] = [None] * self.bs
        self.tables[req.request_id] = table + hits + new
        return new

    def write(self, req: Request, start: int, end: int) -> None:
        table = self.tables[req.request_id]
        rc = self.refs(len(self.phys))
        toks = req.all_token_ids
        for pos in range(start, end):
            b = table[pos // self.bs]
            assert rc[b] == 1, f"step writes position {pos} into block {b} shared by {rc[b]} requests"
            self.phys[b][pos % self.bs] = toks[pos]
        if self.caching:
            for i in range(end // self.bs):
                b, key = table[i], tuple(toks[: (i + 1) * self.bs])
                if b not in self.content and key not in self.cache:
                    self.content[b] = key
                    self.cache[key] = b

    def release(self, rid: str) -> None:
        table = self.tables.pop(rid, [])
        rc = self.refs(len(self.phys))
        for b in reversed(table):
            if rc[b] == 0 and b not in self.free:
                self.free.append(b)


@pytest.mark.parametrize("caching", [True, False], ids=["prefix-cache", "no-cache"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_randomized_operations_against_model(seed, caching):
    rng = random.Random(1000 + seed)
    bs = rng.choice([2, 4, 8])
    num_blocks = rng.randint(6, 24)
    bm = BlockManager(num_blocks=num_blocks, block_size=bs, enable_prefix_caching=caching)
    model = Model(num_blocks, bs, caching)
    vocab = 3  # tiny vocabulary: equal blocks after different prefixes are common
    prefixes = [[rng.randrange(vocab) for _ in range(rng.randint(1, 4 * bs))] for _ in range(4)]
    running: dict[str, Request] = {}
    waiting: list[Request] = []  # preempted, to be re-admitted (with hits on their own blocks)
    counter = 0
    stats = dict(admit=0, hit_blocks=0, full=0, grow=0, finish=0, abort=0, preempt=0, readmit=0)

    def check():
        bm.check_integrity()
        assert bm.ref_counts == model.refs(num_blocks)
        assert list(bm.free_queue) == model.free
        assert bm.num_free_blocks == len(model.free)
        assert (bm.prefix_queries, bm.prefix_hits) == (model.queries, model.hits)
        for rid, r in running.items():
            assert r.block_table == model.tables[rid]
            assert len(r.block_table) == bm.blocks_needed(r.num_computed_tokens) or r.num_computed_tokens == 0
        if caching:
            assert len(bm.cached) == len(model.cache)
            assert sorted(bm.cached.values()) == sorted(model.cache.values())

    def try_admit(req: Request) -> bool:
        n = rng.randint(1, req.num_tokens)  # chunk size (the rest is grown later)
        hits = bm.find_cached_prefix(req)
        mhits = model.lookup(req)
        assert hits == mhits
        for i, b in enumerate(hits):  # a hit holds exactly the request's tokens
            assert model.phys[b] == req.all_token_ids[i * bs : (i + 1) * bs]
        computed = len(hits) * bs
        assert computed < req.num_tokens
        n = min(n, req.num_tokens - computed)
        expect = model.allocate(req, computed, n, mhits)
        got = bm.allocate_slots(req, n, hits)
        assert (got is None) == (expect is None)
        if got is None:
            assert req.block_table == [] and req.num_computed_tokens == 0
            check()
            return False
        assert got == expect
        assert req.num_computed_tokens == computed
        stats["hit_blocks"] += len(hits)
        model.write(req, computed, computed + n)
        compute(bm, req, n)
        running[req.request_id] = req
        check()
        return True

    def preempt(req: Request) -> None:
        bm.free(req)
        model.release(req.request_id)
        req.num_computed_tokens = 0
        del running[req.request_id]
        waiting.append(req)
        stats["preempt"] += 1
        check()

    for _ in range(400):
        op = rng.random()
        if op < 0.3:  # admit a new request, often behind a shared prefix
            counter += 1
            prefix = rng.choice(prefixes) if rng.random() < 0.7 else []
            prompt = prefix + [rng.randrange(vocab) for _ in range(rng.randint(1, 3 * bs))]
            req = make_req(f"r{counter}", prompt)
            stats["admit"] += 1
            if not try_admit(req):
                stats["full"] += 1
        elif op < 0.4 and waiting:  # re-admit a preempted request (prompt + outputs)
            req = waiting.pop(0)
            if try_admit(req):
                stats["readmit"] += 1
            else:
                waiting.insert(0, req)
        elif op < 0.75 and running:  # grow: continue a prefill chunk or decode new tokens
            req = rng.choice(list(running.values()))
            if req.num_computed_tokens == req.num_tokens:
                req.output_token_ids.extend(rng.randrange(vocab) for _ in range(rng.choice([1, 1, 1, 2, bs])))
            n = rng.randint(1, req.num_tokens - req.num_computed_tokens)
            start = req.num_computed_tokens
            expect = model.allocate(req, start, n, [])
            got = bm.allocate_slots(req, n)
            assert (got is None) == (expect is None)
            if got is None:
                check()
                preempt(req)  # out of blocks: recompute later
                continue
            assert got == expect
            model.write(req, start, start + n)
            compute(bm, req, n)
            stats["grow"] += 1
            check()
        elif op < 0.9 and running:  # finish or abort (abort may hit a request mid-prefill)
            req = rng.choice(list(running.values()))
            bm.free(req)
            bm.free(req)  # idempotent
            model.release(req.request_id)
            del running[req.request_id]
            stats["finish" if req.num_computed_tokens == req.num_tokens else "abort"] += 1
            check()
        elif running:
            preempt(rng.choice(list(running.values())))
        elif waiting:  # an aborted waiting request holds nothing
            waiting.pop(rng.randrange(len(waiting)))

    for req in list(running.values()):
        bm.free(req)
        model.release(req.request_id)
        del running[req.request_id]
        check()
    assert bm.num_free_blocks == num_blocks and all(rc == 0 for rc in bm.ref_counts)
    bm.check_integrity()
    # the run exercised what it is meant to
    assert stats["full"] > 0 and stats["preempt"] > 0 and stats["grow"] > 50
    if caching:
        assert stats["hit_blocks"] > 0 and stats["readmit"] > 0
