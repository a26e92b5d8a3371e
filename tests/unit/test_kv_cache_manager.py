"""KVCacheManager (over its BlockPool): allocation, reference counts, freeing and automatic
prefix caching.

Every test calls ``check_integrity`` after each operation. The manager owns the requests' block
tables (``get_block_ids``); the request's progress (``num_computed_tokens``,
``num_cached_tokens``) is the scheduler's, so the helpers below do what the scheduler does:
look the prefix up (a pure lookup), allocate (which counts the lookup on a successful
admission and registers the full blocks of host-known tokens in the prefix cache at once), then
set the progress; a completed step advances ``num_computed_tokens``.

The randomized test at the end drives the manager the way the scheduler does (steps that admit
with prefix hits, grow, and then complete or fail; finish, abort, preempt) against an
independent model of the expected state: the LRU order of the free queue, the prefix cache
keyed by the whole token prefix (registered at allocation, dropped on free for blocks never
confirmed computed), reference counts, and the tokens physically written into each block (a
prefix hit must hand out blocks holding exactly the request's tokens, and a step must never
overwrite KV another request relies on).
"""

from __future__ import annotations

import random

import pytest

from engine.core.kv_cache_manager import KVCacheManager
from engine.core.request import Request, SamplingParams


def make_req(rid: str, tokens: list[int], output: list[int] | None = None) -> Request:
    req = Request(rid, list(tokens), SamplingParams(), max_len=1 << 20)
    if output:
        req.output_token_ids = list(output)
    return req


def tokens_of(req: Request) -> list[int]:
    """Prompt + output (the request itself only exposes them separately)."""
    return req.prompt_token_ids + req.output_token_ids


def blocks(kv: KVCacheManager, req: Request) -> list[int]:
    return kv.get_block_ids(req.request_id)


def compute(kv: KVCacheManager, req: Request, n: int) -> None:
    """What the engine does after a step: the n tokens are now in the cache."""
    req.num_computed_tokens += n
    assert req.num_computed_tokens <= req.num_tokens_with_placeholders
    assert len(blocks(kv, req)) * kv.block_size >= req.num_computed_tokens
    kv.check_integrity([req])


def admit(kv: KVCacheManager, req: Request, n: int | None = None) -> list[int] | None:
    """Admission as the scheduler does it: prefix lookup, allocate the remaining tokens (the
    lookup is counted then), and on success set the request's progress to the hit tokens."""
    assert req.num_computed_tokens == 0
    hits, num_hit = kv.get_computed_blocks(req)
    assert num_hit == len(hits) * kv.block_size
    remaining = req.num_tokens - num_hit
    new = kv.allocate_slots(req, remaining if n is None else min(n, remaining), hits)
    if new is not None:
        req.num_computed_tokens = num_hit
        req.num_cached_tokens = min(num_hit, req.num_prompt_tokens)
    kv.check_integrity([req])
    return new


def run_prompt(kv: KVCacheManager, req: Request) -> None:
    """Admit and compute the whole prompt in one step."""
    assert admit(kv, req) is not None
    compute(kv, req, req.num_tokens - req.num_computed_tokens)


def snapshot(kv: KVCacheManager, *reqs: Request):
    p = kv.pool
    return (
        list(p.ref_counts),
        list(p.free_queue),
        dict(p.cached),
        list(p.block_keys),
        kv.prefix_queries,
        kv.prefix_hits,
        [(blocks(kv, r), r.num_computed_tokens, r.num_cached_tokens) for r in reqs],
    )


def rand_tokens(rng: random.Random, n: int, vocab: int = 1000) -> list[int]:
    return [rng.randrange(vocab) for _ in range(n)]


# --------------------------------------------------------------------------- basic allocation
def test_allocate_append_free():
    rng = random.Random(1)
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    req = make_req("a", rand_tokens(rng, 10))
    new = kv.allocate_slots(req, 10)
    kv.check_integrity([req])
    assert new == blocks(kv, req) and len(new) == 3 and len(set(new)) == 3
    assert req.num_computed_tokens == 0, "allocation leaves the progress to the scheduler"
    assert all(kv.pool.ref_counts[b] == 1 for b in new)
    assert kv.num_free_blocks == 5 and kv.usage == pytest.approx(3 / 8)
    got = blocks(kv, req)
    got.append(99)  # get_block_ids hands out a copy
    assert blocks(kv, req) == new
    compute(kv, req, 10)
    # decode: tokens 11 and 12 fit in the third block, token 13 needs a fourth
    for expect_new in (0, 0, 1, 0):
        req.output_token_ids.append(rng.randrange(1000))
        before = blocks(kv, req)
        new = kv.allocate_slots(req, 1)
        kv.check_integrity([req])
        assert len(new) == expect_new
        assert blocks(kv, req) == before + new
        compute(kv, req, 1)
    assert len(blocks(kv, req)) == 4 == kv.blocks_needed(req.num_tokens)
    assert kv.num_free_blocks == 4
    # a chunk of several tokens
    req.output_token_ids.extend(rand_tokens(rng, 6))
    new = kv.allocate_slots(req, 6)
    assert len(new) == kv.blocks_needed(req.num_tokens) - 4 == 1
    kv.free(req)
    kv.check_integrity()
    assert blocks(kv, req) == []
    assert kv.num_free_blocks == 8 and kv.usage == 0.0
    assert all(rc == 0 for rc in kv.pool.ref_counts)


