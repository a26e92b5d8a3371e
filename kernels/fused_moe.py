"""Triton fused mixture-of-experts (MoE) layer: top-k routing, alignment of the routed
(token, expert) pairs to per-expert blocks, and two grouped GEMMs over all experts.

Given hidden states ``x [T, H]``, router logits ``[T, E]`` and the stacked expert weights
``w13 [E, 2I, H]`` (rows ``0..I`` the gate projection, ``I..2I`` the up projection) and
``w2 [E, H, I]`` (down), the layer computes for every token ``t``

    out[t] = sum_{j < k} w[t, j] * down_e(silu(gate_e(x[t])) * up_e(x[t])),  e = ids[t, j]

with ``(w, ids)`` the top-k of ``softmax(logits[t])`` (in float32), renormalised to sum to one
when ``renormalize`` (Qwen3-MoE's ``norm_topk_prob``). Four launches (three for a batch of at most
:data:`FUSED_ROUTE_MAX_TOKENS` tokens, whose routing and alignment are one program):

1. **Routing** (``_route_kernel``, one program per ``BLOCK_T`` tokens): softmax, top-k by ``k``
   rounds of argmax (the lowest expert on ties), renormalisation; it also ranks each pair among
   the program's pairs of the same expert (column-major: slot ``j`` of all tokens, then ``j+1``)
   and writes the program's per-expert counts. No atomics, so the layout is deterministic.
2. **Alignment** (``_align_kernel``, same grid): every program sums the per-program counts into
   the expert totals, pads each expert's segment to a multiple of ``BLOCK_M`` rows (MegaBlocks'
   block-sparse layout, Gale et al., MLSys 2023; vLLM's ``moe_align_block_size``), and scatters
   its pairs to ``segment start + pairs of earlier programs + rank``. It also writes, for its
   share of the blocks, the block's expert (-1: unused) and its number of real rows, so the GEMMs
   need no sentinel-filled padding.
3. **Gate/up grouped GEMM** with SwiGLU fused (``_gate_up_kernel``): one program per (block of
   ``BLOCK_M`` pairs of one expert, ``BLOCK_N`` intermediate columns) gathers the pairs' token rows
   of ``x``, multiplies them by the expert's gate and up tiles (two fp32 accumulators) and writes
   ``silu(g) * u`` to the block's rows of the intermediate ``[rows, I]`` buffer (laid out like the
   sorted pairs, so the next GEMM reads contiguous rows).
4. **Down grouped GEMM** (``_down_kernel``) with the routing weight fused into the epilogue,
   writing one ``[H]`` row per pair (``[T, k, H]``); the top-k weighted sum over ``k`` is then a
   fixed-order reduction (``torch.sum``), deterministic unlike an atomic scatter-add.

This is the design of vLLM's and SGLang's Triton ``fused_moe`` (tokens sorted by expert, one
grouped GEMM over all experts) with a different alignment (no atomics, per-block row counts),
SwiGLU fused into the first GEMM, and the grouped program order of Triton's matmul tutorial
(``GROUP_M`` blocks share the weight tiles in L2).

CUDA graphs: every grid and buffer size depends only on ``T``, ``E``, ``k`` and the static tile
configuration (:func:`fused_moe_config`), never on the routing: the number of blocks is bounded by
``max_blocks = (T k + min(E, T k) (BLOCK_M - 1)) // BLOCK_M``; unused blocks return at once.
Nothing syncs with the host. Imports only torch and triton.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

__all__ = [
    "FUSED_ROUTE_MAX_TOKENS",
    "MoEWorkspace",
    "fused_moe",
    "fused_moe_config",
    "moe_experts",
    "moe_route_align",
    "moe_workspace",
]

#: batches of at most this many tokens route and align in one program (one launch less)
FUSED_ROUTE_MAX_TOKENS = 64
#: tokens per routing program of larger batches
ROUTE_BLOCK_T = 64
#: rows of the per-program counts summed per iteration by the alignment
_COUNT_CHUNK = tl.constexpr(16)
#: blocks whose (expert, rows) one iteration of the block-table writer computes
_BLOCK_CHUNK = tl.constexpr(64)


def _interpreter_upcast(x: torch.Tensor) -> bool:
    """True when 16-bit tiles must be upcast to fp32 before tl.dot (the Triton CPU interpreter
    stores bfloat16 as raw uint16 and its dot multiplies those integers)."""
    return x.device.type != "cuda" and x.dtype != torch.float32


# ----------------------------------------------------------------------------- routing


@triton.jit
def _route_tile(
    logits_ptr,
    stride_lt,
    stride_le,
    weights_ptr,
    ids_ptr,
    ranks_ptr,
    tile,
    num_tokens,
    NUM_EXPERTS: tl.constexpr,
    E_PAD: tl.constexpr,
    TOP_K: tl.constexpr,
    K_PAD: tl.constexpr,
    BLOCK_T: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    STORE_RANKS: tl.constexpr,
):
    """Top-k routing of tokens ``tile * BLOCK_T ..`` (+ ``BLOCK_T``).

    Returns (per-expert pair counts ``[E_PAD]``, ids ``[BLOCK_T, K_PAD]``, ranks
    ``[BLOCK_T, K_PAD]``, rows ``[BLOCK_T]``, row mask): the rank of pair ``(t, j)`` is the number
    of this tile's pairs of the same expert before it in column-major order.
    """
    rows = tile * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = rows < num_tokens
    offs_e = tl.arange(0, E_PAD)
    e_ok = offs_e < NUM_EXPERTS
    x = tl.load(
        logits_ptr + rows.to(tl.int64)[:, None] * stride_lt + offs_e[None, :] * stride_le,
        mask=row_ok[:, None] & e_ok[None, :],
        other=0.0,
    ).to(tl.float32)
    x = tl.where(e_ok[None, :], x, float("-inf"))
    p = tl.exp(x - tl.max(x, 1)[:, None])
    p = p / tl.sum(p, 1)[:, None]
    p = tl.where(e_ok[None, :], p, -1.0)  # padding experts are never chosen

    offs_k = tl.arange(0, K_PAD)
    sel_w = tl.zeros([BLOCK_T, K_PAD], dtype=tl.float32)
    sel_id = tl.zeros([BLOCK_T, K_PAD], dtype=tl.int32)
    sel_rank = tl.zeros([BLOCK_T, K_PAD], dtype=tl.int32)
    counts = tl.zeros([E_PAD], dtype=tl.int32)
    for j in tl.static_range(TOP_K):
        w_j = tl.max(p, 1)
        # lowest expert on ties; the clamp keeps a NaN row's pick a valid expert (memory safety)
        id_j = tl.minimum(tl.argmax(p, 1).to(tl.int32), NUM_EXPERTS - 1)
        hit = offs_e[None, :] == id_j[:, None]
        p = tl.where(hit, -1.0, p)
        hit_i = (hit & row_ok[:, None]).to(tl.int32)
        earlier = tl.cumsum(hit_i, 0) - hit_i  # earlier tokens of this slot on the same expert
        rank_j = tl.sum(hit_i * (earlier + counts[None, :]), 1)
        counts += tl.sum(hit_i, 0)
        col = offs_k[None, :] == j
        sel_w = tl.where(col, w_j[:, None], sel_w)
        sel_id = tl.where(col, id_j[:, None], sel_id)
        sel_rank = tl.where(col, rank_j[:, None], sel_rank)
    if RENORMALIZE:
        sel_w = sel_w / tl.sum(sel_w, 1)[:, None]
    out = rows.to(tl.int64)[:, None] * TOP_K + offs_k[None, :]
    ok = row_ok[:, None] & (offs_k[None, :] < TOP_K)
    tl.store(weights_ptr + out, sel_w, mask=ok)
    tl.store(ids_ptr + out, sel_id, mask=ok)
    if STORE_RANKS:
        tl.store(ranks_ptr + out, sel_rank, mask=ok)
    return counts, sel_id, sel_rank, rows, row_ok


@triton.jit
def _segments(totals, BLOCK_M: tl.constexpr):
    """(start, end) of each expert's segment of the sorted layout, its pairs padded to a
    multiple of ``BLOCK_M`` rows (empty experts: an empty segment)."""
    padded = (totals + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    end = tl.cumsum(padded, 0)
    return end - padded, end


@triton.jit
def _scatter_pairs(
    sel_id,
    sel_rank,
    rows,
    row_ok,
    base,
    sorted_ptr,
    E_PAD: tl.constexpr,
    TOP_K: tl.constexpr,
    K_PAD: tl.constexpr,
):
    """``sorted[base[e] + rank] = t * TOP_K + j`` for every pair ``(t, j)`` of expert ``e``."""
    offs_e = tl.arange(0, E_PAD)
    offs_k = tl.arange(0, K_PAD)
    for j in tl.static_range(TOP_K):
        col = offs_k[None, :] == j
        id_j = tl.sum(tl.where(col, sel_id, 0), 1)
        rank_j = tl.sum(tl.where(col, sel_rank, 0), 1)
        base_j = tl.sum(tl.where(offs_e[None, :] == id_j[:, None], base[None, :], 0), 1)
        tl.store(sorted_ptr + base_j + rank_j, (rows * TOP_K + j).to(tl.int32), mask=row_ok)


@triton.jit
def _write_blocks(
    seg_start,
    seg_end,
    totals,
    block_expert_ptr,
    block_rows_ptr,
    first,
    last,
    NUM_EXPERTS: tl.constexpr,
    E_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    """Expert (-1: unused) and real row count of blocks ``first .. last``."""
    offs_e = tl.arange(0, E_PAD)
    for b0 in range(first, last, _BLOCK_CHUNK):
        b = b0 + tl.arange(0, _BLOCK_CHUNK)
        pos = b * BLOCK_M
        # the containing segment: segments are consecutive, so it is the number ending <= pos
        e = tl.sum((seg_end[None, :] <= pos[:, None]).to(tl.int32), 1)
        hit = offs_e[None, :] == e[:, None]
        start = tl.sum(tl.where(hit, seg_start[None, :], 0), 1)
        count = tl.sum(tl.where(hit, totals[None, :], 0), 1)
        n_rows = tl.minimum(tl.maximum(count - (pos - start), 0), BLOCK_M)
        used = e < NUM_EXPERTS
        ok = b < last
        tl.store(block_expert_ptr + b, tl.where(used, e, -1), mask=ok)
        tl.store(block_rows_ptr + b, tl.where(used, n_rows, 0), mask=ok)


@triton.jit(do_not_specialize=["num_tokens", "num_blocks"])
def _route_align_kernel(
    logits_ptr,
    stride_lt,
    stride_le,
    weights_ptr,
    ids_ptr,
    sorted_ptr,
    block_expert_ptr,
    block_rows_ptr,
    num_tokens,
    num_blocks,
    NUM_EXPERTS: tl.constexpr,
    E_PAD: tl.constexpr,
    TOP_K: tl.constexpr,
    K_PAD: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_M: tl.constexpr,
    RENORMALIZE: tl.constexpr,
):
    """Small batches (``num_tokens <= BLOCK_T``): routing and alignment in one program."""
    counts, sel_id, sel_rank, rows, row_ok = _route_tile(
        logits_ptr,
        stride_lt,
        stride_le,
        weights_ptr,
        ids_ptr,
        ids_ptr,
        0,
        num_tokens,
        NUM_EXPERTS,
        E_PAD,
        TOP_K,
        K_PAD,
        BLOCK_T,
        RENORMALIZE,
        False,
    )
    seg_start, seg_end = _segments(counts, BLOCK_M)
    _scatter_pairs(sel_id, sel_rank, rows, row_ok, seg_start, sorted_ptr, E_PAD, TOP_K, K_PAD)
    _write_blocks(
        seg_start,
        seg_end,
        counts,
        block_expert_ptr,
        block_rows_ptr,
        0,
        num_blocks,
        NUM_EXPERTS,
        E_PAD,
        BLOCK_M,
    )


@triton.jit(do_not_specialize=["num_tokens"])
def _route_kernel(
    logits_ptr,
    stride_lt,
    stride_le,
    weights_ptr,
    ids_ptr,
    ranks_ptr,
    counts_ptr,
    num_tokens,
    NUM_EXPERTS: tl.constexpr,
    E_PAD: tl.constexpr,
    TOP_K: tl.constexpr,
    K_PAD: tl.constexpr,
    BLOCK_T: tl.constexpr,
    RENORMALIZE: tl.constexpr,
):
    pid = tl.program_id(0)
    counts, _, _, _, _ = _route_tile(
        logits_ptr,
        stride_lt,
        stride_le,
        weights_ptr,
        ids_ptr,
        ranks_ptr,
        pid,
        num_tokens,
        NUM_EXPERTS,
        E_PAD,
        TOP_K,
        K_PAD,
        BLOCK_T,
        RENORMALIZE,
        True,
    )
    tl.store(counts_ptr + pid * E_PAD + tl.arange(0, E_PAD), counts)


@triton.jit(do_not_specialize=["num_tokens", "num_blocks", "blocks_per_program"])
def _align_kernel(
    ids_ptr,
    ranks_ptr,
    counts_ptr,
    sorted_ptr,
    block_expert_ptr,
    block_rows_ptr,
    num_tokens,
    num_blocks,
    blocks_per_program,
    NUM_EXPERTS: tl.constexpr,
    E_PAD: tl.constexpr,
    TOP_K: tl.constexpr,
    K_PAD: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    offs_e = tl.arange(0, E_PAD)
    totals = tl.zeros([E_PAD], dtype=tl.int32)
    before = tl.zeros([E_PAD], dtype=tl.int32)
    for q0 in range(0, nprog, _COUNT_CHUNK):
        q = q0 + tl.arange(0, _COUNT_CHUNK)
        c = tl.load(
            counts_ptr + q[:, None] * E_PAD + offs_e[None, :], mask=(q < nprog)[:, None], other=0
        )
        totals += tl.sum(c, 0)
        before += tl.sum(tl.where((q < pid)[:, None], c, 0), 0)
    seg_start, seg_end = _segments(totals, BLOCK_M)

    rows = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = rows < num_tokens
    offs_k = tl.arange(0, K_PAD)
    idx = rows.to(tl.int64)[:, None] * TOP_K + offs_k[None, :]
    ok = row_ok[:, None] & (offs_k[None, :] < TOP_K)
    sel_id = tl.load(ids_ptr + idx, mask=ok, other=0)
    sel_rank = tl.load(ranks_ptr + idx, mask=ok, other=0)
    _scatter_pairs(
        sel_id, sel_rank, rows, row_ok, seg_start + before, sorted_ptr, E_PAD, TOP_K, K_PAD
    )
    first = pid * blocks_per_program
    last = tl.minimum(first + blocks_per_program, num_blocks)
    _write_blocks(
        seg_start,
        seg_end,
        totals,
        block_expert_ptr,
        block_rows_ptr,
        first,
        last,
        NUM_EXPERTS,
        E_PAD,
        BLOCK_M,
    )


# ----------------------------------------------------------------------------- grouped GEMMs


@triton.jit
def _block_and_tile(num_blocks, n_size, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(block, column tile) of this program, ``GROUP_M`` consecutive blocks per column tile
    (Triton's matmul tutorial ordering: their weight tiles are read once into L2)."""
    pid = tl.program_id(0)
    n_tiles = tl.cdiv(n_size, BLOCK_N)
    per_group = GROUP_M * n_tiles
    first = (pid // per_group) * GROUP_M
    size = tl.minimum(num_blocks - first, GROUP_M)
    block = first + (pid % per_group) % size
    tile = (pid % per_group) // size
    return block, tile


@triton.jit(do_not_specialize=["num_blocks"])
def _gate_up_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    sorted_ptr,
    block_expert_ptr,
    block_rows_ptr,
    num_blocks,
    n_size,
    k_size,
    stride_xt,
    stride_xk,
    stride_we,
    stride_wn,
    stride_wk,
    stride_ot,
    TOP_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """``out[row] = silu(x[tok] Wg_e^T) * (x[tok] Wu_e^T)`` for the rows of one block
    (``n_size`` = I, ``k_size`` = H; Wg rows ``0..I`` of ``w[e]``, Wu rows ``I..2I``)."""
    block, tile = _block_and_tile(num_blocks, n_size, BLOCK_N, GROUP_M)
    expert = tl.load(block_expert_ptr + block)
    if expert < 0:
        return
    n_rows = tl.load(block_rows_ptr + block)
    offs_m = tl.arange(0, BLOCK_M)
    row_ok = offs_m < n_rows
    pair = tl.load(sorted_ptr + block * BLOCK_M + offs_m, mask=row_ok, other=0)
    token = (pair // TOP_K).to(tl.int64)  # padding rows read token 0; their results are dropped
    cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    cols_w = cols % n_size  # columns past I wrap around (loads stay in bounds; stores masked)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = x_ptr + token[:, None] * stride_xt + offs_k[None, :] * stride_xk
    g_ptrs = (
        w_ptr
        + expert.to(tl.int64) * stride_we
        + cols_w[None, :].to(tl.int64) * stride_wn
        + offs_k[:, None] * stride_wk
    )
    u_ptrs = g_ptrs + n_size * stride_wn
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(0, tl.cdiv(k_size, BLOCK_K)):
        if EVEN_K:
            a = tl.load(a_ptrs)
            g = tl.load(g_ptrs)
            u = tl.load(u_ptrs)
        else:
            k_ok = offs_k < k_size - k * BLOCK_K
            a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
            g = tl.load(g_ptrs, mask=k_ok[:, None], other=0.0)
            u = tl.load(u_ptrs, mask=k_ok[:, None], other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
            g = g.to(tl.float32)
            u = u.to(tl.float32)
        acc_g = tl.dot(a, g, acc_g, input_precision=DOT_PREC)
        acc_u = tl.dot(a, u, acc_u, input_precision=DOT_PREC)
        a_ptrs += BLOCK_K * stride_xk
        g_ptrs += BLOCK_K * stride_wk
        u_ptrs += BLOCK_K * stride_wk
    h = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
    out_rows = (block * BLOCK_M + offs_m).to(tl.int64)
    tl.store(
        out_ptr + out_rows[:, None] * stride_ot + cols[None, :],
        h.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & (cols[None, :] < n_size),
    )


@triton.jit(do_not_specialize=["num_blocks"])
def _down_kernel(
    a_ptr,
    w_ptr,
    out_ptr,
    sorted_ptr,
    block_expert_ptr,
    block_rows_ptr,
    weights_ptr,
    num_blocks,
    n_size,
    k_size,
    stride_at,
    stride_we,
    stride_wn,
    stride_wk,
    stride_ot,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """``out[pair] = weight[pair] * (a[row] W2_e^T)`` for the rows of one block (``n_size`` = H,
    ``k_size`` = I; ``a`` the intermediate rows in sorted order)."""
    block, tile = _block_and_tile(num_blocks, n_size, BLOCK_N, GROUP_M)
    expert = tl.load(block_expert_ptr + block)
    if expert < 0:
        return
    n_rows = tl.load(block_rows_ptr + block)
    offs_m = tl.arange(0, BLOCK_M)
    row_ok = offs_m < n_rows
    pair = tl.load(sorted_ptr + block * BLOCK_M + offs_m, mask=row_ok, other=0)
    cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    cols_w = cols % n_size
    offs_k = tl.arange(0, BLOCK_K)
    a_rows = (block * BLOCK_M + offs_m).to(tl.int64)
    a_ptrs = a_ptr + a_rows[:, None] * stride_at + offs_k[None, :]
    w_ptrs = (
        w_ptr
        + expert.to(tl.int64) * stride_we
        + cols_w[None, :].to(tl.int64) * stride_wn
        + offs_k[:, None] * stride_wk
    )
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(0, tl.cdiv(k_size, BLOCK_K)):
        # padding rows of the intermediate were never written: masked to 0
        if EVEN_K:
            a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
            w = tl.load(w_ptrs)
        else:
            k_ok = offs_k < k_size - k * BLOCK_K
            a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_ok[:, None], other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(a, w, acc, input_precision=DOT_PREC)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K * stride_wk
    acc = acc * tl.load(weights_ptr + pair, mask=row_ok, other=0.0)[:, None]
    tl.store(
        out_ptr + pair.to(tl.int64)[:, None] * stride_ot + cols[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & (cols[None, :] < n_size),
    )


# ----------------------------------------------------------------------------- host side


def fused_moe_config(
    num_tokens: int,
    num_experts: int,
    top_k: int,
    hidden_size: int,
    intermediate_size: int,
    dtype: torch.dtype,
    device: torch.device,
) -> dict:
    """Static tile configuration of :func:`fused_moe` for a batch of ``num_tokens`` tokens.

    Returns ``{"BLOCK_M": rows per expert block (shared by both GEMMs and the alignment),
    "gate_up": {...}, "down": {...}}`` where each GEMM entry holds ``BLOCK_N``, ``BLOCK_K``,
    ``GROUP_M``, ``num_warps``, ``num_stages``. A new dict; raises nothing.

    Host-side and static (no autotuning at launch, so the launches can be captured in CUDA
    graphs). The average pairs per expert, ``T k / E``, sets ``BLOCK_M``: 16 while blocks are
    mostly padding (decode; the GEMMs are weight-bound and the tiles stream the expert weights),
    up to 128 for large prefill steps (compute-bound, wgmma-sized tiles). The CUDA bf16/fp16 rows
    start from vLLM's tuned H200 table for E=128, N=768 (``fused_moe/configs``), halving
    ``BLOCK_N`` of the gate/up GEMM, whose fused SwiGLU keeps two accumulators; the interpreter
    (CPU) uses 16x16/32 tiles so small tests cross tile boundaries.
    """
    if device.type != "cuda":
        return {
            "BLOCK_M": 16,
            "gate_up": dict(BLOCK_N=16, BLOCK_K=32, GROUP_M=2, num_warps=4, num_stages=1),
            "down": dict(BLOCK_N=32, BLOCK_K=16, GROUP_M=2, num_warps=4, num_stages=1),
        }
    per_expert = num_tokens * top_k / max(1, num_experts)
    if dtype == torch.float32:
        m = 16 if per_expert <= 16 else 32
        gemm = dict(BLOCK_N=32, BLOCK_K=32, GROUP_M=8, num_warps=4, num_stages=2)
        return {"BLOCK_M": m, "gate_up": gemm, "down": dict(gemm)}
    if per_expert <= 1:  # T k <= E: decode batches up to 16 tokens at top-8 of 128
        return {
            "BLOCK_M": 16,
            "gate_up": dict(BLOCK_N=32, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=4),
            "down": dict(BLOCK_N=64, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=4),
        }
    if per_expert <= 8:
        return {
            "BLOCK_M": 16,
            "gate_up": dict(BLOCK_N=64, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=3),
            "down": dict(BLOCK_N=128, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=3),
        }
    if per_expert <= 24:
        return {
            "BLOCK_M": 32,
            "gate_up": dict(BLOCK_N=64, BLOCK_K=128, GROUP_M=8, num_warps=4, num_stages=3),
            "down": dict(BLOCK_N=128, BLOCK_K=128, GROUP_M=8, num_warps=4, num_stages=3),
        }
    if per_expert <= 96:
        return {
            "BLOCK_M": 64,
            "gate_up": dict(BLOCK_N=64, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=4),
            "down": dict(BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=4),
        }
    return {
        "BLOCK_M": 128,
        "gate_up": dict(BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3),
        "down": dict(BLOCK_N=256, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3),
    }


def max_blocks(num_tokens: int, num_experts: int, top_k: int, block_m: int) -> int:
    """Upper bound of the blocks the alignment can use: every non-empty expert (at most
    ``min(E, T k)`` of them) pads its pairs by at most ``block_m - 1`` rows."""
    pairs = num_tokens * top_k
    return (pairs + min(num_experts, pairs) * (block_m - 1)) // block_m


@dataclass
class MoEWorkspace:
    """Buffers of one :func:`fused_moe` call (sizes from ``T``, ``E``, ``k``, the config only).

    Attributes:
        num_tokens, num_experts, top_k, block_m: the shapes it was made for.
        route_programs: routing programs (1: routing and alignment in one launch).
        route_block_t: tokens per routing program.
        config: the tile configuration (:func:`fused_moe_config`).
        topk_weights: float32 ``[T, k]``; topk_ids: int32 ``[T, k]`` (the routing results).
        ranks: int32 ``[T, k]``; counts: int32 ``[route_programs, E_pad]`` (alignment scratch).
        sorted_pairs: int32 ``[max_blocks * block_m]``, pair ``t * k + j`` per row of the
            blocked layout (rows past a block's count are not written).
        block_expert, block_rows: int32 ``[max_blocks]``: each block's expert (-1 unused) and
            number of real rows.
        intermediate: ``[max_blocks * block_m, I]`` (SwiGLU output rows, sorted layout).
        pair_out: ``[T * k, H]`` (weighted down-projection of each pair; empty for top-1).
    """

    num_tokens: int
    num_experts: int
    top_k: int
    block_m: int
    route_programs: int
    route_block_t: int
    config: dict
    topk_weights: torch.Tensor
    topk_ids: torch.Tensor
    ranks: torch.Tensor
    counts: torch.Tensor
    sorted_pairs: torch.Tensor
    block_expert: torch.Tensor
    block_rows: torch.Tensor
    intermediate: torch.Tensor
    pair_out: torch.Tensor


def moe_workspace(
    num_tokens: int,
    num_experts: int,
    top_k: int,
    hidden_size: int,
    intermediate_size: int,
    dtype: torch.dtype,
    device: torch.device | str,
    config: dict | None = None,
) -> MoEWorkspace:
    """Allocate the buffers of one :func:`fused_moe` call (``torch.empty``, never read before
    written). ``config`` overrides :func:`fused_moe_config` (benchmarks).

    Raises:
        ValueError: ``top_k`` not in ``[1, num_experts]``, or non-positive sizes.
    """
    device = torch.device(device)
    if num_tokens < 0 or num_experts < 1 or not 1 <= top_k <= num_experts:
        raise ValueError(
            f"need num_tokens >= 0 and 1 <= top_k <= num_experts, got T={num_tokens}, "
            f"E={num_experts}, k={top_k}"
        )
    if hidden_size < 1 or intermediate_size < 1:
        raise ValueError("hidden_size and intermediate_size must be positive")
    cfg = config or fused_moe_config(
        num_tokens, num_experts, top_k, hidden_size, intermediate_size, dtype, device
    )
    bm = cfg["BLOCK_M"]
    if num_tokens <= FUSED_ROUTE_MAX_TOKENS:
        programs, block_t = 1, max(16, triton.next_power_of_2(max(1, num_tokens)))
    else:
        programs, block_t = triton.cdiv(num_tokens, ROUTE_BLOCK_T), ROUTE_BLOCK_T
    nb = max_blocks(num_tokens, num_experts, top_k, bm)
    i32 = dict(dtype=torch.int32, device=device)
    floats = dict(dtype=dtype, device=device)
    return MoEWorkspace(
        num_tokens=num_tokens,
        num_experts=num_experts,
        top_k=top_k,
        block_m=bm,
        route_programs=programs,
        route_block_t=block_t,
        config=cfg,
        topk_weights=torch.empty(num_tokens, top_k, dtype=torch.float32, device=device),
        topk_ids=torch.empty(num_tokens, top_k, **i32),
        ranks=torch.empty(num_tokens if programs > 1 else 0, top_k, **i32),
        counts=torch.empty(programs, triton.next_power_of_2(num_experts), **i32),
        sorted_pairs=torch.empty(nb * bm, **i32),
        block_expert=torch.empty(nb, **i32),
        block_rows=torch.empty(nb, **i32),
        intermediate=torch.empty(nb * bm, intermediate_size, **floats),
        # top-1: the down GEMM writes ``out`` itself
        pair_out=torch.empty(num_tokens * top_k if top_k > 1 else 0, hidden_size, **floats),
    )


def moe_route_align(
    router_logits: torch.Tensor, renormalize: bool, ws: MoEWorkspace
) -> MoEWorkspace:
    """Route ``T`` tokens to their top-k experts and lay the pairs out in expert blocks.

    Args:
        router_logits: ``[T, E]`` float32/bfloat16/float16, any strides.
        renormalize: divide the top-k probabilities by their sum (``norm_topk_prob``).
        ws: from :func:`moe_workspace` for this ``T``, ``E``; filled in place: ``topk_weights``,
            ``topk_ids``, ``sorted_pairs``, ``block_expert``, ``block_rows``.

    Returns:
        ``ws``.

    Raises:
        ValueError: shapes or devices that do not match the workspace.
    """
    t, e = ws.num_tokens, ws.num_experts
    if router_logits.shape != (t, e):
        raise ValueError(f"router_logits must be [T={t}, E={e}], got {tuple(router_logits.shape)}")
    if router_logits.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"unsupported router_logits dtype {router_logits.dtype}")
    if router_logits.device != ws.topk_ids.device:
        raise ValueError("router_logits must be on the workspace's device")
    if t == 0:
        return ws
    k, bm = ws.top_k, ws.block_m
    e_pad, k_pad = triton.next_power_of_2(e), triton.next_power_of_2(k)
    nb = ws.block_expert.shape[0]
    common = dict(NUM_EXPERTS=e, E_PAD=e_pad, TOP_K=k, K_PAD=k_pad, BLOCK_T=ws.route_block_t)
    warps = 4 if ws.route_block_t * e_pad < 8192 else 8  # [BLOCK_T, E_pad] tiles in registers
    if ws.route_programs == 1:
        _route_align_kernel[(1,)](
            router_logits,
            router_logits.stride(0),
            router_logits.stride(1),
            ws.topk_weights,
            ws.topk_ids,
            ws.sorted_pairs,
            ws.block_expert,
            ws.block_rows,
            t,
            nb,
            BLOCK_M=bm,
            RENORMALIZE=bool(renormalize),
            num_warps=warps,
            **common,
        )
        return ws
    grid = (ws.route_programs,)
    _route_kernel[grid](
        router_logits,
        router_logits.stride(0),
        router_logits.stride(1),
        ws.topk_weights,
        ws.topk_ids,
        ws.ranks,
        ws.counts,
        t,
        RENORMALIZE=bool(renormalize),
        num_warps=warps,
        **common,
    )
    _align_kernel[grid](
        ws.topk_ids,
        ws.ranks,
        ws.counts,
        ws.sorted_pairs,
        ws.block_expert,
        ws.block_rows,
        t,
        nb,
        triton.cdiv(nb, ws.route_programs),
        BLOCK_M=bm,
        num_warps=warps,
        **common,
    )
    return ws


def _check_experts(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, ws: MoEWorkspace):
    if hidden.dim() != 2 or hidden.shape[0] != ws.num_tokens or hidden.stride(1) != 1:
        raise ValueError(
            f"hidden must be [T={ws.num_tokens}, H] with unit stride on H, got "
            f"{tuple(hidden.shape)} strides {hidden.stride()}"
        )
    if hidden.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"unsupported dtype {hidden.dtype}")
    h = hidden.shape[1]
    if w13.dim() != 3 or w13.shape[0] != ws.num_experts or w13.shape[2] != h or w13.shape[1] % 2:
        raise ValueError(f"w13 must be [E={ws.num_experts}, 2I, H={h}], got {tuple(w13.shape)}")
    i = w13.shape[1] // 2
    if w2.shape != (ws.num_experts, h, i):
        raise ValueError(f"w2 must be [E, H, I] = {(ws.num_experts, h, i)}, got {tuple(w2.shape)}")
    if w13.dtype != hidden.dtype or w2.dtype != hidden.dtype:
        raise ValueError("w13 and w2 must have hidden's dtype")
    if w13.stride(2) != 1 or w2.stride(2) != 1:
        raise ValueError("expert weights must be contiguous on their last dim")
    if ws.intermediate.shape[1] != i or ws.pair_out.shape[1] != h:  # pair_out [0, H] at top-1
        raise ValueError("workspace made for other sizes")
    if ws.intermediate.dtype != hidden.dtype:
        raise ValueError("workspace made for another dtype")
    if {hidden.device, w13.device, w2.device} != {ws.topk_ids.device}:
        raise ValueError("all tensors must be on the workspace's device")
    return h, i


def moe_experts(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    ws: MoEWorkspace,
    out: torch.Tensor,
) -> torch.Tensor:
    """The routed experts of :func:`moe_route_align`'s layout: both grouped GEMMs and the top-k
    weighted sum.

    Args:
        hidden: ``[T, H]`` float32/bfloat16/float16, unit stride on H.
        w13: ``[E, 2I, H]`` (gate rows, then up rows), w2: ``[E, H, I]``, hidden's dtype,
            contiguous on their last dim.
        ws: the workspace :func:`moe_route_align` filled for these tokens.
        out: ``[T, H]`` like hidden, unit stride on H; written and returned.

    Raises:
        ValueError: shapes, dtypes, strides or devices that do not match.
    """
    h, i = _check_experts(hidden, w13, w2, ws)
    if out.shape != hidden.shape or out.dtype != hidden.dtype or out.device != hidden.device:
        raise ValueError("out must match hidden's shape, dtype and device")
    if out.stride(1) != 1:
        raise ValueError("out must have unit stride on H")
    t = ws.num_tokens
    if t == 0:
        return out
    upcast = _interpreter_upcast(hidden)
    prec = "ieee" if hidden.dtype == torch.float32 or upcast else "tf32"
    nb, bm = ws.block_expert.shape[0], ws.block_m
    gu, dn = ws.config["gate_up"], ws.config["down"]
    _gate_up_kernel[(nb * triton.cdiv(i, gu["BLOCK_N"]),)](
        hidden,
        w13,
        ws.intermediate,
        ws.sorted_pairs,
        ws.block_expert,
        ws.block_rows,
        nb,
        i,
        h,
        hidden.stride(0),
        hidden.stride(1),
        w13.stride(0),
        w13.stride(1),
        w13.stride(2),
        ws.intermediate.stride(0),
        TOP_K=ws.top_k,
        BLOCK_M=bm,
        BLOCK_N=gu["BLOCK_N"],
        BLOCK_K=gu["BLOCK_K"],
        GROUP_M=gu["GROUP_M"],
        EVEN_K=h % gu["BLOCK_K"] == 0,
        UPCAST=upcast,
        DOT_PREC=prec,
        num_warps=gu["num_warps"],
        num_stages=gu["num_stages"],
    )
    pair_out = out if ws.top_k == 1 else ws.pair_out
    _down_kernel[(nb * triton.cdiv(h, dn["BLOCK_N"]),)](
        ws.intermediate,
        w2,
        pair_out,
        ws.sorted_pairs,
        ws.block_expert,
        ws.block_rows,
        ws.topk_weights,
        nb,
        h,
        i,
        ws.intermediate.stride(0),
        w2.stride(0),
        w2.stride(1),
        w2.stride(2),
        pair_out.stride(0),
        BLOCK_M=bm,
        BLOCK_N=dn["BLOCK_N"],
        BLOCK_K=dn["BLOCK_K"],
        GROUP_M=dn["GROUP_M"],
        EVEN_K=i % dn["BLOCK_K"] == 0,
        UPCAST=upcast,
        DOT_PREC=prec,
        num_warps=dn["num_warps"],
        num_stages=dn["num_stages"],
    )
    if ws.top_k > 1:
        torch.sum(ws.pair_out.view(t, ws.top_k, h), dim=1, out=out)
    return out


def fused_moe(
    hidden: torch.Tensor,
    router_logits: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    renormalize: bool,
    out: torch.Tensor,
    ws: MoEWorkspace,
) -> torch.Tensor:
    """A sparse MoE layer's experts: :func:`moe_route_align` then :func:`moe_experts`.

    Same semantics as :func:`kernels.reference.fused_moe_ref` (top-k of ``ws.top_k``).

    Args:
        hidden: ``[T, H]``; router_logits: ``[T, E]``; w13: ``[E, 2I, H]``; w2: ``[E, H, I]``;
        renormalize: ``norm_topk_prob``; out: ``[T, H]``, written and returned;
        ws: :func:`moe_workspace` for ``T`` tokens (every buffer is overwritten).

    Raises:
        ValueError: inconsistent shapes, dtypes, strides or devices.
    """
    _check_experts(hidden, w13, w2, ws)
    moe_route_align(router_logits, renormalize, ws)
    return moe_experts(hidden, w13, w2, ws, out)
