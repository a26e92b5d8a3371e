"""The start-up warm-up runs dummy prefill steps without touching the KV cache."""

from __future__ import annotations

import torch

from engine.core.config import EngineConfig
from engine.worker.build import build_engine


def test_warmup_stores_nothing_and_leaves_engine_usable(tiny_checkpoint):
    path, _ = tiny_checkpoint
    eng = build_engine(
        EngineConfig(model=path, block_size=16, num_kv_blocks=8, max_num_batched_tokens=64),
        eos_token_ids=frozenset(),
    )
    runner = eng.executor
    for k, v in runner.kv_caches:
        k.normal_()
        v.normal_()
    before = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
    runner.warmup()
    for (k, v), (k0, v0) in zip(runner.kv_caches, before):
        assert torch.equal(k, k0) and torch.equal(v, v0)
    from engine.core.request import SamplingParams

    out = eng.generate([[1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=3))
    assert len(out[0]) == 3 and eng.kv_cache_manager.num_free_blocks == 8
