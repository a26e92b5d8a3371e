"""The small-M GEMV of :mod:`kernels.gemv` with split-KV decode attention's merge fused into its
prologue: the output projection reads the decode kernel's per-split partial outputs and
log-sum-exps and merges them on the K tiles it loads, instead of a second decode launch
(``kernels.decode_attention._decode_reduce_kernel``) writing the merged ``[B, H_q * D]``
attention output for it to read (issue 19: at batch 1 each of the 28 reduce launches of a
Qwen3-0.6B decode step costs about a launch).

Merge (Flash-Decoding, Dao et al. 2023; the same arithmetic as the reduce kernel): for row
``b`` and feature ``k = h * D + d`` (head ``h``, dimension ``d``), with ``lse[s]`` the
log2-domain log-sum-exp of split ``s`` (``-inf`` for an empty split) and ``w_s = 2^(lse[s] -
max_s lse)``: ``x[b, k] = sum_s w_s * po[b, h, s, d] / sum_s w_s``, rounded to the weight's
dtype as the reduce kernel rounds its output; then ``y = x @ W^T (+ bias)``. A K tile lies
inside one head (``BLOCK_K`` at most ``D``): its ``S`` log-sum-exps and ``[S, BLOCK_K]`` partial
outputs are loaded together, in one block of all the splits (``S`` is a compile-time constant:
the split count is fixed per batch size), and merged in the reduce kernel's order.

Where the merge costs less than the launch it removes is a measurement
(``bench/gemv.py --fused`` writes the ``attn_merge`` entries of
``kernels/configs/gemv_fused_<device>.json``; no entry, no fusion). The accumulation, split-K
reduction by the last-arriving program and counters are :mod:`kernels.gemv`'s.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from kernels.gemv import (
    GEMV_MAX_M,
    GemvConfig,
    _gemv_epilogue,
    dot_precision,
    pdl_launch_args,
    prefetchable,
    split_plan,
    triton_runs_on,
    upcast_dot,
)
from kernels.gemv_fused import fused_gemv_config
from kernels.pdl import pdl_wait, prefetch_l2


@triton.jit
def _merged_features(
    po_row,
    plse_row,
    head,
    d0,
    stride_poh,
    stride_pos,
    NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """One row's merged attention output on a K tile inside head ``head``: float32
    ``[BLOCK_K]`` for dimensions ``d0 .. d0 + BLOCK_K - 1``, from ``po_row`` (``[H, S, D]`` at
    strides ``stride_poh``, ``stride_pos``, 1) and ``plse_row`` (the head's ``[S]``
    log-sum-exps, contiguous). The log-sum-exps and the partials load together (neither
    waits for the other: one round trip to L2), then the reduce kernel's arithmetic."""
    rs = tl.arange(0, BLOCK_S)
    s_ok = rs < NUM_SPLITS
    lse = tl.load(plse_row + rs, mask=s_ok, other=float("-inf"))
    po = tl.load(
        po_row
        + head * stride_poh
        + rs[:, None] * stride_pos
        + (d0 + tl.arange(0, BLOCK_K))[None, :],
        mask=s_ok[:, None],
        other=0.0,
    )
    w = tl.math.exp2(lse - tl.max(lse, 0))
    return tl.sum(po * w[:, None], 0) / tl.sum(w, 0)


