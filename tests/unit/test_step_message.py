"""The pieces of a tensor-parallel step message: block-table changes replayed on the other ranks'
tables, the message's encoding, and the control channel's two-broadcast path for long
messages (two gloo processes)."""

from __future__ import annotations

import multiprocessing as mp
import random

import numpy as np
import pytest

from engine.worker.block_table import PersistentBlockTables, RowBlockTables
from engine.worker.step_inputs import StepInputs
from engine.worker.step_message import SHUTDOWN, decode_step, encode_shutdown, encode_step


@pytest.mark.parametrize("seed", range(3))
def test_changes_replayed_give_the_same_tables(seed):
    """Random appends, resets, releases and row reuse on rank 0's mirror; the other ranks'
    tables, written only from take_changes, hold the same block ids in every live row."""
    rng = random.Random(seed)
    width = 10
    first = PersistentBlockTables(width, initial_rows=2, record_changes=True)
    other = RowBlockTables(width, initial_rows=1)
    live: dict[str, int] = {}  # request id -> blocks
    for step in range(200):
        op = rng.random()
        if op < 0.2 and live:
            rid = rng.choice(sorted(live))
            first.release(rid)
            del live[rid]
        elif op < 0.3 and live:
            rid = rng.choice(sorted(live))
            n = rng.randint(1, width)
            first.append(rid, [rng.randrange(1000) for _ in range(n)], reset=True)
            live[rid] = n
        else:
            rid = rng.choice(sorted(live)) if live and rng.random() < 0.6 else f"r{step}"
            n = rng.randint(0 if rid in live else 1, min(3, width - live.get(rid, 0)))
            first.append(rid, [rng.randrange(1000) for _ in range(n)])
            live[rid] = live.get(rid, 0) + n
        other.apply(*first.take_changes())
        for rid, n in live.items():
            row = np.array([first._rows[rid]])
            assert other.gather(row, n).tolist() == first.gather(row, n).tolist()


def _inputs(rng: np.random.Generator, t: int, b: int, prompt: int) -> StepInputs:
    cu = np.concatenate([[0], np.sort(rng.choice(np.arange(1, t), b - 1, replace=False)), [t]])
    return StepInputs(
        input_ids=rng.integers(0, 500, t),
        positions=rng.integers(0, 500, t),
        slot_mapping=rng.integers(-1, 500, t),
        block_tables=np.zeros((b, 4), dtype=np.int32),
        seq_lens=rng.integers(1, 64, b).astype(np.int32),
        cu_seqlens_q=cu.astype(np.int32),
        logits_indices=(cu[1:] - 1).astype(np.int64),
        sample_requests=[],
        max_query_len=7,
        max_seq_len=63,
        gather_dst=np.array([0, 2], dtype=np.int64),
        gather_src=np.array([1, 0], dtype=np.int64),
        table_rows=rng.permutation(b).astype(np.int64),
        prompt_rows=np.arange(prompt, dtype=np.int64) if prompt else None,
        prompt_targets=rng.integers(0, 500, prompt) if prompt else None,
    )


@pytest.mark.parametrize("prompt", [0, 5])
def test_encode_decode_round_trip(prompt):
    rng = np.random.default_rng(prompt)
    inp = _inputs(rng, 40, 6, prompt)
    first = PersistentBlockTables(4, record_changes=True)
    for i in range(6):
        first.append(f"r{i}", [10 * i + 1, 10 * i + 2, 10 * i + 3, 10 * i + 4])
    inp.block_tables = first.gather(inp.table_rows, 4)
    msg = encode_step(inp, first.take_changes())
    got = decode_step(msg, RowBlockTables(4))
    for name in (
        "input_ids",
        "positions",
        "slot_mapping",
        "block_tables",
        "seq_lens",
        "cu_seqlens_q",
        "logits_indices",
        "gather_dst",
        "gather_src",
        "table_rows",
        "prompt_rows",
        "prompt_targets",
    ):
        a, b = getattr(inp, name), getattr(got, name)
        assert (a is None and b is None) or a.tolist() == b.tolist(), name
    assert (got.max_query_len, got.max_seq_len) == (7, 63)
    with pytest.raises(ValueError, match="header says"):
        decode_step(msg[:-1], RowBlockTables(4))
    with pytest.raises(ValueError, match="not a step message"):
        decode_step(encode_shutdown(), RowBlockTables(4))


def _channel_peer(init: str, inline: int, out) -> None:
    import torch.distributed as dist

    from engine.worker.control_channel import ControlChannel

    dist.init_process_group("gloo", init_method=init, rank=1, world_size=2)
    channel = ControlChannel(dist.group.WORLD, 1, inline)
    got = []
    while True:
        msg = channel.recv()
        got.append(msg.tolist())
        if msg[0] == SHUTDOWN:
            break
    out.put(got)
    dist.destroy_process_group()


def test_control_channel_short_and_long_messages():
    import torch.distributed as dist

    from engine.worker.control_channel import ControlChannel
    from engine.worker.parallel_state import free_loopback_init_method

    init, inline = free_loopback_init_method(), 64
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    peer = ctx.Process(target=_channel_peer, args=(init, inline, out), daemon=True)
    peer.start()
    dist.init_process_group("gloo", init_method=init, rank=0, world_size=2)
    try:
        channel = ControlChannel(dist.group.WORLD, 0, inline)
        rng = np.random.default_rng(0)
        msgs = []
        for n in (2, 20, 1000):  # 2 tokens fit the 64-value inline buffer, the others do not
            inp = _inputs(rng, n, min(3, n), 0)
            msgs.append(encode_step(inp, (np.zeros(0, np.int64),) * 3))
        msgs.append(encode_shutdown())
        assert len(msgs[0]) <= inline < len(msgs[1])
        for m in msgs:
            channel.send(m)
        got = out.get(timeout=60)
    finally:
        dist.destroy_process_group()
        peer.join(30)
    assert got == [m.tolist() for m in msgs]