def test_blocks_are_distinct_across_requests_and_constructor_validates():
    rng = random.Random(2)
    kv = KVCacheManager(num_blocks=16, block_size=8)
    reqs = [make_req(f"r{i}", rand_tokens(rng, rng.randint(1, 30))) for i in range(5)]
    for r in reqs:
        assert kv.allocate_slots(r, r.num_tokens) is not None
        kv.check_integrity(reqs)
    owned = [b for r in reqs for b in blocks(kv, r)]
    assert len(owned) == len(set(owned)) == sum(kv.blocks_needed(r.num_tokens) for r in reqs)
    assert kv.num_free_blocks == 16 - len(owned)
    with pytest.raises(ValueError):
        KVCacheManager(0, 16)
    with pytest.raises(ValueError):
        KVCacheManager(4, 0)


def test_allocate_returns_none_and_changes_nothing_when_full():
    rng = random.Random(3)
    kv = KVCacheManager(num_blocks=6, block_size=4)
    a = make_req("a", rand_tokens(rng, 12))  # 3 blocks, cached
    run_prompt(kv, a)
    b = make_req("b", rand_tokens(rng, 7))  # 2 blocks
    run_prompt(kv, b)
    assert kv.num_free_blocks == 1

    # a new request needing 2 blocks: None, nothing touched (not even a partial allocation),
    # neither as a plain allocation nor as an admission (whose lookup is then not counted)
    c = make_req("c", rand_tokens(rng, 5))
    snap = snapshot(kv, a, b, c)
    assert kv.allocate_slots(c, 5) is None
    assert snapshot(kv, a, b, c) == snap
    assert kv.allocate_slots(c, 5, []) is None
    assert snapshot(kv, a, b, c) == snap
    kv.check_integrity([a, b, c])

    # a running request growing past the cache
    b.output_token_ids.extend(rand_tokens(rng, 10))
    snap = snapshot(kv, a, b, c)
    assert kv.allocate_slots(b, 10) is None
    assert snapshot(kv, a, b, c) == snap
    assert kv.allocate_slots(b, 5) is not None  # 12 tokens: 3 blocks, the one free block
    kv.check_integrity([a, b, c])
    assert kv.num_free_blocks == 0
    assert kv.allocate_slots(c, 1) is None  # completely full: still no exception
    kv.check_integrity([a, b, c])

    # with prefix hits that sit in the free queue (ref 0): they are reclaimed only on success
    compute(kv, b, 5)
    kv.free(a)
    kv.free(b)
    kv.check_integrity()
    d = make_req("d", a.prompt_token_ids + rand_tokens(rng, 30))  # 3 hits + 8 more blocks > 6
    cached, num_hit = kv.get_computed_blocks(d)
    assert len(cached) == 3 and num_hit == 12
    snap = snapshot(kv, d)
    assert kv.allocate_slots(d, d.num_tokens - 12, cached) is None
    assert snapshot(kv, d) == snap
    assert all(blk in kv.pool.free_queue for blk in cached)
    kv.check_integrity()
    # 3 hits + 3 new blocks = all 6: fits exactly although the hits are counted as free
    e = make_req("e", a.prompt_token_ids + rand_tokens(rng, 12))
    cached, num_hit = kv.get_computed_blocks(e)
    assert len(cached) == 3 and num_hit == 12
    q0, h0 = kv.prefix_queries, kv.prefix_hits
    new = kv.allocate_slots(e, e.num_tokens - 12, cached)
    kv.check_integrity()
    assert new is not None and len(new) == 3 and not set(new) & set(cached)
    assert blocks(kv, e) == cached + new and kv.num_free_blocks == 0
    assert e.num_computed_tokens == 0, "the scheduler, not allocate_slots, advances over the hits"
    assert (kv.prefix_queries - q0, kv.prefix_hits - h0) == (24, 12)


def test_free_is_idempotent():
    rng = random.Random(4)
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = make_req("a", rand_tokens(rng, 9))
    b = make_req("b", rand_tokens(rng, 5))
    run_prompt(kv, a)
    run_prompt(kv, b)
    kv.free(a)
    kv.check_integrity([b])
    snap = snapshot(kv, a, b)
    kv.free(a)
    kv.free(a)
    kv.check_integrity([b])
    assert snapshot(kv, a, b) == snap
    assert all(kv.pool.ref_counts[blk] == 1 for blk in blocks(kv, b))  # b untouched
    kv.free(make_req("never", [1, 2, 3]))  # never allocated
    kv.check_integrity([b])
    assert snapshot(kv, a, b) == snap
    kv.free(b)
    assert kv.num_free_blocks == 8


def test_check_integrity_detects_broken_invariants():
    rng = random.Random(12)
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = make_req("a", rand_tokens(rng, 9))
    run_prompt(kv, a)
    kv.check_integrity([a])
    a.num_computed_tokens = 13  # more computed tokens than its 3 blocks hold
    with pytest.raises(AssertionError):
        kv.check_integrity([a])
    a.num_computed_tokens = 9
    free_block = next(iter(kv.pool.free_queue))
    del kv.pool.free_queue[free_block]  # a reference no request's block table accounts for
    kv.pool.ref_counts[free_block] = 1
    with pytest.raises(AssertionError):
        kv.check_integrity()


