"""qk_norm_rope_store (Triton) against the reference composition rms_norm -> rope -> store on
fresh random inputs: decode and prefill sizes, with and without the q/k norm, q/k/v as strided
views of a fused projection output, padding slots left untouched."""

import os

import pytest
import torch

from kernels.qk_norm_rope import qk_norm_rope_store
from kernels.reference import qk_norm_rope_store_ref, rms_norm_ref, rope_ref, store_kv_cache_ref

CASES = [
    # T, H_q, H_kv, D, block_size, dtype, norm
    (1, 4, 2, 64, 16, torch.float32, True),  # decode, one sequence
    (3, 16, 8, 128, 16, torch.bfloat16, True),  # decode batch, Qwen3-0.6B heads
    (37, 8, 2, 64, 32, torch.bfloat16, True),  # prefill
    (21, 20, 4, 64, 16, torch.float16, True),  # H_q not a multiple of the head tile
    (2, 16, 8, 128, 16, torch.float16, True),
    (19, 6, 2, 64, 16, torch.bfloat16, False),  # Qwen2: no q/k norm
    (9, 4, 4, 32, 16, torch.float32, False),
]


def _inputs(t, hq, hkv, d, block_size, dtype, g):
    """q/k/v as views of one [T, (H_q + 2 H_kv) * D + pad] projection output, fresh caches,
    slots with some padding, cos/sin [T, 1, D] from random positions."""
    width = (hq + 2 * hkv) * d
    qkv = torch.randn(t, width + 8, generator=g).to(dtype)[:, :width]  # row stride > width
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    q, k, v = q.view(t, hq, d), k.view(t, hkv, d), v.view(t, hkv, d)
    num_blocks = (t + block_size - 1) // block_size + 3
    k_cache = torch.randn(num_blocks, block_size, hkv, d, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, hkv, d, generator=g).to(dtype)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:t]
    if t > 2:
        slots[torch.randperm(t, generator=g)[: t // 4 + 1]] = -1  # padding tokens: not stored
    pos = torch.randint(0, 4096, (t,), generator=g).float()
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, d, 2).float() / d))
    freqs = torch.outer(pos, inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().unsqueeze(1).to(dtype), emb.sin().unsqueeze(1).to(dtype)
    q_w = (1 + 0.3 * torch.randn(d, generator=g)).to(dtype)
    k_w = (1 + 0.3 * torch.randn(d, generator=g)).to(dtype)
    return q, k, v, k_cache, v_cache, slots, cos, sin, q_w, k_w


def _close(a: torch.Tensor, b: torch.Tensor, dtype) -> bool:
    """Equal up to the rounding of the dtype.

    float32 and float16: within 1e-5 / one unit in the last place (the float32 mean square may
    differ from torch's in its last bit, which can move one rounding to float16 by an ulp; the
    kernel rounds at the same points as the reference, so float16 is otherwise bit-exact).
    bfloat16: the same bits but for under 2 % of the elements, each within two ulps of
    max(|value|, 1), and a whole-tensor relative error below 5e-3. The kernel rounds where eager
    torch rounds: under the interpreter (whose float32 -> bfloat16 cast truncates) by integer
    ops, on the GPU by the casts in a launch with FP fusion off (with it on, a rounded product
    and rotary's add became one FMA: ~20 % of q off by an ulp or more). What differs: the
    float32 mean square's order, and on the GPU its rsqrt (approximate in the last float32
    bits), each moving an intermediate rounding by one ulp now and then; rotary's difference of
    two rounded products then carries that ulp of the products (~1), not of the (possibly
    cancelled) result.
    """
    a, b = a.float(), b.float()
    if dtype == torch.float32:
        return torch.allclose(a, b, rtol=1e-5, atol=1e-5)
    eps = torch.finfo(dtype).eps
    if dtype == torch.float16:
        return bool(((a - b).abs() <= eps * b.abs() + 1e-3).all())
    rel = ((a - b).norm() / b.norm()).item()
    frac = (a != b).float().mean().item()
    ulps = bool(((a - b).abs() <= 2 * eps * b.abs().clamp_min(1.0)).all())
    return frac < 0.02 and rel < 5e-3 and ulps


def _diff(a: torch.Tensor, b: torch.Tensor) -> str:
    """The largest difference, absolute and in units of max(|reference|, 1)."""
    d = (a.float() - b.float()).abs()
    scaled = (d / b.float().abs().clamp_min(1)).max()
    return f"max |diff| {d.max():.3g}, max |diff| / max(|ref|, 1) {scaled:.3g}"


@pytest.mark.parametrize("t,hq,hkv,d,block_size,dtype,norm", CASES)
def test_matches_reference(device, t, hq, hkv, d, block_size, dtype, norm):
    seed = int.from_bytes(os.urandom(4), "little")
    g = torch.Generator().manual_seed(seed)
    q, k, v, k_cache, v_cache, slots, cos, sin, q_w, k_w = _inputs(
        t, hq, hkv, d, block_size, dtype, g
    )
    if t > 1:  # (a single token's view is trivially contiguous)
        assert not q.is_contiguous() and not k.is_contiguous() and not v.is_contiguous()
    eps = 1e-6
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    # the reference composition, spelled out (qk_norm_rope_store_ref is the same chain)
    qn, kn = (rms_norm_ref(q, q_w, eps), rms_norm_ref(k, k_w, eps)) if norm else (q, k)
    q_ref, k_rot = rope_ref(qn, kn, cos, sin)
    store_kv_cache_ref(k_rot, v, k_ref, v_ref, slots)
    k_dev, v_dev = k_cache.to(device), v_cache.to(device)
    out = qk_norm_rope_store(
        q.to(device),
        k.to(device),
        v.to(device),
        k_dev,
        v_dev,
        slots.to(device),
        cos.to(device),
        sin.to(device),
        q_w.to(device) if norm else None,
        k_w.to(device) if norm else None,
        eps,
    )
    assert out.shape == (t, hq, d) and out.dtype == dtype and out.is_contiguous()
    assert _close(out.cpu(), q_ref, dtype), f"q: seed={seed} {_diff(out.cpu(), q_ref)}"
    assert _close(k_dev.cpu(), k_ref, dtype), f"k_cache: seed={seed} {_diff(k_dev.cpu(), k_ref)}"
    assert torch.equal(v_dev.cpu(), v_ref), f"v_cache: seed={seed}"  # v is copied bit for bit
    # slots nobody stored to (padding tokens, unused slots) keep their old contents exactly
    stored = torch.zeros(k_cache.shape[0] * block_size, dtype=torch.bool)
    stored[slots[slots >= 0]] = True
    flat = k_cache.shape[0] * block_size
    untouched = ~stored
    assert torch.equal(
        k_dev.cpu().view(flat, hkv, d)[untouched], k_cache.view(flat, hkv, d)[untouched]
    ), f"seed={seed}"
    assert torch.equal(
        v_dev.cpu().view(flat, hkv, d)[untouched], v_cache.view(flat, hkv, d)[untouched]
    ), f"seed={seed}"
    # the packaged oracle is the same composition
    k2, v2 = k_cache.clone(), v_cache.clone()
    q2 = qk_norm_rope_store_ref(
        q, k, v, k2, v2, slots, cos, sin, q_w if norm else None, k_w if norm else None, eps
    )
    assert torch.equal(q2, q_ref) and torch.equal(k2, k_ref) and torch.equal(v2, v_ref)


def test_float32_exact_on_simple_inputs(device):
    """Unit weights, identity rotation (position 0) and no norm: q and k pass through bit for
    bit, so the gather/scatter addressing is checked exactly."""
    t, hq, hkv, d, bs = 5, 3, 1, 32, 16
    q = torch.randn(t, hq, d)
    kv = torch.randn(t, 2 * hkv, d)
    k, v = kv[:, :hkv], kv[:, hkv:]
    cos, sin = torch.ones(t, d), torch.zeros(t, d)
    k_cache = torch.zeros(2, bs, hkv, d, device=device)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.tensor([3, -1, 17, 0, 31], dtype=torch.int32)
    out = qk_norm_rope_store(
        q.to(device),
        k.to(device),
        v.to(device),
        k_cache,
        v_cache,
        slots.to(device),
        cos.to(device),
        sin.to(device),
    )
    assert torch.equal(out.cpu(), q)
    for i, s in enumerate(slots.tolist()):
        if s >= 0:
            assert torch.equal(k_cache.cpu()[s // bs, s % bs], k[i])
            assert torch.equal(v_cache.cpu()[s // bs, s % bs], v[i])
    assert k_cache.cpu().view(-1, hkv, d)[[1, 2, 16]].abs().sum() == 0


def test_empty_step(device):
    k_cache = torch.zeros(2, 16, 2, 64, device=device)
    q = torch.zeros(0, 4, 64, device=device)
    k = torch.zeros(0, 2, 64, device=device)
    cos = torch.zeros(0, 64, device=device)
    slots = torch.zeros(0, dtype=torch.int64, device=device)
    out = qk_norm_rope_store(q, k, k, k_cache, k_cache.clone(), slots, cos, cos)
    assert out.shape == (0, 4, 64)


def test_rejects_bad_inputs(device):
    t, d = 3, 64
    q = torch.zeros(t, 4, d, device=device)
    k = torch.zeros(t, 2, d, device=device)
    k_cache = torch.zeros(4, 16, 2, d, device=device)
    slots = torch.zeros(t, dtype=torch.int64, device=device)
    cos = torch.zeros(t, 1, d, device=device)
    w = torch.ones(d, device=device)

    def call(**kw):
        args = dict(
            q=q,
            k=k,
            v=k,
            k_cache=k_cache,
            v_cache=k_cache.clone(),
            slot_mapping=slots,
            cos=cos,
            sin=cos,
        )
        args.update(kw)
        return qk_norm_rope_store(**args)

    with pytest.raises(ValueError, match="both"):
        call(q_weight=w)
    with pytest.raises(ValueError, match="slot_mapping"):
        call(slot_mapping=slots[:2])
    with pytest.raises(ValueError, match="dtype"):
        call(q_weight=w.half(), k_weight=w.half())
    with pytest.raises(ValueError, match="cos"):
        call(cos=torch.zeros(t, 2, d, device=device))
    with pytest.raises(ValueError, match="even"):
        call(q=q[..., :63], k=k[..., :63], v=k[..., :63])
    with pytest.raises(ValueError, match="cache heads"):
        call(k=torch.zeros(t, 1, d, device=device), v=torch.zeros(t, 1, d, device=device))
