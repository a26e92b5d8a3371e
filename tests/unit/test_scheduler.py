"""Scheduler: continuous batching, chunked prefill, preemption by recompute, block accounting.

Most tests drive the Scheduler over a real KVCacheManager with a simulated model step
(``update_after_launch`` makes the scheduled tokens computed; a request that reached its end
samples a random token, applied by ``update_from_output``). Every batch is replayed into mirrors
of the block tables (a plain dict and the worker's ``PersistentBlockTables``): its
``new_block_ids`` / ``block_table_reset`` deltas must reproduce the manager's block tables.
The engine-level tests run the tiny checkpoint from ``tests/conftest.py``.
"""

from __future__ import annotations

import random

import pytest
import torch

from engine.core.config import EngineConfig
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.limits import RequestRejected
from engine.core.outputs import SampleOutput
from engine.core.request import FinishReason, Request, RequestStatus, SamplingParams
from engine.core.scheduler import ScheduledBatch, Scheduler
from engine.worker.block_table import PersistentBlockTables
from engine.worker.build import build_engine
from tests.engine_helpers import mirror_blocks

pytestmark = pytest.mark.usefixtures("one_torch_thread")


class CheckedScheduler(Scheduler):
    """A Scheduler whose every batch is checked (:func:`check_deltas`) as soon as it is made."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.mirror: dict[str, list[int]] = {}  # request id -> block ids, from the deltas only
        self.tables = PersistentBlockTables(self.kv_cache_manager.num_blocks, initial_rows=2)
        self.batches = 0

    def schedule(self) -> ScheduledBatch:
        running_before = {r.request_id for r in self.running}
        live_before = set(self.requests)
        batch = super().schedule()
        check_deltas(self, batch, running_before, live_before)
        self.batches += 1
        return batch


def check_deltas(
    s: CheckedScheduler, batch: ScheduledBatch, running_before: set[str], live_before: set[str]
) -> None:
    """The batch's block-table deltas, replayed into a mirror, give the manager's tables."""
    kv = s.kv_cache_manager
    n = len(batch.requests)
    assert len(batch.num_new_tokens) == len(batch.new_block_ids) == n
    assert len(batch.block_table_reset) == n
    assert len(set(batch.finished_request_ids)) == len(batch.finished_request_ids)
    if not n:
        assert batch.finished_request_ids == [], "finished ids wait for a batch that runs"
    for rid in batch.finished_request_ids:
        assert rid not in s.requests and rid not in live_before
        s.mirror.pop(rid, None)
    for req, new, reset in zip(batch.requests, batch.new_block_ids, batch.block_table_reset):
        rid = req.request_id
        # a table starts over exactly for the requests admitted this step (new or preempted)
        assert reset == (rid not in running_before)
        if reset:
            s.mirror[rid] = list(new)
        else:
            s.mirror[rid] += new
        assert s.mirror[rid] == kv.get_block_ids(rid)
    rows = s.tables.apply(batch)
    assert len(set(rows.tolist())) == len(rows)
    width = max([len(kv.get_block_ids(r.request_id)) for r in batch.requests], default=1)
    got = s.tables.gather(rows, max(width, 1))
    for i, req in enumerate(batch.requests):
        table = kv.get_block_ids(req.request_id)
        assert mirror_blocks(s.tables, req.request_id) == table
        assert got[i, : len(table)].tolist() == table
    for req in s.running:  # running, scheduled or not: the mirror is up to date
        assert s.mirror[req.request_id] == kv.get_block_ids(req.request_id)
    if n:
        assert set(s.mirror) <= set(s.requests), "finished requests are released"
        assert len(s.tables) == len(s.mirror)


def make_sched(
    num_blocks=64, block_size=4, max_num_seqs=256, budget=1024, chunked=True, caching=False
):
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=caching)
    return CheckedScheduler(
        kv, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, enable_chunked_prefill=chunked
    )


def make_req(rid, n_prompt, max_tokens=16, rng=None, tokens=None):
    rng = rng or random.Random(hash(rid) & 0xFFFF)
    toks = tokens if tokens is not None else [rng.randrange(1000) for _ in range(n_prompt)]
    return Request(rid, toks, SamplingParams(max_tokens=max_tokens), max_len=1 << 20)


def blocks_of(s: Scheduler, req: Request) -> list[int]:
    return s.kv_cache_manager.get_block_ids(req.request_id)


def check_batch(s: Scheduler, batch: ScheduledBatch) -> None:
    """Invariants of every step."""
    kv = s.kv_cache_manager
    kv.check_integrity(list(s.requests.values()))
    assert batch.total_tokens <= s.max_num_batched_tokens
    assert len(s.running) <= s.max_num_seqs
    assert len({id(r) for r in batch.requests}) == len(batch)
    for r, n in zip(batch.requests, batch.num_new_tokens):
        assert r.status == RequestStatus.RUNNING and r in s.running
        assert 1 <= n <= r.num_tokens - r.num_computed_tokens
        assert len(blocks_of(s, r)) == kv.blocks_needed(r.num_computed_tokens + n)
        if not s.enable_chunked_prefill:  # whole, unless a recompute longer than the budget
            assert n == r.num_tokens - r.num_computed_tokens or (
                r.output_token_ids
                and r.num_tokens - r.num_computed_tokens > s.max_num_batched_tokens
            )
    for r in s.waiting:
        assert r.status == RequestStatus.WAITING and r.num_computed_tokens == 0
        assert blocks_of(s, r) == []
    assert set(s.requests) == {r.request_id for r in s.running} | {r.request_id for r in s.waiting}
    # every block referenced is owned by a running request, with the right count
    refs = [0] * kv.num_blocks
    for r in s.running:
        for b in blocks_of(s, r):
            refs[b] += 1
    assert refs == kv.pool.ref_counts


def sim_step(s: Scheduler, batch: ScheduledBatch, rng: random.Random) -> list[Request]:
    """The engine's part of a step; returns the requests that finished (max_tokens)."""
    sample = [
        r
        for r, n in zip(batch.requests, batch.num_new_tokens)
        if r.num_computed_tokens + n == r.num_tokens
    ]
    starts = [r.num_computed_tokens for r in batch.requests]
    num_prompt = s.update_after_launch(batch, sample)
    assert num_prompt == sum(
        max(0, min(c + n, r.num_prompt_tokens) - c)
        for r, c, n in zip(batch.requests, starts, batch.num_new_tokens)
    )
    for r, c, n in zip(batch.requests, starts, batch.num_new_tokens):
        assert r.num_computed_tokens == c + n
    assert all(r.num_output_placeholders == 1 for r in sample)
    tokens = [rng.randrange(1000) for _ in sample]
    outs = s.update_from_output(sample, SampleOutput(tokens, [None] * len(sample)))
    assert all(r.num_output_placeholders == 0 for r in sample)
    assert [o.request_id for o in outs] == ids(sample)
    assert [o.new_token_ids for o in outs] == [[t] for t in tokens]
    assert all(r.output_token_ids[-1] == t for r, t in zip(sample, tokens))
    done = [r for r in sample if r.is_finished]
    assert [o.request_id for o in outs if o.finished] == ids(done)
    assert all(r.finish_reason == FinishReason.LENGTH for r in done)
    assert all(len(r.output_token_ids) >= r.sampling_params.max_tokens for r in done)
    assert not any(r.request_id in s.requests for r in done)
    s.kv_cache_manager.check_integrity(list(s.requests.values()))
    return done


