"""Small-M linear layer ``y = x W^T (+ b)`` in bf16/fp16 for decode steps: weight-bandwidth bound.

At batch 1-64 a decode step's projections read every weight once and do almost no arithmetic,
so their time is the weight bytes over the HBM bandwidth the kernel reaches. On the H200 cuBLAS
reaches about 1.2 TB/s on Qwen3-0.6B's projections at M = 1 (4-13 MB each: 5-9 us per call plus
a separate split-K reduce kernel for some shapes; ``bench/decode_profile.py``), a third of the
copy bandwidth. This kernel is the "swap AB" small-batch GEMM (as in TensorRT-LLM's and
vLLM's small-M paths, and the FP8 ``fp8_gemv`` of :mod:`kernels.fp8_gemm`): the weight tile
``[BLOCK_N, BLOCK_K]`` is the MMA's first operand and the ``M <= 64`` activation rows its second,
one program per (``BLOCK_N`` output features, K split), every tile load pipelined.

Split-K without a second launch (CUTLASS's "serial split-K" semaphore, Stream-K's fix-up): each
program of a split writes its fp32 partial, then increments the arrival counter of its N tile
(``atomic_add``, acquire-release, GPU scope, after a CTA barrier so every thread's partial is
ordered before it); the program that arrives last sums the partials in split order (the result
does not depend on arrival order), adds the bias, writes ``y`` and sets the counter back to
zero, so the next launch -- and every CUDA-graph replay -- starts from zero. The counters are
one int32 buffer per device, zeroed once (:func:`gemv_counters`).

Tile configurations are static per shape (no autotuning at serve time, CUDA-graph capturable):
a table measured on the GPU (``bench/gemv.py --sweep`` writes
``kernels/configs/gemv_<device>.json``; it also records whether cuBLAS was faster, in which case
:func:`gemv_config` says None); a device or shape without a table entry uses cuBLAS.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.arrival_counters import arrival_counters
from kernels.configs import device_name, kernel_table
from kernels.interpreter import interpreting as _interpreting
from kernels.pdl import launch_options, pdl_enabled, pdl_wait, prefetch_l2

#: at most this many rows go through the fused small-M kernels of :mod:`kernels.gemv_fused`
#: (one 16-row MMA operand) and the plain kernel's "m16" table row
GEMV_MAX_M = 16
#: at most this many rows go through the plain kernel (:func:`gemv`): its second MMA operand is
#: 16, 32 or 64 rows wide (the next power of two); M of 17-64 read the table's "m64" row. A
#: 64-row decode step's projections are still weight-bandwidth bound (64 FLOP per weight byte
#: against the H100's and H200's ~200-300), where cuBLAS's tiles read 1.2 TB/s on an H100
#: (``bench/step_times.py --profile``, 2026-12-07)
GEMV_WIDE_MAX_M = 64
#: counters per device: enough for N / BLOCK_N tiles of any projection (N <= 16 * 65536)
NUM_COUNTERS = 65536


@dataclass(frozen=True)
class GemvConfig:
    """Tiles of one launch: ``block_n`` output features and ``block_k`` inputs per tile, the
    number of K splits, and Triton's ``num_warps`` / ``num_stages``."""

    block_n: int = 32
    block_k: int = 128
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3

    @classmethod
    def from_row(cls, row: dict) -> GemvConfig | None:
        """The tiles a table row holds (its entries named as these fields; others ignored), or
        None where it holds none: a row a sweep wrote when no configuration compiled and
        passed (``cublas_faster`` / ``fused_faster`` only)."""
        if not all(f in row for f in cls.__dataclass_fields__):
            return None
        return cls(**{f: row[f] for f in cls.__dataclass_fields__})


