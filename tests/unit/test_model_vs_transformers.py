"""The engine against transformers' Qwen3ForCausalLM / Qwen2ForCausalLM on random tiny
checkpoints."""

from __future__ import annotations

import pytest
import torch

from engine.attention.registry import get_attention_backend
from engine.core.config import EngineConfig
from engine.core.request import SamplingParams
from engine.worker.build import build_engine
from tests.conftest import hf_greedy
from tests.engine_helpers import logits_for


def _engine(path, **kw):
    cfg = dict(model=path, num_kv_blocks=64, block_size=16, max_num_batched_tokens=4096)
    cfg.update(kw)
    return build_engine(EngineConfig(**cfg), eos_token_ids=frozenset())


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_prefill_logits_match_transformers(tiny_checkpoint, backend):
    """``triton``: the Triton kernels under the interpreter, q/k norm + rotary + KV store fused
    into one launch per layer (``fuse_qk_rope``, the default with that backend)."""
    path, hf = tiny_checkpoint
    eng = _engine(path, attention_backend=backend)
    gen = torch.Generator().manual_seed(7)
    lengths = [1, 7, 16, 33, 50]
    prompts = [torch.randint(0, 384, (n,), generator=gen).tolist() for n in lengths]
    reqs = [
        eng.add_request(f"r{i}", p, SamplingParams(max_tokens=1)) for i, p in enumerate(prompts)
    ]
    batch = eng.scheduler.schedule()
    assert [r.request_id for r in batch.requests] == [r.request_id for r in reqs]
    logits = logits_for(eng, batch)
    offset = 0
    for p in prompts:
        with torch.no_grad():
            ref = hf(torch.tensor([p])).logits[0].float()
        got = logits[offset : offset + len(p)]
        offset += len(p)
        rel = (got - ref).norm() / ref.norm()
        assert rel < 1e-4, f"relative error {rel:.2e} for prompt length {len(p)}"


def test_chunked_prefill_and_decode_logits_match(tiny_checkpoint):
    """Logits of a prompt computed over several chunks and then decoded token by token."""
    path, hf = tiny_checkpoint
    eng = _engine(path, max_num_batched_tokens=16)
    prompt = torch.randint(0, 384, (41,), generator=torch.Generator().manual_seed(3)).tolist()
    req = eng.add_request("r", prompt, SamplingParams(max_tokens=4))
    chunks = []
    while req.num_computed_tokens + 16 < len(prompt):
        batch = eng.scheduler.schedule()
        chunks.append(logits_for(eng, batch))
        eng.scheduler.update_after_launch(batch, [])
    batch = eng.scheduler.schedule()
    chunks.append(logits_for(eng, batch))
    eng.scheduler.update_after_launch(batch, [])
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0].float()
    got = torch.cat(chunks)
    assert len(chunks) == 3
    assert ((got - ref).norm() / ref.norm()) < 1e-4


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_greedy_generation_with_preemption_matches_transformers(tiny_checkpoint, async_scheduling):
    """8 concurrent prompts, 32 greedy tokens, a cache too small for all: ids equal HF generate
    (also with async scheduling: inputs in flight come from the device, preemption with a
    token in flight)."""
    path, hf = tiny_checkpoint
    gen = torch.Generator().manual_seed(11)
    lengths = [3, 9, 17, 24, 31, 40, 12, 5]
    prompts = [torch.randint(0, 384, (n,), generator=gen).tolist() for n in lengths]
    # 8 requests need up to ceil((40 + 32) / 16) = 5 blocks each; 16 blocks force preemption
    eng = _engine(
        path,
        num_kv_blocks=16,
        max_num_batched_tokens=64,
        enable_prefix_caching=False,
        async_scheduling=async_scheduling,
    )
    outs = eng.generate(prompts, SamplingParams(temperature=0.0, max_tokens=32))
    assert eng.scheduler.num_preemptions >= 1
    assert eng.kv_cache_manager.num_free_blocks == eng.kv_cache_manager.num_blocks
    eng.kv_cache_manager.check_integrity()
    for p, out in zip(prompts, outs):
        assert out == hf_greedy(hf, p, 32)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_generation_equal_with_and_without_prefix_cache(tiny_checkpoint, async_scheduling):
    path, _ = tiny_checkpoint
    gen = torch.Generator().manual_seed(5)
    shared = torch.randint(0, 384, (37,), generator=gen).tolist()
    prompts = [shared + torch.randint(0, 384, (n,), generator=gen).tolist() for n in (1, 6, 20)] + [
        shared
    ]
    params = SamplingParams(temperature=0.0, max_tokens=12)
    base = _engine(path, enable_prefix_caching=False).generate(prompts, params)
    eng = _engine(path, enable_prefix_caching=True, async_scheduling=async_scheduling)
    first = eng.generate(prompts[:1], params)
    rest = eng.generate(prompts[1:], params)
    assert first + rest == base
    assert (
        eng.kv_cache_manager.prefix_hits >= 3 * 32
    )  # two full shared blocks reused by three requests
    assert eng.kv_cache_manager.num_free_blocks == eng.kv_cache_manager.num_blocks
    eng.kv_cache_manager.check_integrity()


@pytest.mark.parametrize("fused", [False, True], ids=["separate-launches", "fused-decode"])
def test_triton_decode_steps_match_transformers(tiny_checkpoint, monkeypatch, fused):
    """Greedy decoding through the Triton kernels (interpreter): the decode steps' q/k norm +
    rotary + k/v store and the split merge either in their own launches or fused into the decode
    launch (``QWEN_SERVE_DECODE_FUSED_QK_ROPE`` / ``_REDUCE``): ids equal HF generate."""
    import kernels.decode_attention as da

    monkeypatch.setattr(da, "FUSED_REDUCE_SWITCH", fused)
    path, hf = tiny_checkpoint
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 384, (n,), generator=gen).tolist() for n in (5, 23, 40)]
    eng = _engine(path, attention_backend="triton", enable_prefix_caching=False)
    # the process-wide backend read its switch when first made: set it on the instance
    monkeypatch.setattr(get_attention_backend("triton"), "fused_decode_qk_rope", fused)
    calls = []
    real = da.decode_attention

    def counted(*a, **kw):
        calls.append(kw.get("qk_rope") is not None)
        return real(*a, **kw)

    import engine.attention.triton_backend as tb

    monkeypatch.setattr(tb, "decode_attention", counted)
    outs = eng.generate(prompts, SamplingParams(temperature=0.0, max_tokens=6))
    for p, out in zip(prompts, outs):
        assert out == hf_greedy(hf, p, 6)
    assert calls and any(calls) is fused, "the decode steps took the other path"
