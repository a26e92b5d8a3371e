"""Block-scaled FP8 linear layers on Hopper: ``y = x W^T`` with W float8_e4m3fn in 128x128 blocks.

The format is DeepSeek-V3's fine-grained FP8 (DeepSeek-AI, *DeepSeek-V3 Technical Report*, 2024,
section 3.3; Qwen's ``-FP8`` releases use it): ``W [N, K]`` float8_e4m3fn with one float32 scale
per 128x128 block, ``ws [ceil(N / 128), ceil(K / 128)]``, and activations quantized on the fly
per token in groups of 128 features (``xs [M, ceil(K / 128)]``). A block of the product is

    y[m, n] = sum_kb xs[m, kb] * ws[n // 128, kb] * sum_{k in kb} xq[m, k] * W[n, k]

so every 128-wide K step is one FP8 tensor-core dot with an fp32 result that is scaled and added
to an fp32 accumulator (DeepSeek's "promotion to CUDA cores" every 128 elements; vLLM's and
SGLang's ``w8a8_block_fp8_matmul`` Triton kernels follow the same scheme). Two kernels:

* :func:`fp8_gemv` (small M, decode): weight-bandwidth bound. One program owns ``BLOCK_N``
  output features and a range of K blocks (split-K), loads the ``M <= BLOCK_M`` activation rows
  itself and quantizes them in registers (no separate quantization launch, no FP8 activation
  tensor in memory), and computes ``W_tile x^T`` (the weight tile is the MMA's M operand, so
  ``BLOCK_N >= 64`` tiles can use wgmma while M is tiny: the "swap AB" of small-batch GEMMs).
  With ``split_k > 1`` each split writes an fp32 partial and counts its arrival per N tile; the
  last one sums the partials in split order (deterministic, unlike atomic adds of the values),
  adds the bias and resets the counter: one launch, as the GEMM's split-K below.
* :func:`fp8_gemm` (large M, prefill): :func:`fp8_group_quant` writes ``xq`` and ``xs``
  (column-major, so a tile's row scales are one coalesced load), then a tiled tensor-core GEMM
  (``BLOCK_M x BLOCK_N`` tiles, ``BLOCK_K = 128``, grouped program order for L2 reuse). A tile
  at most 128 wide lies in one weight-scale block, so each K step scales by one per-row vector
  ``sa * sb`` (one multiply-add per accumulator element). Options of :class:`Fp8Config`, for
  the M where few tiles leave SMs idle or the quantization launch is a large part of the time:
  ``fuse_quant`` (the GEMM reads x in its own dtype and quantizes each ``[BLOCK_M, 128]`` tile
  in registers, bit-identical to :func:`fp8_group_quant`: one launch instead of two) and
  ``split_k`` (kernels/gemv.py's serial split-K: each split writes an fp32 partial and counts
  its arrival per tile; the last one sums the partials in split order, adds the bias, writes
  and resets the counter; deterministic, one launch).

Quantization arithmetic (bit-identical to ``kernels.reference.fp8_group_quant_ref``): per group,
``inv = 448 / max(amax, 1e-10)`` (IEEE division), ``q = rne_fp8(clamp(x * inv, -448, 448))``,
``s = 1 / inv``. Under the Triton interpreter the float32 -> float8 cast is not round-to-nearest-
even (Triton 3.9 rounds ties up and mishandles carries), so there the value is first rounded to
the FP8 grid in float32 (``EMULATE_CAST``) and the cast only reinterprets an exact value; on the
GPU the hardware ``cvt.rn.satfinite`` is used.

Every launcher sizes its grid from shapes, picks a static tile configuration from
:func:`kernels.fp8_configs.fp8_config` (the device's measured per-shape, per-M-bucket table or
the built-in tiles; no autotuning at serve time) and allocates its outputs and scratch with
``torch.empty``, so a launch can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.fp8_configs import (
    FP8_BLOCK,
    Fp8Config,
    fp8_config,
    gemv_k_split,
    gemv_option_problems,
    split_k_fits,
)
from kernels.gemv import NUM_COUNTERS, _gemv_epilogue, gemv_counters
from kernels.interpreter import interpreting as _interpreting
from kernels.pdl import pdl_kwargs, pdl_wait, prefetch_l2

FP8_MAX = 448.0
FP8_AMAX_EPS = 1e-10


@triton.jit
def _to_fp8(v, EMULATE_CAST: tl.constexpr):
    """float32 ``v`` (already clamped to +-448) -> float8e4nv, rounded to nearest even."""
    if EMULATE_CAST:
        bits = v.to(tl.int32, bitcast=True)
        e = tl.maximum(((bits >> 23) & 0xFF) - 127, -6)  # subnormals share exponent -6
        step = ((e - 3 + 127) << 23).to(tl.float32, bitcast=True)  # 2^(e-3): one FP8 ulp
        y = tl.abs(v) / step  # exact (a power of two), y <= 16
        y = (y + 12582912.0) - 12582912.0  # 1.5 * 2^23: round to an integer, ties to even
        r = (y * step).to(tl.int32, bitcast=True) | (bits & -2147483648)  # the sign, also of 0
        v = r.to(tl.float32, bitcast=True)
    return v.to(tl.float8e4nv)


@triton.jit
def _quant_tile(x, AXIS: tl.constexpr, EMULATE_CAST: tl.constexpr):
    """Quantize a float32 tile whose ``AXIS`` is one 128-feature group (one group per row of the
    other axis): returns (float8 tile, float32 scales ``1 / inv`` along the other axis)."""
    amax = tl.max(tl.abs(x), axis=AXIS)
    inv = tl.math.div_rn(tl.full(amax.shape, 448.0, tl.float32), tl.maximum(amax, 1e-10))
    if AXIS == 0:
        y = x * inv[None, :]
    else:
        y = x * inv[:, None]
    q = _to_fp8(tl.clamp(y, -448.0, 448.0), EMULATE_CAST)
    s = tl.math.div_rn(tl.full(inv.shape, 1.0, tl.float32), inv)
    return q, s


# ----------------------------------------------------------------------------- quantization
@triton.jit
def _group_quant_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    M,
    K,
    stride_xm,
    stride_qm,
    stride_sm,
    stride_sk,
    GROUP: tl.constexpr,
    GROUPS_PER_PROG: tl.constexpr,
    EMULATE_CAST: tl.constexpr,
):
    """Program ``(m, j)``: groups ``j * GROUPS_PER_PROG ..`` of row ``m``; a padding row
    (``m >= M``) quantizes zeros."""
    m = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1) * GROUPS_PER_PROG + tl.arange(0, GROUPS_PER_PROG)
    k = g[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    mask = k < K
    k_end = tl.where(m < M, K, 0)  # a padding row loads nothing
    x = tl.load(x_ptr + m * stride_xm + k, mask=k < k_end, other=0.0).to(tl.float32)
    q, s = _quant_tile(x, 1, EMULATE_CAST)
    tl.store(q_ptr + m * stride_qm + k, q, mask=mask)
    tl.store(s_ptr + m * stride_sm + g * stride_sk, s, mask=g * GROUP < K)


def fp8_group_quant(
    x: torch.Tensor, group: int = 128, pad_rows_to: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize activations per token in groups of ``group`` features.

    Args:
        x: ``[M, K]`` bf16/fp16/fp32, unit stride on K.
        pad_rows_to: the outputs get ``M_pad = ceil(M / pad_rows_to) * pad_rows_to`` rows, the
            padding rows holding quantized zeros (cuBLASLt's block-scaled GEMM needs the
            scales' leading dimension aligned; :mod:`kernels.fp8_cublas`).

    Returns:
        ``xq`` float8_e4m3fn ``[M_pad, K]`` and ``xs`` float32 ``[M_pad, ceil(K / group)]``, the
        latter a transposed view of a ``[ceil(K / group), M_pad]`` buffer (column-major, what
        :func:`fp8_gemm` reads).
    """
    m, k = x.shape
    m_pad = triton.cdiv(m, pad_rows_to) * pad_rows_to
    kb = triton.cdiv(k, group)
    xq = torch.empty((m_pad, k), dtype=torch.float8_e4m3fn, device=x.device)
    xs = torch.empty((kb, m_pad), dtype=torch.float32, device=x.device).t()
    if m_pad == 0:
        return xq, xs
    gpp = 4 if kb >= 4 else 1
    _group_quant_kernel[(m_pad, triton.cdiv(kb, gpp))](
        x,
        xq,
        xs,
        m,
        k,
        x.stride(0),
        xq.stride(0),
        xs.stride(0),
        xs.stride(1),
        GROUP=group,
        GROUPS_PER_PROG=gpp,
        EMULATE_CAST=_interpreting(),
        num_warps=4,
    )
    return xq, xs


