"""Scheduler: continuous batching, chunked prefill, preemption by recompute, block accounting.

Most tests drive the Scheduler over a real BlockManager with a simulated model step (the
scheduled tokens become computed, a request that reached its end samples a random token).
The engine-level tests run the tiny checkpoint from ``tests/conftest.py``.
"""

from __future__ import annotations

import random

import pytest
import torch

from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.engine import LLMEngine, RequestRejected
from engine.request import FinishReason, Request, RequestStatus, SamplingParams
from engine.scheduler import ScheduledBatch, Scheduler

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def make_sched(num_blocks=64, block_size=4, max_num_seqs=256, budget=1024, chunked=True, caching=False):
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching=caching)
    return Scheduler(bm, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                     enable_chunked_prefill=chunked)


def make_req(rid, n_prompt, max_tokens=16, rng=None, tokens=None):
    rng = rng or random.Random(hash(rid) & 0xFFFF)
    toks = tokens if tokens is not None else [rng.randrange(1000) for _ in range(n_prompt)]
    return Request(rid, toks, SamplingParams(max_tokens=max_tokens), max_len=1 << 20)


def check_batch(s: Scheduler, batch: ScheduledBatch) -> None:
    """Invariants of every step."""
    bm = s.block_manager
    bm.check_integrity()
    assert batch.total_tokens <= s.max_num_batched_tokens
    assert len(s.running) <= s.max_num_seqs
    assert len({id(r) for r in batch.requests}) == len(batch)
    for r, n in zip(batch.requests, batch.num_new_tokens):
        assert r.status == RequestStatus.RUNNING and r in s.running
        assert 1 <= n <= r.num_tokens - r.num_computed_tokens
        assert len(r.block_table) == bm.blocks_needed(r.num_computed_tokens + n)
        if not s.enable_chunked_prefill:  # whole, unless a recompute longer than the budget
            assert n == r.num_tokens - r.num_computed_tokens or (
                r.output_token_ids and r.num_tokens - r.num_computed_tokens > s.max_num_batched_tokens)
    for r in s.waiting:
        assert r.status == RequestStatus.WAITING and r.block_table == [] and r.num_computed_tokens == 0
    # every block referenced is owned by a running request, with the right count
    refs = [0] * bm.num_blocks
    for r in s.running:
        for b in r.block_table:
            refs[b] += 1
    assert refs == bm.ref_counts


def sim_step(s: Scheduler, batch: ScheduledBatch, rng: random.Random) -> list[Request]:
    """The engine's part of a step; returns the requests that finished (max_tokens)."""
    done = []
    for r, n in zip(batch.requests, batch.num_new_tokens):
        r.num_computed_tokens += n
        s.block_manager.cache_full_blocks(r)
        if r.num_computed_tokens == r.num_tokens:
            r.output_token_ids.append(rng.randrange(1000))
            if len(r.output_token_ids) >= r.sampling_params.max_tokens:
                s.finish(r, FinishReason.LENGTH)
                done.append(r)
    s.block_manager.check_integrity()
    return done


def ids(reqs):
    return [r.request_id for r in reqs]


# --------------------------------------------------------------------------- admission
def test_admission_bounded_by_free_blocks_in_arrival_order():
    s = make_sched(num_blocks=10, block_size=4)
    reqs = [make_req(f"r{i}", n) for i, n in enumerate([12, 12, 20, 4])]  # 3, 3, 5, 1 blocks
    for r in reqs:
        s.add(r)
    batch = s.schedule()
    check_batch(s, batch)
    assert ids(batch.requests) == ["r0", "r1"]
    assert batch.num_new_tokens == [12, 12]
    assert s.block_manager.num_free_blocks == 4
    # r2 does not fit; r3 behind it waits too (first come, first served)
    assert ids(s.waiting) == ["r2", "r3"]
    assert reqs[2].block_table == [] and reqs[3].block_table == []


