"""Whole-prompt steps on an idle engine (``EngineConfig.lone_prompt_min_tokens``): the length
bound from the activations (``engine.worker.prefill_budget``), the scheduler's rule, and greedy
outputs equal to the chunked schedule's with every KV block back."""

from __future__ import annotations

import random

import pytest
import torch

from bench.common import QWEN3_06B
from engine.core.config import EngineConfig, ModelConfig
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.request import Request, SamplingParams
from engine.core.scheduler import Scheduler
from engine.worker.build import build_engine
from engine.worker.prefill_budget import (
    ACTIVATION_RESERVE_BYTES,
    activation_bytes_per_token,
    max_step_tokens,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

QWEN3_8B = dict(
    hidden_size=4096, intermediate_size=12288, num_attention_heads=32, num_hidden_layers=36
)


def _cfg(**kw) -> ModelConfig:
    """Qwen3-0.6B's config (``bench.common.QWEN3_06B``) with ``kw`` changed."""
    base = dict(
        architecture="Qwen3ForCausalLM",
        model_type="qwen3",
        attention_bias=False,
        qk_norm=True,
        dtype="bfloat16",
        **QWEN3_06B,
    )
    base.update(kw)
    return ModelConfig(**base)


def test_bytes_per_token_counts_the_larger_phase():
    # Qwen3-0.6B: attention phase 2*1024 + 32*128 + 2*16*128 + 4*16*128 + 2*8*128 = 20,480
    assert activation_bytes_per_token(_cfg(), 1, 2) == int(2 * 20480 * 1.25)
    # Qwen3-8B: the MLP phase (2*4096 + 3*12288 = 45,056) is larger
    big = _cfg(**QWEN3_8B)
    assert activation_bytes_per_token(big, 1, 2) == int(2 * 45056 * 1.25)
    # tensor parallel: each rank holds its share of the heads and the intermediate size
    assert activation_bytes_per_token(big, 2, 2) < activation_bytes_per_token(big, 1, 2)


def test_max_step_tokens():
    assert max_step_tokens(_cfg(), 1, 2, 40960) == 40960  # Qwen3-0.6B: the whole model length
    assert max_step_tokens(_cfg(), 1, 2, 8192) == 8192
    big = _cfg(**QWEN3_8B)
    tokens = max_step_tokens(big, 1, 2, 40960)
    assert tokens == ACTIVATION_RESERVE_BYTES // activation_bytes_per_token(big, 1, 2)
    assert 20_000 < tokens < 35_000
    assert max_step_tokens(big, 2, 2, 40960) > tokens
    moe = _cfg(num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768)
    assert max_step_tokens(moe, 1, 2, 40960) == 0


def _req(rid, n, rng, max_tokens=4):
    return Request(
        rid, [rng.randrange(1000) for _ in range(n)], SamplingParams(max_tokens=max_tokens), 1 << 20
    )


def test_scheduler_takes_a_lone_prompt_whole():
    rng = random.Random(0)

    def sched():
        kv = KVCacheManager(200, 8, enable_prefix_caching=False)
        return Scheduler(
            kv, max_num_seqs=8, max_num_batched_tokens=32, lone_prompt_tokens=(100, 400)
        )

    s = sched()
    a, b = _req("a", 300, rng), _req("b", 50, rng)
    s.add_request(a)
    s.add_request(b)
    batch = s.schedule()
    assert [r.request_id for r in batch.requests] == ["a"] and batch.num_new_tokens == [300]
    # a prompt outside the range is chunked as before
    for n in (99, 401):
        s = sched()
        s.add_request(_req("c", n, rng))
        assert s.schedule().num_new_tokens == [32]
    # the rule needs an idle engine: with a request running, the budget holds
    s = sched()
    s.add_request(_req("d", 20, rng))
    s.schedule()
    s.add_request(_req("e", 300, rng))
    assert sum(s.schedule().num_new_tokens) <= 32
    # off: (0, 0), or without chunked prefill
    kv = KVCacheManager(200, 8, enable_prefix_caching=False)
    s = Scheduler(kv, 8, 32, enable_chunked_prefill=False, lone_prompt_tokens=(100, 400))
    assert s.lone_prompt_tokens == (0, 0)


def _engine(path, **kw):
    cfg = dict(
        model=path, block_size=8, num_kv_blocks=60, max_num_seqs=6, max_num_batched_tokens=48
    )
    cfg.update(kw)
    return build_engine(EngineConfig(**cfg), eos_token_ids=frozenset())


def _run(engine, prompts, arrivals):
    """Greedy outputs; ``arrivals[i]``: the step before which prompt i is added."""
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    out = {i: [] for i in range(len(prompts))}
    step = 0
    pending = sorted(range(len(prompts)), key=lambda i: arrivals[i])
    while pending or engine.has_unfinished():
        while pending and arrivals[pending[0]] <= step:
            i = pending.pop(0)
            engine.add_request(str(i), prompts[i], params)
        outputs, _ = engine.step()
        for o in outputs:
            out[int(o.request_id)] += o.new_token_ids
        step += 1
    return out


def test_runner_resolves_the_range_and_outputs_match(tiny_checkpoint):
    """On the CPU the rule is off unless configured; configured, a long prompt on the idle
    engine runs in one step and every request's greedy tokens equal the chunked schedule's,
    with every KV block back in the pool."""
    path, _ = tiny_checkpoint
    gen = torch.Generator().manual_seed(4)
    lens = [150, 30, 200, 12, 90]
    prompts = [torch.randint(0, 300, (n,), generator=gen).tolist() for n in lens]
    arrivals = [0, 1, 30, 31, 31]  # a long prompt alone, then again after the engine idles
    results = []
    for kw in ({}, {"lone_prompt_min_tokens": 100}):
        engine = _engine(path, **kw)
        try:
            info = engine.cache_info
            if kw:
                assert info.lone_prompt_min_tokens == 100
                assert info.lone_prompt_max_tokens == info.max_model_len
                assert engine.scheduler.lone_prompt_tokens == (100, info.max_model_len)
            else:
                assert (info.lone_prompt_min_tokens, info.lone_prompt_max_tokens) == (0, 0)
            steps = []
            real = engine.scheduler.schedule

            def spy(real=real, steps=steps):
                batch = real()
                steps.append(list(batch.num_new_tokens))
                return batch

            engine.scheduler.schedule = spy
            results.append(_run(engine, prompts, arrivals))
            assert engine.kv_cache_manager.num_free_blocks == 60
            whole = [150] in steps or [200] in steps
            assert whole == bool(kw), steps[:6]
        finally:
            engine.shutdown()
    assert results[0] == results[1]


@pytest.mark.parametrize("bad", [-1, 1.5, "16"])
def test_config_refuses_bad_values(bad):
    with pytest.raises(ValueError, match="lone_prompt_min_tokens"):
        EngineConfig(model="m", lone_prompt_min_tokens=bad)


def test_prefix_hit_keeps_the_budget():
    """A follow-up turn whose prefix is cached is chunked as before, and its hit does not make
    room for other prompts in a large step."""
    rng = random.Random(1)
    kv = KVCacheManager(400, 8, enable_prefix_caching=True)
    s = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=32, lone_prompt_tokens=(100, 1000))
    first = _req("t1", 300, rng, max_tokens=1)
    s.add_request(first)
    batch = s.schedule()
    assert batch.num_new_tokens == [300]  # a fresh prompt: whole
    s.update_after_launch(batch, [first])
    from engine.core.outputs import SampleOutput

    s.update_from_output([first], SampleOutput([5], [None]))
    assert not s.running
    follow = Request(
        "t2",
        first.prompt_token_ids + [5] + [rng.randrange(1000) for _ in range(40)],
        SamplingParams(max_tokens=2),
        1 << 20,
    )
    s.add_request(follow)
    for i in range(3):
        s.add_request(_req(f"o{i}", 200, rng))
    batch = s.schedule()
    assert sum(batch.num_new_tokens) <= 32, list(
        zip([r.request_id for r in batch.requests], batch.num_new_tokens)
    )