# ----------------------------------------------------------------------------- large M
@triton.jit(do_not_specialize=["KB_PER_SPLIT", "GROUP_M"])
def _fp8_gemm_kernel(
    a_ptr,
    as_ptr,
    b_ptr,
    bs_ptr,
    bias_ptr,
    c_ptr,
    part_ptr,
    counter_ptr,
    M,
    N,
    K,
    KB_PER_SPLIT,
    GROUP_M,
    stride_am,
    stride_asm,
    stride_ask,
    stride_bn,
    stride_bsn,
    stride_bsk,
    stride_cm,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SCALE_N: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr,
    FUSE_QUANT: tl.constexpr,
    SPLIT: tl.constexpr,
    EMULATE_CAST: tl.constexpr,
):
    """Program ``(tile, k split)``: ``acc [BLOCK_M, BLOCK_N] = sum_kb (a b) * sa * sb`` over the
    split's K blocks; ``a`` is read as FP8 with its scales ``sa``, or (``FUSE_QUANT``) read in
    x's dtype and quantized here. With ``SPLIT`` the last-arriving split of a tile reduces."""
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    group_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + ((pid % per_group) % group_m)
    pid_n = (pid % per_group) // group_m

    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rm_c = (rm % M).to(tl.int64)  # rows past the end load a valid row; their stores are masked
    rn_c = (rn % N).to(tl.int64)
    rk = tl.arange(0, BLOCK_K)
    kb_lo = pid_k * KB_PER_SPLIT
    kb_hi = tl.minimum(kb_lo + KB_PER_SPLIT, tl.cdiv(K, BLOCK_K))
    a_ptrs = a_ptr + rm_c[:, None] * stride_am + (kb_lo * BLOCK_K + rk)[None, :]
    b_ptrs = b_ptr + rn_c[None, :] * stride_bn + (kb_lo * BLOCK_K + rk)[:, None]
    as_ptrs = as_ptr + rm_c * stride_asm
    if BLOCK_N <= SCALE_N:  # the tile lies in one weight-scale block: one scale per K block
        bs_ptrs = bs_ptr + ((pid_n * BLOCK_N) // SCALE_N) * stride_bsn
    else:
        bs_ptrs = bs_ptr + (rn_c // SCALE_N) * stride_bsn

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(kb_lo, kb_hi):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            k_ok = kb * BLOCK_K + rk < K
            a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_ok[:, None], other=0.0)
        if FUSE_QUANT:
            a, sa = _quant_tile(a.to(tl.float32), 1, EMULATE_CAST)
        else:
            sa = tl.load(as_ptrs + kb * stride_ask)
        sb = tl.load(bs_ptrs + kb * stride_bsk)
        if BLOCK_N <= SCALE_N:
            acc += tl.dot(a, b) * (sa * sb)[:, None]
        else:
            acc += tl.dot(a, b) * sa[:, None] * sb[None, :]
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K

    rm64 = rm.to(tl.int64)
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    c_ptrs = c_ptr + rm64[:, None] * stride_cm + rn[None, :]
    if SPLIT:
        # kernels/gemv.py's serial split-K: write the partial, count arrivals per tile; the last
        # split to arrive sums all partials in split order (deterministic), writes, resets.
        splits = tl.num_programs(1)
        tile = rm64[:, None] * N + rn[None, :]  # the launcher keeps splits * M * N < 2^31
        tl.store(part_ptr + pid_k * M * N + tile, acc, mask=mask)
        tl.debug_barrier()  # every thread's partial is written before the arrival below
        arrived = tl.atomic_add(counter_ptr + pid, 1, sem="acq_rel", scope="gpu")
        if arrived == splits - 1:
            total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for s in range(0, splits):
                total += tl.load(
                    part_ptr + s * M * N + tile, mask=mask, other=0.0, cache_modifier=".cg"
                )
            if HAS_BIAS:
                total += tl.load(bias_ptr + rn_c).to(tl.float32)[None, :]
            tl.store(c_ptrs, total.to(c_ptr.dtype.element_ty), mask=mask)
            tl.atomic_xchg(counter_ptr + pid, 0, sem="relaxed", scope="gpu")
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + rn_c).to(tl.float32)[None, :]
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask)