# --------------------------------------------------------------------------- prefix caching
def test_ref_counts_shared_through_prefix_hits():
    rng = random.Random(5)
    kv = KVCacheManager(num_blocks=16, block_size=4)
    prefix = rand_tokens(rng, 8)
    a = make_req("a", prefix + rand_tokens(rng, 3))
    run_prompt(kv, a)
    b = make_req("b", prefix + rand_tokens(rng, 6))
    c = make_req("c", prefix + rand_tokens(rng, 1))
    run_prompt(kv, b)
    run_prompt(kv, c)
    shared = blocks(kv, a)[:2]
    assert blocks(kv, b)[:2] == shared and blocks(kv, c)[:2] == shared
    assert b.num_cached_tokens == c.num_cached_tokens == 8
    assert [kv.pool.ref_counts[blk] for blk in shared] == [3, 3]
    assert len({blocks(kv, a)[2], blocks(kv, b)[2], blocks(kv, c)[2]}) == 3  # own tails
    used = {blk for r in (a, b, c) for blk in blocks(kv, r)}
    assert kv.num_free_blocks == 16 - len(used)
    kv.free(a)
    kv.check_integrity([b, c])
    assert [kv.pool.ref_counts[blk] for blk in shared] == [2, 2]
    assert not any(blk in kv.pool.free_queue for blk in shared)
    kv.free(c)
    kv.free(b)
    kv.check_integrity()
    assert all(rc == 0 for rc in kv.pool.ref_counts) and kv.num_free_blocks == 16
    # the shared blocks stay in the cache after their last user left
    d = make_req("d", prefix + [7])
    assert kv.get_computed_blocks(d) == (shared, 8)


def test_chained_hashes_same_block_after_different_prefix_does_not_hit():
    rng = random.Random(6)
    kv = KVCacheManager(num_blocks=32, block_size=4)
    p1, p2, x, y = (rand_tokens(rng, 4) for _ in range(4))
    a = make_req("a", p1 + x + y + [5])
    run_prompt(kv, a)

    def hit(req):
        return kv.get_computed_blocks(req)[0]

    # same second and third blocks, different first block: no hit at all
    b = make_req("b", p2 + x + y + [5])
    assert hit(b) == []
    # the block x at a different position (after x itself): no hit beyond p1
    c = make_req("c", p1 + y + x + [5])
    assert hit(c) == blocks(kv, a)[:1]
    # the first block alone as block 0 hits; its content elsewhere does not
    d = make_req("d", x + y + [5])
    assert hit(d) == []
    e = make_req("e", p1 + x + [9, 9, 9, 9, 9])
    assert hit(e) == blocks(kv, a)[:2]
    # one token differing inside a block stops the match there
    f = make_req("f", p1 + x[:3] + [(x[3] + 1) % 1000] + y + [5])
    assert hit(f) == blocks(kv, a)[:1]
    kv.check_integrity([a])
    # b computed and cached: a has block x after p1, b after p2, both cached separately
    run_prompt(kv, b)
    assert not set(blocks(kv, a)) & set(blocks(kv, b))
    g = make_req("g", p2 + x + [1])
    assert hit(g) == blocks(kv, b)[:2]


def test_prompt_exact_multiple_of_block_size_leaves_one_token():
    rng = random.Random(7)
    bs = 4
    kv = KVCacheManager(num_blocks=32, block_size=bs)
    prompt = rand_tokens(rng, 3 * bs)
    a = make_req("a", prompt)
    run_prompt(kv, a)
    assert len(kv.pool.cached) == 3
    b = make_req("b", prompt)  # identical prompt, all three blocks cached
    cached, num_hit = kv.get_computed_blocks(b)
    assert cached == blocks(kv, a)[:2], "the last block must be recomputed to produce logits"
    assert num_hit == 2 * bs
    new = kv.allocate_slots(b, b.num_tokens - 2 * bs, cached)
    b.num_computed_tokens = num_hit
    kv.check_integrity([a, b])
    assert len(new) == 1 and b.num_computed_tokens == 2 * bs
    assert b.num_tokens - b.num_computed_tokens == bs >= 1
    compute(kv, b, bs)
    # a one-block prompt: nothing can be taken from the cache
    c = make_req("c", prompt[:bs])
    assert kv.get_computed_blocks(c) == ([], 0)
    # one token more than the cached blocks: all of them hit
    d = make_req("d", prompt + [1])
    assert kv.get_computed_blocks(d) == (blocks(kv, a)[:3], 3 * bs)
    # a single-token prompt
    assert kv.get_computed_blocks(make_req("e", prompt[:1])) == ([], 0)


