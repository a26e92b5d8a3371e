"""PersistentBlockTables: the delta-built mirror equals the requests' block tables after any
sequence of appends, resets (re-admission after a preemption), releases and row reuse, whether
the deltas come one by one (``append``) or as scheduled batches (``apply``)."""

from __future__ import annotations

import random

import numpy as np
import pytest

from engine.core.request import Request, SamplingParams
from engine.core.scheduler import ScheduledBatch
from engine.worker.block_table import PersistentBlockTables
from tests.engine_helpers import mirror_blocks


def make_batch(
    entries: list[tuple[str, list[int], bool]], finished: list[str] = ()
) -> ScheduledBatch:
    """A batch of (request id, new block ids, reset) entries, releasing ``finished`` first."""
    return ScheduledBatch(
        requests=[Request(rid, [1], SamplingParams(), max_len=1000) for rid, _, _ in entries],
        num_new_tokens=[1] * len(entries),
        new_block_ids=[list(blocks) for _, blocks, _ in entries],
        block_table_reset=[reset for _, _, reset in entries],
        finished_request_ids=list(finished),
    )


@pytest.mark.parametrize("seed", range(5))
def test_mirror_matches_block_tables_under_random_operations(seed):
    rng = random.Random(seed)
    width = 12
    mirror = PersistentBlockTables(width, initial_rows=2)  # small: forces growth of the array
    model: dict[str, list[int]] = {}  # request id -> its block ids
    rows_of: dict[str, int] = {}  # a live request keeps its row until released
    finished: list[str] = []  # to be released by the next batch
    stats = dict(max_live=0, width_errors=0, resets=0, direct=0, released=0, reused_rows=0)
    released_rows: set[int] = set()

    def check_all():
        assert len(mirror) == len(model)
        # rows are reused: the array doubles only when every row is taken
        stats["max_live"] = max(stats["max_live"], len(model))
        cap = 2
        while cap < stats["max_live"]:
            cap *= 2
        assert mirror.table.shape == (cap, width)
        for rid, blocks in model.items():
            assert mirror_blocks(mirror, rid) == blocks
        assert mirror_blocks(mirror, "unknown") == []

    for step in range(300):
        if rng.random() < 0.15 and set(model) - set(finished):  # deltas outside a batch
            rid = rng.choice(sorted(set(model) - set(finished)))
            op = rng.random()
            if op < 0.3:  # released directly (idempotent)
                mirror.release(rid)
                mirror.release(rid)  # idempotent
                del model[rid]
                released_rows.add(rows_of.pop(rid))
                stats["released"] += 1
            else:
                reset = op < 0.5
                blocks = [rng.randrange(1000) for _ in range(rng.randint(0, 3))]
                expect = blocks if reset else model[rid] + blocks
                if len(expect) > width:
                    with pytest.raises(ValueError):
                        mirror.append(rid, blocks, reset)
                    stats["width_errors"] += 1
                else:
                    mirror.append(rid, blocks, reset)
                    model[rid] = expect
                    stats["resets"] += reset
                stats["direct"] += 1
            check_all()
            continue

        entries = []
        for k in range(rng.choice([0, 0, 1, 1, 2, 3])):  # admitted: reset, the whole table
            blocks = [rng.randrange(1000) for _ in range(rng.randint(1, 3))]
            entries.append((f"r{step}.{k}", blocks, True))
        for rid in sorted(model):
            if rid in finished or rng.random() < 0.3:
                continue  # finished, or running but not scheduled this step
            if rng.random() < 0.1:  # re-admitted after a preemption: starts over
                entries.append((rid, [rng.randrange(1000) for _ in range(rng.randint(1, 3))], True))
            else:  # grows (0 blocks: a step inside its last block)
                room = width - len(model[rid])
                n = rng.choice([0, 0, 1, 1, 2])
                entries.append((rid, [rng.randrange(1000) for _ in range(min(n, room))], False))
        rng.shuffle(entries)
        if not entries:
            continue
        batch = make_batch(entries, finished)
        rows = mirror.apply(batch)
        for rid in finished:
            del model[rid]
            released_rows.add(rows_of.pop(rid))
        finished = []
        for (rid, blocks, reset), row in zip(entries, rows.tolist()):
            model[rid] = list(blocks) if reset else model[rid] + blocks
            stats["resets"] += reset and rid in rows_of
            if rid in rows_of:
                assert row == rows_of[rid], "a live request keeps its row"
            else:
                stats["reused_rows"] += row in released_rows
                rows_of[rid] = row
        assert rows.dtype == np.int64 and len(set(rows.tolist())) == len(rows)
        assert len(set(rows_of.values())) == len(rows_of), "live requests have distinct rows"
        need = max(1, max(len(model[rid]) for rid, _, _ in entries))
        got = mirror.gather(rows, need)
        assert got.dtype == np.int32 and got.shape == (len(entries), need)
        for i, (rid, _, _) in enumerate(entries):
            assert got[i, : len(model[rid])].tolist() == model[rid]
        check_all()
        # some requests finish: released through the next batch
        finished = [rid for rid in sorted(model) if rng.random() < 0.1]
        # a request over the width: the append fails and its row is left as it was
        if rng.random() < 0.1 and model:
            rid = rng.choice(sorted(model))
            before = mirror_blocks(mirror, rid)
            with pytest.raises(ValueError):
                mirror.apply(make_batch([(rid, [7] * (width + 1 - len(model[rid])), False)]))
            assert mirror_blocks(mirror, rid) == before
            stats["width_errors"] += 1
    assert stats["max_live"] > 2 and mirror.table.shape[0] > 2, "rows grew beyond initial_rows"
    assert stats["width_errors"] > 0 and stats["resets"] > 0 and stats["direct"] > 0
    assert stats["released"] > 0 and stats["reused_rows"] > 0