@triton.jit
def _gemv_kernel(
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
    PDL: tl.constexpr = False,
    PREFETCH: tl.constexpr = False,
):
    """Program ``(n tile, k split)``: ``acc [BLOCK_N, BLOCK_M] = sum_k W_tile x_tile^T`` over
    its K range; the last split of an N tile to finish reduces (see the module docstring).

    ``PDL``: launched as a programmatic dependent launch (Hopper): nothing the previous kernel
    writes is read, and nothing is written, before ``griddepcontrol.wait``; ``PREFETCH``
    first asks L2 for the first four K tiles of this program's weight slice (weights are never
    written by a step), so their fetch overlaps the previous kernel's tail (CUTLASS example
    63's weight prefetch)."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rn_c = (rn % N).to(tl.int64)  # rows past N read row n % N (in bounds) and are not stored
    rm = tl.arange(0, BLOCK_M)
    m_ok = rm < M
    rk = tl.arange(0, BLOCK_K)
    k_lo = pid_k * K_PER_SPLIT
    k_hi = tl.minimum(k_lo + K_PER_SPLIT, K)
    x_ptrs = x_ptr + rm[None, :] * stride_xm + (k_lo + rk)[:, None]
    w_ptrs = w_ptr + rn_c[:, None] * stride_wn + (k_lo + rk)[None, :]
    if PREFETCH:
        prefetch_l2(w_ptr, rn_c, stride_wn, k_lo, k_hi, 64, BLOCK_K // 64)  # 64 x 16 bits: a line
    pdl_wait(PDL)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        if EVEN_K:
            wt = tl.load(w_ptrs)
            xt = tl.load(x_ptrs, mask=m_ok[None, :], other=0.0)
        else:
            k_ok = k0 + rk < k_hi
            wt = tl.load(w_ptrs, mask=k_ok[None, :], other=0.0)
            xt = tl.load(x_ptrs, mask=m_ok[None, :] & k_ok[:, None], other=0.0)
        if UPCAST:  # the CPU interpreter's dot multiplies bfloat16 as raw integers
            acc += tl.dot(wt.to(tl.float32), xt.to(tl.float32))
        else:
            acc += tl.dot(wt, xt.to(wt.dtype), input_precision=DOT_PREC)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K

    _gemv_epilogue(
        acc, bias_ptr, out_ptr, part_ptr, counter_ptr, M, N, stride_om, pid_n, pid_k,
        rn, rn_c, rm, m_ok, SPLIT_K, BLOCK_N, BLOCK_M, SPLIT_K > 1, HAS_BIAS,
    )  # fmt: skip


@triton.jit
def _gemv_epilogue(
    acc,
    bias_ptr,
    out_ptr,
    part_ptr,
    counter_ptr,
    M,
    N,
    stride_om,
    pid_n,
    pid_k,
    rn,
    rn_c,
    rm,
    m_ok,
    splits,
    BLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
    SPLIT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    """Store program ``(pid_n, pid_k)``'s fp32 ``acc [BLOCK_N, BLOCK_M]`` (``out[m, n]``, rows
    ``rn`` clamped to ``rn_c``, columns ``rm`` valid where ``m_ok``): directly without splits
    (``SPLIT`` False), else as a partial of ``splits``, the last-arriving split reducing in split
    order, adding the bias and resetting its N tile's counter (the module docstring). Shared by
    the fused variants of :mod:`kernels.gemv_fused` and by ``kernels.fp8_gemm``'s small-M
    kernel (whose split count is a launch argument: ``tl.num_programs(1)``)."""
    mask = m_ok[None, :] & (rn[:, None] < N)
    o_ptrs = out_ptr + rm[None, :] * stride_om + rn[:, None]
    total, last = split_k_total(
        acc, part_ptr, counter_ptr, M, N, pid_n, pid_k, rn, rm, mask, splits, BLOCK_N, BLOCK_M,
        SPLIT,
    )  # fmt: skip
    if last:
        if HAS_BIAS:
            total += tl.load(bias_ptr + rn_c).to(tl.float32)[:, None]
        tl.store(o_ptrs, total.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def split_k_total(
    acc,
    part_ptr,
    counter_ptr,
    M,
    N,
    pid_n,
    pid_k,
    rn,
    rm,
    mask,
    splits,
    BLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
    SPLIT: tl.constexpr,
):
    """Serial split-K of program ``(pid_n, pid_k)``'s fp32 ``acc [BLOCK_N, BLOCK_M]``: returns
    ``(total, last)``, ``last`` true in the one program of N tile ``pid_n`` that holds the
    finished sum ``total`` (every program when not ``SPLIT``: ``acc`` itself). With ``SPLIT``
    each program stores its partial (``[splits, M, N]`` at ``part_ptr``, where ``mask``), counts
    its arrival, and the last to arrive sums the partials in split order (so the result does not
    depend on the arrival order) and sets the tile's counter back to zero (the module
    docstring). The caller stores ``total`` where ``last``; in other programs it is ``acc``."""
    total = acc
    last = True
    if SPLIT:
        tile = (rm[None, :] * N + rn[:, None]).to(tl.int64)  # [BLOCK_N, BLOCK_M] in one partial
        tl.store(part_ptr + pid_k * M * N + tile, acc, mask=mask)
        tl.debug_barrier()  # every thread's partial is written before the arrival below
        arrived = tl.atomic_add(counter_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        last = arrived == splits - 1
        if last:
            total = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            for s in range(0, splits):
                total += tl.load(
                    part_ptr + s * M * N + tile, mask=mask, other=0.0, cache_modifier=".cg"
                )
            tl.atomic_xchg(counter_ptr + pid_n, 0, sem="relaxed", scope="gpu")
    return total, last


def gemv_counters(device: torch.device) -> torch.Tensor:
    """The device's ``[NUM_COUNTERS]`` int32 split-K arrival counters
    (:func:`kernels.arrival_counters.arrival_counters`, family "gemv"; every launch leaves them
    zero; the GEMV and FP8 kernels on one stream share them).

    Raises:
        RuntimeError: asked for the first time during CUDA-graph capture.
    """
    return arrival_counters("gemv", NUM_COUNTERS, device)


def triton_runs_on(device: torch.device) -> bool:
    """Whether :func:`gemv` can run on ``device``: CUDA, or any device under the interpreter."""
    return torch.device(device).type == "cuda" or _interpreting()


def gemv_config(m: int, n: int, k: int, device: torch.device) -> GemvConfig | None:
    """The static tiles for ``[M, K] x [K, N]`` on ``device``, or None where cuBLAS is to be
    used: the measured table says it is faster for this shape, or the device and shape were
    never measured (no table entry: an untimed kernel is not assumed to win).

    Looks up ``kernels/configs/gemv_<device name>.json`` (``{"<N>,<K>": {"m1": {...},
    "m16": {...}}}``, each entry a :class:`GemvConfig`'s fields plus ``"cublas_faster"``;
    ``m1`` serves M = 1, ``m16`` every M from 2 to 16, ``m64`` every M from 17 to
    :data:`GEMV_WIDE_MAX_M`; a missing row means cuBLAS). Under the Triton interpreter the tiles
    are small (tests cross tile and split boundaries with small shapes).
    """
    if _interpreting():
        return GemvConfig(block_n=16, block_k=32, split_k=max(1, min(3, k // 64)), num_stages=1)
    entry = kernel_table("gemv", device_name(device)).get(f"{n},{k}")
    row = entry.get(m_bucket(m)) if entry is not None and m <= GEMV_WIDE_MAX_M else None
    if row is None or row.get("cublas_faster"):
        return None
    return GemvConfig.from_row(row)


def m_bucket(m: int) -> str:
    """The table row that serves ``m`` rows: "m1", "m16" (2-16) or "m64" (17 and more)."""
    return "m1" if m == 1 else "m16" if m <= GEMV_MAX_M else "m64"


def block_m(m: int) -> int:
    """The kernel's row tile for ``m`` rows: the next power of two, at least 16 (an MMA
    operand's smallest width)."""
    return max(16, triton.next_power_of_2(m))


