"""``prepare_inputs`` against a per-token reference built from the KV cache manager's blocks.

The real scheduler and KV cache manager run randomized workloads (chunked prefills mixed with
decodes, all-decode steps, finishes, preemptions when blocks run out); every batch is flattened
by ``prepare_inputs`` and by a plain loop over each request's tokens (position ``p`` of a
request stores at ``blocks[p // block_size] * block_size + p % block_size``). With async
scheduling the next step is scheduled before the previous one's samples are applied, so
requests carry a token in flight (its input id comes from the previous step's sample row).
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from engine.core.kv_cache_manager import KVCacheManager
from engine.core.outputs import SampleOutput
from engine.core.request import Request, SamplingParams
from engine.core.scheduler import ScheduledBatch, Scheduler
from engine.worker.block_table import PersistentBlockTables
from engine.worker.step_inputs import prepare_inputs


def reference(
    batch: ScheduledBatch, kv: KVCacheManager, prev_rows: dict[str, int], bs: int
) -> dict[str, list]:
    """The step's arrays from one loop over each request's tokens."""
    out = {k: [] for k in ("ids", "pos", "slots", "seq_lens", "logits", "dst", "src")}
    for req, n in zip(batch.requests, batch.num_new_tokens):
        start = req.num_computed_tokens
        blocks = kv.get_block_ids(req.request_id)
        known = req.prompt_token_ids + req.output_token_ids
        for p in range(start, start + n):
            if p < len(known):
                out["ids"].append(known[p])
            else:  # the token in flight
                out["dst"].append(len(out["ids"]))
                out["src"].append(prev_rows[req.request_id])
                out["ids"].append(0)
            out["pos"].append(p)
            out["slots"].append(blocks[p // bs] * bs + p % bs)
        out["seq_lens"].append(start + n)
        if start + n == req.num_tokens_with_placeholders:
            out["logits"].append(len(out["ids"]) - 1)
    return out


def check(inp, batch, kv, prev_rows, bs) -> None:
    ref = reference(batch, kv, prev_rows, bs)
    assert inp.input_ids.tolist() == ref["ids"]
    assert inp.positions.tolist() == ref["pos"] and inp.positions.dtype == np.int64
    assert inp.slot_mapping.tolist() == ref["slots"] and inp.slot_mapping.dtype == np.int64
    assert inp.seq_lens.tolist() == ref["seq_lens"] and inp.seq_lens.dtype == np.int32
    counts = batch.num_new_tokens
    assert inp.cu_seqlens_q.tolist() == np.concatenate([[0], np.cumsum(counts)]).tolist()
    assert inp.logits_indices.tolist() == ref["logits"]
    assert inp.max_query_len == max(counts) and inp.max_seq_len == max(ref["seq_lens"])
    assert (inp.gather_dst.tolist() if inp.gather_dst is not None else []) == ref["dst"]
    assert (inp.gather_src.tolist() if inp.gather_src is not None else []) == ref["src"]
    for i, req in enumerate(batch.requests):  # each row's blocks up to its sequence length
        blocks = kv.get_block_ids(req.request_id)[: -(-ref["seq_lens"][i] // bs)]
        assert inp.block_tables[i, : len(blocks)].tolist() == blocks


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("seed", range(4))
def test_prepare_inputs_matches_per_token_reference(seed, async_scheduling):
    rng = random.Random(seed)
    bs = rng.choice([2, 4, 16])
    kv = KVCacheManager(rng.randint(20, 60), bs, enable_prefix_caching=rng.random() < 0.5)
    sched = Scheduler(kv, max_num_seqs=rng.randint(1, 8), max_num_batched_tokens=rng.randint(8, 48))
    tables = PersistentBlockTables(-(-4096 // bs), initial_rows=2)
    pending = [
        Request(
            f"r{i}",
            [rng.randrange(1000) for _ in range(rng.randint(1, 3 * bs))],
            SamplingParams(max_tokens=rng.randint(1, 24), ignore_eos=True),
            max_len=1 << 20,
        )
        for i in range(24)
    ]
    prev = None  # (sample requests, rows) of the step in flight
    decode_steps = mixed_steps = 0
    for _ in range(3000):
        if pending and rng.random() < 0.4:
            sched.add_request(pending.pop(0))
        batch = sched.schedule()
        prev_rows = prev[1] if prev is not None else {}
        if len(batch):
            inp = prepare_inputs(batch, bs, tables, prev_rows)
            check(inp, batch, kv, prev_rows, bs)
            decode_steps += len(inp.input_ids) == len(batch)
            mixed_steps += len(inp.input_ids) > len(batch)
            sched.update_after_launch(batch, inp.sample_requests)
            launched = (
                inp.sample_requests,
                {r.request_id: i for i, r in enumerate(inp.sample_requests)},
            )
        else:
            launched = None
        done = prev if async_scheduling else launched
        if done is not None:
            reqs = done[0]
            tokens = [rng.randrange(1000) for _ in reqs]
            sched.update_from_output(reqs, SampleOutput(tokens, [None] * len(reqs)))
        prev = launched if async_scheduling else None
        if not pending and not sched.has_work() and prev is None:
            break
    assert not sched.has_work() and not pending
    assert decode_steps and mixed_steps  # both ways of laying out the tokens were checked