def test_freed_cached_blocks_reused_in_lru_order_until_evicted():
    rng = random.Random(8)
    bs = 4
    kv = KVCacheManager(num_blocks=8, block_size=bs)
    a = make_req("a", rand_tokens(rng, 2 * bs + 1))  # blocks a0 a1 + partial
    b = make_req("b", rand_tokens(rng, 2 * bs + 1))
    run_prompt(kv, a)
    run_prompt(kv, b)
    a_blocks, b_blocks = blocks(kv, a), blocks(kv, b)
    kv.free(a)  # freed first: evicted first; within a request the tail goes first
    kv.free(b)
    kv.check_integrity()
    never_used = [blk for blk in range(8) if blk not in a_blocks + b_blocks]
    expected_order = never_used + a_blocks[::-1] + b_blocks[::-1]
    assert list(kv.pool.free_queue) == expected_order

    def hit(req):
        return kv.get_computed_blocks(req)[0]

    # a hit takes blocks back out of the free queue: they are not evicted afterwards
    a2 = make_req("a2", a.prompt_token_ids[: 2 * bs] + [3])
    assert hit(a2) == a_blocks[:2]
    run_prompt(kv, a2)
    assert blocks(kv, a2)[:2] == a_blocks[:2]
    assert blocks(kv, a2)[2] == never_used[0]  # fresh blocks come from the front
    a2_blocks = blocks(kv, a2)
    kv.free(a2)  # a2's blocks go to the back (most recently used), tail first
    kv.check_integrity()
    assert list(kv.pool.free_queue)[-3:] == a2_blocks[::-1]
    order = list(kv.pool.free_queue)
    assert order == (
        never_used[1:] + [a_blocks[2]] + b_blocks[::-1] + [never_used[0], a_blocks[1], a_blocks[0]]
    )

    # allocate 4 blocks: evicts the never used one, a's old tail, b's tail and b1
    filler = make_req("f", rand_tokens(rng, 4 * bs))
    new = kv.allocate_slots(filler, 4 * bs)
    kv.check_integrity([filler])
    assert new == order[:4]
    # b's prefix: b0 survived, b1 evicted -> only one block hits
    b_again = make_req("b2", b.prompt_token_ids)
    assert hit(b_again) == b_blocks[:1]
    # a's prefix (recently used through a2) still fully cached
    assert hit(make_req("a3", a.prompt_token_ids)) == a_blocks[:2]
    # evict everything: nothing of a or b hits any more
    kv.free(filler)  # never computed: its blocks leave the cache
    g = make_req("g", rand_tokens(rng, 8 * bs))
    assert kv.allocate_slots(g, 8 * bs) is not None
    kv.check_integrity([g])
    # the only cached blocks are g's own, registered at allocation
    assert sorted(kv.pool.cached.values()) == sorted(blocks(kv, g))
    assert hit(make_req("a4", a.prompt_token_ids)) == []
    assert hit(make_req("b3", b.prompt_token_ids)) == []
    kv.free(g)  # never computed either: the cache is empty
    assert kv.pool.cached == {}
    assert hit(make_req("a5", a.prompt_token_ids)) == []
    assert hit(make_req("b4", b.prompt_token_ids)) == []
    kv.check_integrity()


def test_evicted_block_reused_for_other_content_does_not_hit_old_prefix():
    rng = random.Random(9)
    kv = KVCacheManager(num_blocks=3, block_size=4)
    old = make_req("old", rand_tokens(rng, 9))
    run_prompt(kv, old)
    old_blocks = blocks(kv, old)
    kv.free(old)
    assert len(kv.pool.cached) == 2
    new = make_req("new", rand_tokens(rng, 9))
    run_prompt(kv, new)  # takes all three blocks, now holding other tokens
    kv.check_integrity([new])
    assert sorted(blocks(kv, new)) == sorted(old_blocks)
    assert len(kv.pool.cached) == 2 and set(kv.pool.cached.values()) == set(blocks(kv, new)[:2])
    assert kv.get_computed_blocks(make_req("o2", old.prompt_token_ids)) == ([], 0)
    assert kv.get_computed_blocks(make_req("n2", new.prompt_token_ids)) == (blocks(kv, new)[:2], 8)


def test_prefix_counters():
    rng = random.Random(10)
    bs = 4
    kv = KVCacheManager(num_blocks=32, block_size=bs)
    prefix = rand_tokens(rng, 3 * bs)
    a = make_req("a", prefix + [1, 2])
    run_prompt(kv, a)
    assert (kv.prefix_queries, kv.prefix_hits) == (14, 0)
    b = make_req("b", prefix + [3])  # 3 full blocks hit
    run_prompt(kv, b)
    assert (kv.prefix_queries, kv.prefix_hits) == (14 + 13, 12)
    c = make_req("c", prefix)  # exact multiple: only 2 blocks may hit
    run_prompt(kv, c)
    assert (kv.prefix_queries, kv.prefix_hits) == (14 + 13 + 12, 12 + 8)
    d = make_req("d", prefix[:5] + [999, 998, 997, 996])
    run_prompt(kv, d)
    assert (kv.prefix_queries, kv.prefix_hits) == (14 + 13 + 12 + 9, 12 + 8 + 4)
    for r in (a, b, c, d):
        kv.free(r)
    kv.check_integrity()
    assert kv.num_free_blocks == 32

    off = KVCacheManager(num_blocks=8, block_size=bs, enable_prefix_caching=False)
    e = make_req("e", prefix + [1])
    run_prompt(off, e)
    off.free(e)
    f = make_req("f", prefix + [1])
    assert off.get_computed_blocks(f) == ([], 0)
    assert off.allocate_slots(f, f.num_tokens, []) is not None  # an admission: nothing counted
    assert (off.prefix_queries, off.prefix_hits) == (0, 0)
    assert off.pool.cached == {} and all(k is None for k in off.pool.block_keys)
    off.check_integrity()


