"""The q/k/v projection with the input norm and the q/k norm + rotary + KV store fused
(``kernels/gemv_qk_rope.py``) against the ops it replaces, on fresh random inputs under the
Triton interpreter (or on a GPU when one is present):

* against a float32 composition (torch's ``F.rms_norm``, ``F.linear``, the torch reference
  q/k norm + rotary + store ``qk_norm_rope_store_ref``) within bf16 rounding;
* against the same tiles' plain projection (``gemv_rms_norm``) followed by eager torch's q/k
  norm + rotary + store: q and both caches the same bits but for the few elements (under 2 %)
  where an ulp of the float32 math flips a rounding, as are ``qk_norm_rope_store``'s;

with 1-2 K splits, M = 1..16, Qwen2's bias without the q/k norm, distinct q and k norm
weights, padding slots (negative: nothing stored), int32 slots, ``[T, 1, D]`` rotary rows,
several tokens in one cache block and GQA head counts."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from kernels.gemv import GemvConfig, gemv_counters
from kernels.gemv_fused import gemv_rms_norm
from kernels.gemv_qk_rope import gemv_rms_norm_qk_rope
from kernels.qk_norm_rope import qk_norm_rope_store
from kernels.reference import qk_norm_rope_store_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
EPS = 1e-6

#: (M, Hq, Hkv, D, K, split_k, qwen2): GQA 2:1 and 1:1, split and single K, a padding slot
CASES = [
    (1, 4, 2, 32, 128, 2, False),
    (3, 2, 2, 16, 96, 1, False),
    (5, 4, 1, 32, 64, 2, True),
    (16, 2, 1, 16, 128, 2, False),
]


def _seed() -> int:
    return int.from_bytes(os.urandom(4), "little")


def _rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _inputs(m, hq, hkv, d, k, qwen2, dtype, g):
    n = (hq + 2 * hkv) * d
    x = (torch.randn(m, k, generator=g) * 3).to(DEVICE, dtype)
    res = torch.randn(m, k, generator=g).to(DEVICE, dtype)
    norm_w = (1 + 0.2 * torch.randn(k, generator=g)).to(DEVICE, dtype)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(DEVICE, dtype)
    b = torch.randn(n, generator=g).to(DEVICE, dtype) if qwen2 else None
    qk_w = (
        None if qwen2 else [(1 + 0.3 * torch.randn(d, generator=g)).to(DEVICE, dtype) for _ in "qk"]
    )
    pos = torch.randint(0, 4096, (m,), generator=g).float()
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    ang = torch.cat([pos[:, None] * inv[None, :]] * 2, dim=1)
    cos, sin = ang.cos().to(DEVICE, dtype), ang.sin().to(DEVICE, dtype)
    if m % 2:  # the rotary table's [T, 1, D] layout (the model's)
        cos, sin = cos[:, None], sin[:, None]
    block_size, blocks = 16, 4
    slots = torch.randperm(block_size * blocks, generator=g)[:m]
    slots[m // 2] = -1 if m > 2 else slots[m // 2]  # a padding row stores nothing
    cache = torch.randn(blocks, block_size, hkv, d, generator=g).to(DEVICE, dtype)
    slots = slots.to(torch.int32) if m == 3 else slots  # int32 slots are taken too
    return x, res, norm_w, w, b, qk_w, cos, sin, slots.to(DEVICE), cache


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("m, hq, hkv, d, k, split_k, qwen2", CASES)
def test_matches_unfused_kernels_and_float32_reference(m, hq, hkv, d, k, split_k, qwen2, dtype):
    if DEVICE == "cuda" and dtype == torch.float32:
        pytest.skip("float32 is the interpreter's exactness check")
    seed = _seed()
    g = torch.Generator().manual_seed(seed)
    x, res, norm_w, w, b, qk_w, cos, sin, slots, cache = _inputs(m, hq, hkv, d, k, qwen2, dtype, g)
    q_w, k_w = (None, None) if qk_w is None else qk_w
    cfg = GemvConfig(block_n=d, block_k=32, split_k=split_k, num_warps=4, num_stages=1)
    kc, vc = cache.clone(), cache.clone()
    qkv, new_res = gemv_rms_norm_qk_rope(
        x, norm_w, EPS, w, b, res, hq, hkv, kc, vc, slots, cos, sin, q_w, k_w, EPS, cfg
    )
    # the unfused kernels with the same tiles
    plain, plain_res = gemv_rms_norm(x, norm_w, EPS, w, b, res, GemvConfig(d, 32, split_k, 4, 1))
    q, kk, v = plain.split([hq * d, hkv * d, hkv * d], dim=1)
    kc2, vc2 = cache.clone(), cache.clone()
    view = (m, -1, d)
    q_rot = qk_norm_rope_store(
        q.view(view), kk.view(view), v.view(view), kc2, vc2, slots, cos, sin, q_w, k_w, EPS
    )
    assert torch.equal(new_res, plain_res), "the new residual is not x + residual"
    assert int(gemv_counters(qkv.device).abs().sum()) == 0, "arrival counters left non-zero"
    # float32 composition: torch's RMSNorm and product, the torch q/k norm + rotary + store
    h = plain_res.float()
    b32 = None if b is None else b.float()
    y32 = F.linear(F.rms_norm(h, (k,), norm_w.float(), EPS), w.float(), b32)
    q32, k32, v32 = y32.split([hq * d, hkv * d, hkv * d], dim=1)
    kc3, vc3 = cache.float().clone(), cache.float().clone()
    q_ref = qk_norm_rope_store_ref(
        q32.view(view), k32.view(view), v32.view(view), kc3, vc3, slots, cos.float(),
        sin.float(), None if q_w is None else q_w.float(), None if k_w is None else k_w.float(),
        EPS,
    )  # fmt: skip
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert _rel(qkv[:, : hq * d].view(view), q_ref) < tol, f"seed {seed}"
    assert _rel(kc, kc3) < tol and _rel(vc, vc3) < tol, f"seed {seed}"
    # bit for bit (nearly) against eager torch's q/k norm + rotary + store of the plain
    # projection (the roundings the kernels follow): an element may differ where the sum of
    # squares' order flips a rounding (under 2 %); roundings FMA contraction skipped showed
    # here as ~20 % (up to 60 ulps near cancellation). The unfused kernel follows the same
    # roundings (integer ops under the interpreter, casts with FP fusion off on the GPU)
    kc4, vc4 = cache.clone(), cache.clone()
    q_eager = qk_norm_rope_store_ref(
        q.view(view), kk.view(view), v.view(view), kc4, vc4, slots, cos, sin, q_w, k_w, EPS
    )
    fused_q = qkv[:, : hq * d].view(view)
    pairs = [("q", fused_q, q_eager), ("k cache", kc, kc4), ("v cache", vc, vc4)]
    pairs += [("unfused q", q_rot, q_eager), ("unfused k cache", kc2, kc4)]
    for what, a, ref in pairs:
        if dtype == torch.float32:  # float32 sums in another order: ulps, not bits
            assert _rel(a, ref) < 1e-6, f"{what} (seed {seed})"
            continue
        frac = (a != ref).float().mean().item()
        assert frac < 0.02, f"{what}: {frac:.1%} differs from the eager ops' (seed {seed})"
    untouched = torch.ones(cache.shape[0] * cache.shape[1], dtype=torch.bool)
    untouched[slots[slots >= 0].cpu()] = False
    flat = cache.reshape(-1, hkv, d)
    assert torch.equal(kc.reshape(-1, hkv, d)[untouched.to(DEVICE)], flat[untouched.to(DEVICE)])
    assert torch.equal(vc.reshape(-1, hkv, d)[untouched.to(DEVICE)], flat[untouched.to(DEVICE)])
    # v in the output as projected, k rotated as stored
    assert torch.equal(qkv[:, (hq + hkv) * d :], plain[:, (hq + hkv) * d :])


def test_first_layer_and_refusals():
    g = torch.Generator().manual_seed(_seed())
    x, res, norm_w, w, b, qk_w, cos, sin, slots, cache = _inputs(
        2, 2, 1, 16, 64, False, torch.float32, g
    )
    kc, vc = cache.clone(), cache.clone()
    args = (2, 1, kc, vc, slots, cos, sin, *qk_w, EPS)
    qkv, new_res = gemv_rms_norm_qk_rope(x, norm_w, EPS, w, None, None, *args)
    assert new_res is None and qkv.shape == (2, 64)
    plain, _ = gemv_rms_norm(x, norm_w, EPS, w, None, None)
    assert _rel(qkv[:, 48:], plain[:, 48:]) < 1e-6  # v unchanged
    # strided slots and norm weights (views) give the same result and the same stores
    kc2, vc2 = cache.clone(), cache.clone()
    strided = [torch.stack([t, t], 1)[:, 0] for t in (slots, *qk_w)]
    qkv2, _ = gemv_rms_norm_qk_rope(x, norm_w, EPS, w, None, None, 2, 1, kc2, vc2, strided[0],
                                    cos, sin, *strided[1:], EPS)  # fmt: skip
    assert torch.equal(qkv2, qkv) and torch.equal(kc2, kc) and torch.equal(vc2, vc)
    with pytest.raises(ValueError, match="block_n"):
        gemv_rms_norm_qk_rope(x, norm_w, EPS, w, None, None, *args, GemvConfig(block_n=32))
    with pytest.raises(ValueError, match="heads"):
        gemv_rms_norm_qk_rope(x, norm_w, EPS, w, None, None, 3, 1, kc, vc, slots, cos, sin,
                              *qk_w, EPS)  # fmt: skip
    small = [torch.zeros(4, 16, 1, 8)] * 2  # head_dim 8: under the MMA's 16
    with pytest.raises(ValueError, match="power of two"):
        gemv_rms_norm_qk_rope(x, norm_w, EPS, w[:32], None, None, 2, 1, *small, slots, cos[:, :8],
                              sin[:, :8], None, None, EPS)  # fmt: skip
    with pytest.raises(ValueError, match="both"):
        gemv_rms_norm_qk_rope(x, norm_w, EPS, w, None, None, 2, 1, kc, vc, slots, cos, sin,
                              qk_w[0], None, EPS)  # fmt: skip
    with pytest.raises(ValueError, match="slot_mapping"):
        gemv_rms_norm_qk_rope(x, norm_w, EPS, w, None, None, 2, 1, kc, vc, slots[:1], cos,
                              sin, *qk_w, EPS)  # fmt: skip
    with pytest.raises(ValueError, match="dtype"):
        gemv_rms_norm_qk_rope(x, norm_w, EPS, w, None, None, 2, 1, kc.half(), vc.half(),
                              slots, cos, sin, *qk_w, EPS)  # fmt: skip