def test_apply_releases_finished_rows_before_appending():
    mirror = PersistentBlockTables(4, initial_rows=1)
    rows = mirror.apply(make_batch([("a", [1, 2], True)]))
    assert rows.tolist() == [0] and mirror_blocks(mirror, "a") == [1, 2]
    # a finishes; b is admitted in the next batch and takes a's row (no growth needed)
    rows = mirror.apply(make_batch([("b", [3], True)], finished=["a"]))
    assert rows.tolist() == [0] and mirror.table.shape[0] == 1
    assert (
        mirror_blocks(mirror, "a") == [] and mirror_blocks(mirror, "b") == [3] and len(mirror) == 1
    )
    # an id finished and reused in the same batch starts over
    rows = mirror.apply(make_batch([("b", [5, 6], True)], finished=["b"]))
    assert mirror_blocks(mirror, "b") == [5, 6] and len(mirror) == 1
    # a request not reset with no new blocks keeps its row and table
    assert mirror.apply(make_batch([("b", [], False)])).tolist() == rows.tolist()
    assert mirror_blocks(mirror, "b") == [5, 6]
    # a reset with an empty list empties the row; the release of an unknown id is a no-op
    mirror.apply(make_batch([("b", [], True)]))
    assert mirror_blocks(mirror, "b") == []
    mirror.append("b", [4])
    mirror.append("b", [], reset=True)
    assert mirror_blocks(mirror, "b") == []
    mirror.release("never")
    assert len(mirror) == 1


def test_too_many_blocks_and_bad_sizes_raise():
    with pytest.raises(ValueError):
        PersistentBlockTables(0)
    with pytest.raises(ValueError):
        PersistentBlockTables(4, initial_rows=0)
    mirror = PersistentBlockTables(2)
    with pytest.raises(ValueError):
        mirror.append("x", [1, 2, 3])
    assert mirror_blocks(mirror, "x") == []
    with pytest.raises(ValueError):
        mirror.apply(make_batch([("y", [1, 2, 3], True)]))
    mirror.append("z", [1, 2])
    with pytest.raises(ValueError):
        mirror.append("z", [3])
    assert mirror_blocks(mirror, "z") == [1, 2]
    mirror.append("z", [3], reset=True)  # a reset counts from the start of the row
    assert mirror_blocks(mirror, "z") == [3]
    assert isinstance(mirror.gather(np.zeros(0, dtype=np.int64), 1), np.ndarray)