def test_lookup_is_pure_and_counted_once_on_a_successful_admission():
    """get_computed_blocks changes nothing; only an admission's successful allocate_slots
    counts the lookup (a failed one, a retried lookup or a running request's growth do not)."""
    rng = random.Random(13)
    bs = 4
    kv = KVCacheManager(num_blocks=7, block_size=bs)
    prefix = rand_tokens(rng, 2 * bs)
    a = make_req("a", prefix + [1])
    run_prompt(kv, a)
    assert (kv.prefix_queries, kv.prefix_hits) == (9, 0)
    b = make_req("b", prefix + rand_tokens(rng, 4 * bs + 1))  # 2 hits + 5 new blocks; 4 free
    snap = snapshot(kv, a, b)
    for _ in range(3):  # the scheduler looks up again every step until the request fits
        hits, num_hit = kv.get_computed_blocks(b)
        assert hits == blocks(kv, a)[:2] and num_hit == 2 * bs
        assert snapshot(kv, a, b) == snap
        assert kv.allocate_slots(b, b.num_tokens - num_hit, hits) is None
        assert snapshot(kv, a, b) == snap
    kv.free(a)  # now it fits: counted once
    hits, num_hit = kv.get_computed_blocks(b)
    assert kv.allocate_slots(b, b.num_tokens - num_hit, hits) is not None
    b.num_computed_tokens = num_hit
    assert (kv.prefix_queries, kv.prefix_hits) == (9 + 25, 8)
    compute(kv, b, b.num_tokens - num_hit)
    b.output_token_ids.append(5)
    assert kv.allocate_slots(b, 1) is not None  # a running request: None, not counted
    assert (kv.prefix_queries, kv.prefix_hits) == (9 + 25, 8)
    kv.check_integrity([b])


def test_num_cached_tokens_counts_prompt_tokens_of_a_preempted_request():
    """A preempted request re-admitted with outputs in the cache reports at most its prompt."""
    rng = random.Random(11)
    bs = 4
    kv = KVCacheManager(num_blocks=16, block_size=bs)
    req = make_req("r", rand_tokens(rng, 6))
    run_prompt(kv, req)
    for _ in range(10):  # decode 10 tokens
        req.output_token_ids.append(rng.randrange(1000))
        assert kv.allocate_slots(req, 1) is not None
        compute(kv, req, 1)
    # preempt (recompute): free everything (before the reset, as the scheduler does), start
    # over; the cache still holds the full blocks
    kv.free(req)
    req.num_computed_tokens = 0
    assert req.num_tokens == 16
    q0, h0 = kv.prefix_queries, kv.prefix_hits
    assert admit(kv, req) is not None
    assert len(blocks(kv, req)) == 4 and req.num_computed_tokens == 12  # 3 hits, 1 new block
    assert req.num_cached_tokens == 6, "num_cached_tokens counts prompt tokens found in the cache"
    assert (kv.prefix_queries - q0, kv.prefix_hits - h0) == (6, 6), "hits count prompt tokens only"
    kv.free(req)


# --------------------------------------------------------------- registration at allocation
def test_blocks_of_a_step_that_never_completes_leave_the_prefix_cache():
    """allocate_slots registers full blocks at once; a request freed before its step advanced
    num_computed_tokens over them (a failed step) takes them out of the cache again, while its
    computed blocks (its own and its hits) stay."""
    rng = random.Random(14)
    bs = 4
    kv = KVCacheManager(num_blocks=16, block_size=bs)
    prompt = rand_tokens(rng, 3 * bs + 1)

    # a whole prompt allocated, its step fails: nothing stays
    a = make_req("a", prompt)
    assert admit(kv, a) is not None
    a_blocks = blocks(kv, a)
    assert sorted(kv.pool.cached.values()) == sorted(a_blocks[:3]), "registered at allocation"
    assert kv.get_computed_blocks(make_req("peek", prompt))[0] == a_blocks[:3]
    assert a.num_computed_tokens == 0
    kv.free(a)
    kv.check_integrity()
    assert kv.pool.cached == {} and all(k is None for k in kv.pool.block_keys)
    assert kv.get_computed_blocks(make_req("a2", prompt)) == ([], 0)

    # a chunked prefill: the first chunk (6 tokens) computed, the second chunk's step fails
    b = make_req("b", prompt)
    assert admit(kv, b, n=6) is not None
    assert len(kv.pool.cached) == 1  # only the first block is full within the chunk
    compute(kv, b, 6)
    assert kv.allocate_slots(b, 7) is not None
    b_blocks = blocks(kv, b)
    assert len(kv.pool.cached) == 3
    kv.free(b)  # 6 computed: block 0 is, block 1 (tokens 4..7) only half, block 2 not at all
    kv.check_integrity()
    assert list(kv.pool.cached.values()) == [b_blocks[0]]
    assert [k is not None for k in kv.pool.block_keys].count(True) == 1
    assert kv.get_computed_blocks(make_req("b2", prompt))[0] == b_blocks[:1]

    # a completed step keeps its blocks (and takes the computed one as a hit)
    c = make_req("c", prompt)
    run_prompt(kv, c)
    assert blocks(kv, c)[0] == b_blocks[0] and c.num_cached_tokens == bs
    c_blocks = blocks(kv, c)
    kv.free(c)
    kv.check_integrity()
    assert sorted(kv.pool.cached.values()) == sorted(c_blocks[:3])
    assert kv.get_computed_blocks(make_req("c2", prompt + [1]))[0] == c_blocks[:3]

    # an admission with hits whose step fails: the hits (computed) stay, its own blocks go
    d = make_req("d", prompt + rand_tokens(rng, 2 * bs))
    assert admit(kv, d) is not None
    d_blocks = blocks(kv, d)
    assert d_blocks[:3] == c_blocks[:3] and d.num_computed_tokens == 3 * bs
    assert len(kv.pool.cached) == 5  # + d's blocks 3 and 4
    kv.free(d)
    kv.check_integrity()
    assert sorted(kv.pool.cached.values()) == sorted(c_blocks[:3])
    assert kv.get_computed_blocks(make_req("d2", d.prompt_token_ids))[0] == c_blocks[:3]

    # a decode step that fails: the block it filled is not kept, the earlier ones are
    e = make_req("e", prompt[: 2 * bs - 1])
    run_prompt(kv, e)  # 7 tokens: its first block is c's
    assert blocks(kv, e)[0] == c_blocks[0]
    e.output_token_ids.append((prompt[2 * bs - 1] + 1) % 1000)  # token 7 fills block 1 (not c's)
    assert kv.allocate_slots(e, 1) is not None
    e_blocks = blocks(kv, e)
    assert kv.pool.block_keys[e_blocks[1]] is not None  # registered with the decode token
    kv.free(e)  # the step never ran: num_computed_tokens is still 7
    kv.check_integrity()
    assert kv.pool.block_keys[e_blocks[1]] is None
    assert sorted(kv.pool.cached.values()) == sorted(c_blocks[:3])


