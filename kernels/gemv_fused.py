"""The small-M GEMV of :mod:`kernels.gemv` with the elementwise op before it fused into its
prologue, for decode steps where launches, not bytes, set the time (issue 19: every
norm/activation kernel of a batch-1 step costs 1-1.5 us, about its launch).

* :func:`gemv_swiglu`: ``down(silu(gate) * up)`` from the gate/up projection's output
  ``[M, 2I]``: each program computes SwiGLU (Shazeer 2020) on the K tiles it loads, instead of
  a separate ``silu_and_mul`` launch writing ``[M, I]``.
* :func:`gemv_rms_norm`: ``linear(rms_norm(x + residual))`` (RMSNorm, Zhang & Sennrich 2019,
  as Hugging Face's Qwen3 computes it): each program first reads the full rows (K = hidden, a
  few KB from L2) for their sum of squares, then normalizes the K slice it multiplies; the
  programs of the first N tile also write ``x + residual``, the residual stream of the next
  layer. Replaces the add + RMSNorm kernel before q/k/v and before gate/up.

Rounding follows the unfused eager ops (:func:`engine.layers.activation.silu_and_mul`,
:func:`kernels.reference.rms_norm_ref`) step by step, so the fused and unfused products see
the same activation bits wherever the float32 elementwise math agrees (it may differ by an
ulp of float32 before rounding: the GPU's exp, rsqrt and division are approximate, and the sum
of squares is added in another order): ``silu(gate)`` rounded to the model dtype, then the
product with ``up`` rounded; ``x + residual`` rounded, ``h * rsqrt(mean(h^2) + eps)`` rounded,
then the product with the norm weight rounded. (Inductor, which fuses the unfused ops in a
compiled model, keeps the intermediates in float32 instead; both are the same model within
bf16 rounding.)

The accumulation, the split-K reduction by the last-arriving program and its counters are
those of :mod:`kernels.gemv` (shared epilogue). Tiles are static per shape, from
``kernels/configs/gemv_fused_<device>.json`` (``bench/gemv.py --fused --write-table`` times
each fused kernel against the unfused pair, the elementwise kernel plus today's product, and
records ``fused_faster``); no entry, or an entry where the pair won, means no fusion.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.configs import device_name, kernel_table
from kernels.gemv import (
    GEMV_MAX_M,
    GemvConfig,
    _gemv_epilogue,
    dot_precision,
    gemv_supports,
    m_bucket,
    pdl_launch_args,
    prefetchable,
    split_plan,
    upcast_dot,
)
from kernels.interpreter import interpreting as _interpreting
from kernels.pdl import pdl_wait, prefetch_l2
from kernels.rounding import round_to

#: the fused prologues, as :func:`fused_gemv_config` names them in the table's keys
#: ("attn_merge": :mod:`kernels.gemv_merge`; "qkv_rope": :mod:`kernels.gemv_qk_rope`, the norm
#: before q/k/v and the q/k norm + rotary + KV store after it)
FUSED_KINDS = ("swiglu", "rms_norm", "attn_merge", "qkv_rope")


@triton.jit
def _gemv_swiglu_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    out_ptr,
    part_ptr,
    counter_ptr,
    M,
    N,
    K,
    K_PER_SPLIT,
    stride_xm,
    stride_wn,
    stride_om,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PREC: tl.constexpr,
    EMULATE_RNE: tl.constexpr,
    PDL: tl.constexpr = False,
    PREFETCH: tl.constexpr = False,
):
    """Program ``(n tile, k split)`` of ``silu(x[:, :K]) * x[:, K:2K]`` times ``W^T``: the
    activation tile ``[BLOCK_K, BLOCK_M]`` is made from its gate and up tiles as it loads.
    ``PDL`` / ``PREFETCH`` as in :func:`kernels.gemv._gemv_kernel`."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    dtype = x_ptr.dtype.element_ty
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rn_c = (rn % N).to(tl.int64)  # rows past N read row n % N (in bounds) and are not stored
    rm = tl.arange(0, BLOCK_M)
    m_ok = rm < M
    rk = tl.arange(0, BLOCK_K)
    k_lo = pid_k * K_PER_SPLIT
    k_hi = tl.minimum(k_lo + K_PER_SPLIT, K)
    g_ptrs = x_ptr + rm[None, :] * stride_xm + (k_lo + rk)[:, None]
    w_ptrs = w_ptr + rn_c[:, None] * stride_wn + (k_lo + rk)[None, :]
    if PREFETCH:
        prefetch_l2(w_ptr, rn_c, stride_wn, k_lo, k_hi, 64, BLOCK_K // 64)
    pdl_wait(PDL)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        if EVEN_K:
            wt = tl.load(w_ptrs)
            gt = tl.load(g_ptrs, mask=m_ok[None, :], other=0.0)
            ut = tl.load(g_ptrs + K, mask=m_ok[None, :], other=0.0)
        else:
            k_ok = k0 + rk < k_hi
            wt = tl.load(w_ptrs, mask=k_ok[None, :], other=0.0)
            gt = tl.load(g_ptrs, mask=m_ok[None, :] & k_ok[:, None], other=0.0)
            ut = tl.load(g_ptrs + K, mask=m_ok[None, :] & k_ok[:, None], other=0.0)
        g = gt.to(tl.float32)
        silu = round_to(g / (1.0 + tl.exp(-g)), dtype, EMULATE_RNE)  # F.silu: float math, rounded
        xt = round_to(silu.to(tl.float32) * ut.to(tl.float32), dtype, EMULATE_RNE)  # * up
        if UPCAST:  # the CPU interpreter's dot multiplies bfloat16 as raw integers
            acc += tl.dot(wt.to(tl.float32), xt.to(tl.float32))
        else:
            acc += tl.dot(wt, xt.to(wt.dtype), input_precision=DOT_PREC)
        g_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    _gemv_epilogue(
        acc, bias_ptr, out_ptr, part_ptr, counter_ptr, M, N, stride_om, pid_n, pid_k,
        rn, rn_c, rm, m_ok, SPLIT_K, BLOCK_N, BLOCK_M, SPLIT_K > 1, HAS_BIAS,
    )  # fmt: skip


@triton.jit
def _gemv_rms_norm_kernel(
    x_ptr,
    res_ptr,
    norm_w_ptr,
    res_out_ptr,
    w_ptr,
    bias_ptr,
    out_ptr,
    part_ptr,
    counter_ptr,
    M,
    N,
    K,
    K_PER_SPLIT,
    stride_xm,
    stride_rm,
    stride_rom,
    stride_wn,
    stride_om,
    eps,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    EVEN_K: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PREC: tl.constexpr,
    EMULATE_RNE: tl.constexpr,
    PDL: tl.constexpr = False,
    PREFETCH: tl.constexpr = False,
):
    """Program ``(n tile, k split)`` of ``rms_norm(x (+ res)) W^T`` (:func:`rms_norm_gemv_acc`),
    stored by the GEMV's split-K epilogue."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rn_c = (rn % N).to(tl.int64)
    rm = tl.arange(0, BLOCK_M)
    m_ok = rm < M
    acc = rms_norm_gemv_acc(
        x_ptr, res_ptr, norm_w_ptr, res_out_ptr, w_ptr, M, K, K_PER_SPLIT, stride_xm, stride_rm,
        stride_rom, stride_wn, eps, pid_n, pid_k, rn_c, rm, m_ok, BLOCK_M, BLOCK_N, BLOCK_K,
        HAS_RESIDUAL, EVEN_K, UPCAST, DOT_PREC, EMULATE_RNE, PDL, PREFETCH,
    )  # fmt: skip
    _gemv_epilogue(
        acc, bias_ptr, out_ptr, part_ptr, counter_ptr, M, N, stride_om, pid_n, pid_k,
        rn, rn_c, rm, m_ok, SPLIT_K, BLOCK_N, BLOCK_M, SPLIT_K > 1, HAS_BIAS,
    )  # fmt: skip


@triton.jit
def rms_norm_gemv_acc(
    x_ptr,
    res_ptr,
    norm_w_ptr,
    res_out_ptr,
    w_ptr,
    M,
    K,
    K_PER_SPLIT,
    stride_xm,
    stride_rm,
    stride_rom,
    stride_wn,
    eps,
    pid_n,
    pid_k,
    rn_c,
    rm,
    m_ok,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    EVEN_K: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PREC: tl.constexpr,
    EMULATE_RNE: tl.constexpr,
    PDL: tl.constexpr,
    PREFETCH: tl.constexpr,
):
    """The fp32 ``acc [BLOCK_N, BLOCK_M]`` of program ``(pid_n, pid_k)`` of ``rms_norm(x (+
    res)) W^T`` (weight rows ``rn_c``, activation rows ``rm`` valid where ``m_ok``): a first
    pass over the full rows for each row's ``rsqrt(mean(h^2) + eps)``, then the K slice
    normalized as it loads; programs of N tile 0 store ``h = x + res`` (their K slices cover
    the rows). ``PDL`` / ``PREFETCH`` as in :func:`kernels.gemv._gemv_kernel` (the wait is in
    here). Shared by :func:`_gemv_rms_norm_kernel` and ``kernels.gemv_qk_rope``."""
    dtype = x_ptr.dtype.element_ty
    rk = tl.arange(0, BLOCK_K)
    k_lo = pid_k * K_PER_SPLIT  # this program's K slice (pass 2)
    k_hi = tl.minimum(k_lo + K_PER_SPLIT, K)
    if PREFETCH:
        prefetch_l2(w_ptr, rn_c, stride_wn, k_lo, k_hi, 64, BLOCK_K // 64)
    pdl_wait(PDL)

    # pass 1: sum of squares of the whole row h = x + res (rounded as the eager add rounds)
    sq = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ok = m_ok[None, :] & (k0 + rk < K)[:, None]
        h = tl.load(x_ptr + rm[None, :] * stride_xm + (k0 + rk)[:, None], mask=ok, other=0.0)
        if HAS_RESIDUAL:
            r = tl.load(res_ptr + rm[None, :] * stride_rm + (k0 + rk)[:, None], mask=ok, other=0.0)
            h = round_to(h.to(tl.float32) + r.to(tl.float32), dtype, EMULATE_RNE)
        hf = h.to(tl.float32)
        sq += tl.sum(hf * hf, axis=0)
    rstd = tl.rsqrt(sq / K + eps)  # [BLOCK_M], as torch.rsqrt

    # pass 2: this program's K slice, normalized, times its weight tile
    x_ptrs = x_ptr + rm[None, :] * stride_xm + (k_lo + rk)[:, None]
    r_ptrs = res_ptr + rm[None, :] * stride_rm + (k_lo + rk)[:, None]
    ro_ptrs = res_out_ptr + rm[None, :] * stride_rom + (k_lo + rk)[:, None]
    w_ptrs = w_ptr + rn_c[:, None] * stride_wn + (k_lo + rk)[None, :]
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        if EVEN_K:
            ok = m_ok[None, :] & (rk < BLOCK_K)[:, None]
            wt = tl.load(w_ptrs)
            nw = tl.load(norm_w_ptr + k0 + rk)
        else:
            k_ok = k0 + rk < k_hi
            ok = m_ok[None, :] & k_ok[:, None]
            wt = tl.load(w_ptrs, mask=k_ok[None, :], other=0.0)
            nw = tl.load(norm_w_ptr + k0 + rk, mask=k_ok, other=0.0)
        h = tl.load(x_ptrs, mask=ok, other=0.0)
        if HAS_RESIDUAL:
            r = tl.load(r_ptrs, mask=ok, other=0.0)
            h = round_to(h.to(tl.float32) + r.to(tl.float32), dtype, EMULATE_RNE)
            if pid_n == 0:  # one set of programs writes the new residual
                tl.store(ro_ptrs, h, mask=ok)
        normed = round_to(h.to(tl.float32) * rstd[None, :], dtype, EMULATE_RNE)  # x * rsqrt(.)
        xt = round_to(nw.to(tl.float32)[:, None] * normed.to(tl.float32), dtype, EMULATE_RNE)
        if UPCAST:
            acc += tl.dot(wt.to(tl.float32), xt.to(tl.float32))
        else:
            acc += tl.dot(wt, xt.to(wt.dtype), input_precision=DOT_PREC)
        x_ptrs += BLOCK_K
        r_ptrs += BLOCK_K
        ro_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    return acc


def fused_gemv_config(kind: str, m: int, n: int, k: int, device: torch.device) -> GemvConfig | None:
    """The tiles of the fused ``kind`` (one of :data:`FUSED_KINDS`) GEMV for ``[M, K] x [K, N]``
    (``K``: the product's inputs, I for SwiGLU) on ``device``, or None where the fusion is not
    to be used: ``M`` over ``GEMV_MAX_M``, no table entry (never timed on this device), or the
    table says the unfused pair was faster or the fused result less accurate.

    Looks up ``kernels/configs/gemv_fused_<device name>.json`` (``{"<kind>:<N>,<K>": {"m1":
    {...}, "m16": {...}}}``, each a :class:`~kernels.gemv.GemvConfig`'s fields plus
    ``"fused_faster"``); ``m1`` serves M = 1, ``m16`` M = 2..16. Under the Triton interpreter:
    small tiles (K tiles of 32, up to 2 splits).

    Raises:
        ValueError: an unknown ``kind``.
    """
    if kind not in FUSED_KINDS:
        raise ValueError(f"unknown fused GEMV kind {kind!r}; one of {FUSED_KINDS}")
    if m > GEMV_MAX_M:
        return None
    if _interpreting():  # K tiles and splits crossed; wide N tiles (fewer interpreted programs)
        return GemvConfig(block_n=64, block_k=32, split_k=max(1, min(2, k // 64)), num_stages=1)
    entry = kernel_table("gemv_fused", device_name(device)).get(f"{kind}:{n},{k}")
    row = entry.get(m_bucket(m)) if entry is not None else None
    if row is None or not row.get("fused_faster"):
        return None
    return GemvConfig.from_row(row)


def _check(x_k: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, what: str) -> None:
    """Raise the ValueError of :func:`kernels.gemv.gemv` for operands it refuses (``x_k``: the
    ``[M, K]`` operand as the product sees it)."""
    m = x_k.shape[0]
    if m > GEMV_MAX_M:
        raise ValueError(f"{what} takes at most {GEMV_MAX_M} rows, got {m}")
    if x_k.shape[1] != w.shape[1]:
        raise ValueError(f"{what}: the input has {x_k.shape[1]} features, the weight {w.shape[1]}")
    if not gemv_supports(x_k, w, bias):
        raise ValueError(
            f"{what} needs w [N, K] with K stride 1, a [N] unit-stride bias or None, one dtype "
            f"and one device; got x {x_k.dtype} {x_k.device}, w {tuple(w.shape)} stride "
            f"{w.stride()} {w.dtype}, bias "
            f"{None if bias is None else (tuple(bias.shape), bias.stride())}"
        )


def gemv_swiglu(
    gate_up: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: GemvConfig | None = None,
) -> torch.Tensor:
    """``silu(gate) * up`` times ``w^T`` (+ bias) for ``gate_up = [gate | up]`` ``[M, 2K]``
    -> ``[M, N]`` in its dtype, ``M <= 16``: ``down_proj(silu_and_mul(gate_up))`` in one launch.

    Args:
        gate_up: ``[M, 2K]`` bf16, fp16 or fp32, any row stride (copied if its column stride
            is not 1); per tensor-parallel rank, the rank's gate features then its up features
            (``MergedColumnParallelLinear``'s layout).
        w: ``[N, K]`` (the down projection) with unit stride on K, gate_up's dtype.
        bias: ``[N]`` unit stride, same dtype, or None.
        config: tiles; None: :func:`fused_gemv_config`, else the default
            :class:`~kernels.gemv.GemvConfig`.

    Returns:
        A new ``[M, N]`` tensor; the activation rounded as :func:`silu_and_mul` rounds it (see
        the module docstring), float32 accumulation, deterministic split-K.

    Raises:
        ValueError: ``gate_up`` not 2-D with ``2 * w.shape[1]`` columns, more than 16 rows, or
            operands the GEMV refuses (:func:`kernels.gemv.gemv_supports`).
    """
    if gate_up.dim() != 2 or gate_up.shape[1] != 2 * w.shape[1]:
        raise ValueError(
            f"gemv_swiglu: gate_up {tuple(gate_up.shape)} must be [M, 2K] for w {tuple(w.shape)}"
        )
    k = w.shape[1]
    _check(gate_up[:, :k], w, bias, "gemv_swiglu")
    m, n = gate_up.shape[0], w.shape[0]
    out = torch.empty((m, n), dtype=gate_up.dtype, device=gate_up.device)
    if m == 0:
        return out
    if gate_up.stride(1) != 1:
        gate_up = gate_up.contiguous()
    cfg = config or fused_gemv_config("swiglu", m, n, k, gate_up.device) or GemvConfig()
    plan = split_plan(m, n, k, cfg, out)
    _gemv_swiglu_kernel[plan.grid](
        gate_up,
        w,
        bias if bias is not None else w,
        out,
        plan.partials,
        plan.counters,
        m,
        n,
        k,
        plan.k_per_split,
        gate_up.stride(0),
        w.stride(0),
        out.stride(0),
        BLOCK_M=16,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        SPLIT_K=plan.split_k,
        HAS_BIAS=bias is not None,
        EVEN_K=plan.even_k,
        **launch_flags(gate_up, w, cfg),
    )
    return out


def gemv_rms_norm(
    x: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    w: torch.Tensor,
    bias: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    config: GemvConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``rms_norm(x + residual) @ w^T (+ bias)`` and ``x + residual``, ``M <= 16``: a decoder
    layer's add + RMSNorm and the column-parallel projection after it in one launch.

    Args:
        x: ``[M, K]`` bf16, fp16 or fp32 (the previous sublayer's output), any row stride.
        norm_weight: ``[K]`` RMSNorm weight, x's dtype; eps: RMSNorm epsilon.
        w: ``[N, K]`` with unit stride on K, x's dtype; bias: ``[N]`` or None.
        residual: ``[M, K]`` residual stream (x's dtype), or None (the first layer: the norm
            of ``x`` alone).
        config: tiles; None: :func:`fused_gemv_config`, else the default tiles.

    Returns:
        ``(y [M, N], new residual [M, K])``, new tensors (the new residual None when
        ``residual`` is None: it is ``x``). Rounding as :func:`engine.layers.norm.add_rms_norm`
        (see the module docstring); float32 accumulation, deterministic split-K.

    Raises:
        ValueError: more than 16 rows, mismatched shapes, or operands the GEMV refuses.
    """
    _check(x, w, bias, "gemv_rms_norm")
    m, k = x.shape
    n = w.shape[0]
    if norm_weight.shape != (k,) or norm_weight.dtype != x.dtype:
        raise ValueError(
            f"gemv_rms_norm: norm weight {tuple(norm_weight.shape)} {norm_weight.dtype} must be "
            f"[{k}] {x.dtype}"
        )
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(
            f"gemv_rms_norm: residual {tuple(residual.shape)} {residual.dtype} must match x "
            f"{tuple(x.shape)} {x.dtype}"
        )
    out, res_out = norm_outputs(x, residual, n)
    if m == 0:
        return out, res_out
    cfg = config or fused_gemv_config("rms_norm", m, n, k, x.device) or GemvConfig()
    plan = split_plan(m, n, k, cfg, out)
    operands, strides = norm_operands(x, residual, norm_weight, res_out)
    _gemv_rms_norm_kernel[plan.grid](
        *operands,
        w,
        bias if bias is not None else w,
        out,
        plan.partials,
        plan.counters,
        m,
        n,
        k,
        plan.k_per_split,
        *strides,
        w.stride(0),
        out.stride(0),
        float(eps),
        BLOCK_M=16,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        SPLIT_K=plan.split_k,
        HAS_BIAS=bias is not None,
        HAS_RESIDUAL=residual is not None,
        EVEN_K=plan.even_k,
        **launch_flags(x, w, cfg),
    )
    return out, res_out


def norm_outputs(x: torch.Tensor, residual: torch.Tensor | None, n: int):
    """The outputs of a norm GEMV launch: ``(y [M, n] new, new residual [M, K] contiguous or
    None without a residual)``."""
    out = torch.empty((x.shape[0], n), dtype=x.dtype, device=x.device)
    res_out = None
    if residual is not None:
        res_out = torch.empty_like(x, memory_format=torch.contiguous_format)
    return out, res_out


def _k_dense(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def norm_operands(x, residual, norm_weight, res_out) -> tuple[tuple, tuple[int, int, int]]:
    """The first four pointers of a norm GEMV launch (:func:`rms_norm_gemv_acc`'s ``x_ptr,
    res_ptr, norm_w_ptr, res_out_ptr``) and their row strides (``stride_xm, stride_rm,
    stride_rom``): unit K strides (copies where needed), and ``x`` in place of a missing
    residual (never read then)."""
    x = _k_dense(x)
    res = _k_dense(residual) if residual is not None else x
    ro = res_out if res_out is not None else x
    return (x, res, norm_weight.contiguous(), ro), (x.stride(0), res.stride(0), ro.stride(0))


def launch_flags(x: torch.Tensor, w: torch.Tensor, cfg: GemvConfig) -> dict:
    """The keyword arguments every small-M fused launch shares: the interpreter's upcast and
    round-to-nearest emulation, the dot precision, warps and stages, and PDL with the weight
    prefetch (:func:`kernels.gemv.pdl_launch_args`)."""
    return {
        "UPCAST": upcast_dot(x.device, w.dtype),
        "DOT_PREC": dot_precision(w.dtype),
        "EMULATE_RNE": _interpreting() and w.dtype == torch.bfloat16,
        "num_warps": cfg.num_warps,
        "num_stages": cfg.num_stages,
        **pdl_launch_args(x.device, prefetchable(w, cfg.block_k)),
    }
