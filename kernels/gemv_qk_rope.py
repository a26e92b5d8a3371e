"""The q/k/v projection of a decode step in one launch: residual add + RMSNorm in the small-M
GEMV's prologue (:func:`kernels.gemv_fused.gemv_rms_norm`'s), and Qwen3's per-head q/k RMSNorm,
the rotary embedding and the KV-cache store in its epilogue
(:func:`kernels.qk_norm_rope.qk_norm_rope_store`'s work).

At batch 1 the step between the q/k/v projection and the split-KV decode kernel was a launch of
its own (``_qk_norm_rope_store_kernel``, 28 per Qwen3-0.6B step): a few hundred bytes of work
whose cost is the kernel boundary (issue 19). Here each N tile of the projection is one head
(``BLOCK_N == head_dim``), so the program that finishes a tile -- the only one with a split, the
last-arriving one with split-K (:func:`kernels.gemv.split_k_total`) -- holds the whole head row
of every token and applies the rest in registers: the output rounded to the model dtype as the
plain GEMV stores it, then for a query head RMSNorm (Qwen3) and rotate-half rotary (the tile's
two halves ``d < D/2`` and ``d >= D/2`` split apart in registers), for a key head the same and
the store into the token's cache slot, for a value head the store alone. The norm and rotary
are :func:`kernels.qk_norm_rope.norm_rope_halves`, with the roundings of
``kernels.reference.qk_norm_rope_store_ref`` (eager torch's) done by integer ops
(:func:`kernels.rounding.rounded`: with plain casts the GPU compile contracted rounded products
into FMAs, and the GEMV's loop keeps FP fusion on), so for bfloat16 the fused q/k/v equal the
plain projection followed by the eager ops wherever the float32 math agrees (float16's
roundings are casts, which FMAs may still skip).

The tile layout (``[Hq + 2 Hkv] x D`` output features: this rank's q heads, then its k heads,
then its v heads) is ``engine.layers.linear.QKVParallelLinear``'s. Tiles come from the fused
table (kind ``qkv_rope``, :func:`kernels.gemv_fused.fused_gemv_config`) and must have
``block_n == head_dim``; the H200's enables it for M = 2..16 only (at batch 1 the decode step was
1 % slower with it, the decode kernel waiting out the last program's whole-head epilogue).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.gemv import GemvConfig, split_k_total, split_plan
from kernels.gemv_fused import (
    _check,
    fused_gemv_config,
    launch_flags,
    norm_operands,
    norm_outputs,
    rms_norm_gemv_acc,
)
from kernels.interpreter import interpreting as _interpreting
from kernels.qk_norm_rope import norm_rope_halves, rope_table_strides
from kernels.rounding import round_as

__all__ = ["gemv_rms_norm_qk_rope"]


@triton.jit
def _qk_rope_epilogue(
    y,
    head,
    rm,
    m_ok,
    out_ptr,
    stride_om,
    slot_ptr,
    cos_ptr,
    sin_ptr,
    stride_cos_t,
    stride_cos_d,
    stride_sin_t,
    stride_sin_d,
    q_w_ptr,
    k_w_ptr,
    k_cache_ptr,
    v_cache_ptr,
    stride_cb,
    stride_co,
    stride_ch,
    stride_cd,
    num_q_heads,
    num_kv_heads,
    qk_eps,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HAS_QK_NORM: tl.constexpr,
):
    """Head ``head`` of the projection, ``y [HEAD_DIM, BLOCK_M]`` (float32 holding the values the
    GEMV stores in the model dtype; token ``rm`` in column ``rm``, valid where ``m_ok``): q/k heads
    normalized and rotated, k and v heads stored into their tokens' cache slots (a negative slot
    stores nothing), and every head written to its ``out`` columns."""
    dtype = out_ptr.dtype.element_ty
    half: tl.constexpr = HEAD_DIM // 2
    j = tl.arange(0, half)
    lo = (head * HEAD_DIM + j)[:, None]  # output columns of the first half
    o_row = out_ptr + rm[None, :] * stride_om
    mask = m_ok[None, :] & (j < half)[:, None]  # [half, BLOCK_M]
    is_q = head < num_q_heads
    is_v = head >= num_q_heads + num_kv_heads
    slot = tl.load(slot_ptr + rm, mask=m_ok, other=-1).to(tl.int64)  # (unused for a q head)
    safe = tl.maximum(slot, 0)
    kv_head = tl.where(is_v, head - num_q_heads - num_kv_heads, head - num_q_heads)
    c_off = ((safe // BLOCK_SIZE) * stride_cb + (safe % BLOCK_SIZE) * stride_co
             + kv_head * stride_ch)[None, :] + j[:, None] * stride_cd  # fmt: skip
    c_ok = mask & (slot >= 0)[None, :]
    # the tile's two halves [half, BLOCK_M] (rows d and d + D/2): [D, M] -> [D/2, M, 2] -> split
    y1, y2 = tl.split(tl.permute(tl.reshape(y, (2, half, BLOCK_M)), (1, 2, 0)))
    if is_v:  # as projected: the output and the token's v cache slot (exact casts)
        v1, v2 = y1.to(dtype), y2.to(dtype)
        tl.store(o_row + lo, v1, mask=mask)
        tl.store(o_row + lo + half, v2, mask=mask)
        tl.store(v_cache_ptr + c_off, v1, mask=c_ok)
        tl.store(v_cache_ptr + c_off + half * stride_cd, v2, mask=c_ok)
    else:  # q or k: normalized and rotated
        w1 = 0.0
        w2 = 0.0
        if HAS_QK_NORM:
            w1 = tl.where(is_q, tl.load(q_w_ptr + j), tl.load(k_w_ptr + j)).to(tl.float32)
            w2 = tl.where(is_q, tl.load(q_w_ptr + half + j), tl.load(k_w_ptr + half + j))
            w1 = w1[:, None]
            w2 = w2.to(tl.float32)[:, None]
        cos = cos_ptr + rm[None, :] * stride_cos_t + j[:, None] * stride_cos_d
        sin = sin_ptr + rm[None, :] * stride_sin_t + j[:, None] * stride_sin_d
        c1 = tl.load(cos, mask=mask, other=0.0).to(tl.float32)
        c2 = tl.load(cos + half * stride_cos_d, mask=mask, other=0.0).to(tl.float32)
        s1 = tl.load(sin, mask=mask, other=0.0).to(tl.float32)
        s2 = tl.load(sin + half * stride_sin_d, mask=mask, other=0.0).to(tl.float32)
        # rounded by integer ops (EXACT): plain casts were contracted into FMAs with rotary's
        # add on the GPU (up to 60 ulps off eager near cancellation)
        o1, o2 = norm_rope_halves(
            y1, y2, w1, w2, c1, c2, s1, s2, HEAD_DIM, qk_eps, dtype, 0, HAS_QK_NORM, True
        )
        tl.store(o_row + lo, o1, mask=mask)
        tl.store(o_row + lo + half, o2, mask=mask)
        if head >= num_q_heads:  # a key head: into the token's k cache slot
            tl.store(k_cache_ptr + c_off, o1, mask=c_ok)
            tl.store(k_cache_ptr + c_off + half * stride_cd, o2, mask=c_ok)


@triton.jit
def _gemv_rms_norm_qk_rope_kernel(
    x_ptr,
    res_ptr,
    norm_w_ptr,
    res_out_ptr,
    w_ptr,
    bias_ptr,
    out_ptr,
    part_ptr,
    counter_ptr,
    slot_ptr,
    cos_ptr,
    sin_ptr,
    q_w_ptr,
    k_w_ptr,
    k_cache_ptr,
    v_cache_ptr,
    M,
    N,
    K,
    K_PER_SPLIT,
    stride_xm,
    stride_rm,
    stride_rom,
    stride_wn,
    stride_om,
    stride_cos_t,
    stride_cos_d,
    stride_sin_t,
    stride_sin_d,
    stride_cb,
    stride_co,
    stride_ch,
    stride_cd,
    num_q_heads,
    num_kv_heads,
    eps,
    qk_eps,
    BLOCK_M: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    HAS_QK_NORM: tl.constexpr,
    EVEN_K: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PREC: tl.constexpr,
    EMULATE_RNE: tl.constexpr,
    PDL: tl.constexpr = False,
    PREFETCH: tl.constexpr = False,
):
    """Program ``(head, k split)``: :func:`kernels.gemv_fused.rms_norm_gemv_acc` over the head's
    ``HEAD_DIM`` weight rows, the serial split-K sum, then :func:`_qk_rope_epilogue` in the
    program holding the finished head."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rn = pid_n * HEAD_DIM + tl.arange(0, HEAD_DIM)
    rn_c = rn.to(tl.int64)  # N is a whole number of heads: every row is in bounds
    rm = tl.arange(0, BLOCK_M)
    m_ok = rm < M
    acc = rms_norm_gemv_acc(
        x_ptr, res_ptr, norm_w_ptr, res_out_ptr, w_ptr, M, K, K_PER_SPLIT, stride_xm, stride_rm,
        stride_rom, stride_wn, eps, pid_n, pid_k, rn_c, rm, m_ok, BLOCK_M, HEAD_DIM, BLOCK_K,
        HAS_RESIDUAL, EVEN_K, UPCAST, DOT_PREC, EMULATE_RNE, PDL, PREFETCH,
    )  # fmt: skip
    mask = m_ok[None, :] & (rn < N)[:, None]
    total, last = split_k_total(
        acc, part_ptr, counter_ptr, M, N, pid_n, pid_k, rn, rm, mask, SPLIT_K, HEAD_DIM,
        BLOCK_M, SPLIT_K > 1,
    )  # fmt: skip
    if last:
        if HAS_BIAS:
            total += tl.load(bias_ptr + rn_c).to(tl.float32)[:, None]
        # the projection's output as the plain GEMV stores it, kept in float32: on the GPU
        # rounded by integer ops (no FMA contraction can skip it); under the interpreter by its
        # truncating cast, as the plain GEMV's store is there
        y = round_as(total, out_ptr.dtype.element_ty, not EMULATE_RNE)
        _qk_rope_epilogue(
            y, pid_n, rm, m_ok, out_ptr, stride_om, slot_ptr, cos_ptr, sin_ptr, stride_cos_t,
            stride_cos_d, stride_sin_t, stride_sin_d, q_w_ptr, k_w_ptr, k_cache_ptr,
            v_cache_ptr, stride_cb, stride_co, stride_ch, stride_cd, num_q_heads, num_kv_heads,
            qk_eps, HEAD_DIM, BLOCK_M, BLOCK_SIZE, HAS_QK_NORM,
        )  # fmt: skip


