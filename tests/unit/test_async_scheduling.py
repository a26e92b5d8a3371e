"""Async scheduling (step N+1 scheduled and launched before step N's samples reach the host):
same tokens as synchronous steps, stops and aborts with a token in flight, exact block
accounting."""

from __future__ import annotations

import random

import pytest
import torch

from engine.core.commands import AddRequest
from engine.core.config import EngineConfig
from engine.core.request import FinishReason, SamplingParams
from engine.worker.build import build_engine


def _engine(path, async_scheduling, eos=frozenset(), **kw):
    cfg = dict(
        model=path,
        block_size=8,
        num_kv_blocks=64,
        max_num_seqs=8,
        max_num_batched_tokens=48,
        async_scheduling=async_scheduling,
    )
    cfg.update(kw)
    return build_engine(EngineConfig(**cfg), eos_token_ids=eos)


def _run(eng, requests):
    """Add all requests, step to the end; returns ({id: tokens}, {id: finish reason}, steps)."""
    for rid, prompt, params in requests:
        eng.add_request(rid, prompt, params)
    tokens = {rid: [] for rid, _, _ in requests}
    reasons, steps = {}, 0
    while eng.has_unfinished():
        outs, stats = eng.step()
        steps += 1
        eng.kv_cache_manager.check_integrity()
        for o in outs:
            assert o.request_id not in reasons, "output after the last one"
            tokens[o.request_id] += o.new_token_ids
            if o.finished:
                reasons[o.request_id] = o.finish_reason
        assert steps < 1000
    assert eng.kv_cache_manager.num_free_blocks == eng.kv_cache_manager.num_blocks
    assert not eng.requests and eng._in_flight is None
    return tokens, reasons, steps


def test_async_equals_sync_for_greedy_seeded_and_mixed_lengths(tiny_checkpoint):
    path, _ = tiny_checkpoint
    rng = random.Random(3)
    requests = []
    for i in range(12):
        prompt = [rng.randrange(384) for _ in range(rng.randint(1, 60))]
        params = SamplingParams(
            temperature=rng.choice([0.0, 0.9]),
            seed=i,
            max_tokens=rng.randint(1, 20),
            logprobs=rng.choice([None, 2]),
        )
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
    free_run = _engine(path, False).generate(
        [prompt], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    )[0]
    eos = free_run[4]  # greedy token at output index 4 becomes the EOS id
    first = free_run.index(eos)
    for async_scheduling in (False, True):
        eng = _engine(path, async_scheduling, eos=frozenset([eos]))
        tokens, reasons, _ = _run(
            eng,
            [
                ("a", prompt, SamplingParams(temperature=0.0, max_tokens=12)),
                ("b", prompt[:7], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)),
            ],
        )
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
    eng.kv_cache_manager.check_integrity()
    while eng.has_unfinished():
        for o in eng.step()[0]:
            assert o.request_id == "y"
            seen["y"] += o.new_token_ids
    assert len(seen["y"]) == 6
    assert eng.kv_cache_manager.num_free_blocks == eng.kv_cache_manager.num_blocks


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_penalties_and_min_tokens_defer_their_sampling(tiny_checkpoint, async_scheduling):
    """Sampling that reads host state (penalties, min_tokens) is queued after the step in
    flight has been applied (deferred sampling), so it sees every earlier token: results equal
    the synchronous engine's."""
    path, _ = tiny_checkpoint
    prompt = list(range(3, 40))
    reqs = [
        ("p", prompt, SamplingParams(temperature=0.0, max_tokens=10, frequency_penalty=1.5)),
        ("m", prompt[:9], SamplingParams(temperature=0.0, max_tokens=10, min_tokens=6)),
        ("g", prompt[:20], SamplingParams(temperature=0.0, max_tokens=10)),
    ]
    ref = _run(_engine(path, False, eos=frozenset([7])), reqs)
    got = _run(_engine(path, async_scheduling, eos=frozenset([7])), reqs)
    assert got[:2] == ref[:2]


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_error_while_waiting_for_samples_fails_only_that_step(tiny_checkpoint, async_scheduling):
    """An exception at the host sync (StepHandle.result) fails the requests of that step; the
    engine keeps serving, later requests finish and every block is freed."""
    import engine.worker.model_runner as mr

    path, _ = tiny_checkpoint
    eng = _engine(path, async_scheduling)
    real = mr.StepHandle.result
    calls = {"n": 0}

    def flaky(self):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected sync failure")
        return real(self)

    eng.add_request("a", list(range(12)), SamplingParams(temperature=0.0, max_tokens=10))
    outs = []
    mr.StepHandle.result = flaky
    try:
        while calls["n"] < 3:
            outs += eng.step()[0]
    finally:
        mr.StepHandle.result = real
    failed = [o for o in outs if o.error]
    assert [o.request_id for o in failed] == ["a"] and failed[0].finish_reason == FinishReason.ERROR
    tokens, reasons, _ = _run(
        eng, [("b", list(range(20, 30)), SamplingParams(temperature=0.0, max_tokens=5))]
    )
    assert len(tokens["b"]) == 5 and reasons["b"] == FinishReason.LENGTH