def test_same_step_sharing_of_blocks_registered_at_allocation():
    """A request admitted later in the same step hits blocks allocated (not yet computed) for
    an earlier one; only full blocks of the tokens the step covers are shared."""
    rng = random.Random(15)
    bs = 4
    kv = KVCacheManager(num_blocks=32, block_size=bs)
    prefix = rand_tokens(rng, 3 * bs)
    # one step: a allocates its whole prompt, then b is admitted
    a = make_req("a", prefix + rand_tokens(rng, 2))
    b = make_req("b", prefix + rand_tokens(rng, 5))
    assert admit(kv, a) is not None
    assert a.num_computed_tokens == 0
    assert admit(kv, b) is not None
    assert blocks(kv, b)[:3] == blocks(kv, a)[:3] and b.num_computed_tokens == 3 * bs
    assert b.num_cached_tokens == 3 * bs and kv.prefix_hits == 3 * bs
    assert [kv.pool.ref_counts[blk] for blk in blocks(kv, a)[:3]] == [2, 2, 2]
    kv.check_integrity([a, b])
    # the step completes: both advance; everything is computed, so everything stays cached
    compute(kv, a, a.num_tokens)
    compute(kv, b, b.num_tokens - 3 * bs)
    shared = blocks(kv, a)[:3]
    kv.free(a)
    kv.free(b)
    kv.check_integrity()
    assert kv.get_computed_blocks(make_req("a2", prefix + [1])) == (shared, 3 * bs)

    # a chunk: the second request only shares the blocks full within the first one's chunk
    prefix2 = rand_tokens(rng, 3 * bs)
    c = make_req("c", prefix2 + [1])
    d = make_req("d", prefix2 + [2])
    assert admit(kv, c, n=bs + 2) is not None  # tokens 0..5: one full block
    assert admit(kv, d) is not None
    assert blocks(kv, d)[:1] == blocks(kv, c)[:1] and d.num_computed_tokens == bs
    assert not set(blocks(kv, d)[1:]) & set(blocks(kv, c))
    kv.check_integrity([c, d])


def test_registration_covers_only_tokens_known_on_the_host():
    """With async scheduling a step computes a token still in flight (a placeholder): its block
    is registered on a later allocation, once the token is known."""
    rng = random.Random(16)
    bs = 4
    kv = KVCacheManager(num_blocks=16, block_size=bs)
    req = make_req("r", rand_tokens(rng, 2 * bs - 1))
    run_prompt(kv, req)  # 7 tokens, block 0 registered
    assert len(kv.pool.cached) == 1
    req.num_output_placeholders = 1  # token 7 sampled by the step in flight
    assert kv.allocate_slots(req, 1) is not None  # the step computing token 7
    assert len(kv.pool.cached) == 1, "block 1 is full only with a token not on the host yet"
    compute(kv, req, 1)
    req.output_token_ids.append(rng.randrange(1000))  # token 7 arrives ...
    # ... while the next step (computing the in-flight token 8) is scheduled
    assert kv.allocate_slots(req, 1) is not None  # 9 tokens: a third block
    assert len(kv.pool.cached) == 2 and kv.pool.block_keys[blocks(kv, req)[1]] is not None
    probe = make_req("p", tokens_of(req) + [1])
    assert kv.get_computed_blocks(probe)[0] == blocks(kv, req)[:2]


