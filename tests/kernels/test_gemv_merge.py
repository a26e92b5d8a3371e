"""The output projection with split-KV decode attention's merge in its prologue
(``kernels/gemv_merge.py``) on fresh random inputs, under the Triton interpreter (or on a GPU):

* ``gemv_attn_merge`` on random partials (empty splits, one split, more splits than a pass
  takes, K tiles smaller and larger than a head, K and N tails, 1-3 K splits, 1-16 rows, bias)
  against a float32 torch merge then ``F.linear``, and against the unfused pair it replaces
  (the decode reduce launch, then :func:`kernels.gemv.gemv`);
* the chain ``decode_attention(..., merge=False)`` -> ``gemv_attn_merge`` against torch's
  attention reference (:func:`kernels.reference.decode_attention_ref`) then ``F.linear``, and
  against ``decode_attention`` (merged) -> ``gemv`` (the partials are written even for one
  split, the merged output is never touched);
* what each refuses.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from kernels.decode_attention import decode_attention, decode_scratch, merge_splits
from kernels.gemv import GemvConfig, gemv, gemv_counters
from kernels.gemv_merge import gemv_attn_merge
from kernels.reference import decode_attention_ref

from .test_prefill_attention import make_paged

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.bfloat16] if DEVICE == "cuda" else [torch.float32, torch.bfloat16]

#: (B, H, S, D, N, tiles, bias): one split, a pass of 16 and more, K tiles below / above a
#: head, a partial K tile (K 96 in splits of 64 with 64-wide tiles), N tails, 16 rows
CASES = [
    (1, 4, 5, 32, 48, GemvConfig(16, 32, 1, 4, 1), False),
    (1, 4, 1, 16, 40, GemvConfig(16, 32, 2, 4, 1), True),
    (3, 2, 17, 64, 33, GemvConfig(16, 32, 3, 4, 1), True),
    (2, 3, 33, 32, 64, GemvConfig(32, 64, 2, 4, 1), False),  # K = 96: a half tile
    (16, 2, 4, 16, 24, GemvConfig(16, 16, 1, 4, 1), True),
    (1, 6, 9, 16, 40, GemvConfig(16, 32, 2, 4, 1), False),
]


def _seed() -> int:
    return int.from_bytes(os.urandom(4), "little")


def _rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _tol(dtype) -> float:
    return 1e-5 if dtype == torch.float32 else 1.5e-2


def _partials(b, h, s, d, g):
    """Random float32 partials with some empty splits (``lse = -inf``, partial output 0 as the
    decode kernel writes it), at least one non-empty split per head."""
    po = torch.randn(b, h, s, d, generator=g)
    lse = torch.randn(b, h, s, generator=g) * 4
    empty = torch.rand(b, h, s, generator=g) < 0.3
    empty[..., 0] = False
    lse[empty] = float("-inf")
    po[empty] = 0.0
    return po, lse


def _merge_ref(po: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """float32 ``[B, H * D]``: the weighted mean of the splits' outputs, weights ``2^lse``."""
    w = torch.exp2(lse - lse.amax(2, keepdim=True))
    x = (po * w[..., None]).sum(2) / w.sum(2)[..., None]
    return x.reshape(po.shape[0], -1)


