"""Triton fused sampling: greedy argmax or Gumbel-max draw per row, in one pass over the logits.

Each row of ``logits`` ``[N, V]`` yields one token id:

* greedy rows (``temperature <= 1e-5``): ``argmax_j logits[j]``, the lowest index on ties
  (as ``torch.argmax``);
* other rows: ``argmax_j (logits[j] / T + g_j)`` with ``g_j = -log(-log(u_j))`` standard Gumbel
  noise. By the Gumbel-max trick this is an exact draw from ``softmax(logits / T)`` (Gumbel 1954,
  "Statistical theory of extreme values"; Maddison, Tarlow, Minka, "A* Sampling", NeurIPS 2014).
  Tokens whose logit is ``-inf`` are never drawn (unless the whole row is ``-inf``: index 0).

The uniforms are counter-based: ``u_j`` is a pure function of ``(seed, offset, j)``, computed with
Philox-4x32-10 (Salmon, Moraes, Dror, Shaw, "Parallel random numbers: as easy as 1, 2, 3", SC 2011)
keyed by the 64-bit ``seed`` with counter ``(j // 4, offset_lo, offset_hi, 0)``: column ``j`` takes
output word ``j % 4`` (one Philox evaluation per 4 columns). The word's top 23 bits give
``u = (r + 0.5) * 2^-23``, in ``[2^-24, 1 - 2^-24]``, so the logs are finite.
A row's draw therefore depends only on its own logits, temperature, seed and offset, never on the
other rows of the batch, the row's position, the grid or the block sizes.
:func:`kernels.reference.sample_tokens_ref` computes the same uniforms in plain torch.

Work split: stage 1 gives every (row, vocabulary split) a program that sweeps its columns in
``BLOCK_V`` tiles, reading each logit once (bf16 is upcast in registers) and keeping an
element-wise running best (score, index); with one split it writes the token directly. With
several splits (small batches: one row alone cannot fill a GPU) each split writes its best
(score, index) to scratch and stage 2 reduces the splits of each row (max score, lowest index
on ties). No atomics: the result is deterministic. Imports only torch and triton.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.configs import num_sms

__all__ = ["sample_tokens", "choose_sampling_splits", "sampling_config", "GREEDY_TEMPERATURE"]

GREEDY_TEMPERATURE = 1e-5  # rows with temperature <= this are greedy (SamplingParams.greedy)


@triton.jit
def _scan_split(
    row_ptr,
    start,
    end,
    inv_t,
    seed,
    off_lo,
    off_hi,
    RANDOM: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """Best (score, index) of columns ``[start, end)`` of one row (``start < end``): the highest
    score, its lowest column on ties; a range of only -inf (or NaN) scores gives ``start``."""
    offs = tl.arange(0, BLOCK_V)
    best = tl.full([BLOCK_V], float("-inf"), dtype=tl.float32)
    best_i = tl.full([BLOCK_V], 0x7FFFFFFF, dtype=tl.int32)
    for base in range(start, end, BLOCK_V):
        cols = base + offs
        ok = cols < end
        x = tl.load(row_ptr + cols, mask=ok, other=float("-inf")).to(tl.float32)
        if RANDOM:
            # one Philox call gives 4 words: column j uses word j % 4 of counter j // 4
            c0 = (base // 4 + tl.arange(0, BLOCK_V // 4)).to(tl.uint32)
            zero = c0 * 0
            r0, r1, r2, r3 = tl.philox(seed, c0, zero + off_lo, zero + off_hi, zero)
            r = tl.interleave(tl.interleave(r0, r2), tl.interleave(r1, r3))
            u = ((r >> 9).to(tl.float32) + 0.5) * 1.1920928955078125e-07  # 2^-23
            x = x * inv_t - tl.log(-tl.log(u))
        x = tl.where(x == x, x, float("-inf"))  # NaN counts as -inf
        # strict: an element keeps its earliest column on ties; NaN never wins
        take = (x > best) | ((best_i == 0x7FFFFFFF) & ok)
        best = tl.where(take, x, best)
        best_i = tl.where(take, cols, best_i)
    m = tl.max(best, 0)
    idx = tl.min(tl.where(best == m, best_i, 0x7FFFFFFF), 0)
    return m, idx


@triton.jit
def _sample_split_kernel(
    logits_ptr,
    temp_ptr,
    seed_ptr,
    offset_ptr,
    out_ptr,
    pv_ptr,
    pi_ptr,
    vocab,
    split_len,
    stride_lr,
    stride_p,
    SPLIT: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0)
    split = tl.program_id(1)
    start = split * split_len
    end = tl.minimum(start + split_len, vocab)
    row_ptr = logits_ptr + row.to(tl.int64) * stride_lr
    temp = tl.load(temp_ptr + row)
    if temp <= 1e-5:
        m, idx = _scan_split(row_ptr, start, end, 1.0, 0, 0, 0, False, BLOCK_V)
    else:
        seed = tl.load(seed_ptr + row).to(tl.uint64, bitcast=True)
        off = tl.load(offset_ptr + row)
        off_lo = (off & 0xFFFFFFFF).to(tl.uint32)
        off_hi = ((off >> 32) & 0xFFFFFFFF).to(tl.uint32)
        m, idx = _scan_split(row_ptr, start, end, 1.0 / temp, seed, off_lo, off_hi, True, BLOCK_V)
    if SPLIT:
        tl.store(pv_ptr + row * stride_p + split, m)
        tl.store(pi_ptr + row * stride_p + split, idx)
    else:
        tl.store(out_ptr + row, idx.to(tl.int64))


@triton.jit
def _sample_reduce_kernel(
    out_ptr,
    pv_ptr,
    pi_ptr,
    num_splits,
    stride_p,
    BLOCK_S: tl.constexpr,
):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK_S)
    ok = offs < num_splits
    v = tl.load(pv_ptr + row * stride_p + offs, mask=ok, other=float("-inf"))
    i = tl.load(pi_ptr + row * stride_p + offs, mask=ok, other=0x7FFFFFFF)
    m = tl.max(v, 0)
    idx = tl.min(tl.where(v == m, i, 0x7FFFFFFF), 0)
    tl.store(out_ptr + row, idx.to(tl.int64))


def sampling_config(device: torch.device) -> dict:
    """Tile configuration ``{BLOCK_V, num_warps}`` of stage 1 (host-side, static).

    On CPU (the Triton interpreter) a wide tile amortises the interpreter's per-op cost.
    """
    if device.type != "cuda":
        return {"BLOCK_V": 8192, "num_warps": 4}
    return {"BLOCK_V": 2048, "num_warps": 8}


def choose_sampling_splits(
    num_rows: int,
    vocab: int,
    num_sms: int,
    *,
    block_v: int = 2048,
    programs_per_sm: int = 2,
    min_tiles_per_split: int = 4,
    max_splits: int = 128,
) -> int:
    """Number of vocabulary splits per row for :func:`sample_tokens` (host-side, no device access).

    The smallest split count giving ``programs_per_sm * num_sms`` stage-1 programs, capped so
    that every split keeps at least ``min_tiles_per_split`` tiles of ``block_v`` columns.

    Returns:
        An int in ``[1, max_splits]``.

    Raises:
        ValueError: on a negative size or ``num_sms < 1`` / ``block_v < 1``.
    """
    if num_rows < 0 or vocab < 0 or num_sms < 1 or block_v < 1:
        raise ValueError("choose_sampling_splits: invalid arguments")
    want = triton.cdiv(programs_per_sm * num_sms, max(1, num_rows))
    cap = max(1, vocab // (block_v * max(1, min_tiles_per_split)))
    return int(max(1, min(want, cap, max_splits)))


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # interpreter: a few splits still exercise the reduction
    return num_sms(device)


def sample_tokens(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    seeds: torch.Tensor,
    offsets: torch.Tensor,
    out: torch.Tensor,
    *,
    num_splits: int | None = None,
    config: dict | None = None,
) -> torch.Tensor:
    """One token per row: greedy argmax or a Gumbel-max draw from ``softmax(logits / T)`` (Triton).

    Launches its kernels on the current stream and returns without any host synchronisation.

    Args:
        logits: float32 or bfloat16 ``[N, V]``, last dim contiguous (row stride arbitrary);
            ``-inf`` entries are never drawn; read only.
        temperature: float32 ``[N]``; rows with ``temperature <= 1e-5`` are greedy.
        seeds: int64 ``[N]``, the Philox key of each row (any 64-bit pattern).
        offsets: int64 ``[N]``, the Philox counter of each row (e.g. the index of the output token).
        out: int64 ``[N]``, written in place and returned.
        num_splits: vocabulary splits per row (host int >= 1); None picks
            :func:`choose_sampling_splits`. The result does not depend on it.
        config: optional ``{BLOCK_V, num_warps}`` override (``BLOCK_V`` a power of two >= 16).

    Returns:
        ``out``.

    Raises:
        ValueError: on wrong dims, shapes, dtypes, devices, a non-contiguous last dim,
            ``V == 0`` or ``V >= 2**31``, or a bad ``num_splits`` / ``BLOCK_V``.

    Algorithm: Gumbel-max trick (Gumbel 1954; Maddison et al. 2014) with Philox-4x32-10 uniforms
    (Salmon et al. 2011); split-vocabulary argmax with an atomic-free second reduction stage.
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must be [N, V], got {tuple(logits.shape)}")
    n, vocab = logits.shape
    if logits.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"logits must be float32 or bfloat16, got {logits.dtype}")
    if vocab == 0 or vocab >= 2**31 - 1:
        raise ValueError(f"vocabulary size must be in [1, 2**31 - 1), got {vocab}")
    if logits.stride(1) != 1 and vocab > 1:
        raise ValueError("logits' last dimension must be contiguous")
    for name, t, dtype in (
        ("temperature", temperature, torch.float32),
        ("seeds", seeds, torch.int64),
        ("offsets", offsets, torch.int64),
        ("out", out, torch.int64),
    ):
        if t.shape != (n,) or t.dtype != dtype:
            raise ValueError(f"{name} must be {dtype} [N={n}], got {t.dtype} {tuple(t.shape)}")
        if t.device != logits.device:
            raise ValueError(f"{name} must be on logits' device {logits.device}, got {t.device}")
    if any(t.stride(0) != 1 for t in (temperature, seeds, offsets, out)) and n > 1:
        raise ValueError("temperature, seeds, offsets and out must be contiguous")
    cfg = dict(sampling_config(logits.device))
    if config:
        cfg.update(config)
    block_v = cfg["BLOCK_V"]
    if block_v < 16 or block_v & (block_v - 1):
        raise ValueError(f"BLOCK_V must be a power of two >= 16, got {block_v}")
    if num_splits is None:
        num_splits = choose_sampling_splits(n, vocab, _num_sms(logits.device), block_v=block_v)
    if not isinstance(num_splits, int) or num_splits < 1:
        raise ValueError(f"num_splits must be an int >= 1, got {num_splits!r}")
    if n == 0:
        return out
    # split boundaries on tile multiples; trailing splits may be empty (they report -inf)
    split_len = triton.cdiv(triton.cdiv(vocab, num_splits), block_v) * block_v
    num_splits = triton.cdiv(vocab, split_len)
    split = num_splits > 1
    if split:
        pv = torch.empty(n, num_splits, dtype=torch.float32, device=logits.device)
        pi = torch.empty(n, num_splits, dtype=torch.int32, device=logits.device)
    else:
        pv = pi = out  # unused
    _sample_split_kernel[(n, num_splits)](
        logits,
        temperature,
        seeds,
        offsets,
        out,
        pv,
        pi,
        vocab,
        split_len,
        logits.stride(0),
        num_splits,
        SPLIT=split,
        BLOCK_V=block_v,
        num_warps=cfg["num_warps"],
    )
    if split:
        _sample_reduce_kernel[(n,)](
            out,
            pv,
            pi,
            num_splits,
            num_splits,
            BLOCK_S=max(16, triton.next_power_of_2(num_splits)),
            num_warps=1,
        )
    return out
