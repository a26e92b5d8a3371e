"""The two prefill budgets of the scheduler: a larger budget for steps in which nothing decodes
(a lone long prompt) and a cap on prompt tokens while requests decode (decode streams protected
from long prefills). The token streams must not change: greedy outputs equal the default
policy's, and every KV block comes back."""

from __future__ import annotations

import random

import pytest
import torch

from engine.core.attention_budget import causal_pairs, max_rows_within
from engine.core.config import EngineConfig
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.outputs import SampleOutput
from engine.core.request import Request, SamplingParams
from engine.core.scheduler import Scheduler
from engine.worker.build import build_engine

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _req(rid: str, n: int, max_tokens: int, rng: random.Random) -> Request:
    return Request(
        rid,
        [rng.randrange(1000) for _ in range(n)],
        SamplingParams(max_tokens=max_tokens),
        max_len=1 << 20,
    )


def _finish(s: Scheduler, batch, rng: random.Random) -> None:
    """Launch a scheduled batch and apply random samples for the requests that sample."""
    sample = [
        r
        for r, n in zip(batch.requests, batch.num_new_tokens)
        if r.num_computed_tokens + n == r.num_tokens
    ]
    s.update_after_launch(batch, sample)
    s.update_from_output(
        sample, SampleOutput([rng.randrange(1000) for _ in sample], [None] * len(sample))
    )


def _step(s: Scheduler, rng: random.Random):
    batch = s.schedule()
    decodes = sum(
        1
        for r, n in zip(batch.requests, batch.num_new_tokens)
        if r.num_tokens - r.num_computed_tokens == 1
        and r.num_computed_tokens >= r.num_prompt_tokens
    )
    prefill = sum(
        n
        for r, n in zip(batch.requests, batch.num_new_tokens)
        if not (
            r.num_tokens - r.num_computed_tokens == 1
            and r.num_computed_tokens >= r.num_prompt_tokens
        )
    )
    _finish(s, batch, rng)
    return batch, decodes, prefill


@pytest.mark.parametrize("cap,solo", [(16, 512), (48, 256), (None, 2048), (0, 1024)])
def test_prefill_tokens_are_capped_while_decoding_and_a_lone_prefill_takes_the_larger_budget(
    cap, solo
):
    rng = random.Random(cap or 0)
    kv = KVCacheManager(4096, 16, enable_prefix_caching=False)
    s = Scheduler(
        kv,
        max_num_seqs=16,
        max_num_batched_tokens=128,
        prefill_only_token_budget=solo,
        max_prefill_tokens_with_decodes=cap,
    )
    lone = _req("lone", 3000, 4, rng)
    s.add_request(lone)
    first, _, prefill = _step(s, rng)
    assert first.num_new_tokens == [min(solo, 3000)] and prefill == min(solo, 3000)
    while lone.num_computed_tokens < lone.num_prompt_tokens:  # the rest of the lone prompt
        batch, decodes, prefill = _step(s, rng)
        assert decodes == 0 and prefill <= solo
    streams = [_req(f"d{i}", 20, 120, rng) for i in range(6)]
    for r in streams:
        s.add_request(r)
    for _ in range(3):
        _step(s, rng)
    for i in range(3):  # long prompts arrive while the streams decode
        s.add_request(_req(f"long{i}", 900, 2, rng))
    steps_with_prefill = 0
    for _ in range(1000):
        if not s.has_work():
            break
        batch, decodes, prefill = _step(s, rng)
        assert sum(batch.num_new_tokens) <= (128 if decodes else solo)
        if decodes:
            assert prefill <= (cap or 128)  # None and 0: no cap
            steps_with_prefill += prefill > 0
        kv.check_integrity(list(s.requests.values()))
    assert not s.has_work() and kv.num_free_blocks == kv.num_blocks
    assert steps_with_prefill > 0