def test_outputs_produced_before_a_device_error_are_delivered(tiny_checkpoint):
    """A deferred sampling applies the step in flight, which finishes a request, then the
    sampling hits a device error: the engine loop emits the finished request's last output, and
    fails only the others."""
    from engine.core.engine_loop import run_engine_loop

    path, _ = tiny_checkpoint
    eng = _engine(path, True)
    runner = eng.executor
    real_sampler = runner.sampler
    samplings = {"n": 0}

    def sampler(*args, **kw):
        samplings["n"] += 1
        if samplings["n"] == 2:  # "done" (max_tokens 1) finished just before, in this step
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return real_sampler(*args, **kw)

    runner.sampler = sampler
    commands = [
        [
            AddRequest("done", list(range(8)), SamplingParams(temperature=0.0, max_tokens=1)),
            AddRequest("long", list(range(9)), SamplingParams(temperature=0.0, max_tokens=50)),
        ],
        [
            AddRequest(
                "pen",
                list(range(7)),
                SamplingParams(temperature=0.0, max_tokens=5, presence_penalty=0.5),
            )
        ],
    ]
    emitted = []

    def next_commands(timeout):
        return commands.pop(0) if commands else []

    with pytest.raises(RuntimeError, match="CUDA error"):
        run_engine_loop(
            eng, next_commands, lambda outs, stats: emitted.extend(outs), log_interval=0
        )
    last = {o.request_id: o for o in emitted if o.finished}
    assert last["done"].finish_reason == FinishReason.LENGTH and last["done"].error is None
    assert last["long"].error and last["pen"].error


def test_a_host_error_while_applying_the_step_in_flight_fails_every_request(tiny_checkpoint):
    """A bug while a deferred step applies the previous step's samples (here injected into
    ``update_from_output``) leaves ``prev`` half applied: it must leave ``step()`` (the engine
    loop then fails every request and serves on) instead of failing only the new batch, which
    left a request of ``prev`` with a placeholder forever and the loop spinning."""
    from engine.core.commands import AddRequest, Shutdown
    from engine.core.engine_loop import run_engine_loop

    path, _ = tiny_checkpoint
    eng = _engine(path, True)
    real = eng.scheduler.update_from_output
    calls = {"n": 0}

    def update_from_output(sample_requests, samples):
        calls["n"] += 1
        if calls["n"] == 2:
            raise ValueError("injected host bug while applying samples")
        return real(sample_requests, samples)

    eng.scheduler.update_from_output = update_from_output
    pen = SamplingParams(temperature=0.0, max_tokens=8, frequency_penalty=1.0)
    commands = [
        [
            AddRequest("pen", list(range(3, 30)), pen),
            AddRequest("two", list(range(2, 12)), SamplingParams(temperature=0.0, max_tokens=2)),
        ]
    ]
    final, loops = {}, {"n": 0}

    def next_commands(timeout):
        loops["n"] += 1
        if commands:
            return commands.pop(0)
        return [Shutdown()] if loops["n"] > 200 or not eng.has_unfinished() else []

    def emit(outs, stats):
        final.update({o.request_id: o for o in outs if o.finished})

    run_engine_loop(eng, next_commands, emit, log_interval=0)
    assert loops["n"] < 200, "the engine loop kept spinning"
    assert set(final) == {"pen", "two"} and all(o.error for o in final.values())


def test_warmup_shapes_respect_max_model_len_and_max_num_seqs(tiny_checkpoint):
    path, _ = tiny_checkpoint
    for kw in (
        dict(max_num_seqs=8, max_num_batched_tokens=2048, max_model_len=128),
        dict(max_num_seqs=64, max_num_batched_tokens=256, max_model_len=16),
        dict(max_num_seqs=1, max_num_batched_tokens=8, max_model_len=8),
    ):
        eng = _engine(path, True, **kw)
        eng.executor.warmup()
