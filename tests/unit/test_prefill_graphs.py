"""Prefill/mixed-step CUDA graphs (engine/worker/cuda_graph.py): the capture sizes, and the padded
forward a graph replays -- run eagerly on the CPU -- giving the same tokens, logprobs and block
accounting as unpadded steps, with chunked prefill, prefix-cache hits and async scheduling."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from engine.core.config import EngineConfig
from engine.core.request import SamplingParams
from engine.worker.build import build_engine
from engine.worker.cuda_graph import PrefillGraphs, prefill_capture_sizes


@pytest.mark.parametrize("max_tokens", [1, 16, 17, 100, 512, 2048, 3000, 8192, 20000])
def test_capture_sizes_cover_every_step_with_bounded_padding(max_tokens):
    sizes = prefill_capture_sizes(max_tokens)
    assert sizes == sorted(set(sizes)) and all(s % 16 == 0 for s in sizes)
    assert sizes[-1] >= max_tokens and sizes[-1] - max_tokens < 16
    for t in range(1, max_tokens + 1, 7):
        padded = next(s for s in sizes if s >= t)
        assert padded <= max(64, 1.25 * t + 16), (t, padded)


def _engine(path, async_scheduling, graphs: bool, budget: int, max_seqs: int = 6):
    cfg = EngineConfig(
        model=path,
        block_size=8,
        num_kv_blocks=96,
        max_num_seqs=max_seqs,
        max_num_batched_tokens=budget,
        async_scheduling=async_scheduling,
    )
    eng = build_engine(cfg, eos_token_ids=frozenset())
    if (
        graphs
    ):  # what the runner builds on CUDA; without CUDA, run() executes the padded forward eagerly
        r = eng.executor
        g = PrefillGraphs(
            r.model,
            r.kv_caches,
            budget,
            cfg.max_num_seqs,
            r.block_tables.width,
            r.cache_info.max_model_len,
            r.device,
        )
        # stale values from "earlier steps" everywhere: a step must overwrite all it relies on
        gen = torch.Generator().manual_seed(0)
        s = g.inputs
        s.input_ids.random_(0, 384, generator=gen)
        s.positions.random_(
            0, r.cache_info.max_model_len, generator=gen
        )  # earlier steps: valid positions
        s.slot_mapping.random_(0, cfg.num_kv_blocks * cfg.block_size, generator=gen)
        s.block_tables.random_(0, cfg.num_kv_blocks, generator=gen)
        s.seq_lens.random_(1, 40, generator=gen)
        s.cu_seqlens_q.copy_(torch.arange(s.cu_seqlens_q.numel()) * 3)
        s.logits_indices.random_(0, g.sizes[0], generator=gen)
        r.prefill_graphs = g
    return eng


def _run(eng, requests):
    for rid, prompt, params in requests:
        eng.add_request(rid, prompt, params)
    tokens = {rid: [] for rid, _, _ in requests}
    logprobs = {rid: [] for rid, _, _ in requests}
    steps = 0
    while eng.has_unfinished():
        outs, _ = eng.step()
        steps += 1
        eng.kv_cache_manager.check_integrity()
        for o in outs:
            tokens[o.request_id] += o.new_token_ids
            logprobs[o.request_id] += o.logprobs
        assert steps < 2000
    assert eng.kv_cache_manager.num_free_blocks == eng.kv_cache_manager.num_blocks
    return tokens, logprobs


@pytest.mark.parametrize(
    "async_scheduling,max_seqs",
    [(False, 6), (True, 6), (False, 24)],
    ids=["sync", "async", "narrow"],
)
def test_padded_graph_steps_equal_eager_steps(
    tiny_checkpoint, one_torch_thread, async_scheduling, max_seqs
):
    """max_seqs 24: sizes of 32 and 48 tokens also have narrow graphs (16 sequence slots); the
    10 requests replay them (on the CPU through the torch backend: the padding of the narrow
    slots is what is checked here; the Triton backend's split choice is in
    tests/kernels/test_triton_backend.py)."""
    path, _ = tiny_checkpoint
    rng = random.Random(11)
    shared = [rng.randrange(384) for _ in range(40)]  # a prefix several prompts share (cache hits)
    requests = []
    for i in range(10):
        tail = [rng.randrange(384) for _ in range(rng.randint(1, 70))]
        prompt = shared + tail if i % 3 == 0 else tail
        params = SamplingParams(
            temperature=rng.choice([0.0, 0.8]), seed=i, max_tokens=rng.randint(1, 12), logprobs=2
        )
        requests.append((f"r{i}", prompt, params))
    # budget 40: long prompts are chunked and chunks mix with decodes; 40 is not a capture size
    eager = _run(
        _engine(path, async_scheduling, graphs=False, budget=40, max_seqs=max_seqs), requests
    )
    eng = _engine(path, async_scheduling, graphs=True, budget=40, max_seqs=max_seqs)
    calls, keys = [], []
    graphs = eng.executor.prefill_graphs
    run, run_key = graphs.run, graphs._run
    graphs.run = lambda step: calls.append(step.num_tokens) or run(step)
    graphs._run = lambda key: keys.append(key) or run_key(key)
    got = _run(eng, requests)
    assert any(s == 16 for _, s, _ in keys) == (max_seqs > 16)
    assert any(s == 1 for _, s, _ in keys)  # one-sequence steps replayed the lone graphs
    assert got[0] == eager[0]
    for rid in got[1]:
        for a, b in zip(got[1][rid], eager[1][rid], strict=True):
            assert a[0] == pytest.approx(b[0], abs=1e-4)  # the sampled token's logprob
            assert [i for i, _ in a[1]] == [i for i, _ in b[1]]  # the top alternatives
            assert [x for _, x in a[1]] == pytest.approx([x for _, x in b[1]], abs=1e-4)
    assert calls and max(calls) > 16 and min(calls) < 16  # several padded sizes were replayed
    assert eng.kv_cache_manager.prefix_hits > 0  # some steps attended to a cached prefix


def test_narrow_graphs_take_steps_of_few_sequences():
    g = PrefillGraphs(None, None, 1024, 256, 4, 40960, torch.device("cpu"))
    assert [k for k in g.keys if k[0] == 16] == [(16, 1, False), (16, 16, False)]  # no twin
    assert (32, 16, False) in g.keys
    assert (1024, 16, False) in g.keys
    assert g.keys[-1] == (1024, 256, False)  # captured first (reversed), the pool's largest
    assert g.key(1000, 2, 40000) == (1024, 16, False)
    assert g.key(1000, 17, 40000) == (1024, 256, False)
    assert g.key(10, 3, 40000) == (16, 16, False)  # 16 tokens have 16 slots anyway
    few = PrefillGraphs(None, None, 64, 8, 4, 4096, torch.device("cpu"))
    assert {s for _, s, _ in few.keys} == {1, 8}  # nothing narrow between one slot and 8
    assert not any(short for _, _, short in few.keys)


def test_lone_graphs_take_steps_of_one_sequence():
    """Every size has a one-slot twin, which a step of one sequence replays (whatever its
    context); the narrow graphs then hold the steps of 2..16 sequences."""
    g = PrefillGraphs(None, None, 1024, 256, 4, 40960, torch.device("cpu"))
    assert all((t, 1, False) in g.keys for t in g.sizes)
    assert g.key(1000, 1, 40000) == (1024, 1, False)
    assert g.key(1000, 1, 100) == (1024, 1, False)
    assert g.key(10, 1, 100) == (16, 1, False)
    assert g.key(10, 2, 100) == (16, 16, False)
    assert g.key(1000, 2, 100) == (1024, 16, False)
    # captured last: the lone graphs first in the list
    assert {s for _, s, _ in g.keys[: len(g.sizes)]} == {1}
    # a size equal to the model length has none (its warm-up would take the cuDNN path)
    at_len = PrefillGraphs(None, None, 1024, 256, 4, 1024, torch.device("cpu"))
    assert (1024, 1, False) not in at_len.keys and (896, 1, False) in at_len.keys
    assert at_len.key(1000, 1, 1000) == (1024, 16, False)
    one = PrefillGraphs(None, None, 64, 1, 4, 4096, torch.device("cpu"))
    assert one.keys == [(t, 1, False) for t in one.sizes]  # max_num_seqs 1: the wide graphs


def test_short_twins_take_wide_steps_of_short_contexts(monkeypatch):
    """A wide step whose contexts fit UNSPLIT_MAX_KEYS replays the short twin, captured as if
    that were the model length, so its prefill launch runs unsplit; a longer context, a narrow
    step, or a model length within the bound keeps the graphs of before."""
    from kernels.prefill_split import UNSPLIT_MAX_KEYS, prefill_num_splits

    g = PrefillGraphs(None, None, 1024, 256, 4, 40960, torch.device("cpu"))
    assert (32, 32, True) in g.keys and (1024, 256, True) in g.keys
    assert (16, 16, True) not in g.keys  # 16 slots: the unsplit rule does not apply
    assert g.key(320, 65, UNSPLIT_MAX_KEYS) == (320, 256, True)
    assert g.key(320, 65, UNSPLIT_MAX_KEYS + 1) == (320, 256, False)
    assert g.key(320, 5, 100) == (320, 16, False)
    seen = []
    monkeypatch.setattr(
        g.inputs, "metadata", lambda t, s, q, max_len: seen.append((t, s, max_len)) or 1 / 0
    )
    for key, want in (((320, 256, True), UNSPLIT_MAX_KEYS), ((320, 256, False), 40960)):
        with pytest.raises(ZeroDivisionError):
            g._run(key)
        assert seen.pop() == (320, 256, want)
    # the rule the twin exists for: many slots within the bound -> no split; few slots, or
    # keys past it -> the wave model's choice (made 8 here)
    import kernels.prefill_split as ps

    monkeypatch.setattr(ps, "choose_prefill_splits", lambda *a, **kw: 8)
    args = (320, 16, 128, torch.bfloat16, torch.device("cpu"))
    assert prefill_num_splits(*args, UNSPLIT_MAX_KEYS, 132, num_seqs=256) == 1
    assert prefill_num_splits(*args, UNSPLIT_MAX_KEYS + 1, 132, num_seqs=256) == 8
    assert prefill_num_splits(*args, UNSPLIT_MAX_KEYS, 132, num_seqs=16) == 8
    assert not any(short for _, _, short in PrefillGraphs(
        None, None, 1024, 256, 4, UNSPLIT_MAX_KEYS, torch.device("cpu")).keys)  # fmt: skip


def test_padding_rows_store_nothing(tiny_checkpoint, one_torch_thread):
    """A step padded from 5 to 16 tokens writes exactly its 5 slots of the KV cache."""
    path, _ = tiny_checkpoint
    eng = _engine(path, False, graphs=True, budget=64)
    r = eng.executor
    before = [k.clone() for k, _ in r.kv_caches]
    eng.add_request("a", [1, 2, 3, 4, 5], SamplingParams(max_tokens=1))
    while eng.has_unfinished():
        eng.step()
    for (k, _), k0 in zip(r.kv_caches, before):
        changed = (k != k0).reshape(k.shape[0] * k.shape[1], -1).any(-1)  # per cache slot
        assert int(changed.sum()) == 5


def test_graph_inputs_copy_from_pads_decode_and_prefill_steps():
    """``GraphInputs.copy_from`` over stale buffers: every entry a padded step reads is rewritten
    (decode: padding rows store nothing and attend one token of block 0; prefill: padding tokens
    lie past ``cu_seqlens_q[B]`` and padding sequences have no tokens)."""
    from engine.worker.cuda_graph import GraphInputs
    from engine.worker.step_inputs import StepTensors

    g = torch.Generator().manual_seed(5)
    gi = GraphInputs(32, 8, 6, torch.device("cpu"))
    for t in (gi.input_ids, gi.positions, gi.slot_mapping, gi.logits_indices):
        t.random_(0, 999, generator=g)
    gi.block_tables.random_(0, 99, generator=g)
    gi.seq_lens.random_(1, 99, generator=g)
    gi.cu_seqlens_q.random_(0, 99, generator=g)

    def step(t, b, n):
        return StepTensors(
            input_ids=torch.arange(t),
            positions=torch.arange(t) + 10,
            slot_mapping=torch.arange(t) + 100,
            block_tables=torch.arange(b * 2, dtype=torch.int32).view(b, 2),
            seq_lens=torch.arange(1, b + 1, dtype=torch.int32),
            cu_seqlens_q=torch.linspace(0, t, b + 1).to(torch.int32),
            logits_indices=torch.arange(n),
            max_query_len=t,
            max_seq_len=64,
        )

    gi.copy_from(step(3, 3, 3), 4, 4, decode=True)
    assert gi.input_ids[:3].tolist() == [0, 1, 2] and gi.slot_mapping[:4].tolist() == [
        100,
        101,
        102,
        -1,
    ]
    assert gi.block_tables[3].tolist() == [0] * 6 and gi.seq_lens[:4].tolist() == [1, 2, 3, 1]
    assert gi.block_tables[:3, :2].flatten().tolist() == list(range(6))
    meta = gi.metadata(4, 4, 1, 64)
    assert meta.is_decode and meta.seq_lens.shape == (4,)

    s = step(10, 3, 2)
    gi.copy_from(s, 16, 8, decode=False)
    assert gi.slot_mapping[:16].tolist() == list(range(100, 110)) + [-1] * 6
    assert gi.cu_seqlens_q[:4].tolist() == s.cu_seqlens_q.tolist()
    assert gi.cu_seqlens_q[4:9].tolist() == [10] * 5  # padding sequences: no tokens
    assert gi.logits_indices[:8].tolist() == [0, 1] + [0] * 6
    assert not gi.metadata(16, 8, 16, 64).is_decode


@pytest.mark.parametrize("max_seqs", [8, 37])
def test_graph_inputs_stage_decode_as_copy_from(max_seqs):
    """``GraphInputs.stage_decode`` (a decode step's host arrays straight into the buffers)
    leaves every entry a padded decode graph reads as ``copy_from`` of the staged step does,
    over stale buffers, with tokens in flight read from the previous step's samples; padding
    rows get ids and positions 0. The buffers keep their addresses (the graphs read them) and
    each starts on a 16-byte boundary."""
    from engine.worker.cuda_graph import GraphInputs, capture_sizes
    from engine.worker.staging import HostStaging
    from engine.worker.step_inputs import StepInputs

    cpu = torch.device("cpu")
    width = 6
    staged, copied = (GraphInputs(max_seqs, max_seqs, width, cpu) for _ in range(2))
    g = torch.Generator().manual_seed(3)
    for gi in (staged, copied):
        gi.longs.random_(0, 999, generator=g)
        gi.ints.random_(0, 99, generator=g)
    ptrs = [t.data_ptr() for t in (staged.input_ids, staged.slot_mapping, staged.block_tables)]
    for t in (staged.input_ids, staged.positions, staged.slot_mapping, staged.seq_lens):
        assert t.data_ptr() % 16 == 0
    assert staged.block_tables.data_ptr() % 16 == 0
    staging = HostStaging(cpu)
    rng = np.random.default_rng(4)
    sizes = capture_sizes(max_seqs)
    for _ in range(30):
        staging.next_step()
        b = int(rng.integers(1, max_seqs + 1))
        bs = next(s for s in sizes if s >= b)
        m = int(rng.integers(1, width + 1))
        prev = torch.from_numpy(rng.integers(0, 1000, size=int(rng.integers(1, 9))))
        flight = rng.random(b) < 0.5
        inp = StepInputs(
            input_ids=np.where(flight, 0, rng.integers(0, 1000, size=b)).astype(np.int64),
            positions=rng.integers(0, 64, size=b).astype(np.int64),
            slot_mapping=rng.integers(0, 500, size=b).astype(np.int64),
            block_tables=rng.integers(0, 99, size=(b, m)).astype(np.int32),
            seq_lens=rng.integers(1, 64, size=b).astype(np.int32),
            cu_seqlens_q=np.arange(b + 1, dtype=np.int32),
            logits_indices=np.arange(b, dtype=np.int64),
            sample_requests=[],
            max_query_len=1,
            max_seq_len=64,
        )
        if flight.any():
            inp.gather_dst = np.flatnonzero(flight).astype(np.int64)
            inp.gather_src = rng.integers(0, len(prev), size=len(inp.gather_dst))
        staged.stage_decode(inp, bs, staging, prev)
        copied.copy_from(inp.to_device(staging, prev), bs, bs, decode=True)
        assert staged.input_ids[:b].tolist() == copied.input_ids[:b].tolist()
        assert staged.positions[:b].tolist() == copied.positions[:b].tolist()
        assert staged.input_ids[b:bs].tolist() == staged.positions[b:bs].tolist() == [0] * (bs - b)
        assert staged.slot_mapping[:bs].tolist() == copied.slot_mapping[:bs].tolist()
        assert staged.seq_lens[:bs].tolist() == copied.seq_lens[:bs].tolist()
        assert staged.block_tables[:b, :m].tolist() == copied.block_tables[:b, :m].tolist()
        assert staged.block_tables[b:bs].tolist() == copied.block_tables[b:bs].tolist()
    assert ptrs == [
        t.data_ptr() for t in (staged.input_ids, staged.slot_mapping, staged.block_tables)
    ]
    inp.gather_dst, inp.gather_src = np.zeros(1, np.int64), np.zeros(1, np.int64)
    with pytest.raises(ValueError, match="in flight"):
        staged.stage_decode(inp, bs, staging, None)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_decode_graph_steps_from_staged_inputs_equal_eager_steps(
    tiny_checkpoint, one_torch_thread, async_scheduling
):
    """Decode steps through ``DecodeGraphs.run_inputs`` (inputs staged straight into stale graph
    buffers, padded to a captured size, tokens in flight gathered on the device; the padded
    forward run eagerly on the CPU) give the eager engine's tokens and logprobs while requests
    join and leave (batch sizes 1..6 padded to 1, 2, 4, 8)."""
    from engine.worker.cuda_graph import DecodeGraphs

    path, _ = tiny_checkpoint
    rng = random.Random(12)
    requests = []
    for i in range(9):
        prompt = [rng.randrange(384) for _ in range(rng.randint(1, 30))]
        params = SamplingParams(
            temperature=rng.choice([0.0, 0.8]), seed=i, max_tokens=rng.randint(2, 14), logprobs=1
        )
        requests.append((f"d{i}", prompt, params))
    eager = _run(_engine(path, async_scheduling, graphs=False, budget=64), requests)
    eng = _engine(path, async_scheduling, graphs=False, budget=64)
    r = eng.executor
    graphs = DecodeGraphs(
        r.model,
        r.kv_caches,
        eng.config.max_num_seqs,
        r.block_tables.width,
        r.cache_info.max_model_len,
    )
    gen = torch.Generator().manual_seed(1)  # stale values from "earlier steps"
    graphs.inputs.block_tables.random_(0, eng.config.num_kv_blocks, generator=gen)
    graphs.inputs.input_ids.random_(0, 384, generator=gen)
    r.graphs = graphs
    calls = []
    run_inputs = graphs.run_inputs
    graphs.run_inputs = lambda inp, *a: calls.append(len(inp.seq_lens)) or run_inputs(inp, *a)
    got = _run(eng, requests)
    assert got[0] == eager[0]
    for rid in got[1]:
        for a, b in zip(got[1][rid], eager[1][rid], strict=True):
            assert a[0] == pytest.approx(b[0], abs=1e-4)
            assert [i for i, _ in a[1]] == [i for i, _ in b[1]]
    assert len(set(calls)) >= 3 and 1 in calls  # several batch sizes, padded and not