# --------------------------------------------------------------------------- randomized model
class Model:
    """Independent model of the manager: LRU free list, prefix cache keyed by token prefixes."""

    def __init__(self, num_blocks: int, block_size: int, caching: bool):
        self.bs = block_size
        self.caching = caching
        self.free = list(range(num_blocks))  # front = evicted first
        self.content: dict[int, tuple] = {}  # block -> token prefix it is cached under
        self.cache: dict[tuple, int] = {}  # token prefix -> block
        self.phys = [[None] * block_size for _ in range(num_blocks)]  # tokens written (KV)
        self.tables: dict[str, list[int]] = {}
        self.registered: dict[str, int] = {}  # request -> leading blocks looked at for caching
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
        toks = tokens_of(req)
        out = []
        for i in range((req.num_tokens - 1) // self.bs):
            b = self.cache.get(tuple(toks[: (i + 1) * self.bs]))
            if b is None:
                break
            out.append(b)
        return out

    def allocate(self, req: Request, n: int, hits: list[int] | None) -> list[int] | None:
        """``hits`` None: a running request; a list: an admission (counted when it fits)."""
        rid = req.request_id
        table = self.tables.get(rid, [])
        computed = req.num_computed_tokens + len(hits or []) * self.bs
        need = max(0, -(-(computed + n) // self.bs) - len(table) - len(hits or []))
        rc = self.refs(len(self.phys))
        reclaim = sum(1 for b in hits or [] if rc[b] == 0)
        if need > len(self.free) - reclaim:
            return None
        if hits is not None and self.caching:
            self.queries += req.num_prompt_tokens
            self.hits += min(len(hits) * self.bs, req.num_prompt_tokens)
        for b in hits or []:
            if b in self.free:
                self.free.remove(b)
        new = self.free[:need]
        del self.free[:need]
        for b in new:
            self._uncache(b)
            self.phys[b] = [None] * self.bs
        self.tables[rid] = table = table + (hits or []) + new
        self.newly_registered = []
        if self.caching:  # register the full blocks of the host-known tokens the step covers
            toks = tokens_of(req)
            start = self.registered.get(rid, 0)
            n_full = min(computed + n, req.num_tokens) // self.bs
            for i in range(start, n_full):
                b, key = table[i], tuple(toks[: (i + 1) * self.bs])
                if b not in self.content and key not in self.cache:
                    self.content[b] = key
                    self.cache[key] = b
                    self.newly_registered.append(b)
            self.registered[rid] = max(start, n_full)
        return new

    def _uncache(self, b: int) -> None:
        key = self.content.pop(b, None)
        if key is not None and self.cache.get(key) == b:
            del self.cache[key]

    def write(self, req: Request, start: int, end: int, step_hits: set[int]) -> None:
        table = self.tables[req.request_id]
        rc = self.refs(len(self.phys))
        toks = tokens_of(req)
        for pos in range(start, end):
            b = table[pos // self.bs]
            # another request may hold the block only through a hit taken in this same step,
            # on exactly the tokens written here (the end-of-step content check verifies that)
            assert rc[b] == 1 or b in step_hits, (
                f"step writes position {pos} into block {b} shared by {rc[b]} requests"
            )
            assert self.phys[b][pos % self.bs] is None, f"position {pos} of block {b} written twice"
            self.phys[b][pos % self.bs] = toks[pos]

    def release(self, req: Request) -> None:
        """Free with the request's current progress: its blocks past the computed tokens leave
        the cache."""
        table = self.tables.pop(req.request_id, [])
        self.registered.pop(req.request_id, None)
        for b in table[req.num_computed_tokens // self.bs :]:
            self._uncache(b)
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
    kv = KVCacheManager(num_blocks=num_blocks, block_size=bs, enable_prefix_caching=caching)
    model = Model(num_blocks, bs, caching)
    vocab = 3  # tiny vocabulary: equal blocks after different prefixes are common
    prefixes = [[rng.randrange(vocab) for _ in range(rng.randint(1, 4 * bs))] for _ in range(4)]
    running: dict[str, Request] = {}
    waiting: list[Request] = []  # preempted, to be re-admitted (with hits on their own blocks)
    counter = 0
    stats = dict(
        admit=0,
        hit_blocks=0,
        same_step_hits=0,
        full=0,
        grow=0,
        finish=0,
        abort=0,
        preempt=0,
        readmit=0,
        failed_steps=0,
        steps=0,
        dropped_on_free=0,
    )
    step: dict[str, int] = {}  # request id -> tokens the open step computes for it
    step_hits: set[int] = set()  # blocks handed out as hits in the open step
    step_registered: set[int] = set()  # blocks registered during the open step

    def check():
        kv.check_integrity(list(running.values()))
        assert kv.pool.ref_counts == model.refs(num_blocks)
        assert list(kv.pool.free_queue) == model.free
        assert kv.num_free_blocks == len(model.free)
        assert (kv.prefix_queries, kv.prefix_hits) == (model.queries, model.hits)
        for rid, r in running.items():
            assert kv.get_block_ids(rid) == model.tables[rid]
            covered = r.num_computed_tokens + step.get(rid, 0)
            assert len(model.tables[rid]) == kv.blocks_needed(covered)
            if rid not in step:  # computed KV holds exactly the request's tokens (hits included)
                toks = tokens_of(r)
                for pos in range(r.num_computed_tokens):
                    assert model.phys[model.tables[rid][pos // bs]][pos % bs] == toks[pos]
        for r in waiting:
            assert kv.get_block_ids(r.request_id) == [] and r.num_computed_tokens == 0
        assert len(kv.pool.cached) == len(model.cache)
        assert sorted(kv.pool.cached.values()) == sorted(model.cache.values())
        assert {b for b, k in enumerate(kv.pool.block_keys) if k is not None} == set(model.content)
        for key, b in model.cache.items():
            assert kv.pool.block_keys[b][2] == key[-bs:]
        if not caching:
            assert model.cache == {}

    def try_admit(req: Request) -> bool:
        """Admission inside the open step, as the scheduler does it."""
        n = rng.randint(1, req.num_tokens)  # chunk size (the rest is grown later)
        hits, num_hit = kv.get_computed_blocks(req)
        mhits = model.lookup(req)
        assert hits == mhits and num_hit == len(hits) * bs
        for i, b in enumerate(hits):  # a hit holds exactly the request's tokens (or will,
            if b not in step_registered:  # at the end of this step: checked then)
                assert model.phys[b] == tokens_of(req)[i * bs : (i + 1) * bs]
        assert num_hit < req.num_tokens
        n = min(n, req.num_tokens - num_hit)
        expect = model.allocate(req, n, mhits)
        got = kv.allocate_slots(req, n, hits)
        assert (got is None) == (expect is None)
        if got is None:
            assert kv.get_block_ids(req.request_id) == [] and req.num_computed_tokens == 0
            check()
            return False
        assert got == expect
        req.num_computed_tokens = num_hit
        req.num_cached_tokens = min(num_hit, req.num_prompt_tokens)
        stats["hit_blocks"] += len(hits)
        stats["same_step_hits"] += sum(b in step_registered for b in hits)
        step_hits.update(hits)
        running[req.request_id] = req
        step[req.request_id] = n
        step_registered.update(model.newly_registered)
        check()
        return True

    def preempt(req: Request) -> None:
        kv.free(req)  # before the reset, as the scheduler does
        model.release(req)
        req.num_computed_tokens = 0
        del running[req.request_id]
        waiting.append(req)
        stats["preempt"] += 1
        check()

    def end_step():
        """The open step completes (its KV is written, progress advances) or fails (its
        requests are freed with their progress not advanced, and dropped)."""
        if not step:
            return
        stats["steps"] += 1
        if rng.random() < 0.15:
            stats["failed_steps"] += 1
            for rid in list(step):
                req = running.pop(rid)
                before = len(model.cache)
                kv.free(req)
                model.release(req)
                stats["dropped_on_free"] += before - len(model.cache)
                check()  # (the remaining step members are still checked as in the step)
                del step[rid]
        else:
            for rid, n in step.items():
                req = running[rid]
                model.write(req, req.num_computed_tokens, req.num_computed_tokens + n, step_hits)
            for rid, n in list(step.items()):
                running[rid].num_computed_tokens += n
                assert running[rid].num_computed_tokens <= running[rid].num_tokens
            step.clear()
        step_hits.clear()
        step_registered.clear()
        check()

    for _ in range(500):
        op = rng.random()
        if op < 0.6:  # one step: a few admissions and growths, then it completes or fails
            for _ in range(rng.randint(1, 3)):
                kind = rng.random()
                if kind < 0.4:  # admit a new request, often behind a shared prefix
                    counter += 1
                    prefix = rng.choice(prefixes) if rng.random() < 0.7 else []
                    prompt = prefix + [rng.randrange(vocab) for _ in range(rng.randint(1, 3 * bs))]
                    req = make_req(f"r{counter}", prompt)
                    stats["admit"] += 1
                    if not try_admit(req):
                        stats["full"] += 1
                elif kind < 0.55 and waiting:  # re-admit a preempted request (prompt + outputs)
                    req = waiting.pop(0)
                    if try_admit(req):
                        stats["readmit"] += 1
                    else:
                        waiting.insert(0, req)
                else:  # grow: continue a prefill chunk or decode new tokens
                    candidates = [r for rid, r in running.items() if rid not in step]
                    if not candidates:
                        continue
                    req = rng.choice(candidates)
                    if req.num_computed_tokens == req.num_tokens:
                        req.output_token_ids.extend(
                            rng.randrange(vocab) for _ in range(rng.choice([1, 1, 1, 2, bs]))
                        )
                    n = rng.randint(1, req.num_tokens - req.num_computed_tokens)
                    expect = model.allocate(req, n, None)
                    got = kv.allocate_slots(req, n)
                    assert (got is None) == (expect is None)
                    if got is None:
                        check()
                        preempt(req)  # out of blocks: recompute later
                        continue
                    assert got == expect
                    step[req.request_id] = n
                    step_registered.update(model.newly_registered)
                    stats["grow"] += 1
                    check()
            end_step()
        elif op < 0.8 and running:  # finish or abort (abort may hit a request mid-prefill)
            req = rng.choice(list(running.values()))
            kv.free(req)
            kv.free(req)  # idempotent
            model.release(req)
            del running[req.request_id]
            stats["finish" if req.num_computed_tokens == req.num_tokens else "abort"] += 1
            check()
        elif op < 0.92 and running:
            preempt(rng.choice(list(running.values())))
        elif waiting:  # an aborted waiting request holds nothing
            req = waiting.pop(rng.randrange(len(waiting)))
            kv.free(req)
            check()

    for req in list(running.values()):
        kv.free(req)
        model.release(req)
        del running[req.request_id]
        check()
    assert kv.num_free_blocks == num_blocks and all(rc == 0 for rc in kv.pool.ref_counts)
    kv.check_integrity()
    # the run exercised what it is meant to
    assert stats["full"] > 0 and stats["preempt"] > 0 and stats["grow"] > 50
    assert stats["failed_steps"] > 0
    if caching:
        assert stats["hit_blocks"] > 0 and stats["readmit"] > 0
        assert stats["same_step_hits"] > 0 and stats["dropped_on_free"] > 0
