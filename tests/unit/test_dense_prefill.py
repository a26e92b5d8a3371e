"""The cuDNN path of a lone fresh prompt (``engine.attention.dense_prefill``): its gather and GQA
repeat against the paged-attention reference, and the host check that picks it.

On the CPU, SDPA runs its math backend on the same call; the cuDNN kernel itself is checked on
the GPU by ``bench/dense_prefill.py``."""

from __future__ import annotations

import pytest
import torch

from engine.attention.dense_prefill import dense_causal_attention, is_lone_fresh_prompt
from engine.attention.metadata import AttentionMetadata
from engine.attention.triton_backend import TritonAttentionBackend
from kernels.reference import prefill_attention_ref


def _meta(block_tables, seq_lens, q_lens, is_decode=False, max_seq_len=None):
    cu = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(q_lens).cumsum(0)
    return AttentionMetadata(
        slot_mapping=torch.full((sum(q_lens),), -1, dtype=torch.int64),
        block_tables=block_tables,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        cu_seqlens_q=cu,
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens) if max_seq_len is None else max_seq_len,
        is_decode=is_decode,
    )


@pytest.mark.parametrize("t,block_size,hq,hkv", [(37, 16, 4, 2), (100, 32, 8, 8), (64, 16, 6, 2)])
def test_matches_paged_reference(t, block_size, hq, hkv):
    g = torch.Generator().manual_seed(t)
    d = 32
    nb = -(-t // block_size)
    num_blocks = nb + 5
    k_cache = torch.randn(num_blocks, block_size, hkv, d, generator=g)
    v_cache = torch.randn(num_blocks, block_size, hkv, d, generator=g)
    table = torch.randperm(num_blocks, generator=g)[: nb + 2].to(torch.int32)  # longer than needed
    q = torch.randn(t, hq, d, generator=g)
    scale = d**-0.5
    got = dense_causal_attention(q, k_cache, v_cache, table, torch.empty_like(q), scale)
    want = prefill_attention_ref(
        q,
        k_cache,
        v_cache,
        table[None],
        torch.tensor([0, t], dtype=torch.int32),
        torch.tensor([t], dtype=torch.int32),
        torch.empty_like(q),
        scale,
    )
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_strided_queries():
    """q as a view of a fused qkv projection (row stride larger than H_q * D)."""
    g = torch.Generator().manual_seed(1)
    t, hq, hkv, d, bs = 50, 4, 2, 16, 16
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=g)
    q = qkv[:, : hq * d].view(t, hq, d)
    k_cache = torch.randn(4, bs, hkv, d, generator=g)
    v_cache = torch.randn(4, bs, hkv, d, generator=g)
    table = torch.tensor([2, 0, 3, 1], dtype=torch.int32)
    got = dense_causal_attention(q, k_cache, v_cache, table, torch.empty(t, hq, d), 0.25)
    want = prefill_attention_ref(
        q.contiguous(),
        k_cache,
        v_cache,
        table[None],
        torch.tensor([0, t], dtype=torch.int32),
        torch.tensor([t], dtype=torch.int32),
        torch.empty(t, hq, d),
        0.25,
    )
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_lone_fresh_prompt_check():
    bt1 = torch.zeros(1, 4, dtype=torch.int32)
    bt2 = torch.zeros(2, 4, dtype=torch.int32)
    assert is_lone_fresh_prompt(_meta(bt1, [40], [40]), 40)
    # a chunk over a cached prefix
    assert not is_lone_fresh_prompt(_meta(bt1, [60], [40]), 40)
    # two sequences
    assert not is_lone_fresh_prompt(_meta(bt2, [20, 20], [20, 20]), 40)
    # a decode step
    assert not is_lone_fresh_prompt(_meta(bt1, [1], [1], is_decode=True), 1)
    # padded rows (a graph's token count above the prompt's)
    assert not is_lone_fresh_prompt(_meta(bt1, [40], [40]), 48)
    # a graph's bound on seq_lens (the model length) instead of the exact value
    assert not is_lone_fresh_prompt(_meta(bt1, [40], [40], max_seq_len=4096), 40)


def test_backend_takes_dense_path_only_on_cuda():
    """On the CPU the backend never asks for cuDNN (the switch stays as configured)."""
    b = TritonAttentionBackend(dense_prefill_min_tokens=1)
    q = torch.zeros(8, 2, 16)
    meta = _meta(torch.zeros(1, 1, dtype=torch.int32), [8], [8])
    assert not b._dense_prefill(q, meta)
    assert b.dense_prefill_min_tokens == 1


def test_switch_off(monkeypatch):
    monkeypatch.setenv("QWEN_SERVE_DENSE_PREFILL", "0")
    assert TritonAttentionBackend().dense_prefill_min_tokens == 0
    monkeypatch.setenv("QWEN_SERVE_DENSE_PREFILL", "1")
    assert TritonAttentionBackend().dense_prefill_min_tokens > 0


def test_only_a_cudnn_refusal_falls_back():
    """A refusal turns the path off; out-of-memory and device errors propagate."""
    from engine.attention.triton_backend import _cudnn_refused

    assert _cudnn_refused(RuntimeError("No available kernel. Aborting execution."))
    assert _cudnn_refused(RuntimeError("cuDNN Frontend error: [cudnn_frontend] No valid engine"))
    assert not _cudnn_refused(torch.OutOfMemoryError("CUDA out of memory. cudnn workspace"))
    assert not _cudnn_refused(RuntimeError("CUDA error: an illegal memory access was encountered"))
    assert not _cudnn_refused(RuntimeError("shape mismatch"))
    assert not _cudnn_refused(RuntimeError("cuDNN error: CUDNN_STATUS_EXECUTION_FAILED"))
    assert _cudnn_refused(RuntimeError("cuDNN error: CUDNN_STATUS_NOT_SUPPORTED"))


def test_refusal_turns_the_path_off_and_failures_propagate():
    b = TritonAttentionBackend(dense_prefill_min_tokens=16)

    def refuse():
        raise RuntimeError("No available kernel. Aborting execution.")

    def oom():
        raise torch.OutOfMemoryError("CUDA out of memory")

    assert b._cudnn(lambda x: x + 1, 1) == 2 and b.dense_prefill_min_tokens == 16
    with pytest.raises(torch.OutOfMemoryError):
        b._cudnn(oom)
    assert b.dense_prefill_min_tokens == 16
    assert b._cudnn(refuse) is None and b.dense_prefill_min_tokens == 0
