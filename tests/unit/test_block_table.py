"""PersistentBlockTables: the incremental mirror equals the requests' block tables after any
sequence of growth, replacement (preemption), release and row reuse."""

from __future__ import annotations

import random

import numpy as np
import pytest

from engine.block_table import PersistentBlockTables
from engine.request import Request, SamplingParams


@pytest.mark.parametrize("seed", range(5))
def test_mirror_matches_block_tables_under_random_operations(seed):
    rng = random.Random(seed)
    width = 12
    mirror = PersistentBlockTables(width, initial_rows=2)  # small: forces growth of the array
    live: dict[str, Request] = {}
    for step in range(300):
        op = rng.random()
        if op < 0.2 or not live:
            rid = f"r{step}"
            live[rid] = Request(rid, [1], SamplingParams(), max_len=1000)
        elif op < 0.3:
            rid = rng.choice(sorted(live))
            mirror.release(rid)
            del live[rid]
            continue
        elif op < 0.4:  # preemption: the block manager replaces the list, then refills it
            req = live[rng.choice(sorted(live))]
            req.block_table = [rng.randrange(1000) for _ in range(rng.randint(0, 3))]
        for req in live.values():  # growth in place
            if len(req.block_table) < width and rng.random() < 0.5:
                req.block_table.extend(rng.randrange(1000) for _ in range(rng.randint(1, 2)))
                del req.block_table[width:]
        batch = rng.sample(sorted(live), rng.randint(1, len(live)))
        reqs = [live[r] for r in batch]
        rows = mirror.rows_for(reqs)
        assert len(set(rows.tolist())) == len(rows)
        need = max(1, max(len(r.block_table) for r in reqs))
        got = mirror.gather(rows, need)
        for i, r in enumerate(reqs):
            assert got[i, : len(r.block_table)].tolist() == r.block_table
    assert len(mirror) == len(live)


def test_too_many_blocks_and_bad_sizes_raise():
    with pytest.raises(ValueError):
        PersistentBlockTables(0)
    mirror = PersistentBlockTables(2)
    req = Request("x", [1], SamplingParams(), max_len=10)
    req.block_table = [1, 2, 3]
    with pytest.raises(ValueError):
        mirror.rows_for([req])
    assert isinstance(mirror.gather(np.zeros(0, dtype=np.int64), 1), np.ndarray)