def ids(reqs):
    return [r.request_id for r in reqs]


# --------------------------------------------------------------------------- admission
def test_admission_bounded_by_free_blocks_in_arrival_order():
    s = make_sched(num_blocks=10, block_size=4)
    reqs = [make_req(f"r{i}", n) for i, n in enumerate([12, 12, 20, 4])]  # 3, 3, 5, 1 blocks
    for r in reqs:
        s.add_request(r)
    batch = s.schedule()
    check_batch(s, batch)
    assert ids(batch.requests) == ["r0", "r1"]
    assert batch.num_new_tokens == [12, 12]
    assert s.kv_cache_manager.num_free_blocks == 4
    # r2 does not fit; r3 behind it waits too (first come, first served)
    assert ids(s.waiting) == ["r2", "r3"]
    assert blocks_of(s, reqs[2]) == [] and blocks_of(s, reqs[3]) == []


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
        s.add_request(r)
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
    assert s.kv_cache_manager.num_free_blocks == free
    assert ids(s.waiting) == ids(reqs[len(expect) :])


def test_admission_bounded_by_max_num_seqs():
    rng = random.Random(1)
    s = make_sched(max_num_seqs=3)
    reqs = [make_req(f"r{i}", 5, max_tokens=2 + i, rng=rng) for i in range(6)]
    for r in reqs:
        s.add_request(r)
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
        s.add_request(make_req(f"r{i}", 10, rng=rng))
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
        s.add_request(r)
    batch = s.schedule()
    check_batch(s, batch)
    assert list(zip(ids(batch.requests), batch.num_new_tokens)) == [
        ("r0", 10),
        ("r1", 10),
        ("r2", 5),
    ]
    sim_step(s, batch, rng)
    assert (
        reqs[2].num_computed_tokens == 5 and reqs[2].output_token_ids == []
    )  # no sample mid-prefill
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
        s.add_request(r)
    sim_step(s, s.schedule(), rng)
    late = [make_req(f"b{i}", 30, rng=rng) for i in range(3)]
    for r in late:
        s.add_request(r)
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


