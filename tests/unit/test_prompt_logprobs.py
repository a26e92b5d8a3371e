"""Prompt log-probabilities computed in the prefill, against transformers' float32 forward:
chunked prefill, prefix caching, preemption, async scheduling, ``max_tokens=0``, and no extra
rows for requests that do not ask."""

from __future__ import annotations

import random

import pytest
import torch

from engine.core.config import EngineConfig
from engine.core.request import FinishReason, SamplingParams
from engine.worker import prompt_logprobs as plp_module
from engine.worker.build import build_engine
from engine.worker.step_inputs import prepare_inputs


def _engine(path, **kw):
    cfg = dict(
        model=path,
        block_size=8,
        num_kv_blocks=128,
        max_num_seqs=8,
        max_num_batched_tokens=16,
        async_scheduling=False,
    )
    cfg.update(kw)
    return build_engine(EngineConfig(**cfg), eos_token_ids=frozenset())


def _run(eng, requests, max_steps=2000):
    """Add (id, prompt, params) requests, step to the end; returns {id: [outputs]}."""
    for rid, prompt, params in requests:
        eng.add_request(rid, prompt, params)
    outs = {rid: [] for rid, _, _ in requests}
    steps = 0
    while eng.has_unfinished():
        got, _ = eng.step()
        for o in got:
            outs[o.request_id].append(o)
        steps += 1
        eng.kv_cache_manager.check_integrity()
        assert steps < max_steps
    assert eng.kv_cache_manager.num_free_blocks == eng.kv_cache_manager.num_blocks
    return outs


def _reference(hf, prompt: list[int]) -> torch.Tensor:
    """transformers' float32 log-probabilities ``[P, vocab]`` of each position's next token."""
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), dim=-1)


def _check(entries, ref: torch.Tensor, prompt: list[int], k: int) -> None:
    assert len(entries) == len(prompt) - 1
    for j, (lp, rank, alts) in enumerate(entries):
        row = ref[j]
        tok = prompt[j + 1]
        assert abs(lp - row[tok].item()) < 1e-4, f"position {j}: {lp} vs {row[tok].item()}"
        assert rank == int((row > row[tok]).sum()) + 1
        top_v, top_i = row.topk(k)
        assert [i for i, _ in alts] == top_i.tolist()
        assert max(abs(a - b) for (_, a), b in zip(alts, top_v.tolist())) < 1e-4 if k else True


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_prompt_logprobs_match_transformers_with_chunks_and_prefix_cache(
    tiny_checkpoint, async_scheduling
):
    """Prompts spread over several 16-token steps, mixed with requests that do not ask; a second
    request over an already cached prompt still scores every position."""
    path, hf = tiny_checkpoint
    eng = _engine(path, async_scheduling=async_scheduling)
    rng = random.Random(5)
    shared = [rng.randrange(384) for _ in range(41)]
    prompts = {
        "one": [rng.randrange(384)],
        "two": [rng.randrange(384) for _ in range(2)],
        "long": [rng.randrange(384) for _ in range(53)],
        "shared": shared,
        "plain": [rng.randrange(384) for _ in range(30)],
    }
    ks = {"one": 2, "two": 0, "long": 3, "shared": 5}
    reqs = [
        (rid, p, SamplingParams(temperature=0.0, max_tokens=3, prompt_logprobs=ks.get(rid)))
        for rid, p in prompts.items()
    ]
    outs = _run(eng, reqs)
    for rid, p in prompts.items():
        first = outs[rid][0]
        if rid == "plain":
            assert all(o.prompt_logprobs is None for o in outs[rid])
            continue
        assert all(o.prompt_logprobs is None for o in outs[rid][1:]), "sent once"
        _check(first.prompt_logprobs, _reference(hf, p), p, ks[rid])
        assert sum(len(o.new_token_ids) for o in outs[rid]) == 3

    # the shared prompt is in the prefix cache now: a plain request takes the hits, a scoring
    # one takes none (and makes no lookup), and scores the same values
    kv = eng.kv_cache_manager
    q0, h0 = kv.prefix_queries, kv.prefix_hits
    again = _run(
        eng,
        [
            ("plain-again", shared, SamplingParams(temperature=0.0, max_tokens=2)),
            ("score-again", shared, SamplingParams(max_tokens=2, prompt_logprobs=5)),
        ],
    )
    assert again["plain-again"][0].num_cached_tokens == 40  # 5 full blocks
    assert again["score-again"][0].num_cached_tokens == 0
    assert kv.prefix_queries - q0 == 41 and kv.prefix_hits - h0 == 40
    _check(again["score-again"][0].prompt_logprobs, _reference(hf, shared), shared, 5)