def _engine(path, **kw):
    cfg = dict(
        model=path, block_size=8, num_kv_blocks=40, max_num_seqs=6, max_num_batched_tokens=48
    )
    cfg.update(kw)
    return build_engine(EngineConfig(**cfg), eos_token_ids=frozenset())


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_greedy_outputs_equal_the_default_policy_with_long_and_short_prompts(
    tiny_checkpoint, async_scheduling
):
    """Budgets change when a prompt is computed, never what is computed: greedy tokens equal the
    default policy's (and preemption under the small cache loses nothing)."""
    path, _ = tiny_checkpoint
    gen = torch.Generator().manual_seed(9)
    lengths = [150, 5, 90, 12, 3, 170, 40, 7]
    prompts = [torch.randint(0, 384, (n,), generator=gen).tolist() for n in lengths]
    params = [SamplingParams(temperature=0.0, max_tokens=12 + i % 5) for i in range(len(prompts))]
    ref = _engine(path, num_kv_blocks=512, async_scheduling=async_scheduling)
    want = ref.generate(prompts, params)
    eng = _engine(
        path,
        prefill_only_token_budget=200,
        max_prefill_tokens_with_decodes=8,
        max_prefill_attention_with_decodes=300,
        async_scheduling=async_scheduling,
    )
    got = eng.generate(prompts, params)
    assert got == want
    assert eng.scheduler.num_preemptions > 0, "the small cache is meant to force preemptions"
    kv = eng.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks
    kv.check_integrity()


@pytest.mark.parametrize("pairs", [1, 3000, 40_000])
def test_prompt_attention_is_bounded_while_decoding_and_a_long_prompt_still_progresses(pairs):
    """While requests decode, a step's prompt chunks stay within ``pairs`` query-key pairs (the
    first chunk of a step takes at least one row), so a chunk shrinks as its cached prefix
    grows; without decodes the bound does not apply; every prompt finishes, no block leaks."""
    rng = random.Random(pairs)
    kv = KVCacheManager(4096, 16, enable_prefix_caching=False)
    s = Scheduler(
        kv,
        max_num_seqs=16,
        max_num_batched_tokens=256,
        max_prefill_attention_with_decodes=pairs,
    )
    for i in range(4):
        s.add_request(_req(f"d{i}", 30, 200, rng))
    for _ in range(3):
        _step(s, rng)
    longs = [_req(f"long{i}", 700 + 100 * i, 2, rng) for i in range(3)]
    for r in longs:
        s.add_request(r)
    shrunk = 0
    for _ in range(5000):
        if not s.has_work():
            break
        before = {r.request_id: r.num_computed_tokens for r in s.requests.values()}
        total = {r.request_id: r.num_tokens for r in s.requests.values()}
        batch, decodes, _ = _step(s, rng)
        # a request with one token left to compute is a decode row to the scheduler (also the
        # last token of a prompt): its attention is a decode's
        chunks = [
            (before[r.request_id], n)
            for r, n in zip(batch.requests, batch.num_new_tokens)
            if total[r.request_id] - before[r.request_id] > 1
        ]
        if decodes and chunks:
            used = sum(causal_pairs(c, n) for c, n in chunks)
            assert used <= pairs or (len(chunks) == 1 and chunks[0][1] == 1), (used, chunks)
            c, n = chunks[0]
            shrunk += c > 0 and n < max_rows_within(0, pairs)
        kv.check_integrity(list(s.requests.values()))
    assert not s.has_work() and kv.num_free_blocks == kv.num_blocks
    assert all(r.num_computed_tokens >= r.num_prompt_tokens for r in longs)
    if pairs > 1:
        assert shrunk > 0, "chunks over a cached prefix are meant to get fewer rows"


def test_attention_bound_of_zero_is_no_bound():
    kv = KVCacheManager(64, 16, enable_prefix_caching=False)
    s = Scheduler(kv, 4, 128, max_prefill_attention_with_decodes=0)
    assert s.max_prefill_attention_with_decodes is None
    with pytest.raises(ValueError, match="max_prefill_attention_with_decodes"):
        Scheduler(kv, 4, 128, max_prefill_attention_with_decodes=-1)