@pytest.mark.parametrize("caching", [False, True], ids=["no-cache", "prefix-cache"])
@pytest.mark.parametrize("seed", range(4))
def test_every_running_request_decodes_each_step_when_budget_allows(seed, caching):
    """Randomized run: the invariants of every step, until everything finished (with prefix
    caching: prompts behind shared prefixes, admitted with hits, sharing within a step)."""
    rng = random.Random(100 + seed)
    bs = rng.choice([2, 4, 8])
    s = make_sched(
        num_blocks=rng.randint(12, 40),
        block_size=bs,
        max_num_seqs=rng.randint(2, 10),
        budget=rng.randint(16, 64),
        chunked=rng.random() < 0.7,
        caching=caching,
    )
    cap = s.kv_cache_manager.num_blocks * bs
    max_len = min(s.max_num_batched_tokens, cap // 3)
    if not caching:
        pending = [
            make_req(f"r{i}", rng.randint(1, max_len), max_tokens=rng.randint(1, 20), rng=rng)
            for i in range(30)
        ]
    else:
        prefixes, pending = [], []
        for i in range(30):  # runs of requests behind a new prefix, sometimes an older one
            if not prefixes or rng.random() < 0.4:
                prefixes.append([rng.randrange(1000) for _ in range(rng.randint(bs, 3 * bs))])
            prefix = prefixes[-1] if rng.random() < 0.8 else rng.choice(prefixes)
            toks = prefix + [rng.randrange(1000) for _ in range(rng.randint(1, 2 * bs))]
            max_tokens = rng.randint(1, 20)
            pending.append(make_req(f"r{i}", 0, max_tokens=max_tokens, tokens=toks[:max_len]))
    finished = []
    preempted = same_step = 0
    for _ in range(2000):
        if pending and rng.random() < 0.5:
            s.add_request(pending.pop(0))
            if caching and pending and rng.random() < 0.5:  # arrivals together: same-step hits
                s.add_request(pending.pop(0))
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
                assert batch.num_new_tokens[:k] == [
                    r.num_tokens - r.num_computed_tokens for r in before
                ]
        else:
            assert batch.requests[k:] == [], "no admission in a step that preempted"
        admitted = batch.requests[k:]
        for j, r in enumerate(admitted):  # a hit on blocks allocated for an earlier admission
            mine = set(blocks_of(s, r))
            same_step += any(
                mine & set(blocks_of(s, q)[q.num_computed_tokens // bs :]) for q in admitted[:j]
            )
        finished += sim_step(s, batch, rng)
        if not pending and not s.has_work():
            break
    assert not s.has_work() and not pending and s.requests == {}
    assert len(finished) == 30
    assert all(len(r.output_token_ids) == r.sampling_params.max_tokens for r in finished)
    assert s.kv_cache_manager.num_free_blocks == s.kv_cache_manager.num_blocks
    assert s.num_preemptions == preempted
    if caching:
        assert s.kv_cache_manager.prefix_hits > 0
        assert any(r.num_cached_tokens > 0 for r in finished)
        assert same_step > 0, "a request admitted after another in the same step shares its blocks"
    else:
        assert same_step == 0


# --------------------------------------------------------------------------- chunked prefill
def test_chunked_prefill_splits_long_prompt_and_mixes_with_decodes():
    rng = random.Random(5)
    s = make_sched(num_blocks=64, block_size=4, budget=16)
    short = make_req("short", 3, max_tokens=30, rng=rng)
    s.add_request(short)
    sim_step(s, s.schedule(), rng)
    long = make_req("long", 50, max_tokens=2, rng=rng)
    s.add_request(long)
    chunks = []
    while long.num_computed_tokens < long.num_prompt_tokens:
        batch = s.schedule()
        check_batch(s, batch)
        assert ids(batch.requests) == ["short", "long"]
        assert batch.num_new_tokens[0] == 1  # the decode goes on in every step
        assert batch.total_tokens <= 16
        chunks.append(batch.num_new_tokens[1])
        kv = s.kv_cache_manager
        assert len(blocks_of(s, long)) == kv.blocks_needed(long.num_computed_tokens + chunks[-1])
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
    s.add_request(a)
    s.add_request(b)
    batch = s.schedule()
    assert ids(batch.requests) == ["a"]  # b needs the whole budget
    sim_step(s, batch, rng)
    batch = s.schedule()
    assert ids(batch.requests) == ["a"] and blocks_of(s, b) == []
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
        s.add_request(r)
    sim_step(s, s.schedule(), rng)  # 8 tokens each: the cache is full
    d = make_req("d", 2, rng=rng)
    s.add_request(d)  # arrived before the preemption
    batch = s.schedule()  # the 8th tokens still fit in two blocks; d does not fit
    check_batch(s, batch)
    assert ids(batch.requests) == ["a", "b", "c"] and s.kv_cache_manager.num_free_blocks == 0
    sim_step(s, batch, rng)  # 9 tokens each: every request needs a third block
    batch = s.schedule()
    check_batch(s, batch)
    assert batch.num_preemptions == 1 and s.num_preemptions == 1
    assert ids(batch.requests) == ["a", "b"] and batch.num_new_tokens == [1, 1]
    assert ids(s.running) == ["a", "b"]
    assert ids(s.waiting) == ["c", "d"], "the preempted request goes to the front"
    assert c.status == RequestStatus.WAITING and c.num_computed_tokens == 0
    assert blocks_of(s, c) == []
    assert c.num_preemptions == 1 and len(c.output_token_ids) == 2  # outputs kept for recompute
    assert len(blocks_of(s, a)) == len(blocks_of(s, b)) == 3
    assert s.kv_cache_manager.num_free_blocks == 0
    assert all(blk in blocks_of(s, a) + blocks_of(s, b) for blk in range(6))
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
    assert s.kv_cache_manager.num_free_blocks == 6


def test_request_preempts_itself_when_it_is_the_newest():
    rng = random.Random(8)
    s = make_sched(num_blocks=5, block_size=4, budget=64)
    a = make_req("a", 10, max_tokens=10, rng=rng)  # 3 blocks; 11 tokens still fit in them
    b = make_req("b", 8, max_tokens=10, rng=rng)  # 2 blocks; 9 tokens need a third
    s.add_request(a)
    s.add_request(b)
    sim_step(s, s.schedule(), rng)  # a 11 tokens, b 9 tokens; the cache is full
    batch = s.schedule()  # a fits; b is the newest and nothing newer can be evicted
    check_batch(s, batch)
    assert ids(batch.requests) == ["a"] and batch.num_new_tokens == [1]
    assert batch.num_preemptions == 1 and b.num_preemptions == 1 and a.num_preemptions == 0
    assert ids(s.running) == ["a"] and ids(s.waiting) == ["b"]
    assert blocks_of(s, b) == [] and b.num_computed_tokens == 0
    assert b.status == RequestStatus.WAITING
    assert s.kv_cache_manager.num_free_blocks == 2


@pytest.mark.parametrize(
    "budget,a_len,a_max,b_len,b_max,num_blocks",
    [
        (16, 4, 24, 14, 12, 8),  # the recompute of b exceeds the budget
        (8, 2, 40, 6, 30, 12),  # ... by more than twice: it takes several steps
    ],
)
def test_preempted_request_longer_than_budget_without_chunking_still_finishes(
    budget, a_len, a_max, b_len, b_max, num_blocks
):
    """With chunked prefill off, a recompute of prompt + outputs may exceed the token budget."""
    rng = random.Random(9)
    s = make_sched(num_blocks=num_blocks, block_size=4, budget=budget, chunked=False)
    a = make_req("a", a_len, max_tokens=a_max, rng=rng)
    b = make_req("b", b_len, max_tokens=b_max, rng=rng)
    s.add_request(a)
    s.add_request(b)
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
    assert s.kv_cache_manager.num_free_blocks == num_blocks


def test_finish_frees_blocks_in_any_state_and_is_idempotent():
    rng = random.Random(10)
    s = make_sched(num_blocks=16, block_size=4, budget=8)
    a, b, c = make_req("a", 6, rng=rng), make_req("b", 20, rng=rng), make_req("c", 3, rng=rng)
    for r in (a, b, c):
        s.add_request(r)
    batch = s.schedule()  # a whole, b a 2-token chunk; c waits
    sim_step(s, batch, rng)
    assert a.status == b.status == RequestStatus.RUNNING and c.status == RequestStatus.WAITING
    for r in (b, c, a, b, c):  # mid-prefill, waiting, decoding, twice
        s.finish(r, FinishReason.ABORT)
        s.kv_cache_manager.check_integrity()
        assert r.status == RequestStatus.FINISHED and blocks_of(s, r) == []
        assert r not in s.running and r not in s.waiting and r.request_id not in s.requests
    assert b.finish_reason == FinishReason.ABORT
    assert s.kv_cache_manager.num_free_blocks == 16 and not s.has_work()
    # abort by id: True for a live request (here waiting), False for a finished or unknown one
    d = make_req("d", 5, rng=rng)
    s.add_request(d)
    assert s.abort("d")
    assert d.status == RequestStatus.FINISHED and d.finish_reason == FinishReason.ABORT
    assert not s.abort("d") and not s.abort("a") and not s.abort("unknown")
    assert not s.has_work() and s.requests == {}
    assert len(s.schedule()) == 0  # nothing runs: the finished ids wait for the next batch
    e = make_req("e", 5, rng=rng)
    s.add_request(e)
    batch = s.schedule()
    assert ids(batch.requests) == ["e"]
    assert batch.finished_request_ids == ["b", "c", "a", "d"], "each finished one once, in order"
    assert s.schedule().finished_request_ids == []


# --------------------------------------------------------------------------- block-table deltas
def test_batch_carries_block_table_deltas():
    """A batch's new_block_ids: the whole table of a request admitted this step (reset), then
    only the blocks a step appended (often none); finished ids go with the next batch."""
    rng = random.Random(12)
    s = make_sched(num_blocks=8, block_size=4, budget=64)
    a, b = make_req("a", 6, max_tokens=3, rng=rng), make_req("b", 3, max_tokens=10, rng=rng)
    s.add_request(a)
    s.add_request(b)
    batch = s.schedule()
    assert batch.block_table_reset == [True, True]
    assert batch.new_block_ids == [blocks_of(s, a), blocks_of(s, b)]
    assert [len(x) for x in batch.new_block_ids] == [2, 1]
    sim_step(s, batch, rng)  # a 7 tokens, b 4
    batch = s.schedule()  # a computes token 6 (block 1), b token 3 (block 0): nothing new
    assert batch.block_table_reset == [False, False] and batch.new_block_ids == [[], []]
    sim_step(s, batch, rng)  # a 8 tokens, b 5
    b_before = blocks_of(s, b)
    batch = s.schedule()  # b computes token 4: a second block
    assert batch.new_block_ids[0] == [] and len(batch.new_block_ids[1]) == 1
    assert blocks_of(s, b) == b_before + batch.new_block_ids[1]
    assert sim_step(s, batch, rng) == [a]  # a reached max_tokens
    batch = s.schedule()
    assert ids(batch.requests) == ["b"] and batch.finished_request_ids == ["a"]
    assert s.schedule().finished_request_ids == []
    assert s.batches == 5  # (each of them replayed into the mirrors by CheckedScheduler)


# --------------------------------------------------------------------------- prefix caching
def test_prefix_hits_at_admission_shared_within_a_step_and_counted_once():
    rng = random.Random(13)
    s = make_sched(num_blocks=12, block_size=4, budget=64, caching=True)
    kv = s.kv_cache_manager
    prefix = [rng.randrange(1000) for _ in range(8)]
    a = make_req("a", 0, max_tokens=1, tokens=prefix + [1, 2, 3])
    b = make_req("b", 0, max_tokens=1, tokens=prefix + [4, 5, 6, 7, 8])
    s.add_request(a)
    s.add_request(b)
    batch = s.schedule()
    check_batch(s, batch)
    # b, admitted after a in the same step, shares a's two full prompt blocks at once
    assert ids(batch.requests) == ["a", "b"] and batch.num_new_tokens == [11, 5]
    assert blocks_of(s, b)[:2] == blocks_of(s, a)[:2]
    assert [kv.pool.ref_counts[blk] for blk in blocks_of(s, a)[:2]] == [2, 2]
    assert (a.num_computed_tokens, a.num_cached_tokens) == (0, 0)
    assert (b.num_computed_tokens, b.num_cached_tokens) == (8, 8)
    assert batch.new_block_ids[1] == blocks_of(s, b), "the hits are part of the reset table"
    assert (kv.prefix_queries, kv.prefix_hits) == (11 + 13, 8)
    assert sim_step(s, batch, rng) == [a, b]
    shared = kv.get_computed_blocks(make_req("probe", 0, tokens=prefix + [9]))[0]
    assert len(shared) == 2, "computed blocks stay cached after their requests finished"

    # c shares the prefix but does not fit beside f: it is looked up every step and counted
    # once, when it is admitted
    f = make_req("f", 28, max_tokens=50, rng=rng)  # 7 blocks
    c = make_req("c", 0, max_tokens=2, tokens=prefix + [rng.randrange(1000) for _ in range(20)])
    s.add_request(f)
    s.add_request(c)
    for _ in range(3):
        batch = s.schedule()
        check_batch(s, batch)
        assert ids(batch.requests) == ["f"] and ids(s.waiting) == ["c"]
        assert (kv.prefix_queries, kv.prefix_hits) == (24 + 28, 8)
        assert c.num_computed_tokens == 0 and c.num_cached_tokens == 0
        sim_step(s, batch, rng)
    assert s.abort("f")
    batch = s.schedule()
    check_batch(s, batch)
    assert ids(batch.requests) == ["c"] and batch.num_new_tokens == [20]
    assert blocks_of(s, c)[:2] == shared
    assert (c.num_computed_tokens, c.num_cached_tokens) == (8, 8)
    assert (kv.prefix_queries, kv.prefix_hits) == (24 + 28 + 28, 16)
    sim_step(s, batch, rng)


def test_readmitted_preempted_request_reports_cached_prompt_tokens_only():
    """The preempted request's computed blocks stay cached (it is freed before its progress is
    reset); re-admitted, it hits them: num_computed_tokens covers the hit, num_cached_tokens
    and the hit counter only its prompt tokens among them."""
    rng = random.Random(14)
    s = make_sched(num_blocks=5, block_size=4, budget=64, caching=True)
    kv = s.kv_cache_manager
    a = make_req("a", 8, max_tokens=6, rng=rng)  # older; needs a 4th block in step 6
    r = make_req("r", 2, max_tokens=12, rng=rng)  # newest: the victim
    s.add_request(a)
    s.add_request(r)
    for _ in range(5):
        batch = s.schedule()
        check_batch(s, batch)
        assert ids(batch.requests) == ["a", "r"] and batch.num_preemptions == 0
        sim_step(s, batch, rng)
    assert kv.num_free_blocks == 0 and r.num_tokens == 7 and r.num_computed_tokens == 6
    r_blocks = blocks_of(s, r)
    batch = s.schedule()
    check_batch(s, batch)
    assert batch.num_preemptions == 1 and ids(batch.requests) == ["a"] and ids(s.waiting) == ["r"]
    assert kv.pool.block_keys[r_blocks[0]] is not None, "r's computed block is still cached"
    assert sim_step(s, batch, rng) == [a]
    q0, h0 = kv.prefix_queries, kv.prefix_hits
    batch = s.schedule()
    check_batch(s, batch)
    assert ids(batch.requests) == ["r"] and batch.block_table_reset == [True]
    assert blocks_of(s, r)[0] == r_blocks[0] and batch.new_block_ids == [blocks_of(s, r)]
    assert r.num_computed_tokens == 4 and batch.num_new_tokens == [3]  # 2 prompt + 5 outputs
    assert r.num_cached_tokens == 2, "num_cached_tokens counts prompt tokens found in the cache"
    assert (kv.prefix_queries - q0, kv.prefix_hits - h0) == (2, 2)
    for _ in range(100):
        if not s.has_work():
            break
        sim_step(s, batch, rng)
        batch = s.schedule()
        check_batch(s, batch)
    assert not s.has_work() and r.finish_reason == FinishReason.LENGTH
    assert len(r.output_token_ids) == 12 and r.num_preemptions == 1 and kv.num_free_blocks == 5


def test_failed_step_leaves_no_uncomputed_blocks_in_the_prefix_cache():
    """Blocks registered when a step was scheduled leave the cache when the step fails (its
    requests are finished before their progress advanced); computed ones stay."""
    rng = random.Random(15)
    s = make_sched(num_blocks=16, block_size=4, budget=64, caching=True)
    kv = s.kv_cache_manager
    prompt = [rng.randrange(1000) for _ in range(9)]
    a = make_req("a", 0, tokens=prompt)
    b = make_req("b", 0, tokens=prompt[:8] + [5, 6])
    s.add_request(a)
    s.add_request(b)
    batch = s.schedule()
    check_batch(s, batch)
    assert blocks_of(s, b)[:2] == blocks_of(s, a)[:2]  # shared within the step
    assert len(kv.pool.cached) == 2
    outs = s.fail(batch.requests, "boom")  # the launch failed: nothing was computed
    assert [(o.request_id, o.finish_reason, o.error) for o in outs] == [
        ("a", FinishReason.ERROR, "boom"),
        ("b", FinishReason.ERROR, "boom"),
    ]
    assert s.fail(batch.requests, "again") == []
    kv.check_integrity()
    assert kv.pool.cached == {} and kv.num_free_blocks == 16
    c = make_req("c", 0, max_tokens=1, tokens=prompt)
    s.add_request(c)
    batch = s.schedule()
    check_batch(s, batch)
    assert batch.finished_request_ids == ["a", "b"]
    assert c.num_cached_tokens == 0 and c.num_computed_tokens == 0
    assert sim_step(s, batch, rng) == [c]  # computed, then finished: its blocks stay cached
    d = make_req("d", 0, max_tokens=1, tokens=prompt)
    s.add_request(d)
    batch = s.schedule()
    check_batch(s, batch)
    assert d.num_cached_tokens == 8 and batch.num_new_tokens == [1]
    sim_step(s, batch, rng)


# --------------------------------------------------------------------------- engine level
def _engine(path, **kw):
    cfg = dict(
        model=path, block_size=8, num_kv_blocks=16, max_num_seqs=8, max_num_batched_tokens=48
    )
    cfg.update(kw)
    return build_engine(EngineConfig(**cfg), eos_token_ids=frozenset())


def check_engine(eng) -> None:
    """After a step: the manager's invariants over the live requests, and the worker's block
    tables (built from the batches' deltas) equal to the manager's for every running request."""
    kv = eng.kv_cache_manager
    kv.check_integrity(list(eng.requests.values()))
    for r in eng.scheduler.running:
        assert mirror_blocks(eng.executor.block_tables, r.request_id) == kv.get_block_ids(
            r.request_id
        )
    for r in eng.scheduler.waiting:
        assert kv.get_block_ids(r.request_id) == []


def test_request_that_can_never_fit_is_rejected_and_does_not_block_others(tiny_checkpoint):
    path, _ = tiny_checkpoint
    gen = torch.Generator().manual_seed(12)
    eng = _engine(path, num_kv_blocks=6)  # 48 tokens of KV: max_model_len lowered to 48
    assert eng.max_model_len == 48
    ok1 = eng.add_request(
        "ok1", torch.randint(0, 384, (20,), generator=gen).tolist(), SamplingParams(max_tokens=5)
    )
    for n in (48, 60, 300):
        with pytest.raises(RequestRejected):
            eng.add_request(
                f"big{n}", torch.randint(0, 384, (n,), generator=gen).tolist(), SamplingParams()
            )
        assert f"big{n}" not in eng.requests
    with pytest.raises(RequestRejected):
        eng.add_request("empty", [], SamplingParams())
    with pytest.raises(RequestRejected):
        eng.add_request("oov", [1, 384], SamplingParams())
    with pytest.raises(RequestRejected):
        eng.add_request("ok1", [1, 2], SamplingParams())  # duplicate id
    ok2 = eng.add_request(
        "ok2", torch.randint(0, 384, (47,), generator=gen).tolist(), SamplingParams(max_tokens=5)
    )
    assert ids(eng.scheduler.waiting) == ["ok1", "ok2"]
    finished = {}
    for _ in range(100):
        if not eng.has_unfinished():
            break
        outs, _ = eng.step()
        check_engine(eng)
        finished.update({o.request_id: o.finish_reason for o in outs if o.finished})
    assert finished == {"ok1": FinishReason.LENGTH, "ok2": FinishReason.LENGTH}
    assert (
        len(ok1.output_token_ids) == 5 and len(ok2.output_token_ids) == 1
    )  # 47 + 1 = max_model_len
    assert eng.requests == {} and eng.kv_cache_manager.num_free_blocks == 6

    # chunked prefill off: a prompt over the token budget can never be scheduled
    eng = _engine(path, enable_chunked_prefill=False, max_num_batched_tokens=16)
    with pytest.raises(RequestRejected):
        eng.add_request("long", list(range(17)), SamplingParams())
    eng.add_request("fits", list(range(16)), SamplingParams(max_tokens=3))
    outs = []
    while eng.has_unfinished():
        outs += eng.step()[0]
    assert [o.request_id for o in outs if o.finished] == ["fits"]


@pytest.mark.parametrize(
    "caching,chunked,async_scheduling",
    [
        (False, True, False),
        (True, True, False),
        (False, False, False),
        (True, False, False),
        (False, True, True),
        (True, True, True),
    ],
    ids=[
        "no-cache",
        "prefix-cache",
        "no-cache-unchunked",
        "prefix-cache-unchunked",
        "no-cache-async",
        "prefix-cache-async",
    ],
)
def test_block_accounting_after_finish_abort_preempt(
    tiny_checkpoint, caching, chunked, async_scheduling
):
    """Block accounting: after any mix of finished, aborted and preempted requests every block
    is free again (with async scheduling too: aborts and preemptions with a token in flight)."""
    path, _ = tiny_checkpoint
    rng = random.Random(20 + caching + 2 * chunked)
    bs, num_blocks = 8, (14 if chunked else 9)
    budget = 40 if chunked else 24  # unchunked: recomputes (prompt + outputs) exceed the budget
    eng = _engine(
        path,
        block_size=bs,
        num_kv_blocks=num_blocks,
        max_num_seqs=6,
        max_num_batched_tokens=budget,
        enable_prefix_caching=caching,
        enable_chunked_prefill=chunked,
        async_scheduling=async_scheduling,
    )
    kv = eng.kv_cache_manager
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
            check_engine(eng)
        assert not eng.abort("unknown")
        outs, stats = eng.step()
        n_steps += 1
        check_engine(eng)
        assert stats.num_free_blocks == kv.num_free_blocks
        for o in outs:
            assert o.request_id not in finished and o.request_id not in aborted
            outputs[o.request_id] += o.new_token_ids
            if o.finished:
                finished[o.request_id] = o.finish_reason
        assert n_steps < 2000
    assert eng.scheduler.num_preemptions > 0, "the cache is meant to force preemptions"
    assert len(aborted) > 0 and len(finished) > 0 and len(aborted) + len(finished) == N
    assert set(finished.values()) == {FinishReason.LENGTH}  # no EOS ids: only lengths end them
    assert kv.num_free_blocks == num_blocks and all(rc == 0 for rc in kv.pool.ref_counts)
    kv.check_integrity()
    assert eng.requests == {} and not eng.scheduler.running and not eng.scheduler.waiting
    if caching:
        assert kv.prefix_hits > 0
    # finished requests have all their tokens; greedy and seeded ones equal a run without
    # preemption, prefix cache or aborted neighbours (recompute restores the same KV)
    params = {rid: (prompt, sp) for rid, prompt, sp in all_requests}
    for rid in finished:
        prompt, sp = params[rid]
        assert len(outputs[rid]) == min(sp.max_tokens, max_len - len(prompt))
    check = [rid for rid in finished if params[rid][1].greedy or params[rid][1].seed is not None]
    assert len(check) > 5
    ref = _engine(
        path,
        block_size=bs,
        num_kv_blocks=256,
        max_num_seqs=64,
        max_num_batched_tokens=4096,
        max_model_len=max_len,
        enable_prefix_caching=False,
    )
    ref_out = ref.generate([params[rid][0] for rid in check], [params[rid][1] for rid in check])
    assert ref.scheduler.num_preemptions == 0
    assert [outputs[rid] for rid in check] == ref_out
