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

Split-KV mode (``num_splits > 1``): Flash-Decoding (Dao, Haziza, Massa, Sizov, "Flash-Decoding for
long-context inference", 2023) applied to query tiles. A prompt chunk of few rows over a long
cached prefix gives few (query tile, head) programs, each sweeping every key serially, and most
SMs idle; a third grid axis then cuts each tile's key range ``[0, hi)`` into ``num_splits``
contiguous, ``BLOCK_N``-aligned ranges (at least ``MIN_SPLIT_KEYS`` keys each, so a short range
is split less or not at all). Each split runs the same two loops (unmasked keys, then the masked
causal diagonal, which falls in the last split or two) and writes its normalised partial output
and base-2 log-sum-exp to fp32 scratch; :func:`_prefill_merge_kernel` merges the splits of every
tile that had more than one (a tile whose range fits one split is written to ``out`` directly).
The host picks ``num_splits`` (:mod:`kernels.prefill_split`), so grids stay shape-only.

GQA packing (config / table key ``GQA_PACK``; off unless a table row or ``config`` sets it):
the ``G = H_q / H_kv`` query heads that share a KV head are packed into the M dimension of one
tile, as FlashAttention's ``pack_gqa`` (``hopper/pack_gqa.h``), FlashInfer's prefill and vLLM's
Triton unified attention (``BLOCK_Q = BLOCK_M // num_queries_per_kv`` in
``vllm/v1/attention/ops/triton_unified_attention.py``) do. A program then owns one KV head and
``TOK = BLOCK_M // G`` tokens x its G heads: row ``r = t * G + g`` of the ``[BLOCK_M, D]`` Q tile
is token ``t`` of the tile, query head ``kv_head * G + g`` (with q ``[T, H_q, D]`` the G heads of
a token are adjacent, so the Q load and the output store move ``G * D`` contiguous elements per
token). Every K/V tile, and every block-id load, then serves G heads instead of being loaded
once per query head (G times less K/V and block-table traffic from L2; the ``tl.dot`` shapes are
unchanged). The flat tile axis, the key ranges and the split merge count tiles of ``TOK``
tokens; the causal limit is per row (its token's position ``ctx + t``), and the diagonal of a
tile spans ``TOK`` tokens, not ``BLOCK_M``. Used only where ``G`` is a power of two >= 2 and
``TOK >= MIN_PACK_TOKENS`` (:func:`prefill_tiling`); otherwise (MHA, Qwen2.5-0.5B's G = 7, or
too few tokens per tile) the unpacked kernel runs. Grid ``(H_kv, T // TOK + B[, splits])``.

Tile configurations are static: :func:`prefill_config` reads the table measured on the GPU
(``bench/prefill_long.py --sweep --write-table`` writes
``kernels/configs/prefill_attention_<device>.json``); a device, dtype or head_dim without an entry
keeps the configuration chosen by the issue-3 sweep.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.configs import device_name, kernel_table, num_sms

try:  # host-side tensor descriptors (TMA), triton >= 3.4
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - older triton
    TensorDescriptor = None

__all__ = [
    "prefill_attention",
    "prefill_config",
    "prefill_tiling",
    "PREFILL_TABLE_KEYS",
    "MIN_PACK_TOKENS",
    "kv_tma_available",
]

_LOG2E = 1.4426950408889634
# CUDA's limit on gridDim.y, the query-tile axis of the launch
_MAX_GRID_Y = 65535
#: rows per program of the split merge, and its warps (32 fp32 values per thread per tile at D=128)
MERGE_M = 32
MERGE_WARPS = 4


def _interpreter_upcast(q: torch.Tensor) -> bool:
    """True when 16-bit tiles must be upcast to fp32 before tl.dot.

    The Triton CPU interpreter stores bfloat16 as raw uint16 and its ``dot`` multiplies those
    integers (seen with triton 3.9), so off-GPU the kernels compute 16-bit inputs in fp32.
    """
    return q.device.type != "cuda" and q.dtype != torch.float32


@triton.jit
def _online_softmax_step(qk, acc, l_i, m_i, k_pos, kv_ok, q_pos, qk_scale, MASK, CAUSAL):
    """One key tile's online-softmax update (FlashAttention-2, base 2): scores ``qk``
    ``[rows, BLOCK_N]`` masked where ``MASK`` (keys ``k_pos`` past ``seq_len``, i.e. not
    ``kv_ok``, and with ``CAUSAL`` keys after the row's position ``q_pos``), the running max and
    sum advanced and ``acc`` rescaled. Returns ``(p, acc, l_i, m_ij)``; the caller adds
    ``p @ V`` to ``acc`` and takes ``m_ij`` as its new running max."""
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
    return p, acc, l_i, m_ij


@triton.jit
def _paged_attn_tile_tma(
    acc,
    l_i,
    m_i,
    q,
    k_desc,
    v_desc,
    kv_col,
    bt_row_ptr,
    lo,
    hi,
    seq_len,
    q_pos,
    qk_scale,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    MASK: tl.constexpr,
    CAUSAL: tl.constexpr,
    DOT_PREC: tl.constexpr,
    UPCAST: tl.constexpr,
    BT_PREFETCH: tl.constexpr,
):
    """:func:`_paged_attn_tile` with K/V tiles loaded through tensor descriptors (the prefill
    kernel's ``KV_TMA`` mode): a tile lies in one page (``PAGE_SIZE % BLOCK_N == 0``), so it is
    one ``[BLOCK_N, HEAD_DIM]`` box of the cache viewed as ``[blocks * PAGE_SIZE, H_kv * D]`` at
    row ``block * PAGE_SIZE + pos % PAGE_SIZE``, column ``kv_col`` (the KV head's), copied by
    Hopper's tensor memory accelerator through the host descriptors ``k_desc`` / ``v_desc``:
    one block-id load per tile instead of one per key row, no per-row address arithmetic. The
    copy does not mask rows past ``seq_len`` in a masked tile: their scores are masked and their
    V rows zeroed (unused cache slots may hold anything, NaN included)."""
    offs_n = tl.arange(0, BLOCK_N)
    if BT_PREFETCH:
        blk_next = tl.load(bt_row_ptr + lo // PAGE_SIZE, mask=lo < hi, other=0)
    for start_n in range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        if BT_PREFETCH:
            blk = blk_next
            nxt = start_n + BLOCK_N
            blk_next = tl.load(bt_row_ptr + nxt // PAGE_SIZE, mask=nxt < hi, other=0)
        else:
            blk = tl.load(bt_row_ptr + start_n // PAGE_SIZE)
        row = blk * PAGE_SIZE + start_n % PAGE_SIZE
        k = k_desc.load([row, kv_col])
        if UPCAST:
            k = k.to(tl.float32)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PREC)
        k_pos = start_n + offs_n
        kv_ok = k_pos < seq_len  # used where MASK (constexpr); dead code otherwise
        p, acc, l_i, m_ij = _online_softmax_step(
            qk, acc, l_i, m_i, k_pos, kv_ok, q_pos, qk_scale, MASK, CAUSAL
        )
        v = v_desc.load([row, kv_col])
        if MASK:
            v = tl.where(kv_ok[:, None], v, 0.0)
        if UPCAST:
            v = v.to(tl.float32)
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PREC)
        m_i = m_ij
    return acc, l_i, m_i


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
        kv_ok = k_pos < seq_len  # used where MASK (constexpr); dead code otherwise
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
        p, acc, l_i, m_ij = _online_softmax_step(
            qk, acc, l_i, m_i, k_pos, kv_ok, q_pos, qk_scale, MASK, CAUSAL
        )
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
def _paged_attn_range(
    acc, l_i, m_i, q, k_base, v_base, k_desc, v_desc, kv_col, bt_row_ptr,
    lo, hi, seq_len, q_pos, qk_scale,
    stride_kb, stride_kt, stride_kd, stride_vb, stride_vt, stride_vd,
    BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr, MASK: tl.constexpr,
    CAUSAL: tl.constexpr, DOT_PREC: tl.constexpr, UPCAST: tl.constexpr,
    BT_PREFETCH: tl.constexpr, KV_TMA: tl.constexpr,
):  # fmt: skip
    """Keys ``lo .. hi`` of the prefill kernel through :func:`_paged_attn_tile_tma` (``KV_TMA``:
    the descriptors, column ``kv_col``) or :func:`_paged_attn_tile` (the pointer gather from
    ``k_base`` / ``v_base`` with the cache strides); the other path's arguments are unused."""
    if KV_TMA:
        acc, l_i, m_i = _paged_attn_tile_tma(
            acc, l_i, m_i, q, k_desc, v_desc, kv_col, bt_row_ptr, lo, hi, seq_len, q_pos,
            qk_scale, BLOCK_N, HEAD_DIM, PAGE_SIZE, MASK, CAUSAL, DOT_PREC, UPCAST, BT_PREFETCH,
        )  # fmt: skip
    else:
        acc, l_i, m_i = _paged_attn_tile(
            acc, l_i, m_i, q, k_base, v_base, bt_row_ptr, lo, hi, seq_len, q_pos, qk_scale,
            stride_kb, stride_kt, stride_kd, stride_vb, stride_vt, stride_vd,
            BLOCK_N, HEAD_DIM, PAGE_SIZE, MASK, CAUSAL, DOT_PREC, UPCAST, BT_PREFETCH,
        )  # fmt: skip
    return acc, l_i, m_i


@triton.jit
def _find_seq(cu_q_ptr, tile, num_seqs, TOK: tl.constexpr):
    """Last sequence ``s < num_seqs`` with ``cu_q[s] // TOK + s <= tile`` (binary search).

    ``TOK`` is the query tokens of one tile (``BLOCK_M``, or ``BLOCK_M // G`` when GQA-packed).
    Sequence ``s`` owns the flat tile slots ``cu_q[s] // TOK + s .. cu_q[s+1] // TOK + s``:
    that start is strictly increasing in ``s`` (``cu_q`` is non-decreasing and ``s`` grows by
    one), and the ``cu_q[s+1] // TOK - cu_q[s] // TOK + 1`` slots are at least
    ``cdiv(q_len, TOK)``, so every query tile has a slot and the last slot ends at
    ``cu_q[B] // TOK + B - 1 < T // TOK + B``. Empty (padding) sequences own one slot
    that does no work. After vLLM's ``find_seq_idx`` (triton_unified_attention.py).
    """
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        start = tl.load(cu_q_ptr + mid) // TOK + mid
        if start <= tile:
            lo = mid + 1
        else:
            hi = mid
    # slot 0 is sequence 0's first, so lo >= 1 here
    return lo - 1


@triton.jit
def _query_tile(cu_q_ptr, tile, num_seqs, TOK: tl.constexpr):
    """``(seq, q_start, q_len, m_blk)`` of slot ``tile`` of the flat axis of ``TOK``-token
    query tiles (tile ``m_blk`` of sequence ``seq`` holds its tokens ``m_blk * TOK ..``)."""
    seq = _find_seq(cu_q_ptr, tile, num_seqs, TOK)
    q_start = tl.load(cu_q_ptr + seq)
    q_len = tl.load(cu_q_ptr + seq + 1) - q_start
    m_blk = tile - (q_start // TOK + seq)
    return seq, q_start, q_len, m_blk


@triton.jit
def _key_range(ctx, seq_len, m_blk, TOK: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr):
    """``(hi_full, hi)``: query tile ``m_blk`` (tokens ``m_blk * TOK ..``) attends to keys
    ``0 .. hi``, and keys below ``hi_full`` (a multiple of ``BLOCK_N``) are visible to every row
    of the tile (no mask)."""
    if CAUSAL:
        # keys 0 .. ctx + first token are visible to every row of the tile
        hi_full = ((ctx + m_blk * TOK + 1) // BLOCK_N) * BLOCK_N
        hi = tl.minimum(seq_len, ctx + (m_blk + 1) * TOK)
    else:
        hi_full = (seq_len // BLOCK_N) * BLOCK_N
        hi = seq_len
    return hi_full, hi


@triton.jit
def _split_len(hi, num_splits, min_split_keys, BLOCK_N: tl.constexpr):
    """``(split_len, n)``: a key range ``0 .. hi`` (``hi >= 1``) cut into ``n <= num_splits``
    splits of ``split_len`` keys (the last one shorter), ``split_len`` a multiple of ``BLOCK_N``
    and at least ``min_split_keys`` (itself a multiple of ``BLOCK_N``)."""
    split_len = tl.cdiv(tl.cdiv(hi, num_splits), BLOCK_N) * BLOCK_N
    split_len = tl.maximum(split_len, min_split_keys)
    return split_len, tl.cdiv(hi, split_len)


# num_seqs is not specialized (== 1, % 16) so that a new batch size never compiles another
# variant; it only bounds the tile search. Nor are the split-mode ints (split count, minimum split
# length, the scratch's split strides, which grow with T).
@triton.jit(
    do_not_specialize=["num_seqs", "num_splits", "min_split_keys", "stride_pos", "stride_pls"]
)
def _prefill_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    k_desc,
    v_desc,
    out_ptr,
    po_ptr,
    plse_ptr,
    block_tables_ptr,
    cu_q_ptr,
    seq_lens_ptr,
    num_seqs,
    num_splits,
    min_split_keys,
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
    stride_pos,
    stride_pot,
    stride_poh,
    stride_pls,
    stride_plt,
    stride_plh,
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
    SPLIT: tl.constexpr,
    GQA_PACK: tl.constexpr,
    KV_TMA: tl.constexpr,
    ZIGZAG: tl.constexpr = False,
):
    # GQA_PACK: axis 0 is the KV head, and the BLOCK_M rows of a tile are TOK tokens x the
    # NUM_GROUPS query heads of that KV head (row r: token r // G, head r % G of the group), so
    # each K/V tile is loaded once for the G heads. Otherwise axis 0 is the query head and the
    # rows are BLOCK_M tokens of it.
    TOK: tl.constexpr = BLOCK_M // NUM_GROUPS if GQA_PACK else BLOCK_M
    head = tl.program_id(0)  # the KV head when packed
    # The flat slot axis is walked in reverse: within a sequence its last (heaviest under the
    # causal mask) query tiles start first, which balances the tail of a launch of many waves.
    # ZIGZAG (a launch of about two programs per SM, one wave): the first half of the programs
    # takes the slots from the last one down, the second half from the first one up, so that
    # the program an SM gets second (blocks are dispatched in launch order) is a light tile
    # next to its heavy one (causal load balancing as in zigzag / striped attention).
    n_slots = tl.num_programs(1)
    p_slot = tl.program_id(1)
    if ZIGZAG:
        half = (n_slots + 1) // 2
        tile = tl.where(p_slot < half, n_slots - 1 - p_slot, p_slot - half)
    else:
        tile = n_slots - 1 - p_slot
    seq, q_start, q_len, m_blk = _query_tile(cu_q_ptr, tile, num_seqs, TOK)
    # Spare slots have no rows: a sequence owns up to one more slot than cdiv(q_len, TOK)
    # (a padding sequence, q_len 0, owns just that one), and the slots that padding tokens past
    # cu_q[B] add to the grid all fall to the last sequence, past its q_len.
    if m_blk * TOK >= q_len:
        return
    # mixed step: decode rows (one new token) are computed by the split-KV decode kernel; the
    # constexpr test stays outside so that the flag off compiles no comparison at all
    if SKIP_DECODE:  # noqa: SIM102
        if q_len == 1:
            return
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx = seq_len - q_len  # cached prefix length (bottom-right causal alignment)
    if GQA_PACK:
        kv_head = head
    else:
        kv_head = head // NUM_GROUPS
    hi_full, hi = _key_range(ctx, seq_len, m_blk, TOK, BLOCK_N, CAUSAL)
    if SPLIT:
        # split `split` of the tile's keys 0 .. hi: unmasked keys lo .. full_end, then the masked
        # ones mask_lo .. end (empty unless the split reaches the diagonal / the tail)
        split = tl.program_id(2)
        split_len, n_split = _split_len(hi, num_splits, min_split_keys, BLOCK_N)
        if split >= n_split:
            return
        lo = split * split_len
        end = tl.minimum(lo + split_len, hi)
        full_end = tl.maximum(tl.minimum(end, hi_full), lo)
        mask_lo = tl.maximum(lo, hi_full)
    else:
        lo = 0
        end = hi
        full_end = hi_full
        mask_lo = hi_full

    if GQA_PACK:
        # token of each row in its sequence, and the row's query head ([BLOCK_M] and its column)
        offs_r = tl.arange(0, BLOCK_M)
        offs_m = m_blk * TOK + offs_r // NUM_GROUPS
        heads = head * NUM_GROUPS + offs_r % NUM_GROUPS
        head_c = heads[:, None]
    else:
        offs_m = m_blk * BLOCK_M + tl.arange(0, BLOCK_M)
        heads = head
        head_c = head
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < q_len
    q_rows = (q_start + offs_m).to(tl.int64)
    q = tl.load(
        q_ptr + q_rows[:, None] * stride_qt + head_c * stride_qh + offs_d[None, :] * stride_qd,
        mask=row_ok[:, None],
        other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)
    q_pos = ctx + offs_m  # per row: its token's position (packed rows of a token share it)

    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)

    k_base = k_ptr + kv_head * stride_kh
    v_base = v_ptr + kv_head * stride_vh
    bt_row_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt
    # unmasked keys lo .. full_end, then the masked ones mask_lo .. end (block-id prefetch on
    # the long unmasked run only)
    acc, l_i, m_i = _paged_attn_range(
        acc, l_i, m_i, q, k_base, v_base, k_desc, v_desc, kv_head * HEAD_DIM, bt_row_ptr,
        lo, full_end, seq_len, q_pos, qk_scale,
        stride_kb, stride_kt, stride_kd, stride_vb, stride_vt, stride_vd,
        BLOCK_N, HEAD_DIM, PAGE_SIZE, False, CAUSAL, DOT_PREC, UPCAST, BT_PREFETCH, KV_TMA,
    )  # fmt: skip
    acc, l_i, m_i = _paged_attn_range(
        acc, l_i, m_i, q, k_base, v_base, k_desc, v_desc, kv_head * HEAD_DIM, bt_row_ptr,
        mask_lo, end, seq_len, q_pos, qk_scale,
        stride_kb, stride_kt, stride_kd, stride_vb, stride_vt, stride_vd,
        BLOCK_N, HEAD_DIM, PAGE_SIZE, True, CAUSAL, DOT_PREC, UPCAST, False, KV_TMA,
    )  # fmt: skip
    has = l_i > 0.0  # a split may hold no key a row can see (rows above the diagonal)
    acc = acc / tl.where(has, l_i, 1.0)[:, None]
    o_ptrs = (
        out_ptr + q_rows[:, None] * stride_ot + head_c * stride_oh + offs_d[None, :] * stride_od
    )
    if SPLIT:
        if n_split > 1:
            lse = tl.where(has, m_i + tl.math.log2(tl.where(has, l_i, 1.0)), float("-inf"))
            split64 = split.to(tl.int64)
            po_ptrs = (
                po_ptr
                + split64 * stride_pos
                + q_rows[:, None] * stride_pot
                + head_c * stride_poh
                + offs_d[None, :]
            )
            tl.store(po_ptrs, acc, mask=row_ok[:, None])
            lse_ptrs = plse_ptr + split64 * stride_pls + q_rows * stride_plt + heads * stride_plh
            tl.store(lse_ptrs, lse, mask=row_ok)
        else:  # the tile's keys fit one split: no merge
            tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
    else:
        tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


@triton.jit(
    do_not_specialize=["num_seqs", "num_splits", "min_split_keys", "stride_pos", "stride_pls"]
)
def _prefill_merge_kernel(
    out_ptr,
    po_ptr,
    plse_ptr,
    cu_q_ptr,
    seq_lens_ptr,
    num_seqs,
    num_splits,
    min_split_keys,
    stride_ot,
    stride_oh,
    stride_od,
    stride_pos,
    stride_pot,
    stride_poh,
    stride_pls,
    stride_plt,
    stride_plh,
    HEAD_DIM: tl.constexpr,
    TOK: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MERGE_M: tl.constexpr,
    CAUSAL: tl.constexpr,
    SKIP_DECODE: tl.constexpr,
):
    """Second stage of the split-KV mode, grid ``(H_q, slots * TOK // MERGE_M)``: program
    ``(head, slot * TOK // MERGE_M + sub)`` merges the rows of query head ``head`` for tokens
    ``sub * MERGE_M ..`` of the first stage's query tile ``slot`` over its ``n > 1`` splits
    (``TOK``: the first stage's tokens per tile, ``BLOCK_M`` or, GQA-packed, ``BLOCK_M // G``, so
    both stages cut the same tiles and agree on which were split), with weights
    ``2^(lse_s - max lse)`` (online, one split at a time); tiles that had one split were written
    by the first stage. Small row blocks keep the merge's tiles in registers (it streams
    ``n * MERGE_M * D`` fp32 partials and does little arithmetic)."""
    head = tl.program_id(0)
    tile = tl.program_id(1) // (TOK // MERGE_M)
    sub = tl.program_id(1) % (TOK // MERGE_M)
    seq, q_start, q_len, m_blk = _query_tile(cu_q_ptr, tile, num_seqs, TOK)
    if m_blk * TOK + sub * MERGE_M >= q_len:
        return
    if SKIP_DECODE:  # noqa: SIM102
        if q_len == 1:
            return
    seq_len = tl.load(seq_lens_ptr + seq)
    _, hi = _key_range(seq_len - q_len, seq_len, m_blk, TOK, BLOCK_N, CAUSAL)
    _, n_split = _split_len(hi, num_splits, min_split_keys, BLOCK_N)
    if n_split <= 1:
        return
    offs_r = tl.arange(0, MERGE_M)
    offs_d = tl.arange(0, HEAD_DIM)
    first = m_blk * TOK + sub * MERGE_M  # first token of this block in its sequence
    row_ok = first + offs_r < q_len
    row0 = (q_start + first).to(tl.int64)  # its packed row
    # scalar bases advanced split by split, small loop-invariant offsets within the block (a
    # loop-carried pointer tensor would hold two registers per element)
    lse_base = plse_ptr + row0 * stride_plt + head * stride_plh
    po_base = po_ptr + row0 * stride_pot + head * stride_poh
    lse_offs = offs_r * stride_plt
    po_offs = offs_r[:, None] * stride_pot + offs_d[None, :]
    m = tl.full([MERGE_M], -1.0e30, dtype=tl.float32)
    w_sum = tl.zeros([MERGE_M], dtype=tl.float32)
    acc = tl.zeros([MERGE_M, HEAD_DIM], dtype=tl.float32)
    for _ in range(0, n_split):
        lse = tl.load(lse_base + lse_offs, mask=row_ok, other=float("-inf"))
        po = tl.load(po_base + po_offs, mask=row_ok[:, None], other=0.0)
        lse_base += stride_pls
        po_base += stride_pos
        m_new = tl.maximum(m, lse)
        alpha = tl.math.exp2(m - m_new)
        w = tl.math.exp2(lse - m_new)  # 0 where the split saw no key of the row (lse = -inf)
        acc = acc * alpha[:, None] + po * w[:, None]
        w_sum = w_sum * alpha + w
        m = m_new
    acc = acc / tl.where(w_sum > 0.0, w_sum, 1.0)[:, None]
    q_rows = row0 + offs_r
    tl.store(
        out_ptr + q_rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :] * stride_od,
        acc.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None],
    )


#: keys of a table row that :func:`prefill_config` takes: the tiles, the kernel's flags, and (split
#: rows) the split policy of :mod:`kernels.prefill_split`; other keys (timings) are ignored
PREFILL_TABLE_KEYS = (
    "BLOCK_M",
    "BLOCK_N",
    "num_warps",
    "num_stages",
    "BT_PREFETCH",
    "GQA_PACK",
    "KV_TMA",
    "MIN_SPLIT_KEYS",
    "PROGRAMS_PER_SM",
    "MAX_SPLITS",
)
#: split policy without a table row: splits of at least 512 keys (4 tiles of 128: the partial
#: write and merge stay small next to the key sweep), one resident program per SM (BLOCK_M 128,
#: 8 warps), at most 16 splits (``MAX_SPLITS`` 1 turns the split mode off); the interpreter
#: splits at one tile so small tests cross split boundaries
_SPLIT_POLICY = {"MIN_SPLIT_KEYS": 512, "PROGRAMS_PER_SM": 1, "MAX_SPLITS": 16}


#: fewest query tokens of a GQA-packed tile (``BLOCK_M // G``); a smaller quotient falls back to
#: the unpacked kernel. Not a tl.dot limit (the dot's M stays BLOCK_M): it keeps the flat tile
#: axis (``T // TOK + B`` slots, each a binary search) and the split merge's blocks
#: (``min(MERGE_M, TOK)`` tokens) from growing past 8x the unpacked ones; e.g. BLOCK_M 128
#: packs G = 2, 4, 8, BLOCK_M 64 packs G = 2, 4
MIN_PACK_TOKENS = 16


def prefill_tiling(cfg: dict, num_heads: int, num_kv_heads: int) -> tuple[bool, int, int]:
    """``(packed, tok, grid_heads)`` of a launch with config ``cfg`` (a :func:`prefill_config`
    dict) for ``H_q = num_heads``, ``H_kv = num_kv_heads``: whether the GQA-packed kernel runs,
    the query tokens of one tile, and the grid's first axis (the program count per query tile).

    Packed when ``cfg["GQA_PACK"]`` is true and ``G = H_q / H_kv`` is a power of two >= 2 with
    ``BLOCK_M // G >= MIN_PACK_TOKENS``: then ``(True, BLOCK_M // G, H_kv)``; otherwise (also
    G = 7 of Qwen2.5-0.5B, or MHA) the unpacked kernel, ``(False, BLOCK_M, H_q)``. Host ints
    only.
    """
    block_m = int(cfg["BLOCK_M"])
    groups = num_heads // num_kv_heads
    if (
        cfg.get("GQA_PACK", False)
        and groups >= 2
        and (groups & (groups - 1)) == 0
        and block_m % groups == 0
        and block_m // groups >= MIN_PACK_TOKENS
    ):
        return True, block_m // groups, num_kv_heads
    return False, block_m, num_heads


def one_wave_tiles(
    cfg: dict,
    num_tokens: int,
    num_seqs: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
    page_size: int | None,
) -> dict:
    """Config keys for an unsplit causal launch whose grid under ``cfg`` leaves SMs idle: a
    lone prompt of about a thousand tokens gets ``cdiv(T, BLOCK_M) * H`` = 128 programs of
    128-row tiles on the H200's 132 SMs, each SM one program, and the launch lasts as long as
    its last query tile, which sweeps every key tile (8) while the first sweeps one. With the
    split row's tiles (:func:`prefill_config` ``split=True``: 64-row tiles, two programs per
    SM) the grid is one wave of twice as many programs, and ``ZIGZAG`` pairs each SM's heavy
    tile with a light one (see the kernel), so an SM's work is about the mean.

    Returns ``{}`` (keep ``cfg``) unless the device is CUDA, ``cfg``'s grid (its query tiles
    that can hold rows: ``cdiv(num_tokens, TOK) + num_seqs - 1`` at most, times the grid's
    heads) is below the SM count and the split row's grid fills at most ``PROGRAMS_PER_SM``
    (>= 2) programs per SM; else the split row's tile keys and ``ZIGZAG``. Host ints only (a
    graph's padded ``T`` gives a fixed choice). :func:`prefill_attention` asks only when no
    ``config`` is passed: any explicit config, even of one key, keeps the launch as it says.
    """
    if device.type != "cuda" or num_tokens == 0:
        return {}
    sms = num_sms(device)

    def programs(c: dict) -> int:
        _, tok, grid_heads = prefill_tiling(c, num_heads, num_kv_heads)
        return grid_heads * (-(-num_tokens // tok) + num_seqs - 1)

    if programs(cfg) >= sms:
        return {}
    row = prefill_config(head_dim, dtype, device, causal=True, split=True, page_size=page_size)
    per_sm = int(row.get("PROGRAMS_PER_SM", 1))
    if per_sm < 2 or programs(row) > per_sm * sms or programs(row) <= programs(cfg):
        return {}
    keys = ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages", "BT_PREFETCH")
    tiles = {k: row[k] for k in keys if k in row}
    # the flags the row leaves unset are off in it (as programs(row) counted them), not cfg's
    tiles.update(GQA_PACK=bool(row.get("GQA_PACK", False)), KV_TMA=bool(row.get("KV_TMA", False)))
    return {**tiles, "ZIGZAG": True}


def _dtype_key(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _default_config(head_dim: int, dtype: torch.dtype, device: torch.device) -> dict:
    """The tiles without a table entry (the issue-3 choice, unchanged)."""
    if device.type != "cuda":
        # Triton interpreter: small tiles exercise the tile boundaries in the tests.
        return {"BLOCK_M": 32, "BLOCK_N": 32, "num_warps": 4, "num_stages": 1, "BT_PREFETCH": True}
    if dtype == torch.float32:
        return {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 4, "num_stages": 2, "BT_PREFETCH": True}
    if head_dim <= 64:
        return {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3, "BT_PREFETCH": True}
    # chosen by the H200 sweep of bench/kernels.py (figures in docs/benchmarks.md, issue 3)
    return {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 2, "BT_PREFETCH": True}


_TMA_CAPABLE: dict[int, bool] = {}


def kv_tma_available(device: torch.device) -> bool:
    """Whether the ``KV_TMA`` loads can run on ``device``: a CUDA GPU of compute capability 9.0
    or newer (Hopper's tensor memory accelerator) with Triton's host tensor descriptors, or the
    CPU interpreter (tests). Host-side, cached per device index (every launch asks)."""
    if TensorDescriptor is None:
        return False
    device = torch.device(device)
    if device.type != "cuda":
        return device.type == "cpu"
    index = device.index if device.index is not None else torch.cuda.current_device()
    ok = _TMA_CAPABLE.get(index)
    if ok is None:
        ok = _TMA_CAPABLE[index] = torch.cuda.get_device_capability(index)[0] >= 9
    return ok


def _default_tma_config(head_dim: int, dtype: torch.dtype) -> dict | None:
    """The ``KV_TMA`` tiles without a table row, or None where none was measured (then the
    pointer gather runs). ``bench/prefill_variants.py`` on the H200 (2026-12-04): page 128,
    D=128 bf16, BLOCK_N 64 with 4 warps and 3 stages was the fastest paged-TMA tile on 1 x 16k
    and 4 x 4k causal prompts (472 and 469 TFLOP/s, against 439 and 397 for the pointer
    gather over 16-token pages)."""
    if head_dim != 128 or dtype not in (torch.bfloat16, torch.float16):
        return None
    return {
        "BLOCK_M": 128,
        "BLOCK_N": 64,
        "num_warps": 4,
        "num_stages": 3,
        "BT_PREFETCH": True,
        "KV_TMA": True,
    }


def prefill_config(
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
    causal: bool = True,
    split: bool = False,
    page_size: int | None = None,
) -> dict:
    """Tile configuration used by :func:`prefill_attention`: ``{BLOCK_M, BLOCK_N, num_warps,
    num_stages, BT_PREFETCH}`` (``BT_PREFETCH``: load the next tile's block ids one iteration
    ahead), plus ``GQA_PACK`` where a table row sets it (absent = False: pack the G query heads
    of a KV head into a tile's rows, see :func:`prefill_tiling`); with ``split``, also the split
    policy ``MIN_SPLIT_KEYS`` (fewest keys of one split), ``PROGRAMS_PER_SM`` (programs one SM
    runs at once) and ``MAX_SPLITS`` (1: never split), for
    :func:`kernels.prefill_split.choose_prefill_splits`.

    Host-side and static (no autotuning at launch, so launches can be captured in a CUDA graph).
    On CUDA the row ``"causal"``, ``"non_causal"`` or ``"split"`` of entry ``"<dtype>,<head_dim>"``
    (e.g. ``"bfloat16,128"``) of ``kernels/configs/prefill_attention_<device name>.json``
    (:func:`kernels.configs.kernel_table`, written by ``bench/prefill_long.py --write-table``)
    overrides the keys it holds (split mode: the mask mode's row, then the split row); without
    rows the tiles are those the issue-3 sweep chose, and the split policy 512 keys, 1 program
    per SM, 16 splits. Under the
    interpreter (CPU) the tiles are 32 x 32 and splits as short as one tile.

    TMA path: with ``page_size`` (tokens per KV block) on a CUDA device where
    :func:`kv_tma_available`, the rows ``"tma_causal"`` / ``"tma_non_causal"`` / ``"tma_split"``
    of the entry over the measured TMA default (:func:`_default_tma_config`) are used instead,
    with ``KV_TMA: True`` -- provided ``page_size`` is a multiple of their ``BLOCK_N`` (a K/V
    tile then lies in one page); otherwise the pointer-gather rows above. Without
    ``page_size`` the pointer path's rows, and no ``KV_TMA`` key. Under the interpreter (CPU)
    the 32 x 32 tiles take the TMA path where ``page_size`` is a multiple of 32, as the GPU would.

    Args:
        head_dim: D; dtype: q's dtype; device: q's device (CPU means the Triton interpreter);
        causal: the mask mode; split: the split-KV mode (``num_splits > 1``); page_size: the
        cache's tokens per block, or None (pointer path).

    Returns:
        A new dict.

    Raises:
        json.JSONDecodeError: a table file that is not JSON (from ``kernel_table``).
    """
    device = torch.device(device)
    cfg = _default_config(head_dim, dtype, device)
    if device.type == "cuda":
        entry = kernel_table("prefill_attention", device_name(device)).get(
            f"{_dtype_key(dtype)},{head_dim}", {}
        )
        modes = ["causal" if causal else "non_causal"]
        if split:
            modes.append("split")  # a split row overrides the mask mode's row
        tma = _default_tma_config(head_dim, dtype)
        if page_size is not None and tma is not None and kv_tma_available(device):
            for mode in modes:
                row = entry.get(f"tma_{mode}") or {}
                tma.update({k: row[k] for k in PREFILL_TABLE_KEYS if k in row})
            if tma.get("KV_TMA") and page_size % tma["BLOCK_N"] == 0:
                cfg = tma
                modes = []
        for mode in modes:
            row = entry.get(mode) or {}
            cfg.update({k: row[k] for k in PREFILL_TABLE_KEYS if k in row})
    elif page_size is not None and page_size % cfg["BLOCK_N"] == 0 and kv_tma_available(device):
        # the interpreter takes the TMA path where the GPU would (pages of whole tiles), so the
        # CPU tests of the kernel and of the Triton backend at such pages cover it
        cfg["KV_TMA"] = True
    if split:
        policy = dict(_SPLIT_POLICY)
        if device.type != "cuda":
            policy["MIN_SPLIT_KEYS"] = cfg["BLOCK_N"]
        cfg = {**policy, **cfg}
    else:
        for key in _SPLIT_POLICY:
            cfg.pop(key, None)
    return cfg


def _kv_tma_fits(k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether the caches' layout admits the ``KV_TMA`` descriptors: contiguous (viewed as
    ``[blocks * page, H_kv * D]``) and within the descriptors' int32 row coordinates."""
    return (
        k_cache.is_contiguous()
        and v_cache.is_contiguous()
        and k_cache.shape[0] * k_cache.shape[1] < 2**31
    )


def _check_kv_tma(k_cache: torch.Tensor, v_cache: torch.Tensor, block_n: int) -> None:
    """ValueError unless the ``KV_TMA`` loads can serve these caches with ``BLOCK_N`` tiles:
    descriptors available on their device, contiguous ``[blocks, page, H_kv, D]`` caches (viewed
    as ``[blocks * page, H_kv * D]``), and pages a multiple of ``BLOCK_N`` tokens."""
    if not kv_tma_available(k_cache.device):
        raise ValueError(
            f"KV_TMA needs a CUDA GPU of compute capability >= 9.0, not {k_cache.device}"
        )
    page_size = k_cache.shape[1]
    if page_size % block_n:
        raise ValueError(
            f"KV_TMA needs pages of a multiple of BLOCK_N={block_n} tokens, got {page_size}"
        )
    if not _kv_tma_fits(k_cache, v_cache):
        raise ValueError("KV_TMA needs contiguous k_cache / v_cache of fewer than 2**31 rows")


def _check_split_scratch(
    partial_out: torch.Tensor | None,
    partial_lse: torch.Tensor | None,
    num_splits: int,
    q: torch.Tensor,
) -> None:
    """ValueError unless the split-KV scratch fits ``num_splits`` splits of ``q``'s rows."""
    t, hq, d = q.shape
    if partial_out is None or partial_lse is None:
        raise ValueError(f"num_splits={num_splits} needs partial_out and partial_lse")
    if (
        partial_out.dtype != torch.float32
        or partial_lse.dtype != torch.float32
        or partial_out.dim() != 4
        or partial_lse.dim() != 3
        or partial_out.shape[0] < num_splits
        or partial_out.shape[1] < t
        or partial_out.shape[2:] != (hq, d)
        or partial_lse.shape[0] < num_splits
        or partial_lse.shape[1] < t
        or partial_lse.shape[2] != hq
    ):
        raise ValueError(
            f"scratch must be float32 [>={num_splits}, >={t}, {hq}, {d}] and "
            f"[>={num_splits}, >={t}, {hq}], got {tuple(partial_out.shape)} {partial_out.dtype}, "
            f"{tuple(partial_lse.shape)} {partial_lse.dtype}"
        )
    if partial_out.stride(3) != 1:
        raise ValueError("partial_out's last dimension must be contiguous")
    if partial_out.device != q.device or partial_lse.device != q.device:
        raise ValueError("the scratch must be on q's device")


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
    num_splits: int = 1,
    partial_out: torch.Tensor | None = None,
    partial_lse: torch.Tensor | None = None,
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
        config: optional override of :func:`prefill_config`'s keys (benchmarks), e.g.
            ``{"GQA_PACK": True}``.
        skip_decode_rows: when True (a compile-time flag of the kernel), sequences with exactly
            one new token are skipped like padding: their rows of ``out`` are left untouched for
            ``decode_attention(..., cu_seqlens_q=cu_seqlens_q)`` to fill (mixed steps).
        num_splits: host int >= 1; above 1, the split-KV mode (e.g. from
            :func:`kernels.prefill_split.prefill_num_splits`): each query tile's keys are cut
            into up to ``num_splits`` ranges of at least ``MIN_SPLIT_KEYS`` keys, computed by
            separate programs and merged by a second launch.
        partial_out: float32 ``[S, T', H_q, D]`` with ``S >= num_splits``, ``T' >= T``, last dim
            contiguous; partial_lse: float32 ``[S, T', H_q]`` (base-2 log-sum-exp). Scratch of
            the split mode (:func:`kernels.prefill_split.prefill_scratch`), indexed by packed
            query row; needed only when ``num_splits > 1``, not initialised (every element the
            merge reads is written by the first launch).

    Returns:
        ``out``.

    Raises:
        ValueError: on inconsistent shapes, dtypes, devices, head counts or head_dim, a
            ``num_splits`` that is not an int >= 1 (or above 65535) or scratch that does not fit
            it, or when ``T // TOK + B`` exceeds CUDA's 65535 limit on the grid's second axis.

    Grid: ``(H, T // TOK + B)`` (split mode: ``(H, T // TOK + B, num_splits)`` and the merge
    ``(H_q, (T // TOK + B) * TOK // min(32, TOK))``) with ``(H, TOK) = (H_q, BLOCK_M)``, or
    ``(H_kv, BLOCK_M // G)`` GQA-packed (:func:`prefill_tiling`), from the shapes of ``q``,
    ``cu_seqlens_q`` and the caches, the static config and the host int ``num_splits`` only (no
    device-to-host sync), so a launch can be captured in a CUDA graph at a padded ``T`` and ``B``
    and replayed for every step that fits. Each program finds its sequence and query tile by a
    binary search over ``cu_seqlens_q`` (after vLLM's Triton unified attention, ``find_seq_idx``
    in ``vllm/v1/attention/ops/triton_unified_attention.py``).

    Algorithm: FlashAttention-2 (Dao 2023) after Triton's fused-attention tutorial; K/V rows are
    gathered through the block table tile by tile (``block = block_tables[b, pos // block_size]``);
    the split mode is Flash-Decoding's (Dao et al. 2023) split-KV with a log-sum-exp merge. With
    ``GQA_PACK`` (config/table key) the ``G = H_q / H_kv`` query heads of a KV head are packed
    into the M dimension of one tile (row ``t * G + g``: token ``t``, head ``g`` of the group), so
    each K/V tile is read once for the group, as FlashAttention's ``pack_gqa``, FlashInfer's
    prefill and vLLM's Triton unified attention do; every row keeps its own token's causal limit.
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
    if not isinstance(num_splits, int) or isinstance(num_splits, bool) or not 1 <= num_splits:
        raise ValueError(f"num_splits must be an int >= 1, got {num_splits!r}")
    if num_splits > _MAX_GRID_Y:
        raise ValueError(f"num_splits={num_splits} exceeds the grid's third axis ({_MAX_GRID_Y})")
    split = num_splits > 1
    if split:
        _check_split_scratch(partial_out, partial_lse, num_splits, q)
    if t == 0 or b == 0:
        return out
    upcast = _interpreter_upcast(q)
    cfg = dict(prefill_config(d, q.dtype, q.device, causal, split=split, page_size=page_size))
    if config:
        cfg.update(config)
    elif causal and not split:
        cfg.update(one_wave_tiles(cfg, t, b, hq, hkv, d, q.dtype, q.device, page_size))
    block_m, block_n = cfg["BLOCK_M"], cfg["BLOCK_N"]
    kv_tma = bool(cfg.get("KV_TMA", False))
    if kv_tma and not (config and config.get("KV_TMA")) and not _kv_tma_fits(k_cache, v_cache):
        # chosen by the tables from the page size alone: strided caches keep the pointer gather
        # (only an explicit config={"KV_TMA": True} is an error there)
        kv_tma = False
    if kv_tma:
        _check_kv_tma(k_cache, v_cache, block_n)
        k_desc = TensorDescriptor.from_tensor(k_cache.view(-1, hkv * d), [block_n, d])
        v_desc = TensorDescriptor.from_tensor(v_cache.view(-1, hkv * d), [block_n, d])
    else:  # placeholders, never dereferenced
        k_desc, v_desc = k_cache, v_cache
    # GQA packing: TOK tokens x G heads per tile and one program per KV head (or BLOCK_M tokens
    # of one query head); from the config and the head counts only
    pack, tok, grid_heads = prefill_tiling(cfg, hq, hkv)
    # Shapes only (never a per-step value such as the longest q_len), so the launch can be
    # captured in a CUDA graph at a padded T and B; see _find_seq for why this covers every tile.
    num_slots = t // tok + b
    if num_slots > _MAX_GRID_Y:
        raise ValueError(
            f"T // TOK + B = {num_slots} query-tile slots exceed the grid's second axis "
            f"({_MAX_GRID_Y})"
        )
    # splits are whole BLOCK_N tiles (the unmasked loop starts on a tile boundary)
    min_split_keys = -(-max(1, int(cfg.get("MIN_SPLIT_KEYS", block_n))) // block_n) * block_n
    if split:
        po, plse = partial_out, partial_lse
        po_strides = (po.stride(0), po.stride(1), po.stride(2))
        plse_strides = (plse.stride(0), plse.stride(1), plse.stride(2))
    else:  # placeholders, never dereferenced
        po, plse = out, out
        po_strides = plse_strides = (0, 0, 0)
    _prefill_kernel[(grid_heads, num_slots, num_splits)](
        q,
        k_cache,
        v_cache,
        k_desc,
        v_desc,
        out,
        po,
        plse,
        block_tables,
        cu_seqlens_q,
        seq_lens,
        b,
        num_splits,
        min_split_keys,
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
        *po_strides,
        *plse_strides,
        NUM_GROUPS=hq // hkv,
        HEAD_DIM=d,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        PAGE_SIZE=page_size,
        CAUSAL=bool(causal),
        DOT_PREC="ieee" if q.dtype == torch.float32 or upcast else "tf32",
        UPCAST=upcast,
        BT_PREFETCH=bool(cfg.get("BT_PREFETCH", False)),
        SKIP_DECODE=bool(skip_decode_rows),
        SPLIT=split,
        GQA_PACK=pack,
        KV_TMA=kv_tma,
        ZIGZAG=bool(cfg.get("ZIGZAG", False)),
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
    )
    if split:
        # the merge cuts the first launch's TOK-token tiles (so both agree on which were split)
        # into blocks of merge_m tokens of one query head
        merge_m = min(MERGE_M, tok)
        merge_slots = num_slots * (tok // merge_m)
        if merge_slots > _MAX_GRID_Y:
            raise ValueError(
                f"{merge_slots} merge row blocks exceed the grid's second axis ({_MAX_GRID_Y}): "
                "fewer query rows per split launch"
            )
        _prefill_merge_kernel[(hq, merge_slots)](
            out,
            po,
            plse,
            cu_seqlens_q,
            seq_lens,
            b,
            num_splits,
            min_split_keys,
            out.stride(0),
            out.stride(1),
            out.stride(2),
            *po_strides,
            *plse_strides,
            HEAD_DIM=d,
            TOK=tok,
            BLOCK_N=block_n,
            MERGE_M=merge_m,
            CAUSAL=bool(causal),
            SKIP_DECODE=bool(skip_decode_rows),
            num_warps=MERGE_WARPS,
        )
    return out