@triton.jit
def _gemv_attn_merge_kernel(
    po_ptr,
    plse_ptr,
    w_ptr,
    bias_ptr,
    out_ptr,
    part_ptr,
    counter_ptr,
    M,
    N,
    K,
    K_PER_SPLIT,
    stride_pob,
    stride_poh,
    stride_pos,
    stride_plb,
    stride_plh,
    stride_wn,
    stride_om,
    HEAD_DIM: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_S: tl.constexpr,
    SPLIT_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ONE_ROW: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PREC: tl.constexpr,
    PDL: tl.constexpr = False,
    PREFETCH: tl.constexpr = False,
):
    """Program ``(n tile, k split)`` of ``merge(po, lse) @ W^T``: each K tile's activation
    ``[BLOCK_K, BLOCK_M]`` is merged from the partials of its rows as it loads.
    ``PDL`` / ``PREFETCH`` as in :func:`kernels.gemv._gemv_kernel` (the weight prefetch before
    the wait; the partials are read after it)."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    dtype = w_ptr.dtype.element_ty
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rn_c = (rn % N).to(tl.int64)  # rows past N read row n % N (in bounds) and are not stored
    rm = tl.arange(0, BLOCK_M)
    m_ok = rm < M
    k_lo = pid_k * K_PER_SPLIT
    k_hi = tl.minimum(k_lo + K_PER_SPLIT, K)
    w_ptrs = w_ptr + rn_c[:, None] * stride_wn + (k_lo + tl.arange(0, BLOCK_K))[None, :]
    if PREFETCH:
        prefetch_l2(w_ptr, rn_c, stride_wn, k_lo, k_hi, 64, BLOCK_K // 64)
    pdl_wait(PDL)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):  # K tiles never straddle a head (BLOCK_K | HEAD_DIM)
        wt = tl.load(w_ptrs)
        head = k0 // HEAD_DIM
        d0 = k0 % HEAD_DIM
        xt = tl.zeros((BLOCK_K, BLOCK_M), dtype=dtype)
        if ONE_ROW:  # M == 1: no row loop around the loads
            col = _merged_features(
                po_ptr, plse_ptr + head * stride_plh, head, d0, stride_poh, stride_pos,
                NUM_SPLITS, BLOCK_S, BLOCK_K,
            )  # fmt: skip
            xt = tl.where(rm[None, :] == 0, col.to(dtype)[:, None], xt)  # the reduce's rounding
        else:
            for m in range(0, M):
                col = _merged_features(
                    po_ptr + m * stride_pob, plse_ptr + m * stride_plb + head * stride_plh, head,
                    d0, stride_poh, stride_pos, NUM_SPLITS, BLOCK_S, BLOCK_K,
                )  # fmt: skip
                xt = tl.where(rm[None, :] == m, col.to(dtype)[:, None], xt)  # the reduce's rounding
        if UPCAST:  # the CPU interpreter's dot multiplies bfloat16 as raw integers
            acc += tl.dot(wt.to(tl.float32), xt.to(tl.float32))
        else:
            acc += tl.dot(wt, xt, input_precision=DOT_PREC)
        w_ptrs += BLOCK_K
    _gemv_epilogue(
        acc, bias_ptr, out_ptr, part_ptr, counter_ptr, M, N, stride_om, pid_n, pid_k,
        rn, rn_c, rm, m_ok, SPLIT_K, BLOCK_N, BLOCK_M, SPLIT_K > 1, HAS_BIAS,
    )  # fmt: skip


def gemv_attn_merge_supports(
    partial_out: torch.Tensor,
    partial_lse: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor | None,
) -> bool:
    """Whether :func:`gemv_attn_merge` takes these operands (see its Args): shapes, dtypes,
    strides and one device the kernel runs on."""
    if partial_out.dim() != 4 or partial_lse.dim() != 3 or w.dim() != 2:
        return False
    b, h, s, d = partial_out.shape
    return (
        partial_out.dtype == torch.float32
        and partial_lse.dtype == torch.float32
        and partial_lse.shape == (b, h, s)
        and partial_out.stride(3) == 1
        and partial_lse.stride(2) == 1
        and 1 <= b <= GEMV_MAX_M
        and s >= 1
        and d >= 16
        and d & (d - 1) == 0
        and w.shape[1] == h * d
        and w.stride(1) == 1
        and w.dtype in (torch.float16, torch.bfloat16, torch.float32)
        and (
            bias is None
            or (bias.shape == (w.shape[0],) and bias.stride(0) == 1 and bias.dtype == w.dtype)
        )
        and len(
            {partial_out.device, partial_lse.device, w.device}
            | ({bias.device} if bias is not None else set())
        )
        == 1  # fmt: skip
        and triton_runs_on(w.device)
    )


def gemv_attn_merge(
    partial_out: torch.Tensor,
    partial_lse: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: GemvConfig | None = None,
) -> torch.Tensor:
    """The merge of split-KV decode partials times ``w^T`` (+ bias): a decode layer's split
    merge and its output projection in one launch (module docstring).

    Args:
        partial_out: float32 ``[B, H_q, S, D]`` (``B <= 16``; every split's normalized partial
            output, as ``kernels.decode_attention.decode_attention(..., merge=False)`` writes
            it), last dimension contiguous. All ``S`` splits are merged: a scratch with more
            splits than the decode launch wrote must be sliced to those first.
        partial_lse: float32 ``[B, H_q, S]`` log2-domain log-sum-exps (``-inf``: empty split),
            last dimension contiguous.
        w: ``[N, H_q * D]`` bf16, fp16 or fp32 with unit stride on K (the o projection; a
            tensor-parallel rank's columns for its heads); bias: ``[N]`` unit stride, w's
            dtype, or None.
        config: tiles; None: :func:`kernels.gemv_fused.fused_gemv_config` ("attn_merge"),
            else the default :class:`~kernels.gemv.GemvConfig`.

    Returns:
        A new ``[B, N]`` tensor in w's dtype: float32 accumulation, deterministic split-K.

    Raises:
        ValueError: operands :func:`gemv_attn_merge_supports` refuses.
    """
    if not gemv_attn_merge_supports(partial_out, partial_lse, w, bias):
        raise ValueError(
            "gemv_attn_merge needs float32 partial_out [B <= 16, H, S, D] and partial_lse "
            "[B, H, S] (last dims contiguous), w [N, H * D] (16/32-bit, K stride 1), a [N] "
            f"bias or None, one device; got {tuple(partial_out.shape)} {partial_out.dtype}, "
            f"{tuple(partial_lse.shape)} {partial_lse.dtype}, w {tuple(w.shape)} stride "
            f"{w.stride()} {w.dtype} {w.device}, bias "
            f"{None if bias is None else (tuple(bias.shape), bias.stride(), bias.dtype)}"
        )
    b, _, s, d = partial_out.shape
    n, k = w.shape
    out = torch.empty((b, n), dtype=w.dtype, device=w.device)
    cfg = config or fused_gemv_config("attn_merge", b, n, k, w.device) or GemvConfig()
    if cfg.block_k > d:  # a K tile stays inside one head
        cfg = dataclasses.replace(cfg, block_k=d)
    plan = split_plan(b, n, k, cfg, out)
    _gemv_attn_merge_kernel[plan.grid](
        partial_out,
        partial_lse,
        w,
        bias if bias is not None else w,
        out,
        plan.partials,
        plan.counters,
        b,
        n,
        k,
        plan.k_per_split,
        partial_out.stride(0),
        partial_out.stride(1),
        partial_out.stride(2),
        partial_lse.stride(0),
        partial_lse.stride(1),
        w.stride(0),
        out.stride(0),
        HEAD_DIM=d,
        NUM_SPLITS=s,
        BLOCK_M=16,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        BLOCK_S=max(16, triton.next_power_of_2(s)),
        SPLIT_K=plan.split_k,
        HAS_BIAS=bias is not None,
        ONE_ROW=b == 1,
        UPCAST=upcast_dot(w.device, w.dtype),
        DOT_PREC=dot_precision(w.dtype),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        **pdl_launch_args(w.device, prefetchable(w, cfg.block_k)),
    )
    return out