def test_prompt_token_cap_of_zero_is_no_cap():
    kv = KVCacheManager(64, 16, enable_prefix_caching=False)
    assert (
        Scheduler(kv, 4, 128, max_prefill_tokens_with_decodes=0).max_prefill_tokens_with_decodes
        is None
    )
    with pytest.raises(ValueError, match="max_prefill_tokens_with_decodes"):
        Scheduler(kv, 4, 128, max_prefill_tokens_with_decodes=-1)


def _check_step(s: Scheduler, budget: int, pairs: int) -> tuple[int, list[tuple[int, int]]]:
    """Schedule one step and check every prompt chunk against the bound, in scheduling order:
    rows = min(tokens left, token budget left, rows within the pairs left), and at least one row
    for the step's first chunk. Returns the batch's decode count and its (prefix, rows) chunks
    (prefix: the request's computed tokens after admission, a prefix-cache hit included)."""
    batch = s.schedule()
    rows = [
        (r, n, r.num_tokens - r.num_computed_tokens)
        for r, n in zip(batch.requests, batch.num_new_tokens)
    ]
    decodes = sum(1 for _, _, left in rows if left == 1)
    budget_left, pairs_left, chunks = budget, pairs, []
    for r, n, left in rows:
        if left == 1:
            budget_left -= n
            continue
        c = r.num_computed_tokens
        allowed = max_rows_within(c, pairs_left) if decodes else left
        if not chunks:
            allowed = max(allowed, 1)
        assert n == min(left, budget_left, allowed), (r.request_id, c, n, left, budget_left)
        budget_left -= n
        pairs_left -= causal_pairs(c, n)
        chunks.append((c, n))
    return decodes, chunks, batch


@pytest.mark.parametrize("pairs", [1, 5000])
def test_prompts_progress_while_streams_never_stop_decoding(pairs):
    """Streams that decode for longer than the test runs: long prompts (two of them sharing a
    cached prefix) still finish their prefill, each step's chunks are exactly what the bound
    allows, and a bound of one pair still gives the step's first chunk one row."""
    rng = random.Random(pairs)
    kv = KVCacheManager(4096, 16, enable_prefix_caching=True)
    budget = 256
    s = Scheduler(kv, 16, budget, max_prefill_attention_with_decodes=pairs)
    for i in range(4):
        s.add_request(_req(f"d{i}", 20, 10**6, rng))
    for _ in range(3):
        _step(s, rng)
    shared = [rng.randrange(1000) for _ in range(320)]  # 20 blocks
    longs = [
        Request(
            f"long{i}",
            (shared if i else []) + [rng.randrange(1000) for _ in range(400)],
            SamplingParams(max_tokens=2),
            max_len=1 << 20,
        )
        for i in range(3)
    ]
    s.add_request(longs[0])
    s.add_request(longs[1])
    hits = steps = 0
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in longs):
        if steps == 30:
            s.add_request(longs[2])  # its prefix is cached by now
        decodes, chunks, batch = _check_step(s, budget, pairs)
        assert decodes >= 4  # the streams (and a prompt whose last token is left)
        prompting = [r for r in batch.requests if r.num_computed_tokens < r.num_prompt_tokens]
        assert prompting, "a step with a prompt pending carries at least one prompt row"
        hits += sum(
            1
            for r, c in zip(batch.requests, batch.block_table_reset)
            if c and r.num_computed_tokens
        )
        _finish(s, batch, rng)
        kv.check_integrity(list(s.requests.values()))
        steps += 1
        assert steps < 20000
    assert hits == 1, "the third prompt was admitted on a prefix-cache hit"
    for rid in list(s.requests):
        s.abort(rid)
    assert kv.num_free_blocks == kv.num_blocks