def test_larger_budget_is_kept():
    """With a step budget above the prompt, the rule changes nothing (others may join)."""
    rng = random.Random(2)
    kv = KVCacheManager(400, 8, enable_prefix_caching=False)
    s = Scheduler(
        kv,
        max_num_seqs=8,
        max_num_batched_tokens=32,
        prefill_only_token_budget=600,
        lone_prompt_tokens=(100, 1000),
    )
    s.add_request(_req("a", 300, rng))
    s.add_request(_req("b", 200, rng))
    assert s.schedule().num_new_tokens == [300, 200]


def test_longest_step_from_the_memory_left(tiny_checkpoint, monkeypatch):
    """The CUDA start-up step that sets the longest whole-prompt step, run on the CPU with the
    device's memory query replaced: the range follows the memory left (below the utilization
    line, or what is free less 512 MiB with an explicit KV cache size), one step of that length
    runs, and too little memory or a step that does not fit turns the rule off."""
    import dataclasses

    path, _ = tiny_checkpoint
    engine = _engine(path, lone_prompt_min_tokens=64)
    try:
        runner = engine.executor
        per_token = activation_bytes_per_token(runner.model_config, 1, 4)
        gib = 1 << 30

        def memory(free, total=100 * gib):
            monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, total))

        ran = []
        real = runner.warmup
        monkeypatch.setattr(
            runner, "warmup", lambda shapes=None: ran.append(shapes) or real(shapes)
        )

        def resolved():
            runner._resolve_lone_prompts(64, 1, 4)
            info = runner.cache_info
            return info.lone_prompt_min_tokens, info.lone_prompt_max_tokens

        memory((512 << 20) + 200 * per_token)  # explicit KV cache size (num_kv_blocks=60)
        assert resolved() == (64, 200) and ran == [((200, 1),)]
        memory((512 << 20) + 10 * per_token)  # less than the minimum: off
        assert resolved() == (0, 0)
        # utilization 0.85 of 100 GiB, 15 GiB + 300 tokens' worth free: 300
        monkeypatch.setattr(
            runner, "config", dataclasses.replace(runner.config, num_kv_blocks=None)
        )
        memory(15 * gib + 300 * per_token)
        assert resolved() == (64, 300)
        memory(15 * gib + 10**5 * per_token)  # capped by max_model_len
        assert resolved() == (64, runner.cache_info.max_model_len)

        def oom(shapes=None):
            raise torch.OutOfMemoryError("CUDA out of memory")

        monkeypatch.setattr(runner, "warmup", oom)  # the start-up step does not fit: off
        memory(15 * gib + 300 * per_token)
        assert resolved() == (0, 0)
    finally:
        engine.shutdown()


