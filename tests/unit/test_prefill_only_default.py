"""The default budget of a step in which nothing decodes (``engine.worker.prefill_budget``) and
its way from the runner to the scheduler."""

from __future__ import annotations

import pytest

from engine.core.config import EngineConfig, ModelConfig
from engine.worker.build import build_engine
from engine.worker.prefill_budget import (
    ACTIVATION_RESERVE_BYTES,
    activation_bytes_per_token,
    default_prefill_only_budget,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _cfg(**kw) -> ModelConfig:
    base = dict(
        architecture="Qwen3ForCausalLM",
        model_type="qwen3",
        vocab_size=151936,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        rms_norm_eps=1e-6,
        rope_theta=1e6,
        max_position_embeddings=40960,
        tie_word_embeddings=True,
        attention_bias=False,
        qk_norm=True,
        dtype="bfloat16",
    )
    base.update(kw)
    return ModelConfig(**base)


QWEN3_8B = dict(
    hidden_size=4096, intermediate_size=12288, num_attention_heads=32, num_hidden_layers=36
)


def test_bytes_per_token_counts_the_larger_phase():
    small = _cfg()
    # Qwen3-0.6B: attention phase 2*1024 + 32*128 + 2*16*128 + 4*16*128 + 2*8*128 = 20,480 elements
    assert activation_bytes_per_token(small, 1, 2) == int(2 * 20480 * 1.25)
    # Qwen3-8B: the MLP phase (2*4096 + 3*12288 = 45,056) is larger
    assert activation_bytes_per_token(_cfg(**QWEN3_8B), 1, 2) == int(2 * 45056 * 1.25)
    # tensor parallel: each rank holds its share of the heads and the intermediate size
    assert activation_bytes_per_token(_cfg(**QWEN3_8B), 2, 2) < activation_bytes_per_token(
        _cfg(**QWEN3_8B), 1, 2
    )


def test_default_budget_bounds():
    small = _cfg()
    assert default_prefill_only_budget(small, 1, 2, 40960, 1024) == 40960  # the whole model length
    assert default_prefill_only_budget(small, 1, 2, 8192, 1024) == 8192
    big = _cfg(**QWEN3_8B)
    tokens = default_prefill_only_budget(big, 1, 2, 40960, 1024)
    assert tokens == ACTIVATION_RESERVE_BYTES // activation_bytes_per_token(big, 1, 2)
    assert 15_000 < tokens < 25_000
    # never below the step budget, and mixture-of-experts models keep it
    assert default_prefill_only_budget(big, 1, 4, 40960, 65536) == 65536
    moe = _cfg(num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768)
    assert default_prefill_only_budget(moe, 1, 2, 40960, 1024) == 1024


def test_runner_resolves_and_scheduler_uses_it(tiny_checkpoint):
    """On the CPU the default is the step budget; a configured value reaches the scheduler;
    without chunked prefill the budget is the step budget whatever is configured."""
    path, _ = tiny_checkpoint
    base = dict(model=path, block_size=8, num_kv_blocks=40, max_num_seqs=4, max_num_batched_tokens=48)
    cases = [({}, 48), ({"prefill_only_token_budget": 96}, 96)]
    cases.append(({"prefill_only_token_budget": 96, "enable_chunked_prefill": False}, 48))
    for kw, want in cases:
        engine = build_engine(EngineConfig(**base, **kw), eos_token_ids=frozenset())
        try:
            assert engine.cache_info.prefill_only_token_budget == want, kw
            assert engine.scheduler.prefill_only_token_budget == want, kw
        finally:
            engine.shutdown()

