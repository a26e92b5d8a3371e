"""decode_attention (Triton, split-KV) against decode_attention_ref, and its helpers."""

import os

import pytest
import torch

from kernels.decode_attention import choose_num_splits, decode_attention, decode_scratch
from kernels.reference import decode_attention_ref
from .test_prefill_attention import TOL, make_paged, rel_err

CASES = [
    # seq_lens, Hq, Hkv, D, block_size, dtype, num_splits
    ([1, 15, 17], 4, 4, 64, 16, torch.float32, 1),
    ([300, 17, 1], 8, 2, 128, 32, torch.bfloat16, 4),
    ([513], 8, 1, 64, 16, torch.float16, 7),
    ([15, 400], 16, 2, 128, 16, torch.float32, 16),  # some splits empty for the short sequence
    ([33, 260, 100, 1], 2, 1, 128, 32, torch.bfloat16, 2),
    ([64], 8, 8, 64, 32, torch.float32, 9),  # more splits than key tiles
    ([200, 47], 8, 4, 64, 24, torch.float32, 3),  # block size not a power of two
]


@pytest.mark.parametrize("seq_lens,hq,hkv,d,block_size,dtype,num_splits", CASES)
def test_decode_matches_reference(device, seq_lens, hq, hkv, d, block_size, dtype, num_splits):
    seed = int.from_bytes(os.urandom(4), "little")
    g = torch.Generator().manual_seed(seed)
    k_cache, v_cache, block_tables = make_paged(seq_lens, hkv, d, block_size, dtype, g)
    b = len(seq_lens)
    qkv = torch.randn(b, hq + 2 * hkv, d, generator=g).to(dtype)
    q = qkv[:, :hq]  # non-contiguous, like the model's view
    sl = torch.tensor(seq_lens, dtype=torch.int32)
    scale = d**-0.5
    ref = torch.empty(b, hq, d)
    decode_attention_ref(q.float(), k_cache.float(), v_cache.float(), block_tables, sl, ref, scale)

    out = torch.full((b, hq, d), float("nan"), dtype=dtype, device=device)
    po, plse = decode_scratch(b, hq, d, num_splits, device)
    po.fill_(float("nan"))
    plse.fill_(float("nan"))
    res = decode_attention(
        q.to(device), k_cache.to(device), v_cache.to(device), block_tables.to(device), sl.to(device),
        out, scale, po, plse, num_splits,
    )
    assert res is out
    assert torch.isfinite(out).all(), f"unwritten or NaN output (seed={seed})"
    err = rel_err(out.cpu(), ref)
    assert err <= TOL[dtype], f"rel err {err:.2e} (seed={seed})"


def test_choose_num_splits():
    # small batch, long context: split until the GPU is full, keeping >= 128 keys per split
    assert choose_num_splits(1, 8, 4096, 132) == 32
    assert choose_num_splits(1, 8, 100_000, 132) == 33
    # a large batch fills the GPU by itself
    assert choose_num_splits(64, 8, 4096, 132) == 1
    assert choose_num_splits(256, 8, 1024, 132) == 1
    # short contexts are not split
    assert choose_num_splits(1, 8, 200, 132) == 1
    assert choose_num_splits(2, 8, 300, 132) == 2
    assert 1 <= choose_num_splits(0, 8, 0, 132) <= 64
    with pytest.raises(ValueError):
        choose_num_splits(1, 0, 10, 132)


def test_decode_scratch_shapes(device):
    po, plse = decode_scratch(3, 8, 128, 5, device)
    assert po.shape == (3, 8, 5, 128) and po.dtype == torch.float32
    assert plse.shape == (3, 8, 5) and plse.dtype == torch.float32


def test_decode_rejects_bad_inputs(device):
    q = torch.zeros(2, 8, 64, device=device)
    kc = torch.zeros(4, 16, 2, 64, device=device)
    bt = torch.zeros(2, 4, dtype=torch.int32, device=device)
    sl = torch.ones(2, dtype=torch.int32, device=device)
    po, plse = decode_scratch(2, 8, 64, 2, device)
    with pytest.raises(ValueError):  # scratch too small for 4 splits
        decode_attention(q, kc, kc, bt, sl, torch.empty_like(q), 0.1, po, plse, 4)
    with pytest.raises(ValueError):
        decode_attention(q, kc, kc, bt, sl, torch.empty_like(q), 0.1, po, plse, 0)
    with pytest.raises(ValueError):  # wrong seq_lens dtype
        decode_attention(q, kc, kc, bt, sl.long(), torch.empty_like(q), 0.1, po, plse, 2)
    with pytest.raises(ValueError):  # fp16 scratch
        decode_attention(q, kc, kc, bt, sl, torch.empty_like(q), 0.1, po.half(), plse, 2)
