"""Triton varlen flash-attention prefill over the paged KV cache.

Layouts are those of :mod:`kernels.reference`. Queries of many sequences are packed on one
token axis (``cu_seqlens_q``); keys/values are read from the paged cache through the block
table, so a sequence's new tokens also attend to its cached prefix (chunked prefill, prefix
caching). The causal mask is bottom-right aligned: query ``j`` of sequence ``b`` sits at
position ``seq_lens[b] - q_len[b] + j``.

Algorithm: FlashAttention-2 (Dao, "FlashAttention-2: Faster Attention with Better Parallelism
and Work Partitioning", 2023) as written in Triton's fused-attention tutorial
(``python/tutorials/06-fused-attention.py``): one program per (query head, BLOCK_M query rows
of one sequence), online softmax in base 2 with fp32 running max / sum / accumulator, the KV loop
split into a mask-free part and a masked diagonal/tail part. Imports only torch and triton.

Grid: ``(H_q, T // BLOCK_M + B)`` with ``T = q.shape[0]`` and ``B = cu_seqlens_q.shape[0] - 1``,
shapes only, so one launch can be captured in a CUDA graph at a padded token count and batch
size and replayed for any step that fits. The query tiles of all sequences are laid on one flat
axis, and each program finds its sequence by a binary search over ``cu_seqlens_q``, the scheme
of vLLM's Triton unified attention (``find_seq_idx`` in
``vllm/v1/attention/ops/triton_unified_attention.py``); see :func:`_find_seq`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["prefill_attention", "prefill_config"]

_LOG2E = 1.4426950408889634
# CUDA's limit on gridDim.y, the query-tile axis of the launch
_MAX_GRID_Y = 65535


def _interpreter_upcast(q: torch.Tensor) -> bool:
    """True when 16-bit tiles must be upcast to fp32 before tl.dot.

    The Triton CPU interpreter stores bfloat16 as raw uint16 and its ``dot`` multiplies those
    integers (seen with triton 3.9), so off-GPU the kernels compute 16-bit inputs in fp32.
    """
    return q.device.type != "cuda" and q.dtype != torch.float32


@triton.jit
def _paged_attn_tile(
    acc,
    l_i,
    m_i,
    q,
    k_base,
    v_base,
    bt_row_ptr,
    lo,
    hi,
    seq_len,
    q_pos,
    qk_scale,
    stride_kb,
    stride_kt,
    stride_kd,
    stride_vb,
    stride_vt,
    stride_vd,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    MASK: tl.constexpr,
    CAUSAL: tl.constexpr,
    DOT_PREC: tl.constexpr,
    UPCAST: tl.constexpr,
    BT_PREFETCH: tl.constexpr,
):
    """Online-softmax update of (acc, l_i, m_i) with keys lo .. hi (lo multiple of BLOCK_N),
    K/V rows gathered from the paged cache through the block-table row ``bt_row_ptr``."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    if BT_PREFETCH:
        # block ids of the first tile; later tiles' ids are loaded one iteration ahead
        blk_next = tl.load(bt_row_ptr + (lo + offs_n) // PAGE_SIZE, mask=lo + offs_n < hi, other=0)
    for start_n in range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        k_pos = start_n + offs_n
        if MASK:
            kv_ok = k_pos < seq_len
        if BT_PREFETCH:
            blk = blk_next
            nxt = k_pos + BLOCK_N
            blk_next = tl.load(bt_row_ptr + nxt // PAGE_SIZE, mask=nxt < hi, other=0)
        elif MASK:
            blk = tl.load(bt_row_ptr + k_pos // PAGE_SIZE, mask=kv_ok, other=0)
        else:
            blk = tl.load(bt_row_ptr + k_pos // PAGE_SIZE)
        blk = blk.to(tl.int64)
        k_row = blk * stride_kb + (k_pos % PAGE_SIZE) * stride_kt
        v_row = blk * stride_vb + (k_pos % PAGE_SIZE) * stride_vt
        k_ptrs = k_base + k_row[:, None] + offs_d[None, :] * stride_kd
        v_ptrs = v_base + v_row[:, None] + offs_d[None, :] * stride_vd
        if MASK:
            k = tl.load(k_ptrs, mask=kv_ok[:, None], other=0.0)
        else:
            k = tl.load(k_ptrs)
        if UPCAST:
            k = k.to(tl.float32)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PREC)
        if MASK:
            ok = kv_ok[None, :]
            if CAUSAL:
                ok = ok & (k_pos[None, :] <= q_pos[:, None])
            qk = tl.where(ok, qk, float("-inf"))
        m_ij = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        p = tl.math.exp2(qk * qk_scale - m_ij[:, None])
        alpha = tl.math.exp2(m_i - m_ij)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        if MASK:
            v = tl.load(v_ptrs, mask=kv_ok[:, None], other=0.0)
        else:
            v = tl.load(v_ptrs)
        if UPCAST:
            v = v.to(tl.float32)
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PREC)
        m_i = m_ij
    return acc, l_i, m_i


@triton.jit
def _find_seq(cu_q_ptr, tile, num_seqs, BLOCK_M: tl.constexpr):
    """Last sequence ``s < num_seqs`` with ``cu_q[s] // BLOCK_M + s <= tile`` (binary search).

    Sequence ``s`` owns the flat tile slots ``cu_q[s] // BLOCK_M + s .. cu_q[s+1] // BLOCK_M + s``:
    that start is strictly increasing in ``s`` (``cu_q`` is non-decreasing and ``s`` grows by
    one), and the ``cu_q[s+1] // BLOCK_M - cu_q[s] // BLOCK_M + 1`` slots are at least
    ``cdiv(q_len, BLOCK_M)``, so every query tile has a slot and the last slot ends at
    ``cu_q[B] // BLOCK_M + B - 1 < T // BLOCK_M + B``. Empty (padding) sequences own one slot
    that does no work. After vLLM's ``find_seq_idx`` (triton_unified_attention.py).
    """
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        start = tl.load(cu_q_ptr + mid) // BLOCK_M + mid
        if start <= tile:
            lo = mid + 1
        else:
            hi = mid
    # slot 0 is sequence 0's first, so lo >= 1 here
    return lo - 1


# num_seqs is not specialized (== 1, % 16) so that a new batch size never compiles another
# variant; it only bounds the tile search.
@triton.jit(do_not_specialize=["num_seqs"])
def _prefill_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    block_tables_ptr,
    cu_q_ptr,
    seq_lens_ptr,
    num_seqs,
    qk_scale,
    stride_qt,
    stride_qh,
    stride_qd,
    stride_ot,
    stride_oh,
    stride_od,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_vd,
    stride_bt,
    NUM_GROUPS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    CAUSAL: tl.constexpr,
    DOT_PREC: tl.constexpr,
    UPCAST: tl.constexpr,
    BT_PREFETCH: tl.constexpr,
    SKIP_DECODE: tl.constexpr,
):
    head = tl.program_id(0)
    # The flat slot axis is walked in reverse: within a sequence its last (heaviest under the
    # causal mask) query tiles start first, which balances the tail of the launch.
    tile = tl.num_programs(1) - 1 - tl.program_id(1)
    seq = _find_seq(cu_q_ptr, tile, num_seqs, BLOCK_M)
    q_start = tl.load(cu_q_ptr + seq)
    q_len = tl.load(cu_q_ptr + seq + 1) - q_start
    m_blk = tile - (q_start // BLOCK_M + seq)
    # Spare slots have no rows: a sequence owns up to one more slot than cdiv(q_len, BLOCK_M)
    # (a padding sequence, q_len 0, owns just that one), and the slots that padding tokens past
    # cu_q[B] add to the grid all fall to the last sequence, past its q_len.
    if m_blk * BLOCK_M >= q_len:
        return
    # mixed step: decode rows (one new token) are computed by the split-KV decode kernel; the
    # constexpr test stays outside so that the flag off compiles no comparison at all
    if SKIP_DECODE:  # noqa: SIM102
        if q_len == 1:
            return
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx = seq_len - q_len  # cached prefix length (bottom-right causal alignment)
    kv_head = head // NUM_GROUPS

    offs_m = m_blk * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < q_len
    q_rows = (q_start + offs_m).to(tl.int64)
    q = tl.load(
        q_ptr + q_rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :] * stride_qd,
        mask=row_ok[:, None],
        other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)
    q_pos = ctx + offs_m

    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)

    k_base = k_ptr + kv_head * stride_kh
    v_base = v_ptr + kv_head * stride_vh
    bt_row_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt
    if CAUSAL:
        # Keys 0 .. ctx + first row are visible to every row of the tile: no mask needed there.
        hi_full = ((ctx + m_blk * BLOCK_M + 1) // BLOCK_N) * BLOCK_N
        hi = tl.minimum(seq_len, ctx + (m_blk + 1) * BLOCK_M)
    else:
        hi_full = (seq_len // BLOCK_N) * BLOCK_N
        hi = seq_len
    acc, l_i, m_i = _paged_attn_tile(
        acc,
        l_i,
        m_i,
        q,
        k_base,
        v_base,
        bt_row_ptr,
        0,
        hi_full,
        seq_len,
        q_pos,
        qk_scale,
        stride_kb,
        stride_kt,
        stride_kd,
        stride_vb,
        stride_vt,
        stride_vd,
        BLOCK_N,
        HEAD_DIM,
        PAGE_SIZE,
        False,
        CAUSAL,
        DOT_PREC,
        UPCAST,
        BT_PREFETCH,
    )
    acc, l_i, m_i = _paged_attn_tile(
        acc,
        l_i,
        m_i,
        q,
        k_base,
        v_base,
        bt_row_ptr,
        hi_full,
        hi,
        seq_len,
        q_pos,
        qk_scale,
        stride_kb,
        stride_kt,
        stride_kd,
        stride_vb,
        stride_vt,
        stride_vd,
        BLOCK_N,
        HEAD_DIM,
        PAGE_SIZE,
        True,
        CAUSAL,
        DOT_PREC,
        UPCAST,
        False,
    )
    l_i = tl.where(l_i > 0.0, l_i, 1.0)
    acc = acc / l_i[:, None]
    tl.store(
        out_ptr + q_rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :] * stride_od,
        acc.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None],
    )