def test_score_only_with_max_tokens_zero(tiny_checkpoint):
    path, hf = tiny_checkpoint
    eng = _engine(path, async_scheduling=True)
    prompt = list(range(7, 47))
    outs = _run(eng, [("s", prompt, SamplingParams(max_tokens=0, prompt_logprobs=1))])["s"]
    assert len(outs) == 1 and outs[0].finished and outs[0].finish_reason == FinishReason.LENGTH
    assert outs[0].new_token_ids == []
    _check(outs[0].prompt_logprobs, _reference(hf, prompt), prompt, 1)


def test_preempted_while_scoring_its_prompt(tiny_checkpoint):
    """A cache too small for both prompts preempts one while it scores; it starts over and its
    entries are still exact, each position once."""
    path, hf = tiny_checkpoint
    eng = _engine(path, num_kv_blocks=12, max_num_batched_tokens=24)
    rng = random.Random(9)
    prompts = {f"p{i}": [rng.randrange(384) for _ in range(60)] for i in range(2)}
    reqs = [(rid, p, SamplingParams(max_tokens=4, prompt_logprobs=2)) for rid, p in prompts.items()]
    outs = _run(eng, reqs)
    assert eng.scheduler.num_preemptions > 0
    for rid, p in prompts.items():
        _check(outs[rid][0].prompt_logprobs, _reference(hf, p), p, 2)


def test_logits_in_slices_equal_one_pass(tiny_checkpoint, monkeypatch):
    """The bounded-memory slicing (a few rows of logits at a time) gives the same entries."""
    path, hf = tiny_checkpoint
    prompt = list(range(100, 140))
    params = SamplingParams(max_tokens=1, prompt_logprobs=4)
    whole = _run(_engine(path, max_num_batched_tokens=64), [("w", prompt, params)])
    monkeypatch.setattr(plp_module, "SLICE_ELEMENTS", 3 * 384)  # 3 rows at a time
    sliced = _run(_engine(path, max_num_batched_tokens=64), [("s", prompt, params)])
    a, b = sliced["s"][0].prompt_logprobs, whole["w"][0].prompt_logprobs
    assert [(r, [i for i, _ in alts]) for _, r, alts in a] == [
        (r, [i for i, _ in alts]) for _, r, alts in b
    ]
    assert max(abs(x[0] - y[0]) for x, y in zip(a, b)) < 1e-5
    _check(a, _reference(hf, prompt), prompt, 4)


def test_steps_without_a_scoring_request_gather_nothing_extra(tiny_checkpoint):
    """Requests that do not ask add no rows: only a scoring request's positions are gathered."""
    path, _ = tiny_checkpoint
    eng = _engine(path, max_num_batched_tokens=64)
    runner = eng.executor
    eng.add_request("a", list(range(100)), SamplingParams(max_tokens=2))
    batch = eng.scheduler.schedule()  # the first 64-token chunk of "a"
    inp = prepare_inputs(batch, runner.config.block_size, runner.block_tables)
    assert inp.prompt_rows is None and inp.prompt_targets is None and inp.prompt_segments is None
    eng.scheduler.update_after_launch(batch, [])

    eng.add_request("b", list(range(50, 60)), SamplingParams(max_tokens=2, prompt_logprobs=0))
    batch = eng.scheduler.schedule()  # the last 36 tokens of "a", then "b"'s 10
    assert batch.num_new_tokens == [36, 10]
    inp = prepare_inputs(batch, runner.config.block_size, runner.block_tables)
    assert inp.prompt_segments == [("b", 0, 9, 0)]
    assert inp.prompt_rows.tolist() == list(range(36, 45))  # b's rows, its last one samples
    assert inp.prompt_targets.tolist() == list(range(51, 60))