def _k_splits(kb: int, split_k: int) -> tuple[int, int]:
    """(splits, K blocks per split) for ``kb`` K blocks and at most ``split_k`` splits, no
    split empty."""
    split = max(1, min(split_k, kb))
    per_split = triton.cdiv(kb, split)
    return triton.cdiv(kb, per_split), per_split


def _split_k_scratch(m: int, n: int, cfg: Fp8Config, split: int, tiles: int, out: torch.Tensor):
    """``(partials, counters)`` of a launch with ``split`` K splits over ``tiles`` output tiles
    (one arrival counter each): a float32 ``[split, m, n]`` buffer and the shared counters, or
    ``out`` twice (unused) without splits.

    Raises:
        ValueError: more tiles than counters, or 2^31 partial elements or more.
    """
    if split == 1:
        return out, out
    if not split_k_fits(m, n, cfg.block_m, cfg.block_n, split):
        raise ValueError(
            f"split-K {split} of a {m}x{n} output: {tiles} tiles (at most {NUM_COUNTERS} "
            f"counters) and {split * m * n} partial elements (fewer than 2^31)"
        )
    part = torch.empty((split, m, n), dtype=torch.float32, device=out.device)
    return part, gemv_counters(out.device)


def _launch_gemm(a, a_scale, w, ws, bias, out, cfg: Fp8Config) -> torch.Tensor:
    """The tiled GEMM on FP8 ``a`` with scales ``a_scale``, or (``a_scale`` None) on ``a`` in
    bf16/fp16/fp32, quantized in the kernel."""
    m, k = a.shape
    n = w.shape[0]
    fuse = a_scale is None
    split, per_split = _k_splits(triton.cdiv(k, FP8_BLOCK[1]), cfg.split_k)
    tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
    part, counters = _split_k_scratch(m, n, cfg, split, tiles, out)
    _fp8_gemm_kernel[(tiles, split)](
        a,
        ws if fuse else a_scale,
        w,
        ws,
        bias if bias is not None else ws,
        out,
        part,
        counters,
        m,
        n,
        k,
        per_split,
        cfg.group_m,
        a.stride(0),
        0 if fuse else a_scale.stride(0),
        0 if fuse else a_scale.stride(1),
        w.stride(0),
        ws.stride(0),
        ws.stride(1),
        out.stride(0),
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=FP8_BLOCK[1],
        SCALE_N=FP8_BLOCK[0],
        HAS_BIAS=bias is not None,
        EVEN_K=k % FP8_BLOCK[1] == 0,
        FUSE_QUANT=fuse,
        SPLIT=split > 1,
        EMULATE_CAST=_interpreting(),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return out


def fp8_gemm(
    xq: torch.Tensor,
    xs: torch.Tensor,
    w: torch.Tensor,
    ws: torch.Tensor,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    config: Fp8Config | None = None,
) -> torch.Tensor:
    """``out = (xq * xs) (w * ws)^T (+ bias)``: the tensor-core block-scaled GEMM.

    Args:
        xq: float8_e4m3fn ``[M, K]`` (unit stride on K); xs: float32 ``[M, ceil(K / 128)]``
            (any strides; :func:`fp8_group_quant` gives a column-major one).
        w: float8_e4m3fn ``[N, K]`` (unit stride on K); ws: float32
            ``[ceil(N / 128), ceil(K / 128)]``.
        bias: ``[N]`` or None; out: ``[M, N]`` (bf16/fp16/fp32, unit stride on N), written.
        config: tiles (its ``kind`` and ``fuse_quant`` are ignored: ``xq`` is already
            quantized); None: :func:`fp8_config` ``(M, N, K, "gemm", xq.device)``. With
            ``split_k > 1`` the K blocks are split over programs whose fp32 partials the last
            one of each tile sums in split order (deterministic).

    Returns:
        ``out``.

    Raises:
        ValueError: with ``split_k > 1``, more output tiles than split-K counters or
            ``splits * M * N >= 2^31`` partial elements.
    """
    m, k = xq.shape
    n = w.shape[0]
    if m == 0:
        return out
    cfg = config or fp8_config(m, n, k, kind="gemm", device=xq.device)
    return _launch_gemm(xq, xs, w, ws, bias, out, cfg)


# ----------------------------------------------------------------------------- small M
@triton.jit(do_not_specialize=["KB_PER_SPLIT"])
def _fp8_gemv_kernel(
    x_ptr,
    w_ptr,
    ws_ptr,
    bias_ptr,
    out_ptr,
    part_ptr,
    counter_ptr,
    M,
    N,
    K,
    KB_PER_SPLIT,
    stride_xm,
    stride_wn,
    stride_wsn,
    stride_wsk,
    stride_om,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SCALE_N: tl.constexpr,
    SPLIT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr,
    EMULATE_CAST: tl.constexpr,
    FMA: tl.constexpr = False,
    PDL: tl.constexpr = False,
    SCALE_AHEAD: tl.constexpr = False,
):
    """Program ``(n tile, k split)``: ``acc [BLOCK_N, BLOCK_M] = sum_kb W_tile x^T`` over its K
    blocks, each activation group quantized here; with ``SPLIT`` the last-arriving split of an
    N tile reduces (the serial split-K of :func:`_fp8_gemm_kernel`). ``FMA`` (one row,
    ``BLOCK_N <= 128``): the product in fp32 multiply-adds on the CUDA cores (weights converted
    in registers, no shared memory, no tensor-core round trip per 128-wide block) instead of
    the FP8 ``tl.dot``, which pads the row to 16 columns and whose per-block scaling waits for
    every MMA; the weight and activation scales of a K block multiply the quantized row first
    (``xq * (xs * ws)``), so the result differs from the dot's by fp32 rounding only.
    ``PDL``: a programmatic dependent launch (:mod:`kernels.pdl`), without the bf16 GEMV's
    weight prefetch: on the H200's Qwen3-8B-shape FP8 decode step a prefetch of the first four
    K tiles cost 3,565 -> 3,688 us per step, of whole slices 4,613 (docs/benchmarks.md,
    2026-12-02). ``SCALE_AHEAD`` (the dot only): the weight scales of K block ``kb + 1`` are
    loaded in iteration ``kb`` (Triton's pipeliner streams the tiles but leaves this small load
    in the iteration, where it waits on L2 between the MMA and the scaling); same result."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rn_c = (rn % N).to(tl.int64)
    rm = tl.arange(0, BLOCK_M)
    m_ok = rm < M
    rk = tl.arange(0, BLOCK_K)
    kb_lo = pid_k * KB_PER_SPLIT
    kb_hi = tl.minimum(kb_lo + KB_PER_SPLIT, tl.cdiv(K, BLOCK_K))
    x_ptrs = x_ptr + rm[None, :] * stride_xm + (kb_lo * BLOCK_K + rk)[:, None]
    w_ptrs = w_ptr + rn_c[:, None] * stride_wn + (kb_lo * BLOCK_K + rk)[None, :]
    ws_ptrs = ws_ptr + (rn_c // SCALE_N) * stride_wsn
    pdl_wait(PDL)

    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    if FMA:
        # BLOCK_M == 1 and BLOCK_N divides SCALE_N: one weight scale per K block for the whole
        # tile, folded with the activation's into the row, so each weight element costs one
        # fp32 multiply-add into a [BLOCK_N, BLOCK_K] accumulator, reduced over K once at the end
        acc2 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        ws_tile = ws_ptr + (pid_n * BLOCK_N // SCALE_N) * stride_wsn
    if SCALE_AHEAD:
        sw_next = tl.load(ws_ptrs + kb_lo * stride_wsk)
    for kb in range(kb_lo, kb_hi):
        if EVEN_K:
            xt = tl.load(x_ptrs, mask=m_ok[None, :], other=0.0)
            wt = tl.load(w_ptrs)
        else:
            k_ok = kb * BLOCK_K + rk < K
            xt = tl.load(x_ptrs, mask=m_ok[None, :] & k_ok[:, None], other=0.0)
            wt = tl.load(w_ptrs, mask=k_ok[None, :], other=0.0)
        xq, xs = _quant_tile(xt.to(tl.float32), 0, EMULATE_CAST)
        if FMA:
            scale = tl.sum(xs, axis=0) * tl.load(ws_tile + kb * stride_wsk)
            xr = tl.sum(xq.to(tl.float32), axis=1) * scale  # the row (a sum over the size-1 axis)
            acc2 += wt.to(tl.float32) * xr[None, :]
        elif SCALE_AHEAD:
            sw = sw_next
            sw_next = tl.load(ws_ptrs + tl.minimum(kb + 1, kb_hi - 1) * stride_wsk)
            acc += tl.dot(wt, xq) * sw[:, None] * xs[None, :]
        else:
            sw = tl.load(ws_ptrs + kb * stride_wsk)
            acc += tl.dot(wt, xq) * sw[:, None] * xs[None, :]
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if FMA:
        acc = tl.sum(acc2, axis=1)[:, None]

    # kernels/gemv.py's epilogue: stored directly, or with splits the last-arriving split of
    # the N tile sums the partials in split order (deterministic) and resets its counter
    _gemv_epilogue(
        acc, bias_ptr, out_ptr, part_ptr, counter_ptr, M, N, stride_om, pid_n, pid_k,
        rn, rn_c, rm, m_ok, tl.num_programs(1), BLOCK_N, BLOCK_M, SPLIT, HAS_BIAS,
    )  # fmt: skip


@triton.jit
def _fp8_bits_to_f16(w):
    """float8e4nv ``w`` -> float16 holding exactly ``w * 2^-8``, by bit shifts: the sign to bit
    15, the 7 magnitude bits ``eeeemmm`` to bits 13..7. e4m3 and float16 differ in exponent bias
    by 15 - 7 = 8 and both have subnormals below their exponent field 1 (2^-6 * 0.mmm in e4m3,
    2^-14 * 0.mmm in float16), so normals, subnormals and signed zeros all map to the value
    times 2^-8; the e4m3 NaN code 0x7F would become a finite 1.875 (weights hold no NaN). The
    exponent-bias trick of vLLM's Marlin FP8 dequantization (``dequant<half2, kFE4M3fn>`` in
    ``csrc/quantization/marlin/dequant.h``: ``(q & 0x80008000) | ((q & 0x7F007F00) >> 1)``, two
    codes a 32-bit operation, its ``skip_flop`` variant leaving the 2^8 to the scale as here);
    Triton has no 32-bit-word view of a float8 tile, so this costs about three 16-bit integer
    operations a code against half a ``cvt.rn.f16x2.e4m3x2``."""
    b = w.to(tl.uint8, bitcast=True).to(tl.uint16)
    h = ((b & 0x80) << 8) | ((b & 0x7F) << 7)
    return h.to(tl.uint16).to(tl.float16, bitcast=True)  # 16 bits whatever the constants promote to


@triton.jit(do_not_specialize=["KB_PER_SPLIT"])
def _fp8_gemv_fma_kernel(
    x_ptr,
    w_ptr,
    ws_ptr,
    bias_ptr,
    out_ptr,
    part_ptr,
    counter_ptr,
    N,
    K,
    KB_PER_SPLIT,
    stride_wn,
    stride_wsn,
    stride_wsk,
    stride_om,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_K: tl.constexpr,
    SCALE_N: tl.constexpr,
    SPLIT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr,
    EMULATE_CAST: tl.constexpr,
    BIT_CVT: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """One row (``M = 1``) on the CUDA cores, ``BLOCK_K = G * 128`` inputs an iteration:
    program ``(n tile, k split)`` loads a ``[BLOCK_N, BLOCK_K]`` float8 weight tile (each row
    ``BLOCK_K`` contiguous bytes; 16-byte loads, ``G`` of them a thread in flight where
    :func:`_fp8_gemv_kernel`'s ``FMA`` has one) and the row's ``[G, 128]`` activations,
    quantizes the ``G`` groups with one reduction, folds each group's two scales into the
    quantized row (``xq * (xs * ws)``; ``BLOCK_N <= 128``: one weight-scale block row) and adds
    ``w * row`` into a ``[BLOCK_N, BLOCK_K]`` float32 accumulator reduced once at the end; the
    epilogue is :func:`kernels.gemv._gemv_epilogue`'s (serial split-K). ``BIT_CVT``: weights
    converted by :func:`_fp8_bits_to_f16` (integer shifts, ``w * 2^-8``; the ``2^8`` goes into
    the row's scale, a power of two, so the products are bit-identical) instead of the
    ``cvt.f16x2.e4m3x2`` conversion instruction. A split's K groups are a multiple of ``G``
    (:func:`kernels.fp8_configs.gemv_k_split`); ``EVEN_K``: ``K % BLOCK_K == 0``, else loads
    past K are masked (only the last split reaches them)."""
    G: tl.constexpr = BLOCK_K // GROUP_K
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rn_c = (rn % N).to(tl.int64)
    rk = tl.arange(0, BLOCK_K)
    rg = tl.arange(0, G)
    rj = tl.arange(0, GROUP_K)
    kb_lo = pid_k * KB_PER_SPLIT
    kb_hi = tl.minimum(kb_lo + KB_PER_SPLIT, tl.cdiv(K, GROUP_K))
    x_ptrs = x_ptr + kb_lo * GROUP_K + rg[:, None] * GROUP_K + rj[None, :]
    w_ptrs = w_ptr + rn_c[:, None] * stride_wn + (kb_lo * GROUP_K + rk)[None, :]
    ws_row = ws_ptr + (pid_n * BLOCK_N // SCALE_N) * stride_wsn
    pdl_wait(PDL)

    acc2 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for kb in range(kb_lo, kb_hi, G):
        g = kb + rg
        if EVEN_K:
            wt = tl.load(w_ptrs)
            xt = tl.load(x_ptrs)
            sw = tl.load(ws_row + g * stride_wsk)
        else:
            wt = tl.load(w_ptrs, mask=(kb * GROUP_K + rk < K)[None, :], other=0.0)
            xt = tl.load(x_ptrs, mask=g[:, None] * GROUP_K + rj[None, :] < K, other=0.0)
            sw = tl.load(ws_row + g * stride_wsk, mask=g * GROUP_K < K, other=0.0)
        xq, xs = _quant_tile(xt.to(tl.float32), 1, EMULATE_CAST)  # [G, 128] groups, [G] scales
        scale = xs * sw
        if BIT_CVT:
            scale = scale * 256.0  # the 2^-8 of the converted weights
            wf = _fp8_bits_to_f16(wt).to(tl.float32)
        else:
            wf = wt.to(tl.float32)
        row = tl.reshape(xq.to(tl.float32) * scale[:, None], (BLOCK_K,))
        acc2 += wf * row[None, :]
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    acc = tl.sum(acc2, axis=1)[:, None]

    rm = tl.arange(0, 1)
    _gemv_epilogue(
        acc, bias_ptr, out_ptr, part_ptr, counter_ptr, 1, N, stride_om, pid_n, pid_k,
        rn, rn_c, rm, rm < 1, tl.num_programs(1), BLOCK_N, 1, SPLIT, HAS_BIAS,
    )  # fmt: skip


@triton.jit(do_not_specialize=["KB_PER_SPLIT"])
def _fp8_gemv_bd_kernel(
    x_ptr,
    w_ptr,
    ws_ptr,
    bias_ptr,
    out_ptr,
    part_ptr,
    counter_ptr,
    M,
    N,
    K,
    KB_PER_SPLIT,
    stride_xm,
    stride_wn,
    stride_wsn,
    stride_wsk,
    stride_om,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUPS: tl.constexpr,
    GROUP_K: tl.constexpr,
    SCALE_N: tl.constexpr,
    SPLIT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr,
    EMULATE_CAST: tl.constexpr,
    PREFETCH: tl.constexpr = False,
    PDL: tl.constexpr = False,
):
    """The block-diagonal activation operand: program ``(n tile, k split)`` owns at most
    ``GROUPS`` 128-wide K groups (the launcher's split guarantees it) and computes
    ``acc [BLOCK_N, COLS] = sum_j W_j B_j`` with ``COLS = BLOCK_M * GROUPS`` and ``B_j`` the
    ``[BLOCK_K, COLS]`` float8 operand that holds group ``j``'s quantized rows in columns
    ``j * BLOCK_M ..`` and zeros elsewhere: column ``c`` of the accumulator is the unscaled
    product of row ``c % BLOCK_M`` over group ``c // BLOCK_M`` alone, so the loop is a plain
    accumulating tensor-core GEMM (one ``tl.dot(w, b, acc)`` an iteration: no reduction, no
    division, no scale load and no wait for the MMA's result inside it, which the per-block
    scaling of :func:`_fp8_gemv_kernel` needs every 128 inputs), and the scales
    ``xs[c] * ws[n // 128, group]`` multiply the columns once after it, which are then summed
    per row (``[BLOCK_N, GROUPS, BLOCK_M] -> [BLOCK_N, BLOCK_M]``). The same arithmetic as
    DeepSeek-V3's per-128 promotion: each group's product is summed by the tensor cores alone
    and scaled in float32. At ``M = 1`` the operand's 16 columns, padding in the plain kernel,
    carry 16 groups; the MMA work per weight byte is ``COLS`` columns, free while the product
    is bandwidth bound.

    Before the loop the activations of all the program's groups are loaded as one
    ``[BLOCK_K, COLS]`` tile (row ``k`` holds input ``k % 128`` of the column's group: the
    ``BLOCK_K / 128`` groups of an iteration see the same quantized values), quantized along
    the rows (``_quant_tile``, bit-identical to ``fp8_group_quant``), and every iteration
    selects its groups' columns from the register tile (``tl.where`` on the codes' bits). A
    tile of at most 4,096 activations (``BLOCK_K * COLS``: the batch-1 tiles of 16-32 columns)
    is quantized in the loop's first iteration, so that the pipeline's first weight copies,
    which Triton issues just before the loop, are in flight while it waits for the
    activations; a larger one before the loop (kept live through the loop, the loaded tile
    took up to 255 registers a thread and spilled for sm_90). ``PREFETCH``: first an L2
    prefetch of the program's first four weight tiles (:func:`kernels.pdl.prefetch_l2`, after
    the PDL wait). ``EVEN_K``: ``K % BLOCK_K == 0`` (else loads past K are masked; a split's
    groups are a multiple of ``BLOCK_K / 128``, so only the last split reaches past K)."""
    COLS: tl.constexpr = BLOCK_M * GROUPS
    LATE_QUANT: tl.constexpr = BLOCK_K * COLS <= 4096
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rn_c = (rn % N).to(tl.int64)
    rm = tl.arange(0, BLOCK_M)
    m_ok = rm < M
    rk = tl.arange(0, BLOCK_K)
    rc = tl.arange(0, COLS)
    c_grp = rc // BLOCK_M  # the group (relative to the program's first) of each column
    c_row = rc % BLOCK_M  # and its activation row
    kb_lo = pid_k * KB_PER_SPLIT
    kb_hi = tl.minimum(kb_lo + KB_PER_SPLIT, tl.cdiv(K, GROUP_K))
    w_ptrs = w_ptr + rn_c[:, None] * stride_wn + (kb_lo * GROUP_K + rk)[None, :]
    pdl_wait(PDL)
    if PREFETCH:  # 128 float8 weights: one 128-byte line
        prefetch_l2(
            w_ptr, rn_c, stride_wn, kb_lo * GROUP_K, tl.minimum(kb_hi * GROUP_K, K), GROUP_K,
            BLOCK_K // GROUP_K,
        )  # fmt: skip

    # the program's activations, quantized once: [BLOCK_K, COLS] codes and [COLS] scales
    g_abs = kb_lo + c_grp
    col_ok = (c_row < M) & (g_abs < kb_hi)
    kx = g_abs[None, :] * GROUP_K + (rk % GROUP_K)[:, None]
    xt = tl.load(
        x_ptr + c_row[None, :] * stride_xm + kx, mask=col_ok[None, :] & (kx < K), other=0.0
    )
    k_grp = rk // GROUP_K
    if LATE_QUANT:
        codes = tl.zeros((BLOCK_K, COLS), dtype=tl.int8)
        xs = tl.zeros((COLS,), dtype=tl.float32)
    else:
        xq, xs = _quant_tile(xt.to(tl.float32), 0, EMULATE_CAST)
        codes = xq.to(tl.int8, bitcast=True)

    acc = tl.zeros((BLOCK_N, COLS), dtype=tl.float32)
    for kb in range(kb_lo, kb_hi, BLOCK_K // GROUP_K):
        if LATE_QUANT and kb == kb_lo:  # after the pipeline's first weight copies are issued
            xq, xs = _quant_tile(xt.to(tl.float32), 0, EMULATE_CAST)
            codes = xq.to(tl.int8, bitcast=True)
        if EVEN_K:
            wt = tl.load(w_ptrs)
        else:
            wt = tl.load(w_ptrs, mask=(kb * GROUP_K + rk < K)[None, :], other=0.0)
        pick = c_grp[None, :] == (kb - kb_lo + k_grp)[:, None]
        b = tl.where(pick, codes, tl.zeros_like(codes)).to(tl.float8e4nv, bitcast=True)
        acc = tl.dot(wt, b, acc)
        w_ptrs += BLOCK_K

    # column c: xs[c] * ws[n // 128, group of c] (columns of no group of this program are zero)
    g_ok = g_abs < kb_hi
    if BLOCK_N <= SCALE_N:  # the tile lies in one weight-scale row: one scale per column
        ws_row = ws_ptr + ((pid_n * BLOCK_N) // SCALE_N) * stride_wsn
        acc = acc * (tl.load(ws_row + g_abs * stride_wsk, mask=g_ok, other=0.0) * xs)[None, :]
    else:
        sw = tl.load(
            ws_ptr + (rn_c // SCALE_N)[:, None] * stride_wsn + g_abs[None, :] * stride_wsk,
            mask=g_ok[None, :],
            other=0.0,
        )
        acc = acc * sw * xs[None, :]
    if GROUPS > 1:
        acc = tl.sum(tl.reshape(acc, (BLOCK_N, GROUPS, BLOCK_M)), axis=1)

    _gemv_epilogue(
        acc, bias_ptr, out_ptr, part_ptr, counter_ptr, M, N, stride_om, pid_n, pid_k,
        rn, rn_c, rm, m_ok, tl.num_programs(1), BLOCK_N, BLOCK_M, SPLIT, HAS_BIAS,
    )  # fmt: skip


def fp8_gemv(
    x: torch.Tensor,
    w: torch.Tensor,
    ws: torch.Tensor,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    config: Fp8Config | None = None,
) -> torch.Tensor:
    """``out = quant(x) (w * ws)^T (+ bias)`` for few rows: quantization fused, split-K.

    Args:
        x: ``[M, K]`` bf16/fp16/fp32 (unit stride on K), ``M <= config.block_m``.
        w, ws, bias, out: as :func:`fp8_gemm`.
        config: tiles (its ``kind`` is ignored); None: :func:`fp8_config`
            ``(M, N, K, "gemv", x.device)``.

    Returns:
        ``out``.

    Options of ``config`` (:class:`kernels.fp8_configs.Fp8Config`; off by default):

    * ``x_groups``: :func:`_fp8_gemv_bd_kernel`, the block-diagonal activation operand (the
      activations of up to ``x_groups`` K groups quantized once, the loop only accumulating
      tensor-core products, scaled once after it; ``block_m`` may be 1). At least
      ``ceil(K / 128 / x_groups)`` splits (:func:`kernels.fp8_configs.gemv_k_split`);
      ``block_k`` inputs an iteration; ``prefetch``: the first weight tiles asked of L2 first.
    * ``fma`` with ``block_k`` above 128 or ``bit_cvt``: :func:`_fp8_gemv_fma_kernel`, the
      one-row CUDA-core product taking ``block_k`` inputs (up to four scale groups) an
      iteration; ``bit_cvt``: float8 -> float16 by shifts.
    * ``scale_ahead`` (the plain tensor-core product): weight scales loaded an iteration early.

    Raises:
        ValueError: more rows than the configuration's ``block_m``; an ``fma`` configuration
            with ``block_m`` other than 1 or a ``block_n`` not dividing 128; options the
            kernels do not take together (``kernels.fp8_configs.parse_table_entry``'s checks).
    """
    m, k = x.shape
    n = w.shape[0]
    if m == 0:
        return out
    cfg = config or fp8_config(m, n, k, kind="gemv", device=x.device)
    if m > cfg.block_m:
        raise ValueError(f"fp8_gemv takes at most block_m={cfg.block_m} rows, got {m}")
    if cfg.fma and (cfg.block_m != 1 or FP8_BLOCK[0] % cfg.block_n):
        raise ValueError(
            f"the fma product takes block_m 1 and a block_n dividing {FP8_BLOCK[0]}, got "
            f"{cfg.block_m}x{cfg.block_n}"
        )
    problems = gemv_option_problems(cfg)
    if problems:
        raise ValueError(f"fp8_gemv configuration {cfg}: " + "; ".join(problems))
    split, per_split = gemv_k_split(k, cfg)
    part, counters = _split_k_scratch(m, n, cfg, split, triton.cdiv(n, cfg.block_n), out)
    pdl = pdl_kwargs(x.device)
    grid = (triton.cdiv(n, cfg.block_n), split)
    scratch = (bias if bias is not None else ws, out, part, counters)
    common = dict(
        SCALE_N=FP8_BLOCK[0],
        SPLIT=split > 1,
        HAS_BIAS=bias is not None,
        EVEN_K=k % cfg.block_k == 0,
        EMULATE_CAST=_interpreting(),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        **pdl,
    )
    if cfg.x_groups:
        _fp8_gemv_bd_kernel[grid](
            x, w, ws, *scratch, m, n, k, per_split, x.stride(0), w.stride(0), ws.stride(0),
            ws.stride(1), out.stride(0), BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
            BLOCK_K=cfg.block_k, GROUPS=cfg.x_groups, GROUP_K=FP8_BLOCK[1],
            PREFETCH=cfg.prefetch and not _interpreting(), **common,
        )  # fmt: skip
        return out
    if cfg.fma and (cfg.block_k != FP8_BLOCK[1] or cfg.bit_cvt):
        _fp8_gemv_fma_kernel[grid](
            x, w, ws, *scratch, n, k, per_split, w.stride(0), ws.stride(0), ws.stride(1),
            out.stride(0), BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_K=FP8_BLOCK[1],
            BIT_CVT=cfg.bit_cvt, **common,
        )  # fmt: skip
        return out
    _fp8_gemv_kernel[grid](
        x,
        w,
        ws,
        bias if bias is not None else ws,
        out,
        part,
        counters,
        m,
        n,
        k,
        per_split,
        x.stride(0),
        w.stride(0),
        ws.stride(0),
        ws.stride(1),
        out.stride(0),
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=FP8_BLOCK[1],
        SCALE_N=FP8_BLOCK[0],
        SPLIT=split > 1,
        HAS_BIAS=bias is not None,
        EVEN_K=k % FP8_BLOCK[1] == 0,
        EMULATE_CAST=_interpreting(),
        FMA=cfg.fma,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        **pdl,
        **({"SCALE_AHEAD": True} if cfg.scale_ahead else {}),
    )
    return out


def fp8_linear(
    x: torch.Tensor,
    w: torch.Tensor,
    ws: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: Fp8Config | None = None,
) -> torch.Tensor:
    """One block-FP8 linear layer: ``x [M, K]`` (bf16/fp16/fp32) -> ``[M, N]`` in x's dtype.

    ``config`` (None: :func:`fp8_config` ``(M, N, K, device=x.device)``, the device's measured
    table or the built-in tiles) picks the kernel: "gemv", the fused small-M kernel; "gemm" with
    ``fuse_quant``, the GEMM quantizing the activation tiles itself; "gemm" otherwise,
    :func:`fp8_group_quant` then :func:`fp8_gemm`; "cublas", :func:`fp8_group_quant` then
    cuBLASLt's block-scaled GEMM (:mod:`kernels.fp8_cublas`, sm_90). No host synchronisation;
    CUDA-graph capturable.

    Raises:
        ValueError: ``w`` not float8_e4m3fn, or K of ``x`` and ``w`` differ; those of
            :func:`fp8_gemv` / :func:`fp8_gemm` for the configuration.
    """
    if w.dtype != torch.float8_e4m3fn:
        raise ValueError(f"fp8_linear takes a float8_e4m3fn weight, got {w.dtype}")
    m, k = x.shape
    n = w.shape[0]
    if w.shape[1] != k:
        raise ValueError(f"x has {k} features, the weight {w.shape[1]}")
    x = x if x.stride(-1) == 1 else x.contiguous()
    cfg = config or fp8_config(m, n, k, device=x.device, dtype=x.dtype)
    if cfg.kind == "cublas":
        from kernels.fp8_cublas import CUBLAS_M_ALIGN, check_cublas_operands, fp8_cublas_gemm

        check_cublas_operands(k, x.dtype)
        if m == 0:
            return torch.empty((0, n), dtype=x.dtype, device=x.device)
        xq, xs = fp8_group_quant(x, pad_rows_to=CUBLAS_M_ALIGN)
        out = fp8_cublas_gemm(xq, xs, w, ws, bias, x.dtype)
        return out if out.shape[0] == m else out[:m]  # a row prefix: still contiguous
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if cfg.kind == "gemv":
        return fp8_gemv(x, w, ws, bias, out, cfg)
    if m == 0:
        return out
    if cfg.fuse_quant:
        return _launch_gemm(x, None, w, ws, bias, out, cfg)
    xq, xs = fp8_group_quant(x)
    return fp8_gemm(xq, xs, w, ws, bias, out, cfg)