def _reduce(po: torch.Tensor, lse: torch.Tensor, dtype) -> torch.Tensor:
    """The unfused merge: the decode kernel's own reduce launch, ``[B, H * D]``."""
    b, h, _, d = po.shape
    return merge_splits(po, lse, torch.empty(b, h, d, dtype=dtype, device=po.device)).reshape(b, -1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("b, h, s, d, n, cfg, bias", CASES)
def test_gemv_attn_merge_matches_merge_then_linear(b, h, s, d, n, cfg, bias, dtype):
    seed = _seed()
    g = torch.Generator().manual_seed(seed)
    po, lse = _partials(b, h, s, d, g)
    w = (torch.randn(n, h * d, generator=g) / (h * d) ** 0.5).to(dtype)
    bias_t = torch.randn(n, generator=g).to(dtype) if bias else None
    po, lse, w = po.to(DEVICE), lse.to(DEVICE), w.to(DEVICE)
    bias_t = None if bias_t is None else bias_t.to(DEVICE)
    out = gemv_attn_merge(po, lse, w, bias_t, cfg)
    assert out.shape == (b, n) and out.dtype == dtype
    x32 = _merge_ref(po.float().cpu(), lse.float().cpu())
    ref = F.linear(x32, w.float().cpu(), None if bias_t is None else bias_t.float().cpu())
    assert _rel(out.cpu(), ref) < _tol(dtype), f"seed {seed}"
    unfused = gemv(_reduce(po, lse, dtype), w, bias_t, cfg)
    assert _rel(out, unfused) < (1e-6 if dtype == torch.float32 else 4e-3), f"seed {seed}"
    assert int(gemv_counters(out.device).abs().sum()) == 0, "arrival counters left non-zero"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "seq_lens, hq, hkv, d, num_splits",
    [([40], 4, 2, 32, 1), ([300, 17, 1], 8, 2, 32, 4), ([70, 5], 4, 4, 16, 9)],
)
def test_decode_partials_then_merge_gemv_equals_attention_then_projection(
    seq_lens, hq, hkv, d, num_splits, dtype
):
    seed = _seed()
    g = torch.Generator().manual_seed(seed)
    k_cache, v_cache, block_tables = make_paged(seq_lens, hkv, d, 16, dtype, g)
    b = len(seq_lens)
    qkv = torch.randn(b, hq + 2 * hkv, d, generator=g).to(dtype)
    w = (torch.randn(48, hq * d, generator=g) / (hq * d) ** 0.5).to(dtype)
    sl = torch.tensor(seq_lens, dtype=torch.int32)
    scale = d**-0.5
    ref_attn = torch.empty(b, hq, d)
    q = qkv[:, :hq]
    decode_attention_ref(
        q.float(), k_cache.float(), v_cache.float(), block_tables, sl, ref_attn, scale
    )
    ref = F.linear(ref_attn.reshape(b, -1), w.float())

    dev = [t.to(DEVICE) for t in (qkv, k_cache, v_cache, block_tables, sl, w)]
    qkv, k_cache, v_cache, block_tables, sl, w = dev
    q = qkv[:, :hq]
    po, plse = decode_scratch(b, hq, d, num_splits, DEVICE)
    po.fill_(float("nan"))
    plse.fill_(float("nan"))
    args = (q, k_cache, v_cache, block_tables, sl)
    assert decode_attention(*args, None, scale, po, plse, num_splits, merge=False) is None
    assert not torch.isnan(plse).any() and not torch.isnan(po).any(), "a split left unwritten"
    cfg = GemvConfig(16, 32, 2, 4, 1)
    out = gemv_attn_merge(po, plse, w, None, cfg)
    assert _rel(out.cpu(), ref) < _tol(dtype) * 2, f"seed {seed}"

    attn = torch.empty(b, hq, d, dtype=dtype, device=DEVICE)
    po2, plse2 = decode_scratch(b, hq, d, num_splits, DEVICE)
    decode_attention(*args, attn, scale, po2, plse2, num_splits)
    unfused = gemv(attn.reshape(b, -1), w, None, cfg)
    assert _rel(out, unfused) < (1e-6 if dtype == torch.float32 else 4e-3), f"seed {seed}"


def test_merge_gemv_and_partials_refuse_what_they_cannot_run():
    po, lse = torch.zeros(1, 2, 3, 16), torch.zeros(1, 2, 3)
    w = torch.zeros(8, 32)
    with pytest.raises(ValueError, match="gemv_attn_merge needs"):
        gemv_attn_merge(po, lse, torch.zeros(8, 31))  # K is not H * D
    with pytest.raises(ValueError, match="gemv_attn_merge needs"):
        gemv_attn_merge(po.half(), lse, w)  # float32 partials only
    with pytest.raises(ValueError, match="gemv_attn_merge needs"):
        gemv_attn_merge(torch.zeros(17, 2, 3, 16), torch.zeros(17, 2, 3), w)  # 17 rows
    with pytest.raises(ValueError, match="gemv_attn_merge needs"):
        gemv_attn_merge(po, torch.zeros(1, 2, 4), w)  # lse's split count differs
    k_cache = torch.zeros(4, 16, 1, 16)
    q = torch.zeros(1, 2, 16)
    bt, sl = torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32)
    po1, lse1 = decode_scratch(1, 2, 16, 1, "cpu")
    with pytest.raises(ValueError, match="out is required"):
        decode_attention(q, k_cache, k_cache, bt, sl, None, 1.0, po1, lse1, 1)
    cu = torch.tensor([0, 1], dtype=torch.int32)
    with pytest.raises(ValueError, match="merge=False is for pure decode"):
        decode_attention(q, k_cache, k_cache, bt, sl, None, 1.0, po1, lse1, 1, cu_seqlens_q=cu,
                         merge=False)  # fmt: skip