def prefill_config(
    head_dim: int, dtype: torch.dtype, device: torch.device, causal: bool = True
) -> dict:
    """Tile configuration used by :func:`prefill_attention`: ``{BLOCK_M, BLOCK_N, num_warps,
    num_stages}`` plus the flag ``BT_PREFETCH`` (load the next tile's block ids one iteration
    ahead).

    Host-side and static (no autotuning at launch, so launches can be captured in a CUDA graph).
    Values for bf16/fp16 on CUDA were chosen by the sweep in ``bench/kernels.py`` on an H200.

    Args:
        head_dim: D; dtype: q's dtype; device: q's device (CPU means the Triton interpreter);
        causal: the mask mode.

    Returns:
        A new dict; raises nothing.
    """
    if device.type != "cuda":
        # Triton interpreter: small tiles exercise the tile boundaries in the tests.
        return {"BLOCK_M": 32, "BLOCK_N": 32, "num_warps": 4, "num_stages": 1, "BT_PREFETCH": True}
    if dtype == torch.float32:
        return {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 4, "num_stages": 2, "BT_PREFETCH": True}
    if head_dim <= 64:
        return {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3, "BT_PREFETCH": True}
    # chosen by the H200 sweep of bench/kernels.py (figures in docs/benchmarks.md, issue 3)
    return {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 2, "BT_PREFETCH": True}


def prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    out: torch.Tensor,
    scale: float,
    causal: bool = True,
    *,
    config: dict | None = None,
    skip_decode_rows: bool = False,
) -> torch.Tensor:
    """Varlen (packed) attention of new query tokens over the paged KV cache (Triton).

    Same semantics as :func:`kernels.reference.prefill_attention_ref`.

    Args:
        q: ``[T, H_q, D]`` packed queries, float16 / bfloat16 / float32, any strides.
        k_cache, v_cache: ``[num_blocks, block_size, H_kv, D]``, q's dtype, already holding this
            step's keys/values; ``H_q % H_kv == 0`` (MHA, GQA, MQA); D a power of two in [16, 256].
        block_tables: int32 ``[B, max_blocks]``; entries past a sequence's last block are ignored.
        cu_seqlens_q: int32 ``[B + 1]``, non-decreasing, offsets of each sequence's new tokens in
            ``q``, ``cu_seqlens_q[B] <= T`` (not checked: it lives on the device). Padding is
            allowed: rows ``cu_seqlens_q[B]:`` of ``q`` are never read and those of ``out`` never
            written, and sequences with ``q_len == 0`` do no work (their block-table rows and
            ``seq_lens`` are not read).
        seq_lens: int32 ``[B]`` cached + new tokens per sequence (``>= q_len``).
        out: ``[T, H_q, D]`` like ``q``; rows of every sequence written in place, returned.
        scale: softmax scale (usually ``D ** -0.5``).
        causal: bottom-right aligned causal mask (query j at position ``seq_len - q_len + j``).
        config: optional tile override ``{BLOCK_M, BLOCK_N, num_warps, num_stages}`` (benchmarks).
        skip_decode_rows: when True (a compile-time flag of the kernel), sequences with exactly
            one new token are skipped like padding: their rows of ``out`` are left untouched for
            ``decode_attention(..., cu_seqlens_q=cu_seqlens_q)`` to fill (mixed steps).

    Returns:
        ``out``.

    Raises:
        ValueError: on inconsistent shapes, dtypes, devices, head counts or head_dim, or when
            ``T // BLOCK_M + B`` exceeds CUDA's 65535 limit on the grid's second axis.

    Grid: ``(H_q, T // BLOCK_M + B)``, from the shapes of ``q`` and ``cu_seqlens_q`` only (no
    host int, no device-to-host sync), so a launch can be captured in a CUDA graph at a padded
    ``T`` and ``B`` and replayed for every step that fits. Each program finds its sequence and
    query tile by a binary search over ``cu_seqlens_q`` (after vLLM's Triton unified attention,
    ``find_seq_idx`` in ``vllm/v1/attention/ops/triton_unified_attention.py``).

    Algorithm: FlashAttention-2 (Dao 2023) after Triton's fused-attention tutorial; K/V rows are
    gathered through the block table tile by tile (``block = block_tables[b, pos // block_size]``).
    """
    if q.dim() != 3:
        raise ValueError(f"q must be [T, H_q, D], got {tuple(q.shape)}")
    if out.shape != q.shape or out.dtype != q.dtype or out.device != q.device:
        raise ValueError(
            f"out must match q's shape/dtype/device, got {tuple(out.shape)} {out.dtype}"
        )
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"unsupported dtype {q.dtype}; expected float16, bfloat16 or float32")
    t, hq, d = q.shape
    if d < 16 or d > 256 or d & (d - 1):
        raise ValueError(f"head_dim must be a power of two in [16, 256], got {d}")
    if (
        cu_seqlens_q.dim() != 1
        or cu_seqlens_q.dtype != torch.int32
        or cu_seqlens_q.device != q.device
    ):
        raise ValueError("cu_seqlens_q must be an int32 [B + 1] tensor on q's device")
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError("k_cache/v_cache must be [num_blocks, block_size, H_kv, D] of equal shape")
    _, page_size, hkv, dk = k_cache.shape
    if dk != d:
        raise ValueError(f"cache head_dim {dk} != q head_dim {d}")
    if hkv == 0 or hq % hkv:
        raise ValueError(f"H_q={hq} must be a multiple of H_kv={hkv}")
    if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise ValueError("k_cache/v_cache must have q's dtype")
    b = cu_seqlens_q.shape[0] - 1
    if block_tables.dim() != 2 or block_tables.dtype != torch.int32 or block_tables.shape[0] != b:
        raise ValueError(
            f"block_tables must be int32 [B={b}, max_blocks], got {tuple(block_tables.shape)} "
            f"{block_tables.dtype}"
        )
    if seq_lens.shape != (b,) or seq_lens.dtype != torch.int32:
        raise ValueError(f"seq_lens must be int32 [B={b}]")
    if block_tables.stride(1) != 1 and block_tables.shape[1] > 1:
        raise ValueError("block_tables rows must be contiguous")
    devs = {k_cache.device, v_cache.device, block_tables.device, seq_lens.device}
    if devs != {q.device}:
        raise ValueError("all tensors must be on q's device")
    if t == 0 or b == 0:
        return out
    upcast = _interpreter_upcast(q)
    cfg = dict(prefill_config(d, q.dtype, q.device, causal))
    if config:
        cfg.update(config)
    # Shapes only (never a per-step value such as the longest q_len), so the launch can be
    # captured in a CUDA graph at a padded T and B; see _find_seq for why this covers every tile.
    num_slots = t // cfg["BLOCK_M"] + b
    if num_slots > _MAX_GRID_Y:
        raise ValueError(
            f"T // BLOCK_M + B = {num_slots} query-tile slots exceed the grid's second axis "
            f"({_MAX_GRID_Y})"
        )
    _prefill_kernel[(hq, num_slots)](
        q,
        k_cache,
        v_cache,
        out,
        block_tables,
        cu_seqlens_q,
        seq_lens,
        b,
        float(scale) * _LOG2E,
        q.stride(0),
        q.stride(1),
        q.stride(2),
        out.stride(0),
        out.stride(1),
        out.stride(2),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        k_cache.stride(3),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        v_cache.stride(3),
        block_tables.stride(0),
        NUM_GROUPS=hq // hkv,
        HEAD_DIM=d,
        BLOCK_M=cfg["BLOCK_M"],
        BLOCK_N=cfg["BLOCK_N"],
        PAGE_SIZE=page_size,
        CAUSAL=bool(causal),
        DOT_PREC="ieee" if q.dtype == torch.float32 or upcast else "tf32",
        UPCAST=upcast,
        BT_PREFETCH=bool(cfg.get("BT_PREFETCH", False)),
        SKIP_DECODE=bool(skip_decode_rows),
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
    )
    return out
