"""Async scheduling (step N+1 scheduled and launched before step N's samples reach the host):
same tokens as synchronous steps, stops and aborts with a token in flight, exact block accounting."""

from __future__ import annotations

import random

import pytest
import torch

from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.request import FinishReason, SamplingParams


def _engine(path, async_scheduling, eos=frozenset(), **kw):
    cfg = dict(model=path, block_size=8, num_kv_blocks=64, max_num_seqs=8, max_num_batched_tokens=48,
               async_scheduling=async_scheduling)
    cfg.update(kw)
    return LLMEngine(EngineConfig(**cfg), eos_token_ids=eos)


def _run(eng, requests):
    """Add all requests, step to the end; returns ({id: tokens}, {id: finish reason}, steps)."""
    for rid, prompt, params in requests:
        eng.add_request(rid, prompt, params)
    tokens = {rid: [] for rid, _, _ in requests}
    reasons, steps = {}, 0
    while eng.has_unfinished():
        outs, stats = eng.step()
        steps += 1
        eng.block_manager.check_integrity()
        for o in outs:
            assert o.request_id not in reasons, "output after the last one"
            tokens[o.request_id] += o.new_token_ids
            if o.finished:
                reasons[o.request_id] = o.finish_reason
        assert steps < 1000
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks
    assert not eng.requests and eng._in_flight is None
    return tokens, reasons, steps


def test_async_equals_sync_for_greedy_seeded_and_mixed_lengths(tiny_checkpoint):
    path, _ = tiny_checkpoint
    rng = random.Random(3)
    requests = []
    for i in range(12):
        prompt = [rng.randrange(384) for _ in range(rng.randint(1, 60))]
        params = SamplingParams(temperature=rng.choice([0.0, 0.9]), seed=i, max_tokens=rng.randint(1, 20),
                                logprobs=rng.choice([None, 2]))
        requests.append((f"r{i}", prompt, params))
    sync = _run(_engine(path, False), requests)
    eng = _engine(path, True)
    got = _run(eng, requests)
    assert got[0] == sync[0] and got[1] == sync[1]
    assert all(len(got[0][rid]) == p.max_tokens for rid, _, p in requests)


def test_eos_stop_with_the_next_step_in_flight(tiny_checkpoint):
    """A request stopping on EOS was already scheduled again: nothing after the EOS is emitted,
    its extra row is dropped and its blocks are freed."""
    path, _ = tiny_checkpoint
    prompt = torch.randint(0, 384, (20,), generator=torch.Generator().manual_seed(1)).tolist()
    free_run = _engine(path, False).generate([prompt], SamplingParams(temperature=0.0, max_tokens=12,
                                                                      ignore_eos=True))[0]
    eos = free_run[4]  # greedy token at output index 4 becomes the EOS id
    first = free_run.index(eos)
    for async_scheduling in (False, True):
        eng = _engine(path, async_scheduling, eos=frozenset([eos]))
        tokens, reasons, _ = _run(eng, [("a", prompt, SamplingParams(temperature=0.0, max_tokens=12)),
                                       ("b", prompt[:7], SamplingParams(temperature=0.0, max_tokens=12,
                                                                        ignore_eos=True))])
        assert tokens["a"] == free_run[: first + 1] and reasons["a"] == FinishReason.STOP
        assert len(tokens["b"]) == 12 and reasons["b"] == FinishReason.LENGTH


def test_abort_with_a_token_in_flight(tiny_checkpoint):
    path, _ = tiny_checkpoint
    eng = _engine(path, True)
    eng.add_request("x", list(range(10)), SamplingParams(temperature=0.0, max_tokens=50))
    eng.add_request("y", list(range(5, 30)), SamplingParams(temperature=0.0, max_tokens=6))
    seen = {"x": [], "y": []}
    for _ in range(4):
        for o in eng.step()[0]:
            seen[o.request_id] += o.new_token_ids
    assert eng._in_flight is not None and eng.requests["x"].num_output_placeholders == 1
    assert eng.abort("x")
    eng.block_manager.check_integrity()
    while eng.has_unfinished():
        for o in eng.step()[0]:
            assert o.request_id == "y"
            seen["y"] += o.new_token_ids
    assert len(seen["y"]) == 6
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_penalties_and_min_tokens_run_synchronously(tiny_checkpoint, async_scheduling):
    """Sampling that reads host state (penalties, min_tokens) drains the step in flight first,
    so it sees every earlier token: results equal the synchronous engine's."""
    path, _ = tiny_checkpoint
    prompt = list(range(3, 40))
    reqs = [("p", prompt, SamplingParams(temperature=0.0, max_tokens=10, frequency_penalty=1.5)),
            ("m", prompt[:9], SamplingParams(temperature=0.0, max_tokens=10, min_tokens=6)),
            ("g", prompt[:20], SamplingParams(temperature=0.0, max_tokens=10))]
    ref = _run(_engine(path, False, eos=frozenset([7])), reqs)
    got = _run(_engine(path, async_scheduling, eos=frozenset([7])), reqs)
    assert got[:2] == ref[:2]
