"""Triton split-KV paged decode attention (flash-decoding) with a reduction stage.

Layouts are those of :mod:`kernels.reference`: one query token per sequence, ``q`` and ``out``
``[B, H_q, D]``, K/V in the paged cache ``[num_blocks, block_size, H_kv, D]`` reached through
``block_tables`` and ``seq_lens``.

Algorithm: Flash-Decoding (Dao, Haziza, Massa, Sizov, "Flash-Decoding for long-context
inference", PyTorch blog, 2023). Stage 1 gives every (KV head, sequence, split) its own
program: the ``H_q / H_kv`` query heads that share the KV head are processed together as the
rows of one ``[BLOCK_G, D]`` tile, so each KV block is read from memory once, and the split's
keys are swept with the FlashAttention-2 online softmax (fp32 running max / sum / accumulator).
Each split writes its normalised partial output and its log-sum-exp; stage 2 merges the splits
with weights ``exp(lse_s - max lse)``. With one split, stage 1 writes ``out`` directly and stage 2
is skipped.

Fused merge (``FUSED_REDUCE``; off by default until measured on the GPU,
``QWEN_SERVE_DECODE_FUSED_REDUCE=1`` or the config key turns it on): no second launch. Each
stage-1 program writes its partial, then, after a CTA barrier, increments the arrival counter of
its (sequence, KV head) with an acquire-release atomic at GPU scope; the program that arrives
last merges the partials of its group's query heads and sets the counter back to zero, so every
launch and CUDA-graph replay starts from zero (CUTLASS's serial split-K semaphore, as
:mod:`kernels.gemv`'s split-K). The merge is stage 2's own code (:func:`_merge_splits`): each
query head's ``[splits, D]`` partials and ``[splits]`` log-sum-exps in one vectorized load past
L1, so the result does not depend on the arrival order. (A first version that read the splits
one after another was slower than the second launch on the H200: docs/benchmarks.md,
2026-12-04.)

Fused q/k prologue (``qk_rope``, constexpr ``FUSED_QK``; pure decode only; the engine uses it
when ``QWEN_SERVE_DECODE_FUSED_QK_ROPE=1``, off by default until measured): ``q`` is the raw
projection; each program normalizes (Qwen3's per-head RMSNorm) and rotates its group's query
rows in registers (:func:`kernels.qk_norm_rope.norm_rope_rows`), and the program whose split
holds the new token (position ``seq_len - 1``) does the same for that token's key and stores
key and value into the token's cache slot before its loop reads them back (a CTA barrier
orders the store and the loads; no other program reads that position). A decode layer then
needs no launch of :func:`kernels.qk_norm_rope.qk_norm_rope_store` (FlashInfer applies rotary
inside its decode kernel likewise: ``pos_encoding_mode``).

Mixed steps (``cu_seqlens_q`` given, constexpr ``VARLEN``): ``q``/``out`` are the packed
``[T, H_q, D]`` tensors of a step that also carries prompt chunks; each program of both stages
reads ``cu_seqlens_q[b]``, ``cu_seqlens_q[b + 1]`` and returns at once unless sequence ``b`` has
exactly one new token, whose query and output are row ``cu_seqlens_q[b]``. The scratch stays
indexed by ``b``. The prefill kernel (``skip_decode_rows=True``) computes the other rows. Imports
only torch and triton.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.arrival_counters import arrival_counters
from kernels.interpreter import interpreting as _interpreting
from kernels.pdl import pdl_kwargs, pdl_wait
from kernels.prefill_attention import _paged_attn_tile
from kernels.qk_norm_rope import norm_rope_rows, rope_table_strides
from kernels.switches import env_switch

__all__ = [
    "decode_attention",
    "decode_scratch",
    "merge_splits",
    "choose_num_splits",
    "choose_mixed_splits",
    "decode_config",
    "reduce_counters",
    "QKRope",
    "MIXED_FEW_SLOTS",
]

_LOG2E = 1.4426950408889634
#: arrival counters of the fused merge per device: one per (sequence, KV head) of a launch
NUM_REDUCE_COUNTERS = 1 << 16


#: whether launches merge their splits in stage 1 unless ``config`` says
#: (``QWEN_SERVE_DECODE_FUSED_REDUCE``, off when unset; read once, at import)
FUSED_REDUCE_SWITCH = env_switch("QWEN_SERVE_DECODE_FUSED_REDUCE", default=False)


def reduce_counters(device: torch.device | str) -> torch.Tensor:
    """The device's ``[NUM_REDUCE_COUNTERS]`` int32 arrival counters of the fused merge
    (:func:`kernels.arrival_counters.arrival_counters`, family "decode_attention"; every launch
    leaves them zero, and a programmatic dependent launch waits for its predecessor before
    touching them).

    Raises:
        RuntimeError: asked for the first time during CUDA-graph capture.
    """
    return arrival_counters("decode_attention", NUM_REDUCE_COUNTERS, device)


@triton.jit
def _packed_row(cu_q_ptr, seq):
    """First row ``cu_q[seq]`` (int64) of sequence ``seq`` in a packed batch and its new-token
    count."""
    start = tl.load(cu_q_ptr + seq)
    return start.to(tl.int64), tl.load(cu_q_ptr + seq + 1) - start


@triton.jit
def _merge_splits(
    out_ptr,
    po_ptr,
    plse_ptr,
    seq64,
    row64,
    head,
    num_splits,
    stride_ob,
    stride_oh,
    stride_od,
    stride_pob,
    stride_poh,
    stride_pos,
    stride_plb,
    stride_plh,
    HEAD_DIM: tl.constexpr,
    BLOCK_S: tl.constexpr,
    CACHE: tl.constexpr,
):
    """``out[row64, head] = sum_s w_s po[seq64, head, s] / sum_s w_s`` with ``w_s = 2^(lse_s -
    max lse)`` (0 for an empty split, ``lse = -inf``): one ``[BLOCK_S, HEAD_DIM]`` load of the
    head's partials and one ``[BLOCK_S]`` load of its log-sum-exps. ``CACHE``: the loads' cache
    modifier (``.cg`` where other programs of the same launch wrote the partials)."""
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, HEAD_DIM)
    s_ok = offs_s < num_splits
    lse = tl.load(
        plse_ptr + seq64 * stride_plb + head * stride_plh + offs_s,
        mask=s_ok,
        other=float("-inf"),
        cache_modifier=CACHE,
    )
    m = tl.max(lse, 0)
    w = tl.math.exp2(lse - m)
    po = tl.load(
        po_ptr
        + seq64 * stride_pob
        + head * stride_poh
        + offs_s[:, None] * stride_pos
        + offs_d[None, :],
        mask=s_ok[:, None],
        other=0.0,
        cache_modifier=CACHE,
    )
    o = tl.sum(po * w[:, None], 0) / tl.sum(w, 0)
    tl.store(
        out_ptr + row64 * stride_ob + head * stride_oh + offs_d * stride_od,
        o.to(out_ptr.dtype.element_ty),
    )


# min_split_keys is not specialized: a new value never compiles another variant
@triton.jit(do_not_specialize=["min_split_keys"])
def _decode_split_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    po_ptr,
    plse_ptr,
    counter_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    cu_q_ptr,
    new_k_ptr,
    new_v_ptr,
    slot_ptr,
    cos_ptr,
    sin_ptr,
    q_w_ptr,
    k_w_ptr,
    stride_nkt,
    stride_nkh,
    stride_nkd,
    stride_nvt,
    stride_nvh,
    stride_nvd,
    stride_cos_t,
    stride_cos_d,
    stride_sin_t,
    stride_sin_d,
    eps,
    qk_scale,
    num_splits,
    min_split_keys,
    stride_qb,
    stride_qh,
    stride_qd,
    stride_ob,
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
    stride_pob,
    stride_poh,
    stride_pos,
    stride_plb,
    stride_plh,
    NUM_GROUPS: tl.constexpr,
    BLOCK_G: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    SPLIT: tl.constexpr,
    DOT_PREC: tl.constexpr,
    UPCAST: tl.constexpr,
    BT_PREFETCH: tl.constexpr,
    VARLEN: tl.constexpr,
    FUSED_REDUCE: tl.constexpr = False,
    BLOCK_S: tl.constexpr = 16,
    FUSED_QK: tl.constexpr = False,
    HAS_NORM: tl.constexpr = False,
    EXACT_ROPE: tl.constexpr = False,
    PDL: tl.constexpr = False,
):
    pdl_wait(PDL)  # programmatic dependent launch (kernels.pdl): q and this step's k/v are new
    kv_head = tl.program_id(0)
    seq = tl.program_id(1)
    split = tl.program_id(2)
    seq64 = seq.to(tl.int64)
    row64 = seq64
    if VARLEN:  # mixed step: packed q/out rows, only sequences with one new token computed here
        row64, q_len = _packed_row(cu_q_ptr, seq)
        if q_len != 1:
            return
    seq_len = tl.load(seq_lens_ptr + seq)
    # Split s covers keys [s * split_len, (s + 1) * split_len), split_len a multiple of BLOCK_N
    # and at least min_split_keys (a multiple of BLOCK_N): a short sequence fills fewer splits,
    # and the rest are empty (lse -inf, weight 0 in the reduction).
    split_len = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    split_len = tl.maximum(split_len, min_split_keys)
    start = split * split_len
    end = tl.maximum(tl.minimum(start + split_len, seq_len), start)  # empty split: end == start

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, HEAD_DIM)
    g_ok = offs_g < NUM_GROUPS
    heads = kv_head * NUM_GROUPS + offs_g
    if FUSED_QK:  # raw projections: q's RMSNorm and rotary here (the new k/v: below)
        cos_row = cos_ptr + row64 * stride_cos_t
        sin_row = sin_ptr + row64 * stride_sin_t
        q = norm_rope_rows(
            q_ptr + row64 * stride_qb,
            heads,
            g_ok,
            stride_qh,
            stride_qd,
            q_w_ptr,
            cos_row,
            sin_row,
            stride_cos_d,
            stride_sin_d,
            eps,
            HEAD_DIM,
            HAS_NORM,
            EXACT_ROPE,
        )
    else:
        q = tl.load(
            q_ptr + row64 * stride_qb + heads[:, None] * stride_qh + offs_d[None, :] * stride_qd,
            mask=g_ok[:, None],
            other=0.0,
        )
    if UPCAST:
        q = q.to(tl.float32)
    m_i = tl.full([BLOCK_G], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, HEAD_DIM], dtype=tl.float32)
    k_base = k_ptr + kv_head * stride_kh
    v_base = v_ptr + kv_head * stride_vh
    bt_row_ptr = block_tables_ptr + seq64 * stride_bt
    if FUSED_QK:
        # the split holding the new token (position seq_len - 1) normalizes and rotates its k
        # and stores k and v into the token's slot (a negative slot: padding, nothing stored),
        # then reads them back through the cache like every other key (a CTA barrier orders
        # its own store and loads); no other program reads that position
        slot = tl.load(slot_ptr + seq).to(tl.int64)
        last = seq_len - 1
        if (slot >= 0) & (last >= start) & (last < end):
            one = offs_g < 1  # row 0 of a [BLOCK_G, D] tile holds this KV head's row
            kv_rows = kv_head + offs_g * 0
            k_new = norm_rope_rows(
                new_k_ptr + row64 * stride_nkt,
                kv_rows,
                one,
                stride_nkh,
                stride_nkd,
                k_w_ptr,
                cos_row,
                sin_row,
                stride_cos_d,
                stride_sin_d,
                eps,
                HEAD_DIM,
                HAS_NORM,
                EXACT_ROPE,
            )
            v_new = tl.load(
                new_v_ptr
                + row64 * stride_nvt
                + kv_rows[:, None] * stride_nvh
                + offs_d[None, :] * stride_nvd,
                mask=one[:, None],
                other=0.0,
            )
            page = slot // PAGE_SIZE
            within = slot % PAGE_SIZE
            k_dst = k_base + page * stride_kb + within * stride_kt + offs_d[None, :] * stride_kd
            v_dst = v_base + page * stride_vb + within * stride_vt + offs_d[None, :] * stride_vd
            tl.store(k_dst + offs_g[:, None] * 0, k_new, mask=one[:, None])
            tl.store(v_dst + offs_g[:, None] * 0, v_new, mask=one[:, None])
        tl.debug_barrier()
    full_end = start + ((end - start) // BLOCK_N) * BLOCK_N
    # full tiles without masks, then the masked tail tile (same online-softmax step as prefill)
    acc, l_i, m_i = _paged_attn_tile(
        acc,
        l_i,
        m_i,
        q,
        k_base,
        v_base,
        bt_row_ptr,
        start,
        full_end,
        end,
        offs_g,
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
        False,
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
        full_end,
        end,
        end,
        offs_g,
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
        False,
        DOT_PREC,
        UPCAST,
        False,
    )

    has = l_i > 0.0
    acc = acc / tl.where(has, l_i, 1.0)[:, None]
    if SPLIT:
        lse = tl.where(has, m_i + tl.math.log2(tl.where(has, l_i, 1.0)), float("-inf"))
        po_ptrs = (
            po_ptr
            + seq64 * stride_pob
            + heads[:, None] * stride_poh
            + split * stride_pos
            + offs_d[None, :]
        )
        tl.store(po_ptrs, acc, mask=g_ok[:, None])
        tl.store(plse_ptr + seq64 * stride_plb + heads * stride_plh + split, lse, mask=g_ok)
        if FUSED_REDUCE:
            tl.debug_barrier()  # every thread's partial is written before the arrival below
            count_ptr = counter_ptr + seq64 * tl.num_programs(0) + kv_head
            arrived = tl.atomic_add(count_ptr, 1, sem="acq_rel", scope="gpu")
            if arrived == num_splits - 1:  # the last split of this (sequence, KV head)
                for g in tl.static_range(NUM_GROUPS):
                    _merge_splits(
                        out_ptr,
                        po_ptr,
                        plse_ptr,
                        seq64,
                        row64,
                        kv_head * NUM_GROUPS + g,
                        num_splits,
                        stride_ob,
                        stride_oh,
                        stride_od,
                        stride_pob,
                        stride_poh,
                        stride_pos,
                        stride_plb,
                        stride_plh,
                        HEAD_DIM,
                        BLOCK_S,
                        ".cg",
                    )
                tl.atomic_xchg(count_ptr, 0, sem="relaxed", scope="gpu")
    else:
        o_ptrs = (
            out_ptr + row64 * stride_ob + heads[:, None] * stride_oh + offs_d[None, :] * stride_od
        )
        tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=g_ok[:, None])


@triton.jit
def _decode_reduce_kernel(
    out_ptr,
    po_ptr,
    plse_ptr,
    cu_q_ptr,
    num_splits,
    stride_ob,
    stride_oh,
    stride_od,
    stride_pob,
    stride_poh,
    stride_pos,
    stride_plb,
    stride_plh,
    HEAD_DIM: tl.constexpr,
    BLOCK_S: tl.constexpr,
    VARLEN: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_wait(PDL)
    head = tl.program_id(0)
    seq = tl.program_id(1).to(tl.int64)
    row = seq
    if VARLEN:  # as in stage 1
        row, q_len = _packed_row(cu_q_ptr, seq)
        if q_len != 1:
            return
    _merge_splits(
        out_ptr,
        po_ptr,
        plse_ptr,
        seq,
        row,
        head,
        num_splits,
        stride_ob,
        stride_oh,
        stride_od,
        stride_pob,
        stride_poh,
        stride_pos,
        stride_plb,
        stride_plh,
        HEAD_DIM,
        BLOCK_S,
        "",
    )


def decode_config(head_dim: int, dtype: torch.dtype, device: torch.device) -> dict:
    """Tile configuration ``{BLOCK_N, num_warps, num_stages, BT_PREFETCH}`` of stage 1 (host-side,
    static); ``BT_PREFETCH`` loads the next tile's block ids one iteration ahead.

    Values for bf16/fp16 on CUDA were chosen by the sweep in ``bench/kernels.py`` on an H200.

    Args:
        head_dim: D; dtype: q's dtype; device: q's device (CPU means the Triton interpreter).

    Returns:
        A new dict; raises nothing.
    """
    if device.type != "cuda":
        return {"BLOCK_N": 32, "num_warps": 4, "num_stages": 1, "BT_PREFETCH": True}
    if dtype == torch.float32:
        return {"BLOCK_N": 32, "num_warps": 4, "num_stages": 2, "BT_PREFETCH": True}
    # chosen by the H200 sweep of bench/kernels.py (figures in docs/benchmarks.md)
    return {"BLOCK_N": 32, "num_warps": 4, "num_stages": 4, "BT_PREFETCH": True}


def choose_num_splits(
    batch: int,
    num_kv_heads: int,
    max_seq_len: int,
    num_sms: int,
    *,
    min_keys_per_split: int = 128,
    programs_per_sm: int = 2,
    max_splits: int = 64,
) -> int:
    """Number of KV splits for :func:`decode_attention` (host-side; no device access or sync).

    Picks the smallest split count that gives at least ``programs_per_sm * num_sms`` stage-1
    programs (``batch * num_kv_heads * splits``), capped so that every split keeps at least
    ``min_keys_per_split`` keys of the longest sequence, and by ``max_splits``.

    Args:
        batch: number of sequences B; num_kv_heads: H_kv.
        max_seq_len: host int, the largest ``seq_lens`` entry
            (e.g. ``AttentionMetadata.max_seq_len``).
        num_sms: multiprocessor count of the GPU (132 on an H200).

    Returns:
        An int in ``[1, max_splits]``.

    Raises:
        ValueError: if an argument is negative or ``num_sms < 1``.
    """
    if batch < 0 or num_kv_heads < 1 or max_seq_len < 0 or num_sms < 1:
        raise ValueError("choose_num_splits: invalid arguments")
    programs = max(1, batch * num_kv_heads)
    want = triton.cdiv(programs_per_sm * num_sms, programs)
    cap = max(1, max_seq_len // max(1, min_keys_per_split))
    return int(max(1, min(want, cap, max_splits)))


#: most sequence slots of a mixed step whose decode rows are split for a long context (the
#: narrow prefill/mixed graphs, ``engine.worker.cuda_graph.NARROW_SEQS``, have this many)
MIXED_FEW_SLOTS = 16
#: most stage-1 programs (sequence slots x KV heads x splits) of such a launch
MIXED_MAX_PROGRAMS = 2048
#: fewest keys of one split in such a launch (``decode_attention``'s ``min_split_keys``): a
#: short context fills one or two splits of a grid sized for a long one
MIXED_MIN_SPLIT_KEYS = 512


def choose_mixed_splits(
    num_seq_slots: int,
    num_kv_heads: int,
    max_seq_len: int,
    num_sms: int,
    *,
    max_programs: int = MIXED_MAX_PROGRAMS,
) -> tuple[int, int]:
    """``(num_splits, min_split_keys)`` for the decode rows of a mixed step
    (``decode_attention(..., cu_seqlens_q=...)``), from host ints.

    How many of a mixed step's ``num_seq_slots`` sequences decode, and over how many keys, is a
    device-side fact (the step may replay a CUDA graph captured for any such step). With at
    most :data:`MIXED_FEW_SLOTS` slots the common case is one or two streams decoding over a
    long context next to a prompt chunk, so the splits are those of a single decoding sequence
    (:func:`choose_num_splits` with ``batch=1``), capped so the grid ``num_seq_slots *
    num_kv_heads * splits`` stays within ``max_programs`` (16 slots of 8 KV heads: 16 splits),
    with ``min_split_keys`` :data:`MIXED_MIN_SPLIT_KEYS` so that short contexts fill only the
    splits they need. With more slots the step is taken to hold many decoding sequences, and
    the split count is :func:`choose_num_splits` of the slots (and ``min_split_keys`` 0), as
    for a decode step of that batch.

    Args:
        num_seq_slots: sequences of the launch (B, padded in a graph); num_kv_heads: H_kv.
        max_seq_len: host bound of the longest context (``max_model_len`` inside a graph).
        num_sms: multiprocessors of the GPU.
        max_programs: the grid cap above.

    Returns:
        ``(num_splits >= 1, min_split_keys >= 0)``.

    Raises:
        ValueError: as :func:`choose_num_splits` (a negative count), or ``max_programs < 1``.
    """
    if num_seq_slots < 0:
        raise ValueError("choose_mixed_splits: invalid arguments")
    if max_programs < 1:
        raise ValueError("choose_mixed_splits: max_programs must be >= 1")
    if num_seq_slots > MIXED_FEW_SLOTS:
        return choose_num_splits(num_seq_slots, num_kv_heads, max_seq_len, num_sms), 0
    one = choose_num_splits(1, num_kv_heads, max_seq_len, num_sms)
    per_split = max(1, num_seq_slots) * num_kv_heads
    return max(1, min(one, max_programs // per_split)), MIXED_MIN_SPLIT_KEYS


@dataclass(frozen=True)
class QKRope:
    """What :func:`decode_attention` needs to take the raw projections of a pure decode step
    (the fused prologue: ``kernels.qk_norm_rope.qk_norm_rope_store``'s work in the attention
    launch).

    Attributes:
        k, v: ``[B, H_kv, D]`` this step's key and value projections (any strides; k before its
            norm and rotary).
        slot_mapping: int64 or int32 ``[B]`` cache slots of the new tokens (negative: padding,
            nothing stored).
        cos, sin: ``[B, D]`` or ``[B, 1, D]`` rotary rows of the tokens' positions.
        q_weight, k_weight: ``[D]`` RMSNorm weights (Qwen3), or both None (Qwen2).
        eps: RMSNorm epsilon.
    """

    k: torch.Tensor
    v: torch.Tensor
    slot_mapping: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    q_weight: torch.Tensor | None
    k_weight: torch.Tensor | None
    eps: float


def _qk_rope_args(r: QKRope | None, q: torch.Tensor, hkv: int) -> tuple[tuple, bool]:
    """The fused prologue's launch arguments (pointers, strides, eps) and HAS_NORM; without a
    prologue, placeholders of the same count (``q``'s pointer, zero strides), never read.

    Raises:
        ValueError: shapes, dtypes or devices that do not fit ``q`` and the cache.
    """
    if r is None:
        return (q,) * 7 + (0,) * 10 + (0.0,), False
    b, _, d = q.shape
    if r.k.shape != (b, hkv, d) or r.v.shape != (b, hkv, d):
        raise ValueError(f"qk_rope k/v must be [B={b}, H_kv={hkv}, D={d}]")
    if r.slot_mapping.shape != (b,) or r.slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"qk_rope slot_mapping must be int32/int64 [B={b}]")
    cos_strides = rope_table_strides(r.cos, b, d, "qk_rope cos")
    sin_strides = rope_table_strides(r.sin, b, d, "qk_rope sin")
    if (r.q_weight is None) != (r.k_weight is None):
        raise ValueError("qk_rope q_weight and k_weight must both be given or both be None")
    has_norm = r.q_weight is not None
    tensors = [r.k, r.v, r.cos, r.sin] + ([r.q_weight, r.k_weight] if has_norm else [])
    if has_norm and any(w.shape != (d,) or w.stride(0) != 1 for w in (r.q_weight, r.k_weight)):
        raise ValueError(f"qk_rope norm weights must be contiguous [D={d}]")
    if any(t.dtype != q.dtype for t in tensors):
        raise ValueError("qk_rope tensors must have q's dtype")
    if any(t.device != q.device for t in [*tensors, r.slot_mapping]):
        raise ValueError("qk_rope tensors must be on q's device")
    return (
        r.k,
        r.v,
        r.slot_mapping,
        r.cos,
        r.sin,
        r.q_weight if has_norm else r.k,  # unused pointers without the norm
        r.k_weight if has_norm else r.k,
        *r.k.stride(),
        *r.v.stride(),
        *cos_strides,
        *sin_strides,
        float(r.eps),
    ), has_norm


def decode_scratch(
    batch: int, num_heads: int, head_dim: int, num_splits: int, device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Allocate the split-KV scratch of :func:`decode_attention`.

    Returns:
        ``(partial_out, partial_lse)``: float32 ``[batch, num_heads, num_splits, head_dim]`` and
        float32 ``[batch, num_heads, num_splits]`` (uninitialised; every used element is written
        by stage 1 before stage 2 reads it).

    Raises:
        ValueError: on a non-positive size.
    """
    if batch < 1 or num_heads < 1 or head_dim < 1 or num_splits < 1:
        raise ValueError("decode_scratch: sizes must be positive")
    po = torch.empty(batch, num_heads, num_splits, head_dim, dtype=torch.float32, device=device)
    plse = torch.empty(batch, num_heads, num_splits, dtype=torch.float32, device=device)
    return po, plse


def merge_splits(
    partial_out: torch.Tensor, partial_lse: torch.Tensor, out: torch.Tensor
) -> torch.Tensor:
    """The split merge of :func:`decode_attention` alone (its second launch): ``out[b, h] =
    sum_s w_s partial_out[b, h, s] / sum_s w_s``, ``w_s = 2^(lse_s - max lse)``, for every split
    of the scratch (benchmarks and tests of a consumer that merges them itself,
    ``kernels.gemv_merge``).

    Args:
        partial_out: float32 ``[B, H, S, D]``, last dimension contiguous; partial_lse: float32
            ``[B, H, S]`` (log2 domain, ``-inf`` for an empty split), last dimension contiguous.
        out: ``[B, H, D]`` float16 / bfloat16 / float32, written and returned.

    Raises:
        ValueError: mismatched shapes, dtypes, strides or devices.
    """
    b, h, s, d = partial_out.shape
    if (
        partial_out.dtype != torch.float32
        or partial_lse.dtype != torch.float32
        or partial_lse.shape != (b, h, s)
        or out.shape != (b, h, d)
        or partial_out.stride(3) != 1
        or partial_lse.stride(2) != 1
        or len({partial_out.device, partial_lse.device, out.device}) != 1
    ):
        raise ValueError(
            f"merge_splits: partials {tuple(partial_out.shape)} {partial_out.dtype} and "
            f"{tuple(partial_lse.shape)} {partial_lse.dtype}, out {tuple(out.shape)} do not match"
        )
    if b and h:
        _launch_reduce(out, partial_out, partial_lse, s, b)
    return out


def _launch_reduce(out, partial_out, partial_lse, num_splits: int, num_seqs: int, cu_q=None):
    """The split merge's launch, grid ``(H_q, num_seqs)``: the first ``num_splits`` splits of
    the scratch into ``out`` (``cu_q``: a mixed step's ``cu_seqlens_q``, its packed decode rows
    only; None: row ``b`` is sequence ``b``)."""
    _decode_reduce_kernel[(partial_out.shape[1], num_seqs)](
        out,
        partial_out,
        partial_lse,
        partial_lse if cu_q is None else cu_q,  # an unused placeholder without VARLEN
        num_splits,
        out.stride(0),
        out.stride(1),
        out.stride(2),
        partial_out.stride(0),
        partial_out.stride(1),
        partial_out.stride(2),
        partial_lse.stride(0),
        partial_lse.stride(1),
        HEAD_DIM=out.shape[-1],
        BLOCK_S=max(16, triton.next_power_of_2(num_splits)),
        VARLEN=cu_q is not None,
        num_warps=4,
        **pdl_kwargs(out.device),
    )


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    out: torch.Tensor,
    scale: float,
    partial_out: torch.Tensor,
    partial_lse: torch.Tensor,
    num_splits: int,
    *,
    config: dict | None = None,
    cu_seqlens_q: torch.Tensor | None = None,
    min_split_keys: int = 0,
    qk_rope: QKRope | None = None,
    merge: bool = True,
) -> torch.Tensor | None:
    """Paged decode attention, one query token per sequence, split-KV (Triton).

    Same semantics as :func:`kernels.reference.decode_attention_ref`. With ``cu_seqlens_q``
    (a mixed step), the same for the decode rows of a packed batch only: sequence ``b``'s query
    is row ``cu_seqlens_q[b]`` of ``q`` when it has exactly one new token
    (``cu_seqlens_q[b + 1] - cu_seqlens_q[b] == 1``); sequences with 0 or more than 1 new tokens
    are skipped, their rows of ``out`` (and rows past ``cu_seqlens_q[B]``) left untouched, their
    ``block_tables`` rows and ``seq_lens`` not read. Pair it with
    ``prefill_attention(..., skip_decode_rows=True)`` for the other rows.

    Args:
        q: ``[B, H_q, D]`` (``[T, H_q, D]`` packed with ``cu_seqlens_q``) float16 / bfloat16 /
            float32, any strides.
        k_cache, v_cache: ``[num_blocks, block_size, H_kv, D]`` of q's dtype; ``H_q % H_kv == 0``;
            D a power of two in [16, 256].
        block_tables: int32 ``[B, max_blocks]`` (rows contiguous); seq_lens: int32 ``[B]``, each
            ``>= 1`` (for the computed sequences).
        out: like ``q``; written in place and returned. May be None with ``merge=False``.
        scale: softmax scale.
        partial_out: float32 ``[B, H_q, S, D]`` with ``S >= num_splits``, last dim contiguous;
            partial_lse: float32 ``[B, H_q, S]`` (log2-domain log-sum-exp), last dim contiguous.
            Scratch from :func:`decode_scratch`; unused when ``num_splits == 1``.
        num_splits: host int >= 1, e.g. from :func:`choose_num_splits`; sizes the grid.
        config: optional stage-1 tile override ``{BLOCK_N, num_warps, num_stages}`` (benchmarks),
            and ``FUSED_REDUCE`` (bool): the split merge in stage 1's last-arriving program
            instead of a second launch (default: :data:`FUSED_REDUCE_SWITCH`, off). With more
            than :data:`NUM_REDUCE_COUNTERS` (sequence, KV head) pairs the second launch runs.
        cu_seqlens_q: optional int32 ``[B + 1]`` on q's device, non-decreasing, with
            ``cu_seqlens_q[B] <= T`` (not checked: it lives on the device).
        min_split_keys: host int >= 0, fewest keys of one split (rounded up to the tile,
            ``BLOCK_N``): a sequence of ``L`` keys fills only ``cdiv(L, split_len)`` of the
            ``num_splits`` splits and the others are empty, so a grid sized for a long context
            does not cut short sequences into one-tile splits. 0: every sequence is cut into
            ``num_splits`` parts (at least one tile each).
        qk_rope: pure decode only (no ``cu_seqlens_q``): ``q`` is then the raw projection, and
            the launch also does ``kernels.qk_norm_rope.qk_norm_rope_store``'s work -- q and the
            new k RMS-normalized and rotated, k and v stored into their slots (the program whose
            split holds position ``seq_lens[b] - 1`` stores them before reading the cache) --
            so that a decode layer needs one launch less; the result equals that kernel followed
            by this one up to the float32 order of the mean square (an ulp of the dtype at
            most). The new token must be the last of each sequence.
        merge: False: stop after the splits (pure decode only): every split's partial output
            and log-sum-exp are written to the scratch, even with one split, and nothing is
            merged into ``out`` (the consumer merges them: ``kernels.gemv_merge``).

    Returns:
        ``out`` (None with ``merge=False``).

    Raises:
        ValueError: on inconsistent shapes, dtypes, devices, strides, ``num_splits < 1`` or
            ``min_split_keys < 0``.

    Grid: ``(H_kv, B, num_splits)`` and, without the fused merge (and with ``merge``),
    ``(H_q, B)`` for the reduction, from shapes and the host int ``num_splits`` only (with
    ``cu_seqlens_q``, skipped sequences' programs return at once), so a launch can be captured
    in a CUDA graph at a padded ``T`` and ``B``.

    Algorithm: Flash-Decoding (Dao et al. 2023 blog) with FlashAttention-2's online softmax;
    the query heads of one KV head form one tile so each KV block is read once.
    """
    varlen = cu_seqlens_q is not None
    if q.dim() != 3:
        raise ValueError(f"q must be [{'T' if varlen else 'B'}, H_q, D], got {tuple(q.shape)}")
    t, hq, d = q.shape
    b = t
    if varlen:
        if (
            cu_seqlens_q.dim() != 1
            or cu_seqlens_q.shape[0] < 1
            or cu_seqlens_q.dtype != torch.int32
            or cu_seqlens_q.device != q.device
        ):
            raise ValueError("cu_seqlens_q must be an int32 [B + 1] tensor on q's device")
        b = cu_seqlens_q.shape[0] - 1
    if not merge and varlen:
        raise ValueError("merge=False is for pure decode launches (no cu_seqlens_q)")
    if out is None and merge:
        raise ValueError("out is required unless merge=False")
    if out is not None and (out.shape != q.shape or out.dtype != q.dtype or out.device != q.device):
        raise ValueError("out must match q's shape, dtype and device")
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"unsupported dtype {q.dtype}")
    if d < 16 or d > 256 or d & (d - 1):
        raise ValueError(f"head_dim must be a power of two in [16, 256], got {d}")
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError("k_cache/v_cache must be [num_blocks, block_size, H_kv, D] of equal shape")
    _, page_size, hkv, dk = k_cache.shape
    if dk != d or hkv == 0 or hq % hkv:
        raise ValueError(f"cache [*, *, {hkv}, {dk}] incompatible with q [*, {hq}, {d}]")
    if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise ValueError("k_cache/v_cache must have q's dtype")
    if block_tables.dim() != 2 or block_tables.dtype != torch.int32 or block_tables.shape[0] != b:
        raise ValueError(f"block_tables must be int32 [B={b}, max_blocks]")
    if block_tables.stride(1) != 1 and block_tables.shape[1] > 1:
        raise ValueError("block_tables rows must be contiguous")
    if seq_lens.shape != (b,) or seq_lens.dtype != torch.int32:
        raise ValueError(f"seq_lens must be int32 [B={b}]")
    if not isinstance(num_splits, int) or num_splits < 1:
        raise ValueError(f"num_splits must be an int >= 1, got {num_splits!r}")
    if not isinstance(min_split_keys, int) or min_split_keys < 0:
        raise ValueError(f"min_split_keys must be an int >= 0, got {min_split_keys!r}")
    if (
        partial_out.dtype != torch.float32
        or partial_lse.dtype != torch.float32
        or partial_out.dim() != 4
        or partial_lse.dim() != 3
        or partial_out.shape[:2] != (b, hq)
        or partial_out.shape[3] != d
        or partial_lse.shape[:2] != (b, hq)
        or partial_out.shape[2] < num_splits
        or partial_lse.shape[2] < num_splits
    ):
        raise ValueError(
            f"scratch must be float32 [B, H_q, >={num_splits}, D] and [B, H_q, >={num_splits}], "
            f"got {tuple(partial_out.shape)} {partial_out.dtype}, "
            f"{tuple(partial_lse.shape)} {partial_lse.dtype}"
        )
    if partial_out.stride(3) != 1 or partial_lse.stride(2) != 1:
        raise ValueError("scratch last dimensions must be contiguous")
    devs = {
        k_cache.device,
        v_cache.device,
        block_tables.device,
        seq_lens.device,
        partial_out.device,
        partial_lse.device,
    }
    if devs != {q.device}:
        raise ValueError("all tensors must be on q's device")
    if qk_rope is not None and varlen:
        raise ValueError("qk_rope is for pure decode launches (no cu_seqlens_q)")
    rope_args, has_norm = _qk_rope_args(qk_rope, q, k_cache.shape[2])
    if b == 0 or t == 0:
        return out if merge else None
    if out is None:
        out = q  # an unused placeholder pointer: nothing is stored to it without the merge
    # Triton's CPU interpreter multiplies bf16 as raw uint16 in tl.dot: compute 16-bit in fp32
    # there.
    upcast = q.device.type != "cuda" and q.dtype != torch.float32
    cfg = dict(decode_config(d, q.dtype, q.device))
    if config:
        cfg.update(config)
    group = hq // hkv
    split = num_splits > 1 or not merge
    fused = bool(cfg.get("FUSED_REDUCE", FUSED_REDUCE_SWITCH))
    fused = fused and merge and split and b * hkv <= NUM_REDUCE_COUNTERS
    counters = reduce_counters(q.device) if fused else seq_lens  # placeholder when unused
    block_s = max(16, triton.next_power_of_2(num_splits))
    block_n = cfg["BLOCK_N"]
    min_keys = -(-min_split_keys // block_n) * block_n
    cu_q = cu_seqlens_q if varlen else seq_lens  # unused placeholder without VARLEN
    pdl = pdl_kwargs(q.device)
    _decode_split_kernel[(hkv, b, num_splits)](
        q,
        k_cache,
        v_cache,
        out,
        partial_out,
        partial_lse,
        counters,
        block_tables,
        seq_lens,
        cu_q,
        *rope_args,
        float(scale) * _LOG2E,
        num_splits,
        min_keys,
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
        partial_out.stride(0),
        partial_out.stride(1),
        partial_out.stride(2),
        partial_lse.stride(0),
        partial_lse.stride(1),
        NUM_GROUPS=group,
        BLOCK_G=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=d,
        BLOCK_N=block_n,
        PAGE_SIZE=page_size,
        SPLIT=split,
        DOT_PREC="ieee" if q.dtype == torch.float32 or upcast else "tf32",
        UPCAST=upcast,
        BT_PREFETCH=bool(cfg.get("BT_PREFETCH", False)),
        VARLEN=varlen,
        FUSED_REDUCE=fused,
        BLOCK_S=block_s,
        FUSED_QK=qk_rope is not None,
        HAS_NORM=has_norm,
        # the prologue's roundings by integer ops under the interpreter (its bfloat16 cast
        # truncates), as qk_norm_rope_store's there; on the GPU casts (FP fusion stays on: no
        # bf16 FMA in the prologue's sm_90 PTX, only the float32 sum of squares contracted)
        EXACT_ROPE=qk_rope is not None and _interpreting(),
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
        **pdl,
    )
    if not merge:
        return None
    if split and not fused:
        _launch_reduce(out, partial_out, partial_lse, num_splits, b, cu_seqlens_q)
    return out
