"""TritonAttentionBackend against the torch backend over a chunked-prefill + decode sequence."""

import os

import pytest
import torch

from engine.attention import AttentionMetadata, TorchAttentionBackend, get_attention_backend
from engine.triton_backend import TritonAttentionBackend


def _meta(block_tables, ctx_lens, q_lens, block_size, device, pad=0):
    slots, cu = [], [0]
    for b, (c, n) in enumerate(zip(ctx_lens, q_lens)):
        for p in range(c, c + n):
            slots.append(int(block_tables[b, p // block_size]) * block_size + p % block_size)
        cu.append(cu[-1] + n)
    slots += [-1] * pad  # padding tokens are not stored
    seq_lens = [c + n for c, n in zip(ctx_lens, q_lens)]
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        block_tables=block_tables.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=device),
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
        is_decode=max(q_lens) == 1 and min(q_lens) == 1,
    )


def test_backend_selection():
    assert get_attention_backend("triton", torch.device("cpu")).name == "triton"
    assert get_attention_backend(None, torch.device("cpu")).name == "torch"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_backend_matches_torch_backend(device, dtype):
    seed = int.from_bytes(os.urandom(4), "little")
    g = torch.Generator().manual_seed(seed)
    hq, hkv, d, bs, num_blocks = 8, 2, 64, 16, 24
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    block_tables = torch.randperm(num_blocks, generator=g)[:16].view(2, 8).to(torch.int32)
    # the torch backend (the oracle) runs in float32 on the CPU on upcast copies of the inputs
    ref_k = torch.zeros(num_blocks, bs, hkv, d)
    ref_v = torch.zeros(num_blocks, bs, hkv, d)
    k_cache = torch.zeros(num_blocks, bs, hkv, d, dtype=dtype, device=device)
    v_cache = torch.zeros_like(k_cache)
    torch_be, triton_be = TorchAttentionBackend(), TritonAttentionBackend()
    # two chunks of prefill (the second attends to the cached first chunk), then 3 decode steps
    steps = [([0, 0], [20, 33]), ([20, 33], [17, 1]), ([37, 34], [1, 1]), ([38, 35], [1, 1]), ([39, 36], [1, 1])]
    scratch_ids = set()
    for ctx_lens, q_lens in steps:
        t = sum(q_lens)
        q = torch.randn(t, hq, d, generator=g).to(dtype)
        k = torch.randn(t, hkv, d, generator=g).to(dtype)
        v = torch.randn(t, hkv, d, generator=g).to(dtype)
        ref = torch_be.forward(
            q.float(), k.float(), v.float(), ref_k, ref_v, _meta(block_tables, ctx_lens, q_lens, bs, "cpu"), d**-0.5
        )
        meta = _meta(block_tables, ctx_lens, q_lens, bs, device)
        out = triton_be.forward(q.to(device), k.to(device), v.to(device), k_cache, v_cache, meta, d**-0.5)
        assert out.shape == (t, hq, d) and out.dtype == dtype
        err = ((out.cpu().float() - ref).norm() / ref.norm()).item()
        assert err <= tol, f"step {ctx_lens}+{q_lens}: rel err {err:.2e} (seed={seed})"
        assert torch.equal(k_cache.cpu(), ref_k.to(dtype)) and torch.equal(v_cache.cpu(), ref_v.to(dtype))
        scratch_ids |= {id(buf[0]) for buf in triton_be._scratch.values()}
    assert len(scratch_ids) <= 1  # decode scratch allocated once and reused