@pytest.mark.parametrize("seed", range(5))
def test_admission_randomized_blocks_seqs_budget(seed):
    rng = random.Random(seed)
    bs = rng.choice([2, 4, 8])
    num_blocks = rng.randint(4, 40)
    max_seqs = rng.randint(1, 12)
    budget = rng.randint(8, 200)
    chunked = rng.random() < 0.5
    s = make_sched(num_blocks, bs, max_seqs, budget, chunked)
    reqs = [make_req(f"r{i}", rng.randint(1, min(budget, 30)), rng=rng) for i in range(20)]
    for r in reqs:
        s.add(r)
    batch = s.schedule()
    check_batch(s, batch)
    # expected: the longest prefix of the queue that fits blocks, seqs and tokens
    free, left, expect = num_blocks, budget, []
    for r in reqs:
        if len(expect) == max_seqs or left == 0:
            break
        n = min(r.num_tokens, left)
        if not chunked and n < r.num_tokens:
            break
        need = -(-n // bs)
        if need > free:
            break
        free -= need
        left -= n
        expect.append((r.request_id, n))
    assert list(zip(ids(batch.requests), batch.num_new_tokens)) == expect
    assert s.block_manager.num_free_blocks == free
    assert ids(s.waiting) == ids(reqs[len(expect):])


def test_admission_bounded_by_max_num_seqs():
    rng = random.Random(1)
    s = make_sched(max_num_seqs=3)
    reqs = [make_req(f"r{i}", 5, max_tokens=2 + i, rng=rng) for i in range(6)]
    for r in reqs:
        s.add(r)
    batch = s.schedule()
    assert ids(batch.requests) == ["r0", "r1", "r2"]
    sim_step(s, batch, rng)
    batch = s.schedule()  # decodes only: the seat limit holds
    check_batch(s, batch)
    assert ids(batch.requests) == ["r0", "r1", "r2"] and batch.num_new_tokens == [1, 1, 1]
    assert sim_step(s, batch, rng) == [reqs[0]]  # r0 done (max_tokens=2): a seat frees
    batch = s.schedule()
    check_batch(s, batch)
    assert ids(batch.requests) == ["r1", "r2", "r3"] and batch.num_new_tokens == [1, 1, 5]


def test_admission_bounded_by_token_budget_without_chunking():
    rng = random.Random(2)
    s = make_sched(budget=25, chunked=False)
    for i in range(3):
        s.add(make_req(f"r{i}", 10, rng=rng))
    batch = s.schedule()
    check_batch(s, batch)
    assert ids(batch.requests) == ["r0", "r1"] and batch.total_tokens == 20
    sim_step(s, batch, rng)
    batch = s.schedule()
    check_batch(s, batch)
    assert ids(batch.requests) == ["r0", "r1", "r2"] and batch.num_new_tokens == [1, 1, 10]


def test_admission_bounded_by_token_budget_with_chunking():
    rng = random.Random(3)
    s = make_sched(budget=25, chunked=True)
    reqs = [make_req(f"r{i}", 10, rng=rng) for i in range(3)]
    for r in reqs:
        s.add(r)
    batch = s.schedule()
    check_batch(s, batch)
    assert list(zip(ids(batch.requests), batch.num_new_tokens)) == [("r0", 10), ("r1", 10), ("r2", 5)]
    sim_step(s, batch, rng)
    assert reqs[2].num_computed_tokens == 5 and reqs[2].output_token_ids == []  # no sample mid-prefill
    batch = s.schedule()
    check_batch(s, batch)
    assert list(zip(ids(batch.requests), batch.num_new_tokens)) == [("r0", 1), ("r1", 1), ("r2", 5)]
    sim_step(s, batch, rng)
    assert len(reqs[2].output_token_ids) == 1


# --------------------------------------------------------------------------- running first
def test_running_scheduled_before_waiting_and_all_decode():
    rng = random.Random(4)
    s = make_sched(num_blocks=200, budget=64)
    first = [make_req(f"a{i}", rng.randint(1, 10), max_tokens=50, rng=rng) for i in range(6)]
    for r in first:
        s.add(r)
    sim_step(s, s.schedule(), rng)
    late = [make_req(f"b{i}", 30, rng=rng) for i in range(3)]
    for r in late:
        s.add(r)
    batch = s.schedule()
    check_batch(s, batch)
    # six decodes first, then the waiting ones get the remaining 58 tokens: 30 + 28
    assert ids(batch.requests) == ids(first) + ["b0", "b1"]
    assert batch.num_new_tokens == [1] * 6 + [30, 28]
    sim_step(s, batch, rng)
    batch = s.schedule()
    check_batch(s, batch)
    assert ids(batch.requests) == ids(first) + ["b0", "b1", "b2"]
    assert batch.num_new_tokens == [1] * 7 + [2, 30]


@pytest.mark.parametrize("seed", range(4))
def test_every_running_request_decodes_each_step_when_budget_allows(seed):
    """Randomized run: the invariants of every step, until everything finished."""
    rng = random.Random(100 + seed)
    bs = rng.choice([2, 4, 8])
    s = make_sched(num_blocks=rng.randint(12, 40), block_size=bs, max_num_seqs=rng.randint(2, 10),
                   budget=rng.randint(16, 64), chunked=rng.random() < 0.7)
    cap = s.block_manager.num_blocks * bs
    pending = [make_req(f"r{i}", rng.randint(1, min(s.max_num_batched_tokens, cap // 3)),
                        max_tokens=rng.randint(1, 20), rng=rng) for i in range(30)]
    finished = []
    preempted = 0
    for _ in range(2000):
        if pending and rng.random() < 0.5:
            s.add(pending.pop(0))
        before = list(s.running)
        waiting_before = list(s.waiting)
        batch = s.schedule()
        check_batch(s, batch)
        preempted += batch.num_preemptions
        k = sum(r in before for r in batch.requests)
        assert all(r in before for r in batch.requests[:k]), "running requests come first"
        assert all(r not in before for r in batch.requests[k:])
        # newly admitted ones are the head of the waiting queue, in order
        assert batch.requests[k:] == waiting_before[: len(batch) - k]
        if batch.num_preemptions == 0:
            need = sum(r.num_tokens - r.num_computed_tokens for r in before)
            if need <= s.max_num_batched_tokens:
                assert batch.requests[:k] == before, "every running request is scheduled"
                assert batch.num_new_tokens[:k] == [r.num_tokens - r.num_computed_tokens for r in before]
        else:
            assert batch.requests[k:] == [], "no admission in a step that preempted"
        finished += sim_step(s, batch, rng)
        if not pending and not s.has_work():
            break
    assert not s.has_work() and not pending
    assert len(finished) == 30
    assert all(len(r.output_token_ids) == r.sampling_params.max_tokens for r in finished)
    assert s.block_manager.num_free_blocks == s.block_manager.num_blocks
    assert s.num_preemptions == preempted


# --------------------------------------------------------------------------- chunked prefill
def test_chunked_prefill_splits_long_prompt_and_mixes_with_decodes():
    rng = random.Random(5)
    s = make_sched(num_blocks=64, block_size=4, budget=16)
    short = make_req("short", 3, max_tokens=30, rng=rng)
    s.add(short)
    sim_step(s, s.schedule(), rng)
    long = make_req("long", 50, max_tokens=2, rng=rng)
    s.add(long)
    chunks = []
    while long.num_computed_tokens < long.num_prompt_tokens:
        batch = s.schedule()
        check_batch(s, batch)
        assert ids(batch.requests) == ["short", "long"]
        assert batch.num_new_tokens[0] == 1  # the decode goes on in every step
        assert batch.total_tokens <= 16
        chunks.append(batch.num_new_tokens[1])
        assert len(long.block_table) == s.block_manager.blocks_needed(long.num_computed_tokens + chunks[-1])
        sim_step(s, batch, rng)
        if long.num_computed_tokens < long.num_prompt_tokens:
            assert long.output_token_ids == []
    assert chunks == [15, 15, 15, 5]
    assert len(long.output_token_ids) == 1
    batch = s.schedule()
    assert list(zip(ids(batch.requests), batch.num_new_tokens)) == [("short", 1), ("long", 1)]


def test_without_chunking_a_prompt_waits_for_a_step_with_room():
    rng = random.Random(6)
    s = make_sched(num_blocks=64, block_size=4, budget=16, chunked=False)
    a = make_req("a", 10, max_tokens=3, rng=rng)
    b = make_req("b", 16, max_tokens=1, rng=rng)
    s.add(a)
    s.add(b)
    batch = s.schedule()
    assert ids(batch.requests) == ["a"]  # b needs the whole budget
    sim_step(s, batch, rng)
    batch = s.schedule()
    assert ids(batch.requests) == ["a"] and b.block_table == []
    sim_step(s, batch, rng)
    sim_step(s, s.schedule(), rng)  # a finishes
    batch = s.schedule()
    assert ids(batch.requests) == ["b"] and batch.num_new_tokens == [16]


# --------------------------------------------------------------------------- preemption
def test_preempts_newest_running_request_when_blocks_run_out():
    rng = random.Random(7)
    s = make_sched(num_blocks=6, block_size=4, budget=64)
    a, b, c = (make_req(x, 7, max_tokens=10, rng=rng) for x in "abc")  # two blocks each
    for r in (a, b, c):
        s.add(r)
    sim_step(s, s.schedule(), rng)  # 8 tokens each: the cache is full
    d = make_req("d", 2, rng=rng)
    s.add(d)  # arrived before the preemption
    batch = s.schedule()  # the 8th tokens still fit in two blocks; d does not fit
    check_batch(s, batch)
    assert ids(batch.requests) == ["a", "b", "c"] and s.block_manager.num_free_blocks == 0
    sim_step(s, batch, rng)  # 9 tokens each: every request needs a third block
    batch = s.schedule()
    check_batch(s, batch)
    assert batch.num_preemptions == 1 and s.num_preemptions == 1
    assert ids(batch.requests) == ["a", "b"] and batch.num_new_tokens == [1, 1]
    assert ids(s.running) == ["a", "b"]
    assert ids(s.waiting) == ["c", "d"], "the preempted request goes to the front"
    assert c.status == RequestStatus.WAITING and c.num_computed_tokens == 0 and c.block_table == []
    assert c.num_preemptions == 1 and len(c.output_token_ids) == 2  # outputs kept for recompute
    assert len(a.block_table) == len(b.block_table) == 3
    assert s.block_manager.num_free_blocks == 0
    assert all(blk in a.block_table + b.block_table for blk in range(6))
    # run to completion: c is recomputed (prompt + outputs) and finishes with all its tokens
    done = sim_step(s, batch, rng)
    for _ in range(200):
        if not s.has_work():
            break
        batch = s.schedule()
        check_batch(s, batch)
        if c in batch.requests and c.num_computed_tokens == 0:
            assert batch.num_new_tokens[batch.requests.index(c)] == 9  # 7 prompt + 2 outputs
        done += sim_step(s, batch, rng)
    assert sorted(ids(done)) == ["a", "b", "c", "d"]
    assert len(c.output_token_ids) == 10
    assert s.block_manager.num_free_blocks == 6


def test_request_preempts_itself_when_it_is_the_newest():
    rng = random.Random(8)
    s = make_sched(num_blocks=5, block_size=4, budget=64)
    a = make_req("a", 10, max_tokens=10, rng=rng)  # 3 blocks; 11 tokens still fit in them
    b = make_req("b", 8, max_tokens=10, rng=rng)  # 2 blocks; 9 tokens need a third
    s.add(a)
    s.add(b)
    sim_step(s, s.schedule(), rng)  # a 11 tokens, b 9 tokens; the cache is full
    batch = s.schedule()  # a fits; b is the newest and nothing newer can be evicted
    check_batch(s, batch)
    assert ids(batch.requests) == ["a"] and batch.num_new_tokens == [1]
    assert batch.num_preemptions == 1 and b.num_preemptions == 1 and a.num_preemptions == 0
    assert ids(s.running) == ["a"] and ids(s.waiting) == ["b"]
    assert b.block_table == [] and b.num_computed_tokens == 0 and b.status == RequestStatus.WAITING
    assert s.block_manager.num_free_blocks == 2


@pytest.mark.parametrize("budget,a_len,a_max,b_len,b_max,num_blocks", [
    (16, 4, 24, 14, 12, 8),  # the recompute of b exceeds the budget
    (8, 2, 40, 6, 30, 12),  # ... by more than twice: it takes several steps
])
def test_preempted_request_longer_than_budget_without_chunking_still_finishes(
        budget, a_len, a_max, b_len, b_max, num_blocks):
    """With chunked prefill off, a recompute of prompt + outputs may exceed the token budget."""
    rng = random.Random(9)
    s = make_sched(num_blocks=num_blocks, block_size=4, budget=budget, chunked=False)
    a = make_req("a", a_len, max_tokens=a_max, rng=rng)
    b = make_req("b", b_len, max_tokens=b_max, rng=rng)
    s.add(a)
    s.add(b)
    done, recompute_len = [], 0
    for _ in range(300):
        if not s.has_work():
            break
        batch = s.schedule()
        check_batch(s, batch)
        if b in batch.requests and b.num_computed_tokens == 0 and b.num_preemptions:
            recompute_len = max(recompute_len, b.num_tokens)
        done += sim_step(s, batch, rng)
    assert s.num_preemptions > 0 and b.num_preemptions > 0
    assert recompute_len > budget
    assert not s.has_work(), "a preempted request must be able to run again"
    assert sorted(ids(done)) == ["a", "b"]
    assert len(a.output_token_ids) == a_max and len(b.output_token_ids) == b_max
    assert s.block_manager.num_free_blocks == num_blocks


def test_finish_frees_blocks_in_any_state_and_is_idempotent():
    rng = random.Random(10)
    s = make_sched(num_blocks=16, block_size=4, budget=8)
    a, b, c = make_req("a", 6, rng=rng), make_req("b", 20, rng=rng), make_req("c", 3, rng=rng)
    for r in (a, b, c):
        s.add(r)
    batch = s.schedule()  # a whole, b a 2-token chunk; c waits
    sim_step(s, batch, rng)
    assert a.status == b.status == RequestStatus.RUNNING and c.status == RequestStatus.WAITING
    for r in (b, c, a, b, c):  # mid-prefill, waiting, decoding, twice
        s.finish(r, FinishReason.ABORT)
        s.block_manager.check_integrity()
        assert r.status == RequestStatus.FINISHED and r.block_table == []
        assert r not in s.running and r not in s.waiting
    assert b.finish_reason == FinishReason.ABORT
    assert s.block_manager.num_free_blocks == 16 and not s.has_work()


# --------------------------------------------------------------------------- engine level
def _engine(path, **kw):
    cfg = dict(model=path, block_size=8, num_kv_blocks=16, max_num_seqs=8, max_num_batched_tokens=48)
    cfg.update(kw)
    return LLMEngine(EngineConfig(**cfg), eos_token_ids=frozenset())


def test_request_that_can_never_fit_is_rejected_and_does_not_block_others(tiny_checkpoint):
    path, _ = tiny_checkpoint
    gen = torch.Generator().manual_seed(12)
    eng = _engine(path, num_kv_blocks=6)  # 48 tokens of KV: max_model_len lowered to 48
    assert eng.max_model_len == 48
    ok1 = eng.add_request("ok1", torch.randint(0, 384, (20,), generator=gen).tolist(),
                          SamplingParams(max_tokens=5))
    for n in (48, 60, 300):
        with pytest.raises(RequestRejected):
            eng.add_request(f"big{n}", torch.randint(0, 384, (n,), generator=gen).tolist(), SamplingParams())
        assert f"big{n}" not in eng.requests
    with pytest.raises(RequestRejected):
        eng.add_request("empty", [], SamplingParams())
    with pytest.raises(RequestRejected):
        eng.add_request("oov", [1, 384], SamplingParams())
    with pytest.raises(RequestRejected):
        eng.add_request("ok1", [1, 2], SamplingParams())  # duplicate id
    ok2 = eng.add_request("ok2", torch.randint(0, 384, (47,), generator=gen).tolist(),
                          SamplingParams(max_tokens=5))
    assert ids(eng.scheduler.waiting) == ["ok1", "ok2"]
    finished = {}
    for _ in range(100):
        if not eng.has_unfinished():
            break
        outs, _ = eng.step()
        eng.block_manager.check_integrity()
        finished.update({o.request_id: o.finish_reason for o in outs if o.finished})
    assert finished == {"ok1": FinishReason.LENGTH, "ok2": FinishReason.LENGTH}
    assert len(ok1.output_token_ids) == 5 and len(ok2.output_token_ids) == 1  # 47 + 1 = max_model_len
    assert eng.requests == {} and eng.block_manager.num_free_blocks == 6

    # chunked prefill off: a prompt over the token budget can never be scheduled
    eng = _engine(path, enable_chunked_prefill=False, max_num_batched_tokens=16)
    with pytest.raises(RequestRejected):
        eng.add_request("long", list(range(17)), SamplingParams())
    eng.add_request("fits", list(range(16)), SamplingParams(max_tokens=3))
    outs = []
    while eng.has_unfinished():
        outs += eng.step()[0]
    assert [o.request_id for o in outs if o.finished] == ["fits"]


@pytest.mark.parametrize("caching,chunked,async_scheduling",
                         [(False, True, False), (True, True, False), (False, False, False), (True, False, False),
                          (False, True, True), (True, True, True)],
                         ids=["no-cache", "prefix-cache", "no-cache-unchunked", "prefix-cache-unchunked",
                              "no-cache-async", "prefix-cache-async"])
def test_block_accounting_after_finish_abort_preempt(tiny_checkpoint, caching, chunked, async_scheduling):
    """Block accounting: after any mix of finished, aborted and preempted requests every block
    is free again (with async scheduling too: aborts and preemptions with a token in flight)."""
    path, _ = tiny_checkpoint
    rng = random.Random(20 + caching + 2 * chunked)
    bs, num_blocks = 8, (14 if chunked else 9)
    budget = 40 if chunked else 24  # unchunked: recomputes (prompt + outputs) exceed the budget
    eng = _engine(path, block_size=bs, num_kv_blocks=num_blocks, max_num_seqs=6,
                  max_num_batched_tokens=budget,
                  enable_prefix_caching=caching, enable_chunked_prefill=chunked, async_scheduling=async_scheduling)
    bm = eng.block_manager
    max_len = eng.max_model_len
    N = 40
    prefixes = [[rng.randrange(384) for _ in range(rng.randint(8, 30))] for _ in range(3)]

    def new_prompt():
        p = rng.choice(prefixes) if caching and rng.random() < 0.7 else []
        p = p + [rng.randrange(384) for _ in range(rng.randint(1, 30))]
        return p[: min(max_len - 1, budget)]  # without chunking a prompt must fit the token budget

    pending = []
    for i in range(N):
        temp = rng.choice([0.0, 0.8])
        max_tokens = rng.randint(1, 24 if chunked else 40)
        params = SamplingParams(temperature=temp, max_tokens=max_tokens, seed=rng.choice([None, i]))
        pending.append((f"q{i}", new_prompt(), params))
    all_requests = list(pending)
    aborted, finished, n_steps = set(), {}, 0
    outputs: dict[str, list[int]] = {}
    while pending or eng.has_unfinished():
        for _ in range(rng.randint(0, 3)):
            if pending:
                rid, prompt, params = pending.pop(0)
                eng.add_request(rid, prompt, params)
                outputs[rid] = []
        if pending and eng.requests and rng.random() < 0.15:  # abort a live request (any state)
            rid = rng.choice(sorted(eng.requests))
            assert eng.abort(rid)
            aborted.add(rid)
            bm.check_integrity()
        assert not eng.abort("unknown")
        outs, stats = eng.step()
        n_steps += 1
        bm.check_integrity()
        assert stats.num_free_blocks == bm.num_free_blocks
        for o in outs:
            assert o.request_id not in finished and o.request_id not in aborted
            outputs[o.request_id] += o.new_token_ids
            if o.finished:
                finished[o.request_id] = o.finish_reason
        assert n_steps < 2000
    assert eng.scheduler.num_preemptions > 0, "the cache is meant to force preemptions"
    assert len(aborted) > 0 and len(finished) > 0 and len(aborted) + len(finished) == N
    assert set(finished.values()) == {FinishReason.LENGTH}  # no EOS ids: only lengths end them
    assert bm.num_free_blocks == num_blocks and all(rc == 0 for rc in bm.ref_counts)
    bm.check_integrity()
    assert eng.requests == {} and not eng.scheduler.running and not eng.scheduler.waiting
    if caching:
        assert bm.prefix_hits > 0
    # finished requests have all their tokens; greedy and seeded ones equal a run without
    # preemption, prefix cache or aborted neighbours (recompute restores the same KV)
    params = {rid: (prompt, sp) for rid, prompt, sp in all_requests}
    for rid in finished:
        prompt, sp = params[rid]
        assert len(outputs[rid]) == min(sp.max_tokens, max_len - len(prompt))
    check = [rid for rid in finished if params[rid][1].greedy or params[rid][1].seed is not None]
    assert len(check) > 5
    ref = _engine(path, block_size=bs, num_kv_blocks=256, max_num_seqs=64, max_num_batched_tokens=4096,
                  max_model_len=max_len, enable_prefix_caching=False)
    ref_out = ref.generate([params[rid][0] for rid in check], [params[rid][1] for rid in check])
    assert ref.scheduler.num_preemptions == 0
    assert [outputs[rid] for rid in check] == ref_out