def qk_rope_config(m: int, n: int, k: int, head_dim: int, device: torch.device):
    """The tiles of :func:`gemv_rms_norm_qk_rope` for ``[M, K] x [K, N]`` on ``device``: the
    fused table's ``qkv_rope`` entry, or None (no fusion: no entry, the pair won, or tiles whose
    ``block_n`` is not ``head_dim``). Under the interpreter: N tiles of one head, K tiles of
    32, up to 2 splits."""
    if _interpreting():
        return GemvConfig(block_n=head_dim, block_k=32, split_k=max(1, min(2, k // 64)),
                          num_stages=1)  # fmt: skip
    cfg = fused_gemv_config("qkv_rope", m, n, k, device)
    return cfg if cfg is not None and cfg.block_n == head_dim else None


def gemv_rms_norm_qk_rope(
    x: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    w: torch.Tensor,
    bias: torch.Tensor | None,
    residual: torch.Tensor | None,
    num_q_heads: int,
    num_kv_heads: int,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    qk_eps: float,
    config: GemvConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``qkv = rms_norm(x + residual) @ w^T (+ bias)``, then q/k RMSNorm + rotary and the k/v
    cache store, in one launch, ``M <= 16`` tokens: a decoder layer's input norm, q/k/v
    projection and :func:`kernels.qk_norm_rope.qk_norm_rope_store`.

    Args:
        x: ``[M, K]`` the previous sublayer's output; norm_weight ``[K]``, eps: the input
            RMSNorm's; residual: ``[M, K]`` or None (the first layer), as in
            :func:`kernels.gemv_fused.gemv_rms_norm`.
        w: ``[(Hq + 2 Hkv) D, K]`` the q/k/v weight (q heads, k heads, v heads), unit K stride;
            bias: ``[(Hq + 2 Hkv) D]`` or None (Qwen2 has one).
        num_q_heads, num_kv_heads: Hq, Hkv (this rank's).
        k_cache, v_cache: ``[num_blocks, block_size, Hkv, D]`` with identical strides, last
            dimension contiguous; updated in place at ``slot_mapping``.
        slot_mapping: int64 or int32 ``[M]``; negative: store nothing.
        cos, sin: ``[M, D]`` or ``[M, 1, D]`` rotary rows of the tokens' positions.
        q_weight, k_weight: ``[D]`` q/k RMSNorm weights (Qwen3) or both None (Qwen2);
            qk_eps: their epsilon.
        config: tiles with ``block_n == D``; None: :func:`qk_rope_config`, else one head per
            tile with the default K tiles.

    Returns:
        ``(qkv [M, (Hq + 2 Hkv) D], new residual [M, K] or None)``: qkv with q and k
        normalized and rotated (v as projected), in x's dtype; one dtype for every tensor.

    Raises:
        ValueError: more than 16 rows, shapes that disagree (weight rows not ``(Hq + 2 Hkv)
            D``, caches, tables, slots), a head size that is not a power of two of at least 16
            (the N tile of the MMA), ``config.block_n != D``, mixed dtypes or devices, only one
            q/k norm weight, or what :func:`kernels.gemv.gemv` refuses.
    """
    _check(x, w, bias, "gemv_rms_norm_qk_rope")
    m, k = x.shape
    n = w.shape[0]
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape or k_cache.stride() != v_cache.stride():
        raise ValueError("k_cache/v_cache must be [num_blocks, block_size, H_kv, D] alike")
    d = k_cache.shape[3]
    if k_cache.shape[2] != num_kv_heads or n != (num_q_heads + 2 * num_kv_heads) * d:
        raise ValueError(
            f"gemv_rms_norm_qk_rope: weight rows {n} and cache {tuple(k_cache.shape)} do not "
            f"hold {num_q_heads} q + 2 x {num_kv_heads} kv heads"
        )
    if k_cache.stride(3) != 1 or d < 16 or d & (d - 1):
        raise ValueError(f"head_dim {d} must be a power of two >= 16, the cache's last dim dense")
    if norm_weight.shape != (k,) or slot_mapping.shape != (m,):
        raise ValueError(
            f"norm weight {tuple(norm_weight.shape)} must be [{k}], slot_mapping "
            f"{tuple(slot_mapping.shape)} [{m}]"
        )
    if slot_mapping.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"slot_mapping must be int64 or int32, got {slot_mapping.dtype}")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"residual {tuple(residual.shape)} must match x {tuple(x.shape)}")
    cos_strides = rope_table_strides(cos, m, d, "cos")
    sin_strides = rope_table_strides(sin, m, d, "sin")
    if (q_weight is None) != (k_weight is None):
        raise ValueError("q_weight and k_weight must both be given or both be None")
    norms = [] if q_weight is None else [q_weight, k_weight]
    if any(t.shape != (d,) for t in norms):
        raise ValueError(f"q_weight/k_weight must be [D={d}]")
    same = [x, norm_weight, k_cache, v_cache, cos, sin, *norms]
    same += [residual] if residual is not None else []
    if {t.dtype for t in same} != {w.dtype} or {t.device for t in [*same, slot_mapping]} != {
        w.device
    }:
        raise ValueError("gemv_rms_norm_qk_rope: every tensor needs the weight's dtype and device")
    cfg = config or qk_rope_config(m, n, k, d, x.device) or GemvConfig(block_n=d)
    if cfg.block_n != d:
        raise ValueError(f"gemv_rms_norm_qk_rope: block_n {cfg.block_n} must equal head_dim {d}")
    out, res_out = norm_outputs(x, residual, n)
    if m == 0:
        return out, res_out
    plan = split_plan(m, n, k, cfg, out)
    operands, strides = norm_operands(x, residual, norm_weight, res_out)
    _gemv_rms_norm_qk_rope_kernel[plan.grid](
        *operands,
        w,
        bias if bias is not None else w,
        out,
        plan.partials,
        plan.counters,
        slot_mapping.contiguous(),  # (the kernel reads unit strides; no copy when they are)
        cos,
        sin,
        q_weight.contiguous() if q_weight is not None else w,  # unused without the q/k norm
        k_weight.contiguous() if k_weight is not None else w,
        k_cache,
        v_cache,
        m,
        n,
        k,
        plan.k_per_split,
        *strides,
        w.stride(0),
        out.stride(0),
        *cos_strides,
        *sin_strides,
        *k_cache.stride(),
        num_q_heads,
        num_kv_heads,
        float(eps),
        float(qk_eps),
        BLOCK_M=16,
        HEAD_DIM=d,
        BLOCK_K=cfg.block_k,
        SPLIT_K=plan.split_k,
        BLOCK_SIZE=k_cache.shape[1],
        HAS_BIAS=bias is not None,
        HAS_RESIDUAL=residual is not None,
        HAS_QK_NORM=q_weight is not None,
        EVEN_K=plan.even_k,
        **launch_flags(x, w, cfg),
    )
    return out, res_out
