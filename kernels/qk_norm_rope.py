"""Triton kernel: Qwen3's per-head q/k RMSNorm, the rotary embedding and the KV-cache store of
one layer in one launch.

Between the qkv projection and attention a Qwen3 layer otherwise runs the q/k norm + rotary
(one or two Inductor kernels) and :func:`kernels.kv_cache.store_kv_cache`; here one program
per (token, tile of heads) reads its rows of q, or of k and v, once, normalizes and rotates
them in registers and writes q to a new tensor and k, v to their cache slots. Qwen2 (no q/k
norm) runs the same kernel with the norm compiled out (``HAS_NORM=False``).

Layouts are those of :mod:`kernels.reference`; the oracle is
:func:`kernels.reference.qk_norm_rope_store_ref`. Imports only torch and triton.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.interpreter import interpreting as _interpreting
from kernels.pdl import pdl_kwargs, pdl_wait
from kernels.rounding import round_as

__all__ = ["qk_norm_rope_store", "norm_rope_rows", "norm_rope_halves", "rope_table_strides"]


@triton.jit
def norm_rope_halves(
    x1f,
    x2f,
    w1,
    w2,
    c1,
    c2,
    s1,
    s2,
    head_dim,
    eps,
    dtype: tl.constexpr,
    AXIS: tl.constexpr,
    HAS_NORM: tl.constexpr,
    EXACT: tl.constexpr,
):
    """The two halves ``x1f``, ``x2f`` (float32 holding values of ``dtype``; the head dimension
    along ``AXIS``) of rows normalized (HAS_NORM: RMSNorm over the ``head_dim`` features, weight
    halves ``w1``, ``w2``) and rotated (rotate-half: ``o1 = x1 cos1 - x2 sin1``, ``o2 = x2 cos2 + x1
    sin2``); ``w*``, ``c*``, ``s*`` broadcast against the halves. Returns ``(o1, o2)`` in ``dtype``,
    rounded wherever eager torch rounds (rms_norm_ref's cast before the weight, each product and the
    sum of rope_ref), so the results match the reference composition where the roundings happen.
    ``EXACT``: each rounding by :func:`kernels.rounding.rounded` (integer ops: exact on the GPU
    with FP fusion on, and under the interpreter); else the plain casts, exact on the GPU only in
    a kernel launched with ``enable_fp_fusion=False`` (with fusion on, a rounded product and
    rotary's add become one FMA: up to 60 bf16 ulps off eager near cancellation, ~20 % of the
    elements differing, H100/H200 2026-12-06; module docstring of ``kernels.rounding``). Shared
    by :func:`_norm_rope_tile` (``qk_norm_rope_store``: casts with FP fusion off on the GPU,
    exact under the interpreter) and the q/k/v projection's epilogue (``kernels.gemv_qk_rope``:
    exact, its GEMV keeping FP fusion)."""
    if HAS_NORM:
        mean_sq = (tl.sum(x1f * x1f, axis=AXIS) + tl.sum(x2f * x2f, axis=AXIS)) / head_dim
        r = tl.expand_dims(tl.rsqrt(mean_sq + eps), AXIS)
        x1f = round_as(w1 * round_as(x1f * r, dtype, EXACT), dtype, EXACT)
        x2f = round_as(w2 * round_as(x2f * r, dtype, EXACT), dtype, EXACT)
    a1 = round_as(x1f * c1, dtype, EXACT)
    b1 = round_as(x2f * s1, dtype, EXACT)
    a2 = round_as(x2f * c2, dtype, EXACT)
    b2 = round_as(x1f * s2, dtype, EXACT)
    return round_as(a1 - b1, dtype, EXACT).to(dtype), round_as(a2 + b2, dtype, EXACT).to(dtype)


@triton.jit
def _norm_rope_tile(
    x_ptr,
    offs_h,
    offs_j,
    mask,
    stride_h,
    stride_d,
    w_ptr,
    c1,
    c2,
    s1,
    s2,
    head_dim,
    half,
    eps,
    HAS_NORM: tl.constexpr,
    EXACT: tl.constexpr,
):
    """Rows ``offs_h`` of one token's ``[H, D]`` slice at ``x_ptr``, normalized (HAS_NORM) and
    rotated: returns the two halves ``[BLOCK_H, BLOCK_HALF]`` in the input dtype
    (:func:`norm_rope_halves`, ``EXACT`` as there)."""
    base = x_ptr + offs_h[:, None] * stride_h
    x1 = tl.load(base + offs_j[None, :] * stride_d, mask=mask, other=0.0)
    x2 = tl.load(base + (offs_j[None, :] + half) * stride_d, mask=mask, other=0.0)
    w1 = 0.0
    w2 = 0.0
    if HAS_NORM:
        j_mask = offs_j < half
        w1 = tl.load(w_ptr + offs_j, mask=j_mask, other=0.0).to(tl.float32)[None, :]
        w2 = tl.load(w_ptr + half + offs_j, mask=j_mask, other=0.0).to(tl.float32)[None, :]
    return norm_rope_halves(
        x1.to(tl.float32), x2.to(tl.float32), w1, w2, c1, c2, s1, s2, head_dim, eps, x1.dtype,
        1, HAS_NORM, EXACT,
    )  # fmt: skip


@triton.jit
def norm_rope_rows(
    x_ptr,
    offs_h,
    h_mask,
    stride_h,
    stride_d,
    w_ptr,
    cos_row,
    sin_row,
    stride_cos_d,
    stride_sin_d,
    eps,
    HEAD_DIM: tl.constexpr,
    HAS_NORM: tl.constexpr,
    EXACT: tl.constexpr,
):
    """Rows ``offs_h`` (``[BLOCK]``, valid where ``h_mask``) of one token's ``[H, D]`` slice at
    ``x_ptr``, RMS-normalized (HAS_NORM, weight ``w_ptr [D]``) and rotated with the token's
    ``cos_row`` / ``sin_row`` (``[D]``): ``[BLOCK, HEAD_DIM]`` in the input dtype (0 in masked
    rows), for a consumer that wants whole rows (the fused decode prologue). Each element's
    rotate-half partner (``d +- D/2``) is loaded beside it; the roundings to the input dtype are
    :func:`_norm_rope_tile`'s, ``EXACT`` as in :func:`norm_rope_halves` (the decode kernel keeps FP
    fusion on; its sm_90 PTX has no bf16 FMA here, only the float32 sum of squares contracted).
    ``HEAD_DIM``: a power of two."""
    half: tl.constexpr = HEAD_DIM // 2
    offs_d = tl.arange(0, HEAD_DIM)
    partner = (offs_d + half) % HEAD_DIM
    base = x_ptr + offs_h[:, None] * stride_h
    mask = h_mask[:, None]
    x = tl.load(base + offs_d[None, :] * stride_d, mask=mask, other=0.0)
    dtype = x.dtype
    xf = x.to(tl.float32)
    xpf = tl.load(base + partner[None, :] * stride_d, mask=mask, other=0.0).to(tl.float32)
    if HAS_NORM:
        w = tl.load(w_ptr + offs_d).to(tl.float32)[None, :]
        wp = tl.load(w_ptr + partner).to(tl.float32)[None, :]
        r = tl.rsqrt(tl.sum(xf * xf, axis=1) / HEAD_DIM + eps)[:, None]
        xf = round_as(w * round_as(xf * r, dtype, EXACT), dtype, EXACT)
        xpf = round_as(wp * round_as(xpf * r, dtype, EXACT), dtype, EXACT)
    c = tl.load(cos_row + offs_d * stride_cos_d).to(tl.float32)[None, :]
    sn = tl.load(sin_row + offs_d * stride_sin_d).to(tl.float32)[None, :]
    a = round_as(xf * c, dtype, EXACT)
    b = round_as(xpf * sn, dtype, EXACT)
    # rotate-half: the first half takes x1 cos - x2 sin, the second x2 cos + x1 sin
    return round_as(tl.where(offs_d[None, :] < half, a - b, a + b), dtype, EXACT).to(dtype)


@triton.jit
def _qk_norm_rope_store_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    q_out_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    cos_ptr,
    sin_ptr,
    q_w_ptr,
    k_w_ptr,
    stride_qt,
    stride_qh,
    stride_qd,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_vt,
    stride_vh,
    stride_vd,
    stride_ot,
    stride_oh,
    stride_od,
    stride_cb,  # cache strides (k_cache and v_cache are checked to share them)
    stride_co,
    stride_ch,
    stride_cd,
    stride_cos_t,
    stride_cos_d,
    stride_sin_t,
    stride_sin_d,
    num_q_heads,
    num_kv_heads,
    num_q_tiles,
    head_dim,
    eps,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    HAS_NORM: tl.constexpr,
    EXACT: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_wait(PDL)  # programmatic dependent launch (kernels.pdl): q/k/v come from the last kernel
    # One program per (token, tile of BLOCK_H heads): tiles 0 .. num_q_tiles - 1 are query heads
    # (written to q_out), the following ones KV heads (k normalized and rotated, v copied, both
    # into the cache slot of the token).
    tok = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1)
    half = head_dim // 2
    offs_j = tl.arange(0, BLOCK_HALF)
    j_mask = offs_j < half
    # this token's cos/sin halves, [1, BLOCK_HALF], broadcast over the heads
    cos_row = cos_ptr + tok * stride_cos_t
    sin_row = sin_ptr + tok * stride_sin_t
    c1 = tl.load(cos_row + offs_j * stride_cos_d, mask=j_mask, other=0.0).to(tl.float32)[None, :]
    c2 = tl.load(cos_row + (offs_j + half) * stride_cos_d, mask=j_mask, other=0.0).to(tl.float32)[
        None, :
    ]
    s1 = tl.load(sin_row + offs_j * stride_sin_d, mask=j_mask, other=0.0).to(tl.float32)[None, :]
    s2 = tl.load(sin_row + (offs_j + half) * stride_sin_d, mask=j_mask, other=0.0).to(tl.float32)[
        None, :
    ]
    if tile < num_q_tiles:
        offs_h = tile * BLOCK_H + tl.arange(0, BLOCK_H)
        mask = (offs_h[:, None] < num_q_heads) & j_mask[None, :]
        o1, o2 = _norm_rope_tile(
            q_ptr + tok * stride_qt,
            offs_h,
            offs_j,
            mask,
            stride_qh,
            stride_qd,
            q_w_ptr,
            c1,
            c2,
            s1,
            s2,
            head_dim,
            half,
            eps,
            HAS_NORM,
            EXACT,
        )
        dst = q_out_ptr + tok * stride_ot + offs_h[:, None] * stride_oh
        tl.store(dst + offs_j[None, :] * stride_od, o1, mask=mask)
        tl.store(dst + (offs_j[None, :] + half) * stride_od, o2, mask=mask)
    else:
        slot = tl.load(slot_ptr + tok).to(tl.int64)
        offs_h = (tile - num_q_tiles) * BLOCK_H + tl.arange(0, BLOCK_H)
        h_limit = tl.where(slot >= 0, num_kv_heads, 0)  # negative slot: store nothing
        mask = (offs_h[:, None] < h_limit) & j_mask[None, :]
        o1, o2 = _norm_rope_tile(
            k_ptr + tok * stride_kt,
            offs_h,
            offs_j,
            mask,
            stride_kh,
            stride_kd,
            k_w_ptr,
            c1,
            c2,
            s1,
            s2,
            head_dim,
            half,
            eps,
            HAS_NORM,
            EXACT,
        )
        safe_slot = tl.maximum(slot, 0)
        # (a name of its own: Triton merges a variable assigned in both branches, and this one is
        # an offset where the query branch's ``dst`` is a pointer)
        cache_off = (
            (safe_slot // BLOCK_SIZE) * stride_cb
            + (safe_slot % BLOCK_SIZE) * stride_co
            + offs_h[:, None] * stride_ch
        )
        lo = cache_off + offs_j[None, :] * stride_cd
        hi = cache_off + (offs_j[None, :] + half) * stride_cd
        tl.store(k_cache_ptr + lo, o1, mask=mask)
        tl.store(k_cache_ptr + hi, o2, mask=mask)
        v_row = v_ptr + tok * stride_vt + offs_h[:, None] * stride_vh
        v1 = tl.load(v_row + offs_j[None, :] * stride_vd, mask=mask)
        v2 = tl.load(v_row + (offs_j[None, :] + half) * stride_vd, mask=mask)
        tl.store(v_cache_ptr + lo, v1, mask=mask)
        tl.store(v_cache_ptr + hi, v2, mask=mask)


def rope_table_strides(x: torch.Tensor, t: int, d: int, name: str) -> tuple[int, int]:
    """(token stride, dim stride) of a cos/sin table ``[T, D]`` or ``[T, 1, D]``.

    Raises:
        ValueError: another shape (naming ``name``).
    """
    if x.dim() == 3 and x.shape[1] == 1:
        x = x[:, 0]
    if x.dim() != 2 or tuple(x.shape) != (t, d):
        raise ValueError(f"{name} must be [T={t}, D={d}] or [T, 1, D], got {tuple(x.shape)}")
    return x.stride(0), x.stride(1)


def qk_norm_rope_store(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    q_weight: torch.Tensor | None = None,
    k_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Per-head RMSNorm of q and k, rotary embedding (rotate-half), and the store of k and v
    into the paged cache, in one launch (Triton).

    Same results as :func:`kernels.reference.qk_norm_rope_store_ref` up to the float32
    reduction order of the mean square (the rounding to the model dtype happens at the same
    points: after the normalization, after the weight, after each rotary product and sum).

    Args:
        q: ``[T, H_q, D]``; k, v: ``[T, H_kv, D]``, D even; any strides (e.g. views into the
            fused qkv projection output). One dtype for q, k, v, caches, cos, sin and weights.
        k_cache, v_cache: ``[num_blocks, block_size, H_kv, D]`` with identical shapes and
            strides, the last dimension contiguous; updated in place with the rotated k and
            the unchanged v. Any ``block_size``.
        slot_mapping: int64 (int32 accepted) ``[T]``; ``slot = block * block_size + offset``; a
            negative slot stores nothing (padding tokens; their q is still computed).
        cos, sin: ``[T, D]`` or ``[T, 1, D]``, the rotary table rows of the tokens' positions.
        q_weight, k_weight: ``[D]`` RMSNorm weights (Qwen3), or both None: no norm (Qwen2).
        eps: RMSNorm epsilon.

    Returns:
        The rotated q as a new contiguous ``[T, H_q, D]`` tensor in q's dtype.

    Raises:
        ValueError: mismatched shapes, dtypes, devices or strides; an odd D; only one of the
            two norm weights given.

    The grid depends only on T and the head counts and the launch reads no host values, so it
    can be captured in a CUDA graph.
    """
    if q.dim() != 3 or k.dim() != 3 or v.shape != k.shape:
        raise ValueError(
            f"q must be [T, H_q, D] and k/v [T, H_kv, D] of equal shape, got {tuple(q.shape)}, "
            f"{tuple(k.shape)}, {tuple(v.shape)}"
        )
    t, h_q, d = q.shape
    _, h_kv, _ = k.shape
    if k.shape[0] != t or k.shape[2] != d:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} disagree on T or D")
    if d % 2:
        raise ValueError(f"head_dim must be even for rotate-half rotary, got {d}")
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError("k_cache/v_cache must be [num_blocks, block_size, H_kv, D] of equal shape")
    if k_cache.stride() != v_cache.stride():
        raise ValueError("k_cache and v_cache must have identical strides")
    if k_cache.stride(-1) != 1:
        raise ValueError("cache last dimension must be contiguous")
    block_size = k_cache.shape[1]
    if tuple(k_cache.shape[2:]) != (h_kv, d):
        raise ValueError(
            f"cache heads/head_dim {tuple(k_cache.shape[2:])} do not match k {(h_kv, d)}"
        )
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] != t:
        raise ValueError(f"slot_mapping must be [T={t}], got {tuple(slot_mapping.shape)}")
    if slot_mapping.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"slot_mapping must be int64 or int32, got {slot_mapping.dtype}")
    cos_strides = rope_table_strides(cos, t, d, "cos")
    sin_strides = rope_table_strides(sin, t, d, "sin")
    if (q_weight is None) != (k_weight is None):
        raise ValueError("q_weight and k_weight must both be given or both be None")
    has_norm = q_weight is not None
    tensors = [q, k, v, k_cache, v_cache, cos, sin]
    if has_norm:
        if q_weight.shape != (d,) or k_weight.shape != (d,):
            raise ValueError(
                f"q_weight/k_weight must be [D={d}], got {tuple(q_weight.shape)}, "
                f"{tuple(k_weight.shape)}"
            )
        tensors += [q_weight, k_weight]
    if len({x.dtype for x in tensors}) != 1:
        raise ValueError(
            "q, k, v, the caches, cos, sin and the norm weights must share one dtype, got "
            f"{sorted({str(x.dtype) for x in tensors})}"
        )
    devs = {x.device for x in tensors} | {slot_mapping.device}
    if len(devs) != 1:
        raise ValueError(f"all tensors must be on one device, got {devs}")
    q_out = torch.empty((t, h_q, d), dtype=q.dtype, device=q.device)
    if t == 0:
        return q_out
    block_h = 16  # tiles >= 16 in every dimension; rows past the head count are masked
    block_half = max(16, triton.next_power_of_2(d // 2))
    num_q_tiles = triton.cdiv(h_q, block_h)
    grid = (t, num_q_tiles + triton.cdiv(h_kv, block_h))
    pdl = pdl_kwargs(q.device)
    _qk_norm_rope_store_kernel[grid](
        q,
        k,
        v,
        q_out,
        k_cache,
        v_cache,
        slot_mapping,
        cos,
        sin,
        q_weight if has_norm else q,  # unused pointers when HAS_NORM is False
        k_weight if has_norm else k,
        *q.stride(),
        *k.stride(),
        *v.stride(),
        *q_out.stride(),
        *k_cache.stride(),
        *cos_strides,
        *sin_strides,
        h_q,
        h_kv,
        num_q_tiles,
        d,
        float(eps),
        BLOCK_SIZE=block_size,
        BLOCK_H=block_h,
        BLOCK_HALF=block_half,
        HAS_NORM=has_norm,
        # the roundings of eager torch: under the interpreter (whose bfloat16 cast truncates)
        # by integer ops; on the GPU by the casts, with FP fusion off, else LLVM turns a rounded
        # product into a bfloat16 multiply and contracts it with rotary's add into an FMA
        EXACT=_interpreting(),
        enable_fp_fusion=False,
        **pdl,
    )
    return q_out
