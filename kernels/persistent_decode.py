"""A persistent batch-1 decode kernel for whole Qwen3 decoder layers (issue 19's lever for the
1 ms batch-1 step: fewer kernel boundaries, not fewer bytes).

One launch runs ``L`` layers of one decode token, every program resident, the phases of a
layer separated by grid barriers (:mod:`kernels.grid_barrier`):

A. input RMSNorm (every program recomputes the statistics of the hidden state) and the
   q/k/v projection, ``ceil(N / programs)`` rows per program;
B. q/k RMSNorm + rotary (:func:`kernels.qk_norm_rope.norm_rope_rows`), k and v stored in
   their paged-cache slot (or folded into C: ``FUSE_B``);
C. split-KV attention: (KV head, split) items, each the GQA group's queries over one slice of
   the context (online softmax; Milakov & Gimelshein 2018, FlashDecoding's split-KV);
D. the splits merged per query head;
E. o projection + residual add;
F. post-attention RMSNorm + gate/up projection + SwiGLU;
G. down projection + residual add (in place: the next layer's input).

Each layer's tensors -- one per layer and kind, as the engine holds its weights and KV caches
-- are reached through an int64 table of their addresses (:func:`layer_table`); the context
length is read on the device, so a CUDA graph replays the launch for any length. The roundings
are eager torch's (the oracle, ``bench/persistent_layer_probe.py:layer_ref``, composes
:mod:`kernels.reference`'s operations; bit-equal under the interpreter). Measured on an H100
(docs/benchmarks.md, 2026-12-06, thirteenth session): 28 Qwen3-0.6B layers at 1k context in
1,008 us with the attention tiles pipelined, against the engine's 1.18 ms step (its LM head
0.11 ms).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.grid_barrier import grid_arrive, grid_leave, grid_sync, grid_wait, launch_resident
from kernels.interpreter import interpreting
from kernels.l2_prefetch import bulk_prefetch_l2
from kernels.qk_norm_rope import norm_rope_rows
from kernels.rounding import round_as


@triton.jit
def _rms_scale(x_ptr, H: tl.constexpr, BK: tl.constexpr, eps):
    """``rsqrt(mean(x^2) + eps)`` of the bf16 ``x [H]`` (read at L2: another program wrote it)."""
    ss = tl.zeros((BK,), dtype=tl.float32)
    for k0 in tl.static_range(0, H, BK):
        xv = tl.load(x_ptr + k0 + tl.arange(0, BK), cache_modifier=".cg").to(tl.float32)
        ss += xv * xv
    return tl.rsqrt(tl.sum(ss, axis=0) / H + eps)


@triton.jit
def _in_chunk(x_ptr, nw_ptr, r, cols, MODE: tl.constexpr, EXACT: tl.constexpr, S: tl.constexpr = 1):
    """Columns ``cols`` of a GEMV's input as float32: ``MODE`` 0 ``x`` itself; 1 RMSNorm's
    ``w * bf16(x * r)`` rounded to bf16 (:func:`kernels.reference.rms_norm_ref`'s roundings);
    2 the attention output merged from the ``S`` splits' partials (``x_ptr``: ``part [HQ, S,
    D]``, ``nw_ptr``: ``ml [HQ, S, 2]``, ``r``: the head dim ``D``; :func:`_attn_merge`'s
    arithmetic, rounded to bf16)."""
    if MODE == 2:
        sp = tl.arange(0, S)
        hs = (cols // r)[:, None] * S + sp[None, :]
        m = tl.load(nw_ptr + hs * 2, cache_modifier=".cg")
        lsum = tl.load(nw_ptr + hs * 2 + 1, cache_modifier=".cg")
        acc = tl.load(x_ptr + hs * r + (cols % r)[:, None], cache_modifier=".cg")
        wgt = tl.where(lsum > 0, tl.exp(m - tl.max(m, axis=1)[:, None]), 0.0)
        xv = round_as(tl.sum(acc * wgt, axis=1) / tl.sum(lsum * wgt, axis=1), tl.bfloat16, EXACT)
    else:
        xv = tl.load(x_ptr + cols, cache_modifier=".cg").to(tl.float32)
        if MODE == 1:
            w = tl.load(nw_ptr + cols).to(tl.float32)
            xv = round_as(w * round_as(xv * r, tl.bfloat16, EXACT), tl.bfloat16, EXACT)
    return xv


@triton.jit
def _w_load(w_ptr, rows, ok, cols, K: tl.constexpr):
    """Columns ``cols`` of the bf16 weight rows ``W[rows]`` (``W [*, K]``), zeros where not
    ``ok``: ``[BP, BK]``."""
    return tl.load(w_ptr + rows[:, None] * K + cols[None, :], mask=ok[:, None], other=0.0)


@triton.jit
def _first_chunk(
    w_ptr, pid, N: tl.constexpr, R: tl.constexpr, BP: tl.constexpr, K: tl.constexpr,
    BK: tl.constexpr, ROW0: tl.constexpr = 0,
):  # fmt: skip
    """The first ``BK`` columns of program ``pid``'s first tile of a GEMV's weight ``[*, K]``
    (rows ``ROW0 + pid * R + [0, R)`` below ``ROW0 + N``; bf16 ``[BP, BK]``, zeros where
    masked): loaded while the program waits at a barrier (weights are never written), so
    their latency overlaps the wait."""
    rows, ok = _tile_rows(pid, N, R, BP)
    return _w_load(w_ptr, ROW0 + rows, ok, tl.arange(0, BK), K)


@triton.jit
def _w_chunk(w_ptr, rows, ok, cols, K: tl.constexpr, w0, first, PRE: tl.constexpr):
    """Columns ``cols`` of ``W[rows]`` (bf16 ``[BP, BK]``): ``w0`` when ``PRE`` and ``first``
    (the chunk :func:`_first_chunk` loaded earlier), else loaded now (:func:`_w_load`)."""
    if PRE:
        if first:
            wv = w0
        else:
            wv = _w_load(w_ptr, rows, ok, cols, K)
    else:
        wv = _w_load(w_ptr, rows, ok, cols, K)
    return wv


@triton.jit
def _late_chunk(x_ptr, nw_ptr, cols, ss):
    """Columns ``cols`` of RMSNorm's input before its scale, ``w * x`` (float32), and the sum
    of squares ``ss [BK]`` with this chunk's ``x^2`` added (the scale is applied to the dot
    product afterwards: :func:`_late_scale`)."""
    xv = tl.load(x_ptr + cols, cache_modifier=".cg").to(tl.float32)
    w = tl.load(nw_ptr + cols).to(tl.float32)
    return w * xv, ss + xv * xv


@triton.jit
def _late_scale(ss, K: tl.constexpr, eps):
    """``rsqrt(mean(x^2) + eps)`` from the sums of squares ``ss [BK]`` over all ``K`` columns."""
    return tl.rsqrt(tl.sum(ss, axis=0) / K + eps)


@triton.jit
def _rows_dot(
    w_ptr, rows, ok, x_ptr, nw_ptr, r, K: tl.constexpr, BK: tl.constexpr, BP: tl.constexpr,
    MODE: tl.constexpr, EXACT: tl.constexpr, S: tl.constexpr = 1, w0=0, first=False,
    PRE: tl.constexpr = False,
):  # fmt: skip
    """float32 ``W[rows] . in`` (``[BP]``, rows valid where ``ok``) over the whole ``K``, the
    input from :func:`_in_chunk` (``MODE``, ``S``); with ``PRE`` and ``first`` the first chunk
    of the weight is ``w0`` (:func:`_w_chunk`). ``MODE`` 3: RMSNorm's input with the scale
    applied last, ``rsqrt(mean(x^2) + eps) * (W[rows] . (w * x))``, the scale from sums of
    squares taken beside the dot product (:func:`_late_chunk`; the argument ``r`` is ``eps``
    here; no bf16 rounding of the normalized input)."""
    acc = tl.zeros((BP, BK), dtype=tl.float32)
    ss = tl.zeros((BK,), dtype=tl.float32)
    for k0 in tl.static_range(0, K, BK):
        cols = k0 + tl.arange(0, BK)
        if MODE == 3:
            xv, ss = _late_chunk(x_ptr, nw_ptr, cols, ss)
        else:
            xv = _in_chunk(x_ptr, nw_ptr, r, cols, MODE, EXACT, S)
        wv = _w_chunk(w_ptr, rows, ok, cols, K, w0, first, PRE and k0 == 0)
        acc += wv.to(tl.float32) * xv[None, :]
    y = tl.sum(acc, axis=1)
    if MODE == 3:
        y = y * _late_scale(ss, K, r)
    return y


@triton.jit
def _rows_dot2(
    w_ptr, rows, rows2, ok, x_ptr, nw_ptr, r, K: tl.constexpr, BK: tl.constexpr,
    BP: tl.constexpr, EXACT: tl.constexpr, w0=0, w0b=0, first=False, PRE: tl.constexpr = False,
    LATE: tl.constexpr = False,
):  # fmt: skip
    """:func:`_rows_dot` of two row sets (the gate and up rows) over one normalized input, in
    one K loop: ``(W[rows] . in, W[rows2] . in)`` (first chunks ``w0``/``w0b`` with ``PRE``
    and ``first``; ``LATE``: the norm's scale applied last, ``_rows_dot``'s ``MODE`` 3, ``r``
    the epsilon)."""
    acc = tl.zeros((BP, BK), dtype=tl.float32)
    acc2 = tl.zeros((BP, BK), dtype=tl.float32)
    ss = tl.zeros((BK,), dtype=tl.float32)
    for k0 in tl.static_range(0, K, BK):
        cols = k0 + tl.arange(0, BK)
        if LATE:
            xv, ss = _late_chunk(x_ptr, nw_ptr, cols, ss)
        else:
            xv = _in_chunk(x_ptr, nw_ptr, r, cols, 1, EXACT)
        wv = _w_chunk(w_ptr, rows, ok, cols, K, w0, first, PRE and k0 == 0)
        wv2 = _w_chunk(w_ptr, rows2, ok, cols, K, w0b, first, PRE and k0 == 0)
        acc += wv.to(tl.float32) * xv[None, :]
        acc2 += wv2.to(tl.float32) * xv[None, :]
    y, y2 = tl.sum(acc, axis=1), tl.sum(acc2, axis=1)
    if LATE:
        r_late = _late_scale(ss, K, r)
        y, y2 = y * r_late, y2 * r_late
    return y, y2


@triton.jit
def _load_res(res_ptr, rows, ok):
    """The residual stream's rows ``res[rows]`` as float32 (0 where not ``ok``), read at L2
    (another program may have written them before the last barrier)."""
    return tl.load(res_ptr + rows, mask=ok, other=0.0, cache_modifier=".cg").to(tl.float32)


@triton.jit
def _add_residual(
    y, res_ptr, out_ptr, rows, ok, EXACT: tl.constexpr, res=0, EARLY: tl.constexpr = False
):
    """``out[rows] = bf16(res[rows] + bf16(y))`` where ``ok``: a projection's float32 rows
    ``y`` rounded to bf16, added to the residual stream in bf16 (eager torch's two roundings);
    ``res`` loaded now (:func:`_load_res`), or with ``EARLY`` the values given (loaded before
    the projection's K loop, so their latency overlaps it)."""
    if not EARLY:
        res = _load_res(res_ptr, rows, ok)
    out = round_as(res + round_as(y, tl.bfloat16, EXACT), tl.bfloat16, EXACT)
    tl.store(out_ptr + rows, out.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _tile_rows(t, N: tl.constexpr, R: tl.constexpr, BP: tl.constexpr):
    """Rows of tile ``t`` (``R`` rows, ``BP`` its power-of-two width) as int64, and their mask."""
    i = tl.arange(0, BP)
    rows = t * R + i
    return rows.to(tl.int64), (i < R) & (rows < N)


@triton.jit
def _kv_tile(
    kc, vc, bt_ptr, t0, c_hi, g, HKV: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
    BT: tl.constexpr, RT: tl.constexpr,
):  # fmt: skip
    """KV head ``g``'s keys and values ``[RT, D]`` (bf16, read at L2) of tokens ``t0 + [0,
    BT)`` through the block table (``RT`` a multiple of ``BT``: row ``j`` holds token ``t0 + j
    % BT``, the tile repeated for each query head of the group, :func:`_attn_split`'s
    ``ROW_SM``), and their mask ``tok < c_hi`` (masked rows: zeros, no traffic)."""
    tok = t0 + tl.arange(0, RT) % BT
    t_ok = tok < c_hi
    blk = tl.load(bt_ptr + tok // BS, mask=t_ok, other=0).to(tl.int64)
    kv_off = ((blk * BS + tok % BS) * HKV + g)[:, None] * D + tl.arange(0, D)[None, :]
    k = tl.load(kc + kv_off, mask=t_ok[:, None], other=0.0, cache_modifier=".cg")
    v = tl.load(vc + kv_off, mask=t_ok[:, None], other=0.0, cache_modifier=".cg")
    return k, v, t_ok


@triton.jit
def _attn_split(
    q_ptr, kc, vc, bt_ptr, part_ptr, ml_ptr, g, s, seq_len, scale,
    HKV: tl.constexpr, G: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, S: tl.constexpr,
    BT: tl.constexpr, FUSED: tl.constexpr, qkv_ptr, qn_ptr, kn_ptr, cos_ptr, sin_ptr, eps, slot,
    HQ: tl.constexpr, EXACT: tl.constexpr, pre_k=0, pre_v=0, pre_ok=0, PRE: tl.constexpr = False,
    ROW_SM: tl.constexpr = False, DOT: tl.constexpr = False,
):  # fmt: skip
    """Split ``s`` of KV head ``g``: the ``G`` query heads of its group over tokens
    ``[s * chunk, (s + 1) * chunk)`` of the context (``chunk`` = ``ceil(seq_len / S)`` rounded
    up to ``BT``), online softmax in float32; writes the unnormalized ``acc [G, D]`` to
    ``part [HQ, S, D]`` and ``(m, l)`` to ``ml [HQ, S, 2]`` (``m = -inf``, ``l = 0`` for an empty
    split). ``FUSED``: the queries are normalized and rotated here from ``qkv`` (phase B's
    :func:`kernels.qk_norm_rope.norm_rope_rows`), the cache is read for the earlier tokens only,
    and the split holding the new token (position ``seq_len - 1``) rotates its key, adds it and
    its value from registers and stores both in ``slot``; else ``q`` comes from ``q_ptr``.
    The ``BT``-token tiles are software-pipelined (each tile's keys/values asked for before the
    previous tile's arithmetic); ``PRE``: the first tile is ``pre_k``/``pre_v`` ``[BT, D]``
    (``[G * BT, D]`` with ``ROW_SM``; valid where ``pre_ok``), loaded earlier by the caller
    (:func:`_kv_tile` of ``lo`` and the same ``c_hi``).
    ``ROW_SM``: the online softmax runs per row of a ``[G * BT, D]`` tile (row ``j``: query
    head ``j // BT`` of the group against token ``j % BT``; the tile's keys/values repeated per
    head, ``_kv_tile``'s ``RT``) -- each row keeps its own running max, sum and ``[D]``
    accumulator, so a tile needs no reduction across warps (only the dot over ``D``) and no
    layout conversion of the keys/values; the rows of each head are merged once, after the
    last tile (FlashDecoding's split merge, arXiv:2311.01282, over the rows). Float32 sums in
    another order than the per-head loop: not bit-equal to it. ``DOT`` (without ``ROW_SM``):
    the per-head loop on tensor cores, :func:`_attn_dot` (the group's rows padded to
    :data:`DOT_ROWS`, the padding's results not stored)."""
    chunk = tl.cdiv(tl.cdiv(seq_len, S), BT) * BT
    lo = s * chunk
    hi = tl.minimum(lo + chunk, seq_len)
    hq = g * G + tl.arange(0, G)
    d = tl.arange(0, D)
    c_hi = tl.minimum(hi, seq_len - 1) if FUSED else hi  # FUSED: the new token from registers
    RT: tl.constexpr = BT * G if ROW_SM else BT
    # software pipelining: each tile's keys/values are asked for before the previous tile's
    # (or the queries') arithmetic, so their latency overlaps it
    if PRE:
        k, v, t_ok = pre_k, pre_v, pre_ok
    else:
        k, v, t_ok = _kv_tile(kc, vc, bt_ptr, lo, c_hi, g, HKV, D, BS, BT, RT)
    if ROW_SM:
        m, l_sum, acc, q = _attn_rows(
            k, v, t_ok, kc, vc, bt_ptr, lo, c_hi, g, scale, HKV, G, D, BS, BT, FUSED, q_ptr,
            qkv_ptr, qn_ptr, cos_ptr, sin_ptr, eps,
        )  # fmt: skip
    elif DOT:
        m, l_sum, acc, q = _attn_dot(
            k, v, t_ok, kc, vc, bt_ptr, lo, c_hi, g, scale, HKV, G, D, BS, BT, FUSED, q_ptr,
            qkv_ptr, qn_ptr, cos_ptr, sin_ptr, eps, EXACT,
        )  # fmt: skip
    else:
        m, l_sum, acc, q = _attn_heads(
            k, v, t_ok, kc, vc, bt_ptr, lo, c_hi, g, scale, HKV, G, D, BS, BT, FUSED, q_ptr,
            qkv_ptr, qn_ptr, cos_ptr, sin_ptr, eps,
        )  # fmt: skip
    if FUSED:
        if (lo < seq_len) & (seq_len <= hi):  # this split holds the new token
            gk = g + tl.arange(0, 1)
            k_new = norm_rope_rows(
                qkv_ptr + HQ * D, gk, gk < HKV, D, 1, kn_ptr, cos_ptr, sin_ptr, 1, 1, eps, D,
                True, True,
            )  # fmt: skip
            v_off = gk[:, None] * D + d[None, :]
            v_new = tl.load(qkv_ptr + (HQ + HKV) * D + v_off, cache_modifier=".cg")
            store = (v_off * 0 + slot) >= 0  # a negative slot stores nothing (padding)
            tl.store(kc + slot * HKV * D + v_off, k_new, mask=store)
            tl.store(vc + slot * HKV * D + v_off, v_new, mask=store)
            sc = tl.sum(q * k_new.to(tl.float32), axis=1) * scale  # [G]
            m_new = tl.maximum(m, sc)
            alpha = tl.exp(m - m_new)
            p = tl.exp(sc - m_new)
            l_sum = l_sum * alpha + p
            acc = acc * alpha[:, None] + p[:, None] * v_new.to(tl.float32)
            m = m_new
    if DOT and not ROW_SM:  # DOT_ROWS rows, the group's first G stored
        r = tl.arange(0, DOT_ROWS)
        hr = g * G + r
        tl.store(part_ptr + (hr[:, None] * S + s) * D + d[None, :], acc, mask=(r < G)[:, None])
        tl.store(ml_ptr + (hr * S + s) * 2, m, mask=r < G)
        tl.store(ml_ptr + (hr * S + s) * 2 + 1, l_sum, mask=r < G)
    else:
        tl.store(part_ptr + (hq[:, None] * S + s) * D + d[None, :], acc)
        tl.store(ml_ptr + (hq * S + s) * 2, m)
        tl.store(ml_ptr + (hq * S + s) * 2 + 1, l_sum)


@triton.jit
def _group_q(hq, D: tl.constexpr, FUSED: tl.constexpr, q_ptr, qkv_ptr, qn_ptr, cos_ptr, sin_ptr,
             eps):  # fmt: skip
    """The float32 queries ``[len(hq), D]`` of the query heads ``hq`` (any, repeats allowed):
    normalized and rotated from ``qkv`` (``FUSED``, phase B's
    :func:`kernels.qk_norm_rope.norm_rope_rows`) or read from ``q``."""
    if FUSED:
        q = norm_rope_rows(  # (exact roundings: no FMA may skip rotary's, kernels.rounding)
            qkv_ptr, hq, hq >= 0, D, 1, qn_ptr, cos_ptr, sin_ptr, 1, 1, eps, D, True, True
        ).to(tl.float32)
    else:
        q = tl.load(q_ptr + hq[:, None] * D + tl.arange(0, D)[None, :], cache_modifier=".cg")
        q = q.to(tl.float32)
    return q


@triton.jit
def _attn_heads(
    k, v, t_ok, kc, vc, bt_ptr, lo, c_hi, g, scale, HKV: tl.constexpr, G: tl.constexpr,
    D: tl.constexpr, BS: tl.constexpr, BT: tl.constexpr, FUSED: tl.constexpr, q_ptr, qkv_ptr,
    qn_ptr, cos_ptr, sin_ptr, eps,
):  # fmt: skip
    """:func:`_attn_split`'s tile loop per query head: the running ``(m [G], l [G], acc [G,
    D])`` (float32) over tokens ``[lo, c_hi)`` of KV head ``g``, the first tile ``k``/``v``
    ``[BT, D]`` (valid where ``t_ok``) given, each next one loaded before the current one's
    arithmetic; also returns the queries ``q [G, D]``."""
    q = _group_q(g * G + tl.arange(0, G), D, FUSED, q_ptr, qkv_ptr, qn_ptr, cos_ptr, sin_ptr, eps)
    m = tl.full((G,), float("-inf"), dtype=tl.float32)
    l_sum = tl.zeros((G,), dtype=tl.float32)
    acc = tl.zeros((G, D), dtype=tl.float32)
    for t0 in range(lo, c_hi, BT):
        k_next, v_next, ok_next = _kv_tile(kc, vc, bt_ptr, t0 + BT, c_hi, g, HKV, D, BS, BT, BT)
        sc = tl.sum(q[:, None, :] * k.to(tl.float32)[None, :, :], axis=2) * scale  # [G, BT]
        sc = tl.where(t_ok[None, :], sc, float("-inf"))
        m_new = tl.maximum(m, tl.max(sc, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(sc - m_new[:, None])
        l_sum = l_sum * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v.to(tl.float32)[None, :, :], axis=1)
        m = m_new
        k, v, t_ok = k_next, v_next, ok_next
    return m, l_sum, acc, q


#: the rows of :func:`_attn_dot`'s query tile: the GQA group's heads padded to the smallest M of
#: Triton's ``tl.dot`` (16)
DOT_ROWS = tl.constexpr(16)


@triton.jit
def _attn_dot(
    k, v, t_ok, kc, vc, bt_ptr, lo, c_hi, g, scale, HKV: tl.constexpr, G: tl.constexpr,
    D: tl.constexpr, BS: tl.constexpr, BT: tl.constexpr, FUSED: tl.constexpr, q_ptr, qkv_ptr,
    qn_ptr, cos_ptr, sin_ptr, eps, EXACT: tl.constexpr,
):  # fmt: skip
    """:func:`_attn_heads` on tensor cores (``_attn_split``'s ``DOT``): the group's ``G`` query
    heads padded to ``DOT_ROWS`` rows (the padding repeats head ``G - 1``; its results are
    not stored), each tile's scores ``q k^T`` and the weighted values ``p v`` as ``tl.dot``
    (bf16 operands, float32 accumulation: the probabilities ``p`` rounded to bf16 for the
    second product, as FlashAttention-2, arXiv:2307.08691, and the engine's paged decode
    kernel do), the online softmax between them in float32. Returns ``(m [R], l [R], acc [R,
    D])`` and the queries ``[R, D]``, ``R`` = ``DOT_ROWS``. ``EXACT`` (the interpreter, whose
    ``tl.dot`` multiplies bf16 as raw integers): float32 operands, ``p`` rounded as on a GPU.
    Needs ``G <= DOT_ROWS`` and ``BT``, ``D`` of 16 or more."""
    hq = g * G + tl.minimum(tl.arange(0, DOT_ROWS), G - 1)
    q = _group_q(hq, D, FUSED, q_ptr, qkv_ptr, qn_ptr, cos_ptr, sin_ptr, eps)  # bf16 values
    q_op = q if EXACT else q.to(tl.bfloat16)
    m = tl.full((DOT_ROWS,), float("-inf"), dtype=tl.float32)
    l_sum = tl.zeros((DOT_ROWS,), dtype=tl.float32)
    acc = tl.zeros((DOT_ROWS, D), dtype=tl.float32)
    for t0 in range(lo, c_hi, BT):
        k_next, v_next, ok_next = _kv_tile(kc, vc, bt_ptr, t0 + BT, c_hi, g, HKV, D, BS, BT, BT)
        k_op = k.to(tl.float32) if EXACT else k
        sc = tl.dot(q_op, tl.trans(k_op)) * scale  # [R, BT]
        sc = tl.where(t_ok[None, :], sc, float("-inf"))
        m_new = tl.maximum(m, tl.max(sc, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(sc - m_new[:, None])
        l_sum = l_sum * alpha + tl.sum(p, axis=1)
        if EXACT:  # p rounded to nearest as a GPU's cast does (the interpreter's truncates)
            pv = tl.dot(round_as(p, tl.bfloat16, EXACT), v.to(tl.float32))
        else:
            pv = tl.dot(p.to(tl.bfloat16), v)
        acc = acc * alpha[:, None] + pv
        m = m_new
        k, v, t_ok = k_next, v_next, ok_next
    return m, l_sum, acc, q


@triton.jit
def _attn_rows(
    k, v, t_ok, kc, vc, bt_ptr, lo, c_hi, g, scale, HKV: tl.constexpr, G: tl.constexpr,
    D: tl.constexpr, BS: tl.constexpr, BT: tl.constexpr, FUSED: tl.constexpr, q_ptr, qkv_ptr,
    qn_ptr, cos_ptr, sin_ptr, eps,
):  # fmt: skip
    """:func:`_attn_heads` per row (``_attn_split``'s ``ROW_SM``): tiles ``[G * BT, D]`` (row
    ``j``: head ``j // BT``, token ``j % BT``), a running ``(m, l, acc)`` per row, merged per
    head after the last tile; returns the same ``(m [G], l [G], acc [G, D])`` (``m = -inf``,
    ``l = 0``, ``acc = 0`` for a head without tokens) and the queries ``[G, D]``."""
    RT: tl.constexpr = G * BT
    # each row's query: its head's, normalized and rotated once per head (G rows), then
    # repeated over the head's BT rows (one layout change per item, not per tile)
    q_g = _group_q(g * G + tl.arange(0, G), D, FUSED, q_ptr, qkv_ptr, qn_ptr, cos_ptr, sin_ptr, eps)
    q = tl.reshape(tl.broadcast_to(q_g[:, None, :], (G, BT, D)), (RT, D))
    m_r = tl.full((RT,), float("-inf"), dtype=tl.float32)
    l_r = tl.zeros((RT,), dtype=tl.float32)
    acc_r = tl.zeros((RT, D), dtype=tl.float32)
    for t0 in range(lo, c_hi, BT):
        k_next, v_next, ok_next = _kv_tile(kc, vc, bt_ptr, t0 + BT, c_hi, g, HKV, D, BS, BT, RT)
        sc = tl.sum(q * k.to(tl.float32), axis=1) * scale  # [RT]
        m_new = tl.where(t_ok, tl.maximum(m_r, sc), m_r)
        # a row without a token yet keeps -inf (its l and acc are 0: any finite alpha will do)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_r - m_safe)
        p = tl.where(t_ok, tl.exp(sc - m_safe), 0.0)
        l_r = l_r * alpha + p
        acc_r = acc_r * alpha[:, None] + p[:, None] * v.to(tl.float32)
        m_r = m_new
        k, v, t_ok = k_next, v_next, ok_next
    # merge each head's rows (the split merge over rows): weights exp(m_row - max of the head),
    # the rows viewed as [G, BT] (head j // BT is row j's: one reduction per quantity)
    m_h = tl.reshape(m_r, (G, BT))
    m = tl.max(m_h, axis=1)  # [G]
    w = tl.exp(m_h - tl.where(m == float("-inf"), 0.0, m)[:, None])  # (a -inf row: weight 0)
    l_sum = tl.sum(tl.reshape(l_r, (G, BT)) * w, axis=1)
    acc = tl.sum(tl.reshape(acc_r, (G, BT, D)) * w[:, :, None], axis=1)
    return m, l_sum, acc, q_g


@triton.jit
def _attn_merge(
    part_ptr, ml_ptr, out_ptr, h, S: tl.constexpr, D: tl.constexpr, EXACT: tl.constexpr
):
    """Query head ``h``: the ``S`` splits' partials combined (rescaled by ``exp(m_s - max m)``)
    and normalized, stored as bf16 ``out[h * D : (h + 1) * D]``."""
    sp = tl.arange(0, S)
    d = tl.arange(0, D)
    m = tl.load(ml_ptr + (h * S + sp) * 2, cache_modifier=".cg")
    lsum = tl.load(ml_ptr + (h * S + sp) * 2 + 1, cache_modifier=".cg")
    mx = tl.max(m, axis=0)
    wgt = tl.where(lsum > 0, tl.exp(m - mx), 0.0)
    acc = tl.load(part_ptr + (h * S + sp[:, None]) * D + d[None, :], cache_modifier=".cg")
    o = tl.sum(acc * wgt[:, None], axis=0) / tl.sum(lsum * wgt, axis=0)
    o = round_as(o, tl.bfloat16, EXACT)
    tl.store(out_ptr + h * D + d, o.to(out_ptr.dtype.element_ty))


@triton.jit
def _split_done(
    count_ptr, g, part_ptr, ml_ptr, attn_ptr, S: tl.constexpr, D: tl.constexpr,
    G: tl.constexpr, EXACT: tl.constexpr,
):  # fmt: skip
    """After a split of KV head ``g`` stored its partials: count its arrival (acquire-release
    atomic at GPU scope after a CTA barrier, CUTLASS's serial split-K semaphore); the last of
    the ``S`` splits merges the group's ``G`` query heads (:func:`_attn_merge`) and sets the
    counter back to zero, so no merge phase (and barrier) is needed."""
    tl.debug_barrier()
    arrived = tl.atomic_add(count_ptr + g, 1, sem="acq_rel", scope="gpu")
    if arrived == S - 1:
        for i in tl.static_range(G):
            _attn_merge(part_ptr, ml_ptr, attn_ptr, g * G + i, S, D, EXACT)
        tl.atomic_xchg(count_ptr + g, 0, sem="relaxed", scope="gpu")


#: bytes per bulk L2 prefetch instruction (:func:`kernels.l2_prefetch.bulk_prefetch_l2`)
PREFETCH_CHUNK = tl.constexpr(32768)


@triton.jit
def _prefetch_tile(
    w_ptr, pid, N: tl.constexpr, R: tl.constexpr, K: tl.constexpr, ROW0: tl.constexpr
):
    """Ask L2 for program ``pid``'s tile of a bf16 weight ``[*, K]``: rows ``ROW0 + [pid * R,
    min((pid + 1) * R, N))`` (one contiguous range; nothing where the program has no tile)."""
    lo = pid * R
    n = tl.minimum(N - lo, R)
    bulk_prefetch_l2(w_ptr + (ROW0 + lo).to(tl.int64) * K, n * (K * 2), PREFETCH_CHUNK)


@triton.jit
def _prefetch_kv(kc, vc, bt_ptr, n_tok, pid, nprog, BS: tl.constexpr, HKV: tl.constexpr,
                 D: tl.constexpr):  # fmt: skip
    """Ask L2 for the keys and values of the context's first ``n_tok`` tokens in the caches
    ``kc``/``vc`` (``[blocks, BS, HKV, D]`` bf16: a block's tokens are one contiguous range),
    the ``2 * ceil(n_tok / BS)`` block ranges dealt round-robin over the ``nprog`` programs."""
    nb = tl.cdiv(n_tok, BS)
    for i in range(pid, 2 * nb, nprog):
        b = i % nb
        blk = tl.load(bt_ptr + b).to(tl.int64)
        nbytes = tl.minimum(n_tok - b * BS, BS) * (HKV * D * 2)
        if i < nb:
            bulk_prefetch_l2(kc + blk * (BS * HKV * D), nbytes, PREFETCH_CHUNK)
        else:
            bulk_prefetch_l2(vc + blk * (BS * HKV * D), nbytes, PREFETCH_CHUNK)


@triton.jit
def _layer_ptr(layer_ptrs, layer, j):
    """Pointer ``j`` of ``layer`` in the int64 table ``layer_ptrs [L, 10]`` (the addresses of
    the layer's wqkv, wo, wgu, wd, ln1, ln2, q-norm, k-norm weights and K, V caches, bf16),
    marked 16-byte aligned (``tl.multiple_of``: without it the loads through it are scalar,
    sm_90 PTX)."""
    p = tl.load(layer_ptrs + layer * 10 + j).to(tl.pointer_type(tl.bfloat16))
    return tl.multiple_of(p, 16)


@triton.jit
def _layers_kernel(
    x_ptr, h2_ptr, qkv_ptr, q_ptr, attn_ptr, act_ptr, part_ptr, ml_ptr, bar_ptr, count_ptr,
    layer_ptrs, bt_ptr, slot_ptr, cos_ptr, sin_ptr, seq_len_ptr, LAYERS, eps, scale,
    H: tl.constexpr, HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, FF: tl.constexpr,
    BS: tl.constexpr, S: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
    R_QKV: tl.constexpr, P_QKV: tl.constexpr, R_H: tl.constexpr, P_H: tl.constexpr,
    R_FF: tl.constexpr, P_FF: tl.constexpr, EXACT: tl.constexpr, FUSE_B: tl.constexpr,
    MERGE_E: tl.constexpr, PRE_KV: tl.constexpr, MERGE_C: tl.constexpr, SKIP: tl.constexpr = 0,
    PF: tl.constexpr = 0, PRE_W: tl.constexpr = False, LATE_R: tl.constexpr = False,
    EARLY_RES: tl.constexpr = False, ROW_SM: tl.constexpr = False, BK_H: tl.constexpr = 0,
    DOT: tl.constexpr = False,
):  # fmt: skip
    """``LAYERS`` Qwen3 decoder layers of one decode token (module docstring, phases A-G), the
    hidden state ``x [H]`` (bf16) updated in place. Scratch: ``h2 [H]``, ``qkv [(HQ + 2 HKV) D]``,
    ``q``/``attn [HQ D]``, ``act [FF]`` (bf16), ``part [HQ, S, D]``, ``ml [HQ, S, 2]``
    (float32); ``bar``: two zeroed int32 counters (left zero). Each layer's tensors, wherever
    they are (one tensor per layer, as the engine holds them), through the pointer table
    ``layer_ptrs`` (:func:`_layer_ptr`): ``wqkv [(HQ + 2 HKV) D, H]``, ``wo [H, HQ D]``,
    ``wgu [2 FF, H]`` (gate rows, then up), ``wd [H, FF]``, ``ln1``/``ln2 [H]``,
    ``qn``/``kn [D]``, caches ``[blocks, BS, HKV, D]``; ``bt`` the sequence's int32 block
    table; ``slot_ptr`` the new token's int64 cache slot (negative: its k/v are not stored, as
    a padding row of the engine's ``slot_mapping``); ``cos``/``sin [D]`` its rotary row;
    ``seq_len_ptr``: the int32 context length counting the new token (read on the device, as
    the slot: a CUDA graph replays any length). The q/k norm + rotary rounds by integer ops on
    every device (``EXACT`` there), so no FMA contraction skips a rounding; ``EXACT`` rounds the
    rest that way too (the interpreter, whose casts truncate).
    ``FUSE_B``: no phase B (each attention item normalizes and rotates its group's queries and
    the new key itself, the new token's k/v enter its split from registers and that item stores
    them); ``MERGE_E``: no phase D (every o-projection program merges the splits of its input
    chunks itself); ``PRE_KV`` (with ``FUSE_B``): each program loads the first ``BT``-token tile
    of earlier keys/values of its first attention item while it waits at the barrier after A
    (they do not depend on the layer's input: the new token's come from registers); the
    pipelined loop of :func:`_attn_split` starts from it;
    ``MERGE_C``: no phase D (the last split of each KV head to finish merges its group,
    :func:`_split_done`, counters ``count [HKV]`` zeroed and left zero). ``SKIP``: a bit mask of
    phases (A = 1, B = 2, C = 4, D = 8, E = 16, F = 32, G = 64) whose work is left out, their
    barriers kept: the time of one phase's work is the difference (the results are wrong).
    ``PF``: a bit mask of bulk L2 prefetches (GPU only; hints, no effect on results), each
    issued between a barrier's arrival and its wait, so HBM fetches the weights of later phases
    while latency-bound phases run: 1, after A, this program's o and gate/up tiles (read in E
    and F); 2, after C, its down tile (G) and the next layer's q/k/v tile (A); 4, after E, the
    next layer's keys/values of the earlier tokens (C). ``PRE_W``: each GEMV phase's first
    ``BK`` weight columns of the program's first tile loaded into registers while it waits at
    the barrier before the phase (:func:`_first_chunk`; the chain probe's register preload).
    ``LATE_R``: the RMSNorms before A and F apply their scale to the dot products (computed
    beside them, :func:`_late_chunk`) instead of first reading the whole input for it, so the
    weight loads need not wait for that reduction (float32 throughout: not eager's bf16
    rounding of the normalized input). ``EARLY_RES``: E and G load their residual rows before
    the K loop (:func:`_add_residual`; the same arithmetic). ``ROW_SM``: the attention items'
    online softmax per row of ``[G * BT, D]`` tiles (:func:`_attn_split`, :func:`_attn_rows`;
    no cross-warp reduction per tile). ``DOT`` (not with ``ROW_SM``): the items' per-head
    loop on tensor cores (:func:`_attn_dot`: the group's queries padded to 16 rows, each tile's
    two products as ``tl.dot``). ``BK_H``: the K chunk of E and G (the projections to
    ``H``, whose tiles have few rows: fewer, wider chunks, so fewer dependent steps and layout
    changes of the input per tile); 0: ``BK`` (E with ``MERGE_E`` keeps ``BK``)."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    QKV_N: tl.constexpr = (HQ + 2 * HKV) * D
    G: tl.constexpr = HQ // HKV
    BK_G: tl.constexpr = BK_H if BK_H > 0 else BK  # G's K chunk
    BK_E: tl.constexpr = BK if MERGE_E else BK_G  # E's
    seq_len = tl.load(seq_len_ptr)
    pos = seq_len - 1
    slot = tl.load(slot_ptr).to(tl.int64)  # the new token's cache slot; < 0: not stored
    if PRE_KV:  # this program's first attention item: its earlier tokens (the same per layer)
        pre_lo = (pid % S) * (tl.cdiv(tl.cdiv(seq_len, S), BT) * BT)
        pre_hi = tl.minimum(pre_lo + tl.cdiv(tl.cdiv(seq_len, S), BT) * BT, pos)
        pre_hi = tl.where(pid < HKV * S, pre_hi, 0)  # no item: nothing loaded
    if PRE_W:  # layer 0's first q/k/v chunk (later layers': during the barrier after G)
        w0_a = _first_chunk(_layer_ptr(layer_ptrs, 0, 0), pid, QKV_N, R_QKV, P_QKV, H, BK)
    else:
        w0_a = 0
    phase = 0
    for layer in range(LAYERS):
        # (each phase loads its layer pointers when it needs them: fewer live registers)
        kc = _layer_ptr(layer_ptrs, layer, 8)
        vc = _layer_ptr(layer_ptrs, layer, 9)
        # A: input norm + q/k/v projection
        if (SKIP & 1) == 0:
            wqkv_ptr = _layer_ptr(layer_ptrs, layer, 0)
            ln1 = _layer_ptr(layer_ptrs, layer, 4)
            if LATE_R:
                r = eps
            else:
                r = _rms_scale(x_ptr, H, BK, eps)
            for t in range(pid, tl.cdiv(QKV_N, R_QKV), nprog):
                rows, ok = _tile_rows(t, QKV_N, R_QKV, P_QKV)
                y = _rows_dot(
                    wqkv_ptr, rows, ok, x_ptr, ln1, r, H, BK,
                    P_QKV, 3 if LATE_R else 1, EXACT, 1, w0_a, t == pid, PRE_W,
                )  # fmt: skip
                y = round_as(y, tl.bfloat16, EXACT)
                tl.store(qkv_ptr + rows, y.to(qkv_ptr.dtype.element_ty), mask=ok)
        phase += 1
        grid_arrive(bar_ptr)
        if PF & 1:  # E's and F's weight tiles into L2 while B/C run
            _prefetch_tile(_layer_ptr(layer_ptrs, layer, 1), pid, H, R_H, HQ * D, 0)
            wgu_pf = _layer_ptr(layer_ptrs, layer, 2)
            _prefetch_tile(wgu_pf, pid, FF, R_FF, H, 0)
            _prefetch_tile(wgu_pf, pid, FF, R_FF, H, FF)
        if PRE_KV:  # the first tile of this program's attention item, during the wait
            k_pre, v_pre, ok_pre = _kv_tile(
                kc, vc, bt_ptr, pre_lo, pre_hi, pid // S, HKV, D, BS, BT, BT * G if ROW_SM else BT
            )
        grid_wait(bar_ptr, phase * nprog)
        # B: q/k norm + rotary, k/v into the cache slot (FUSE_B: in C's items instead)
        qn = _layer_ptr(layer_ptrs, layer, 6)
        kn = _layer_ptr(layer_ptrs, layer, 7)
        if not FUSE_B:
            for item in range(pid, 3 * ((SKIP & 2) == 0), nprog):
                if item == 0:
                    hq = tl.arange(0, HQ)
                    qr = norm_rope_rows(
                        qkv_ptr, hq, hq < HQ, D, 1, qn, cos_ptr, sin_ptr, 1, 1,
                        eps, D, True, True,
                    )  # fmt: skip
                    tl.store(q_ptr + hq[:, None] * D + tl.arange(0, D)[None, :], qr)
                elif item == 1:
                    hk = tl.arange(0, HKV)
                    kr = norm_rope_rows(
                        qkv_ptr + HQ * D, hk, hk < HKV, D, 1, kn, cos_ptr, sin_ptr,
                        1, 1, eps, D, True, True,
                    )  # fmt: skip
                    off = hk[:, None] * D + tl.arange(0, D)[None, :]
                    tl.store(kc + slot * HKV * D + off, kr, mask=(off * 0 + slot) >= 0)
                else:
                    off = tl.arange(0, HKV)[:, None] * D + tl.arange(0, D)[None, :]
                    v = tl.load(qkv_ptr + (HQ + HKV) * D + off, cache_modifier=".cg")
                    tl.store(vc + slot * HKV * D + off, v, mask=(off * 0 + slot) >= 0)
            phase += 1
            grid_sync(bar_ptr, phase * nprog)
        # C: split-KV attention partials
        if (SKIP & 4) == 0:
            if PRE_KV:
                if pid < HKV * S:
                    _attn_split(
                        q_ptr, kc, vc, bt_ptr, part_ptr, ml_ptr, pid // S, pid % S, seq_len, scale,
                        HKV, G, D, BS, S, BT, FUSE_B, qkv_ptr, qn,
                        kn, cos_ptr, sin_ptr, eps, slot, HQ, EXACT, k_pre, v_pre,
                        ok_pre, True, ROW_SM, DOT,
                    )  # fmt: skip
                    if MERGE_C:
                        _split_done(count_ptr, pid // S, part_ptr, ml_ptr, attn_ptr, S, D, G, EXACT)
            for item in range(pid + PRE_KV * nprog, HKV * S, nprog):
                _attn_split(
                    q_ptr, kc, vc, bt_ptr, part_ptr, ml_ptr, item // S, item % S, seq_len, scale,
                    HKV, G, D, BS, S, BT, FUSE_B, qkv_ptr, qn, kn,
                    cos_ptr, sin_ptr, eps, slot, HQ, EXACT, ROW_SM=ROW_SM, DOT=DOT,
                )  # fmt: skip
                if MERGE_C:
                    _split_done(count_ptr, item // S, part_ptr, ml_ptr, attn_ptr, S, D, G, EXACT)
        phase += 1
        grid_arrive(bar_ptr)
        if PRE_W:  # E's first o chunk
            w0_e = _first_chunk(_layer_ptr(layer_ptrs, layer, 1), pid, H, R_H, P_H, HQ * D, BK_E)
        else:
            w0_e = 0
        if PF & 2:  # G's weight tile and the next layer's q/k/v tile into L2
            _prefetch_tile(_layer_ptr(layer_ptrs, layer, 3), pid, H, R_H, FF, 0)
            if layer + 1 < LAYERS:
                _prefetch_tile(_layer_ptr(layer_ptrs, layer + 1, 0), pid, QKV_N, R_QKV, H, 0)
        grid_wait(bar_ptr, phase * nprog)
        if not (MERGE_E or MERGE_C):  # D: merge the splits
            for h in range(pid, HQ * ((SKIP & 8) == 0), nprog):
                _attn_merge(part_ptr, ml_ptr, attn_ptr, h, S, D, EXACT)
            phase += 1
            grid_sync(bar_ptr, phase * nprog)
        # E: o projection + residual
        if (SKIP & 16) == 0:
            wo_ptr = _layer_ptr(layer_ptrs, layer, 1)
            for t in range(pid, tl.cdiv(H, R_H), nprog):
                rows, ok = _tile_rows(t, H, R_H, P_H)
                res = _load_res(x_ptr, rows, ok) if EARLY_RES else 0
                if MERGE_E:  # the splits merged in the o projection's input chunks
                    y = _rows_dot(
                        wo_ptr, rows, ok, part_ptr, ml_ptr, D, HQ * D, BK, P_H,
                        2, EXACT, S, w0_e, t == pid, PRE_W,
                    )  # fmt: skip
                else:
                    y = _rows_dot(
                        wo_ptr, rows, ok, attn_ptr, attn_ptr, 1.0, HQ * D, BK_E,
                        P_H, 0, EXACT, 1, w0_e, t == pid, PRE_W,
                    )  # fmt: skip
                _add_residual(y, x_ptr, h2_ptr, rows, ok, EXACT, res, EARLY_RES)
        phase += 1
        grid_arrive(bar_ptr)
        if PRE_W:  # F's first gate and up chunks
            wgu_pre = _layer_ptr(layer_ptrs, layer, 2)
            w0_g = _first_chunk(wgu_pre, pid, FF, R_FF, P_FF, H, BK)
            w0_u = _first_chunk(wgu_pre, pid, FF, R_FF, P_FF, H, BK, FF)
        else:
            w0_g = 0
            w0_u = 0
        if PF & 4:  # the next layer's earlier keys/values into L2
            if layer + 1 < LAYERS:
                _prefetch_kv(
                    _layer_ptr(layer_ptrs, layer + 1, 8), _layer_ptr(layer_ptrs, layer + 1, 9),
                    bt_ptr, pos, pid, nprog, BS, HKV, D,
                )  # fmt: skip
        grid_wait(bar_ptr, phase * nprog)
        # F: post-attention norm + gate/up + SwiGLU
        if (SKIP & 32) == 0:
            wgu = _layer_ptr(layer_ptrs, layer, 2)
            ln2 = _layer_ptr(layer_ptrs, layer, 5)
            if LATE_R:
                r2 = eps
            else:
                r2 = _rms_scale(h2_ptr, H, BK, eps)
            for t in range(pid, tl.cdiv(FF, R_FF), nprog):
                rows, ok = _tile_rows(t, FF, R_FF, P_FF)
                gate, up = _rows_dot2(
                    wgu, rows, rows + FF, ok, h2_ptr, ln2, r2, H, BK, P_FF, EXACT, w0_g, w0_u,
                    t == pid, PRE_W, LATE_R,
                )  # fmt: skip
                gate = round_as(gate, tl.bfloat16, EXACT)
                silu = round_as(gate / (1.0 + tl.exp(-gate)), tl.bfloat16, EXACT)
                a = round_as(silu * round_as(up, tl.bfloat16, EXACT), tl.bfloat16, EXACT)
                tl.store(act_ptr + rows, a.to(act_ptr.dtype.element_ty), mask=ok)
        phase += 1
        grid_arrive(bar_ptr)
        if PRE_W:  # G's first down chunk
            w0_d = _first_chunk(_layer_ptr(layer_ptrs, layer, 3), pid, H, R_H, P_H, FF, BK_G)
        else:
            w0_d = 0
        grid_wait(bar_ptr, phase * nprog)
        # G: down projection + residual (the next layer's input)
        if (SKIP & 64) == 0:
            wd_ptr = _layer_ptr(layer_ptrs, layer, 3)
            for t in range(pid, tl.cdiv(H, R_H), nprog):
                rows, ok = _tile_rows(t, H, R_H, P_H)
                res = _load_res(h2_ptr, rows, ok) if EARLY_RES else 0
                y = _rows_dot(
                    wd_ptr, rows, ok, act_ptr, act_ptr, 1.0, FF, BK_G, P_H, 0, EXACT, 1, w0_d,
                    t == pid, PRE_W,
                )  # fmt: skip
                _add_residual(y, h2_ptr, x_ptr, rows, ok, EXACT, res, EARLY_RES)
        phase += 1
        grid_arrive(bar_ptr)
        if PRE_W:  # the next layer's first q/k/v chunk (the last layer: its own, unused)
            w0_a = _first_chunk(
                _layer_ptr(layer_ptrs, tl.minimum(layer + 1, LAYERS - 1), 0), pid, QKV_N, R_QKV,
                P_QKV, H, BK,
            )  # fmt: skip
        grid_wait(bar_ptr, phase * nprog)
    grid_leave(bar_ptr, nprog)


#: the order of a layer's tensors in :func:`layer_table`'s rows (the kernel's ``_layer_ptr``)
LAYER_TENSORS = ("wqkv", "wo", "wgu", "wd", "ln1", "ln2", "q_norm", "k_norm", "k_cache", "v_cache")


def layer_table(layers) -> torch.Tensor:
    """The kernel's int64 pointer table ``[L, 10]``: for each layer the addresses of its ten
    bf16 tensors in :data:`LAYER_TENSORS` order -- q/k/v weight ``[(HQ + 2 HKV) D, H]``, o
    ``[H, HQ D]``, gate/up ``[2 FF, H]`` (gate rows first), down ``[H, FF]``, the input and
    post-attention RMSNorm weights ``[H]``, the q/k RMSNorm weights ``[D]``, and its K and V
    caches ``[blocks, BS, HKV, D]`` -- on the first tensor's device. Make it once, outside a
    CUDA-graph capture (it copies from the host); the tensors must outlive its use.

    Args:
        layers: one sequence of ten tensors per layer.

    Raises:
        ValueError: a layer without ten tensors, or a tensor that is not contiguous bf16 at a
            16-byte aligned address (the kernel loads through them as such).
    """
    rows = []
    for ts in layers:
        ts = list(ts)
        if len(ts) != len(LAYER_TENSORS):
            raise ValueError(f"a layer needs {len(LAYER_TENSORS)} tensors ({LAYER_TENSORS})")
        for name, t in zip(LAYER_TENSORS, ts):
            if t.dtype != torch.bfloat16 or not t.is_contiguous() or t.data_ptr() % 16:
                raise ValueError(
                    f"{name}: every layer tensor must be contiguous bf16, 16-byte aligned"
                )
        rows.append([t.data_ptr() for t in ts])
    return torch.tensor(rows, dtype=torch.int64, device=ts[0].device)


class Scratch:
    """The kernel's scratch buffers and barrier counters for ``dims`` = ``(H, HQ, HKV, D, FF)``
    and ``splits`` KV splits per head, on ``device`` (made once: a CUDA graph replays the launch
    on them; one set per concurrent launch)."""

    def __init__(self, dims, splits, device):
        h, hq, hkv, d, ff = dims
        bf = dict(dtype=torch.bfloat16, device=device)
        self.h2 = torch.zeros(h, **bf)
        self.qkv = torch.zeros((hq + 2 * hkv) * d, **bf)
        self.q = torch.zeros(hq * d, **bf)
        self.attn = torch.zeros(hq * d, **bf)
        self.act = torch.zeros(ff, **bf)
        self.part = torch.zeros(hq, splits, d, dtype=torch.float32, device=device)
        self.ml = torch.zeros(hq, splits, 2, dtype=torch.float32, device=device)
        self.bar = torch.zeros(2, dtype=torch.int32, device=device)
        self.count = torch.zeros(hkv, dtype=torch.int32, device=device)
        self.splits = splits


def dot_attn_fits(hq: int, hkv: int, d: int, block_t: int) -> bool:
    """Whether ``DOT`` (the per-head attention loop on tensor cores) takes this shape: a GQA
    group (``hq // hkv`` query heads per KV head) of at most :data:`DOT_ROWS`, and a head dim
    ``d`` and attention tile ``block_t`` (tokens) of 16 or more (``tl.dot``'s smallest tile)."""
    return hq // hkv <= DOT_ROWS.value and min(block_t, d) >= 16


def persistent_layers(
    x, table, dims, block_size, block_table, slot, seq_len, cos, sin, eps, scratch: Scratch,
    programs=1, block_k=64, block_t=32, num_warps=4, fuse_b=False, merge_e=False, pre_kv=False,
    merge_c=False, skip=0, info=None, check=True, prefetch=0, pre_w=False, late_r=False,
    early_res=False, row_sm=False, block_k_h=None, dot_attn=False,
):  # fmt: skip
    """Run :func:`_layers_kernel` over every layer of ``table`` (:func:`layer_table`, ``[L,
    10]``; ``dims`` = ``(H, HQ, HKV, D, FF)``, ``block_size`` the caches' tokens per block) on
    the hidden state ``x [H]`` (bf16, updated in place and returned); each layer's caches get
    the token's k/v at position ``seq_len - 1`` (an int, or an int32 ``[1]`` device tensor, as
    a CUDA graph replays it) in cache slot ``slot`` (an int or an int64 ``[1]`` device tensor;
    negative: nothing stored); ``block_table`` the sequence's int32 block ids; ``cos``/``sin
    [D]`` its rotary row (bf16); ``eps`` the RMSNorm epsilon; ``fuse_b``,
    ``merge_e``, ``pre_kv``: the kernel's ``FUSE_B``, ``MERGE_E``, ``PRE_KV`` (phases B and D
    folded into C and E; the first ``block_t`` keys/values of the program's first attention
    item loaded during the barrier wait);
    ``merge_c``: ``MERGE_C`` (the last split of a KV head merges its group); ``skip``: the
    kernel's ``SKIP`` mask (phases whose work is left out, for timing only); ``prefetch``: the
    kernel's ``PF`` mask of L2 prefetches (0 under the interpreter: inline PTX); ``pre_w``: its
    ``PRE_W`` (each GEMV's first weight chunk loaded during the barrier wait); ``late_r``,
    ``early_res``: its ``LATE_R`` (the RMSNorm scales applied to the dot products: float32,
    not eager's roundings) and ``EARLY_RES`` (residual rows loaded before the K loops);
    ``row_sm``: its ``ROW_SM`` (the attention's online softmax per row, merged per head);
    ``dot_attn``: its ``DOT`` (the attention's per-head loop on tensor cores; not with
    ``row_sm``);
    ``block_k_h``: its ``BK_H``, the K chunk of the o and down projections (None: ``block_k``;
    it must divide HQ * D and FF);
    ``info``: a dict that gets the launch's register line (``"usage"``) and, compiled on a
    GPU, the kernel's PTX (``"ptx"``) and its spilled bytes per thread (``"spills"``);
    ``check``: the residency check of :func:`kernels.grid_barrier.launch_resident` (a caller
    that checked once may skip it: it compiles and queries the device, host work on every
    eager call).

    Raises:
        ValueError: ``block_k`` not dividing H, FF and HQ * D, ``block_k_h`` not a power of two
            dividing FF and HQ * D, a splits count, head count or
            head dim that is no power of two, ``pre_kv`` without ``fuse_b``, ``prefetch`` on a
            GPU below compute capability 9.0 (the bulk prefetch is sm_90 PTX), or more
            programs than the GPU holds at once (:func:`kernels.grid_barrier.launch_resident`),
            ``dot_attn`` with ``row_sm``, a GQA group over 16 heads, or a ``block_t`` or head dim
            under 16.
    """
    h, hq, hkv, d, ff = dims
    if any(k % block_k for k in (h, ff, hq * d)):
        raise ValueError(f"block_k {block_k} must divide H, FF and HQ * D")
    block_k_h = block_k if block_k_h is None else block_k_h
    if block_k_h < 1 or block_k_h & (block_k_h - 1) or any(k % block_k_h for k in (ff, hq * d)):
        raise ValueError(f"block_k_h {block_k_h} must be a power of two dividing FF and HQ * D")
    for name, v in (("splits", scratch.splits), ("HQ", hq), ("HKV", hkv), ("D", d)):
        if v & (v - 1):
            raise ValueError(f"{name} = {v} must be a power of two")
    if pre_kv and not fuse_b:
        raise ValueError("pre_kv needs fuse_b")
    if dot_attn and (row_sm or not dot_attn_fits(hq, hkv, d, block_t)):
        raise ValueError(
            "dot_attn needs row_sm off, a GQA group of at most 16 heads and block_t and the head "
            "dim of 16 or more (tl.dot's smallest tile)"
        )
    gpu = x.device.type == "cuda" and not interpreting()
    if prefetch and gpu and torch.cuda.get_device_capability(x.device)[0] < 9:
        raise ValueError("prefetch needs compute capability 9.0+ (cp.async.bulk.prefetch)")
    if not isinstance(seq_len, torch.Tensor):
        seq_len = torch.tensor([seq_len], dtype=torch.int32, device=x.device)
    if not isinstance(slot, torch.Tensor):
        slot = torch.tensor([slot], dtype=torch.int64, device=x.device)
    layers = table.shape[0]
    r_qkv, r_h, r_ff = (-(-n // programs) for n in ((hq + 2 * hkv) * d, h, ff))
    p2 = triton.next_power_of_2
    args = (
        x, scratch.h2, scratch.qkv, scratch.q, scratch.attn, scratch.act, scratch.part,
        scratch.ml, scratch.bar, scratch.count, table, block_table, slot, cos, sin, seq_len,
        layers, eps,
        d**-0.5, h, hq, hkv, d, ff, block_size, scratch.splits, block_t, block_k,
        r_qkv, p2(r_qkv), r_h, p2(r_h), r_ff, p2(r_ff), interpreting(), fuse_b, merge_e,
        pre_kv, merge_c, skip, prefetch if gpu else 0, pre_w, late_r, early_res, row_sm,
        block_k_h, dot_attn,
    )  # fmt: skip
    usage = launch_resident(_layers_kernel, (programs,), args, num_warps, x.device, check)
    if info is not None:
        info["usage"] = usage
        if gpu:  # (the compiled kernel from the launch's cache)
            compiled = _layers_kernel.warmup(*args, grid=(programs,), num_warps=num_warps)
            info["ptx"] = compiled.asm.get("ptx", "")
            info["spills"] = int(getattr(compiled, "n_spills", 0) or 0)
    return x