def gemv_supports(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether :func:`gemv` takes these operands: 2-D ``x`` of at most ``GEMV_WIDE_MAX_M`` rows,
    ``w`` ``[N, K]`` with unit stride on K, a ``[N]`` unit-stride bias or None, one dtype and one
    device for all, and a device the kernel runs on."""
    return (
        x.dim() == 2
        and w.dim() == 2
        and x.shape[0] <= GEMV_WIDE_MAX_M
        and x.shape[1] == w.shape[1]
        and w.stride(1) == 1
        and x.dtype == w.dtype
        and x.device == w.device
        and (
            bias is None
            or (
                bias.shape == (w.shape[0],)
                and bias.stride(0) == 1
                and bias.dtype == w.dtype
                and bias.device == w.device
            )
        )
        and triton_runs_on(x.device)
    )


def gemv(
    x: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: GemvConfig | None = None,
    pdl: int | None = None,
) -> torch.Tensor:
    """``x [M, K] @ w[N, K]^T (+ bias [N])`` -> ``[M, N]`` in x's dtype, for ``M <= 64``.

    Args:
        x: ``[M, K]`` bf16, fp16 or fp32 (fp32 with an IEEE dot: no TF32 rounding); any row
            stride (copied if its K stride is not 1).
        w: ``[N, K]`` with unit stride on K (Hugging Face's linear layout), x's dtype.
        bias: ``[N]`` with unit stride, x's dtype, or None.
        config: tiles; None: :func:`gemv_config`, or the default tiles where that says cuBLAS.
        pdl: 0 a plain launch; 1 a programmatic dependent launch (:mod:`kernels.pdl`; CUDA,
            sm_90+); 2 that and an L2 prefetch of the weights before the wait; None: 2. Always
            0 where :func:`kernels.pdl.pdl_enabled` is False.

    Returns:
        a new ``[M, N]`` tensor. Accumulation in float32; deterministic (splits are summed in
        split order by the last program of each N tile).

    Raises:
        ValueError: more than ``GEMV_WIDE_MAX_M`` rows, mismatched K, operands :func:`gemv_supports`
            refuses (weight K stride, bias shape or stride, dtypes, devices), or more N tiles
            than split-K counters.
    """
    m, k = x.shape
    n = w.shape[0]
    if m > GEMV_WIDE_MAX_M:
        raise ValueError(f"gemv takes at most {GEMV_WIDE_MAX_M} rows, got {m}")
    if w.shape[1] != k:
        raise ValueError(f"x has {k} features, the weight {w.shape[1]}")
    if not gemv_supports(x, w, bias):
        raise ValueError(
            "gemv needs w [N, K] with K stride 1, a [N] unit-stride bias or None, one dtype and "
            f"one device; got x {x.dtype} {x.device}, w {tuple(w.shape)} stride {w.stride()} "
            f"{w.dtype}, bias {None if bias is None else (tuple(bias.shape), bias.stride())}"
        )
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    if x.stride(-1) != 1:
        x = x.contiguous()
    cfg = config or gemv_config(m, n, k, x.device) or GemvConfig()
    plan = split_plan(m, n, k, cfg, out)
    _gemv_kernel[plan.grid](
        x,
        w,
        bias if bias is not None else w,
        out,
        plan.partials,
        plan.counters,
        m,
        n,
        k,
        plan.k_per_split,
        x.stride(0),
        w.stride(0),
        out.stride(0),
        BLOCK_M=block_m(m),
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        SPLIT_K=plan.split_k,
        HAS_BIAS=bias is not None,
        EVEN_K=plan.even_k,
        UPCAST=upcast_dot(x.device, w.dtype),
        DOT_PREC=dot_precision(w.dtype),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        **pdl_launch_args(x.device, prefetchable(w, cfg.block_k), pdl),
    )
    return out


@dataclass(frozen=True)
class SplitPlan:
    """How one launch splits ``[M, K] x [K, N]``: the grid ``(N tiles, K splits)``, the inputs
    per split (a multiple of ``block_k``), whether every K tile is full (``even_k``), and the
    fp32 partials ``[split_k, M, N]`` and arrival counters of a split launch (with one split
    both are the output itself, never read)."""

    grid: tuple[int, int]
    k_per_split: int
    split_k: int
    even_k: bool
    partials: torch.Tensor
    counters: torch.Tensor


def split_plan(m: int, n: int, k: int, cfg: GemvConfig, out: torch.Tensor) -> SplitPlan:
    """The :class:`SplitPlan` of ``cfg`` for ``[M, K] x [K, N]`` writing ``out`` (no split left
    empty: ``split_k`` may come out below ``cfg.split_k``).

    Raises:
        ValueError: more N tiles than split-K counters (a split launch only).
    """
    tiles = triton.cdiv(n, cfg.block_n)
    per_split = triton.cdiv(triton.cdiv(k, cfg.split_k), cfg.block_k) * cfg.block_k
    split = triton.cdiv(k, per_split)  # no empty split
    if split > 1 and tiles > NUM_COUNTERS:
        raise ValueError(f"{tiles} N tiles exceed the {NUM_COUNTERS} split-K counters")
    part = torch.empty((split, m, n), dtype=torch.float32, device=out.device) if split > 1 else out
    counters = gemv_counters(out.device) if split > 1 else out
    even_k = k % per_split == 0 and per_split % cfg.block_k == 0
    return SplitPlan((tiles, split), per_split, split, even_k, part, counters)


def prefetchable(w: torch.Tensor, block_k: int) -> bool:
    """Whether a small-M kernel's weight prefetch applies: the kernels prefetch 16-bit weights
    in 128-byte lines of 64 elements, so ``w`` must be 16-bit and a K tile at least one line
    (``block_k`` is a power of two)."""
    return w.element_size() == 2 and block_k >= 64


def pdl_launch_args(device: torch.device, can_prefetch: bool, pdl: int | None = None) -> dict:
    """The ``PDL`` / ``PREFETCH`` constexprs and launch options of a small-M GEMV launch
    (:mod:`kernels.pdl`): ``pdl`` 0 plain, 1 PDL, 2 PDL and the weights' L2 prefetch (where
    ``can_prefetch``, see :func:`prefetchable`), None: 2; all of them 0 where
    :func:`kernels.pdl.pdl_enabled` says no (CPU, interpreter, pre-Hopper, the switch off)."""
    enabled = pdl_enabled(device)
    pdl = (2 if pdl is None else pdl) if enabled else 0  # never where PDL cannot run
    return {"PDL": pdl > 0, "PREFETCH": pdl > 1 and can_prefetch, **launch_options(pdl > 0)}


def upcast_dot(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the kernels multiply in float32 (the CPU interpreter's dot multiplies bfloat16
    as raw integers)."""
    return torch.device(device).type != "cuda" and dtype != torch.float32


def dot_precision(dtype: torch.dtype) -> str:
    """``tl.dot``'s ``input_precision``: IEEE for float32 (no TF32 rounding), else "tf32" (a
    no-op for 16-bit operands)."""
    return "ieee" if dtype == torch.float32 else "tf32"