def test_long_remainder_after_a_short_hit_is_whole_and_alone():
    """A prompt sharing a short cached prefix with a long uncached rest: the step holds exactly
    that rest, and no other waiting prompt."""
    rng = random.Random(3)
    kv = KVCacheManager(400, 8, enable_prefix_caching=True)
    s = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=32, lone_prompt_tokens=(100, 1000))
    from engine.core.outputs import SampleOutput

    first = _req("t1", 40, rng, max_tokens=1)
    s.add_request(first)
    while s.running or s.waiting:  # the 40-token prompt runs in 32 + 8
        batch = s.schedule()
        sample = [
            r
            for r, n in zip(batch.requests, batch.num_new_tokens)
            if r.num_computed_tokens + n == r.num_tokens
        ]
        s.update_after_launch(batch, sample)
        s.update_from_output(sample, SampleOutput([5] * len(sample), [None] * len(sample)))
    tokens = first.prompt_token_ids[:32] + [rng.randrange(1000) for _ in range(250)]
    s.add_request(Request("t2", tokens, SamplingParams(max_tokens=2), 1 << 20))
    s.add_request(_req("o", 50, rng))
    batch = s.schedule()
    assert [r.request_id for r in batch.requests] == ["t2"]
    assert batch.num_new_tokens == [250] and batch.requests[0].num_computed_tokens == 32


def test_cudnn_plans_are_built_again_on_the_engine_loop_thread(tiny_checkpoint, monkeypatch):
    """torch caches cuDNN's attention plans per host thread: an engine loop on another thread
    than the one that built the engine (``--engine-mode thread``) builds the lone prompts' plans
    for itself before its first step; on the building thread, on the CPU or without
    whole-prompt steps nothing is built; a failure is logged, never raised."""
    import dataclasses
    import threading

    from engine.core.commands import Shutdown
    from engine.core.engine_loop import run_engine_loop

    path, _ = tiny_checkpoint
    engine = _engine(path, lone_prompt_min_tokens=64)
    try:
        runner = engine.executor
        built, blas = [], []
        monkeypatch.setattr(
            runner, "_warm_up_dense_prefill", lambda n: built.append((n, threading.get_ident()))
        )
        monkeypatch.setattr(runner, "_warm_up_blas", lambda: blas.append(threading.get_ident()))

        def loop_on_a_thread():
            raised = []

            def run():
                try:
                    run_engine_loop(engine, lambda timeout: [Shutdown()], lambda *a: None, 0.0)
                except BaseException as exc:  # noqa: BLE001 - reported by the assert below
                    raised.append(exc)

            t = threading.Thread(target=run)
            t.start()
            t.join(30)
            assert not t.is_alive() and raised == []
            return t.ident

        loop_on_a_thread()
        assert built == [], "the CPU keeps no cuDNN plans"
        monkeypatch.setattr(runner, "device", torch.device("cuda"))  # no CUDA call follows
        monkeypatch.setattr(
            runner,
            "cache_info",
            dataclasses.replace(
                runner.cache_info, lone_prompt_min_tokens=64, lone_prompt_max_tokens=300
            ),
        )
        engine.prepare_thread()  # the thread that built the engine has its plans
        assert built == []
        ident = loop_on_a_thread()
        assert built == [(300, ident)] and blas == [ident]

        def fail(*_):
            raise torch.OutOfMemoryError("CUDA out of memory")

        monkeypatch.setattr(runner, "_warm_up_dense_prefill", fail)
        monkeypatch.setattr(runner, "_warm_up_blas", fail)
        loop_on_a_thread()  # logged; the loop still ran to its shutdown
        monkeypatch.setattr(
            runner, "cache_info", dataclasses.replace(runner.cache_info, lone_prompt_max_tokens=0)
        )
        monkeypatch.setattr(runner, "_warm_up_dense_prefill", lambda n: built.append(n))
        loop_on_a_thread()
        assert built == [(300, ident)], "no whole-prompt steps: no plans"
    finally:
        engine.shutdown()
